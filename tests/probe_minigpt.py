"""Runs train_ddp_minigpt.py's real main() with a function wrapped, for tests that look inside a
DDP run or make it fail from outside. Launched under torchrun in place of the script; the course
never imports it:

    torchrun ... tests/probe_minigpt.py record OUT_DIR [trainer flags]
        each rank writes OUT_DIR/rank{RANK}.json: the start of every training window it read, how
        many times DDP's gradient communication hook ran (once per bucket per all-reduce), and with
        --dropout the first mask its embedding dropout drew in training, hashed
    torchrun ... tests/probe_minigpt.py crash STEP:RANK [trainer flags]
        that rank dies as if killed (os._exit, no cleanup) when step STEP begins, on the first
        attempt only (TORCHELASTIC_RESTART_COUNT 0), so a restarted job gets past it
    torchrun ... tests/probe_minigpt.py hang STEP:RANK [trainer flags]
        that rank stops at step STEP as if stuck: it never calls the step's all-reduce
    torchrun ... tests/probe_minigpt.py desync STEP:RANK [trainer flags]
        after step STEP that rank nudges one weight behind DDP's back
    torchrun ... tests/probe_minigpt.py nospace N [trainer flags]
        the disk is full from the N-th checkpoint write on: its fsync fails with ENOSPC
    torchrun ... tests/probe_minigpt.py hide RANK [trainer flags]
        on that rank no file exists (os.path.isfile is False), as on a node that does not share
        the others' filesystem

Errors end the probe as they end the script: one line and the script's exit code
(helpers.run_as_script). The crash, hang and desync modes then end the process without Python's
teardown (os._exit, once the group is left and the output flushed): a restarted rank once
aborted there, after its run had finished ("terminate called without an active exception").
"""
import errno
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_ddp_minigpt as trainer  # noqa: E402
from helpers import dropout_mask_hook, run_as_script  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402


def record(out_dir):
    seen = {"windows": [], "allreduce_calls": 0}

    def counted_allreduce(state, bucket):
        seen["allreduce_calls"] += 1
        return allreduce_hook(state, bucket)

    def ddp_with_counting_hook(*args, **kwargs):
        model = trainer.torch.nn.parallel.DistributedDataParallel(*args, **kwargs)
        model.register_comm_hook(None, counted_allreduce)
        if model.module.drop.p > 0:
            model.module.drop.register_forward_hook(dropout_mask_hook(seen))
        return model

    def rows_and_record(self, k, original=trainer.Windows.rows):
        batch = original(self, k)
        i = k % self.per_epoch
        seen["windows"] += self.starts[i * self.batch:(i + 1) * self.batch].tolist()
        return batch

    trainer.DDP, trainer.Windows.rows = ddp_with_counting_hook, rows_and_record
    try:
        run_as_script(trainer)
    finally:
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(seen, f)


def fault(mode, at):
    step_at, rank = map(int, at.split(":"))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    mine = int(os.environ["RANK"]) == rank and first_attempt
    train_step = trainer.train_step

    def faulty_step(run, model, optimizer, windows, step):
        if mine and step + 1 == step_at and mode == "crash":
            os._exit(17)  # like a killed process: no cleanup, no goodbye to the group
        if mine and step + 1 == step_at and mode == "hang":
            time.sleep(3600)  # alive, but never at this step's all-reduce
        result = train_step(run, model, optimizer, windows, step)
        if mine and step + 1 == step_at and mode == "desync":
            with trainer.torch.no_grad():
                next(model.parameters()).view(-1)[0] += 1e-3
        return result

    trainer.train_step = faulty_step
    try:
        run_as_script(trainer)  # the script's own end: its error line, the group left
    except SystemExit as exit_:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_.code)  # then no Python teardown of torch, whose threads can abort there


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
    if mode == "record":
        record(arg)
    elif mode == "hide":
        if int(os.environ["RANK"]) == int(arg):
            trainer.os.path.isfile = lambda path: False
        run_as_script(trainer)
    elif mode == "nospace":
        no_space(arg)
    else:
        fault(mode, arg)
