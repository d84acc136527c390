"""Runs train_4d_minigpt.py's real main() with its schedule watched, for the tests that measure what
each rank holds for backward or kill a worker. Launched under torchrun in place of the script; the
course never imports it:

    torchrun ... tests/probe_4d.py record OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json: {"coords": its (pp, dp, cp, tp) coordinates,
        "steps", "peak_saved_bytes": the most bytes of activations it held for backward at once
        during a step (tensors saved by autograd, each storage counted once, the weights left out),
        "params": the elements of its shards of the parameters}
    torchrun ... tests/probe_4d.py crash STEP:RANK OUT_DIR [trainer flags]
        as record, and that rank SIGKILLs itself when step STEP begins, on the first attempt only
        (TORCHELASTIC_RESTART_COUNT 0), so a restarted job gets past it

Errors end the probe as they end the script (helpers.run_as_script).
"""
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_4d_minigpt as trainer  # noqa: E402
from helpers import Saved, run_as_script, unpack  # noqa: E402


def record(out_dir, crash_at=None):
    import torch
    saved, seen = Saved(), {"steps": 0}
    kill_step, kill_rank = crash_at or (None, None)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    kill = first_attempt and int(os.environ["RANK"]) == kill_rank
    pipeline_schedule, train_step = trainer.pipeline_schedule, trainer.train_step

    def watched_schedule(run, model):
        saved.model = model
        seen["coords"] = [run.mesh.get_local_rank(d) for d in ("pp", "dp", "cp", "tp")]
        seen["params"] = sum(p.to_local().numel() for p in model.parameters())
        schedule = pipeline_schedule(run, model)
        step = schedule.step

        def watched_step(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, unpack):
                return step(*args, **kwargs)
        schedule.step = watched_step
        return schedule

    def counted_step(*args):
        if kill and args[-1] + 1 == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill: no cleanup, no goodbye
        seen["steps"] += 1
        return train_step(*args)

    trainer.pipeline_schedule, trainer.train_step = watched_schedule, counted_step
    try:
        run_as_script(trainer)
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump({**seen, "peak_saved_bytes": saved.peak}, f)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "record":
        out, crash, rest = sys.argv[2], None, sys.argv[3:]
    else:
        crash, out, rest = tuple(map(int, sys.argv[2].split(":"))), sys.argv[3], sys.argv[4:]
    sys.argv = [trainer.__file__] + rest
    record(out, crash)
