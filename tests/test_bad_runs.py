"""Chapter 5, a run that goes wrong loses nothing: every trainer under real torchrun launches at 2
processes on CPU/gloo (and in process for what needs no launch). These tests prove:

1. a step whose gradient norm or loss is not finite (forced by a learning rate far too high) is not
   applied: every rank stops at that same step with the same one-line error, torchrun reports exit
   code 4, and the good checkpoint already at --save stays byte for byte what it was;
2. a save that fails (the disk fills up: a --save that names a folder is refused at start-up,
   test_classifier_inputs.py and test_minigpt_inputs.py) stops every rank with one line
   naming the path and the reason and exit code 5, no rank waits at the save, the previous
   checkpoint is intact, finite and loads, and no temporary file is left behind; a full disk is
   named in the user's words (the disk holding the folder, MB free, MB a checkpoint needs) in
   every trainer, on a real 64 KiB tmpfs where root can mount one (torch's words are no errno);
3. --resume of a checkpoint holding non-finite weights is refused in one line (exit code 2), and a
   checkpoint is never written from non-finite weights;
4. the `summary` line is strict JSON whatever the values: NaN and infinity are written as null;
5. chapters 7-12 refuse every bad input of the hostile-input sweep in one line with exit code 2,
   in process: each number that is not finite or out of range at parse time (--temperature, --lr,
   --min-lr, --clip, --weight-decay, --gpu-peak-tflops, --dist-timeout NaN, inf, 1e20 and 1e-6,
   --seed below 0 or past 2**63 - 1, --dropout and --val-fraction NaN, an unknown
   --compile-backend; the edges parse and the largest seed builds weights); a run.json without
   step, args or rng, with a step that is no integer of 0 or more, or an rng whose entries are
   not the byte lists restore_rng reads (the control: the whole run.json reads); --sample of
   weights whose config does not fit them (another width, no n_head, heads that do not divide
   the width; the control: their own config samples).
6. in every GPT chapter a .bin id equal to --vocab-size is refused in one line, and MFU counts
   the peak of every GPU of the job (a GPU faked); in chapters 8-11 the data check asks for a
   batch per replica, not per rank (the control: 4 replicas are refused).
A write that fails half-way (the partial file removed) is in test_faults.py.
"""
import json
import math
import os
import re
import subprocess
import types
import zlib

import numpy as np
import pytest
import torch
from helpers import as_script
from helpers import (DDP, GPT, NEEDS_PP, SINGLE, SMALL, TINY_GPT, command, in_process,
                     needs_torch, started, trainer)

PROBE, CLASSIFIER_PROBE = "tests/probe_minigpt.py", "tests/probe_classifier.py"


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def stopped_on_every_rank(result, code, message):
    """Both ranks wrote the same one-line error matching `message`; torchrun reports `code`."""
    assert result.returncode != 0, result.stdout
    assert f"exitcode  : {code}" in result.stderr, result.stderr[-3000:]
    lines = error_lines(result.stderr)
    assert len(lines) == 2 and lines[0] == lines[1], lines  # the same verdict, the same step
    assert re.search(message, lines[0]), lines[0]
    assert not re.search(r'File ".*(train_|probe_)\w+\.py"', result.stderr)  # no traceback from us
    return lines[0]


def only_the_checkpoint(folder, name):
    assert sorted(p.name for p in folder.iterdir()) == [name]  # no temporary file left behind


