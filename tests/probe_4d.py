"""Runs train_4d_minigpt.py's real main() with its steps watched, for the tests that measure what
each rank holds and sends, or kill a worker. Launched under torchrun in place of the script; the
course never imports it:

    torchrun ... tests/probe_4d.py record OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json: {"coords": its (pp, dp, cp, tp) coordinates,
        "steps", "peak_saved_bytes": the most bytes of activations it held for backward at once
        during a step (tensors saved by autograd, each storage counted once, the weights left out),
        "params": the elements of its shards of the parameters, "positions": the places in each
        sequence of the tokens it holds, "sent": the bytes it sent in its
        second training step (none if it runs one), by group ("tp", "cp", "pp", "fsdp": dp x
        cp, "tied": the first and last stage, "world"), each collective counted as a ring sends:
        an all-gather (g - 1) times its input, a reduce-scatter (g - 1) / g of its input, an
        all-reduce twice that, an isend its tensor; "calls": how many of each kind in that step,
        by group ("fsdp reduce_scatter"); "in_step_bytes": the most bytes of gathered weights and
        whole gradients it held, just before a stage reduce-scattered (helpers.fsdp_bytes_held);
        and with --dropout "dropout_mask": the first mask the stage's first dropout drew in
        training, hashed}
    torchrun ... tests/probe_4d.py run [trainer flags]
        the trainer as it is, nothing watched (the test launches that need no records)
    torchrun ... tests/probe_4d.py killsave MOMENT@STEP:RANK,... OUT_DIR [trainer flags]
        as record, and a rank SIGKILLed while it saves a step, one spec per attempt
        (helpers.kill_in_save), so that a restarted job gets past it

Errors end the probe as they end the script (helpers.run_as_script), and then the process ends
without Python's teardown (os._exit, once its files are written and its output flushed).
"""
import inspect
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_4d_minigpt as trainer  # noqa: E402
from helpers import Saved, dropout_mask_hook, run_as_script, unpack, watch_reduce  # noqa: E402
from helpers import kill_in_save  # noqa: E402

RING = {"all_gather": lambda g: g - 1, "reduce_scatter": lambda g: (g - 1) / g,
        "all_reduce": lambda g: 2 * (g - 1) / g}  # the share of its input a rank sends


def kind(name):
    return next((k for k in RING if name.startswith(k)), None)


def record(out_dir):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    dist = trainer.dist
    saved, seen, groups = Saved(), {"steps": 0, "sent": {}, "calls": {}}, {}  # the second step's
    pipeline_schedule, train_step, counting = trainer.pipeline_schedule, trainer.train_step, [0]

    def add(group_name, nbytes, what):
        if counting[0] == 1:  # inside a training step, outermost calls only
            label = groups.get(group_name, group_name)
            seen["sent"][label] = seen["sent"].get(label, 0) + nbytes
            call = f"{label} {what}"
            seen["calls"][call] = seen["calls"].get(call, 0) + 1

    class Functional(TorchDispatchMode):  # DTensor's collectives: TP's, the norm's
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if func.namespace == "_c10d_functional" and kind(name):
                group = args[-1]  # its name, the last argument of every one of them
                size = dist.get_world_size(dist.distributed_c10d._resolve_process_group(group))
                add(group, args[0].numel() * args[0].element_size() * RING[kind(name)](size),
                    kind(name))
            return func(*args, **(kwargs or {}))

    def wrap(name):  # dist.NAME, counted by the group it is called on
        original = getattr(dist, name)
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            group = bound.get("group") or dist.group.WORLD
            tensor = next(bound[k] for k in ("input_tensor", "input", "tensor") if k in bound)
            share = 1 if name == "isend" else RING[kind(name)](dist.get_world_size(group))
            add(group.group_name, tensor.numel() * tensor.element_size() * share,
                kind(name) or name)
            counting[0] += counting[0] > 0  # what it calls inside is not counted again
            try:
                return original(*args, **kwargs)
            finally:
                counting[0] -= counting[0] > 1
        setattr(dist, name, counted)
        setattr(dist.distributed_c10d, name, counted)  # P2POp checks its op against this one

    for name in ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                 "reduce_scatter_single", "all_reduce", "isend"):  # the schedule's sends: isend
        if hasattr(dist, name):
            wrap(name)

    def watched_schedule(run, model):
        saved.model = model
        seen["coords"] = [run.mesh.get_local_rank(d) for d in ("pp", "dp", "cp", "tp")]
        seen["params"] = sum(p.to_local().numel() for p in model.parameters())
        seen["positions"] = run.context.positions.tolist()  # the tokens of a sequence it holds
        drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        if drops:  # stage 0's embedding dropout, or the first block's on a later stage
            drops[0].register_forward_hook(dropout_mask_hook(seen))
        for dim in ("pp", "cp", "tp"):
            groups[run.mesh.get_group(dim).group_name] = dim
        fsdp = next(model.parameters()).device_mesh.get_group(0)  # dim 0: FSDP's, dp x cp
        groups[fsdp.group_name], groups[dist.group.WORLD.group_name] = "fsdp", "world"
        if run.tied is not None:
            groups[run.tied.group_name] = "tied"
        schedule = pipeline_schedule(run, model)
        watch_reduce(schedule, model, seen)  # at --pp 1 the schedule never runs: 0
        step = schedule.step

        def watched_step(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, unpack):
                return step(*args, **kwargs)
        schedule.step = watched_step
        return schedule

    def counted_step(*args):
        seen["steps"] += 1
        if seen["steps"] != 2:  # counted in the second step alone: each op is watched, slowly
            return train_step(*args)
        counting[0] = 1
        try:
            with Functional():
                return train_step(*args)
        finally:
            counting[0] = 0

    trainer.pipeline_schedule, trainer.train_step = watched_schedule, counted_step
    try:
        code = run_to_the_end()
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump({**seen, "peak_saved_bytes": saved.peak}, f)
    leave_at_once(code)


def run_to_the_end():
    """The trainer's main() and the script's own end (its error line, the group left); returns
    the exit code the script would exit with."""
    try:
        run_as_script(trainer)
    except SystemExit as exit_:
        return exit_.code
    return 0


def leave_at_once(code):
    """Exit without Python's teardown of torch (about 0.9 s of CPU a process, and 8 processes
    share 2 cores); everything is written and the group is left."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "run":
        sys.argv = [trainer.__file__] + sys.argv[2:]
        leave_at_once(run_to_the_end())
    if mode == "record":
        out, crash, rest = sys.argv[2], None, sys.argv[3:]
    else:
        crash, out, rest = sys.argv[2].split(","), sys.argv[3], sys.argv[4:]
    sys.argv = [trainer.__file__] + rest
    if crash:
        kill_in_save(trainer, crash)
    record(out)
