"""Runs train_tp_minigpt.py's real main() watched, for the tests. Launched under torchrun in place
of the script; the course never imports it:

    torchrun ... tests/probe_tp.py record OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json at its first step: {"tp_group", "dp_group": the
        global ranks of the tp row and the dp column it belongs to}, and after the closing sample
        OUT_DIR/sample{RANK}.json: the token ids it drew (every rank samples: each forward is a
        collective of its tp row)
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


def record(out_dir):
    import json
    train_step = trainer.train_step

    def recorded_step(run, model, optimizer, windows, step):
        path = os.path.join(out_dir, f"rank{run.rank}.json")
        if not os.path.exists(path):  # the first step this process takes
            groups = {f"{dim}_group": sorted(trainer.dist.get_process_group_ranks(
                run.mesh[dim].get_group())) for dim in ("tp", "dp")}
            with open(path, "w") as f:
                json.dump(groups, f)
        return train_step(run, model, optimizer, windows, step)

    generate = trainer.GPT.generate

    def recorded_generate(model, *args):
        out = generate(model, *args)
        with open(os.path.join(out_dir, f"sample{os.environ['RANK']}.json"), "w") as f:
            json.dump(out[0].tolist(), f)
        return out

    trainer.train_step, trainer.GPT.generate = recorded_step, recorded_generate
    run_as_script(trainer)


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
    mode, arg, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    sys.argv = [trainer.__file__] + rest
    {"record": record, "drift": drift}[mode](arg)
