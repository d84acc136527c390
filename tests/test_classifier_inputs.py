"""Every bad input to the chapter 1 and 2 scripts ends with exit code 2 and one clear line on
stderr, no traceback and no hang: non-positive, malformed, NaN or infinite numbers, a --seed
torch cannot take, a missing, empty, corrupted, truncated or mismatched checkpoint, or one edited
by hand (a key missing, a negative or fractional epoch, a model that is no state dict, random
states of the wrong size), missing or unreadable MNIST files, or files that disagree (as many
labels as images, 28x28 images, labels 0-9), a --save that could not be written (refused before
any training, leaving nothing behind), a CUDA device that is not there, the DDP script started
without torchrun. Each refusal has its control: the same input made good is accepted (the good
checkpoint resumes, the good MNIST files load, the largest seed trains, a folder at --save is
fine for --eval-only, which saves nothing).

Most cases call the scripts' own parse_args()/main() in this process (a launch costs seconds of
torch import); the last test runs each script's own exit path (its __main__ block) to prove that
such an error becomes exit code 2 with one line; that under torchrun it stops every worker instead
of hanging is test_cluster_paths.py's classifier launch."""
import numpy as np
import pytest
import torch
from helpers import DDP, SINGLE, as_script, in_process, make_mnist, trainer, write_idx


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
    make_mnist(d / "good")
    disagreeing = {  # a folder whose files disagree: the file and what it holds instead
        "counts": ("t10k-labels-idx1-ubyte", np.zeros(19)),  # 20 images
        "label": ("train-labels-idx1-ubyte", np.r_[np.zeros(59), 12]),
        "rows": ("train-images-idx3-ubyte", np.zeros((60, 20, 20)))}
    for name, (file, array) in disagreeing.items():
        write_idx(make_mnist(d / name) / file, array)
    (d / "empty.pt").write_bytes(b"")
    state = torch.load(d / "good.pt", weights_only=True)
    short_rng = {"cpu": torch.zeros(10, dtype=torch.uint8), "cuda": None}
    edited = {"epoch-4": {**state, "epoch": -4}, "epoch2.5": {**state, "epoch": 2.5},
              "model-list": {**state, "model": [1]}, "rng-short": {**state, "rng": short_rng},
              "no-optimizer": {k: v for k, v in state.items() if k != "optimizer"}}
    for name, edit in edited.items():  # the good checkpoint, edited by hand
        torch.save(edit, d / f"{name}.pt")
    (d / "a-file").write_text("")
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


@pytest.mark.parametrize("script,name,problem", [
    (SINGLE, "epoch-4", "its epoch (-4) is not a whole number of epochs done, 0 or more"),
    (DDP, "epoch2.5", "its epoch (2.5) is not a whole number of epochs done, 0 or more"),
    (SINGLE, "model-list", "its model (list) is not a state dict of tensors"),
    (DDP, "rng-short", "its rng (dict) is not the random generators' states a save writes"),
    (SINGLE, "no-optimizer", "it has no optimizer: not a checkpoint of this script"),
    (DDP, "empty", "the file is empty"),
])
def test_empty_and_hand_edited_checkpoints_are_refused_in_one_line(script, name, problem, files,
                                                                   tmp_path):
    """Each key a resume reads is checked, with its type, before anything is loaded: a negative
    epoch once trained from epoch -4, a fractional one crashed in range(), an empty file said
    "EOFError". The control: the good checkpoint they were edited from resumes."""
    flags = ["--train-samples", "64", "--val-samples", "8", "--epochs", "1", "--save",
             tmp_path / "x.pt"]
    with pytest.raises(trainer(script).InputError) as err:
        in_process(script, [*flags, "--resume", files / f"{name}.pt"])
    assert str(err.value) == f"cannot resume from {files / name}.pt: {problem}"
    assert err.value.code == 2 and not (tmp_path / "x.pt").exists()
    resumed = in_process(script, [*flags, "--resume", files / "good.pt"])
    assert f"resumed from {files / 'good.pt'} after epoch 1" in resumed


