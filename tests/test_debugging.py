"""Chapter 6, debugging aids of the DDP trainers, under real torchrun launches on CPU/gloo. These tests prove:

1. --debug makes every rank (not only rank 0) report its data shard, `[rank N] train COUNT: [first ids]..`,
   the shards it reports are the DistributedSampler's (sizes add up, first ids differ between ranks), and the
   lines come out whole and in rank order (rank 0 prints the gathered lines; the suite runs with
   PYTHONUNBUFFERED=1, under which lines printed by two processes at once splice into each other);
2. a rank that stops calling collectives (the LM trainer's teaching aid DDP_FAIL_MODE=hang) is not a hang: the
   other rank's all-reduce fails after --dist-timeout seconds and torchrun ends the job, within a minute;
   --debug's per-rank window log comes out before it.
The sync check that --debug switches on is proved in test_basic_ddp.py (a nudged ResNet-18 replica); the
unused-parameter error and the skipped-collective timeout in their simplest form are blocks of
docs/troubleshooting.md, run by test_snippets.py.
"""
import re
import time

from torch.utils.data import DistributedSampler

from conftest import command, finish, start

GPT = "train_ddp_minigpt.py"
TINY = ["--n-layer", 2, "--n-head", 2, "--n-embd", 32, "--block-size", 32, "--eval-windows", 32, "--log-every", 1,
        "--max-steps", 8, "--save", ""]


def test_debug_logs_every_rank_shard_and_checks_sync(runs):
    out = runs["d2"].stdout  # 2 processes, 512 train / 101 val samples, --debug --check-sync
    shards = {int(m.group(1)): (int(m.group(2)), m.group(3), int(m.group(4)))
              for m in re.finditer(r"^\[rank (\d)\] train (\d+): \[([\d, ]+)\]\.\. \| val (\d+)$", out, re.M)}
    assert list(shards) == [0, 1], out  # both lines whole, rank 0's first
    for rank, (count, first_ids, val_count) in shards.items():  # what DistributedSampler deals (seed 3) to rank
        sampler = DistributedSampler(range(512), num_replicas=2, rank=rank, seed=3)
        assert (count, first_ids, val_count) == (256, ", ".join(map(str, list(sampler)[:4])), (51, 50)[rank])
    assert shards[0][1] != shards[1][1]  # different samples on each rank
    assert "epoch 2/2 |" in out and "replicas differ" not in runs["d2"].stderr  # the sync check passed twice


def test_a_stuck_rank_is_caught_by_the_timeout_not_a_hang(tmp_path):
    cmd = command(GPT, TINY + ["--dist-timeout", 2, "--debug"], nproc=2)
    began = time.monotonic()
    result = finish(start(cmd, tmp_path, {"DDP_FAIL_AT_STEP": "3", "DDP_FAIL_RANK": "1", "DDP_FAIL_MODE": "hang"}),
                    cmd, time_limit=120)
    took = time.monotonic() - began
    assert result.returncode != 0 and took < 60, f"exit {result.returncode} after {took:.0f}s"
    assert "step 2/8 | loss" in result.stdout and "step 3/8 | loss" not in result.stdout  # stuck at step 3
    assert re.search(r"\[rank0\]: RuntimeError: .*Timed out waiting 2000ms", result.stderr), result.stderr[-2000:]
    windows = re.findall(r"^\[rank (\d)\] \d+ micro-batches per epoch, first windows at tokens \[[\d, ]+\]$",
                         result.stdout, re.M)
    assert windows == ["0", "1"], result.stdout  # --debug: both ranks reported their windows, before the hang
