"""Chapter 3, train_ddp_minigpt.py, under real launches (plain `python` and `torchrun` on
CPU/gloo), with a small model on the default corpus. These tests prove:

1. at 2 processes the ranks read disjoint, non-overlapping training windows (and --debug names
   each rank's first windows, whole lines in rank order); with --grad-accum 2 DDP all-reduces the
   gradients once per optimizer step (a counting comm hook), not once per micro-batch;
2. 2 processes x batch 6 x 2 accumulation steps give the weights of 1 process x batch 24 in one
   micro-batch (accumulation with no_sync is exact within an epoch: an epoch deals whole
   micro-batches, so across epochs the two drop different windows), and the validation loss
   falls, equal to one process's at steps 0 and 18 (evaluation sums, then divides once);
   1 and 2 read the shared 2-process reference run (helpers.ddp_reference: 18 steps, recorded by
   a probe, --debug, launched from a hostile shell), which chapters 7 and 8 reproduce;
3. a worker that dies at step 6 under `torchrun --max-restarts=1` (killed by a probe in tests/,
   not by the trainer) is restarted, and the run resumes from its step-4 checkpoint exactly: its
   step 5 repeats the first attempt's (dropout included);
4. bf16 autocast runs on the CPU, the summary carries the median pace benchmark_scaling.py reads,
   a --compile'd model's checkpoint has no `_orig_mod.` keys, and `--sample` generates from that
   checkpoint in one plain process without torchrun;
5. the model returns the mean loss per token, as GPT code people copy from does;
6. --grad-checkpointing recomputes blocks in backward and yields the plain model's gradients;
7. the no_sync loop holds the forward too: counted, the script's accumulation all-reduces once per
   step, while backward() alone inside no_sync() all-reduces every micro-batch (same gradients);
8. a second layout: 3 processes log one process's losses, gradient norms (where a clip binds and
   where it does not) and validation losses over windows dealt unequally, and their checkpoint
   goes on in one process with the uninterrupted run's next steps;
9. on two nodes of one process, with dropout, each rank reads its own windows and draws its own
   masks (recorded by the probe: the two ranks' differ);
10. with --amp bf16 the matrix products run in bf16 while DDP all-reduces fp32 gradients, and
    2 processes under bf16 with recomputation, on a file of token ids, log the one-process
    bf16 run's numbers at the same global batch within bf16's rounding;
11. in one process: recomputation with dropout logs the run without it (the forward's masks
    replayed), weight decay falls on the 2-D tensors alone, a fake clock sees training timed
    alone (every log line 1000.0 ms/step, at --log-every 2 too), two epochs at world 2 give
    whole micro-batches on both ranks, and a resume restores the global rank's random state.
Bad inputs are in test_minigpt_inputs.py; --check-sync and timeouts in test_debugging.py.
"""
import collections
import contextlib
import io
import json
import re
import types
import unittest.mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import logged_grad_norms as grad_norms, logged_losses as losses
from helpers import logged_val_losses as val_losses
from helpers import assert_bf16_run_is_one_processs, bf16
from helpers import FakeClock, assert_a_world_of_one_schedules_times_and_samples_as_it_should
from helpers import (GPT, REPO, SHARDED, TINY_GPT, command, ddp_dropout_reference, ddp_reference,
                     in_process, ok, one_process_group, started, summary, trainer, weights)
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

gpt = trainer(GPT)


