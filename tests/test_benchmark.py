"""Chapter 6, benchmark_scaling.py, under real torchrun launches on CPU/gloo. These tests prove:

1. weak scaling at 1 and 2 processes: the numbers come from each run's `summary` line, speedup and
   efficiency follow from them exactly, the trainer's own flags reach it (plus `--save ''` and the device),
   and the table, the ASCII chart, the JSON file and the SVG picture all show the same runs. The trainer
   here is a stand-in whose pace is known (10 ms per step, 25% more per added process), so the arithmetic
   is checked to the digit; the real trainers' summaries go through the same reader in
   test_the_real_trainers_summaries_are_what_the_benchmark_reads;
2. strong scaling splits the global batch evenly over the processes, and refuses a batch that does not split;
3. --collectives checks that all_reduce and broadcast give the right values at every size and reports
   nccl-tests' algorithm and bus bandwidths (busbw = algbw x 2(N-1)/N for all-reduce, x 1 for broadcast);
4. more processes than this machine has cores, or a trainer that fails, end in one error line and exit
   code 2, with the trainer's own last lines shown;
5. bad input ends in one line and exit code 2 before any run: a --timeout beyond a week (beyond 24.8
   days Python's wait crashed), a --max-bytes beyond this machine's memory, a --json or --svg whose
   file cannot be made (under a file, in /proc, empty: checked by making it, as root ignores
   permissions); a missing folder is made, as the trainers' --save makes theirs.
"""
import json
import os
import sys
import xml.etree.ElementTree as ET

import pytest

from helpers import REPO, as_script, classifier_runs, command, demo_run, finish, run, start, summary

sys.path.insert(0, str(REPO))
import benchmark_scaling as bench  # noqa: E402  (imports no torch at module level)

