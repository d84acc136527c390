"""Runs train_fsdp_minigpt.py's real main() with a function wrapped, for the tests that count FSDP's
gradient reductions or make a worker die. Launched under torchrun in place of the script; the course
never imports it:

    torchrun ... tests/probe_fsdp.py count OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json: {"reduce_scatters": how many times FSDP
        reduce-scattered gradients, "all_gathers": how many times it gathered weights (both inside
        training steps), "steps": optimizer steps taken, "whole_grad_bytes": the most bytes of
        whole (unsharded) gradients FSDP held between two micro-batches}
    torchrun ... tests/probe_fsdp.py crash STEP:RANK [trainer flags]
        that rank dies as if killed (os._exit, no cleanup) when step STEP begins, on the first
        attempt only (TORCHELASTIC_RESTART_COUNT 0), so a restarted job gets past it
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
from helpers import count_calls, run_as_script  # noqa: E402

def count(out_dir):
    seen = {"reduce_scatters": 0, "all_gathers": 0, "steps": 0, "in_step": False,
            "whole_grad_bytes": 0}
    count_calls(trainer.dist, {"reduce_scatter_tensor": "reduce_scatters",  # the name varies
                               "reduce_scatter_single": "reduce_scatters",  # by release
                               "all_gather_into_tensor": "all_gathers",
                               "all_gather_single": "all_gathers"}, seen, lambda: seen["in_step"])
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

    trainer.train_step = counted_step
    try:
        run_as_script(trainer)
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            seen.pop("in_step")
            json.dump(seen, f)


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
    {"count": count, "crash": crash, "nospace": no_space}[mode](arg)