CONTRACT = {  # tests/README.md, "One proof for every GPT chapter"; None: not held yet
    "reference": ["test_disjoint_windows_one_allreduce_per_step_and_accumulation_is_exact",
                  "test_three_processes_log_one_processs_norms_and_validation_and_resume_at_one"],
    "norms": ["test_three_processes_log_one_processs_norms_and_validation_and_resume_at_one"],
    "padded": ["test_three_processes_log_one_processs_norms_and_validation_and_resume_at_one"],
    "dropout": ["test_on_two_nodes_each_rank_reads_its_own_windows_and_draws_its_own_masks"],
    "collectives": ["test_disjoint_windows_one_allreduce_per_step_and_accumulation_is_exact",
                    "test_no_sync_holds_the_forward_too_or_every_micro_batch_all_reduces"],
    "policy": ["test_bf16_computes_in_bf16_while_ddp_all_reduces_fp32_gradients"],
    "resume": ["test_three_processes_log_one_processs_norms_and_validation_and_resume_at_one",
               "test_a_crashed_worker_is_restarted_and_resumes_exactly"],
    "bf16": ["test_two_ddp_processes_in_bf16_log_one_processs_bf16_numbers"],
}
# Three processes of 6 sequences x 2 micro-batches (36 a step), a clip of 1.9 that binds in steps
# 1, 3 and 6 and not in 2, 4 and 5, and 13 validation windows dealt 5, 4 and 4 to the replicas.
THREE = SHARDED + ["--clip", 1.9, "--eval-windows", 13, "--eval-every", 4]


def steps_logged(out):
    """{step: the whole training log line} for every `step N/M | loss ...` line."""
    return {int(m.group(1)): line for line in out.splitlines()
            if (m := re.match(r"step (\d+)/\d+ \| loss ", line))}


@pytest.fixture(scope="module", autouse=True)
def crashed(tmp_path_factory):
    """The module's own launch, started as the module starts (its test comes last: the in-process
    tests run meanwhile): rank 1 crashes as step 6 begins, under torchrun --max-restarts=1. Call
    it for (its CompletedProcess, its folder)."""
    folder = tmp_path_factory.mktemp("crash")
    flags = TINY_GPT + ["--max-steps", 8, "--save-every", 4, "--dropout", 0.1, "--batch-size", 4,
                        "--grad-accum", 2, "--save", folder / "ck.pt", "--resume", "auto"]
    wait = started({"crash": (command("tests/probe_minigpt.py", ["crash", "6:1", *flags], nproc=2,
                                      torchrun_args=["--max-restarts=1"]),
                              REPO, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})})
    yield lambda: (wait()["crash"], folder)
    wait()  # never leave it running


@pytest.fixture(scope="module", autouse=True)
def three(tmp_path_factory):
    """The module's second launch, started as the module starts: THREE at 3 processes for 4 steps,
    saved at step 4. Call it for (what it printed, its checkpoint)."""
    ckpt = tmp_path_factory.mktemp("three") / "ck.pt"
    wait = started({"three": (command(GPT, [*THREE, "--max-steps", 4, "--save", ckpt], nproc=3),
                              REPO, None)})
    yield lambda: (ok(wait()["three"]), ckpt)
    wait()  # never leave it running


@pytest.fixture(scope="module", autouse=True)
def bf16_pair():
    """The module's third launch, started as the module starts: 2 processes of 6 sequences under
    --amp bf16 with --grad-checkpointing on a file of token ids (helpers.bf16, no dropout). Call
    it for what it printed."""
    wait = started({"bf16": (command(GPT, [*bf16(dropout=False), "--batch-size", 6], nproc=2),
                             REPO, None)})
    yield lambda: ok(wait()["bf16"])
    wait()  # never leave it running


def test_two_ddp_processes_in_bf16_log_one_processs_bf16_numbers(bf16_pair):
    """DDP at 2 processes under bf16 with recomputation logs chapter 3's one-process bf16 run at
    the same global batch (12 sequences), within the tolerances helpers.assert_bf16_run_is_one_
    processs argues (its control: dropout flipped differs by more), and the data, parameter and
    tokens-per-step lines the test computes. Without dropout: each DDP rank draws its own masks,
    where one process draws one stream."""
    assert_bf16_run_is_one_processs(bf16_pair(), dropout=False)