@pytest.fixture(scope="module", autouse=True)
def starting(tmp_path_factory):
    """The module's four 2-process launches, started side by side as the module starts (the tests
    that read them come last: the in-process tests run meanwhile). The classifier and the LM
    resumed with a learning rate far too high, the LM whose disk fills up at its 2nd save (a
    probe), and the classifier whose disk is full at its save (a probe)."""
    d = {name: tmp_path_factory.mktemp(name) for name in ("classifier", "lm", "disk", "full")}
    in_process(SINGLE, SMALL + ["--epochs", 1, "--save", d["classifier"] / "ck.pt"])  # both formats
    in_process(GPT, TINY_GPT + ["--max-steps", 4, "--save", d["lm"] / "ck.pt"])
    launches = {
        "classifier": (DDP, SMALL + ["--lr", "1e20", "--epochs", 2, "--save-every", 1, "--save",
                                     d["classifier"] / "ck.pt"]),
        "lm": (GPT, TINY_GPT + ["--max-steps", 8, "--save-every", 1, "--save", d["lm"] / "ck.pt",
                                "--resume", "auto", "--lr", "1e4"]),
        "disk": (PROBE, ["nospace", 2, *TINY_GPT, "--max-steps", 6, "--save-every", 2,
                         "--save", d["disk"] / "ck.pt"]),  # the 1st save works, the 2nd cannot
        "full": (CLASSIFIER_PROBE, ["nospace", 1, *SMALL, "--epochs", 1, "--save", "ck.pt"])}
    before = {name: (d[name] / "ck.pt").read_bytes() for name in ("classifier", "lm")}
    wait = started({name: (command(script, args, nproc=2), d[name], None)
                    for name, (script, args) in launches.items()})
    yield lambda: {name: (result, d[name], before.get(name)) for name, result in wait().items()}
    wait()  # never leave one running


@pytest.fixture(scope="module")
def launched(starting):
    """{name: (CompletedProcess, its folder, the checkpoint's bytes before it started)}."""
    return starting()


def full_disk(folder):
    """The words of a save that found the disk holding `folder` (or a folder in it) full: a regex."""
    return (rf"the disk holding {re.escape(str(folder))}\S* is full: \d+\.\d [kM]B free, a checkpoint "
            r"needs about \d+\.\d [kM]B \(")


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of 64 KiB, too small for any checkpoint here (a tmpfs: root mounts it)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a real full disk needs a tmpfs mounted by root: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("script,args", [
    (SINGLE, SMALL + ["--epochs", 1]), (DDP, SMALL + ["--epochs", 1]),
    (GPT, TINY_GPT + ["--max-steps", 1]),
    ("train_fsdp_minigpt.py", TINY_GPT + ["--max-steps", 1, "--export", ""]),
    ("train_tp_minigpt.py", TINY_GPT + ["--max-steps", 1, "--tp", 1, "--export", ""]),
    pytest.param("train_pp_minigpt.py", TINY_GPT + ["--max-steps", 1, "--pp", 1, "--export", ""],
                 marks=needs_torch(*NEEDS_PP))])
def test_a_real_full_disk_is_named_in_the_users_words(script, args, small_disk):
    save = small_disk / ("ck" if script in ("train_fsdp_minigpt.py", "train_tp_minigpt.py",
                                            "train_pp_minigpt.py") else "ck.pt")
    with pytest.raises(trainer(script).SaveFailed) as err:
        in_process(script, args + ["--save", save])
    message = str(err.value)
    assert re.match(rf"cannot save {re.escape(str(save))}\S*: {full_disk(small_disk)}", message)
    assert "\n" not in message and err.value.code == 5
    assert not [p for p in small_disk.rglob("*") if p.is_file()]  # nothing half-written is left


def test_chapter_1_reports_a_failed_save_in_one_line(tmp_path, monkeypatch):
    """A folder made at --save once the run started (one there at the start is refused then)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck.pt").mkdir()
    module, model = trainer(SINGLE), torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(module.SaveFailed) as err:
        module.save_once("ck.pt", model, optimizer, 1, module.parse_args([]), True)
    assert str(err.value) == "cannot save ck.pt: Is a directory" and err.value.code == 5


def poisoned(path, key):
    """A copy of the checkpoint at `path` with one weight set to NaN."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    state["model"][key].view(-1)[0] = float("nan")
    bad = path.with_name("nan.pt")
    torch.save(state, bad)
    return bad


def test_the_lm_refuses_to_resume_from_non_finite_weights(tmp_path):
    good = tmp_path / "ck.pt"
    in_process(GPT, TINY_GPT + ["--max-steps", 2, "--save", good])
    bad = poisoned(good, "tok_emb.weight")
    with pytest.raises(trainer(GPT).InputError) as err:
        in_process(GPT, TINY_GPT + ["--max-steps", 4, "--resume", bad, "--save", ""])
    assert str(err.value) == f"{bad} holds weights that are not finite: use an earlier checkpoint"
    assert err.value.code == 2
    with pytest.raises(trainer(GPT).InputError, match="holds weights that are not finite"):
        in_process(GPT, ["--sample", "--ckpt", bad, "--device", "cpu"])


