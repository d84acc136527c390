"""Chapters 1 and 2 under real launches (plain `python` and `torchrun` on CPU/gloo). These tests prove:

1. the README demo (`torchrun --nproc_per_node=2 train_ddp_basic.py`, default flags) learns (>= 90% val
   accuracy), prints each log line once and writes exactly one checkpoint, with no `module.` keys;
2. DDP on 2 processes with --batch-size B ends with the weights of one process with --batch-size 2B;
3. --check-sync passes on a healthy run, and --debug (which includes it) stops a run whose replica was
   nudged behind DDP's back
   (ResNet-18, whose BatchNorm buffers would hang an evaluation through the DDP wrapper);
4. validation metrics count each sample once at world size 1, 2 and 3 on a set of odd size, and
   checkpoints cross-load between the two scripts;
5. resume equals the uninterrupted run (the single script here; DDP in test_faults.py);
6. (the ranks' shards are disjoint, cover the data and reshuffle each epoch: test_launcher.py's two-node run);
7. the real MNIST loader reads MNIST-format files (tiny ones written here), with DDP as one process.
Bad inputs are in test_bad_inputs.py; the shape of the lesson's diff in test_lesson_diff.py.
"""
import os

import pytest
import torch

from conftest import DDP, SINGLE, SMALL, make_mnist, ok, run, summary, weights


def test_readme_demo_learns_logs_once_and_saves_once(demo):
    result, tmp_path = demo  # exactly the README's demo, run from an empty folder
    out = ok(result)
    assert summary(out)["val_acc"] >= 0.90
    lines = out.splitlines()
    for prefix in ["world size 2 |", "data synthetic |", "model cnn |", "epoch 0/3 |", "epoch 1/3 |",
                   "epoch 3/3 |", "done |", "summary ", "saved checkpoints/classifier.pt after epoch 3"]:
        assert sum(line.startswith(prefix) for line in lines) == 1, f"{prefix!r} not printed exactly once:\n{out}"
    assert os.listdir(tmp_path / "checkpoints") == ["classifier.pt"]  # one writer, no temp file left behind
    state = torch.load(tmp_path / "checkpoints" / "classifier.pt", map_location="cpu", weights_only=True)
    assert set(state) == {"model", "optimizer", "epoch", "args", "rng"}
    assert state["epoch"] == 3 and state["args"]["batch_size"] == 64
    assert state["model"] and not any(key.startswith("module.") for key in state["model"])


def assert_weights_close(a, b, exact=False):
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:  # the same sums in another order: float32 rounding only
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def test_ddp_two_processes_equal_one_process_with_twice_the_batch(runs):
    d = runs["dir"]
    assert_weights_close(weights(d / "d2.pt"), weights(d / "s2.pt"))
    # and training did move the weights: equality is not two copies of the initialisation
    assert not torch.allclose(weights(d / "s1.pt")["0.weight"], weights(d / "s2.pt")["0.weight"])


def test_check_sync_passes_on_a_healthy_run(runs):
    assert "error" not in runs["d2"].stderr.lower() and "epoch 2/2 |" in runs["d2"].stdout


def test_check_sync_catches_a_desynchronised_resnet_replica(tmp_path):
    """ResNet-18 under DDP on 2 processes; rank 1 nudges one weight after epoch 1, behind DDP's back. The
    run evaluates (9 val samples: 5 on rank 0, 4 on rank 1, so with batch 4 two batches against one; through
    the DDP wrapper its BatchNorm buffer broadcast would hang) and then the check stops it. The run asks for
    --debug, which includes --check-sync (the healthy run of the `runs` fixture passes both flags)."""
    result = run("tests/ddp_probe.py", ["desync", "-", "--model", "resnet18", "--train-samples", 16, "--val-samples", 9,
                                        "--batch-size", 4, "--epochs", 2, "--save", "", "--debug"], nproc=2)
    assert "epoch 1/2 | train loss" in result.stdout  # trained and evaluated epoch 1, unequal batches and all
    assert result.returncode != 0
    assert "error: --check-sync: replicas differ after epoch 1" in result.stderr
    assert "epoch 2/2" not in result.stdout  # it stopped at the first check


def test_val_metrics_identical_at_world_size_1_2_and_3_and_checkpoints_cross_load(runs, in_process):
    """s2.pt (single script) evaluated by the DDP script as one process and as three; d2.pt (DDP, two
    processes) evaluated by the single script: each script reads the other's checkpoint, and the
    validation metrics over 101 samples agree at every world size."""
    d, reference = runs["dir"], summary(runs["s2"].stdout)
    one = in_process(DDP, [*SMALL, "--eval-only", "--resume", d / "s2.pt"])
    assert "one-process group" in one
    for got in (summary(one), summary(runs["w3_eval"].stdout)):
        assert got["val_samples"] == 101 and got["val_acc"] == reference["val_acc"]
        assert got["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-6)
    two = summary(runs["d2"].stdout)
    single = summary(in_process(SINGLE, [*SMALL, "--eval-only", "--resume", d / "d2.pt"]))
    assert two["val_samples"] == single["val_samples"] == 101 and two["val_acc"] == single["val_acc"]
    assert two["val_loss"] == pytest.approx(single["val_loss"], rel=1e-6)


def test_resume_equals_uninterrupted_run(runs):
    d = runs["dir"]
    out = runs["s1_resumed"].stdout
    assert "epoch 1/2 | val loss" in out and "epoch 1/2 | train loss" not in out  # it went on from epoch 1
    assert_weights_close(weights(d / "s1r.pt"), weights(d / "s2.pt"), exact=True)
    assert torch.load(d / "s1r.pt", weights_only=True)["epoch"] == 2


def test_real_mnist_loader_reads_idx_files_with_ddp_as_one_process(tmp_path, in_process):
    make_mnist(tmp_path / "data")
    out = in_process(DDP, ["--dataset", "mnist", "--data-dir", tmp_path / "data", "--epochs", 1, "--save", ""])
    assert "world size 1 |" in out and "data mnist | 60 train / 20 val samples" in out
    assert "epoch 1/1 | train loss" in out and summary(out)["val_samples"] == 20
