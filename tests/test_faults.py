"""Chapter 5, faults. These tests prove that
- a worker killed with a real SIGKILL (found by its PID and RANK) under `torchrun --max-restarts=1` is
  restarted with its peer, `--resume auto` picks up the last checkpoint, and the run ends with exactly the
  weights of the uninterrupted README demo;
- without restarts, the same kill ends the whole job with a non-zero exit within 60 s (no hang), and the
  last checkpoint on disk is intact and loads;
- a node whose peer never joins fails within --join-timeout, not after the default minutes;
- a checkpoint write that fails half-way (the disk fills, the process dies) never leaves a truncated file
  under the final name: the previous checkpoint is still there, whole, in all three trainers.
The LM's exact resume after a crash at a chosen step is in test_minigpt.py.
"""
import concurrent.futures
import functools
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (DDP, REPO, command, demo_run, descendants, finish, free_port, ok, start,
                     trainer, weights)

RESTART_FIX = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch/pytorch#135712, see README chapter 5


def worker_of_rank(agent, rank):
    """The PID of the torchrun worker whose environment says RANK=rank."""
    for pid in descendants(agent.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b"".join(env):
            return pid
    raise AssertionError(f"no worker with RANK={rank} under {agent.pid}")


def wait_for(path, agent, seconds=180):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert agent.poll() is None, "the job ended before writing its first checkpoint"
        assert time.monotonic() < deadline, f"no {path} after {seconds}s"
        time.sleep(0.02)


@pytest.fixture(scope="module", autouse=True)
def lonely_node():
    """Node 0 of 2 through the launcher, whose peer never comes: started as the module starts, it
    waits out its join timeout while the other tests run. Call it for (its CompletedProcess, the
    seconds from its start to its end)."""
    cmd = [str(REPO / "launch_multinode_ddp.sh"), "--nnodes", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "--join-timeout", "3", "--node-rank", "0", "--run", DDP]
    began = time.monotonic()
    agent = start(cmd, REPO, {"TORCHRUN": f"{sys.executable} -m torch.distributed.run"})
    result = functools.cache(lambda: (finish(agent, cmd, time_limit=90),
                                      time.monotonic() - began))  # an upper bound on its time
    yield result
    result()  # never leave it running


def kill_rank_1_once_saved(path, agent):
    """Wait for the job's first checkpoint at `path`, then SIGKILL its rank 1 worker; returns when
    (time.monotonic()). Run in a thread: it reads /proc and sends a signal, nothing else."""
    wait_for(path, agent)
    os.kill(worker_of_rank(agent, 1), signal.SIGKILL)
    return time.monotonic()


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The module's two SIGKILL runs, side by side, each worker killed by a thread of its own as
    soon as its job's first checkpoint is on disk: the README demo's flags under
    `torchrun --max-restarts=1` with --resume auto ("restarted"), and a 40-epoch run without
    restarts ("ended"). {name: (CompletedProcess, its folder, seconds from the kill to its end)}."""
    d = {name: tmp_path_factory.mktemp(name) for name in ("restarted", "ended")}
    cmds = {"restarted": command(DDP, ["--save-every", 1, "--resume", "auto"], nproc=2,
                                 torchrun_args=["--max-restarts=1"]),
            "ended": command(DDP, ["--epochs", 40, "--save-every", 1, "--save", "ck.pt"], nproc=2)}
    agents = {"restarted": start(cmds["restarted"], d["restarted"], RESTART_FIX),
              "ended": start(cmds["ended"], d["ended"])}
    saved = {"restarted": d["restarted"] / "checkpoints" / "classifier.pt",
             "ended": d["ended"] / "ck.pt"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        kills = {name: pool.submit(kill_rank_1_once_saved, saved[name], agent)
                 for name, agent in agents.items()}
    ended = {}
    for name in ("ended", "restarted"):  # the one that ends at once first: its time is exact
        ended[name] = (finish(agents[name], cmds[name], time_limit=60 if name == "ended" else 240),
                       time.monotonic())
    return {name: (result, d[name], at - kills[name].result())
            for name, (result, at) in ended.items()}


def test_sigkill_with_a_restart_resumes_to_the_uninterrupted_result(killed):
    result, folder, _ = killed["restarted"]  # the demo's flags otherwise: the same training
    out = ok(result)
    assert "resumed from checkpoints/classifier.pt after epoch" in out  # the restarted group went on
    demo_folder = demo_run()[1]
    a = weights(folder / "checkpoints" / "classifier.pt")
    b = weights(demo_folder / "checkpoints" / "classifier.pt")
    assert all(torch.equal(a[key], b[key]) for key in a)


def test_sigkill_without_restarts_ends_the_job_within_60s_and_keeps_the_checkpoint(killed):
    result, folder, since_kill = killed["ended"]
    assert result.returncode != 0 and since_kill < 60
    assert "Signal 9 (SIGKILL)" in result.stderr  # torchrun's report names the cause
    state = torch.load(folder / "ck.pt", map_location="cpu", weights_only=True)
    assert 1 <= state["epoch"] < 40 and state["model"]


def test_a_node_whose_peer_never_joins_fails_within_the_join_timeout(lonely_node):
    result, took = lonely_node()  # took: until this test, the kill tests' time included
    assert result.returncode != 0 and took < 150  # torchrun's own default alone is 600 s
    assert "node 0 of 2: waiting up to 3s for all 2 nodes at 127.0.0.1" in result.stderr
    assert "RendezvousTimeoutError" in result.stderr


@pytest.mark.parametrize("script", ["train_single_gpu.py", "train_ddp_basic.py", "train_ddp_minigpt.py"])
def test_a_failed_checkpoint_write_leaves_the_previous_file_whole(script, tmp_path, monkeypatch):
    module = trainer(script)
    path = tmp_path / "ck.pt"
    path.write_bytes(b"the previous checkpoint")

    def write_half_then_fail(obj, f):
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module.torch, "save", write_half_then_fail)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    args = module.parse_args([])
    with pytest.raises(module.SaveFailed, match=rf"^cannot save {re.escape(str(path))}: the disk "
                       rf"holding {re.escape(str(tmp_path))} is full: \d+\.\d [kM]B free, a checkpoint "
                       r"needs about \d+\.\d kB \(No space left on device\)$"):  # 24 bytes
        if script == "train_ddp_minigpt.py":  # what rank 0 runs inside save_on_rank_0
            module.write_file(str(path), {"model": model.state_dict()})
        else:
            module.save_checkpoint(str(path), model, optimizer, 1, args)
    assert path.read_bytes() == b"the previous checkpoint"  # untouched under the final name
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # and the partial temp file is gone
