"""Every bad input to train_ddp_minigpt.py ends with exit code 2 and one clear line: a missing,
empty or too-short data file, a .bin file without --vocab-size, with an odd byte count or with
token ids >= the vocabulary, impossible model, timeout or AMP settings, NaN or infinity for any
float flag, a --dist-timeout outside 1 s to a week, a --seed torch cannot take, an unknown
--compile-backend, a missing, corrupt or mismatched checkpoint for --resume or --sample, or one
edited by hand (a file only to sample from, keys or random states missing or of the wrong size,
a negative, fractional or too large step, a model that is no state dict, a config its weights do
not fit), a --save that rank 0 could not write (refused before the group is joined, leaving
nothing behind), a start without torchrun, a GPU asked for that is not there. Each new refusal
has its control: the good checkpoint resumes and samples, the bounds themselves are accepted, the
largest seed trains, a rank other than 0 does not check --save. Most cases call the script's own
main() in this process (a launch costs seconds of torch import); one test runs it as `python`
would (its `__main__` block, in this process: helpers.as_script) to prove that such an error
becomes exit code 2 and one line."""
import numpy as np
import pytest
import torch
from helpers import GPT, as_script, in_process, trainer

gpt = trainer(GPT)
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--max-steps", "1", "--save", ""]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gptbad")
    (d / "empty.txt").write_bytes(b"")
    (d / "short.txt").write_text("print('hello')\n" * 4)
    (d / "text.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    np.array([1, 2, 3, 70000 % 65536, 9] * 400, dtype=np.uint16).tofile(d / "ids.bin")
    (d / "odd.bin").write_bytes(b"\x01\x00\x02")
    in_process(GPT, [*TINY, "--data", d / "text.txt", "--save", d / "good.pt"])
    good = (d / "good.pt").read_bytes()
    (d / "truncated.pt").write_bytes(good[:len(good) // 3])
    state = torch.load(d / "good.pt", weights_only=True)
    short_rng = [{"cpu": torch.zeros(10, dtype=torch.uint8), "cuda": None}]
    edited = {  # the good checkpoint, edited by hand; "export": a file only to sample from
        "export": {**state, "optimizer": {}, "scaler": {}, "rng": []},
        "no-rng": {k: v for k, v in state.items() if k != "rng"},
        "rng-short": {**state, "rng": short_rng}, "model-list": {**state, "model": [1]},
        "step-5": {**state, "step": -5}, "step1.5": {**state, "step": 1.5},
        "step-far": {**state, "step": 10**6},
        "wide": {**state, "config": {**state["config"], "n_embd": 32}},
        "no-head": {**state, "config": {k: v for k, v in state["config"].items() if k != "n_head"}},
        "head3": {**state, "config": {**state["config"], "n_head": 3}}}
    for name, edit in edited.items():
        torch.save(edit, d / f"{name}.pt")
    return d


@pytest.mark.parametrize("args,message", [
    (["--data", "{d}/missing.txt"], "data file not found: {d}/missing.txt"),
    (["--data", "{d}/empty.txt"], "{d}/empty.txt has 0 training and 0 validation tokens: too few for 1 process(es)"),
    (["--data", "{d}/short.txt"], "{d}/short.txt has 54 training and 6 validation tokens: too few"),
    (["--data", "{d}/ids.bin"], "{d}/ids.bin holds token ids: give --vocab-size"),
    (["--data", "{d}/ids.bin", "--vocab-size", "1000"],
     "{d}/ids.bin holds token id 4464, not below the vocabulary size 1000 (--vocab-size)"),
    (["--data", "{d}/odd.bin", "--vocab-size", "10"], "{d}/odd.bin has an odd number of bytes"),
    (["--data", "{d}/text.txt", "--amp", "fp16"], "--amp fp16 needs a CUDA device"),
    (["--data", "{d}/text.txt", "--resume", "{d}/truncated.pt"],
     "cannot read checkpoint {d}/truncated.pt: "),
    (["--data", "{d}/text.txt", "--resume", "{d}/good.pt", "--n-embd", "32"],
     "{d}/good.pt was trained with {{"),
    (["--sample", "--ckpt", "{d}/nothing.pt"], "checkpoint not found: {d}/nothing.pt"),
    (["--sample", "--ckpt", "{d}/good.pt", "--device", "cuda"],
     "--device cuda, but no CUDA device is visible"),
])
def test_bad_data_and_checkpoints_raise_one_line_input_errors(args, message, files):
    with pytest.raises(gpt.InputError) as err:
        in_process(GPT, [*TINY, *[a.format(d=files) for a in args]])
    assert message.format(d=files) in str(err.value) and "\n" not in str(err.value)


FINITE = "must be a finite number, {}, got {}"
TIMEOUT = "--dist-timeout must be between 1 and 604800 seconds (a week), got {}"
SEED = "--seed must be between 0 and 9223372036854775807, got {}"


@pytest.mark.parametrize("args,message", [
    (["--n-embd", "30", "--n-head", "4"], "--n-head 4 must divide --n-embd 30"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--dropout", "nan"], "--dropout must be in [0, 1) and --val-fraction in (0, 1)"),
    (["--val-fraction", "nan"], "--dropout must be in [0, 1) and --val-fraction in (0, 1)"),
    (["--grad-accum", "0"], "argument --grad-accum: " + FINITE.format("positive", 0)),
    (["--dist-timeout", "0"], "argument --dist-timeout: " + FINITE.format("positive", 0)),
    (["--dist-timeout", "nan"], "argument --dist-timeout: " + FINITE.format("positive", "nan")),
    (["--dist-timeout", "inf"], "argument --dist-timeout: " + FINITE.format("positive", "inf")),
    (["--dist-timeout", "1e20"], "argument --dist-timeout: must be at most 604800, got 1e20"),
    (["--dist-timeout", "1e-6"], TIMEOUT.format("1e-06")),
    (["--temperature", "nan"], "argument --temperature: " + FINITE.format("positive", "nan")),
    (["--lr", "inf"], "argument --lr: " + FINITE.format("positive", "inf")),
    (["--min-lr", "nan"], "argument --min-lr: " + FINITE.format("at least 0", "nan")),
    (["--clip", "inf"], "argument --clip: " + FINITE.format("at least 0", "inf")),
    (["--weight-decay", "inf"], "argument --weight-decay: " + FINITE.format("at least 0", "inf")),
    (["--gpu-peak-tflops", "nan"],
     "argument --gpu-peak-tflops: " + FINITE.format("positive", "nan")),
    (["--seed", str(2**64)], SEED.format(2**64)),
    (["--seed", "-3"], SEED.format(-3)),
    (["--compile-backend", "inductr"], "argument --compile-backend: invalid choice: 'inductr'"),
    (["--sample"], "--sample needs --ckpt PATH"),
    (["--amp", "fp8"], "argument --amp: invalid choice: 'fp8'"),
])
def test_bad_flags_are_refused_in_one_line(args, message, capsys):
    """NaN, infinity, a timeout of 1e20 or 1e-6 seconds and a seed past 64 bits all crashed, at
    the group's start or at a step; now each is one line when the flags are read."""
    with pytest.raises(SystemExit) as exit_:
        gpt.parse_args(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_the_bounds_themselves_are_accepted_and_the_largest_seed_trains(files):
    """The controls of the refusals above: a timeout of 1 s and of a week, seed 0 and 2**63 - 1,
    each backend. The largest seed trains; a seed past 32 bits gives other initial weights than
    the seed it equals in its low bits, and seeds below 2**32 keep theirs (the other chapters
    start from the same weights)."""
    for args in (["--dist-timeout", "1"], ["--dist-timeout", "604800"], ["--seed", "0"],
                 ["--seed", str(2**63 - 1)], *(["--compile-backend", name] for name in
                                                ("inductor", "aot_eager", "eager", "cudagraphs"))):
        assert gpt.parse_args(args)
    out = in_process(GPT, [*TINY, "--data", files / "text.txt", "--seed", 2**63 - 1,
                           "--max-new-tokens", 1])
    assert "step 1/1 | loss" in out
    name, shape = "blocks.0.attn.qkv.weight", (4, 4)
    assert not torch.equal(gpt.initial_value(name, shape, 2**32 + 5, 1),
                           gpt.initial_value(name, shape, 5, 1))
    seeded = torch.Generator().manual_seed(5 * 2**32 + gpt.zlib.crc32(name.encode()))
    assert torch.equal(gpt.initial_value(name, shape, 5, 1),
                       torch.randn(shape, generator=seeded) * 0.02)


STEP = "is not a step from 0 to the --max-steps of the run that saved it"


@pytest.mark.parametrize("name,problem", [
    ("export", "its optimizer (dict) is not an optimizer's state dict: a file only to sample "
               "from cannot be resumed"),
    ("no-rng", "its rng (none) is not every rank's random-number states"),
    ("rng-short", "its rng (list) is not every rank's random-number states"),
    ("step-5", f"its step (-5) {STEP}"), ("step1.5", f"its step (1.5) {STEP}"),
    ("step-far", f"its step (1000000) {STEP}"),
])
def test_hand_edited_checkpoints_are_refused_in_one_line_before_resuming(name, problem, files):
    """Each key a resume reads is checked, with its type, by read_checkpoint: a file only to
    sample from raised KeyError: 'param_groups', a step of -5 trained with negative learning
    rates. The control: the good checkpoint they were edited from resumes."""
    path = files / f"{name}.pt"
    with pytest.raises(gpt.InputError) as err:
        in_process(GPT, [*TINY, "--data", files / "text.txt", "--resume", path])
    assert str(err.value) == f"cannot resume from {path}: {problem}" and err.value.code == 2
    resumed = in_process(GPT, [*TINY, "--data", files / "text.txt", "--resume",
                               files / "good.pt", "--max-new-tokens", 1])
    assert f"resumed from {files / 'good.pt'} at step 1" in resumed


@pytest.mark.parametrize("name,problem", [
    ("wide", "its weights do not fit its config: blocks.0.attn.proj.bias is 16, the config "
             "makes 32"),
    ("no-head", "its config has no n_head"),
    ("head3", "its config's n_head 3 does not divide n_embd 16"),
    ("model-list", "ValueError: its model is not a state dict of tensors"),
])
def test_a_sampled_checkpoint_whose_config_does_not_fit_its_weights_is_one_line(name, problem,
                                                                                files):
    """--sample builds its model from the file's config: another width, no head count, or one
    that does not divide the width were tracebacks (a model that is no state dict too, in
    resumes as well). The control: the good file samples."""
    path = files / f"{name}.pt"
    with pytest.raises(gpt.InputError) as err:
        in_process(GPT, ["--sample", "--ckpt", path, "--max-new-tokens", 1])
    assert str(err.value) == f"cannot read checkpoint {path}: {problem}"
    assert err.value.code == 2
    sampled = in_process(GPT, ["--sample", "--ckpt", files / "good.pt", "--prompt", "def",
                               "--max-new-tokens", 2])
    assert sampled.startswith("def") and len(sampled.encode()) >= 5


@pytest.mark.parametrize("save,reason", [
    ("{d}", "Is a directory"),  # a folder where the file goes
    ("{d}/text.txt/ck.pt", "Not a directory"),  # a file where a folder must be
])
def test_a_save_path_that_cannot_be_written_is_refused_before_the_group(save, reason, files,
                                                                        monkeypatch):
    """Once the whole run trained, then stopped at its first save (exit code 5); now rank 0,
    the rank that saves, checks before the group is joined, and leaves nothing behind (root
    writes to read-only folders, so a folder or a file in the way stands for every reason).
    The control: another rank does not check (it writes nothing)."""
    save, before = save.format(d=files), sorted(files.rglob("*"))
    with pytest.raises(gpt.InputError) as err:
        in_process(GPT, [*TINY, "--data", files / "text.txt", "--save", save])
    assert str(err.value) == f"--save {save} cannot be written: {reason}"
    assert err.value.code == 2 and sorted(files.rglob("*")) == before
    monkeypatch.setenv("RANK", "1")
    assert gpt.refuse_an_unwritable_save(gpt.parse_args(["--save", save])) is None


def test_input_errors_exit_2_with_one_line_and_no_traceback(files):
    cases = [(GPT, [*TINY, "--data", files / "ids.bin"]),  # plain python: refused before the data
             (GPT, ["--sample", "--ckpt", files / "truncated.pt"])]
    results = [as_script(script, args) for script, args in cases]
    for (_, args), result in zip(cases, results):
        where = f"{args}: exit {result.returncode}\n{result.stderr}"
        assert result.returncode == 2 and "Traceback" not in result.stderr, where
        assert len(result.stderr.strip().splitlines()) == 1, where
        assert result.stderr.startswith("error: "), where
    assert results[0].stderr == ("error: not launched by torchrun: see the commands at the top of "
                                 "this script\n")
    exact = {  # the arguments, and the whole of stderr
        ("--temperature", "nan"): "train_ddp_minigpt.py: error: argument --temperature: must be a "
                                  "finite number, positive, got nan",
        ("--dist-timeout", "1e-6"): "train_ddp_minigpt.py: error: " + TIMEOUT.format("1e-06"),
        ("--sample", "--ckpt", str(files / "head3.pt")):
            f"error: cannot read checkpoint {files}/head3.pt: its config's n_head 3 does not "
            "divide n_embd 16"}
    for args, line in exact.items():
        result = as_script(GPT, list(args))
        assert result.returncode == 2 and result.stderr == line + "\n", (args, result.stderr)


def test_cuda_without_a_gpu_and_more_processes_than_gpus_are_one_line(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(gpt.torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as exit_:  # before any process group is made
        gpt.avoid_known_failures(gpt.parse_args(["--device", "cuda"]))
    assert exit_.value.code == 2 and capsys.readouterr().err == (
        "error: --device cuda: GPU 2 asked for, but 2 visible: start at most one process per GPU "
        "(--nproc_per_node), or --device cpu\n")
