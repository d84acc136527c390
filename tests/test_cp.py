"""Chapter 10, train_cp_minigpt.py (context parallelism inside FSDP, a (dp, cp) mesh), under real
torchrun launches on CPU/gloo. These tests prove:

1. the same math as one process: at the same seed, data and flags (2 accumulation steps, gradient
   norms above --clip, so clipping binds), --cp 2 at 2 processes with --grad-checkpointing logs the
   losses and gradient norms of chapter 3 in one process with the same global batch (1e-5
   relative: the last printed digit of a loss; norms print 3 decimals), for 10 steps (5-14), and
   its validation losses at steps 6 and 12 (1e-4: 4 decimals; the control: they differ by more).
   So would not a run where a rank's queries saw a later token (the loss falls too fast), where the
   positions were a rank's own (0..T/cp - 1, not its tokens' places in the sequence), where a
   rank's keys and values got no gradient from the other rank's queries, where a checkpointed
   block lost its context, or where validation windows were dealt by rank instead of by row or
   their tokens counted twice;
2. dp 2 x cp 2 at 4 processes, two nodes of 2 started through chapter 4's launcher, with
   --grad-sync last (FSDP's no_sync: one reduce-scatter per step), logs the
   losses and gradient norms of 2 DDP processes (1e-5 relative) and their validation losses at
   steps 0 and 6: every rank of a row reads one batch, the rows read what DDP's ranks read, and
   the validation sums of every rank add up (none is left out); FSDP shards over the grid's dp and
   cp dims flattened into one ("dp_cp", every rank) and gathers 4 units a micro-batch, 3 in the
   dropout run at dp 2 x cp 2 (--reshard-after-forward no: block 0 kept whole for its backward);
3. --cp-rotate ring at cp 4 (4 processes) logs one process's losses, gradient norms (1e-5) and
   validation losses (1e-4); each pass carries one rank's keys and values or their fp32 gradients
   (3 + 3 + 4 passes per block and micro-batch, counted, no all-gather; under bf16 K, V travel in
   bf16 and their gradients in fp32, the bytes counted), and a rank holds for
   backward chapter 7's activations at T / cp tokens plus each block's fp32 output and
   log-sum-exps (within 2% of the formula); one ring step's attention and its backward, tile by
   tile, merged by log-sum-exp, equal causal attention and autograd's gradients in one process
   (the controls: outputs merged without their weights, tiles that forget their first row);
   two rings at dp 2 x cp 2 log one process's losses, gradient norms where --clip 2.0 binds and
   where it does not, and validation losses over 13 windows (one batch padded);
4. the split the docs describe: at cp 2 and T 32, context rank 0 holds tokens 0-7 and 24-31 and
   rank 1 tokens 8-23, whatever its row; the split line shows equal attention work (50%, 50%)
   where contiguous halves would give 26% and 74%; at cp 4 the chunks cover each position once
   with equal work; each block's all-gather returns the keys and values of the whole sequence,
   once per block and micro-batch; a chunk's attention (one function and mask on every device,
   so the GPU's path runs here too) equals the rows of whole-sequence causal attention it holds,
   where torch's is_causal=True (aligned with the first key) does not, and torch.compile traces it
   without a graph break (the masks built beforehand); the keys' and values'
   gradients are summed in fp32 under bf16 (rounded once); the training loss is the global sum
   over the global count of targets, so shares with unequal targets (a masked prompt) give one
   process's gradient and loss, where the mean of the ranks' means (the control) does not;
5. checkpoints are chapter 7's: the --cp 2 run resumes chapter 7's checkpoint (step 4), and
   chapter 7 resumes its last (step 14) to step 18 with one process's losses and weights; its
   export samples in chapter 3; rank 0 SIGKILLed in the save of step 12, its .metadata written,
   under `torchrun --max-restarts=1` (the README's restart setting) is restarted and `--resume auto` goes on from step 8 with the
   uninterrupted run's losses (those of item 1); its export holds the weights of its last
   checkpoint, read offline (`dcp_to_torch_save`), exactly (the control: 4 steps on, they differ);
   each rank's random streams come back only at the world size and --cp that saved them (the
   controls: the same cp restores them, another cp or a tp layout does not);
6. bad input is one line and exit code 2: a --cp that does not divide the world size, a
   --block-size that 2 x cp does not divide, more chunks than tokens, a --block-size beyond the
   data (10^13: refused in the data check's words before the context's positions are made, by
   rank 0 alone; the control: a context the data holds passes), a torch without chapter
   10's (2.13) or chapter 9's (2.10) calls, whatever its version (the control: a nightly with them);
7. benchmark_scaling.py reads its summary: the global batch counts the dp rows, not the ranks;
8. a run as a GPU user starts one: --cp 2 under --amp bf16, --grad-checkpointing, --compile
   (aot_eager), --reshard-after-forward no and --debug, on a file of token ids (--data,
   --vocab-size, --val-fraction), logs chapter 3's one-process bf16 numbers within bf16's
   rounding, and the data and parameter lines the test computes; the clipped and dropout runs
   set --weight-decay, --dist-timeout and --amp off too;
9. the start-up lines' numbers, against numbers the test writes out: the world line's tokens and
   replicas at dp 2 x cp 2, each rank's memory at 2 and 4 ranks, the gradients a reduce-scatter
   takes in (--grad-sync every and last), the bytes the split line says a block sends in fp32,
   in bf16, and for a recomputed ring (its passes counted by the probe too).
The schedule and the clock, in this process as a world of one: each step applies and logs
the warmup and cosine worked out by hand, and ms/step leaves out evaluation and saving (the
test moves the clock: 1 s a step, 100 s an evaluation or a save); with dropout, the closing
sample runs every module in evaluation mode.
With --dropout 0.1, in this process as a world of one, --grad-checkpointing logs the losses
and norms of the same run without it (the backward recomputes with the forward's masks).
"""
import json
import types

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from helpers import assert_a_world_of_one_schedules_times_and_samples_as_it_should
from helpers import logged_grad_norms as grad_norms, logged_losses as losses
from helpers import kills, logged_val_losses as val_losses
from helpers import streams_restored
from helpers import assert_every_unit_computes_in_bf16_and_reduces_in_fp32
from helpers import assert_bf16_policy_reduces_in_fp32
from helpers import CLIPPED, assert_clipped_run_is_one_processs, one_process_clipped
from helpers import assert_bf16_run_is_one_processs, bf16, one_process_bf16
from helpers import assert_kv_gradients_summed_in_fp32
from helpers import assert_planned
from helpers import (EVAL_6, GPT, NEEDS_CP, NOISY, REPO, SHARDED, TINY_GPT, as_script, command,
                     ddp_dropout_reference, ddp_reference, finish, in_process, needs_torch, ok,
                     one_process_reference, start, start_two_nodes, summary, trainer)

