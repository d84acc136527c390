"""Shared helpers: launch the course's scripts as a user would (plain `python` or real `torchrun` on
CPU/gloo), with one thread per process, loopback-only rendezvous and a hard time limit, and read
their output."""
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIME_LIMIT = int(os.environ.get("COURSE_TEST_TIME_LIMIT", 240))  # seconds; longer is a hang: fail, do not wait


def command(script, args=(), nproc=None, torchrun_args=()):
    """`python script args` when nproc is None, else `torchrun --standalone --nproc_per_node=N script args`.
    --standalone rendezvouses on localhost at a free port, so concurrent launches never collide."""
    script = str(REPO / script) if not os.path.isabs(script) else script
    if nproc is None:
        return [sys.executable, script, *map(str, args)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            *torchrun_args, script, *map(str, args)]


def environment(extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra or {}))
    return env


def start(cmd, cwd, env=None):
    return subprocess.Popen(cmd, cwd=cwd, env=environment(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def descendants(pid):
    """The PIDs of every process below pid (torchrun's workers may sit in sessions of their own)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def finish(proc, cmd, time_limit=TIME_LIMIT):
    try:
        out, err = proc.communicate(timeout=time_limit)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *descendants(proc.pid)]:  # the whole tree: a worker left alive holds the pipes
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {time_limit}s: {' '.join(cmd)}\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run(script, args=(), nproc=None, cwd=None, env=None, torchrun_args=()):
    """Run one launch to the end and return its CompletedProcess (returncode, stdout, stderr)."""
    cmd = command(script, args, nproc, torchrun_args)
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


SINGLE, DDP = "train_single_gpu.py", "train_ddp_basic.py"
SMALL = ["--train-samples", 512, "--val-samples", 101, "--seed", 3]  # 101: odd, so no world size divides it


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The README's demo, `torchrun --standalone --nproc_per_node=2 train_ddp_basic.py`, run once from an
    empty folder: (its CompletedProcess, that folder)."""
    folder = tmp_path_factory.mktemp("demo")
    return run(DDP, nproc=2, cwd=folder), folder


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """One set of small runs shared by the equivalence, resume, cross-load, world-size and two-node tests."""
    d = tmp_path_factory.mktemp("runs")
    single, ddp = SMALL + ["--batch-size", 32], SMALL + ["--batch-size", 16]  # global batch 32 in both
    r = {}
    import importlib
    sys.path.insert(0, str(REPO))
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the launched runs (OMP_NUM_THREADS=1): the same float sums, bit for bit
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the 1-epoch run to resume from: here, no launch needed
            importlib.import_module(SINGLE[:-3]).main([str(a) for a in single + ["--epochs", 1, "--save", d / "s1.pt"]])
    finally:
        torch.set_num_threads(threads)
    # the uninterrupted 2-epoch run (plain python), beside the resumed one: the single-process script under
    # torchrun, which ignores the variables torchrun sets and runs as usual (one process each)
    cmd = command(SINGLE, single + ["--epochs", 2, "--resume", d / "s1.pt", "--save", d / "s1r.pt"], nproc=1)
    resumed = start(cmd, REPO)
    (r["s2"],) = run_many([(SINGLE, single + ["--epochs", 2, "--save", d / "s2.pt"])])
    r["s1_resumed"] = finish(resumed, cmd)
    r["d2"] = run(DDP, ddp + ["--epochs", 2, "--save", d / "d2.pt", "--check-sync", "--debug"], nproc=2)
    r["w3_eval"] = run(DDP, ddp + ["--eval-only", "--resume", d / "s2.pt"], nproc=3)
    for result in r.values():
        ok(result)
    r["dir"], r["ddp_flags"] = d, ddp + ["--epochs", 2]
    return r


@pytest.fixture
def in_process(capsys):
    """Run a trainer's main(argv) inside this test process (no launch, no torch import to wait for) and
    return what it printed; a DDP trainer's one-process group is left again afterwards."""
    import importlib

    import torch.distributed as dist
    sys.path.insert(0, str(REPO))

    def call(script, args):
        capsys.readouterr()
        importlib.import_module(script[:-3]).main([str(a) for a in args])
        return capsys.readouterr().out

    yield call
    if dist.is_initialized():
        dist.destroy_process_group()
