"""Chapter 6, the LM trainer's debugging aids, under real torchrun launches on CPU/gloo. These
tests prove:

1. --check-sync stops a run whose replicas drifted apart (a probe in tests/ nudges one weight on
   rank 1 behind DDP's back) at the next evaluation, with exit code 3, before it saves;
2. a rank that stops calling collectives is not a hang: the other rank's all-reduce fails after
   --dist-timeout seconds and torchrun ends the job, within a minute.
--debug's per-rank window lines (whole, in rank order, the windows each rank really reads) and a
healthy run passing the sync check are proved in test_minigpt.py; the unused-parameter error and
the skipped-collective timeout in their simplest form are blocks of docs/troubleshooting.md, run by
test_docs.py.
"""
import re
import time

from helpers import TINY_GPT, command, finish, start

PROBE = "tests/probe_minigpt.py"
FLAGS = TINY_GPT + ["--max-steps", 8, "--eval-every", 4]


def test_check_sync_stops_a_desynchronised_replica_before_it_saves(tmp_path):
    cmd = command(PROBE, ["desync", "2:1", *FLAGS, "--check-sync", "--save", tmp_path / "ck.pt",
                          "--save-every", 4], nproc=2)
    result = finish(start(cmd, tmp_path), cmd)
    assert result.returncode != 0 and "exitcode  : 3" in result.stderr, result.stderr[-2000:]
    assert "error: --check-sync: replicas differ after step 4" in result.stderr
    assert "step 4/8 | val loss" in result.stdout and "step 5/8" not in result.stdout
    assert not (tmp_path / "ck.pt").exists()  # the diverged weights were never written


def test_a_stuck_rank_is_caught_by_the_timeout_not_a_hang(tmp_path):
    cmd = command(PROBE, ["hang", "3:1", *FLAGS, "--dist-timeout", 2, "--save", ""], nproc=2)
    began = time.monotonic()
    result = finish(start(cmd, tmp_path), cmd, time_limit=120)
    took = time.monotonic() - began
    assert result.returncode != 0 and took < 60, f"exit {result.returncode} after {took:.0f}s"
    assert "step 2/8 | loss" in result.stdout and "step 3/8 | loss" not in result.stdout
    assert re.search(r"\[rank0\]: RuntimeError: .*Timed out waiting 2000ms", result.stderr), \
        result.stderr[-2000:]
