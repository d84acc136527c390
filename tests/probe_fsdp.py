"""Runs train_fsdp_minigpt.py's real main() with a function wrapped, for the tests that count FSDP's
gradient reductions or make a worker die. Launched under torchrun in place of the script; the course
never imports it:

    torchrun ... tests/probe_fsdp.py count OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json: {"reduce_scatters": how many times FSDP
        reduce-scattered gradients, "all_gathers": how many times it gathered weights (both inside
        training steps), "steps": optimizer steps taken, "whole_grad_bytes": the most bytes of
        whole (unsharded) gradients FSDP held between two micro-batches, "outside": the
        collectives that send tensors (c10d's scatters, broadcasts and all-gathers, DTensor's
        functional all-gathers) made while building the model, in the first save and in the
        export, "exported": how many tensors the export's state dict holds on this rank,
        "eval_with_grad": whether an evaluation forward ran with autograd on, "grads_kept":
        how many parameters still held a .grad after a step}
    torchrun ... tests/probe_fsdp.py crash STEP:RANK [trainer flags]
        that rank dies as if killed (os._exit, no cleanup) when step STEP begins, on the first
        attempt only (TORCHELASTIC_RESTART_COUNT 0), so a restarted job gets past it
    torchrun ... tests/probe_fsdp.py killsave MOMENT@STEP:RANK,... [trainer flags]
        a rank SIGKILLed while it saves a step, one spec per attempt (helpers.kill_in_save)
    torchrun ... tests/probe_fsdp.py nospace N:RANK [trainer flags]
        that rank's disk is full from its N-th fsync on (its shard files: it writes no run.json)

Errors end the probe as they end the script (helpers.run_as_script).
"""
import errno
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp_minigpt as trainer  # noqa: E402
from helpers import FSDP_CALLS, count_calls, kill_in_save, run_as_script  # noqa: E402

def count(out_dir):
    seen = {"reduce_scatters": 0, "all_gathers": 0, "steps": 0, "in_step": False,
            "whole_grad_bytes": 0, "eval_with_grad": False, "grads_kept": 0,
            "outside": {"build": 0, "save": 0, "export": 0}}
    watch_outside(seen)
    count_calls(trainer.dist, FSDP_CALLS, seen, lambda: seen["in_step"])
    train_step = trainer.train_step

    def counted_step(*args):  # FSDP's calls inside training steps, not evaluation's or export's
        seen["steps"], seen["in_step"] = seen["steps"] + 1, True
        model = args[1]
        if not hasattr(model, "_probe_sync"):  # before each micro-batch: what the last one left
            model._probe_sync = model.set_requires_gradient_sync

            def sync(flag, **kwargs):
                seen["whole_grad_bytes"] = max(seen["whole_grad_bytes"], whole_grad_bytes(model))
                return model._probe_sync(flag, **kwargs)
            model.set_requires_gradient_sync = sync
        try:
            return train_step(*args)
        finally:
            seen["in_step"] = False
            seen["grads_kept"] = sum(p.grad is not None for p in model.parameters())

    trainer.train_step = counted_step
    try:
        run_as_script(trainer)
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            seen.pop("in_step")
            json.dump(seen, f)


def watch_outside(seen):
    """Count in seen["outside"][phase] the collectives that send tensors while building the
    model, in the first save and in the export; record the export's size on this rank and any
    evaluation forward run with autograd on."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    phase = [None]

    class Gathers(TorchDispatchMode):  # DTensor's full_tensor() and redistribute: functional
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and "all_gather" in func.__name__:
                seen["outside"][phase[0]] += 1
            return func(*args, **(kwargs or {}))

    def counted(module, name):
        original = getattr(module, name)

        def call(*args, **kwargs):
            if phase[0]:
                seen["outside"][phase[0]] += 1
            return original(*args, **kwargs)
        setattr(module, name, call)
    for name in ("scatter", "broadcast", "all_gather_into_tensor", "all_gather_single"):
        if hasattr(trainer.dist, name):
            counted(trainer.dist, name)
    import torch.distributed.tensor._collective_utils as dtensor  # private: DTensor's own names
    for name in ("scatter", "broadcast"):  # distribute_tensor sends from a rank through these
        if hasattr(dtensor, name):
            counted(dtensor, name)

    def in_phase(name, function, once=False):
        calls = [0]

        def watched(*args, **kwargs):
            calls[0] += 1
            if once and calls[0] > 1:  # the first call only
                return function(*args, **kwargs)
            phase[0] = name
            try:
                with Gathers():
                    return function(*args, **kwargs)
            finally:
                phase[0] = None
        return watched
    build = in_phase("build", trainer.build_model)

    def built(*args):  # and a hook that sees every evaluation forward
        raw_model, optimizer = build(*args)

        def check(module, inputs):
            if not module.training and torch.is_grad_enabled():
                seen["eval_with_grad"] = True
        raw_model.register_forward_pre_hook(check)
        return raw_model, optimizer
    state_dict = trainer.get_model_state_dict

    def exported(*args, **kwargs):
        weights = state_dict(*args, **kwargs)
        seen["exported"] = len(weights)
        return weights
    trainer.build_model, trainer.get_model_state_dict = built, exported
    trainer.save_checkpoint = in_phase("save", trainer.save_checkpoint, once=True)
    trainer.export = in_phase("export", trainer.export)


def whole_grad_bytes(model):
    """Bytes of unsharded gradients FSDP keeps between backwards while gradient sync is off
    (torch's private FSDP state, read here only): in the reduce dtype if one is set, else as the
    unsharded parameter's .grad."""
    total = 0
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        for group in getattr(state, "_fsdp_param_groups", None) or ():
            for param in group.fsdp_params:
                for grad in (param.unsharded_accumulated_grad, param._unsharded_param.grad
                             if hasattr(param, "_unsharded_param") else None):
                    total += grad.numel() * grad.element_size() if grad is not None else 0
    return total


def crash(at):
    step_at, rank = map(int, at.split(":"))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    mine, train_step = int(os.environ["RANK"]) == rank and first_attempt, trainer.train_step

    def crashing_step(run, model, optimizer, windows, step):
        if mine and step + 1 == step_at:
            os._exit(17)  # like a killed process: no cleanup, no goodbye to the group
        return train_step(run, model, optimizer, windows, step)

    trainer.train_step = crashing_step
    run_as_script(trainer)


def no_space(at):
    from_call, rank = map(int, at.split(":"))
    calls, fsync = [], os.fsync

    def fsync_on_a_full_disk(fd):  # the shard's bytes cannot reach the disk
        calls.append(fd)
        if int(os.environ["RANK"]) == rank and len(calls) >= from_call:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fsync(fd)

    os.fsync = fsync_on_a_full_disk  # DCP's file writer calls os.fsync too
    run_as_script(trainer)


if __name__ == "__main__":
    mode, arg = sys.argv[1], sys.argv[2]
    sys.argv = [trainer.__file__] + sys.argv[3:]
    if mode == "killsave":
        kill_in_save(trainer, arg.split(","))
        run_as_script(trainer)
    {"count": count, "crash": crash, "nospace": no_space}[mode](arg)