def test_three_processes_log_one_processs_norms_and_validation_and_resume_at_one(three):
    """3 processes (THREE, 4 steps) log what one process logs at the same global batch (18 x 2,
    in this process, 6 steps): the losses, the gradient norms before clipping where --clip 1.9
    binds and where it does not, and the validation losses over 13 windows dealt unequally. Their
    checkpoint of step 4 goes on in one process with the uninterrupted run's steps 5 and 6. Its
    summary counts the tokens of every rank in a step (3 x 6 x 32 x 2, the world line's) and its
    throughput is those over a step's time."""
    out, ckpt = three()
    one = in_process(GPT, [*THREE, "--batch-size", 18, "--max-steps", 6, "--save", ""])
    assert "world size 3 |" in out and sorted(losses(out)) == [1, 2, 3, 4]
    pace = summary(out)  # every rank's tokens: 3 replicas x 6 sequences x 32 tokens x 2
    assert pace["per_step"] == 3 * 6 * 32 * 2 and pace["steps"] == 4, pace
    assert pace["throughput"] == pytest.approx(pace["per_step"] / (pace["step_ms"] / 1000),
                                               rel=0.01), pace
    for step in range(1, 5):
        assert losses(out)[step] == pytest.approx(losses(one)[step], rel=1e-5), step
        assert grad_norms(out)[step] == pytest.approx(grad_norms(one)[step], abs=2e-3), step
    binds = [grad_norms(one)[step] > 1.9 for step in range(1, 7)]
    assert binds == [True, False, True, False, False, True], binds
    assert sorted(val_losses(out)) == [0, 4]
    assert all(val_losses(out)[s] == pytest.approx(val_losses(one)[s], abs=1e-4) for s in (0, 4))
    resumed = in_process(GPT, [*THREE, "--batch-size", 18, "--max-steps", 6, "--resume", ckpt,
                               "--save", ""])
    assert f"resumed from {ckpt} at step 4" in resumed and sorted(losses(resumed)) == [5, 6]
    for step in (5, 6):
        assert losses(resumed)[step] == pytest.approx(losses(one)[step], rel=1e-5), step
        assert grad_norms(resumed)[step] == pytest.approx(grad_norms(one)[step], abs=2e-3), step
    assert val_losses(resumed)[6] == pytest.approx(val_losses(one)[6], abs=1e-4)


