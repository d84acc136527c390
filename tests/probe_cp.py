"""Runs train_cp_minigpt.py's real main() with its steps watched, for the tests and the measurements
of docs/cp.md. Launched under torchrun in place of the script; the course never imports it:

    torchrun ... tests/probe_cp.py record OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json: {"dp_rank", "cp_rank", "positions": the global
        positions of the tokens it holds, "fsdp_dims", "fsdp_ranks": the names and ranks of the
        mesh FSDP shards its parameters over, "steps", "peak_saved_bytes": the most bytes of
        activations it held for backward at once during a training step (tensors saved by
        autograd, each storage counted once, the weights left out), "gathered_bytes": the bytes
        of keys and values its all-gathers returned in the first step, "all_gathers": how many,
        "passed_bytes" and "passes": the same for --cp-rotate ring's sends to the next rank,
        "max_rss_bytes": the process's peak resident memory, read when it ends, "dropout_mask": a
        hash of its first dropout mask (the embeddings'), "fsdp": FSDP's {"reduce_scatters",
        "all_gathers"} in the first step (c10d's calls over FSDP's group, not the cp group's)};
        PROBE_RING_WAITS=1 makes each ring pass complete before the step's attention runs
    torchrun ... tests/probe_cp.py killsave MOMENT@STEP:RANK,... OUT_DIR [trainer flags]
        as record, and a rank SIGKILLed while it saves a step, one spec per attempt
        (helpers.kill_in_save), so that a restarted job gets past it

Errors end the probe as they end the script (helpers.run_as_script).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_cp_minigpt as trainer  # noqa: E402
from helpers import (FSDP_CALLS, Saved, count_calls, dropout_mask_hook,  # noqa: E402
                     kill_in_save, run_as_script, unpack)


def record(out_dir):
    import torch
    import resource
    saved, seen = Saved(), {"steps": 0, "gathered_bytes": 0, "all_gathers": 0,
                            "passed_bytes": 0, "passes": 0,
                            "fsdp": {"reduce_scatters": 0, "all_gathers": 0}}
    at_once = os.environ.get("PROBE_RING_WAITS") == "1"
    train_step, gather, pass_on = (trainer.train_step, trainer.GatherContext.forward,
                                   trainer.pass_on)

    cp_group = [None]

    def fsdps(args, kwargs):  # a call on any group but the cp group's (GatherContext's) is FSDP's
        group = kwargs["group"] if "group" in kwargs else (args[2] if len(args) > 2 else None)
        return group != cp_group[0]
    count_calls(trainer.dist, FSDP_CALLS, seen["fsdp"], lambda: seen["steps"] == 1, fsdps)
    mask_hash = dropout_mask_hook(seen)

    def watched_step(run, model, optimizer, windows, step):
        fsdp = next(model.parameters()).device_mesh  # what FSDP shards over
        seen.update(dp_rank=run.dp_rank, cp_rank=run.mesh.get_local_rank("cp"),
                    positions=run.context.positions.tolist(),
                    fsdp_dims=list(fsdp.mesh_dim_names), fsdp_ranks=fsdp.mesh.flatten().tolist())
        saved.model, seen["steps"] = model, seen["steps"] + 1
        cp_group[0] = run.context.group
        hook = model.drop.register_forward_hook(mask_hash)
        try:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, unpack):
                return train_step(run, model, optimizer, windows, step)
        finally:
            hook.remove()

    def counted_gather(ctx, x, group):
        out = gather(ctx, x, group)
        if seen["steps"] == 1:
            seen["gathered_bytes"] += out.nbytes
            seen["all_gathers"] += 1
        return out

    def counted_pass(x, context):
        if seen["steps"] == 1:
            seen["passed_bytes"] += x.nbytes
            seen["passes"] += 1
        arrived = pass_on(x, context)
        if at_once:  # no overlap: wait for the pass before computing (the step time it hides)
            got = arrived()
            return lambda: got
        return arrived

    trainer.train_step, trainer.GatherContext.forward = watched_step, staticmethod(counted_gather)
    trainer.pass_on = counted_pass
    try:
        run_as_script(trainer)
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
            json.dump({**seen, "peak_saved_bytes": saved.peak, "max_rss_bytes": rss}, f)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "record":
        out, crash, rest = sys.argv[2], None, sys.argv[3:]
    else:
        crash, out, rest = sys.argv[2].split(","), sys.argv[3], sys.argv[4:]
    sys.argv = [trainer.__file__] + rest
    if crash:
        kill_in_save(trainer, crash)
    record(out)
