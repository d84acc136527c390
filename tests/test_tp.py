"""Chapter 8, train_tp_minigpt.py (tensor parallelism inside FSDP, a 2-D mesh), under real torchrun
launches on CPU/gloo. These tests prove:

1. the same math as DDP: at the same seed, data and flags (2 accumulation steps, gradient norms
   above --clip, so clipping binds), dp 2 x tp 2 at 4 processes with sequence parallelism and
   loss parallel (the defaults) logs the losses and gradient norms of 2 DDP processes (1e-5
   relative) and their validation losses at steps 0 and 6 (4 printed decimals; the control: those
   two differ); this holds only if the two ranks of a tp group read the same batch (data by dp row,
   not by rank: read by rank, the 4 ranks would read 4 different shares of the windows);
2. checkpoints reshard across grids: the (dp 2, tp 2) checkpoint resumes at (dp 1, tp 2) without
   sequence parallelism, compiled block by block, two processes that two nodes' agents start
   through chapter 4's launcher (with --grad-sync last, which at dp 1 defers nothing: FSDP's dp
   group is one rank, so there is no reduce-scatter to make), and at tp 1
   (in process), each with the same global batch, and both log the next 8 losses of the
   uninterrupted DDP run; the (dp 1, tp 2) run's 8 losses are also chapter 3's in one process with
   that global batch; its export holds DDP's final weights (1e-4) and samples through
   train_ddp_minigpt.py; a rank SIGKILLed in a save (dp 1 x tp 2, from the grid's step 10,
   `torchrun --max-restarts=1`) is restarted and goes on from the last complete step with one
   process's losses;
3. what each rank holds and sends: a tp row is consecutive ranks, a dp column every tp-th
   (each rank's groups recorded by tests/probe_tp.py), and a row's ranks draw the same closing
   sample (every rank samples: each token's forward is the row's collective); the memory and
   accumulation lines give rank 0's share as the test counts it from the model's shapes: at dp 2
   x tp 2 a quarter of what TP splits and half of the rest, at dp 1 x tp 2 half and all, and at
   tp 4 (built in a fake group of 4) a quarter and all, on 256 and 300 tokens; the TP traffic
   line's counts are the activations' collectives the probe saw DTensor make in a step, with and
   without sequence parallelism and under --grad-checkpointing, its MiB sent what they send, and
   at tp 4 the test's own count; the model gives chapter 3's logits from chapter
   3's weights (head-by-head qkv); sampling pads on the right and draws GPT.generate's tokens;
   an SP checkpoint with dropout resumed without SP keeps a row's copies equal (--check-sync);
4. with --dropout 0.1 and 13 validation windows (one row padded), dp 2 x tp 2 without sequence
   parallelism logs 2 DDP processes' losses and validation losses: a row draws its DDP rank's
   masks, also after rank 0 is killed once step 2 is saved and the group restarts (each rank
   resumes its own streams); with it, each rank draws its own (its own tokens);
5. bad input is one line and exit code 2: a --tp that does not divide the world size, --n-head
   or (sequence parallel) --block-size; --check-sync (on in the dp 2 x tp 2 run) stops a tp row
   whose copies of a replicated parameter differ with one line per rank and exit code 3 (a probe
   nudges one rank's copy);
6. benchmark_scaling.py reads its summary: the global batch counts the dp rows, not the ranks.
The schedule and the clock, in this process as a world of one: each step applies and logs
the warmup and cosine worked out by hand, and ms/step leaves out evaluation and saving (the
test moves the clock: 1 s a step, 100 s an evaluation or a save); with dropout, the closing
sample runs every module in evaluation mode.
"""
import collections
import json
import math
import os
import re
import shutil
import types

import pytest
import torch
from helpers import assert_a_world_of_one_schedules_times_and_samples_as_it_should
from helpers import logged_grad_norms as grad_norms, logged_losses as losses
from helpers import kills, logged_val_losses as val_losses
from helpers import assert_every_unit_computes_in_bf16_and_reduces_in_fp32
from helpers import assert_bf16_policy_reduces_in_fp32
from helpers import assert_planned, streams_restored
from helpers import VOCAB, built_in_a_fake_world, first_rank_share, gpt_shapes, memory_words
from helpers import assert_bf16_run_is_one_processs, bf16, one_process_bf16
from helpers import (EVAL_6, GPT, NOISY, REPO, SHARDED, TINY_GPT, command, ddp_dropout_reference,
                     ddp_reference, finish, in_process, ok, one_process_reference, run, start,
                     start_two_nodes, summary, trainer)

import benchmark_scaling as bench  # noqa: E402  (the repository is on sys.path: helpers)

TP = "train_tp_minigpt.py"
tp = trainer(TP)
FLAGS = SHARDED + ["--max-steps", 18]  # batch 6, 2 accumulation steps, --clip 1.0
# The grid run recomputes without dropout: its backward's forwards make the traffic line's
# gathers and reduce-scatters of that case (the drift run recomputes with dropout).
RECOMPUTED = ["--grad-checkpointing"]