def test_on_two_nodes_each_rank_reads_its_own_windows_and_draws_its_own_masks():
    """With --dropout 0.1 on two nodes of one process (helpers.NOISY, the run chapters 7 and 8
    compare with), the ranks read disjoint windows (dealt by global rank: by the rank on its node,
    both would read the same) and their first dropout masks differ: each rank seeds its own. The
    control: the run without dropout (ddp_reference, through the same probe) records no mask."""
    _, folder = ddp_dropout_reference()
    seen = [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    masks = [rank.get("dropout_mask") for rank in seen]
    assert None not in masks and masks[0] != masks[1], masks
    assert len(seen[0]["windows"]) == 4 * 2 * 6  # steps x micro-batches x batch
    assert not set(seen[0]["windows"]) & set(seen[1]["windows"])
    plain = json.loads((ddp_reference()[2] / "rank0.json").read_text())
    assert "dropout_mask" not in plain and plain["allreduce_calls"] == 18


def test_bf16_computes_in_bf16_while_ddp_all_reduces_fp32_gradients(monkeypatch):
    """The mixed-precision policy, in one process of a world of one: with --amp bf16 the head's
    logits come out in bf16 in training (autocast runs the matrix products in bf16), while the
    weights and their gradients stay fp32, so DDP all-reduces fp32 buckets (a comm hook records
    their dtype). A model cast to bf16 would all-reduce, and round, in bf16."""
    seen = {"logits": set(), "buckets": set()}
    wrap = gpt.DDP

    def recorded(bucket_state, bucket):
        seen["buckets"].add(bucket.buffer().dtype)
        return allreduce_hook(bucket_state, bucket)

    def logits(module, inputs, output):
        if module.training:  # the evaluation's forward runs in bf16 too; training is what counts
            seen["logits"].add(output.dtype)

    def ddp_recording(*args, **kwargs):
        model = wrap(*args, **kwargs)
        model.register_comm_hook(None, recorded)
        model.module.head.register_forward_hook(logits)
        return model
    monkeypatch.setattr(gpt, "DDP", ddp_recording)
    in_process(GPT, [*TINY_GPT, "--max-steps", 2, "--amp", "bf16", "--save", "",
                     "--max-new-tokens", 1])
    assert seen == {"logits": {torch.bfloat16}, "buckets": {torch.float32}}, seen


def test_each_step_applies_and_logs_the_schedules_learning_rate(monkeypatch):
    """The learning rate the optimizer applies at each step, and the one the log shows, are the
    schedule's, worked out by hand: TINY_GPT's 1e-2 after 2 warmup steps (5e-3, then 1e-2), then
    the cosine over steps 2 and 3 down towards --min-lr 3e-4 (1e-2, then halfway: 5.15e-3)."""
    applied, make = [], gpt.make_optimizer

    def recorded(*args):
        optimizer = make(*args)
        optimizer.register_step_pre_hook(
            lambda opt, *_: applied.append(opt.param_groups[0]["lr"]))
        return optimizer
    monkeypatch.setattr(gpt, "make_optimizer", recorded)
    out = in_process(GPT, [*TINY_GPT, "--max-steps", 4, "--save", "", "--max-new-tokens", 1])
    assert applied == pytest.approx([5e-3, 1e-2, 1e-2, 5.15e-3], rel=1e-9)
    logged = [float(line.split(" | lr ")[1].split()[0]) for line in steps_logged(out).values()]
    assert logged == pytest.approx(applied, rel=1e-2)  # printed to 3 digits


def test_each_rank_evaluates_its_own_validation_windows_once():
    """13 validation windows on 3 ranks: 5, 4 and 4 windows, none on two ranks, all 13 scored.
    A rank that scored every window would give the same mean, three times over the work."""
    args = gpt.parse_args(["--block-size", "8", "--eval-windows", "13", "--batch-size", "3"])
    val, seen = np.arange(1000) % 256, []
    for rank in range(3):
        run = types.SimpleNamespace(args=args, rank=rank, world_size=3, device=torch.device("cpu"))
        seen.append([row[0].item() for x, _ in gpt.validation_batches(run, val) for row in x])
    assert [len(windows) for windows in seen] == [5, 4, 4]
    assert sorted(sum(seen, [])) == [9 * i % 256 for i in range(13)]  # windows of 9 tokens


def test_each_epoch_deals_a_new_order_that_the_ranks_share_out():
    """Each epoch shuffles the windows again (seeded by seed + epoch), and in every epoch the two
    ranks read different windows: the set_epoch that DistributedSampler needs, built in."""
    tokens = np.arange(2000) % 256
    ranks = [gpt.Windows(tokens, 8, 4, rank, 2, seed=0) for rank in (0, 1)]
    for epoch in (0, 1):
        mine = [set(w.starts_of_epoch(epoch).tolist()) for w in ranks]
        assert mine[0] and not mine[0] & mine[1]
    assert list(ranks[0].starts_of_epoch(0)) != list(ranks[0].starts_of_epoch(1))


def test_the_validation_loss_is_summed_in_fp32_from_bf16_logits():
    """Under --amp bf16 the logits come out in bf16; the validation loss sums their cross-entropy
    in fp32 (float64 totals), within 1e-6 of a float64 sum. Summed in bf16 it is off by more than
    1e-4 (the control)."""
    import torch.distributed as dist
    torch.manual_seed(0)
    logits = (3 * torch.randn(4, 32, 256)).to(torch.bfloat16)
    targets = torch.randint(0, 256, (4, 32))
    class Fixed(torch.nn.Module):  # a model whose forward returns those logits
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return logits, None
    exact = F.cross_entropy(logits.double().flatten(0, 1), targets.flatten()).item()
    with one_process_group():
        dist.init_process_group("gloo")
        mean = gpt.mean_loss_over_ranks(Fixed(), [(None, targets)], contextlib.nullcontext())
    assert mean == pytest.approx(exact, rel=1e-6)
    rounded = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    assert abs(rounded.item() / targets.numel() - exact) > 1e-4


def test_fp16_clips_and_logs_the_unscaled_gradient_norm(monkeypatch):
    """fp16 needs a GradScaler, whose loss scale (65,536 at first) multiplies every gradient; the
    step unscales them before clipping, so the clip and the logged norm see the true gradients:
    within 2% of the fp32 run's (clipped first, the norm would be the scale times larger). The
    script refuses fp16 on a CPU; the test lets it through to run the path."""
    monkeypatch.setattr(gpt, "amp_dtype", lambda choice, device: {"fp16": torch.float16,
                                                                  "off": None}[choice])
    flags = [*TINY_GPT, "--max-steps", 2, "--save", "", "--max-new-tokens", 1]
    half = in_process(GPT, flags + ["--amp", "fp16"])
    full = in_process(GPT, flags + ["--amp", "off"])
    assert "amp float16" in half and sorted(grad_norms(half)) == [1, 2]
    for step in (1, 2):
        assert grad_norms(half)[step] == pytest.approx(grad_norms(full)[step], rel=0.02), step


def test_disjoint_windows_one_allreduce_per_step_and_accumulation_is_exact(tmp_path):
    out, ckpt, records = ddp_reference()  # 2 processes x batch 6 x 2 micro-batches, 18 steps
    ranks = [json.loads((records / f"rank{r}.json").read_text()) for r in (0, 1)]
    for seen in ranks:
        assert len(seen["windows"]) == 18 * 2 * 6  # steps x micro-batches x batch
        assert seen["allreduce_calls"] == 18  # one bucket (a tiny model), once per optimizer step
    both = ranks[0]["windows"] + ranks[1]["windows"]
    assert len(set(both)) == len(both)  # no window read twice, by one rank or by both
    starts = sorted(both)
    assert min(b - a for a, b in zip(starts, starts[1:])) >= 33  # 33-token windows never overlap
    logged = re.findall(r"^\[rank (\d)\] \d+ micro-batches per epoch, first windows at tokens "
                        r"\[([\d, ]+)\]$", out, re.M)
    assert logged == [(str(r), ", ".join(map(str, ranks[r]["windows"][:4]))) for r in (0, 1)]
    losses = val_losses(out)
    assert sorted(losses) == [0, 6, 12, 18] and losses[18] < losses[0] - 0.5  # evaluated every 6

    # the reference: one process, batch 24 in one micro-batch, in this test process
    single = in_process(GPT, [*SHARDED, "--max-steps", 18, "--batch-size", 24, "--grad-accum", 1,
                              "--save", tmp_path / "one.pt"])
    assert "world size 1 |" in single
    logged = [{step: float(line.split(" | ")[1].split()[1]) for step, line in steps_logged(o).items()}
              for o in (out, single)]
    assert sorted(logged[0]) == list(range(1, 19))
    assert logged[0] == pytest.approx(logged[1], rel=1e-5)  # every step's loss
    assert sorted(val_losses(single)) == [0, 18]  # evaluation: one process's, to 4 decimals
    assert all(val_losses(single)[s] == pytest.approx(losses[s], abs=1e-4) for s in (0, 18))
    a, b = weights(ckpt), weights(tmp_path / "one.pt")
    for key in a:  # 18 steps of AdamW carry the order of float sums to ~3e-5: chapter 7's 1e-4
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-4, msg=key)


