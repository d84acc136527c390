"""Chapter 6, benchmark_scaling.py, under real torchrun launches on CPU/gloo. These tests prove:

1. weak scaling at 1 and 2 processes: each run's numbers come from the trainer's own `summary` line (global
   batch 64 then 128), speedup and efficiency follow from them, and the table, the ASCII chart, the JSON file
   and the SVG picture all show the same runs;
2. strong scaling splits the global batch evenly over the processes, and refuses a batch that does not split;
3. --collectives checks that all_reduce and broadcast give the right values at every size and reports
   nccl-tests' algorithm and bus bandwidths (busbw = algbw x 2(N-1)/N for all-reduce, x 1 for broadcast);
4. more processes than this machine has cores, or a trainer that fails, end in one error line and exit
   code 2, with the trainer's own last lines shown.
"""
import json
import sys
import xml.etree.ElementTree as ET

import pytest

from conftest import REPO, command, finish, run, start

sys.path.insert(0, str(REPO))
import benchmark_scaling as bench  # noqa: E402  (imports no torch at module level)

BENCH = "benchmark_scaling.py"
SMALL = ["--epochs", 1, "--train-samples", 768, "--val-samples", 32]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The three launches of this module: {name: (CompletedProcess, folder)}. The failing trainer's launch
    (one process) runs beside the weak-scaling one's first run (one process), the collectives after them."""
    d = tmp_path_factory.mktemp("bench")
    (d / "broken_trainer.py").write_text("import sys\nprint('loading the data')\n"
                                         "sys.exit('error: no such dataset: imagenet-99')\n")
    args = {"weak": ["--device", "cpu", "--nproc", 1, 2, "--json", d / "s.json", "--svg", d / "s.svg", "--", *SMALL],
            "collectives": ["--device", "cpu", "--collectives", "--nproc", 2, "--max-bytes", "16K", "--iters", 3,
                            "--warmup", 1, "--json", d / "c.json"],
            "broken": ["--device", "cpu", "--nproc", 1, 2, "--trainer", d / "broken_trainer.py"]}
    broken = start(command(BENCH, args["broken"]), d)
    weak = run(BENCH, args["weak"], cwd=d)
    return {"weak": (weak, d), "broken": (finish(broken, command(BENCH, args["broken"])), d),
            "collectives": (run(BENCH, args["collectives"], cwd=d), d)}


def test_weak_scaling_table_chart_json_and_svg_agree(launched):
    result, tmp_path = launched["weak"]
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["mode"] == "weak scaling" and data["hardware"].endswith("CPU, gloo")
    one, two = data["runs"]
    assert (one["nproc"], one["per_step"], two["nproc"], two["per_step"]) == (1, 64, 2, 128)
    for r in (one, two):  # throughput is the global batch over the median step time the trainer measured
        assert r["throughput"] == pytest.approx(r["per_step"] / (r["step_ms"] / 1000), rel=0.01)
        assert r["unit"] == "samples/s"
    assert one["speedup"] == 1 and two["speedup"] == pytest.approx(two["throughput"] / one["throughput"], abs=1e-3)
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2, abs=1e-3)
    table_rows = [line.split("|") for line in result.stdout.splitlines() if line.strip().startswith(("1 |", "2 |"))]
    assert [int(row[0]) for row in table_rows] == [1, 2, 1, 2]  # two table rows, two chart bars
    assert table_rows[1][3].strip() == f"{two['throughput']:,.0f}"
    assert "'#' measured" in result.stdout and "#" * 10 in result.stdout
    svg = ET.parse(tmp_path / "s.svg").getroot()  # well-formed XML
    bars = [e for e in svg.iter("{http://www.w3.org/2000/svg}rect") if e.get("fill") == "#3b73b9"]
    assert len(bars) == 2 and float(bars[1].get("height")) > 0
    assert f"{two['throughput']:,.0f}" in (tmp_path / "s.svg").read_text()


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


def test_too_many_processes_and_bad_sizes_exit_2_with_one_line():
    for args, message in [(["--device", "cpu", "--nproc", 1, 4096], "--nproc 4096: this machine has"),
                          (["--collectives", "--max-bytes", "12X"], "not a size like 64K"),
                          (["--collectives", "--", "--epochs", "1"], "--collectives runs no trainer")]:
        result = run(BENCH, args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_a_failing_trainer_exits_2_and_shows_its_own_last_lines(launched):
    result, _ = launched["broken"]
    assert result.returncode == 2, result.stderr
    first, *shown = result.stderr.strip().splitlines()
    assert first == "error: broken_trainer.py failed at 1 process(es): exit code 1; its last lines:"
    assert any("error: no such dataset: imagenet-99" in line for line in shown), result.stderr
    assert "running broken_trainer.py on 2" not in result.stdout  # stopped at the first failure