@pytest.mark.parametrize("script", [SINGLE, DDP])
def test_the_classifiers_refuse_to_resume_from_non_finite_weights(script, tmp_path):
    good = tmp_path / "ck.pt"
    in_process(SINGLE, SMALL + ["--epochs", 1, "--save", good])
    bad = poisoned(good, "0.weight")
    with pytest.raises(trainer(script).InputError, match="holds weights that are not finite"):
        in_process(script, SMALL + ["--epochs", 2, "--resume", bad])


@pytest.mark.parametrize("script", [SINGLE, DDP, GPT])
def test_no_checkpoint_is_written_from_non_finite_weights(script, tmp_path):
    module, path = trainer(script), tmp_path / "ck.pt"
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(module.SaveFailed, match="the weights are not finite"):
        if script == GPT:  # the state rank 0 would write: refused before any file is opened
            args = module.parse_args(["--save", str(path)])
            run = module.Run(args, torch.device("cpu"), 0, 1, True, "off", None,
                             torch.amp.GradScaler("cpu", enabled=False))
            module.checkpoint_state(run, model, optimizer, module.Data(None, None, 256, None, 0),
                                    3, [])
        else:
            module.save_checkpoint(str(path), model, optimizer, 3, module.parse_args([]))
    assert not path.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("script", [SINGLE, DDP, GPT])
def test_the_summary_line_is_strict_json_whatever_the_values(script):
    line = trainer(script).summary_line({"val_loss": math.nan, "throughput": math.inf, "steps": 3,
                                         "train_s": 1.5})
    assert line.startswith("summary ")
    parsed = json.loads(line[len("summary "):], parse_constant=pytest.fail)  # NaN literals fail
    assert parsed == {"val_loss": None, "throughput": None, "steps": 3, "train_s": 1.5}


# ------------------------------- chapters 7-12: numbers, run.json and --sample's file, in process

SHARDED_TRAINERS = ["train_fsdp_minigpt.py", "train_tp_minigpt.py", "train_pp_minigpt.py",
                    "train_cp_minigpt.py", "train_4d_minigpt.py", "train_moe_minigpt.py"]
TOP = 2**63 - 1  # the largest seed: torch.manual_seed's range from 0
BAD_NUMBERS = [  # (flags, what the one line says after "error: "), as the sweep gave them
    (["--temperature", "nan"], "argument --temperature: must be a finite number, positive, "
                               "got nan"),
    (["--lr", "nan"], "argument --lr: must be a finite number, positive, got nan"),
    (["--lr", "inf"], "argument --lr: must be a finite number, positive, got inf"),
    (["--min-lr", "nan"], "argument --min-lr: must be a finite number, at least 0, got nan"),
    (["--clip", "inf"], "argument --clip: must be a finite number, at least 0, got inf"),
    (["--weight-decay", "nan"], "argument --weight-decay: must be a finite number, at least 0, "
                                "got nan"),
    (["--gpu-peak-tflops", "inf"], "argument --gpu-peak-tflops: must be a finite number, "
                                   "positive, got inf"),
    (["--dist-timeout", "nan"], "argument --dist-timeout: must be a finite number, positive, "
                                "got nan"),
    (["--dist-timeout", "inf"], "argument --dist-timeout: must be a finite number, positive, "
                                "got inf"),
    (["--dist-timeout", "1e20"], "argument --dist-timeout: must be at most 604800, got 1e20"),
    (["--dist-timeout", "1e-6"], "--dist-timeout must be between 1 and 604800 seconds (a week), "
                                 "got 1e-06"),
    (["--seed", "-1"], f"--seed must be between 0 and {TOP}, got -1"),
    (["--seed", str(TOP + 1)], f"--seed must be between 0 and {TOP}, got {TOP + 1}"),
    (["--compile-backend", "inductr"], "argument --compile-backend: invalid choice: 'inductr'"),
    (["--dropout", "nan"], "--dropout must be in [0, 1) and --val-fraction in (0, 1)"),
    (["--val-fraction", "nan"], "--dropout must be in [0, 1) and --val-fraction in (0, 1)")]