def test_bf16_on_cpu_compile_free_keys_and_sampling_without_torchrun(tmp_path):
    out = in_process(GPT, [*TINY_GPT, "--max-steps", 3, "--amp", "bf16", "--compile",
                           "--compile-backend", "eager", "--save", tmp_path / "bf16.pt"])
    result = summary(out)
    assert "amp bfloat16" in out and result["steps"] == 3
    assert result["per_step"] == 16 * 32 and result["throughput_unit"] == "tokens/s"
    assert result["throughput"] == pytest.approx(result["per_step"] / (result["step_ms"] / 1000),
                                                 rel=0.01)
    with torch.autocast("cpu", dtype=gpt.amp_dtype("bf16", torch.device("cpu"))):  # as main() does
        logits, _ = gpt.GPT(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16,
                            dropout=0.0)(torch.zeros(1, 8, dtype=torch.long))
    assert logits.dtype == torch.bfloat16  # the matrix products really ran in bf16
    plain = set(gpt.GPT(**torch.load(tmp_path / "bf16.pt", weights_only=True)["config"]).state_dict())
    keys = set(weights(tmp_path / "bf16.pt"))
    assert keys == plain and not any("_orig_mod" in k or "module." in k for k in keys)
    printed = io.StringIO()  # sampling: straight through main(), with no torchrun variables set
    with contextlib.redirect_stdout(printed):
        gpt.main(["--sample", "--ckpt", str(tmp_path / "bf16.pt"), "--prompt", "def ",
                  "--max-new-tokens", "40"])
    assert printed.getvalue().startswith("def ") and len(printed.getvalue().encode()) > 40
    assert not torch.distributed.is_initialized()  # it made no process group: one plain process