@pytest.mark.parametrize("script,folder,message", [
    (DDP, "counts", "{raw}/t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte hold 20 images and "
                    "19 labels: a split needs a label for each image, and at least one"),
    (SINGLE, "label", "{raw}/train-labels-idx1-ubyte holds label 12, not a digit from 0 to 9"),
    (SINGLE, "rows",
     "{raw}/train-images-idx3-ubyte holds images of 20x20 pixels, not MNIST's 28x28"),
])
def test_mnist_files_that_disagree_are_refused_in_one_line(script, folder, message, files):
    """Unchecked, too few labels stopped the run in TensorDataset, a label of 12 in the loss and
    20x20 images in the model, each with a traceback. The control: the good files load."""
    with pytest.raises(trainer(script).InputError) as err:
        in_process(script, ["--dataset", "mnist", "--data-dir", files / folder, "--save", ""])
    raw = files / folder / "MNIST" / "raw"
    assert str(err.value) == message.format(raw=raw) and err.value.code == 2
    x_train, y_train, x_val, y_val = trainer(script).load_mnist(str(files / "good"))
    assert x_train.shape == (60, 1, 28, 28) and x_val.shape == (20, 1, 28, 28)
    assert len(y_train) == 60 and len(y_val) == 20


@pytest.mark.parametrize("script,save,reason", [
    (SINGLE, "{d}/empty", "Is a directory"),  # a folder where the file goes
    (DDP, "{d}/a-file/ck.pt", "Not a directory"),  # a file where a folder must be
    (SINGLE, "{d}/a-file/new/ck.pt", "Not a directory"),
])
def test_a_save_path_that_cannot_be_written_is_refused_before_training(script, save, reason,
                                                                       files):
    """Once the whole run trained, then stopped at its save (exit code 5); now the process that
    saves checks first, and leaves nothing behind (root writes to read-only folders, so a folder
    or a file in the way stands for every reason). The controls: a path in folders still to
    make passes and makes none of them, and --eval-only, which saves nothing, is not refused."""
    save, before = save.format(d=files), sorted(files.rglob("*"))
    with pytest.raises(trainer(script).InputError) as err:
        in_process(script, ["--train-samples", "64", "--val-samples", "8", "--save", save])
    assert str(err.value) == f"--save {save} cannot be written: {reason}"
    assert err.value.code == 2 and sorted(files.rglob("*")) == before
    assert trainer(script).why_unwritable(str(files / "new" / "deeper" / "ck.pt")) is None
    assert sorted(files.rglob("*")) == before
    evaluated = in_process(script, ["--train-samples", "64", "--val-samples", "8", "--save", save,
                                    "--eval-only"])
    assert "epoch 0/3 | val loss" in evaluated


def test_input_errors_exit_2_with_one_line_and_no_traceback(files):
    """Each script run as `python SCRIPT` runs it (its __main__ block, here: helpers.as_script):
    bad flags, a hand-edited checkpoint, disagreeing MNIST files, a --save in the way, each the
    exact line, before any training; and the DDP script without torchrun. Under torchrun, an
    input error on one rank stops every worker with exit code 2: test_cluster_paths.py's
    classifier launch (rank 1 cannot find the checkpoint rank 0 resumes from)."""
    small = ["--train-samples", "64", "--val-samples", "8", "--save", ""]
    raw = files / "label" / "MNIST" / "raw"
    cases = {  # the arguments, and the line on stderr
        (SINGLE, "--epochs", "0"): "train_single_gpu.py: error: argument --epochs: must be a "
                                   "finite number, positive, got 0",
        (SINGLE, "--lr", "nan"): "train_single_gpu.py: error: argument --lr: must be a finite "
                                 "number, positive, got nan",
        (SINGLE, "--seed", str(2**63)): "train_single_gpu.py: error: --seed must be between 0 and "
                                        "9223372036854775807, got 9223372036854775808",
        (SINGLE, *small, "--resume", str(files / "epoch-4.pt")):
            f"error: cannot resume from {files}/epoch-4.pt: its epoch (-4) is not a whole number "
            "of epochs done, 0 or more",
        (SINGLE, *small, "--dataset", "mnist", "--data-dir", str(files / "label")):
            f"error: {raw}/train-labels-idx1-ubyte holds label 12, not a digit from 0 to 9",
        (SINGLE, *small[:-1], str(files / "empty")):
            f"error: --save {files}/empty cannot be written: Is a directory",
        (DDP,): "error: not launched by torchrun: see the commands at the top of this script"}
    for (script, *args), line in cases.items():
        result = as_script(script, args)
        where = f"{script} {args}: exit {result.returncode}\n{result.stderr}"
        assert result.returncode == 2 and result.stderr == line + "\n", where
        assert "epoch 0/" not in result.stdout, where  # refused before any evaluation, any step