CONTRACT = {  # tests/README.md, "One proof for every GPT chapter"; None: not held yet
    "reference": ["test_dp2_x_tp2_computes_what_ddp_computes",
                  "test_the_grid_checkpoint_resumes_at_dp1_x_tp2_and_at_tp1"],
    "norms": ["test_with_dropout_and_a_padded_evaluation_dp2_x_tp2_logs_ddps_numbers"],
    "padded": ["test_with_dropout_and_a_padded_evaluation_dp2_x_tp2_logs_ddps_numbers"],
    "dropout": ["test_with_dropout_and_a_padded_evaluation_dp2_x_tp2_logs_ddps_numbers",
                "test_sequence_parallel_drops_out_each_ranks_tokens_with_its_own_masks",
                "test_sequence_parallel_masks_differ_across_rows_too"],
    "collectives": ["test_fsdp_under_tp_reduce_scatters_as_grad_sync_says_and_keeps_the_last_block",
                    "test_the_traffic_line_counts_the_collectives_a_step_makes"],
    "policy": ["test_fsdps_policy_computes_in_bf16_and_reduces_in_fp32"],
    "resume": ["test_the_grid_checkpoint_resumes_at_dp1_x_tp2_and_at_tp1"],
    "bf16": ["test_bf16_with_recomputation_and_dropout_logs_one_processs_numbers"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """TP at dp 2 x tp 2 for 10 steps (its checkpoint: step 10); from that checkpoint to step 18
    at dp 1 x tp 2 (exported, --grad-sync last, no sequence parallelism, compiled) and at tp 1;
    chapter 3 at 2 processes (ddp_reference, shared with chapter 7's tests) and at 1
    (one_process_reference, shared with chapter 9's), for 18 steps; beside them the drift probe
    and the dropout runs, and a bf16 run (dp 1 x tp 2)."""
    d = tmp_path_factory.mktemp("tp")
    for sub in ("drift", "dropout", "sp dropout"):
        (d / sub).mkdir()
    drift = command("tests/probe_tp.py", ["drift", "2:1", d / "drift", *TINY_GPT, "--tp", 2,
                                          "--check-sync", "--dropout", 0.1, "--grad-checkpointing",
                                          "--amp", "bf16",  # its sums' dtypes recorded
                                          "--max-steps", 4, "--save", d / "sp", "--save-every", 1,
                                          "--export", ""], nproc=2)  # saves step 1, then drifts
    drifting = start(drift, REPO)
    beside = {"tp dropout": command("tests/probe_tp.py", [  # 13 windows: rows of 7 and 6
                  "killsave", "renamed@2:0", d / "dropout", *NOISY, "--tp", 2,
                  "--sequence-parallel", "off", "--save-every", 2, "--save", d / "noisy",
                  "--resume", "auto", "--export", ""], nproc=4,  # rank 0 killed once step 2
                  torchrun_args=["--max-restarts=1"]),  # is saved; the group restarted
              "sp dropout": command("tests/probe_tp.py", [
                  "record", d / "sp dropout", *SHARDED, "--tp", 2, "--max-steps", 1, "--dropout",
                  0.1, "--grad-sync", "last", "--amp", "bf16", "--save", "", "--export", ""],
                  nproc=4)}
    beside["bf16"] = command(TP, [*bf16(), "--batch-size", 12, "--tp", 2, "--sequence-parallel",
                                  "off", "--reshard-after-forward", "no", "--dist-timeout", 600,
                                  "--debug", "--export", ""], nproc=2)
    restart_fix = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch#135712
    started = {name: start(cmd, REPO, restart_fix if name == "tp dropout" else None)
               for name, cmd in beside.items()}
    ddp, ddp_ckpt, _ = ddp_reference()
    r = {"drift": finish(drifting, drift), "ddp dropout": ddp_dropout_reference()[0]}
    switch = command(TP, [*TINY_GPT, "--tp", 2, "--check-sync", "--dropout", 0.1,
                          "--sequence-parallel", "off", "--resume", d / "sp", "--max-steps", 3,
                          "--save", "", "--export", ""], nproc=2)
    switched = start(switch, REPO)
    r.update({"ddp": ddp, "ddp.pt": ddp_ckpt,
         "grid": ok(run("tests/probe_tp.py", ["record", d, *FLAGS, *RECOMPUTED, "--tp", 2,
                                              "--max-steps", 10,
                                              *EVAL_6, "--save", d / "ck", "--export",
                                              d / "grid.pt", "--check-sync",
                                              "--max-new-tokens", 12], nproc=4))})
    r["switched"] = ok(finish(switched, switch))
    r.update({name: ok(finish(proc, beside[name])) for name, proc in started.items()})
    resumed = f"resumed from {d / 'noisy' / 'step-000002'} at step 2\n"
    before, after = r["tp dropout"].split(resumed)
    r["tp dropout killed"] = "step 2/4 | loss" in before and "step 3/4 | loss" in after
    # the resumed run's first evaluation aside: the uninterrupted run evaluates at 0 and 4 only
    r["tp dropout"] = before + re.sub(r"^step 2/4 \| val loss .*\n", "", after, flags=re.M)
    resume = FLAGS + ["--batch-size", 12, "--resume", d / "ck", "--save", ""]
    shutil.copytree(d / "ck" / "step-000010", d / "killed" / "ck" / "step-000010")
    kill = command("tests/probe_tp.py", ["killsave", "metadata@12:1", d / "killed", *FLAGS,
                                         "--batch-size", 12, "--tp", 2, "--max-steps", 14,
                                         "--save-every", 2, "--save", d / "killed" / "ck",
                                         "--resume", "auto", "--export", ""],
                   nproc=2, torchrun_args=["--max-restarts=1"])
    killed = start(kill, REPO, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})  # pytorch#135712
    row = start_two_nodes(TP, resume + ["--tp", 2, "--grad-sync", "last",  # FSDP's no_sync
                                        "--sequence-parallel", "off",  # all-reduces, as Megatron
                                        "--compile", "--compile-backend", "aot_eager",  # no C++
                                        "--export", d / "tp.pt"])  # while these run:
    r["column"] = in_process(TP, resume + ["--tp", 1, "--export", ""])
    r["one"] = one_process_reference()[0]  # shared with chapter 9's tests
    one_process_bf16(), one_process_bf16(dropout=False)  # run now, while the launches run
    r["row"] = next(out for out in row() if "world size 2 " in out)  # rank 0's node logs
    r["killed"] = ok(finish(killed, kill))
    return {**r, "dir": d}


def test_check_sync_stops_a_tp_row_whose_copies_drift_apart(runs):
    """--check-sync compares, after every step, the copies a tp row holds of what TP does not split:
    at dp 2 x tp 2 (the grid run) they stay equal and the run ends well; the control, rank 1 of a
    tp 2 row nudging its copy of the final norm's weight before step 2 (tests/probe_tp.py), stops
    the run after step 2 with one line and exit code 3, where the loss alone looks normal."""
    drift = runs["drift"]
    assert "done | val loss" in runs["grid"]
    assert drift.returncode != 0 and "step 1/4 | loss" in drift.stdout
    assert "step 2/4 | loss" not in drift.stdout  # stopped before step 2's log line
    said = [f"error: --check-sync: the tp group of rank {rank} holds copies that differ after "
            "step 2: [" in drift.stderr for rank in (0, 1)]  # both see it; torchrun may stop
    assert any(said) and "exitcode  : 3" in drift.stderr, drift.stderr  # one before it prints


def test_with_dropout_and_a_padded_evaluation_dp2_x_tp2_logs_ddps_numbers(runs):
    """--dropout 0.1, --sequence-parallel off (dropout acts where a row's ranks hold the same whole
    activations): a row's ranks draw DDP's rank's masks (seeded by row: the first masks of a row
    hash alike, of two rows not), so dp 2 x tp 2 logs 2 DDP processes' losses; 13 validation
    windows on 2 rows (7 and 6: one padded, counted as 0) give DDP's validation losses. The
    control: they change. With --clip 2.0 the gradient norms before clipping are DDP's too, in
    the steps where the clip binds (1 and 2) and where it does not (3 and 4). Rank 0 is killed
    once step 2 is saved and the group restarted: every rank resumes its own random streams, so
    steps 3 and 4 (their first masks recorded) are DDP's too."""
    assert runs["tp dropout killed"]  # the control: the run was killed and resumed
    masks = [rank_record(runs["dir"] / "dropout", rank)["dropout_mask"] for rank in range(4)]
    assert masks[0] == masks[1] and masks[2] == masks[3] and masks[0] != masks[2]
    tp_out, ddp = runs["tp dropout"], runs["ddp dropout"]
    assert sorted(losses(tp_out)) == sorted(grad_norms(tp_out)) == [1, 2, 3, 4]
    for step, loss in losses(tp_out).items():
        assert loss == pytest.approx(losses(ddp)[step], rel=1e-5), step
        assert grad_norms(tp_out)[step] == pytest.approx(grad_norms(ddp)[step], abs=2e-3), step
    assert [grad_norms(ddp)[step] > 2.0 for step in range(1, 5)] == [True, True, False, False]
    assert sorted(val_losses(tp_out)) == sorted(val_losses(ddp)) == [0, 4]
    for step in (0, 4):
        assert val_losses(tp_out)[step] == pytest.approx(val_losses(ddp)[step], abs=1e-4), step
    assert abs(val_losses(ddp)[0] - val_losses(ddp)[4]) > 0.01


def test_bf16_with_recomputation_and_dropout_logs_one_processs_numbers(runs):
    """dp 1 x tp 2 under --amp bf16, --grad-checkpointing and --dropout 0.1 (sequence parallelism
    off: the row draws one process's masks; --reshard-after-forward no: FSDP's gathers are exact,
    whenever they run), with --debug, on a file of token ids (--data, --vocab-size,
    --val-fraction), logs chapter 3's bf16 losses, gradient norms and validation losses within
    bf16's rounding, and the data and parameter lines the test computes: TP rounds each rank's
    half of a row-wise product to bf16 before adding them. Measured on 2 cores (torch 2.14): over
    6 steps the losses agree to 1.5e-3, the norms to 5e-3, the validation losses to 5e-4; the
    test allows 5e-3, 1.5e-2 and 2e-3. A training loss left in bf16 moved the losses by up to
    0.026 (measured by a review, issue 59)."""
    assert_bf16_run_is_one_processs(runs["bf16"])


def test_sequence_parallel_drops_out_each_ranks_tokens_with_its_own_masks(runs):
    """--sequence-parallel on (the default): dropout acts on each rank's own part of the sequence,
    so each rank draws its own masks (seeded by rank): in the tp 2 run with --dropout 0.1 (the
    drift run), the row's two ranks' first masks differ, where seeded by row they would repeat one
    mask on both halves of the sequence (the control: a row's masks alike, the test above)."""
    masks = [rank_record(runs["dir"] / "drift", rank)["dropout_mask"] for rank in (0, 1)]
    assert masks[0] != masks[1]
    assert "sequence parallel on)" in runs["drift"].stdout


def test_sequence_parallel_masks_differ_across_rows_too(runs):
    """At dp 2 x tp 2 with sequence parallelism and dropout, all four ranks draw their own masks:
    seeded by tp rank instead of rank, the two rows would repeat each other's masks."""
    masks = [rank_record(runs["dir"] / "sp dropout", rank)["dropout_mask"] for rank in range(4)]
    assert len(set(masks)) == 4, masks


def test_under_bf16_fsdp_sums_in_fp32_and_tp_sums_each_gradient_in_its_own_dtype(runs):
    """The dtype of every sum over tp and dp that a step runs, recorded in the run
    (tests/probe_tp.py), as docs/tp.md's table says, under --amp bf16 with sequence parallelism.
    With --grad-sync every (the drift run, dp 1 x tp 2, one micro-batch) DTensor sums the norms'
    gradients over tp in bf16 (shape (32,): 2 blocks of 2 norms and the final one, a weight and a
    bias each) and reduce-scatters the activations' gradients in bf16; at dp 1 FSDP sums nothing.
    With --grad-sync last over 2 micro-batches (the sp dropout run, dp 2 x tp 2) the norms' sums
    run once, on FSDP's fp32 buffer, and FSDP's reduce-scatters over dp run in fp32: the control
    that the record tells the dtypes apart."""
    every, last = (rank_record(runs["dir"] / name, 0) for name in ("drift", "sp dropout"))
    assert every["fsdp_sum_dtypes"] == []
    assert last["fsdp_sum_dtypes"] and set(last["fsdp_sum_dtypes"]) == {"torch.float32"}, last
    for rec in (every, last):
        scattered = {dtype for name, dtype, _ in rec["sums"] if name == "reduce_scatter_tensor"}
        assert scattered == {"torch.bfloat16"}, rec
    norms = [[dtype for name, dtype, n in rec["sums"] if name == "all_reduce" and n == 32]
             for rec in (every, last)]
    assert norms == [["torch.bfloat16"] * 10, ["torch.float32"] * 10], norms


def test_fsdp_under_tp_reduce_scatters_as_grad_sync_says_and_keeps_the_last_block(runs):
    """FSDP's own collectives in the first step at dp 2 x tp 2 (2 micro-batches of 2 blocks and
    the root: 3 units): --grad-sync every reduce-scatters each unit per micro-batch (6), last once
    per step (3); each micro-batch gathers the root once, both blocks before their forward and
    block 0 again before its backward (4; the last block stays whole): 8 either way."""
    for run_dir, scatters in (("", 6), ("sp dropout", 3)):
        for rank in range(4):
            seen = rank_record(runs["dir"] / run_dir, rank)["fsdp"]
            assert seen == {"reduce_scatters": scatters, "all_gathers": 8}, (run_dir, rank, seen)


def rank_record(out_dir, rank):
    """What tests/probe_tp.py recorded of a rank's first step."""
    return json.loads((out_dir / f"rank{rank}.json").read_text())


def test_a_tp_row_is_consecutive_ranks_and_draws_one_sample(runs):
    """At dp 2 x tp 2 rank r sits in tp row r // 2 (ranks 0, 1 or 2, 3: one node's GPUs, whose
    links carry TP's all-reduces) and dp column r % 2 (ranks 0, 2 or 1, 3), as the mesh says; the
    closing sample, drawn on every rank, is the same 12 tokens on both ranks of a row."""
    for rank in range(4):
        seen = rank_record(runs["dir"], rank)
        row, column = rank // 2, rank % 2
        assert seen["tp_group"] == [2 * row, 2 * row + 1], seen
        assert seen["dp_group"] == [column, column + 2], seen
    samples = [json.loads((runs["dir"] / f"sample{rank}.json").read_text()) for rank in range(4)]
    assert samples[0] == samples[1] and samples[2] == samples[3]  # a row draws one sample:
    assert len(samples[0]) == 1 + 12  # each token's forward needs both its ranks' inputs alike


def test_dp2_x_tp2_computes_what_ddp_computes(runs):
    grid, ddp = runs["grid"], runs["ddp"]
    # 6 sequences of 32 tokens, 2 micro-batches, on each of 2 replicas: a row's ranks share one
    assert f"world size 4 (2 dp x 2 tp) | device cpu | amp off | {6 * 32 * 2 * 2:,} tokens per " \
           "step (6 x 32 x 2 accumulation x 2 replicas)" in grid, grid
    assert sorted(losses(grid)) == list(range(1, 11))
    for step, loss in losses(grid).items():
        assert loss == pytest.approx(losses(ddp)[step], rel=1e-5), step
    for step, norm in grad_norms(grid).items():  # above --clip 1.0: clipping binds
        assert norm > 1.0 and norm == pytest.approx(grad_norms(ddp)[step], abs=2e-3), step
    assert sorted(val_losses(grid)) == [0, 6, 10]  # 4 decimals; the control: they differ
    for step in (0, 6):
        assert val_losses(grid)[step] == pytest.approx(val_losses(ddp)[step], abs=1e-4), step
    assert abs(val_losses(ddp)[0] - val_losses(ddp)[6]) > 0.01


def test_the_grid_checkpoint_resumes_at_dp1_x_tp2_and_at_tp1(runs):
    """Resumed at dp 1 x tp 2 (two nodes, no sequence parallelism, --grad-sync last, compiled
    block by block: torch 2.14 cannot compile the vocabulary-split embedding, and the whole model
    fails in AOTAutograd, the stage the aot_eager backend used here runs without inductor's C++
    build) and at tp 1, each logs DDP's and one process's next 8 losses (1e-4)."""
    ddp, one = losses(runs["ddp"]), losses(runs["one"])
    assert "TP traffic per rank: none (--tp 1: FSDP alone)" in runs["column"]
    for out, grid in ((runs["row"], "1 dp x 2 tp"), (runs["column"], "1 dp x 1 tp")):
        assert f"world size {2 if '2 tp' in grid else 1} ({grid})" in out
        assert f"resumed from {runs['dir'] / 'ck' / 'step-000010'} at step 10" in out
        resumed = losses(out)
        assert sorted(resumed) == list(range(11, 19))
        for step, loss in resumed.items():  # 12 sequences per micro-step in every run
            assert loss == pytest.approx(ddp[step], rel=1e-4), (step, out)
            assert loss == pytest.approx(one[step], rel=1e-4), (step, out)


def test_a_rank_killed_in_a_save_is_restarted_and_resumes_from_the_last_complete_step(runs):
    """dp 1 x tp 2 from the grid's step 10, rank 1 SIGKILLed in the save of step 12 once DCP's
    .metadata is written, restarted by torchrun: --resume auto goes on from step 10 again (the
    partial folder ignored, though it may hold run.json too: rank 0 may remove it first, as a
    failed save), and both attempts log one process's losses; at the end the folder holds step
    14 alone."""
    out, ck, one = runs["killed"], runs["dir"] / "killed" / "ck", losses(runs["one"])
    assert out.count(f"resumed from {ck / 'step-000010'} at step 10") == 2
    logged = re.findall(r"^step (\d+)/14 \| loss (\d+\.\d+)", out, re.M)
    assert [int(step) for step, _ in logged] == [11, 12, 11, 12, 13, 14]
    for step, loss in logged:  # 12 sequences per micro-step, as in one process
        assert float(loss) == pytest.approx(one[int(step)], rel=1e-4), step
    [killed] = kills(ck)
    assert killed["moment"] == "metadata" and "step-000010" in killed["held"]
    assert ".metadata" in killed["held"]["partial-step-000012"]
    assert sorted(os.listdir(ck)) == ["step-000014"]


def test_the_whole_gradients_a_rank_holds_are_its_tp_part(runs):
    """--grad-sync last holds each gradient whole over dp but still split by TP: at tp 2 (the
    resumed two-node run) a rank holds half of every matrix TP splits (25,024 values in the blocks,
    8,192 in the vocabulary matrix) and all the rest (1,472): 18,080 fp32 values, not the model's
    34,688 (the control)."""
    said = "--grad-sync last: every rank holds the whole gradients, {:.2f} MiB, from the first"
    assert said.format(4 * ((25_024 + 8_192) // 2 + 1_472) / 2**20) in runs["row"]
    assert said.format(4 * 34_688 / 2**20) not in runs["row"]


def test_the_export_holds_ddps_weights_and_samples_in_chapter_3(runs):
    exported = torch.load(runs["dir"] / "tp.pt", map_location="cpu", weights_only=True)
    ddp = torch.load(runs["ddp.pt"], map_location="cpu", weights_only=True)
    assert exported["config"] == ddp["config"]
    for key, value in ddp["model"].items():
        torch.testing.assert_close(exported["model"][key], value, rtol=1e-4, atol=1e-4, msg=key)
    sampled = in_process(GPT, ["--sample", "--ckpt", runs["dir"] / "tp.pt", "--prompt", "def ",
                               "--max-new-tokens", 20])
    assert sampled.startswith("def ") and len(sampled) > 10


def test_the_export_gathers_the_whole_model_to_rank_0s_cpu_alone(runs):
    """At dp 2 x tp 2 (the grid run) the export hands rank 0 every whole weight on the CPU and the
    other ranks nothing (tests/probe_tp.py records what get_model_state_dict returns to each), so
    no rank holds a second copy of the model on its GPU; the file holds DDP's names and sizes.
    The control: rank 0's share is every weight of chapter 3's checkpoint."""
    ddp = torch.load(runs["ddp.pt"], map_location="cpu", weights_only=True)["model"]
    whole = sum(value.numel() for value in ddp.values())
    held = [json.loads((runs["dir"] / f"export{rank}.json").read_text()) for rank in range(4)]
    assert held == [{"elements": whole, "devices": ["cpu"]}] + [
        {"elements": 0, "devices": []}] * 3, held
    exported = torch.load(runs["dir"] / "grid.pt", map_location="cpu", weights_only=True)
    assert {k: v.shape for k, v in exported["model"].items()} == {
        k: v.shape for k, v in ddp.items()}


def test_a_switch_of_sequence_parallelism_on_resume_keeps_the_copies_equal(runs):
    """Saved with sequence parallelism and dropout (each rank its own stream), resumed without it
    (a row must draw alike): the saved streams are not restored, the row's fresh seeds stay, and
    --check-sync finds its copies equal after every step. The control: restored, they drift."""
    out = runs["switched"]
    assert "resumed from" in out and "step 3/3 | loss" in out and "done | val loss" in out


def test_random_streams_come_back_only_at_the_tp_and_sp_that_saved_them(monkeypatch):
    """A checkpoint's RNG states are restored rank by rank only at the tp, sequence parallelism
    and world size that saved them: saved at dp 2 x tp 2 without sequence parallelism (a row's
    two ranks hold one stream), a resume at dp 4 x tp 1 restoring them would give two replicas
    one mask. Each switch of tp, of sequence parallelism or of the world size keeps the fresh
    seeds. The control: the same layout restores them."""
    restored = streams_restored(tp, monkeypatch)
    for saved_tp, here_tp, saved_sp, here_sp, world, expected in [
            (2, 2, "off", "off", 4, ["rank 1's"]), (2, 2, "on", "on", 4, ["rank 1's"]),
            (2, 1, "off", "off", 4, []), (1, 2, "on", "on", 4, []),
            (2, 2, "on", "off", 4, []), (2, 2, "off", "off", 2, [])]:
        args = types.SimpleNamespace(tp=here_tp, sequence_parallel=here_sp)
        run = types.SimpleNamespace(rank=1, world_size=world, device=torch.device("cpu"), args=args)
        state = {"args": {"tp": saved_tp, "sequence_parallel": saved_sp},
                 "rng": ["rank 0's", "rank 1's", "rank 2's", "rank 3's"]}
        restored.clear()
        tp.load_shards("ck", state, run, None, None)
        assert restored == expected, (saved_tp, here_tp, saved_sp, here_sp, world)


def test_sampling_pads_on_the_right_and_draws_what_one_process_draws(runs):
    """generate_in_row pads the context to its full length on the right, where a causal model's
    last token never reads it: every forward it makes starts with the context, and on the
    exported weights, greedy (top-k 1), it draws GPT.generate's 20 tokens. The control: padded on
    the left, the positions move and the last token's logits change."""
    exported = torch.load(runs["dir"] / "tp.pt", map_location="cpu", weights_only=True)
    model = tp.GPT(**exported["config"])
    model.load_state_dict(exported["model"])
    model.eval()
    prompt = torch.tensor([list(b"def main(")])
    args = types.SimpleNamespace(max_new_tokens=20, temperature=1.0, top_k=1)
    expected, forward, seen = model.generate(prompt, 20, 1.0, 1), model.forward, []
    model.forward = lambda idx, *rest: (seen.append(idx), forward(idx, *rest))[1]
    assert torch.equal(tp.generate_in_row(model, prompt, args), expected)
    assert len(seen) == 20 and all(torch.equal(x[:, :len(expected[0]) - 20 + i],
                                               expected[:, :len(expected[0]) - 20 + i])
                                   for i, x in enumerate(seen))  # the context first, then padding
    window = prompt.shape[1]  # the control: the same context padded on the left
    left = torch.nn.functional.pad(prompt, (model.block_size - window, 0))
    assert not torch.allclose(model(left)[0][0, -1], model(prompt)[0][0, -1], atol=1e-3)


def test_the_model_computes_chapter_3s_logits_from_its_weights():
    """The GPT here orders qkv's outputs head by head, as chapter 3's does (the TP plan splits
    them into whole heads; nanoGPT's q|k|v order would split them wrong at 2 heads or more per
    rank, where the tests' 1 head per rank cannot tell): chapter 3's weights, 4 heads, give
    chapter 3's logits. The control: two heads' rows swapped, they differ."""
    ours, theirs = tp.GPT(256, 32, 1, 4, 32, 0.0), trainer(GPT).GPT(256, 32, 1, 4, 32, 0.0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.5)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(x)[0], theirs(x)[0])
    with torch.no_grad():
        ours.blocks[0].attn.qkv.weight[:24] = theirs.blocks[0].attn.qkv.weight[24:48]
    assert not torch.allclose(ours(x)[0], theirs(x)[0], atol=1e-3)


def tp_split(shapes):
    """Which of helpers.gpt_shapes() TP splits (by vocabulary, columns or rows): the tied
    embedding, and in each block qkv (weight and bias), proj's weight, the MLP's first layer
    (weight and bias) and its second's weight. The positions and the norms stay whole."""
    block = [False, False, True, True, True, False, False, False, True, True, True, False]
    return [True, False, *block * ((len(shapes) - 4) // 12), False, False]


def tp_share(shapes, dp, tp):
    """Rank 0's values at dp x tp, counted here: 1 / tp of what TP splits, then FSDP's dim-0 share
    over dp of that and of the rest (every size here divides evenly)."""
    split = [(math.prod(shape) // tp,) for shape, cut in zip(shapes, tp_split(shapes)) if cut]
    return first_rank_share(split, dp) + first_rank_share(
        [shape for shape, cut in zip(shapes, tp_split(shapes)) if not cut], dp)


def test_each_rank_holds_its_share(runs):
    """The memory line is rank 0's share, counted here from the model's shapes: at dp 2 x tp 2 a
    quarter of what TP splits (each block's matrices, the column-wise layers' biases, the tied
    embedding and head, split by vocabulary) and half of the rest (FSDP's share): 9,040; at dp 1 x
    tp 2 (the resumed row, and the bf16 run on a 300-token vocabulary) half of what TP splits and
    all the rest (1,472): 18,080 on 256 tokens. The accumulation line's whole gradients are a
    rank's tp part at dp 2 and at dp 1, in fp32 under bf16 too (--grad-sync last's line:
    test_the_whole_gradients_a_rank_holds_are_its_tp_part). The control: the model split evenly
    over the ranks, 8,672 and 17,344."""
    for out, shapes, dp, sync in [(runs["grid"], gpt_shapes(), 2, "every"),
                                  (runs["row"], gpt_shapes(), 1, "last"),
                                  (runs["bf16"], gpt_shapes(vocab=VOCAB), 1, "every")]:
        mine, whole = tp_share(shapes, dp, 2), first_rank_share(shapes, 1)
        assert f"memory per rank (cpu): weights, gradients and AdamW state " \
               f"{memory_words(mine, whole)}" in out, (dp, out)
        assert mine != first_rank_share(shapes, 2 * dp)  # the control
        part = 4 * tp_share(shapes, 1, 2) / 2**20  # fp32 gradients of a rank's tp part
        every = (f"--grad-sync every: gradients stay sharded between micro-batches; the {part:.2f}"
                 " MiB of them reduce-scattered 2 times per step")
        assert (every in out) == (sync == "every"), (dp, out)
    assert (tp_share(gpt_shapes(), 2, 2), tp_share(gpt_shapes(), 1, 2)) == (9_040, 18_080)


@pytest.mark.parametrize("name, flags", [("grid", "sequence parallel, 2 micro-batches, "
                                                 "recomputed"),
                                         ("drift", "sequence parallel, checkpointing"),
                                         ("dropout", "all-reduces, 2 micro-batches")])
def test_the_traffic_line_counts_the_collectives_a_step_makes(runs, name, flags):
    """The TP traffic line's counts are those of the activations' collectives that DTensor made
    in a rank's first step (tests/probe_tp.py), at batch x context x width elements (tp 2: an
    all-gather's input is half), in three runs: with sequence parallelism under
    --grad-checkpointing, without dropout over 2 micro-batches (the grid) and with it over one
    (the drift run; the recomputed dropout's reduction is gathered again), and without sequence
    parallelism (all-reduces) (a formula off by one term fails one of them); the
    size in MiB, of fp32 activations and under --amp bf16 (the drift run) of bf16 ones; the MiB
    sent, what those collectives send from a rank as rings (0.44 to 0.47 MiB: a factor of 2 off
    is far outside the 0.005 allowed)."""
    out = {"grid": runs["grid"], "drift": runs["drift"].stdout, "dropout": runs["tp dropout"]}[name]
    batch = 16 if name == "drift" else 6  # TINY_GPT's default, SHARDED's
    tensor = batch * 32 * 32  # batch x context x width
    seen = rank_record(runs["dir"] / ("" if name == "grid" else name), 0)["collectives"]
    counted = collections.Counter(op for op, size in seen if size in (tensor, tensor // 2))
    line = re.search(r"TP traffic per rank: (?:(\d+) all-gathers and (\d+) reduce-scatters|"
                     r"(\d+) all-reduces) of ([\d.]+) MiB", out)
    gathers, scatters, reduces, mib = line.groups()
    logged = ({"all_reduce": int(reduces)} if reduces else
              {"all_gather_into_tensor": int(gathers), "reduce_scatter_tensor": int(scatters)})
    assert counted == logged, (flags, counted, logged)
    size = 2 if name == "drift" else 4  # the drift run in bf16: the activations in 2 bytes
    assert float(mib) == round(tensor * size / 2**20, 2)
    # What a rank sends of each, as a ring sends it at tp 2: an all-reduce twice half its tensor,
    # an all-gather its own input (half the tensor), a reduce-scatter half its input.
    half = {"all_reduce": tensor, "all_gather_into_tensor": tensor // 2,
            "reduce_scatter_tensor": tensor // 2}
    sent = sum(half[op] * n for op, n in counted.items()) * size / 2**20
    said = re.search(r"MiB per step, ([\d.]+) MiB sent \(tp 2, sequence parallel", out).group(1)
    assert float(said) == pytest.approx(sent, abs=0.005) and sent > 0.1, (said, sent)
    recomputed = types.SimpleNamespace(args=tp.parse_args(SHARDED + [  # off, checkpointing:
        "--tp", "2", "--grad-checkpointing", "--sequence-parallel", "off"]), amp="off")  # 1 more
    assert tp.traffic_line(recomputed).startswith("TP traffic per rank: 24 all-reduces of ")
    recomputed.args.dropout = 0.1  # the MLP's reduction too: dropout's mask after it is drawn again
    assert tp.traffic_line(recomputed).startswith("TP traffic per rank: 28 all-reduces of ")


def test_at_tp_4_the_traffic_line_is_what_the_test_counts():
    """At tp 4 (4 heads; no launch), the traffic line against a count written out here: per
    micro-batch 4 collectives of the activations a block and 2 for the ends, 2 micro-batches; a
    rank sends 3/4 of each tensor, twice for an all-reduce, once for each of an all-gather and a
    reduce-scatter; in fp32 and in bf16, with sequence parallelism and without. The control:
    at tp 2 a rank sends 1/2 of each, a third less."""
    for amp, width in (("off", 4), ("bfloat16", 2)):
        for sp in ("on", "off"):
            lines = [tp.traffic_line(types.SimpleNamespace(amp=amp, args=tp.parse_args(
                SHARDED + ["--tp", str(ranks), "--n-head", "4", "--sequence-parallel", sp])))
                for ranks in (4, 2)]
            ops, tensor = (4 * 2 + 2) * 2, 6 * 32 * 32 * width  # B x T x C, in the compute dtype
            what = (f"{ops} all-gathers and {ops} reduce-scatters" if sp == "on" else
                    f"{ops} all-reduces")
            assert lines[0] == (f"TP traffic per rank: {what} of {tensor / 2**20:.2f} MiB per "
                                f"step, {2 * ops * tensor * 3 / 4 / 2**20:.2f} MiB sent (tp 4, "
                                f"sequence parallel {sp})"), lines
            assert f", {2 * ops * tensor / 2 / 2**20:.2f} MiB sent (tp 2," in lines[1]


def test_at_tp_4_rank_0_holds_and_logs_a_quarter_of_what_tp_splits():
    """At dp 1 x tp 4 (4 heads), the model built in this process as rank 0 of a fake group of 4
    (no launch; the fake collectives send nothing, and building sends nothing anyway): its memory
    and accumulation lines give a quarter of what TP splits and all the rest, as counted here,
    on 256 and on 300 tokens. The control: at dp 2 x tp 2, also 4 ranks, rank 0 holds another
    share, and the line says so."""
    for vocab in (256, VOCAB):
        for dp, ranks in ((1, 4), (2, 2)):
            printed = built_in_a_fake_world(TP, SHARDED + ["--tp", ranks, "--n-head", 4],
                                            vocab_size=vocab)[1]
            shapes = gpt_shapes(vocab=vocab)
            mine, whole = tp_share(shapes, dp, ranks), first_rank_share(shapes, 1)
            part = 4 * tp_share(shapes, 1, ranks) / 2**20
            assert memory_words(mine, whole) in printed, printed
            assert f"the {part:.2f} MiB of them reduce-scattered 2 times" in printed
    assert tp_share(gpt_shapes(), 1, 4) != tp_share(gpt_shapes(), 2, 2)


def test_a_tp_that_does_not_divide_is_one_line(capsys):
    with pytest.raises(tp.InputError,
                       match=r"^--tp 2 does not divide the world size 1: start a multiple"):
        in_process(TP, TINY_GPT + ["--tp", 2, "--max-steps", 1, "--save", "", "--export", ""])
    with pytest.raises(SystemExit) as exit_:
        tp.parse_args(["--tp", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "--tp 3 must divide --n-head 4: each rank holds whole heads" in err
    with pytest.raises(SystemExit) as exit_:
        tp.parse_args(["--tp", "4", "--block-size", "30"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "--tp 4 must divide --block-size 30 (or give --sequence-parallel off)" in err
    tp.parse_args(["--tp", "4", "--block-size", "30", "--sequence-parallel", "off"])  # control


def test_benchmark_scaling_reads_the_tp_trainers_summary(runs):
    """benchmark_scaling.py runs any trainer the same way (its launches: test_benchmark.py);
    what it needs of a trainer is its summary's pace keys: tokens per step over the dp rows."""
    row = bench.pace_row(summary(runs["grid"]), 4, 0.0)
    assert row["per_step"] == 6 * 32 * 2 * 2 and row["unit"] == "tokens/s"  # batch x T x K x dp
    assert row["throughput"] == pytest.approx(768 / (row["step_ms"] / 1000), rel=0.01)


def test_a_tp_row_across_nodes_is_a_warning():
    """Not refused: a row of --tp consecutive ranks that nodes of that many processes cannot hold
    runs, with one warning line from rank 0 at the start."""
    assert tp.avoid_tp_across_nodes(2, 8) is None and tp.avoid_tp_across_nodes(8, 8) is None
    assert tp.avoid_tp_across_nodes(16, 8).startswith("warning: --tp 16 with 8 processes per node")
    assert tp.avoid_tp_across_nodes(3, 8) and tp.avoid_tp_across_nodes(2, 1)


def test_fsdps_policy_computes_in_bf16_and_reduces_in_fp32():
    """--amp bf16: the gathered weights cast to bf16, FSDP's reduce-scatter over dp in fp32 (a
    bf16 sum over many ranks would round at every addition); --amp off: no cast at all. The
    policy does not reach TP's sums over tp (the norms' gradients): those run in bf16."""
    assert_bf16_policy_reduces_in_fp32(tp)
    assert_every_unit_computes_in_bf16_and_reduces_in_fp32(TP, SHARDED + ["--tp", 2])  # read off it


def test_the_planner_predicts_what_each_rank_holds_and_sends(runs):
    """Chapter 13's plan_layout.py, given each run's flags and world size, predicts its memory,
    accumulation and TP traffic lines to the character: dp 2 x tp 2 with sequence parallelism,
    dp 1 x tp 2 without it and with --grad-sync last, dp 1 x tp 2 in bf16 with recomputation and
    dropout, dp 2 x tp 2 with dropout and without sequence parallelism, and the bf16 run on a
    300-token vocabulary. The control: its lines at dp 1 x tp 2 are not the grid's."""
    tp2 = ["--tp", 2]
    assert_planned(8, [
        (runs["grid"], 4, FLAGS + RECOMPUTED + tp2),
        (runs["row"], 2, FLAGS + tp2 + ["--batch-size", 12, "--grad-sync", "last",
                                        "--sequence-parallel", "off"]),
        (runs["drift"].stdout, 2, TINY_GPT + tp2 + ["--dropout", 0.1, "--grad-checkpointing",
                                                    "--amp", "bf16"]),
        (runs["tp dropout"], 4, NOISY + tp2 + ["--sequence-parallel", "off"]),
        (runs["bf16"], 2, bf16() + tp2 + ["--batch-size", 12, "--sequence-parallel", "off"])],
        other=(2, FLAGS + tp2))


def test_a_world_of_one_applies_the_schedule_times_training_and_samples_in_eval_mode(
        tmp_path):
    """The warmup and cosine by hand, applied and logged at each step; ms/step leaves out the
    evaluations and saves (a clock the test moves); the closing sample in evaluation mode (no
    dropout); as a world of one with --tp 1."""
    assert_a_world_of_one_schedules_times_and_samples_as_it_should(
        TP, ["--tp", "1"], tmp_path)