def test_the_model_returns_the_mean_loss_per_token():
    torch.manual_seed(0)
    model = gpt.GPT(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0)
    x = torch.randint(0, 256, (3, 17))
    logits, loss = model(x[:, :-1], x[:, 1:])
    assert loss.dim() == 0 and 4.5 < loss.item() < 6.5  # about ln 256 = 5.5 for a fresh model
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()))


def test_grad_checkpointing_gives_the_same_gradients_with_less_stored():
    """--grad-checkpointing recomputes each block in backward instead of keeping its activations:
    the gradients must be those of the plain model (dropout 0: both passes are deterministic)."""
    grads, block_runs = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = gpt.GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
        model.grad_checkpointing = checkpointing
        runs = []  # a pre-hook: the recompute may stop early, before the block's end
        model.blocks[0].register_forward_pre_hook(lambda *_, runs=runs: runs.append(1))
        x = torch.randint(0, 256, (4, 17))
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
        block_runs.append(len(runs))
    assert block_runs == [1, 2]  # checkpointing really recomputed the block during backward
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


class MeanSquare(torch.nn.Module):
    """A model of the course's shape: (outputs, mean loss)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        out = self.linear(x)
        return out, F.mse_loss(out, y)


def test_no_sync_holds_the_forward_too_or_every_micro_batch_all_reduces():
    """3 steps of 2 micro-batches, counted by a comm hook (one call per bucket per all-reduce; this
    model is one bucket): the script's own accumulate_gradients all-reduces once per step; the
    tempting form with only backward() inside no_sync() all-reduces on every micro-batch, with the
    same gradients, so only a count shows it."""
    from helpers import one_process_group
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    counts, grads = {}, {}
    with one_process_group():
        torch.distributed.init_process_group("gloo")
        for form in ("the script's", "backward only"):
            torch.manual_seed(0)
            model, calls = torch.nn.parallel.DistributedDataParallel(MeanSquare()), []
            model.register_comm_hook(None, lambda state, bucket: calls.append(1)
                                     or allreduce_hook(state, bucket))
            off = torch.autocast("cpu", enabled=False)
            scaler = torch.amp.GradScaler("cpu", enabled=False)
            for _ in range(3):
                batches = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(2)]
                if form == "the script's":
                    gpt.accumulate_gradients(model, batches, off, scaler)
                    continue
                for i, (x, y) in enumerate(batches):
                    _, loss = model(x, y)  # the forward outside no_sync: DDP has decided to sync
                    with contextlib.nullcontext() if i == len(batches) - 1 else model.no_sync():
                        (loss / len(batches)).backward()
            counts[form], grads[form] = len(calls), model.module.linear.weight.grad.clone()
    assert counts == {"the script's": 3, "backward only": 6}
    torch.testing.assert_close(grads["the script's"], grads["backward only"])


def test_recomputation_draws_the_forwards_dropout_masks_again():
    """With --dropout 0.1, in this process as a world of one, --grad-checkpointing logs the losses
    and gradient norms of the same run without it, to every printed digit: the backward
    recomputes each block from the random state its forward drew from (the checkpoint keeps and
    replays it), so the gradients belong to the forward's masks. The control: the run at
    --dropout 0 logs other losses, so the masks count."""
    flags = [*TINY_GPT, "--max-steps", 3, "--eval-every", 3, "--eval-windows", 2, "--save", "",
             "--max-new-tokens", 1]
    kept, recomputed, still = (
        in_process(GPT, [*flags, "--dropout", dropout, *more])
        for dropout, more in ((0.1, []), (0.1, ["--grad-checkpointing"]), (0.0, [])))
    assert sorted(losses(kept)) == [1, 2, 3] and sorted(grad_norms(kept)) == [1, 2, 3]
    assert losses(recomputed) == losses(kept) and grad_norms(recomputed) == grad_norms(kept)
    assert losses(still)[1] != losses(kept)[1]


def test_weight_decay_falls_on_the_matrices_and_embeddings_alone():
    """make_optimizer's decayed group (--weight-decay 0.3) holds exactly the 2-D tensors, named
    here: the tied embedding and head matrix (once), the position embeddings and each block's
    qkv, proj and two MLP weights; the other group, at weight decay 0, holds every LayerNorm's
    gain and bias and every Linear's bias (decayed, a norm's gain would be pulled towards 0). The
    control: those vectors are parameters too, so decaying every parameter would differ."""
    args = gpt.parse_args(["--weight-decay", "0.3"])
    model = gpt.GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    decayed, kept = gpt.make_optimizer(model, args, torch.device("cpu")).param_groups
    names = {id(p): name for name, p in model.named_parameters()}  # the tied matrix once
    blocks = [f"blocks.{i}." for i in range(2)]
    matrices = ["tok_emb.weight", "pos_emb.weight"] + [
        b + m + ".weight" for b in blocks for m in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")]
    vectors = ["ln_f.weight", "ln_f.bias"] + [
        b + m for b in blocks for m in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias",
                                        "attn.qkv.bias", "attn.proj.bias", "mlp.0.bias",
                                        "mlp.2.bias")]
    assert (decayed["weight_decay"], kept["weight_decay"]) == (0.3, 0.0)
    assert sorted(names[id(p)] for p in decayed["params"]) == sorted(matrices)
    assert sorted(names[id(p)] for p in kept["params"]) == sorted(vectors)
    assert model.head.weight is model.tok_emb.weight and len(matrices) == 2 + 4 * 2
    assert sorted(names.values()) == sorted(matrices + vectors) and vectors  # the control


def test_a_world_of_one_schedules_times_training_alone_and_samples_in_eval_mode(tmp_path):
    """Chapter 3 passes the check chapters 7-12 pass (helpers.assert_a_world_of_one_schedules_
    times_and_samples_as_it_should, without --export, which chapter 3 has not): the schedule's
    learning rates, 1000.0 ms/step on a clock that only the test moves (1 s a step, 100 s each
    evaluation and save, never counted), steps in training mode, the sample in evaluation mode.
    Then at --log-every 2, with an evaluation and a save after every step: each logged line
    still says 1000.0 ms/step, so the steps between log lines are timed too (a clock restarted
    after each step but not stopped would drop them: 500.0). The control: the unlogged steps
    1 and 3 ran, were evaluated and saved (the clock moved 1 + 200 s each)."""
    assert_a_world_of_one_schedules_times_and_samples_as_it_should(GPT, [], tmp_path,
                                                                  dense=False, export=False)
    clock, calls = FakeClock(), collections.Counter()

    def moving(function, seconds):
        def moved(*args):
            calls[function.__name__] += 1
            result = function(*args)
            clock.now += seconds
            return result
        return moved
    with unittest.mock.patch.multiple(
            gpt, time=clock, train_step=moving(gpt.train_step, 1),
            evaluate=moving(gpt.evaluate, 100), save_checkpoint=moving(gpt.save_checkpoint, 100)):
        out = in_process(GPT, [*TINY_GPT, "--max-steps", 4, "--log-every", 2, "--eval-every", 1,
                               "--eval-windows", 2, "--save", tmp_path / "every.pt",
                               "--save-every", 1, "--max-new-tokens", 1])
    logged = re.findall(r"^step (\d)/4 \| loss .* \| (\S+) ms/step", out, re.M)
    assert logged == [("2", "1000.0"), ("4", "1000.0")], out
    assert calls == {"train_step": 4, "evaluate": 5, "save_checkpoint": 4}, calls
    assert clock.now == 4 * 1 + 5 * 100 + 4 * 100


def test_every_micro_batch_of_two_epochs_is_whole_on_both_ranks():
    """At world 2, each rank's share of an epoch is per_epoch micro-batches of B windows: over two
    whole epochs every micro-batch of rank 0 and of rank 1 is a full (B, T + 1) block of tokens,
    per_epoch being the windows that fit (whatever the offset) split over the ranks, in batches:
    (2000 - 8) // 9 // 2 // 4 = 27. An epoch dealt per_epoch x B windows in all, not per rank,
    would run short halfway, then empty. The control: the two epochs read other windows."""
    tokens = np.arange(2000) % 256
    for rank in (0, 1):
        windows = gpt.Windows(tokens, 8, 4, rank, 2, seed=0)
        assert windows.per_epoch == (2000 - 8) // 9 // 2 // 4
        shapes = [tuple(windows.rows(k).shape) for k in range(2 * windows.per_epoch)]
        assert shapes == [(4, 9)] * (2 * 27), (rank, sorted(set(shapes)))
        firsts = [windows.starts_of_epoch(epoch) for epoch in (0, 1)]
        assert list(firsts[0]) != list(firsts[1])


def test_a_resume_restores_the_random_state_of_the_global_rank(tmp_path, monkeypatch):
    """A checkpoint of 2 ranks holds 2 random states; loaded as rank 1 on a node where it is
    LOCAL_RANK 0 (two nodes of one process), the run gets rng[1] back, its global rank's: by
    the rank on its node, ranks 0 and 1 would resume one dropout stream. The control: the two
    saved states differ, and loaded as rank 0 the run gets rng[0]."""
    args = gpt.parse_args(list(map(str, TINY_GPT)))
    data = types.SimpleNamespace(vocab_size=256, itos=None)
    model = gpt.GPT(**gpt.model_config(args, 256))
    optimizer = gpt.make_optimizer(model, args, torch.device("cpu"))
    amp, autocast, scaler = gpt.mixed_precision("off", torch.device("cpu"))
    runs = [gpt.Run(args, torch.device("cpu"), rank, 2, rank == 0, amp, autocast, scaler)
            for rank in (0, 1)]
    with torch.random.fork_rng():
        saved = [torch.manual_seed(seed) and gpt.rng_state(torch.device("cpu")) for seed in (5, 6)]
        torch.save(gpt.checkpoint_state(runs[0], model, optimizer, data, 2, saved),
                   tmp_path / "ck.pt")
        assert not torch.equal(saved[0]["cpu"], saved[1]["cpu"])
        monkeypatch.setenv("LOCAL_RANK", "0")  # rank 1 is the first process of its node
        for rank in (1, 0):
            torch.manual_seed(99)
            assert gpt.load_checkpoint(tmp_path / "ck.pt", runs[rank], model, optimizer,
                                       data) == 2
            assert torch.equal(torch.get_rng_state(), saved[rank]["cpu"]), rank


def test_a_crashed_worker_is_restarted_and_resumes_exactly(crashed):
    """torchrun --max-restarts=1: rank 1 dies as step 6 begins (first attempt only); torchrun
    restarts both workers, --resume auto picks up the step-4 checkpoint, and the restarted run's
    step 5 is the first attempt's step 5 to the printed digit (loss, lr, grad norm): weights,
    optimizer, data position and every rank's dropout stream came back exactly. Its summary counts
    the 4 steps it ran (a clock counting from step 0 would claim 8 in their time)."""
    result, folder = crashed()
    out = ok(result)
    first, _, second = out.partition(f"resumed from {folder / 'ck.pt'} at step 4")
    assert second, out  # the restart resumed from the step-4 checkpoint
    before, after = steps_logged(first), steps_logged(second)
    assert sorted(before) == [1, 2, 3, 4, 5] and sorted(after) == [5, 6, 7, 8]
    assert after[5].split(" | ")[:4] == before[5].split(" | ")[:4]
    assert summary(second)["steps"] == 4  # the restarted run timed its own steps 5-8 alone
    assert torch.load(folder / "ck.pt", weights_only=True)["step"] == 8
