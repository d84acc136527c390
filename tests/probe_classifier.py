"""Runs train_ddp_basic.py's real main() with one function wrapped, for tests that must see which
samples each rank reads, or give one rank a different view of the disk. Launched under torchrun in
place of the script; the course never imports it:

    torchrun ... tests/probe_classifier.py record OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json: the training-sample ids it read, in order
    torchrun ... tests/probe_classifier.py hide RANK [trainer flags]
        on that rank no file exists (os.path.isfile is False), as on a node that does not share
        the others' filesystem
    torchrun ... tests/probe_classifier.py nospace N [trainer flags]
        the disk is full from the N-th checkpoint write on: its fsync fails with ENOSPC

Errors end the probe as they end the script: one line and the script's exit code
(helpers.run_as_script).
"""
import errno
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_ddp_basic as trainer  # noqa: E402
from helpers import run_as_script  # noqa: E402


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
        run_as_script(trainer)
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(seen, f)


def hide(rank):
    if int(os.environ["RANK"]) == int(rank):
        trainer.os.path.isfile = lambda path: False
    run_as_script(trainer)


def no_space(from_write):
    writes, fsync = [], os.fsync

    def fsync_on_a_full_disk(fd):  # the checkpoint's bytes cannot reach the disk
        writes.append(fd)
        if len(writes) >= int(from_write):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fsync(fd)

    trainer.os.fsync = fsync_on_a_full_disk
    run_as_script(trainer)


if __name__ == "__main__":
    mode, arg = sys.argv[1], sys.argv[2]
    sys.argv = [trainer.__file__] + sys.argv[3:]
    {"record": record, "hide": hide, "nospace": no_space}[mode](arg)
