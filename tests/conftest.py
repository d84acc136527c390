"""Shared helpers: launch the course's scripts as a user would (plain `python` or real `torchrun` on
CPU/gloo), with one thread per process, loopback-only rendezvous and a hard time limit, and read
their output."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIME_LIMIT = 240  # seconds; a launch that takes longer is a hang, and the test fails instead of waiting


def command(script, args=(), nproc=None):
    """`python script args` when nproc is None, else `torchrun --standalone --nproc_per_node=N script args`.
    --standalone rendezvouses on localhost at a free port, so concurrent launches never collide."""
    script = str(REPO / script) if not os.path.isabs(script) else script
    if nproc is None:
        return [sys.executable, script, *map(str, args)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            script, *map(str, args)]


def environment(extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra or {}))
    return env


def start(cmd, cwd, env=None):
    return subprocess.Popen(cmd, cwd=cwd, env=environment(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(proc, cmd):
    try:
        out, err = proc.communicate(timeout=TIME_LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {TIME_LIMIT}s: {' '.join(cmd)}\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run(script, args=(), nproc=None, cwd=None, env=None):
    """Run one launch to the end and return its CompletedProcess (returncode, stdout, stderr)."""
    cmd = command(script, args, nproc)
    return finish(start(cmd, cwd or REPO, env), cmd)


def run_many(launches, cwd=None, at_once=2):
    """One-process launches, `at_once` side by side (the machine has two cores); each is (script, args).
    Returns their CompletedProcesses in the order given."""
    cmds = [command(script, args) for script, args in launches]
    results = []
    for i in range(0, len(cmds), at_once):
        procs = [(start(cmd, cwd or REPO), cmd) for cmd in cmds[i:i + at_once]]
        results += [finish(proc, cmd) for proc, cmd in procs]
    return results


def ok(result):
    """Assert a launch succeeded, showing its output if not; return its stdout."""
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    return result.stdout


def summary(stdout):
    """The machine-readable `summary {json}` line every trainer prints once at the end."""
    lines = [line for line in stdout.splitlines() if line.startswith("summary ")]
    assert len(lines) == 1, f"expected one summary line, got {len(lines)}:\n{stdout}"
    return json.loads(lines[0][len("summary "):])


def weights(path):
    import torch
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def write_idx(path, array):
    """An MNIST-format (IDX) file: magic 0x08 (ubyte) + ndim, big-endian sizes, then the bytes."""
    import numpy as np
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def make_mnist(root, n_train=60, n_val=20):
    import numpy as np
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_val)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    return raw
