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

import pytest
from helpers import TINY_GPT, command, finish, start

PROBE = "tests/probe_minigpt.py"
FLAGS = TINY_GPT + ["--max-steps", 8, "--eval-every", 4]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The module's two launches, side by side: {name: (CompletedProcess, seconds it took, folder)}.
    A --dist-timeout of 5 s, not less: two launches side by side must still join in time."""
    d = {name: tmp_path_factory.mktemp(name) for name in ("desync", "hang")}
    cmds = {"desync": command(PROBE, ["desync", "2:1", *FLAGS, "--check-sync", "--save",
                                      d["desync"] / "ck.pt", "--save-every", 4], nproc=2),
            "hang": command(PROBE, ["hang", "3:1", *FLAGS, "--dist-timeout", 5, "--save", ""],
                            nproc=2)}
    began = time.monotonic()
    started = {name: start(cmd, d[name]) for name, cmd in cmds.items()}
    results = {}
    for name, proc in started.items():
        result = finish(proc, cmds[name], time_limit=120)
        results[name] = (result, time.monotonic() - began, d[name])
    return results


def test_check_sync_stops_a_desynchronised_replica_before_it_saves(launched):
    result, _, folder = launched["desync"]
    assert result.returncode != 0 and "exitcode  : 3" in result.stderr, result.stderr[-2000:]
    assert "error: --check-sync: replicas differ after step 4" in result.stderr
    assert "step 4/8 | val loss" in result.stdout and "step 5/8" not in result.stdout
    assert not (folder / "ck.pt").exists()  # the diverged weights were never written


def test_a_stuck_rank_is_caught_by_the_timeout_not_a_hang(launched):
    result, took, _ = launched["hang"]  # at most: the desync run was finished first
    assert result.returncode != 0 and took < 60, f"exit {result.returncode} after {took:.0f}s"
    assert "step 2/8 | loss" in result.stdout and "step 3/8 | loss" not in result.stdout
    assert re.search(r"\[rank0\]: RuntimeError: .*Timed out waiting 5000ms", result.stderr), \
        result.stderr[-2000:]
