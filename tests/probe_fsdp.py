"""Runs train_fsdp_minigpt.py's real main() counting FSDP's gradient reductions, for the test that
accumulation adds no communication. Launched under torchrun in place of the script; the course
never imports it:

    torchrun ... tests/probe_fsdp.py OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json: {"reduce_scatters": how many times FSDP
        reduce-scattered gradients, "steps": optimizer steps taken}

Errors end the probe as they end the script (helpers.run_as_script).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp_minigpt as trainer  # noqa: E402
from helpers import run_as_script  # noqa: E402

if __name__ == "__main__":
    out_dir, seen = sys.argv[1], {"reduce_scatters": 0, "steps": 0}
    sys.argv = [trainer.__file__] + sys.argv[2:]
    dist, inside = trainer.dist, [False]
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):  # the name varies by release
        if hasattr(dist, name):
            def counted(*args, original=getattr(dist, name), **kwargs):
                outermost = not inside[0]  # one call may be made of the other: count it once
                seen["reduce_scatters"] += outermost
                inside[0] = True
                try:
                    return original(*args, **kwargs)
                finally:
                    inside[0] = not outermost
            setattr(dist, name, counted)
    train_step = trainer.train_step

    def counted_step(*args):
        seen["steps"] += 1
        return train_step(*args)

    trainer.train_step = counted_step
    try:
        run_as_script(trainer)
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(seen, f)
