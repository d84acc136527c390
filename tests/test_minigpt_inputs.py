"""Every bad input to train_ddp_minigpt.py ends with exit code 2 and one clear line: a missing,
empty or too-short data file, a .bin file without --vocab-size, with an odd byte count or with
token ids >= the vocabulary, impossible model, timeout or AMP settings, a missing, corrupt or
mismatched checkpoint for --resume or --sample, a start without torchrun, a GPU asked for that is
not there. Most cases call the script's own main() in this
process (a launch costs seconds of torch import); one test runs it as `python` would (its
`__main__` block, in this process: helpers.as_script) to prove that such an error becomes exit code
2 and one line."""
import numpy as np
import pytest
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


@pytest.mark.parametrize("args,message", [
    (["--n-embd", "30", "--n-head", "4"], "--n-head 4 must divide --n-embd 30"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--grad-accum", "0"], "argument --grad-accum: must be positive, got 0"),
    (["--dist-timeout", "0"], "argument --dist-timeout: must be positive, got 0"),
    (["--sample"], "--sample needs --ckpt PATH"),
    (["--amp", "fp8"], "argument --amp: invalid choice: 'fp8'"),
])
def test_bad_flags_are_refused_in_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpt.parse_args(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


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


def test_cuda_without_a_gpu_and_more_processes_than_gpus_are_one_line(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(gpt.torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as exit_:  # before any process group is made
        gpt.avoid_known_failures(gpt.parse_args(["--device", "cuda"]))
    assert exit_.value.code == 2 and capsys.readouterr().err == (
        "error: --device cuda: GPU 2 asked for, but 2 visible: start at most one process per GPU "
        "(--nproc_per_node), or --device cpu\n")