import benchmark_scaling as bench  # noqa: E402  (the repository is on sys.path: helpers)

pytestmark = needs_torch(*NEEDS_CP)
CP, FSDP = "train_cp_minigpt.py", "train_fsdp_minigpt.py"
cp = trainer(CP)
ONE = SHARDED + ["--batch-size", 12]  # chapter 3's one-process global batch: 12 sequences


CONTRACT = {  # tests/README.md, "One proof for every GPT chapter"; None: not held yet
    "reference": ["test_cp2_logs_one_processs_losses_gradient_norms_and_validation_losses",
                  "test_two_rings_at_dp2_x_cp2_log_one_processs_norms_and_padding",
                  "test_a_ring_of_4_logs_one_processs_losses_and_passes_one_ranks_keys_at_a_time",
                  "test_dp2_x_cp2_on_two_nodes_logs_ddps_losses_and_gradient_norms"],
    "norms": ["test_two_rings_at_dp2_x_cp2_log_one_processs_norms_and_padding"],
    "padded": ["test_a_padded_evaluation_at_dp2_x_cp2_counts_each_target_once",
               "test_two_rings_at_dp2_x_cp2_log_one_processs_norms_and_padding"],
    "dropout": ["test_dropout_draws_its_own_masks_on_every_rank_of_a_row"],
    "collectives": ["test_fsdp_under_cp_reduce_scatters_as_grad_sync_says_and_keeps_the_last_block",
                    "test_a_ring_of_4_logs_one_processs_losses_and_passes_one_ranks_keys_at_a_time",
                    "test_checkpoints_move_between_chapter_7_and_cp_and_a_killed_rank_resumes"],
    "policy": ["test_fsdps_policy_computes_in_bf16_and_reduces_in_fp32",
               "test_key_and_value_gradients_are_summed_in_fp32"],
    "resume": ["test_checkpoints_move_between_chapter_7_and_cp_and_a_killed_rank_resumes"],
    "bf16": ["test_bf16_compiled_at_cp2_logs_one_processs_bf16_numbers"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """dp 2 x cp 2 for 10 steps on two nodes of 2 processes (recorded, --grad-sync last); chapter
    7 in process for 4 steps (its checkpoint: step 4), then --cp 2 from it to step 14, rank 0
    killed in the save of step 12 (.metadata written, run.json not) and restarted (recorded; its last checkpoint: step 14); --cp 4 --cp-rotate
    ring for 6 steps and a ring of 2 under bf16 for 2 (both recorded) beside chapter 7 from step
    14 to 18, in process; chapter 3 at 2 processes (ddp_reference) and at 1
    (one_process_reference)."""
    d = tmp_path_factory.mktemp("cp")
    (d / "grid").mkdir()
    (d / "rec").mkdir()
    grid = start_two_nodes("tests/probe_cp.py", ["record", d / "grid", *SHARDED, "--cp", 2,
                                                 "--max-steps", 10, *EVAL_6, "--save", "",
                                                 "--export", "", "--grad-sync", "last"], nproc=2)
    in_process(FSDP, ONE + ["--max-steps", 4, "--save", d / "ck", "--export", ""])
    cmd = command("tests/probe_cp.py", ["killsave", "metadata@12:0", d / "rec", *ONE, "--cp", 2,
                                        "--max-steps", 14, *EVAL_6, "--grad-checkpointing",
                                        "--save-every", 4, "--save", d / "ck",
                                        "--resume", "auto", "--export", d / "cp.pt"],
                  nproc=2, torchrun_args=["--max-restarts=1"])
    proc = start(cmd, REPO, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})  # pytorch#135712
    r = {"one": one_process_reference(), "ddp": ddp_reference()[0],  # meanwhile
         "ddp noisy": ddp_dropout_reference()[0]}
    r["restarted"] = ok(finish(proc, cmd))
    (d / "ring").mkdir()
    ring = command("tests/probe_cp.py", ["record", d / "ring", *ONE, "--cp", 4, "--cp-rotate",
                                         "ring", "--max-steps", 6, *EVAL_6, "--save", "",
                                         "--export", ""], nproc=4)
    proc = start(ring, REPO)
    (d / "ring16").mkdir()
    ring16 = command("tests/probe_cp.py", ["record", d / "ring16", *ONE, "--cp", 2, "--cp-rotate",
                                           "ring", "--amp", "bf16", "--grad-checkpointing",
                                           "--max-steps", 2, "--save", "", "--export", ""], nproc=2)
    proc16 = start(ring16, REPO)
    (d / "noisy").mkdir()  # dropout and a padded evaluation at dp 2 x cp 2, --grad-sync every
    noisy = command("tests/probe_cp.py", ["record", d / "noisy", *NOISY, "--cp", 2, "--export", "",
                                          "--reshard-after-forward", "no"], nproc=4)
    procn = start(noisy, REPO)
    ring_rows = command(CP, [*CLIPPED, "--cp", 2, "--cp-rotate", "ring", "--export", ""],
                        nproc=4)  # dp 2 x cp 2: two rings
    bf16_cmd = command(CP, [*bf16(dropout=False), "--batch-size", 12, "--cp", 2,
                            "--reshard-after-forward", "no", "--compile", "--compile-backend",
                            "aot_eager", "--debug", "--export", ""], nproc=2)
    one_process_clipped()  # the same global batch in this process, for the two rings
    one_process_bf16(dropout=False), one_process_bf16()
    r["fsdp"] = in_process(FSDP, ONE + ["--max-steps", 18, "--resume", d / "ck", "--save", "",
                                        "--export", d / "f18.pt"])
    r["grid"] = next(out for out in grid() if "world size 4 " in out)  # rank 0's node logs
    r["ring"] = ok(finish(proc, ring))
    r["ring16"] = ok(finish(proc16, ring16))
    r["noisy"] = ok(finish(procn, noisy))
    r["ring rows"] = ok(finish(start(ring_rows, REPO), ring_rows))
    r["bf16"] = ok(finish(start(bf16_cmd, REPO), bf16_cmd))
    return {**r, "dir": d}


def test_two_rings_at_dp2_x_cp2_log_one_processs_norms_and_padding(runs):
    """--cp-rotate ring at dp 2 x cp 2: each row is a ring of its own, its sends addressed by the
    rank within the row's group (at dp 1 a global rank would name the same process, so only a
    second row shows it). The four ranks log one process's losses at the same global batch, its
    gradient norms before clipping where --clip 2.0 binds (steps 1 and 2) and where it does not
    (3 and 4, the control), and its validation losses over 13 windows (7 and 6: one padded)."""
    assert "world size 4 (2 dp x 2 cp)" in runs["ring rows"]
    assert_clipped_run_is_one_processs(runs["ring rows"])


def test_a_padded_evaluation_at_dp2_x_cp2_counts_each_target_once(runs):
    """13 validation windows on 2 rows (7 and 6: one padded batch, whose targets count no token):
    dp 2 x cp 2's step-0 validation loss is DDP's over the same 13 windows. The control: over 32
    windows (chapter 3's run without padding) it differs."""
    noisy, ddp = val_losses(runs["noisy"]), val_losses(runs["ddp noisy"])
    assert noisy[0] == pytest.approx(ddp[0], abs=1e-4)
    assert abs(ddp[0] - val_losses(runs["ddp"])[0]) > 1e-3


def test_dropout_draws_its_own_masks_on_every_rank_of_a_row(runs):
    """At dp 2 x cp 2 with --dropout 0.1 each rank holds its own tokens and seeds by rank: four
    different first masks, where seeded by row a row's two ranks would drop the same units of
    different tokens. The losses still fall."""
    masks = [record(runs["dir"] / "noisy", rank)["dropout_mask"] for rank in range(4)]
    assert len(set(masks)) == 4, masks
    assert losses(runs["noisy"])[4] < losses(runs["noisy"])[1]


def test_fsdp_under_cp_reduce_scatters_as_grad_sync_says_and_keeps_the_last_block(runs):
    """FSDP's own collectives (over dp x cp; not the cp group's gathers of keys and values) in the
    first step of 2 micro-batches, 2 blocks and the root: --grad-sync every reduce-scatters each
    unit per micro-batch (6), last once per step (3, the two-node run); each micro-batch gathers
    the root, both blocks and block 0 again for its backward (4; the last block stays whole).
    With --reshard-after-forward no (the noisy run) block 0 stays whole too: 3 per micro-batch."""
    for run_dir, scatters, gathers in (("noisy", 6, 6), ("grid", 3, 8)):
        for rank in range(4):
            seen = record(runs["dir"] / run_dir, rank)["fsdp"]
            assert seen == {"reduce_scatters": scatters, "all_gathers": gathers}, (
                run_dir, rank, seen)


def record(out_dir, rank):
    """What tests/probe_cp.py recorded of a rank."""
    return json.loads((out_dir / f"rank{rank}.json").read_text())


def test_cp2_logs_one_processs_losses_gradient_norms_and_validation_losses(runs):
    out, (one, _) = runs["restarted"], runs["one"]  # with --grad-checkpointing
    assert "world size 2 (1 dp x 2 cp)" in out
    assert sorted(losses(out)) == list(range(5, 15))
    for step, loss in losses(out).items():  # printed to 4 decimals: 1e-5 relative is the last one
        assert loss == pytest.approx(losses(one)[step], rel=1e-5), step
    for step, norm in grad_norms(out).items():  # above --clip 1.0: clipping binds; 3 decimals
        assert norm > 1.0 and norm == pytest.approx(grad_norms(one)[step], rel=1e-5), step
    assert {6, 12} <= set(val_losses(out))  # every 6 steps, and at its starts (4, 8) and end
    for step in (6, 12):  # 4 decimals; the control: the loss at 6 is not the loss at 12
        assert val_losses(out)[step] == pytest.approx(val_losses(one)[step], abs=1e-4), step
    assert abs(val_losses(one)[6] - val_losses(one)[12]) > 0.01


def test_a_ring_of_4_logs_one_processs_losses_and_passes_one_ranks_keys_at_a_time(runs):
    """--cp-rotate ring at cp 4: one process's losses, norms and validation losses; each pass
    carries one rank's keys and values (or their fp32 gradients), never the whole sequence's."""
    out, (one, _) = runs["ring"], runs["one"]
    assert "world size 4 (1 dp x 4 cp)" in out
    # the split line: a rank's K and V, 0.023 MiB, sent 6 times and their gradients 4 times
    assert "0.23 MiB, K, V in 6 ring passes and their fp32 gradients in 4" in out
    assert sorted(losses(out)) == list(range(1, 7))
    for step, loss in losses(out).items():
        assert loss == pytest.approx(losses(one)[step], rel=1e-5), step
    for step, norm in grad_norms(out).items():
        assert norm > 1.0 and norm == pytest.approx(grad_norms(one)[step], rel=1e-5), step
    assert sorted(val_losses(out)) == [0, 6]
    for step in (0, 6):
        assert val_losses(out)[step] == pytest.approx(val_losses(one)[step], abs=1e-4), step
    one_ranks = 2 * 12 * 8 * 32 * 4  # K and V of a rank: 12 sequences, 8 tokens, width 32, fp32
    for rank in range(4):
        seen = json.loads((runs["dir"] / "ring" / f"rank{rank}.json").read_text())
        # per block (2) and micro-batch (2): 3 passes of K, V forward, 3 in backward and 4 of
        # their gradients (the last brings them home); no all-gather
        assert (seen["passes"], seen["all_gathers"]) == (2 * 2 * 10, 0), seen
        assert seen["passed_bytes"] == 2 * 2 * 10 * one_ranks, seen
        # held for backward: chapter 7's activations at t = 8 tokens (as in
        # test_each_rank_holds_an_early_chunk_and_a_late_one), and per block the output in fp32
        # and a log-sum-exp per query and head: 4 L (t C + t heads) per sequence
        formula = 12 * 4 * (16 * 2 * 8 * 32 + 2 * 8 * 32 + 8 * 256 + 2 * (8 * 32 + 8 * 2))
        assert formula <= seen["peak_saved_bytes"] <= 1.02 * formula, seen


def test_bf16_compiled_at_cp2_logs_one_processs_bf16_numbers(runs):
    """Each sequence split over 2 ranks under --amp bf16, --grad-checkpointing and --compile with
    the aot_eager backend, FSDP keeping the weights gathered between forward and backward, on a
    file of token ids, logs chapter 3's one-process bf16 losses, gradient norms and validation
    losses within bf16's rounding (the keys and values gathered in bf16, their gradients summed
    in fp32), and the data and parameter lines the test computes. No dropout: each rank draws
    its own tokens' masks. Measured on 2 cores (torch 2.14):
    losses, norms and validation losses within 1.7e-3, 5e-3 and 7e-4 of one process's; allowed:
    5e-3, 1.5e-2 and 2e-3."""
    assert_bf16_run_is_one_processs(runs["bf16"], dropout=False)


def test_the_world_memory_accumulation_and_split_lines_are_what_the_test_counts(runs):
    """What rank 0 prints at start-up, against numbers written out here. The world line of dp 2 x
    cp 2: 768 tokens per step, 6 sequences x 32 tokens x 2 micro-batches x 2 replicas (the rows,
    not the 4 ranks). The memory line: 16 bytes (weights, gradients, AdamW's two moments) for a
    quarter of the model's 34,688 parameters (every size divides 4), and for a half at cp 2; the
    accumulation line: the whole fp32 gradients each reduce-scatter takes in. The split line's
    bytes per block and micro-batch: a rank's K and V (12 sequences x 16 tokens x 32 values each)
    go to the other rank twice (forward, and backward's gather again or recompute), in 4 bytes
    at fp32 (the killed run) and in 2 under bf16, and their gradients once, in fp32."""
    whole = 256 * 32 + 32 * 32 + 2 * 32 + 2 * (4 * 32 + 3 * 32 * 32 + 3 * 32 + 32 * 32 + 32
                                                + 2 * 4 * 32 * 32 + 4 * 32 + 32)
    assert whole == 34_688
    grid = runs["grid"]
    assert "| 768 tokens per step (6 x 32 x 2 accumulation x 2 replicas)" in grid
    for out, world in ((grid, 4), (runs["restarted"], 2)):
        mine = whole // world
        assert (f"weights, gradients and AdamW state {16 * mine / 2**20:.2f} MiB ({mine:,} of "
                f"{whole:,} parameters; DDP: {16 * whole / 2**20:.2f} MiB)") in out, world
    assert f"gradients, {4 * whole / 2**20:.2f} MiB, from the first micro-batch" in grid  # last
    assert f"the {4 * whole / 2**20:.2f} MiB of them reduce-scattered 2 times" in runs["restarted"]
    values = 2 * 12 * 16 * 32  # K and V of a rank's tokens
    for out, size in ((runs["restarted"], 4), (runs["bf16"], 2)):
        sent = values * (2 * size + 4) / 2**20
        assert f"| sent per block and micro-batch: {sent:.2f} MiB, K, V all-gathered" in out, size


def test_a_ring_under_bf16_sends_keys_in_bf16_and_their_gradients_in_fp32(runs):
    """--amp bf16 (FSDP's policy: bf16 compute) at cp 2 with --grad-checkpointing: the ring runs,
    its outputs cast back to the compute dtype, with losses near one process's fp32 ones; the
    bytes it sends are K, V in bf16 and dK, dV in fp32 (all in bf16, or all in fp32, would count
    other bytes), and the recomputed forward sends K, V round again, as the split line says."""
    out, (one, _) = runs["ring16"], runs["one"]
    assert sorted(losses(out)) == [1, 2]
    for step, loss in losses(out).items():  # bf16 against fp32: close, not equal
        assert loss == pytest.approx(losses(one)[step], rel=2e-2), step
    unit = 2 * 12 * 16 * 32  # K and V of a rank: 12 sequences, 16 tokens, width 32 (values)
    for rank in range(2):
        seen = json.loads((runs["dir"] / "ring16" / f"rank{rank}.json").read_text())
        # per block (2) and micro-batch (2): K, V in forward, again in the recomputed forward and
        # once in backward, in bf16, and their gradients twice (to the next rank, then home), in
        # fp32
        assert seen["passes"] == 2 * 2 * 5, seen
        assert seen["passed_bytes"] == 2 * 2 * (3 * unit * 2 + 2 * unit * 4), seen
    sent = (3 * unit * 2 + 2 * unit * 4) / 2**20  # a block's micro-batch
    assert (f"| sent per block and micro-batch: {sent:.2f} MiB, K, V in 3 ring passes and their "
            "fp32 gradients in 2") in out


def test_dp2_x_cp2_on_two_nodes_logs_ddps_losses_and_gradient_norms(runs):
    grid, ddp = runs["grid"], runs["ddp"]
    assert "world size 4 (2 dp x 2 cp)" in grid
    assert sorted(losses(grid)) == list(range(1, 11))
    for step, loss in losses(grid).items():
        assert loss == pytest.approx(losses(ddp)[step], rel=1e-5), step
    for step, norm in grad_norms(grid).items():
        assert norm > 1.0 and norm == pytest.approx(grad_norms(ddp)[step], rel=1e-5), step
    assert sorted(val_losses(grid)) == [0, 6, 10]  # each row's windows, summed over every rank
    for step in (0, 6):
        assert val_losses(grid)[step] == pytest.approx(val_losses(ddp)[step], abs=1e-4), step


def test_random_streams_come_back_only_at_the_cp_that_saved_them(monkeypatch):
    """A checkpoint's RNG states are restored rank by rank only at the world size and --cp that
    saved them: at another cp a rank holds other chunks, and its stream drew masks for those. The
    control: the same cp restores them; a chapter-7 checkpoint (no cp: 1) restores at --cp 1."""
    restored = streams_restored(cp, monkeypatch)
    for here, args, expected in [(2, {"cp": 1}, []), (2, {"cp": 2}, ["rank 1's"]),
                                 (1, {}, ["rank 1's"]), (2, {}, []), (2, {"cp": 2, "tp": 2}, [])]:
        run = types.SimpleNamespace(rank=1, world_size=2, device=torch.device("cpu"),
                                    args=types.SimpleNamespace(cp=here))
        restored.clear()
        cp.load_shards("ck", {"args": args, "rng": ["rank 0's", "rank 1's"]}, run, None, None)
        assert restored == expected, (here, args)

def test_each_rank_holds_an_early_chunk_and_a_late_one(runs):
    held = {0: list(range(0, 8)) + list(range(24, 32)), 1: list(range(8, 24))}
    whole = 2 * 6 * 2 * 32 * 16 * 4  # K and V: batch 6, 2 heads, 32 tokens, head size 16, fp32
    for rank in range(4):
        seen = json.loads((runs["dir"] / "grid" / f"rank{rank}.json").read_text())
        assert (seen["dp_rank"], seen["cp_rank"]) == (rank // 2, rank % 2), seen
        assert (seen["fsdp_dims"], seen["fsdp_ranks"]) == (["dp_cp"], [0, 1, 2, 3]), seen  # a mesh
        assert seen["positions"] == held[rank % 2], seen
        assert seen["all_gathers"] == 2 * 2 * 2, seen  # 2 blocks x 2 micro-batches, x 2: in
        assert seen["gathered_bytes"] == 8 * whole, seen  # forward, and again in backward
        # held for backward: the formula of chapter 7's activations at T / cp tokens (t = 16),
        # 4 (16 L t C + 2 t C + t V) per sequence, 6 sequences a micro-batch; keeping the gathered
        # K and V would add 2 T C per block (19% more)
        formula = 6 * 4 * (16 * 2 * 16 * 32 + 2 * 16 * 32 + 16 * 256)
        assert formula <= seen["peak_saved_bytes"] <= 1.02 * formula, seen
    # a rank's K and V, 2 x 6 x 16 tokens x 32 x 4 bytes = 0.023 MiB, sent twice, and their gradients
    assert ("CP split: 4 chunks of 8 tokens, rank i of a row holds chunks i and 3 - i | attention "
            "pairs per rank: 50.0%, 50.0% (contiguous shares would give 25.8%, 74.2%) | sent per "
            "block and micro-batch: 0.07 MiB, K, V all-gathered in forward and backward and their "
            "fp32 gradients reduce-scattered") in runs["grid"]


def test_four_context_ranks_cover_every_position_once_with_equal_work():
    shares = [cp.chunk_positions(r, 4, 64) for r in range(4)]
    assert sorted(torch.cat(shares).tolist()) == list(range(64))
    assert len({int((s + 1).sum()) for s in shares}) == 1  # query p reads p + 1 keys
    contiguous = [torch.arange(16 * r, 16 * r + 16) for r in range(4)]  # the control: unequal
    assert len({int((s + 1).sum()) for s in contiguous}) == 4


def test_a_chunks_queries_read_every_key_up_to_their_own_place():
    """The attention a chunk runs, the same function and mask on a GPU (only the dtype differs)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    whole = cp.causal_attention(q, k, v)
    torch.testing.assert_close(whole, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    last = cp.causal_attention(q[..., 12:, :], k, v)  # positions 12-15 over keys 0-15
    torch.testing.assert_close(last, whole[..., 12:, :])
    inner = cp.causal_attention(q[..., 8:12, :], k[..., :12, :], v[..., :12, :])  # its end: 12
    torch.testing.assert_close(inner, whole[..., 8:12, :])
    top_left = F.scaled_dot_product_attention(q[..., 12:, :], k, v, is_causal=True)  # the control
    assert not torch.allclose(top_left, whole[..., 12:, :], atol=1e-3)


def test_the_attention_compiles_without_a_graph_break():
    """Context builds each chunk's mask before torch.compile traces the attention, and a square one
    is is_causal: no graph break. The control: the mask built inside the traced code breaks it."""
    from torch._dynamo.utils import counters
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    late = cp.Context(None, 0, 2, 16, torch.device("cpu")).masks[1]  # positions 12-15, 16 keys

    def breaks(attention):
        torch._dynamo.reset()
        counters.clear()
        torch.compile(attention, backend="eager")(q, k, v)
        return sum(counters["graph_break"].values())
    assert breaks(lambda q, k, v: cp.causal_attention(q[..., 12:, :], k, v, late)) == 0
    assert breaks(lambda q, k, v: cp.causal_attention(q, k, v)) == 0
    assert breaks(lambda q, k, v: cp.causal_attention(q[..., 12:, :], k, v)) > 0


def test_a_ring_steps_attention_and_backward_are_one_softmaxs_tile_by_tile():
    """--cp-rotate ring's math in one process: 16 queries over keys in two blocks (the first
    with the queries' own positions, causal), each step's outputs merged by their log-sum-exps,
    and each block's backward from the merged output and log-sum-exp, in tiles of 3 queries,
    equal causal attention and its autograd gradients. The controls: the two steps' outputs
    averaged without their weights, and tiles that forget where they start in the causal block."""
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64)
                     for _ in range(4))
    earlier = [torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(2)]
    keys, values = torch.cat([earlier[0], k], -2), torch.cat([earlier[1], v], -2)
    q_, keys_, values_ = (t.clone().requires_grad_() for t in (q, keys, values))
    mask = torch.ones(16, 32, dtype=torch.bool).tril(16)  # every earlier key, and up to its own
    F.scaled_dot_product_attention(q_, keys_, values_, attn_mask=mask).backward(grad)
    own, lse_own = cp.block_attention(q, k, v, True, tile=3)
    seen, lse_seen = cp.block_attention(q, *earlier, False, tile=3)
    total = torch.logaddexp(lse_own, lse_seen)
    out = own * torch.exp(lse_own - total) + seen * torch.exp(lse_seen - total)
    whole = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    torch.testing.assert_close(out, whole)
    assert not torch.allclose((own + seen) / 2, whole, atol=1e-2)  # merged without their weights
    delta = (grad * out).sum(-1, keepdim=True)
    dq_own, dkv_own = cp.block_gradients(q, torch.stack([k, v]), grad, (total, delta), True, 3)
    dq_seen, dkv_seen = cp.block_gradients(q, torch.stack(earlier), grad, (total, delta), False, 3)
    torch.testing.assert_close(dq_own + dq_seen, q_.grad)
    torch.testing.assert_close(torch.cat([dkv_seen[0], dkv_own[0]], -2), keys_.grad)
    torch.testing.assert_close(torch.cat([dkv_seen[1], dkv_own[1]], -2), values_.grad)
    forgetful = torch.cat([cp.tile_scores(q[..., i:i + 3, :], k, 0) for i in range(0, 16, 3)], -2)
    assert not torch.equal(forgetful.isinf(), cp.tile_scores(q, k, 0).isinf())


def test_key_and_value_gradients_are_summed_in_fp32(monkeypatch):
    """Under bf16 the reduce-scatter of dK and dV adds in fp32 and rounds once, at the end (the
    control: the gradient that comes in is bf16)."""
    assert_kv_gradients_summed_in_fp32(cp, monkeypatch)


def test_the_training_loss_is_the_global_sum_over_the_global_count_of_targets(monkeypatch):
    """Shares with unequal targets (a masked prompt, -100, on one rank): each rank's backward,
    averaged over the ranks as FSDP averages, gives one process's gradient and loss; the mean of
    the ranks' means (the control) does not."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 5)
    x, y = torch.randn(2, 6, 8), torch.randint(0, 5, (2, 6))
    y[:, :2] = -100  # the prompt: rank 0 holds 2 targets of 6, rank 1 all 6
    shares = [(x[:, :3], y[:, :3]), (x[:, 3:], y[:, 3:])]

    class Model(torch.nn.Module):  # what accumulate_gradients asks of FSDP's model
        def __init__(self):
            super().__init__()
            self.head = head

        def set_requires_gradient_sync(self, sync):
            pass

        def forward(self, x, context=None):
            return self.head(x), None
    counted = []  # what each rank sends; the all-reduce answers their sum

    def all_reduce(count, op=None, group=None):
        counted.append(int(count))
        count.fill_(float((y != -100).sum()))
    monkeypatch.setattr(cp.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(cp.dist, "all_reduce", all_reduce)
    grads, losses = [], []
    for share in shares:
        head.zero_grad()
        losses.append(float(cp.accumulate_gradients(Model(), [share], None)))
        grads.append(head.weight.grad.clone())
    head.zero_grad()
    one = F.cross_entropy(head(x).flatten(0, 1), y.flatten())  # one process, every target
    one.backward()
    assert counted == [2, 6]  # each rank counts its own targets, the masked ones left out
    torch.testing.assert_close((grads[0] + grads[1]) / 2, head.weight.grad)
    assert sum(losses) / 2 == pytest.approx(one.item(), rel=1e-6)  # train_step's mean_over_ranks
    means = [F.cross_entropy(head(a).flatten(0, 1), b.flatten()).item() for a, b in shares]
    assert sum(means) / 2 != pytest.approx(one.item(), rel=1e-2)


def test_checkpoints_move_between_chapter_7_and_cp_and_a_killed_rank_resumes(runs):
    out, d, (one, one_ckpt) = runs["restarted"], runs["dir"], runs["one"]
    assert f"resumed from {d / 'ck' / 'step-000004'} at step 4" in out  # chapter 7's
    assert f"resumed from {d / 'ck' / 'step-000008'} at step 8" in out  # after the kill
    assert out.count("step 9/14 | loss") == 2  # logged before the kill, and again after it
    [killed] = kills(d / "ck")  # DCP's .metadata written, run.json not yet
    assert killed["moment"] == "metadata" and "step-000008" in killed["held"]
    assert killed["held"]["partial-step-000012"][0] == ".metadata"
    assert "run.json" not in killed["held"]["partial-step-000012"]
    seen = json.loads((d / "rec" / "rank0.json").read_text())  # --grad-checkpointing: the block's
    assert seen["all_gathers"] == 2 * 2 * 2, seen  # the block's recompute gathers, once
    resumed = losses(runs["fsdp"])
    assert sorted(resumed) == [15, 16, 17, 18]
    for step, loss in resumed.items():
        assert loss == pytest.approx(losses(one)[step], rel=1e-5), step
    exported = torch.load(d / "f18.pt", map_location="cpu", weights_only=True)["model"]
    for key, value in torch.load(one_ckpt, map_location="cpu", weights_only=True)["model"].items():
        torch.testing.assert_close(exported[key], value, rtol=1e-4, atol=1e-4, msg=key)
    dcp_to_torch_save(d / "ck" / "step-000014", d / "ck14.pt")  # offline: no process group
    checkpointed = torch.load(d / "ck14.pt", weights_only=False)["model"]
    cp_export = torch.load(d / "cp.pt", map_location="cpu", weights_only=True)["model"]
    assert sorted(cp_export) == sorted(checkpointed)  # the export: the step-14 weights, whole
    for key, value in checkpointed.items():
        assert torch.equal(cp_export[key], value), key
    assert not torch.equal(cp_export["tok_emb.weight"], exported["tok_emb.weight"])  # 4 steps on
    sampled = in_process(GPT, ["--sample", "--ckpt", d / "cp.pt", "--prompt", "def ",
                               "--max-new-tokens", 20])
    assert sampled.startswith("def ") and len(sampled) > 10


@pytest.mark.parametrize("flags,message", [
    (["--cp", 3], "--block-size 32 must be a multiple of 2 x --cp = 6: each sequence is cut "
                  "into 6 equal chunks"),
    (["--cp", 32], "--cp 32 cuts a sequence into 64 chunks, more than the 32 tokens of "
                   "--block-size: give a --block-size of at least 64")])
def test_a_split_that_does_not_fit_is_one_line(flags, message):
    result = as_script(CP, SHARDED + flags)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result
    assert message in result.stderr


def test_a_cp_that_does_not_divide_the_world_is_one_line():
    with pytest.raises(cp.InputError, match=r"^--cp 2 does not divide the world size 1: start a"):
        in_process(CP, SHARDED + ["--cp", 2, "--max-steps", 1, "--save", "", "--export", ""])


def test_a_context_longer_than_the_data_is_the_data_checks_line_before_the_context(monkeypatch):
    """A --block-size of 10^13 (a context of 80 TB of positions) is refused in load_data's own
    line, before make_run builds the context: without the guard the allocation fails first. Only
    rank 0 says it; the control: a context the data can hold passes the guard."""
    module, huge = cp, ["--cp", "1", "--block-size", str(10**13)]
    line = (r"^the default corpus has 1,800,000 training and 200,000 validation tokens: too few "
            r"for 1 replica\(s\) x --batch-size 6 x --block-size 10000000000000; give more data "
            r"or smaller sizes$")
    with pytest.raises(module.InputError, match=line) as err:
        in_process(CP, SHARDED + huge + ["--max-steps", 1, "--save", "", "--export", ""])
    assert err.value.code == 2
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_:  # the other ranks: exit code 2, without a word
        module.refuse_a_context_longer_than_the_data(module.parse_args(huge), 1)
    assert exit_.value.code == 2
    assert module.refuse_a_context_longer_than_the_data(module.parse_args([]), 1) is None


@pytest.mark.parametrize("script,needs", [(CP, "2.13"), ("train_pp_minigpt.py", "2.10")])
def test_a_torch_older_than_the_chapters_calls_is_one_line(script, needs, monkeypatch, capsys):
    """Chapters 9 and 10 call what older torches lack; the course's floor (requirements.txt) is
    the oldest torch where chapters 1-8 pass. A torch without the call is refused in one line,
    exit code 2, before any other guard, whatever its version says. The control: a nightly's
    version (below the release as a version) with the call passes, and the next guard speaks
    (this test process was not started by torchrun)."""
    from torch.torch_version import TorchVersion
    module = trainer(script)
    monkeypatch.delenv("RANK", raising=False)
    args = module.parse_args(["--device", "cpu"])
    monkeypatch.setattr(module.torch, "__version__", TorchVersion(needs + ".0a0+git1234"))
    with monkeypatch.context() as older:
        if script == CP:
            older.delattr(module.dist, "all_gather_single")
        else:
            older.setattr(module.ScheduleGPipe, "step", lambda self, *args, target=None: None)
        with pytest.raises(SystemExit) as stop:
            module.avoid_known_failures(args)
        assert stop.value.code == 2
        said = f"error: this chapter needs torch {needs} or newer"
        assert capsys.readouterr().err.startswith(said)
    with pytest.raises(SystemExit) as stop:
        module.avoid_known_failures(args)
    said = "error: not launched by torchrun: see the commands at the top"
    assert stop.value.code == 2 and capsys.readouterr().err.startswith(said)


def test_a_cp_row_across_nodes_is_a_warning():
    """Not refused: a row of --cp consecutive ranks that nodes of that many processes cannot hold
    runs, with one warning line from rank 0 at the start."""
    assert cp.avoid_cp_across_nodes(2, 8) is None and cp.avoid_cp_across_nodes(4, 4) is None
    assert cp.avoid_cp_across_nodes(16, 8).startswith("warning: --cp 16 with 8 processes per node")
    assert cp.avoid_cp_across_nodes(3, 8) and cp.avoid_cp_across_nodes(2, 1)  # 3 rows of 8: across


def test_benchmark_scaling_reads_the_cp_trainers_summary(runs):
    """benchmark_scaling.py runs any trainer the same way (its launches: test_benchmark.py);
    what it needs of a trainer is its summary's pace keys: tokens per step over the dp rows."""
    row = bench.pace_row(summary(runs["grid"]), 4, 0.0)
    assert row["per_step"] == 6 * 32 * 2 * 2 and row["unit"] == "tokens/s"  # batch x T x K x dp
    assert row["throughput"] == pytest.approx(768 / (row["step_ms"] / 1000), rel=0.01)


def test_fsdps_policy_computes_in_bf16_and_reduces_in_fp32():
    """FSDP's policy in this chapter: bf16 weights for compute, fp32 gradient reductions."""
    assert_bf16_policy_reduces_in_fp32(cp)
    assert_every_unit_computes_in_bf16_and_reduces_in_fp32(CP, SHARDED + ["--cp", 2])  # read off it


def test_the_planner_predicts_what_each_rank_holds_and_sends(runs):
    """Chapter 13's plan_layout.py, given each run's flags and world size, predicts its memory,
    accumulation and split lines to the character: dp 2 x cp 2 with --grad-sync last, cp 2 with
    recomputation, a ring of 4, a ring of 2 in bf16 with recomputation, dp 2 x cp 2 with dropout,
    and cp 2 in bf16 on a 300-token vocabulary. The control: its lines for cp 4 are not the
    grid's."""
    assert_planned(10, [
        (runs["grid"], 4, SHARDED + ["--cp", 2, "--grad-sync", "last"]),
        (runs["restarted"], 2, ONE + ["--cp", 2, "--grad-checkpointing"]),
        (runs["ring"], 4, ONE + ["--cp", 4, "--cp-rotate", "ring"]),
        (runs["ring16"], 2, ONE + ["--cp", 2, "--cp-rotate", "ring", "--amp", "bf16",
                                   "--grad-checkpointing"]),
        (runs["noisy"], 4, NOISY + ["--cp", 2]),
        (runs["bf16"], 2, bf16(dropout=False) + ["--batch-size", 12, "--cp", 2])],
        other=(4, SHARDED + ["--cp", 4]))


def test_a_world_of_one_applies_the_schedule_times_training_and_samples_in_eval_mode(
        tmp_path):
    """The warmup and cosine by hand, applied and logged at each step; ms/step leaves out the
    evaluations and saves (a clock the test moves); the closing sample in evaluation mode (no
    dropout); as a world of one with --cp 1."""
    assert_a_world_of_one_schedules_times_and_samples_as_it_should(
        CP, ["--cp", "1"], tmp_path)


def test_recomputation_draws_the_forwards_dropout_masks_again():
    """With --dropout 0.1, in this process as a world of one (--cp 1: the blocks are the same
    code at any cp), --grad-checkpointing logs the losses and gradient norms of the same run
    without it, to every printed digit: the backward recomputes each block with the random state
    its forward drew from. The control: without dropout the losses differ."""
    flags = [*TINY_GPT, "--cp", 1, "--max-steps", 3, "--eval-every", 3, "--eval-windows", 2,
             "--save", "", "--export", "", "--max-new-tokens", 1]
    kept, recomputed, still = (
        in_process(CP, [*flags, "--dropout", dropout, *more])
        for dropout, more in ((0.1, []), (0.1, ["--grad-checkpointing"]), (0.0, [])))
    assert sorted(losses(kept)) == [1, 2, 3]
    assert losses(recomputed) == losses(kept) and grad_norms(recomputed) == grad_norms(kept)
    assert losses(still)[1] != losses(kept)[1]
