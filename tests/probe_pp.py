"""Runs train_pp_minigpt.py's real main() with its schedule watched, for the tests that measure what
each stage holds for backward or kill a worker. Launched under torchrun in place of the script; the
course never imports it:

    torchrun ... tests/probe_pp.py record OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json: {"stage", "steps", "peak_saved_bytes": the most
        bytes of activations its stage held for backward at once during a step (tensors saved by
        autograd, each storage counted once, the weights left out), "micro_batch_saved_bytes":
        what one micro-batch alone leaves saved (the first forward of step 1, before any backward),
        "reduce_scatters", "all_gathers": FSDP's calls inside training steps, "kept_outputs": the
        most outputs the schedule's stage kept after a step (the last stage's logits, if kept),
        "tied_bytes": the bytes it all-reduced in the end stages' group inside training steps,
        "in_step_bytes": the most bytes of gathered weights and whole gradients it held, just
        before its stage reduce-scattered (helpers.fsdp_bytes_held), and with --dropout
        "dropout_mask": the first mask the stage's first dropout drew, hashed}
    torchrun ... tests/probe_pp.py killsave MOMENT@STEP:RANK,... OUT_DIR [trainer flags]
        as record, and a rank SIGKILLed while it saves a step, one spec per attempt
        (helpers.kill_in_save), so that a restarted job gets past it

Errors end the probe as they end the script (helpers.run_as_script).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_pp_minigpt as trainer  # noqa: E402
from helpers import Saved, count_calls, dropout_mask_hook, run_as_script, unpack  # noqa: E402
from helpers import kill_in_save, watch_reduce  # noqa: E402


def record(out_dir):
    import torch
    saved, seen = Saved(), {"steps": 0, "kept_outputs": 0, "reduce_scatters": 0, "all_gathers": 0,
                            "tied_bytes": 0}
    tied, all_reduce = [None], trainer.dist.all_reduce
    pipeline_schedule, train_step = trainer.pipeline_schedule, trainer.train_step

    def watched_schedule(run, model):
        saved.model, seen["stage"], tied[0] = model, run.stage, run.tied
        drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        if drops:  # stage 0's embedding dropout, or the first block's on a later stage
            drops[0].register_forward_hook(dropout_mask_hook(seen))
        schedule = pipeline_schedule(run, model)
        first_stage = getattr(schedule, "_stage", None) or schedule._stages[0]  # or its first
        step, forward = schedule.step, first_stage.forward_one_chunk

        def first_forward(*args, **kwargs):  # what one micro-batch leaves saved, before backward
            out = forward(*args, **kwargs)
            if saved.first is None:
                saved.first = saved.live
            return out

        def watched_step(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, unpack):
                return step(*args, **kwargs)
        first_stage.forward_one_chunk, schedule.step = first_forward, watched_step
        watch_reduce(schedule, model, seen)
        return schedule

    def counted_step(*args):
        seen["steps"], seen["in_step"] = seen["steps"] + 1, True
        try:
            return train_step(*args)
        finally:
            seen["in_step"] = False
            for stage in getattr(args[1], "_stages", None) or [args[1]._stage]:  # what each
                seen["kept_outputs"] = max(seen["kept_outputs"], len(stage.output_chunks))  # keeps

    def watched_all_reduce(tensor, *args, group=None, **kwargs):  # the tied gradient's bytes
        if seen["in_step"] and group is not None and group is tied[0]:
            seen["tied_bytes"] += tensor.numel() * tensor.element_size()
        return all_reduce(tensor, *args, group=group, **kwargs)

    trainer.pipeline_schedule, trainer.train_step = watched_schedule, counted_step
    trainer.dist.all_reduce = watched_all_reduce
    seen["in_step"] = False  # FSDP's calls inside training steps, not evaluation's or export's
    count_calls(trainer.dist, {"reduce_scatter_tensor": "reduce_scatters",  # the names vary by
                               "reduce_scatter_single": "reduce_scatters",  # release
                               "all_gather_into_tensor": "all_gathers",
                               "all_gather_single": "all_gathers"}, seen, lambda: seen["in_step"])
    try:
        run_as_script(trainer)
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            seen.pop("in_step")
            json.dump({**seen, "peak_saved_bytes": saved.peak,
                       "micro_batch_saved_bytes": saved.first}, f)


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
