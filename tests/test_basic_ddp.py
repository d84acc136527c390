"""Chapters 1 and 2 under real launches (plain `python` and `torchrun` on CPU/gloo). These tests prove:

1. the README demo (`torchrun --nproc_per_node=2 train_ddp_basic.py`, default flags) learns (>= 90% val
   accuracy), prints each log line once and writes exactly one checkpoint, with no `module.` keys;
2. DDP on 2 processes with --batch-size B ends with the weights of one process with --batch-size 2B;
3. --check-sync passes on a healthy run and stops a run whose replica was nudged behind DDP's back;
4. the ranks' training shards are disjoint, cover the data, and change order every epoch;
5. validation metrics count each sample once at world size 1, 2 and 3 on a set of odd size;
6. resume equals the uninterrupted run, and checkpoints cross-load between the two scripts;
7. ResNet-18 (BatchNorm buffers) trains under DDP and evaluates ranks with unequal batch counts;
8. the real MNIST loader reads MNIST-format files (tiny ones written here), with DDP as one process.
Bad inputs are in test_bad_inputs.py; the shape of the lesson's diff in test_lesson_diff.py.
"""
import json
import os

import pytest
import torch

from conftest import DDP, SMALL, make_mnist, ok, run, summary, weights


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


def test_check_sync_catches_a_desynchronised_replica(tmp_path):
    result = run("tests/ddp_probe.py", ["desync", "-", *SMALL, "--batch-size", 16, "--epochs", 2, "--save", "",
                                        "--check-sync"], nproc=2)
    assert result.returncode != 0
    assert "error: --check-sync: replicas differ after epoch 1" in result.stderr
    assert "epoch 2/2" not in result.stdout  # it stopped at the first check


def test_shards_are_disjoint_cover_the_data_and_reshuffle_each_epoch(tmp_path):
    ok(run("tests/ddp_probe.py", ["record", tmp_path, "--train-samples", 100, "--val-samples", 10, "--epochs", 2,
                                  "--batch-size", 10, "--save", "", "--check-sync"], nproc=2))
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [len(s) for s in seen] == [100, 100]  # 50 samples per rank per epoch, 2 epochs
    for epoch in (0, 1):
        shard0, shard1 = (set(s[50 * epoch:50 * epoch + 50]) for s in seen)
        assert len(shard0) == len(shard1) == 50 and not shard0 & shard1
        assert shard0 | shard1 == set(range(100))
    for s in seen:
        assert s[:50] != s[50:]  # set_epoch: a different order in epoch 2


def test_val_metrics_identical_at_world_size_1_2_and_3(runs):
    """Weights from s2.pt evaluated by the single script (at the end of its run), the DDP script as one
    process and as three; d2's own weights evaluated by the single script and by its two-process run."""
    reference = summary(runs["s2"].stdout)
    assert "one-process group" in runs["w1_eval"].stdout
    for name in ("w1_eval", "w3_eval"):
        got = summary(runs[name].stdout)
        assert got["val_samples"] == 101 and got["val_acc"] == reference["val_acc"], name
        assert got["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-6), name
    two, one = summary(runs["d2"].stdout), summary(runs["single_reads_ddp"].stdout)
    assert two["val_samples"] == one["val_samples"] == 101 and two["val_acc"] == one["val_acc"]
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)


def test_resume_equals_uninterrupted_run(runs):
    d = runs["dir"]
    out = runs["s1_resumed"].stdout
    assert "epoch 1/2 | val loss" in out and "epoch 1/2 | train loss" not in out  # it went on from epoch 1
    assert_weights_close(weights(d / "s1r.pt"), weights(d / "s2.pt"), exact=True)
    assert torch.load(d / "s1r.pt", weights_only=True)["epoch"] == 2


def test_checkpoints_cross_load_between_the_scripts(runs):
    d = runs["dir"]
    # single-process epoch 1, then DDP epoch 2: the same weights as either uninterrupted run
    assert_weights_close(weights(d / "ds1.pt"), weights(d / "s2.pt"))
    out = runs["ddp_reads_single"].stdout
    assert "epoch 2/2 | train loss" in out and "epoch 1/2 | train loss" not in out  # it trained epoch 2 only


def test_resnet18_trains_under_ddp_with_unequal_eval_batches(tmp_path):
    # 9 val samples over 2 ranks: 5 and 4, so with batch 4 rank 0 runs two eval batches and rank 1 one;
    # evaluating through the DDP wrapper would hang on its BatchNorm buffer broadcast
    result = ok(run(DDP, ["--model", "resnet18", "--train-samples", 16, "--val-samples", 9, "--batch-size", 4,
                          "--epochs", 1, "--save", tmp_path / "r.pt"], nproc=2))
    assert summary(result)["val_samples"] == 9
    keys = weights(tmp_path / "r.pt").keys()
    assert "bn1.running_mean" in keys and not any(k.startswith("module.") for k in keys)


def test_real_mnist_loader_reads_idx_files_with_ddp_as_one_process(tmp_path):
    make_mnist(tmp_path / "data")
    out = ok(run(DDP, ["--dataset", "mnist", "--data-dir", tmp_path / "data", "--epochs", 1, "--save", ""]))
    assert "world size 1 |" in out and "data mnist | 60 train / 20 val samples" in out
    assert "epoch 1/1 | train loss" in out and summary(out)["val_samples"] == 20