BENCH = "benchmark_scaling.py"
STAND_IN = """import json, os, sys
world, rank, flags = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), sys.argv[1:]
batch = int(flags[flags.index("--batch-size") + 1]) if "--batch-size" in flags else 64
step_ms, per_step = 10.0 * (1 + 0.25 * (world - 1)), batch * world
if rank == 0:
    json.dump(flags, open(f"flags{world}.json", "w"))
    print("summary " + json.dumps({"step_ms": step_ms, "per_step": per_step, "throughput_unit": "samples/s",
                                   "throughput": per_step / step_ms * 1000}))
"""


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The three launches of this module, side by side: {name: (CompletedProcess, folder)}."""
    d = tmp_path_factory.mktemp("bench")
    (d / "stand_in.py").write_text(STAND_IN)
    (d / "broken_trainer.py").write_text("import sys\nprint('loading the data')\n"
                                         "sys.exit('error: no such dataset: imagenet-99')\n")
    args = {"weak": ["--device", "cpu", "--nproc", 1, 2, "--trainer", d / "stand_in.py", "--json", d / "s.json",
                     "--svg", d / "s.svg", "--", "--epochs", "1"],
            "collectives": ["--device", "cpu", "--collectives", "--nproc", 2, "--max-bytes", "16K", "--iters", 3,
                            "--warmup", 1, "--json", d / "c.json"],
            "broken": ["--device", "cpu", "--nproc", 1, 2, "--trainer", d / "broken_trainer.py"]}
    started = {name: (start(command(BENCH, a), d), command(BENCH, a)) for name, a in args.items()}
    return {name: (finish(proc, cmd), d) for name, (proc, cmd) in started.items()}


def test_weak_scaling_table_chart_json_and_svg_agree(launched):
    result, tmp_path = launched["weak"]
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["mode"] == "weak scaling" and data["hardware"].endswith("CPU, gloo")
    one, two = data["runs"]
    assert (one["nproc"], one["per_step"], one["step_ms"], one["throughput"]) == (1, 64, 10.0, 6400.0)
    assert (two["nproc"], two["per_step"], two["step_ms"], two["throughput"]) == (2, 128, 12.5, 10240.0)
    assert (one["speedup"], one["efficiency"], two["speedup"], two["efficiency"]) == (1.0, 1.0, 1.6, 0.8)
    for world in (1, 2):  # the user's flags after --, then no checkpoint and the device
        assert json.loads((tmp_path / f"flags{world}.json").read_text()) == ["--epochs", "1", "--save", "",
                                                                              "--device", "cpu"]
    table_rows = [line.split("|") for line in result.stdout.splitlines() if line.strip().startswith(("1 |", "2 |"))]
    assert [int(row[0]) for row in table_rows] == [1, 2, 1, 2]  # two table rows, two chart bars
    assert [c.strip() for c in table_rows[1][1:6]] == ["128", "12.5", "10,240", "1.60x", "80%"]
    assert table_rows[2][1].count("#") == 25 and table_rows[3][1].count("#") == 40  # bars to scale: 6,400 : 10,240
    assert table_rows[3][1].count(".") == 10  # and what linear scaling (12,800) would add
    svg = ET.parse(tmp_path / "s.svg").getroot()  # well-formed XML
    bars = [e for e in svg.iter("{http://www.w3.org/2000/svg}rect") if e.get("fill") == "#3b73b9"]
    assert len(bars) == 2 and float(bars[1].get("height")) / float(bars[0].get("height")) == pytest.approx(1.6, rel=1e-3)
    assert "10,240 (1.60x, 80%)" in (tmp_path / "s.svg").read_text()


def test_the_real_trainers_summaries_are_what_the_benchmark_reads():
    """The summaries of real runs (2 processes, batch 16 each; the README demo) make benchmark rows."""
    for stdout, per_step in ((classifier_runs()["d2"].stdout, 32), (demo_run()[0].stdout, 128)):
        row = bench.pace_row(summary(stdout), 2, 0.0)
        assert row["per_step"] == per_step and row["unit"] == "samples/s" and row["step_ms"] > 0
        assert row["throughput"] == pytest.approx(per_step / (row["step_ms"] / 1000), rel=0.01)
    with pytest.raises(KeyError):
        bench.pace_row({"val_loss": 1.0}, 1, 0.0)  # an older trainer without the pace keys


def test_strong_scaling_splits_the_global_batch_and_refuses_uneven_splits():
    assert bench.trainer_args(["--epochs", "1"], 4, 256, "cpu")[-2:] == ["--batch-size", "64"]
    assert bench.trainer_args([], 1, 256, "cpu")[-2:] == ["--batch-size", "256"]
    assert ["--save", ""] == bench.trainer_args([], 2, None, "cpu")[:2]  # never overwrites a user's checkpoint
    with pytest.raises(bench.InputError, match="does not split evenly over 3 processes"):
        bench.trainer_args([], 3, 256, "cpu")
    with pytest.raises(bench.InputError, match="not as the trainer's --batch-size"):
        bench.trainer_args(["--batch-size", "8"], 2, 256, "cpu")


def test_collectives_report_correct_results_and_nccl_tests_bandwidths(launched):
    result, tmp_path = launched["collectives"]
    assert result.returncode == 0, result.stdout + result.stderr
    (report,) = json.loads((tmp_path / "c.json").read_text())["collectives"]
    rows = report["rows"]
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert [(r["op"], r["bytes"]) for r in rows] == [("all_reduce", 1024), ("all_reduce", 4096), ("all_reduce", 16384),
                                                     ("broadcast", 1024), ("broadcast", 4096), ("broadcast", 16384),
                                                     ("barrier", 0)]
    for r in rows:
        assert r["wrong"] == 0 and r["time_us"] > 0
        if r["op"] != "barrier":
            assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=0.01)
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"], rel=0.01)  # 2(N-1)/N = 1 at N = 2
    assert "all_reduce |    16 KiB |" in result.stdout
    assert bench.BUSBW_FACTOR["all_reduce"](8) == 1.75 and bench.BUSBW_FACTOR["broadcast"](8) == 1


def test_too_many_processes_bad_sizes_and_unwritable_outputs_exit_2_with_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    for args, message in [(["--device", "cpu", "--nproc", 1, 4096], "--nproc 4096: this machine has"),
                          (["--device", "cpu", "--json", tmp_path / "a_file" / "out.json"], "cannot write"),
                          (["--device", "cpu", "--svg", tmp_path], "cannot write"),
                          (["--collectives", "--max-bytes", "12X"], "not a size like 64K"),
                          (["--collectives", "--", "--epochs", "1"], "--collectives runs no trainer"),
                          (["--collectives", "--svg", tmp_path / "c.svg"], "draws no chart")]:
        result = run(BENCH, args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_a_timeout_beyond_a_week_a_size_beyond_memory_and_an_unwritable_output_exit_2(tmp_path):
    """Refused at parse time or before any run, in one line each: a --timeout Python's wait cannot
    take, a --max-bytes no rank here could allocate, and a --json whose file cannot be made even by
    root (under a file, in /proc, empty). The controls: the largest accepted values parse, and a
    missing folder is made, as every trainer's --save makes its own, with no probe file left."""
    (tmp_path / "a_file").write_text("")
    memory_k = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 1024
    week = "--timeout must be between 1 and 604800 seconds (a week), got "
    for args, line in [
            (["--timeout", 604801], week + "604801"),
            (["--timeout", 10 ** 30], week + str(10 ** 30)),
            (["--collectives", "--max-bytes", f"{memory_k + 1}K"],
             f"must be at most this machine's memory, {bench.human_bytes(memory_k * 1024)}, got"),
            (["--json", tmp_path / "a_file" / "out.json"],
             f"{tmp_path / 'a_file'} is a file, not a folder"),
            (["--json", "/proc/out.json"], "cannot write /proc/out.json: no new file in /proc ("),
            (["--json", ""], "cannot write '': the path is empty")]:
        result = as_script(BENCH, ["--device", "cpu", "--nproc", 4096, *args])  # no run, if missed
        assert result.returncode == 2 and line in result.stderr, (args, result.stderr)
        assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert bench.parse_args(["--timeout", "604800"]).timeout == 604800
    assert bench.byte_size(f"{memory_k}K") == memory_k * 1024
    made = tmp_path / "new" / "folder"
    result = as_script(BENCH, ["--device", "cpu", "--nproc", 1, 4096, "--json", made / "out.json"])
    assert result.returncode == 2 and "--nproc 4096" in result.stderr  # past the check, refused
    assert made.is_dir() and not list(made.iterdir())


def test_a_failing_trainer_exits_2_and_shows_its_own_last_lines(launched):
    result, _ = launched["broken"]
    assert result.returncode == 2, result.stderr
    first, *shown = result.stderr.strip().splitlines()
    assert first == "error: broken_trainer.py failed at 1 process(es): exit code 1; its last lines:"
    assert any("error: no such dataset: imagenet-99" in line for line in shown), result.stderr
    assert "running broken_trainer.py on 2" not in result.stdout  # stopped at the first failure
