"""Runs train_moe_minigpt.py's real main() with its training step watched, for tests/test_moe.py.
Launched under torchrun in place of the script; the course never imports it:

    torchrun ... tests/probe_moe.py record OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json: {"losses": the loss of every step, "norms": its
        gradient norm before clipping (both as train_step returns them, every digit), "all_to_alls":
        how many all_to_all_single calls each step made (forward and backward)}

Errors end the probe as they end the script (helpers.run_as_script).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_moe_minigpt as trainer  # noqa: E402
from helpers import count_calls, run_as_script  # noqa: E402


def record(out_dir):
    seen = {"losses": [], "norms": [], "all_to_alls": [], "calls": 0}
    count_calls(trainer.dist, {"all_to_all_single": "calls"}, seen)
    train_step = trainer.train_step

    def recorded_step(*args):
        before = seen["calls"]
        loss, norm = train_step(*args)
        seen["losses"].append(loss.item())
        seen["norms"].append(norm.item())
        seen["all_to_alls"].append(seen["calls"] - before)
        return loss, norm

    trainer.train_step = recorded_step
    try:
        run_as_script(trainer)
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            seen.pop("calls")
            json.dump(seen, f)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    sys.argv = [sys.argv[0], *sys.argv[3:]]
    assert mode == "record", mode
    record(out)