EDGES = ["--seed", str(TOP), "--dist-timeout", "604800", "--temperature", "1e-3", "--clip", "0",
         "--min-lr", "0", "--weight-decay", "0", "--compile-backend", "aot_eager"]  # all accepted


@pytest.mark.parametrize("script", SHARDED_TRAINERS)
def test_every_number_is_finite_and_in_range_at_parse_time(script, capsys):
    """Each bad number of the sweep is one line and exit code 2 at parse time, before any step;
    the controls: the edges of every range parse, --dist-timeout 1 too, and the largest seed
    builds weights (a seed past 32 bits is folded into torch's 64, and one below is unchanged)."""
    module = trainer(script)
    for flags, words in BAD_NUMBERS:
        with pytest.raises(SystemExit) as exit_:
            module.parse_args(flags)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and f": error: {words}" in err, err
    args = module.parse_args(EDGES)
    assert (args.seed, args.dist_timeout) == (TOP, 604800)
    assert module.parse_args(["--dist-timeout", "1"]).dist_timeout == 1
    name, crc = "blocks.0.attn.qkv.weight", zlib.crc32(b"blocks.0.attn.qkv.weight")
    assert torch.isfinite(module.initial_value(name, (4, 4), TOP, 2)).all()
    before = torch.randn(4, 4, generator=torch.Generator().manual_seed(3 * 2**32 + crc)) * 0.02
    assert torch.equal(module.initial_value(name, (4, 4), 3, 2), before)


