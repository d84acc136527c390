"""Runs train_cp_minigpt.py's real main() with its steps watched, for the tests and the measurements
of docs/cp.md. Launched under torchrun in place of the script; the course never imports it:

    torchrun ... tests/probe_cp.py record OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json: {"dp_rank", "cp_rank", "positions": the global
        positions of the tokens it holds, "steps", "peak_saved_bytes": the most bytes of
        activations it held for backward at once during a training step (tensors saved by
        autograd, each storage counted once, the weights left out), "gathered_bytes": the bytes
        of keys and values its all-gathers returned in the first step, "all_gathers": how many}
    torchrun ... tests/probe_cp.py crash STEP:RANK OUT_DIR [trainer flags]
        as record, and that rank SIGKILLs itself when step STEP begins, on the first attempt only
        (TORCHELASTIC_RESTART_COUNT 0), so a restarted job gets past it

Errors end the probe as they end the script (helpers.run_as_script).
"""
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_cp_minigpt as trainer  # noqa: E402
from helpers import Saved, run_as_script, unpack  # noqa: E402


def record(out_dir, crash_at=None):
    import torch
    saved, seen = Saved(), {"steps": 0, "gathered_bytes": 0, "all_gathers": 0}
    kill_step, kill_rank = crash_at or (None, None)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    kill = first_attempt and int(os.environ["RANK"]) == kill_rank
    train_step, gather = trainer.train_step, trainer.GatherContext.forward

    def watched_step(run, model, optimizer, windows, step):
        if kill and step + 1 == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill: no cleanup, no goodbye
        seen.update(dp_rank=run.dp_rank, cp_rank=run.mesh.get_local_rank("cp"),
                    positions=run.context.positions.tolist())
        saved.model, seen["steps"] = model, seen["steps"] + 1
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, unpack):
            return train_step(run, model, optimizer, windows, step)

    def counted_gather(ctx, x, group):
        out = gather(ctx, x, group)
        if seen["steps"] == 1:
            seen["gathered_bytes"] += out.nbytes
            seen["all_gathers"] += 1
        return out

    trainer.train_step, trainer.GatherContext.forward = watched_step, staticmethod(counted_gather)
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
