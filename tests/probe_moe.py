"""Runs train_moe_minigpt.py's real main() with its training step watched, for tests/test_moe.py.
Launched under torchrun in place of the script; the course never imports it:

    torchrun ... tests/probe_moe.py record OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json: {"losses": the loss of every step, "norms": its
        gradient norm before clipping (both as train_step returns them, every digit), "all_to_alls":
        how many all_to_all_single calls each step made (forward and backward), "sent": the bytes
        this rank's all-to-alls sent to other ranks in each step (its own rows aside)}
    torchrun ... tests/probe_moe.py killsave MOMENT@STEP:RANK,... OUT_DIR [trainer flags]
        as record, and a rank SIGKILLed while it saves a step, one spec per attempt
        (helpers.kill_in_save), so that a restarted job gets past it

Errors end the probe as they end the script (helpers.run_as_script).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_moe_minigpt as trainer  # noqa: E402
from helpers import kill_in_save, run_as_script  # noqa: E402


def record(out_dir):
    seen = {"losses": [], "norms": [], "all_to_alls": [], "sent": [], "calls": 0, "bytes": 0}
    all_to_all, train_step = trainer.dist.all_to_all_single, trainer.train_step

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                **kwargs):
        n = trainer.dist.get_world_size(group)
        splits = input_split_sizes or [input.shape[0] // n] * n
        row = input[:1].numel() * input.element_size()  # bytes a row, the all-to-all's unit
        seen["calls"] += 1
        seen["bytes"] += row * (sum(splits) - splits[trainer.dist.get_rank(group)])
        return all_to_all(output, input, output_split_sizes, input_split_sizes, group=group,
                          **kwargs)

    def recorded_step(run, model, optimizer, windows, step):
        calls, sent = seen["calls"], seen["bytes"]
        loss, norm = train_step(run, model, optimizer, windows, step)
        seen["losses"].append(loss.item())
        seen["norms"].append(norm.item())
        seen["all_to_alls"].append(seen["calls"] - calls)
        seen["sent"].append(seen["bytes"] - sent)
        return loss, norm

    trainer.dist.all_to_all_single, trainer.train_step = counted, recorded_step
    try:
        run_as_script(trainer)
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump({k: v for k, v in seen.items() if k not in ("calls", "bytes")}, f)


if __name__ == "__main__":
    if sys.argv[1] == "record":
        out, crash, rest = sys.argv[2], None, sys.argv[3:]
    else:
        crash, out, rest = sys.argv[2].split(","), sys.argv[3], sys.argv[4:]
    assert sys.argv[1] in ("record", "killsave"), sys.argv[1]
    sys.argv = [trainer.__file__] + rest
    if crash:
        kill_in_save(trainer, crash)
    record(out)
