"""Runs train_tp_minigpt.py's real main() with one rank's copy of a replicated parameter nudged, for
the test that --check-sync catches a tp row whose copies drift apart. Launched under torchrun in
place of the script; the course never imports it:

    torchrun ... tests/probe_tp.py drift STEP:RANK [trainer flags]
        before step STEP, that rank adds 1e-3 to its shard of the final norm's weight (a
        parameter TP does not split: every rank of a tp row holds a copy), as a rank-seeded
        dropout or a wrong random stream would make it drift

Errors end the probe as they end the script (helpers.run_as_script).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_tp_minigpt as trainer  # noqa: E402
from helpers import run_as_script  # noqa: E402


def drift(at):
    import torch
    step_at, rank = map(int, at.split(":"))
    mine, train_step = int(os.environ["RANK"]) == rank, trainer.train_step

    def drifting_step(run, model, optimizer, windows, step):
        if mine and step + 1 == step_at:
            with torch.no_grad():
                model.ln_f.weight.to_local().add_(1e-3)  # this rank's copy, no other's
        return train_step(run, model, optimizer, windows, step)

    trainer.train_step = drifting_step
    run_as_script(trainer)


if __name__ == "__main__":
    at, rest = sys.argv[2], sys.argv[3:]
    assert sys.argv[1] == "drift", sys.argv[1]
    sys.argv = [trainer.__file__] + rest
    drift(at)
