"""Runs train_ddp_minigpt.py's real main() with two functions wrapped, for tests that must look inside a
DDP run (launched under torchrun in place of the script; nothing here is imported by the course):

    torchrun ... tests/minigpt_probe.py OUT_DIR [trainer flags]

Each rank writes OUT_DIR/rank{R}.json: the start offsets of every training window it read, and how many
times DDP's gradient communication hook ran (once per bucket per all-reduce of the gradients).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_ddp_minigpt as trainer  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402

seen = {"windows": [], "allreduce_calls": 0}


def counted_allreduce(state, bucket):
    seen["allreduce_calls"] += 1
    return allreduce_hook(state, bucket)


def ddp_with_counting_hook(*args, **kwargs):
    model = trainer.torch.nn.parallel.DistributedDataParallel(*args, **kwargs)
    model.register_comm_hook(None, counted_allreduce)
    return model


def get_and_record(self, k, original=trainer.Windows.get):
    batch = original(self, k)
    i = k % self.per_epoch
    seen["windows"] += self.starts[i * self.batch:(i + 1) * self.batch].tolist()
    return batch


if __name__ == "__main__":
    out_dir = sys.argv[1]
    sys.argv = [trainer.__file__] + sys.argv[2:]
    trainer.DDP, trainer.Windows.get = ddp_with_counting_hook, get_and_record
    trainer.main()
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(seen, f)
