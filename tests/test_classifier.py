"""Chapters 1 and 2 (train_single_gpu.py, train_ddp_basic.py) under real launches: plain `python`
and `torchrun` on CPU/gloo. These tests prove:

1. the README demo (`torchrun --nproc_per_node=2 train_ddp_basic.py`, default flags) learns
   (>= 90% val accuracy), prints each log line once and writes exactly one checkpoint, with no
   `module.` keys;
2. DDP on 2 processes with --batch-size B each (per process; a global batch of 2B) ends with the
   weights of one process with --batch-size 2B (the same global batch);
3. validation metrics count each sample once at world size 1, 2 and 3 on a set of odd size, and
   checkpoints cross-load between the two scripts;
4. evaluating the plain module (not the DDP wrapper) lets ranks with unequal numbers of batches
   finish: ResNet-18, whose BatchNorm buffers the wrapper would broadcast, on 5 + 4 val samples;
5. resume equals the uninterrupted run (the single script here; DDP in test_faults.py);
6. the real MNIST loader reads MNIST-format files (tiny ones written here), with DDP;
7. the chapter 1 default run, like the demo, reaches >= 90%.
The ranks' shards (disjoint, covering, reshuffled each epoch) are checked in test_launcher.py's
two-node run; bad inputs in test_classifier_inputs.py; the lesson's diff in test_lesson_shape.py.
"""
import os

import pytest
import torch
from helpers import (DDP, SINGLE, SMALL, classifier_runs, demo_run, in_process, make_mnist, ok,
                     summary, weights)


def test_readme_demo_learns_logs_once_and_saves_once():
    result, folder = demo_run()  # exactly the README's demo, run from an empty folder
    out = ok(result)
    assert summary(out)["val_acc"] >= 0.90
    lines = out.splitlines()
    for prefix in ["world size 2 | global batch 128", "data synthetic |", "model cnn |",
                   "epoch 0/3 |", "epoch 1/3 |", "epoch 3/3 |", "done |", "summary ",
                   "saved checkpoints/classifier.pt after epoch 3"]:
        assert sum(line.startswith(prefix) for line in lines) == 1, f"{prefix!r} not once:\n{out}"
    assert os.listdir(folder / "checkpoints") == ["classifier.pt"]  # one writer, no temp file
    state = torch.load(folder / "checkpoints" / "classifier.pt", map_location="cpu",
                       weights_only=True)
    assert set(state) == {"model", "optimizer", "epoch", "args", "rng"}
    assert state["epoch"] == 3 and state["args"]["batch_size"] == 64
    assert state["model"] and not any(key.startswith("module.") for key in state["model"])


def test_chapter_1_default_run_learns(tmp_path):
    out = in_process(SINGLE, ["--save", tmp_path / "c.pt"])
    assert "world size 1 | global batch 64" in out and summary(out)["val_acc"] >= 0.90


def assert_weights_close(a, b, exact=False):
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:  # the same sums in another order: float32 rounding only
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def test_ddp_two_processes_equal_one_process_with_twice_the_batch():
    d = classifier_runs()["dir"]
    assert_weights_close(weights(d / "d2.pt"), weights(d / "s2.pt"))
    # and training did move the weights: equality is not two copies of the initialisation
    assert not torch.allclose(weights(d / "s1.pt")["0.weight"], weights(d / "s2.pt")["0.weight"])


def test_val_metrics_identical_at_world_size_1_2_and_3_and_checkpoints_cross_load():
    """s2.pt (single script) evaluated by the DDP script as one process and as three; d2.pt (DDP,
    two processes) evaluated by the single script: each script reads the other's checkpoint, and
    the validation metrics over 101 samples agree at every world size."""
    runs = classifier_runs()
    d, reference = runs["dir"], summary(runs["s2"].stdout)
    one = summary(in_process(DDP, [*SMALL, "--eval-only", "--resume", d / "s2.pt"]))
    for got in (one, summary(runs["w3_eval"].stdout)):
        assert got["val_samples"] == 101 and got["val_acc"] == reference["val_acc"]
        assert got["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-6)
    two = summary(runs["d2"].stdout)
    single = summary(in_process(SINGLE, [*SMALL, "--eval-only", "--resume", d / "d2.pt"]))
    assert two["val_samples"] == single["val_samples"] == 101 and two["val_acc"] == single["val_acc"]
    assert two["val_loss"] == pytest.approx(single["val_loss"], rel=1e-6)


def test_unequal_eval_batches_with_batchnorm_finish_on_every_rank():
    """9 val samples on 2 ranks: 5 and 4, so with batch 4 two batches against one. Through the DDP
    wrapper, ResNet-18's BatchNorm buffer broadcast would wait for a forward that never comes."""
    out = ok(classifier_runs()["bn"])  # --model resnet18, 16 train and 9 val samples, batch 4
    assert "epoch 1/1 | train loss" in out and summary(out)["val_samples"] == 9


def test_resume_equals_uninterrupted_run():
    runs = classifier_runs()
    d, out = runs["dir"], runs["s1_resumed"].stdout
    assert "epoch 1/2 | val loss" in out and "epoch 1/2 | train loss" not in out  # from epoch 1
    assert_weights_close(weights(d / "s1r.pt"), weights(d / "s2.pt"), exact=True)
    assert torch.load(d / "s1r.pt", weights_only=True)["epoch"] == 2


def test_real_mnist_loader_reads_idx_files_with_ddp(tmp_path):
    make_mnist(tmp_path / "data")
    out = in_process(DDP, ["--dataset", "mnist", "--data-dir", tmp_path / "data", "--epochs", 1,
                           "--save", ""])
    assert "world size 1 |" in out and "data mnist | 60 train / 20 val samples" in out
    assert "epoch 1/1 | train loss" in out and summary(out)["val_samples"] == 20
