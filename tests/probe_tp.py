"""Runs train_tp_minigpt.py's real main() watched, for the tests and docs/tp.md's measurements.
Launched under torchrun in place of the script; the course never imports it:

    torchrun ... tests/probe_tp.py record OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json at the end of its first step: {"tp_group",
        "dp_group": the global ranks of the tp row and the dp column it belongs to,
        "collectives": [name, elements of its input] of each functional collective (DTensor's)
        in that step, "peak_saved_bytes": the most bytes of activations it held for backward at
        once in that step (tensors saved by autograd, each storage counted once, the weights left
        out), "dropout_mask": a hash of its first dropout mask (the embeddings'), "fsdp": FSDP's
        {"reduce_scatters", "all_gathers"} in that step (c10d's calls), "sums": [name, dtype,
        elements] of each of DTensor's reductions (all-reduce, reduce-scatter) in that step, and
        "fsdp_sum_dtypes": the dtype of each of FSDP's reduce-scatters}; after the
        closing sample OUT_DIR/sample{RANK}.json: the token ids it drew (every rank samples: each
        forward is a collective of its tp row); at the export OUT_DIR/export{RANK}.json: the
        {"elements", "devices"} of the whole weights get_model_state_dict handed it
    torchrun ... tests/probe_tp.py drift STEP:RANK OUT_DIR [trainer flags]
        as record, and before step STEP that rank adds 1e-3 to its shard of the final norm's
        weight (a parameter TP does not split: every rank of a tp row holds a copy), as a wrong
        dropout seed or random stream would make it drift
    torchrun ... tests/probe_tp.py killsave MOMENT@STEP:RANK,... OUT_DIR [trainer flags]
        as record, and a rank SIGKILLed while it saves a step, one spec per attempt
        (helpers.kill_in_save), so that a restarted job gets past it

Errors end the probe as they end the script (helpers.run_as_script).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_tp_minigpt as trainer  # noqa: E402
from helpers import (FSDP_CALLS, Saved, count_calls, dropout_mask_hook,  # noqa: E402
                     kill_in_save, run_as_script, unpack)


def record(out_dir, drift_at=None):
    import json
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    saved, seen, train_step = Saved(), {}, trainer.train_step
    drift_step, drift_rank = drift_at or (None, None)
    fsdp = {"reduce_scatters": 0, "all_gathers": 0, "on": False}  # FSDP's c10d calls, not DTensor's
    count_calls(trainer.dist, FSDP_CALLS, fsdp, lambda: fsdp["on"])
    # FSDP's sum over dp, and in which dtype: torch 2.14 calls reduce_scatter_single, older
    # releases reduce_scatter_tensor (one of them is noted, so no call is noted twice)
    name = next(n for n in ("reduce_scatter_single", "reduce_scatter_tensor")
                if hasattr(trainer.dist, n))
    scatter = getattr(trainer.dist, name)

    def noted_scatter(*args, **kwargs):
        if fsdp["on"]:
            grad = kwargs["input"] if "input" in kwargs else args[1]
            seen["fsdp_sum_dtypes"].append(str(grad.dtype))
        return scatter(*args, **kwargs)
    setattr(trainer.dist, name, noted_scatter)

    class Collectives(TorchDispatchMode):  # what DTensor sends: its functional collectives
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if func.namespace == "_c10d_functional" and name in (
                    "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
                seen["collectives"].append([name, args[0].numel()])
                if name != "all_gather_into_tensor":
                    seen["sums"].append([name, str(args[0].dtype), args[0].numel()])
            return func(*args, **(kwargs or {}))

    mask_hash = dropout_mask_hook(seen)

    def recorded_step(run, model, optimizer, windows, step):
        if run.rank == drift_rank and step + 1 == drift_step:
            with torch.no_grad():
                model.ln_f.weight.to_local().add_(1e-3)  # this rank's copy, no other's
        path = os.path.join(out_dir, f"rank{run.rank}.json")
        if os.path.exists(path):  # after the first step this process takes
            return train_step(run, model, optimizer, windows, step)
        seen.update({f"{dim}_group": sorted(trainer.dist.get_process_group_ranks(
            run.mesh[dim].get_group())) for dim in ("tp", "dp")}, collectives=[], sums=[],
            fsdp_sum_dtypes=[])
        saved.model, hook = model, model.drop.register_forward_hook(mask_hash)
        fsdp["on"] = True
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, unpack), Collectives():
            out = train_step(run, model, optimizer, windows, step)
        fsdp["on"] = False
        hook.remove()
        counts = {key: fsdp[key] for key in ("reduce_scatters", "all_gathers")}
        with open(path, "w") as f:
            json.dump({**seen, "peak_saved_bytes": saved.peak, "fsdp": counts}, f)
        return out

    generate = trainer.generate_in_row

    def recorded_generate(model, *args):
        out = generate(model, *args)
        with open(os.path.join(out_dir, f"sample{os.environ['RANK']}.json"), "w") as f:
            json.dump(out[0].tolist(), f)
        return out

    gather = trainer.get_model_state_dict

    def recorded_gather(model, options=None):  # the export's: what each rank is handed
        weights = gather(model, options=options)
        with open(os.path.join(out_dir, f"export{os.environ['RANK']}.json"), "w") as f:
            json.dump({"elements": sum(t.numel() for t in weights.values()),
                       "devices": sorted({t.device.type for t in weights.values()})}, f)
        return weights

    trainer.train_step, trainer.generate_in_row = recorded_step, recorded_generate
    trainer.get_model_state_dict = recorded_gather
    run_as_script(trainer)


if __name__ == "__main__":
    if sys.argv[1] == "record":
        out, drift_at, rest = sys.argv[2], None, sys.argv[3:]
    elif sys.argv[1] == "killsave":
        out, drift_at, rest = sys.argv[3], None, sys.argv[4:]
    else:
        drift_at, out, rest = tuple(map(int, sys.argv[2].split(":"))), sys.argv[3], sys.argv[4:]
    kills_at, sys.argv = sys.argv[1] == "killsave" and sys.argv[2], [trainer.__file__] + rest
    if kills_at:
        kill_in_save(trainer, kills_at.split(","))
    record(out, drift_at)
