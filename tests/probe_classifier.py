"""Runs train_ddp_basic.py's real main() with one function wrapped, for a test that must see
which samples each rank reads. Launched under torchrun in place of the script; the course never
imports it:

    torchrun ... tests/probe_classifier.py OUT_DIR [trainer flags]

Each rank writes OUT_DIR/rank{RANK}.json: the training-sample ids it read, in order.
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


if __name__ == "__main__":
    out_dir, seen, build = sys.argv[1], [], trainer.build_datasets
    sys.argv = [trainer.__file__] + sys.argv[2:]

    def build_recorded(args):
        train_set, val_set = build(args)
        return Recorder(train_set, seen), val_set

    trainer.build_datasets = build_recorded
    try:
        trainer.main()
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(seen, f)
