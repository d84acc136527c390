"""What the tests share: launching the course's scripts as a user would (plain `python`, or real
`torchrun` on CPU/gloo with one thread per process, loopback-only rendezvous and a hard time limit),
running a trainer's main() inside the test process, one small configuration per trainer, and the
chapter 2 runs that several test modules compare against (run once per test session, cached).

Tests import what they use from here by name; there is no conftest.py.
"""
import argparse
import collections
import contextlib
import errno
import functools
import importlib
import io
import json
import math
import os
import re
import runpy
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest.mock
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIME_LIMIT = int(os.environ.get("COURSE_TEST_TIME_LIMIT", 240))  # seconds; longer is a hang: fail
SINGLE, DDP, GPT = "train_single_gpu.py", "train_ddp_basic.py", "train_ddp_minigpt.py"

# one small configuration per trainer (flags as strings, as a user types them)
SMALL = ["--train-samples", "512", "--val-samples", "101", "--seed", "3"]  # 101: no world size divides it
TINY_GPT = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
            "--eval-windows", "32", "--log-every", "1", "--lr", "1e-2", "--warmup-steps", "2"]
# chapters 7 and 8 against chapter 3: a constant learning rate, so that runs of 10, 14 and 18 steps
# share their schedule. At the course's 3e-3, not TINY_GPT's 1e-2 without warmup: there Adam turns
# the rounding differences of two exact methods (a reduce-scatter and an all-reduce add in other
# orders) into 1e-3 in the weights by step 15. One token sampled after training (no test reads
# it; on the sharded trainers every rank samples, each token a forward with its collectives).
CONSTANT_LR = ["--warmup-steps", "0", "--lr", "3e-3", "--min-lr", "3e-3"]
SHARDED = TINY_GPT + ["--batch-size", "6", "--grad-accum", "2", *CONSTANT_LR,
                      "--max-new-tokens", "1"]
EVAL_6 = ["--eval-every", "6"]  # the references' validation losses at steps 0, 6, 12 and 18

sys.path.insert(0, str(REPO))  # the trainers are importable: `trainer(GPT).GPT`, `.parse_args`...


def trainer(script):
    """The module of a course script, imported from the repository root."""
    return importlib.import_module(script[:-3])


# ----------------------------------------------------------------------------------------- launches

def command(script, args=(), nproc=None, torchrun_args=()):
    """`python script args` if nproc is None, else `torchrun --standalone --nproc_per_node=N ...`.
    --standalone rendezvouses on localhost at a free port: concurrent launches never collide."""
    script = str(REPO / script) if not os.path.isabs(script) else script
    if nproc is None:
        return [sys.executable, script, *map(str, args)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *torchrun_args, script, *map(str, args)]


# What a user's shell may hold that the course's scripts, the launcher, torchrun, torch.distributed,
# gloo or NCCL read: no test launch inherits any of it, so that the suite gives the same answer in a
# clean shell, inside a SLURM allocation, or with debug switches on. A test that needs one sets it.
INHERITED_NOT = (
    "SLURM_",  # the launcher derives nodes, ranks and the head node from an allocation
    "TORCHRUN",  # the launcher's choice of launcher
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_", "PET_",  # torchrun and elastic; PET_X
    "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL", "TORCH_NCCL_",  # is a default for torchrun's
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",  # --x flag; debug and logging levels change the output
    "GLOO_", "TP_SOCKET_IFNAME", "NCCL_",  # which interface and transport the backends use
    "CUDA_VISIBLE_DEVICES",  # hidden below: the CPU tests run on CPU even on a GPU machine
    "OMP_NUM_THREADS",  # set to 1 below: two processes on two cores, and the same float sums
)


# A user's TORCH_DISTRIBUTED_DEBUG=DETAIL (it crashes DDP on gloo), and what the trainers answer.
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
DETAIL_WARNING = ("warning: TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DDP on gloo "
                  "(docs/troubleshooting.md): going on at INFO")  # chapters 2 and 3, which run DDP
DETAIL_UNTESTED = DETAIL_WARNING.replace("crashes DDP", "is untested")  # chapters 7 to 11


# A shell the suite must ignore: a two-node SLURM allocation, a launcher that fails, a rendezvous where
# nothing listens, a world of 64, debug switches, interfaces that do not exist, a GPU. Every address is
# loopback: even if the stripping broke, nothing would leave this machine.
HOSTILE_SHELL = {
    "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_STEP_NODELIST": "gpu[01-02]",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8", "SLURM_PROCID": "3",
    "SLURM_CPUS_PER_TASK": "16", "TORCHRUN": "false", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
    "WORLD_SIZE": "64", "RANK": "3", "LOCAL_RANK": "3", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
    "GLOO_SOCKET_IFNAME": "nonexistent0", "TP_SOCKET_IFNAME": "nonexistent0",
    "NCCL_SOCKET_IFNAME": "nonexistent0", "PET_NPROC_PER_NODE": "8", "CUDA_VISIBLE_DEVICES": "0",
    "OMP_NUM_THREADS": "7"}


