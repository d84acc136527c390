"""Every bad input to the chapter 1 and 2 scripts ends with exit code 2 and one clear line on
stderr, no traceback and no hang: non-positive, malformed, NaN or infinite numbers, a --seed
torch cannot take, a missing, corrupted, truncated or mismatched checkpoint, missing or
unreadable MNIST files, a CUDA device that is not there, the DDP script started without torchrun.

Most cases call the scripts' own parse_args()/main() in this process (a launch costs seconds of
torch import); the last test runs each script's own exit path (its __main__ block) to prove that
such an error becomes exit code 2 with one line; that under torchrun it stops every worker instead
of hanging is test_cluster_paths.py's classifier launch."""
import pytest
from helpers import DDP, SINGLE, as_script, in_process, make_mnist, trainer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    in_process(SINGLE, ["--train-samples", 64, "--val-samples", 8, "--epochs", 1,
                        "--save", d / "good.pt"])
    good = (d / "good.pt").read_bytes()
    (d / "truncated.pt").write_bytes(good[:len(good) // 2])
    (d / "garbage.pt").write_bytes(b"not a checkpoint\n" * 100)
    (d / "empty").mkdir()
    raw = make_mnist(d / "broken")
    (raw / "t10k-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03garbage")
    return d


@pytest.mark.parametrize("script,args,message", [
    (SINGLE, ["--batch-size", "0"],
     "argument --batch-size: must be a finite number, positive, got 0"),
    (DDP, ["--epochs", "-1"], "argument --epochs: must be a finite number, positive, got -1"),
    (SINGLE, ["--lr", "0"], "argument --lr: must be a finite number, positive, got 0"),
    (SINGLE, ["--lr", "nan"], "argument --lr: must be a finite number, positive, got nan"),
    (DDP, ["--lr", "inf"], "argument --lr: must be a finite number, positive, got inf"),
    (DDP, ["--lr", "fast"], "argument --lr: invalid positive float value: 'fast'"),
    (SINGLE, ["--train-samples", "-5"],
     "argument --train-samples: must be a finite number, positive, got -5"),
    (SINGLE, ["--model", "vgg"], "argument --model: invalid choice: 'vgg'"),
    (DDP, ["--num-workers", "-1"],
     "argument --num-workers: must be a finite number, at least 0, got -1"),
    (SINGLE, ["--seed", str(2**64)],
     "--seed must be between 0 and 9223372036854775807, got 18446744073709551616"),
    (DDP, ["--seed", "-1"], "--seed must be between 0 and 9223372036854775807, got -1"),
])
def test_bad_flag_values_are_refused_in_one_line(script, args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        trainer(script).parse_args(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("script,args,message", [
    (SINGLE, ["--resume", "{d}/missing.pt"], "checkpoint not found: {d}/missing.pt"),
    (DDP, ["--resume", "{d}/garbage.pt"], "cannot resume from {d}/garbage.pt: "),
    (SINGLE, ["--resume", "{d}/truncated.pt"], "cannot resume from {d}/truncated.pt: "),
    (DDP, ["--resume", "{d}/good.pt", "--model", "resnet18"],
     "{d}/good.pt holds a --model cnn, this run builds --model resnet18"),
    (SINGLE, ["--dataset", "mnist", "--data-dir", "{d}/empty"],
     "MNIST not found: place the uncompressed files train-images-idx3-ubyte, "
     "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte in {d}/empty/MNIST/raw/"),
    (DDP, ["--dataset", "mnist", "--data-dir", "{d}/broken"],
     "cannot read the MNIST files in {d}/broken/MNIST/raw/"),
    (DDP, ["--device", "cuda"], "--device cuda, but no CUDA device is visible"),
    (SINGLE, ["--device", "cuda"], "--device cuda, but no CUDA device is visible"),
])
def test_bad_files_and_options_raise_one_line_input_errors(script, args, message, files, tmp_path):
    args = [a.format(d=files) for a in args]
    args += ["--train-samples", "64", "--val-samples", "8", "--save", str(tmp_path / "x.pt")]
    with pytest.raises(trainer(script).InputError) as err:
        in_process(script, args)
    assert message.format(d=files) in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "x.pt").exists()


def test_input_errors_exit_2_with_one_line_and_no_traceback():
    """Each script run as `python SCRIPT` runs it (its __main__ block, here: helpers.as_script):
    bad flags, each the exact line; and the DDP script without torchrun. Under torchrun, an
    input error on one rank stops every worker with exit code 2: test_cluster_paths.py's
    classifier launch (rank 1 cannot find the checkpoint rank 0 resumes from)."""
    cases = {  # the arguments, and the line on stderr
        (SINGLE, "--epochs", "0"): "train_single_gpu.py: error: argument --epochs: must be a "
                                   "finite number, positive, got 0",
        (SINGLE, "--lr", "nan"): "train_single_gpu.py: error: argument --lr: must be a finite "
                                 "number, positive, got nan",
        (SINGLE, "--seed", str(2**63)): "train_single_gpu.py: error: --seed must be between 0 and "
                                        "9223372036854775807, got 9223372036854775808",
        (DDP,): "error: not launched by torchrun: see the commands at the top of this script"}
    for (script, *args), line in cases.items():
        result = as_script(script, args)
        where = f"{script} {args}: exit {result.returncode}\n{result.stderr}"
        assert result.returncode == 2 and result.stderr == line + "\n", where
        assert "epoch 0/" not in result.stdout, where  # refused before any evaluation, any step
