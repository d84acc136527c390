"""Runs train_ddp_basic.py's real main() with one function wrapped, for tests that must look inside a
DDP run (launched under torchrun in place of the script; nothing here is imported by the course):

    torchrun ... tests/ddp_probe.py record OUT_DIR [trainer flags]   # each rank writes OUT_DIR/rank{R}.json:
                                                                     # the training-sample ids it read, in order
    torchrun ... tests/ddp_probe.py desync - [trainer flags]         # rank 1 nudges one weight after each epoch,
                                                                     # behind DDP's back
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_ddp_basic as trainer  # noqa: E402


class Recorder(torch.utils.data.Dataset):
    """A dataset that remembers every index read from it."""

    def __init__(self, dataset, seen):
        self.dataset, self.seen = dataset, seen

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        self.seen.append(index)
        return self.dataset[index]


def record(out_dir):
    seen, build = [], trainer.build_datasets

    def build_recorded(args):
        train_set, val_set = build(args)
        return Recorder(train_set, seen), val_set

    trainer.build_datasets = build_recorded
    try:
        trainer.main()
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(seen, f)


def desync():
    train = trainer.train_one_epoch

    def train_then_nudge(model, *args):
        totals = train(model, *args)
        if os.environ["RANK"] == "1":
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] += 1e-3
        return totals

    trainer.train_one_epoch = train_then_nudge
    trainer.main()


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    sys.argv = [trainer.__file__] + sys.argv[3:]
    record(out_dir) if mode == "record" else desync()