def step_folder(folder, state):
    """A step folder that read_run_state takes as complete (a .metadata beside it), holding
    `state` as its run.json; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".metadata").write_bytes(b"")
    (folder / "run.json").write_text(json.dumps(state))
    return str(folder)


@pytest.mark.parametrize("script", SHARDED_TRAINERS)
def test_each_sharded_trainer_finds_keeps_and_refuses_step_folders_by_one_rule(script, tmp_path,
                                                                               monkeypatch):
    """The rules of the step folders, in each trainer's own copy (a twin's slip fails its own
    case): only step-N and partial-step-N folders are the trainer's, numbered as numbers (step
    1,000,000 after 999,000); a user's step-000005.keep copy and step-000007.tar file are neither
    read nor removed; a partial folder that holds all a step holds is not resumed; a removal
    killed as it starts leaves no complete step; a step saved again replaces the old. A run resumed from a step of --save goes on only
    with that step's seed; a fresh run, or one resumed from elsewhere, is refused a --save that
    holds steps (the control: the step's own run goes on, its folder named "DIR/step-N/", by a
    link to DIR, or from within DIR)."""
    module, ck = trainer(script), tmp_path / "ck"

    def step(name, whole=True, seed=1, folder=ck):
        (folder / name).mkdir(parents=True)
        (folder / name / "__0_0.distcp").write_bytes(b"a shard")
        if whole:
            (folder / name / ".metadata").write_bytes(b"its index")
            (folder / name / "run.json").write_text(json.dumps({"args": {"seed": seed}}))
        return folder / name
    for name in ("step-999000", "step-1000000", "step-000005.keep", "partial-step-2000000"):
        step(name)
    step("step-3000000", whole=False)  # a save killed before its .metadata
    (ck / "step-000007.tar").write_bytes(b"a user's archive")
    newest = module.newest_complete_step(str(ck), False)
    assert newest == str(ck / "step-1000000")
    module.drop_older_steps(str(ck), newest)
    assert sorted(os.listdir(ck)) == ["step-000005.keep", "step-000007.tar", "step-1000000",
                                      "step-3000000"]
    run = types.SimpleNamespace(args=types.SimpleNamespace(max_steps=10))
    with pytest.raises(module.InputError, match="a partial-step-N folder is a save cut short"):
        module.read_run_state(str(step("partial-step-000009")), run, None)
    doomed = step("step-000001")
    with monkeypatch.context() as patch:  # the kill, as the removal of the folder's files starts
        patch.setattr(module.shutil, "rmtree", lambda *a, **k: (_ for _ in ()).throw(SystemExit))
        with pytest.raises(SystemExit):
            module.remove_step(str(doomed))
    assert os.listdir(doomed) and not module.complete(str(doomed))
    again = step("partial-step-000011", seed=3)  # a run gone back saves a step it saved before
    module.rename_step(str(again), str(step("step-000011")))
    assert json.loads((ck / "step-000011" / "run.json").read_text())["args"]["seed"] == 3

    def check(path, seed, save=ck, saved_by=1):
        args = types.SimpleNamespace(benchmark=False, save=str(save), seed=seed, export="")
        module.check_save_folder(types.SimpleNamespace(args=args), path and str(path),
                                 path and {"args": {"seed": saved_by}})
    mine = ck / "step-1000000"
    (tmp_path / "link").symlink_to(ck)
    check(mine, 1), check(f"{mine}/", 1), check(mine, 1, save=tmp_path / "link")
    monkeypatch.chdir(ck)
    check("step-1000000", 1)
    with pytest.raises(module.InputError, match=rf"^{mine} is another run's step \(--seed 1, "):
        check(mine, 2)
    elsewhere = step("step-000004", seed=2, folder=tmp_path / "other")
    for path in (elsewhere, None):
        with pytest.raises(module.InputError, match=rf"^--save {ck} holds another run's steps"):
            check(path, 2, saved_by=2)


@pytest.mark.parametrize("script", SHARDED_TRAINERS)
def test_a_run_json_without_what_resuming_reads_is_one_line(script, tmp_path):
    """A run.json without step, args or rng, with a step that is no integer of 0 or more, or an
    rng whose entries are not the byte lists restore_rng reads (another size, not bytes, no
    cuda), each read by the trainer's read_run_state: one line, exit code 2; the control: the
    same run.json whole reads, and its step comes back."""
    module = trainer(script)
    run = types.SimpleNamespace(args=module.parse_args([]))
    data = types.SimpleNamespace(vocab_size=256)
    size = len(torch.get_rng_state())
    good = {"step": 3, "config": module.model_config(run.args, 256), "args": {},
            "rng": [{"cpu": torch.get_rng_state().tolist(), "cuda": None}]}
    assert module.read_run_state(step_folder(tmp_path / "good", good), run, data)["step"] == 3
    rng_words = (f"its rng is not a list of each rank's random states, a cpu list of {size} bytes "
                 "and a cuda list of bytes or null")
    cases = [({k: v for k, v in good.items() if k != "step"}, "it has no step"),
             ({k: v for k, v in good.items() if k not in ("args", "rng")}, "it has no args, rng"),
             ({**good, "step": "3"}, "its step is '3', not an integer of 0 or more"),
             ({**good, "step": -5}, "its step is -5, not an integer of 0 or more"),
             ({**good, "step": 2.5}, "its step is 2.5, not an integer of 0 or more"),
             ({**good, "args": []}, "its config or args is not an object"),
             ({**good, "rng": [{"cpu": [0] * 16, "cuda": None}]}, rng_words),
             ({**good, "rng": [{"cpu": [300] * size, "cuda": None}]}, rng_words),
             ({**good, "rng": [{"cpu": good["rng"][0]["cpu"]}]}, rng_words),
             ({**good, "rng": [good["rng"][0]["cpu"]]}, rng_words),
             ([1, 2, 3], "it has no step, config, args, rng")]
    for i, (state, words) in enumerate(cases):
        path = step_folder(tmp_path / f"bad{i}", state)
        with pytest.raises(module.InputError) as err:
            module.read_run_state(path, run, data)
        assert str(err.value) == f"cannot resume from {path}/run.json: {words}"
        assert err.value.code == 2


@pytest.fixture(scope="module")
def one_files(tmp_path_factory):
    """--sample's files: a small GPT's weights with their config, and the same weights under
    configs they do not fit: another width, no n_head, a head count that does not divide the
    width, and a mixture with more experts per token than experts."""
    d = tmp_path_factory.mktemp("onefile")
    config = {"vocab_size": 256, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 8,
              "dropout": 0.0}
    weights = trainer("train_fsdp_minigpt.py").GPT(**config).state_dict()
    configs = {"good": config, "wider": {**config, "n_embd": 16},
               "headless": {k: v for k, v in config.items() if k != "n_head"},
               "three_heads": {**config, "n_head": 3},
               "mixture": {**config, "experts": 2, "top_k": 3}}
    for name, each in configs.items():
        torch.save({"model": weights, "config": each, "step": 1, "itos": None}, d / f"{name}.pt")
    return d


@pytest.mark.parametrize("script", SHARDED_TRAINERS)
def test_a_checkpoint_whose_config_does_not_fit_its_weights_is_one_line(script, one_files):
    """--sample --ckpt of weights saved under another width, under a config without n_head, or
    with a head count that does not divide the width: one line and exit code 2 (through the
    script's __main__ in chapter 7), not a traceback; the control: the same weights under their
    own config sample, and with --prompt, --temperature, --top-k and --seed each chapter samples
    chapter 3's text (controls: another seed, and top-k 1, sample other texts). Chapter 12 also
    refuses a mixture with more experts per token than experts."""
    module, d = trainer(script), one_files
    sampled = in_process(script, ["--sample", "--ckpt", d / "good.pt", "--max-new-tokens", 3])
    assert sampled.startswith("\n") and len(sampled) > 2, sampled  # the prompt, tokens, a newline
    flags = ["--sample", "--ckpt", d / "good.pt", "--max-new-tokens", 12, "--prompt", "ab",
             "--temperature", 0.7, "--top-k", 5, "--seed", 4]
    text = in_process(script, flags)
    assert text.startswith("ab") and text == in_process(GPT, flags), text
    others = in_process(GPT, flags[:-1] + [5]), in_process(GPT, flags[:-3] + [1, "--seed", 4])
    assert text not in others, (text, others)
    cases = [("wider", "cannot read checkpoint {}: its weights do not fit its config: "),
             ("headless", "cannot read checkpoint {}: its config has no n_head"),
             ("three_heads", "cannot read checkpoint {}: its config's n_head 3 does not divide "
                             "n_embd 8")]
    if script == "train_moe_minigpt.py":
        cases.append(("mixture", "{} holds a config that no mixture has"))
    for name, words in cases:
        with pytest.raises(module.InputError) as err:
            in_process(script, ["--sample", "--ckpt", d / f"{name}.pt"])
        assert str(err.value).startswith(words.format(d / f"{name}.pt")), err.value
        assert "\n" not in str(err.value) and err.value.code == 2
    if script == "train_fsdp_minigpt.py":
        result = as_script(script, ["--sample", "--ckpt", d / "wider.pt"])
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result
        assert result.stderr.startswith(f"error: cannot read checkpoint {d / 'wider.pt'}: its "
                                        "weights do not fit its config: ")


# ------------------------------------------ the launches, started with the module, read last

def test_the_classifier_stops_at_a_non_finite_step_and_keeps_the_good_checkpoint(launched):
    result, folder, before = launched["classifier"]
    stopped_on_every_rank(result, 4, r"^error: epoch 1 step \d+: loss \S+, gradient norm (nan|inf): "
                                     r"not finite, step not applied; try a lower --lr \(now 1e\+20\)")
    assert "epoch 1/2 | train loss" not in result.stdout  # no epoch finished, no summary
    assert (folder / "ck.pt").read_bytes() == before
    only_the_checkpoint(folder, "ck.pt")


def test_the_lm_stops_at_a_non_finite_step_and_keeps_the_last_good_checkpoint(launched):
    result, folder, _ = launched["lm"]
    line = stopped_on_every_rank(result, 4, r"^error: step (\d+)/8: loss \S+, grad norm \S+: not "
                                            r"finite, step not applied; try a lower --lr \(now "
                                            r"10000\), a --clip \(now 1\)$")
    step = int(re.search(r"step (\d+)/8", line).group(1))
    assert step >= 5 and f"step {step}/8 | loss" not in result.stdout  # that step was not applied
    state = torch.load(folder / "ck.pt", map_location="cpu", weights_only=True)
    assert state["step"] == step - 1  # the last applied step's checkpoint, never the bad one
    assert trainer(GPT).all_finite(state["model"])
    only_the_checkpoint(folder, "ck.pt")


def test_a_full_disk_stops_every_rank_with_one_line_and_keeps_the_last_checkpoint(launched):
    result, folder, _ = launched["disk"]
    path = folder / "ck.pt"
    stopped_on_every_rank(result, 5, f"^error: cannot save {re.escape(str(path))}: "
                                     f"{full_disk(folder)}No space left on device\\)$")
    assert "step 2/6 | saved" in result.stdout and "step 5/6" not in result.stdout
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["step"] == 2 and trainer(GPT).all_finite(state["model"])
    only_the_checkpoint(folder, "ck.pt")


def test_a_full_disk_at_the_classifiers_save_stops_every_rank_with_one_line(launched):
    result, folder, _ = launched["full"]
    stopped_on_every_rank(result, 5, rf"^error: cannot save ck\.pt: {full_disk(folder)}No space "
                                     r"left on device\)$")
    assert "done | val loss" in result.stdout  # training finished; only the save failed
    assert not list(folder.iterdir())  # no checkpoint, and no temporary file left behind


@pytest.mark.parametrize("script", [GPT, *SHARDED_TRAINERS])
def test_a_token_id_equal_to_the_vocabulary_size_is_one_line(script, tmp_path):
    """A .bin whose largest id is --vocab-size itself has no row in the embedding: refused in one
    line before any model is built (past the check it would fail in the embedding mid-run, a
    device assert on a GPU). The control: one more entry in the vocabulary reads it."""
    module, path = trainer(script), tmp_path / "ids.bin"
    np.array([0, 5, 300], dtype=np.uint16).tofile(path)
    with pytest.raises(module.InputError, match=r"holds token id 300, not below the vocabulary "
                                                r"size 300 \(--vocab-size\)$"):
        module.read_ids(str(path), 300, "--vocab-size")
    assert list(module.read_ids(str(path), 301, "--vocab-size")) == [0, 5, 300]


@pytest.mark.parametrize("script", [GPT, *SHARDED_TRAINERS])
def test_mfu_counts_the_peak_of_every_gpu_of_the_job(script, monkeypatch):
    """MFU's denominator is one GPU's peak times every GPU of the job, whatever the layout: at 4
    processes of dp 1 (all cp, tp, pp or ep), 4 x an H100's 989 bf16 TFLOPS, or 4 x the
    --gpu-peak-tflops given; a layout's replicas alone would overstate MFU by the other sizes."""
    module = trainer(script)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    for given, peak in ((None, 989), (100.0, 100)):
        run = types.SimpleNamespace(device=torch.device("cuda", 0), amp="bfloat16", world_size=4,
                                    dp_size=1, args=types.SimpleNamespace(gpu_peak_tflops=given))
        flops, note = module.gpu_peak_flops(run)
        assert flops == peak * 1e12 * 4 and f"MFU against {peak:g} TFLOPS per GPU" in note


@pytest.mark.parametrize("script", ["train_tp_minigpt.py", "train_pp_minigpt.py",
                                    "train_cp_minigpt.py", "train_4d_minigpt.py"])
def test_the_data_check_counts_the_replicas_where_a_rows_ranks_share_a_batch(script, tmp_path):
    """Where the ranks of a row (tp, pp, cp) read one batch, the data must hold a batch per
    replica, not per rank: 4 ranks in one row start on 30 training tokens, enough for one batch of
    2 windows of 8 (plus a window's offset), where 4 batches would need 80. The control: at 4
    replicas the same data is refused in one line."""
    module, path = trainer(script), tmp_path / "tiny.txt"
    path.write_bytes(bytes(range(65, 105)))  # 40 tokens: 30 to train on, 10 to validate
    args = module.parse_args(["--data", str(path), "--val-fraction", "0.25", "--batch-size", "2",
                              "--block-size", "8"])
    one_row = types.SimpleNamespace(args=args, world_size=4, dp_size=1, dp_rank=0, rank=0,
                                    is_main=False)
    assert len(module.build_data(one_row).val) == 10
    with pytest.raises(module.InputError, match=r"30 training and 10 validation tokens: too "
                                                r"few for 4 replica\(s\)"):
        module.build_data(types.SimpleNamespace(**{**vars(one_row), "dp_size": 4}))