@contextlib.contextmanager
def hostile_shell():
    """os.environ as a user's shell inside an allocation with debug switches on; then as it was."""
    saved = dict(os.environ)
    os.environ.update(HOSTILE_SHELL)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def environment(extra=None, cuda=False):
    """The user's environment without INHERITED_NOT, one thread per process, unbuffered output,
    and no GPU visible unless `cuda` (tests/test_gpu.py); then `extra` on top."""
    env = {k: v for k, v in os.environ.items()
           if not any(k == name or name.endswith("_") and k.startswith(name)
                      for name in INHERITED_NOT)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if cuda and "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    elif not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra or {})
    return env


def start(cmd, cwd, env=None, cuda=False):
    return subprocess.Popen(cmd, cwd=cwd, env=environment(env, cuda), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


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
    """Wait for a started launch; past the time limit, kill its whole tree and fail the test."""
    try:
        out, err = proc.communicate(timeout=time_limit)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *descendants(proc.pid)]:  # a worker left alive would hold the pipes
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        shown = cmd if isinstance(cmd, str) else " ".join(map(str, cmd))
        pytest.fail(f"timed out after {time_limit}s: {shown}\n{out}\n{err}")
    record(shlex.split(cmd) if isinstance(cmd, str) else cmd, proc.returncode)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run(script, args=(), nproc=None, cwd=None, env=None, torchrun_args=(), cuda=False):
    """Run one launch to the end and return its CompletedProcess (returncode, stdout, stderr).
    The GPUs are hidden unless `cuda`."""
    cmd = command(script, args, nproc, torchrun_args)
    return finish(start(cmd, cwd or REPO, env, cuda), cmd)


def started(launches):
    """Start every launch now ({name: (command, cwd, env)}) and return a function that waits for
    them all, once, and returns {name: CompletedProcess}. Launches side by side keep both cores busy
    through what one launch waits for (imports, rendezvous, teardown); a module starts its launches
    first, runs its in-process tests meanwhile, and reads the launches last."""
    procs = {name: (start(cmd, cwd, env), cmd) for name, (cmd, cwd, env) in launches.items()}
    return functools.cache(lambda: {name: finish(proc, cmd) for name, (proc, cmd) in procs.items()})


def start_two_nodes(script, args, nproc=1, restarts=0):
    """Two nodes of `nproc` processes each on this machine: the commands chapter 4's launcher
    prints (meeting at 127.0.0.1, torchrun restarting the group up to `restarts` times), each run
    by its own torchrun agent, started now (the environment is read now). Returns a function that
    waits for both and returns what each node printed."""
    printed = subprocess.run(
        [str(REPO / "launch_multinode_ddp.sh"), "--nnodes", "2", "--nproc-per-node", str(nproc),
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--join-timeout", "60",
         "--max-restarts", str(restarts), script, *map(str, args)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**environment(), "TORCHRUN": f"{sys.executable} -m torch.distributed.run"})
    nodes = [line for line in printed.stdout.splitlines() if line and not line.startswith("#")]
    agents = [subprocess.Popen(line, shell=True, cwd=REPO, env=environment(), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True) for line in nodes]
    return lambda: [ok(finish(agent, line)) for line, agent in zip(nodes, agents)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_script(script, args=()):
    """`python script args` run inside this process (runpy, as __main__: the script's own exit
    path) in the environment a launch gets, for what needs no process of its own: a refusal, its
    one line and its exit code. Returns a CompletedProcess."""
    cmd, code = [str(REPO / script), *map(str, args)], 0
    saved_env, saved_argv = dict(os.environ), sys.argv
    out, err, clean = io.StringIO(), io.StringIO(), environment()
    os.environ.clear()
    os.environ.update(clean)
    sys.argv = cmd
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(cmd[0], run_name="__main__")
    except SystemExit as exit_:  # as the interpreter maps it: None is 0, a text is 1
        code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
    record(cmd, code)
    return subprocess.CompletedProcess(cmd, code, out.getvalue(), err.getvalue())


# ------------------------------------------------------------------------ what the suite launched
# Every launch that ended with exit 0 in this test session, as (course script, its arguments): the
# flag matrix (tests/test_zz_switches.py) reads what really ran, not what a module declares. A
# probe stands for the trainer it runs; its own words before the trainer's flags are not flags.
LAUNCHED = []
PROBED = {"probe_classifier.py": DDP, "probe_minigpt.py": GPT}


def record(cmd, returncode):
    """Note a launch that succeeded: the first course script in its command, and what follows."""
    if returncode != 0:
        return
    for i, word in enumerate(map(str, cmd)):
        name = os.path.basename(word)
        script = PROBED.get(name) or (name.startswith("probe_") and
                                      name.replace("probe_", "train_")[:-3] + "_minigpt.py")
        script = script or name
        if script.endswith(".py") and (REPO / script).is_file():
            LAUNCHED.append((script, [str(word) for word in cmd[i + 1:]]))
            return


def switches(script):
    """{flag: (its choices or None, its default)} of a course script's parser, read without running
    the script: its parse_args builds the parser and is stopped where it would parse."""
    class Built(Exception):
        pass

    def stop(parser, *args, **kwargs):
        raise Built(parser)
    module = trainer(script)
    with unittest.mock.patch.object(argparse.ArgumentParser, "parse_args", stop):
        try:
            module.parse_args([])
        except Built as built:
            parser = built.args[0]
    return {action.option_strings[-1]: (action.choices, action.default)
            for action in parser._actions
            if action.option_strings and action.option_strings[-1] != "--help"}


def launched_values(args, flags):
    """{flag: the values one launch ran it with}: those given in its arguments ({None} for a flag
    without choices), or for a flag with choices not given, its default."""
    given = {}
    for i, word in enumerate(args):
        flag, _, value = word.partition("=")
        if flag in flags:
            value = value or (args[i + 1] if i + 1 < len(args) else None)
            given.setdefault(flag, set()).add(value if flags[flag][0] else None)
    for flag, (choices, default) in flags.items():
        if choices and flag not in given:
            given[flag] = {default}
    return given


# ------------------------------------------------------------------------------------------ outputs

def ok(result):
    """Assert a launch succeeded, showing its output if not; return its stdout."""
    assert result.returncode == 0, \
        f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    return result.stdout


def summary(stdout):
    """The machine-readable `summary {json}` line every trainer prints once at the end."""
    lines = [line for line in stdout.splitlines() if line.startswith("summary ")]
    assert len(lines) == 1, f"expected one summary line, got {len(lines)}:\n{stdout}"
    return json.loads(lines[0][len("summary "):])


# an LM trainer's log line: step, loss and gradient norm
LOG_LINE = re.compile(r"^step (\d+)/\d+ \| loss (\d+\.\d+) \| lr \S+ \| grad norm (\d+\.\d+)", re.M)


def logged_losses(stdout):
    """{step: loss} of an LM trainer's log lines."""
    return {int(m.group(1)): float(m.group(2)) for m in LOG_LINE.finditer(stdout)}


def logged_grad_norms(stdout):
    """{step: gradient norm before clipping} of an LM trainer's log lines."""
    return {int(m.group(1)): float(m.group(3)) for m in LOG_LINE.finditer(stdout)}


def logged_val_losses(stdout):
    """{step: validation loss} of an LM trainer's log lines (printed to 4 decimals)."""
    return {int(step): float(loss) for step, loss in
            re.findall(r"^step (\d+)/\d+ \| val loss (\d+\.\d+)", stdout, re.M)}


def weights(path):
    import torch
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


# -------------------------------------------------------------------------------------- in process

# FSDP's gradient reductions and weight gathers, under the names c10d gives them by release
FSDP_CALLS = {"reduce_scatter_tensor": "reduce_scatters",
              "reduce_scatter_single": "reduce_scatters",
              "all_gather_into_tensor": "all_gathers", "all_gather_single": "all_gathers"}


def count_calls(module, keys, seen, counting=lambda: True, wanted=lambda args, kwargs: True):
    """Wrap the functions of `module` named in `keys` ({name: key}; a name this release lacks is
    skipped) so that each call adds 1 to seen[key] while counting() holds, if wanted(args,
    kwargs) says the call is one to count; a call made of another one (reduce_scatter_tensor of
    reduce_scatter_single, say) counts once."""
    inside = [False]
    for name, key in keys.items():
        if not hasattr(module, name):
            continue

        def counted(*args, original=getattr(module, name), key=key, **kwargs):
            outermost = not inside[0]
            seen[key] += outermost and counting() and wanted(args, kwargs)
            inside[0] = True
            try:
                return original(*args, **kwargs)
            finally:
                inside[0] = not outermost
        setattr(module, name, counted)


def fsdp_bytes_held(model):
    """Bytes of a rank's stages' weights FSDP holds gathered and gradients it holds whole, now:
    the unsharded parameters of every unit that is unsharded, and every whole gradient (the fp32
    one FSDP accumulates while its gradient sync is off, else the parameter's own); TP's local part
    where TP split a parameter."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    def nbytes(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()
    total = 0
    for module in [*model.modules(), *getattr(model, "parts", [])]:
        group = fully_shard.state(module)._fsdp_param_group if isinstance(module, FSDPModule) \
            else None
        for param in group.fsdp_params if group else []:
            whole = getattr(param, "_unsharded_param", None)
            if whole is None:
                continue
            total += nbytes(whole) if group.is_unsharded else 0
            grad = param.unsharded_accumulated_grad
            grad = whole.grad if grad is None else grad
            total += nbytes(grad) if grad is not None else 0
    return total


def watch_reduce(schedule, model, seen):
    """Record in seen["in_step_bytes"] the most fsdp_bytes_held(model) just before a stage of the
    schedule reduce-scatters its gradients, after its last backward: a step's peak of both."""
    seen["in_step_bytes"] = 0
    for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
        def watched(*args, _reduce=stage.perform_reduce_grad, **kwargs):
            seen["in_step_bytes"] = max(seen["in_step_bytes"], fsdp_bytes_held(model))
            return _reduce(*args, **kwargs)
        stage.perform_reduce_grad = watched


def dropout_mask_hook(seen):
    """A forward hook for a Dropout module: the first mask it draws in training, hashed, goes to
    seen["dropout_mask"] (ranks that draw alike record the same hash)."""
    import hashlib

    def hook(module, inputs, output):
        if module.training and "dropout_mask" not in seen:
            mask = (output == 0).cpu().numpy().tobytes()
            seen["dropout_mask"] = hashlib.sha256(mask).hexdigest()[:12]
    return hook


class Saved:
    """The activation bytes autograd holds for backward, live and at their peak."""

    def __init__(self):
        self.model, self.counts, self.live, self.peak, self.first = None, {}, 0, 0, None

    def pack(self, tensor):
        storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()  # a DTensor's own
        key = storage.data_ptr()
        weights = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr()
                   for p in self.model.parameters()}
        if key in weights or tensor.requires_grad and tensor.is_leaf:
            return tensor  # a weight (gathered or not), not an activation
        if key not in self.counts:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.counts[key] = self.counts.get(key, 0) + 1
        return Held(self, tensor, key, storage.nbytes())

    def release(self, key, nbytes):
        self.counts[key] -= 1
        if not self.counts[key]:
            del self.counts[key]
            self.live -= nbytes


class Held:
    """A saved tensor; when autograd drops it (after its backward), its bytes are released."""

    def __init__(self, saved, tensor, key, nbytes):
        self.saved, self.tensor, self.key, self.nbytes = saved, tensor, key, nbytes

    def __del__(self):
        self.saved.release(self.key, self.nbytes)


def streams_restored(module, monkeypatch):
    """Patch a sharded trainer's load_shards to load nothing (no DCP, no shards) and to record the
    random states it restores; returns the list they are appended to."""
    restored = []
    for name in ("get_state_dict", "set_state_dict"):
        monkeypatch.setattr(module, name, lambda *a, **k: ({}, {}))
    monkeypatch.setattr(module.dcp, "load", lambda *a, **k: None)
    monkeypatch.setattr(module, "shards_finite", lambda model: True)
    monkeypatch.setattr(module, "restore_rng", lambda saved, device: restored.append(saved))
    return restored

def unpack(held):
    return held.tensor if isinstance(held, Held) else held


def run_as_script(module):
    """What a trainer's `if __name__ == "__main__":` block does, around module.main(): for the probes,
    which run a trainer with a function wrapped and must end as the script would (one error line and
    the script's exit code for its errors, the process group left)."""
    code = 0
    try:
        module.main()
    except module.Stop as err:
        sys.stderr.write(f"error: {err}\n")
        code = err.code
    finally:
        module.gc.collect()
        if module.dist.is_initialized():
            module.dist.destroy_process_group()
    sys.exit(code)



KILL_MOMENTS = ("shards", "metadata", "renamed", "cleanup")  # what kill_in_save can aim at


def kill_in_save(module, specs):
    """For a probe: SIGKILL one rank of a sharded trainer while it saves a step, at one of
    KILL_MOMENTS, a spec "MOMENT@STEP:RANK" per attempt: the k-th once k kills are recorded (an
    agent whose workers restart for a peer's failure keeps its TORCHELASTIC_RESTART_COUNT), none
    past the last. shards: the rank's first file write of the save (its peers may have written
    theirs); metadata: once DCP's save returned (.metadata written, no run.json); renamed: once
    the step has its final name, before older steps are dropped; cleanup: the rank's disk full
    in the save, then rank 0 killed while removing the failed step (run.json and a shard gone
    first, .metadata last, as shutil.rmtree may order them). Before dying, the rank appends what
    the --save folder held to SAVE.kills.jsonl."""
    save_folder = sys.argv[len(sys.argv) - sys.argv[::-1].index("--save")]  # the last, as argparse
    record = Path(f"{save_folder}.kills.jsonl")  # one line a kill: the kills so far, job-wide
    attempt = len(record.read_text().splitlines()) if record.exists() else 0
    if attempt >= len(specs):
        return
    moment, at = specs[attempt].split("@")
    step_at, rank = map(int, at.split(":"))
    assert moment in KILL_MOMENTS, moment
    mine, saving = int(os.environ["RANK"]) == rank, [None]

    def die():
        held = {d.name: sorted(os.listdir(d)) for d in sorted(Path(save_folder).glob("*step-*"))}
        with open(record, "a") as f:
            f.write(json.dumps({"attempt": attempt, "moment": moment, "step": step_at,
                                "held": held}) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(owner, name, before=None, after=None):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if before and saving[0] == step_at:
                before(*args)
            result = original(*args, **kwargs)
            if after and saving[0] == step_at:
                after(*args)
            return result
        setattr(owner, name, wrapped)
    save = module.save_checkpoint

    def saving_step(run, raw_model, optimizer, data, step):
        saving[0] = step
        try:
            return save(run, raw_model, optimizer, data, step)
        finally:
            saving[0] = None
    module.save_checkpoint = saving_step
    if moment in ("shards", "cleanup") and mine:
        def no_room(fd):
            if moment == "shards":
                die()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        wrap(os, "fsync", before=no_room)
    if moment == "metadata" and mine:
        wrap(module.dcp, "save", after=lambda *args: die())
    if moment == "renamed" and mine:
        wrap(module, "drop_older_steps", before=lambda *args: die())
    if moment == "cleanup" and int(os.environ["RANK"]) == 0:
        def cut_short(folder):
            for name in sorted(os.listdir(folder)):
                if name != ".metadata":
                    os.remove(os.path.join(folder, name))
                    if name.endswith(".distcp"):
                        break
            die()
        wrap(module, "remove_step", before=lambda folder: cut_short(folder)
             if os.path.isdir(folder) and "partial" in folder else None)


def kills(save_folder):
    """What kill_in_save recorded: per kill, its attempt, moment, step and what --save held."""
    lines = Path(f"{save_folder}.kills.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@contextlib.contextmanager
def one_process_group(extra=None):
    """The environment torchrun gives a world of one (loopback, a free port) and one thread, as in
    the launched runs (OMP_NUM_THREADS=1: the same float sums), with `extra` on top; afterwards,
    all as it was."""
    import torch
    import torch.distributed as dist
    saved, threads = dict(os.environ), torch.get_num_threads()
    # nothing of the user's torchrun, SLURM or debug settings; the GPUs stay as they were: CUDA may
    # start up in this process (an optimizer step asks whether a CUDA stream is capturing) and must
    # find the devices torch counted at import. The runs are told --device cpu instead.
    clean = environment(extra, cuda=True)  # built from the shell's, before it is cleared
    os.environ.clear()
    os.environ.update(clean)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    dist.set_debug_level_from_env()  # torch read the shell's TORCH_DISTRIBUTED_DEBUG at import
    torch.set_num_threads(1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
        dist.set_debug_level_from_env()
        torch.set_num_threads(threads)


@contextlib.contextmanager
def fake_world(world_size):
    """A process group of `world_size` ranks in this process, which is rank 0, whose collectives
    send nothing and return nothing (torch's "fake" backend): enough to build a chapter's sharded
    model at a layout no launch runs and read what its rank 0 would log of its shards."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    with one_process_group():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        yield


def in_process(script, args, env=None):
    """Run a trainer's main(args) in this process, as one process of a torchrun world of one (no
    launch, no torch import to wait for), on the CPU unless args say otherwise, and return what it
    printed. `env`: variables on top of the clean environment. Errors propagate."""
    printed = io.StringIO()
    with one_process_group(env), contextlib.redirect_stdout(printed):
        trainer(script).main(["--device", "cpu", *map(str, args)])
    record([script, "--device", "cpu", *map(str, args)], 0)
    return printed.getvalue()


class FakeClock:
    """time for a trainer's module, whose perf_counter reads a clock that only the test moves."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def __getattr__(self, name):  # sleep, time, strftime...: the real ones
        return getattr(time, name)


def assert_a_world_of_one_schedules_times_and_samples_as_it_should(script, flags, tmp_path,
                                                                  dense=True, export=True):
    """A chapter's main(), in this process as a world of one (`flags` make the layout one rank;
    `export`: it takes --export, as chapters 7-12 do and chapter 3 does not), applies and logs the
    schedule worked out by hand in chapter 3's test (TINY_GPT: 1e-2 after 2 warmup steps, then a
    cosine over steps 2 and 3 towards 3e-4: 5e-3, 1e-2, 1e-2, 5.15e-3), a step at a time whatever
    its micro-batches (2 here); its ms/step counts training only; and its closing sample runs every
    module in evaluation mode (no dropout). The clock is the test's: each step moves it 1 s, each
    evaluation and each save 100 s, so every step logs 1000.0 ms/step exactly; the controls:
    evaluations and saves ran between logged steps (a counted one would log 101000.0), and the steps
    ran in training mode. It runs at --seed 7 with dropout: a `dense` chapter logs chapter 3's
    losses and validation losses in one process at that seed (dropout seeded by --seed; the control:
    chapter 3 at --seed 0 logs others)."""
    module, clock, applied, calls = trainer(script), FakeClock(), [], collections.Counter()
    phase, modes = ["start"], collections.defaultdict(set)  # the modes modules ran in, by phase

    def recorded(*args):
        optimizer = make(*args)
        optimizer.register_step_pre_hook(
            lambda opt, *_: applied.append(opt.param_groups[0]["lr"]))
        return optimizer

    def hooked(*args):  # every module of the model, a pipeline's stages too, notes its mode
        built = build(*args)
        for part in [built[0], *getattr(built[0], "parts", [])]:
            for m in part.modules():
                m.register_forward_pre_hook(lambda m, _: modes[phase[0]].add(m.training))
        return built

    def moving(function, seconds):
        def moved(*args):
            calls[function.__name__] += 1
            phase[0] = function.__name__
            result = function(*args)
            clock.now += seconds
            phase[0] = "after " + function.__name__  # the last save's is the sample's
            return result
        return moved
    make, build = module.make_optimizer, module.build_model
    run = [*TINY_GPT, "--max-steps", 4, "--grad-accum", 2, "--batch-size", 4, "--eval-every", 2,
           "--eval-windows", 2, "--dropout", 0.1, "--seed", 7]
    with unittest.mock.patch.multiple(
            module, time=clock, make_optimizer=recorded, build_model=hooked,
            train_step=moving(module.train_step, 1), evaluate=moving(module.evaluate, 100),
            save_checkpoint=moving(module.save_checkpoint, 100)):
        out = in_process(script, [*run, *flags, "--save", tmp_path / "ck", "--save-every", 2,
                                  *(["--export", ""] if export else []), "--max-new-tokens", 2])
    assert applied == pytest.approx([5e-3, 1e-2, 1e-2, 5.15e-3], rel=1e-9)
    logged = re.findall(r"^step \d/4 \| loss \S+ \| lr (\S+) \| .* \| (\S+) ms/step", out, re.M)
    assert logged == [("5.00e-03", "1000.0"), ("1.00e-02", "1000.0"), ("1.00e-02", "1000.0"),
                      ("5.15e-03", "1000.0")], out
    assert calls == {"train_step": 4, "evaluate": 3, "save_checkpoint": 2}, calls
    assert modes["train_step"] == {True} and modes["evaluate"] == {False}, modes
    assert modes["after save_checkpoint"] == {False}, modes  # the sample, after the last save
    if dense:
        losses = re.compile(r"^step \d/4 \| (?:val )?loss (\S+)", re.M)
        chapter_3 = [in_process(GPT, [*run[:-1], seed, "--save", "", "--max-new-tokens", 1])
                     for seed in (7, 0)]
        assert losses.findall(out) == losses.findall(chapter_3[0]), (out, chapter_3[0])
        assert losses.findall(chapter_3[1]) != losses.findall(chapter_3[0])


# ----------------------------------------------------------------------------------------- data

def write_idx(path, array):
    """An MNIST-format (IDX) file: magic 0x08 (ubyte) + ndim, big-endian sizes, then the bytes."""
    import numpy as np
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def make_mnist(root, n_train=60, n_val=20):
    """Tiny random MNIST files in root/MNIST/raw/, in the real format; returns that folder."""
    import numpy as np
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_val)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    return raw


# --------------------------------------------------------------- shared chapter 2 runs (cached)

def has_feature(feature):
    """Whether the installed torch has what chapter 9 ("return_outputs": its schedules' argument)
    or chapter 10 ("all_gather_single") calls. The chapters look for the call itself, not at the
    version string, which a nightly (2.13.0a0) makes compare below the release it will become."""
    import inspect
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleGPipe
    if feature == "all_gather_single":
        return hasattr(dist, "all_gather_single")
    return "return_outputs" in inspect.signature(ScheduleGPipe.step).parameters


def needs_torch(feature, chapter):
    """A skip mark for tests of a chapter that needs a newer torch than the course's floor
    (requirements.txt), where the installed torch lacks the call: the chapter refuses it."""
    return pytest.mark.skipif(not has_feature(feature),
                              reason=f"chapter {chapter} needs a torch with {feature}")


NEEDS_PP, NEEDS_CP = ("return_outputs", 9), ("all_gather_single", 10)  # what 9 and 10 call


def scratch(name):
    """A fresh folder for this test session's shared runs, removed when the session ends."""
    import atexit
    folder = Path(tempfile.mkdtemp(prefix=f"course-{name}-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def demo_run():
    """The README's demo, `torchrun --standalone --nproc_per_node=2 train_ddp_basic.py`, run once
    from an empty folder (with classifier_runs()): (its CompletedProcess, that folder)."""
    runs = classifier_runs()
    return runs["demo"], runs["demo_dir"]


@functools.cache
def ddp_reference():
    """Chapter 3 at 2 processes for 18 steps of SHARDED, evaluated every 6, run once: the run that
    chapters 7 and 8 must reproduce, and chapter 3's own proofs of its data and communication
    (test_minigpt.py). It runs through tests/probe_minigpt.py's `record` (each rank's windows and
    gradient all-reduces, written to the folder), with --debug (each rank's windows logged,
    replicas checked in sync), launched from a hostile shell (test_hermetic.py). Returns (what it
    printed, its checkpoint, the folder of the records)."""
    folder = scratch("ddp_reference")
    cmd = command("tests/probe_minigpt.py", ["record", folder, *SHARDED, "--max-steps", 18,
                                             *EVAL_6, "--debug", "--save", folder / "ddp.pt"],
                  nproc=2)
    with hostile_shell():  # the launch ignores a user's SLURM, torchrun and debug settings
        proc = start(cmd, REPO)
    return ok(finish(proc, cmd)), folder / "ddp.pt", folder


# Dropout on, a clip of 2.0 that binds in steps 1 and 2 (norms 2.47, 2.13) and not in 3 and 4
# (1.57, 1.93), and 13 validation windows (7 and 6 on 2 replicas: one padded batch).
# A weight decay of 0.3, not the default 0.1, a timeout of 600 seconds and --amp off spelled out:
# switches a user's run sets, carried by every launch that uses NOISY or CLIPPED and by the
# references they are compared with (--val-fraction: the bf16 runs, on their own data).
USER_SWITCHES = ["--weight-decay", "0.3", "--dist-timeout", "600", "--amp", "off"]
NOISY = SHARDED + ["--dropout", "0.1", "--clip", "2.0", "--eval-windows", "13", "--max-steps", "4",
                   "--eval-every", "4", "--save", "", *USER_SWITCHES]


# A clip of 2.0 that binds in steps 1 and 2 and not in 3 and 4, and 13 validation windows (7 and 6
# on 2 replicas: one padded batch), no dropout: chapters 9, 10 and 11 at 2 replicas of 6 sequences
# against one_process_clipped().
CLIPPED = SHARDED + ["--clip", "2.0", "--eval-windows", "13", "--max-steps", "4", "--eval-every",
                     "4", "--save", "", *USER_SWITCHES]


@functools.cache
def one_process_clipped():
    """Chapter 3 in this process with CLIPPED and --batch-size 12: 2 replicas' global batch."""
    return in_process(GPT, CLIPPED + ["--batch-size", 12])


def assert_clipped_run_is_one_processs(out, val_abs=1e-4):
    """A CLIPPED run at 2 replicas logs one process's losses (1e-5 relative), its gradient norms
    before clipping where the clip binds (steps 1 and 2) and where it does not (3 and 4, the
    control), and its validation losses, the padded evaluation's among them. The norms print 3
    decimals but are compared within 2e-3: they may differ by 2 in the last printed digit."""
    one = one_process_clipped()
    assert sorted(logged_losses(out)) == [1, 2, 3, 4], out
    for step in range(1, 5):
        assert logged_losses(out)[step] == pytest.approx(logged_losses(one)[step], rel=1e-5), step
        assert logged_grad_norms(out)[step] == pytest.approx(logged_grad_norms(one)[step],
                                                             abs=2e-3), step
    norms = logged_grad_norms(one)
    assert [norms[step] > 2.0 for step in range(1, 5)] == [True, True, False, False], norms
    assert sorted(logged_val_losses(out)) == [0, 4]
    assert logged_val_losses(out) == pytest.approx(logged_val_losses(one), abs=val_abs)


# bf16 with recomputation and dropout, as a GPU run turns them on together: 6 steps of SHARDED at a
# global batch of 12, evaluated every 3, against chapter 3 in one process with the same switches
BF16 = SHARDED + ["--max-steps", "6", "--eval-every", "3", "--amp", "bf16", "--grad-checkpointing",
                  "--dropout", "0.1", "--save", ""]


VOCAB, VAL_FRACTION = 300, 0.25  # the bf16 runs' data: token ids, not bytes, and a longer tail


# The bf16 runs' words: a text of its own, so that no edit of a course file moves their numbers
WORDS = ("def return self import from class for in if else while with as yield lambda None "
         "True False and or not is try except raise print range len list dict tuple torch model "
         "loss step rank world batch grad norm data token block layer head").split()


def fixed_text(size=40_000):
    """`size` bytes of WORDS in an order drawn by a linear congruential generator written out
    here (the same bytes on every Python and numpy), with spaces, newlines and brackets."""
    x, text = 12345, []
    while sum(map(len, text)) < size:
        x = (1103515245 * x + 12345) % 2**31
        end = "\n" if (x >> 4) % 9 == 0 else ("(" if (x >> 6) % 7 == 0 else " ")
        text.append(WORDS[(x >> 8) % len(WORDS)] + end)
    return "".join(text).encode()[:size]


@functools.cache
def token_ids():
    """A .bin of uint16 token ids, as a user's tokenizer writes one, made once: fixed_text()'s
    40,000 bytes, each id its byte plus 44, all below VOCAB. Returns its path."""
    import numpy as np
    path = scratch("tokens") / "ids.bin"
    raw = np.frombuffer(fixed_text(), dtype=np.uint8)
    (raw.astype(np.uint16) + 44).tofile(path)
    return path


def token_data():
    """The flags of a run on token_ids(): --data, --vocab-size and --val-fraction, as a user's
    run on their own tokenizer's output gives them."""
    return ["--data", token_ids(), "--vocab-size", VOCAB, "--val-fraction", VAL_FRACTION]


def bf16(dropout=True):
    """BF16 on token_ids(); without dropout for the layouts whose ranks each draw their own masks
    where one process draws one (FSDP, PP, CP, and TP with sequence parallelism)."""
    flags = BF16 if dropout else [w for w in BF16 if w not in ("--dropout", "0.1")]
    return flags + token_data()


@functools.cache
def one_process_bf16(dropout=True):
    """Chapter 3 in one process (in this one) with bf16(dropout) and --batch-size 12, run once:
    what a bf16 layout of a later chapter must log, within bf16's rounding
    (assert_bf16_run_is_one_processs)."""
    return in_process(GPT, bf16(dropout) + ["--batch-size", "12"])


def assert_data_line(out):
    """The data line of a run on token_ids(), against what this test computes from the file: the
    tokens split at VAL_FRACTION, the vocabulary, and the loss of predicting each validation token
    by its frequency in the training tokens (each count plus one)."""
    import numpy as np
    ids = np.fromfile(token_ids(), dtype=np.uint16)
    n_val = int(len(ids) * VAL_FRACTION)
    train, val = ids[:len(ids) - n_val], ids[len(ids) - n_val:]
    counts = np.bincount(train, minlength=VOCAB) + 1.0
    baseline = -np.log(counts[val] / counts.sum()).mean()
    assert (f"| {len(train):,} train / {n_val:,} val tokens | vocab {VOCAB} | token-frequency "
            f"baseline loss {baseline:.4f}") in out, out


def gpt_shapes(vocab=256, context=32, width=32, layers=2):
    """The shapes of the GPT's parameters, written out here (TINY_GPT's by default): the tied
    embedding (the head's matrix too, so once), the positions, each block's two norms (weight,
    bias), qkv, proj and the MLP's two layers (weight, bias), and the final norm."""
    c = width
    block = [(c,), (c,), (3 * c, c), (3 * c,), (c, c), (c,),  # ln1, qkv, proj
             (c,), (c,), (4 * c, c), (4 * c,), (c, 4 * c), (c,)]  # ln2, the MLP
    return [(vocab, c), (context, c), *block * layers, (c,), (c,)]


def first_rank_share(shapes, ranks):
    """How many values rank 0 holds of parameters of these shapes, each split on dim 0 over
    `ranks` as FSDP2 splits it: ceil(rows / ranks) rows to each rank from the first, so the last
    ranks may hold fewer (at 3 ranks, 256 rows are 86, 86 and 84)."""
    return sum(-(-shape[0] // ranks) * math.prod(shape[1:]) for shape in shapes)


def memory_words(mine, whole):
    """The memory line's figures for a rank holding `mine` of `whole` parameters: weights,
    gradients and AdamW's two moments, 4 fp32 copies, 16 bytes a parameter; and DDP's."""
    return f"{16 * mine / 2**20:.2f} MiB ({mine:,} of {whole:,} parameters; DDP: " \
           f"{16 * whole / 2**20:.2f} MiB)"


def assert_planned(chapter, runs, other):
    """Chapter 13's planner (plan_layout.py's chapter_lines), given each run's world size and
    flags, predicts the lines its rank 0 printed about what a rank holds and sends (memory,
    accumulation, traffic...), each found whole in what the run printed. `runs`: (what it
    printed, world size, flags) each. The control: the planner's lines for `other`, another
    layout's (world size, flags), are not all in the first run's output."""
    plan = trainer("plan_layout.py").chapter_lines
    for out, world_size, flags in runs:
        lines = plan(str(chapter), world_size, [str(f) for f in flags])
        assert lines and all(line in out for line in lines), (world_size, flags, lines, out)
    assert not all(line in runs[0][0] for line in plan(str(chapter), other[0],
                                                        [str(f) for f in other[1]]))


def assert_bf16_run_is_one_processs(out, dropout=True, tolerances=(5e-3, 1.5e-2, 2e-3)):
    """A bf16 run of bf16(dropout) logs one_process_bf16(dropout)'s losses, gradient norms and
    validation losses within `tolerances` (absolute), and the data and parameter lines the test
    computes. Both compute in bf16; a layout that splits a matrix product adds its ranks' partial
    outputs after each is rounded to bf16, where one process's product adds in fp32 and rounds
    once; FSDP's policy computes the gradients in bf16, where one process's autocast gives fp32
    ones; and Adam carries the differences forward. Measured on 2 cores (torch 2.14), chapters
    7-11, on an earlier text (chapter 3's source): losses within 2e-3, norms 6e-3, validation
    losses 9e-4. The control: the one-process run with dropout flipped differs from the reference
    by more than the loss tolerance (1.39e-2 measured on fixed_text()), so the comparison can
    fail."""
    one, other = one_process_bf16(dropout), one_process_bf16(not dropout)
    assert "| amp bfloat16 |" in out and "| amp bfloat16 |" in one
    assert_data_line(out)
    # the parameters of TINY_GPT's model on VOCAB tokens, counted here: the tied embedding, the
    # positions, 2 blocks of 2 norms, qkv, proj and the MLP (with biases), and the final norm
    v, t, c, layers = VOCAB, 32, 32, 2
    block = 2 * 2 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c)
    assert f"model {v * c + t * c + layers * block + 2 * c:,} parameters | " in out, out
    assert f"| {12 * t * 2} tokens per step (" in out, out  # 12 sequences, 2 micro-batches
    steps, (loss, norm, val) = [1, 2, 3, 4, 5, 6], tolerances
    assert sorted(logged_losses(out)) == sorted(logged_grad_norms(out)) == steps, out
    for step in steps:
        assert logged_losses(out)[step] == pytest.approx(logged_losses(one)[step], abs=loss), step
        assert logged_grad_norms(out)[step] == pytest.approx(logged_grad_norms(one)[step],
                                                             abs=norm), step
    assert sorted(logged_val_losses(out)) == [0, 3, 6]
    assert logged_val_losses(out) == pytest.approx(logged_val_losses(one), abs=val)
    other = logged_losses(other)
    assert max(abs(other[step] - logged_losses(one)[step]) for step in steps) > loss


def assert_dropout_run_is_ddps(out):
    """A NOISY run at 2 replicas logs ddp_dropout_reference()'s losses (1e-5 relative), its
    gradient norms before clipping where the clip binds (steps 1 and 2) and where it does not (3
    and 4, the control), and its validation losses, the padded evaluation's too. The norms print
    3 decimals but are compared within 2e-3: they may differ by 2 in the last printed digit."""
    ddp = ddp_dropout_reference()[0]
    assert sorted(logged_losses(out)) == sorted(logged_grad_norms(out)) == [1, 2, 3, 4], out
    for step in range(1, 5):
        assert logged_losses(out)[step] == pytest.approx(logged_losses(ddp)[step], rel=1e-5), step
        assert logged_grad_norms(out)[step] == pytest.approx(logged_grad_norms(ddp)[step],
                                                             abs=2e-3), step
    norms = logged_grad_norms(ddp)
    assert [norms[step] > 2.0 for step in range(1, 5)] == [True, True, False, False], norms
    assert logged_val_losses(out) == pytest.approx(logged_val_losses(ddp), abs=1e-4)


def assert_kv_gradients_summed_in_fp32(module, monkeypatch):
    """A chapter's GatherContext.backward under bf16: the reduce-scatter of dK and dV adds in fp32
    and rounds once, at the end (the control: the gradient that comes in is bf16)."""
    import types
    import torch
    sent = {}

    def reduce_scatter(out, parts, group=None):  # as if both ranks sent this rank's parts
        sent["dtype"] = parts.dtype
        out.copy_(2 * parts[:len(out)])
    monkeypatch.setattr(module.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(module.dist, "reduce_scatter_single", reduce_scatter)
    grad = torch.randn(2, 1, 2, 8, 4).bfloat16()  # K and V, batch, heads, 2 ranks' 4 tokens, size
    mine, _ = module.GatherContext.backward(types.SimpleNamespace(group=None), grad)
    assert grad.dtype == torch.bfloat16 and sent["dtype"] == torch.float32
    assert mine.dtype == torch.bfloat16 and mine.shape == (2, 1, 2, 4, 4)
    torch.testing.assert_close(mine, (2 * grad[..., :4, :].float()).bfloat16())


def assert_bf16_policy_reduces_in_fp32(module):
    """A chapter's FSDP MixedPrecisionPolicy: with --amp bf16 the weights are gathered and used in
    bf16 and the gradients reduced in fp32 (a bf16 sum over many ranks rounds at each addition);
    the control, --amp off: nothing cast."""
    import torch
    name, policy = module.mixed_precision("bf16", torch.device("cpu"))
    assert (name, policy.param_dtype, policy.reduce_dtype) == ("bfloat16", torch.bfloat16,
                                                                torch.float32)
    name, policy = module.mixed_precision("off", torch.device("cpu"))
    assert (name, policy.param_dtype, policy.reduce_dtype) == ("off", None, torch.float32)


def built_in_a_fake_world(script, flags, world_size=4, vocab_size=256):
    """A chapter's model as its rank 0 builds it in a world of `world_size` (fake_world: no
    launch), with the script's own make_run and build_model; what the other ranks would have told
    rank 0 through all_gather_object is rank 0's own answer. Returns (model, what it printed)."""
    import torch
    import torch.distributed as dist
    module, printed = trainer(script), io.StringIO()
    args = module.parse_args([*map(str, flags), "--device", "cpu"])

    def gather_own(out, obj, group=None):
        out[:] = [obj] * len(out)
    with fake_world(world_size), contextlib.redirect_stdout(printed), \
            unittest.mock.patch.object(dist, "all_gather_object", gather_own):
        run = module.make_run(args, torch.device("cpu"), 0, world_size)
        model = module.build_model(run, vocab_size)[0]
    return model, printed.getvalue()


def fsdp_units(model):
    """(name, compute dtype, reduce dtype, parameters) of every FSDP unit of a model, read off
    FSDP's own state (private: torch 2.14 keeps a list of parameter groups, older releases one).
    A pipeline rank's stages (`model.parts`, a plain list) are units of their own."""
    from torch.distributed.fsdp import FSDPModule
    units, modules = [], dict(model.named_modules())
    for k, part in enumerate(getattr(model, "parts", [])):
        modules.update({f"parts.{k}.{name}": m for name, m in part.named_modules()
                        if all(m is not seen for seen in modules.values())})
    for name, module in modules.items():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            for group in groups if groups is not None else [state._fsdp_param_group]:
                if group is not None:
                    policy = group.mp_policy
                    units.append((name, policy.param_dtype, policy.reduce_dtype,
                                  len(group.fsdp_params)))
    return units


def assert_every_unit_computes_in_bf16_and_reduces_in_fp32(script, flags):
    """Under --amp bf16, each FSDP unit of rank 0's model (built at 4 ranks in a fake world), read
    off the model: its weights gathered in bf16 and its gradients reduced in fp32, and together
    the units hold every parameter, so none is left outside a policy. The control: under --amp
    off every unit computes in its parameters' fp32 (no cast)."""
    import torch
    for amp, compute in (("bf16", torch.bfloat16), ("off", None)):
        model = built_in_a_fake_world(script, [*flags, "--amp", amp])[0]
        units = fsdp_units(model)
        assert len(units) > 1 and sum(n for *_, n in units) == len(list(model.parameters()))
        assert {(dtype, reduce) for _, dtype, reduce, _ in units} == {(compute, torch.float32)}, \
            (amp, units)


@functools.cache
def ddp_dropout_reference():
    """Chapter 3 at 2 processes with NOISY and --check-sync, run once: the losses, gradient norms
    and validation losses (padded) that chapters 7 and 8 must log with dropout, a binding clip and
    padding. It runs as two nodes of one process each (chapter 4's launcher), through
    tests/probe_minigpt.py's `record`, which writes each rank's windows and first dropout mask
    (hashed) to the folder. Returns (what rank 0's node printed, that folder)."""
    folder = scratch("ddp_dropout")
    nodes = start_two_nodes("tests/probe_minigpt.py", ["record", folder, *NOISY, "--check-sync"])()
    return next(out for out in nodes if "world size 2 " in out), folder


@functools.cache
def one_process_reference():
    """Chapter 3 in one process (in this one) for 18 steps of SHARDED with --batch-size 12,
    evaluated every 6: the global batch of ddp_reference (2 processes of 6) in one process, the run
    that chapters 8 and 9 must reproduce. Returns (what it printed, its checkpoint)."""
    ckpt = scratch("one_process") / "one.pt"
    out = in_process(GPT, SHARDED + ["--max-steps", 18, "--batch-size", 12, *EVAL_6,
                                     "--save", ckpt])
    return out, ckpt


@functools.cache
def classifier_runs():
    """The chapter 1-2 runs that several modules compare against, run once, the launches side by
    side with the in-process runs: {name: CompletedProcess, "dir": their folder, "ddp_flags",
    "d2_nodes": what each node of d2 printed, "demo_dir"}.
    - s1, s2: chapter 1 (SMALL, batch 32) for 1 and 2 epochs; s1_resumed: s1 resumed to 2 epochs,
      with torchrun's variables (RANK...) set, which chapter 1 ignores (all three in process);
    - d2: chapter 2 at 2 processes of batch 16 for 2 epochs, started as two nodes of one process by
      chapter 4's launcher, through tests/probe_classifier.py's `record` ("dir"/rankN.json: the
      samples each rank read);
    - w3_eval: chapter 2 evaluating s2.pt at 3 processes;
    - bn: chapter 2 with ResNet-18 (BatchNorm) and 9 validation samples at 2 processes;
    - demo: the README's demo, from an empty folder."""
    d, demo_dir = scratch("runs"), scratch("demo")
    single, ddp = SMALL + ["--batch-size", "32"], SMALL + ["--batch-size", "16"]  # global batch 32
    cmds = {"demo": command(DDP, nproc=2),
            "bn": command(DDP, ["--model", "resnet18", "--train-samples", 16, "--val-samples", 9,
                                "--batch-size", 4, "--epochs", 1, "--save", ""], nproc=2),
            "w3_eval": command(DDP, ddp + ["--eval-only", "--resume", d / "s2.pt"], nproc=3)}
    launched = {"demo": start(cmds["demo"], demo_dir), "bn": start(cmds["bn"], REPO)}
    nodes = start_two_nodes("tests/probe_classifier.py",
                            ["record", d, *ddp, "--epochs", 2, "--save", d / "d2.pt"])
    r = {}  # meanwhile, in this process
    for name, args, saved in (("s1", ["--epochs", 1], "s1.pt"), ("s2", ["--epochs", 2], "s2.pt"),
                              ("s1_resumed", ["--epochs", 2, "--resume", d / "s1.pt"], "s1r.pt")):
        args = single + args + ["--save", d / saved]
        r[name] = subprocess.CompletedProcess(args, 0, in_process(SINGLE, args), "")
    launched["w3_eval"] = start(cmds["w3_eval"], REPO)  # it evaluates s2.pt
    for name, proc in launched.items():
        r[name] = finish(proc, cmds[name])
        ok(r[name])
    r["d2_nodes"] = nodes()
    r["d2"] = subprocess.CompletedProcess("two nodes", 0, next(
        out for out in r["d2_nodes"] if "world size 2 |" in out), "")
    return {**r, "dir": d, "ddp_flags": ddp + ["--epochs", "2"], "demo_dir": demo_dir}


def run_single(path):
    """What a page's single-process trainer prints, run here with one thread, as the launched
    processes run (the same float sums)."""
    import torch
    printed, threads = io.StringIO(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(path), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    return printed.getvalue()
