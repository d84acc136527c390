"""Chapter 11, train_4d_minigpt.py (pipeline stages, tensor and context parallelism and FSDP on one
(pp, dp, cp, tp) mesh), under real torchrun launches on CPU/gloo. These tests prove:

1. the same math as one process, each run against the run it must equal (losses of every step
   to 1e-5 relative, gradient norms within 2e-3 (3 decimals), validation losses to the 4 decimals
   logged): for 8 steps with a clip that binds in all, pp 2 x cp 2 x tp 2 at 8 processes (two
   nodes of one stage each, through chapter 4's launcher) = chapter 3 in one process with the
   same global batch, and tp 2 x cp 2 at 4 processes (no sequence parallelism) and pp 2 x cp 2 at
   4 processes (GPipe, activation checkpointing) = one process; for 4 steps with a clip that
   binds in two and a padded validation, dp 2 x pp 2 x tp 2 at 8 processes = one process, dp
   index j reading DDP rank j's windows; with dropout and sequence parallelism off, dp 2 x tp 2
   = chapter 3's DDP with dropout, each tp pair drawing one mask, and with sequence parallelism
   every rank draws its own (recorded by tests/probe_4d.py).
   A group built wrong (FSDP over dp alone, CP's gather over the tp group...) leaves these
   numbers or stops the run: tests/mistakes.py runs each such mistake against these tests;
2. the layout: rank 0 prints the mesh and one rank's coordinates and groups, tp innermost;
3. checkpoints know no layout: the 8-process run's step-8 checkpoint resumes in chapters 7, 8, 9
   and 10 (one process) and here at pp 2 x cp 2 and at one process, with the uninterrupted run's
   next losses, the one process through a SIGKILL under `torchrun --max-restarts=1` (restarted,
   `--resume auto`); chapter 7's checkpoint resumes here at tp 2 x cp 2; the export holds one
   process's weights at the same step and samples in chapter 3, and the run's own sample, drawn at
   random, is one process's at the same seed; random streams come back only at the pp, cp, tp,
   sequence parallelism and world size that saved them;
4. what a rank holds and sends: the parameters of its shards add up over the mesh to the model
   (the tied matrix twice: its two stages), as the memory line counts them; the bytes rank 0 sends
   in a step, by group, are the traffic line's (tests/probe_4d.py counts them), with sequence
   parallelism and without, and with blocks recomputed (CP's gathers: two per block, not three);
   under bf16 the line's activations halve and the tied gradient's shard stays fp32; at an uneven
   cut it counts stage 0's blocks, and at tp 1 no tp collectives;
5. bad input is one line and exit code 2: sizes whose product does not divide the world size
   (one line from rank 0, before any group), tp not dividing the heads, more stages than blocks,
   a context that 2 x cp does not divide, a cp share that sequence parallelism cannot split by tp,
   a --block-size beyond the data (10^13: refused in the data check's words before the context's
   positions are made, by rank 0 alone; the control: a context the data holds passes);
   a tp group across nodes is warned of, cp groups across nodes noted;
6. each cp rank holds an early chunk and a late one (recorded), for equal attention work; pp 3
   over 4 blocks logs one process's losses, the tied gradient summed by the end stages alone;
   under bf16 (cp 2 x tp 2 with dropout) the validation loss before training is one process's in
   fp32: the logits' cross-entropy is summed in fp32;
7. benchmark_scaling.py reads its summary: the global batch counts the dp replicas, not the ranks;
8. a run as a GPU user starts one: pp 2 x tp 2 under --amp bf16, --grad-checkpointing,
   --compile (aot_eager), --reshard-after-forward yes, on a file of token ids (--data,
   --vocab-size, --val-fraction), logs chapter 3's one-process bf16 numbers within bf16's
   rounding, and the data and parameter lines the test computes; the clipped and dropout runs
   set --weight-decay, --dist-timeout and --amp off too.
The schedule and the clock, in this process as a world of one: each step applies and logs
the warmup and cosine worked out by hand, and ms/step leaves out evaluation and saving (the
test moves the clock: 1 s a step, 100 s an evaluation or a save); with dropout, the closing
sample runs every module in evaluation mode.
"""
import json
import math
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
from helpers import CLIPPED, assert_clipped_run_is_one_processs, one_process_clipped
from helpers import assert_bf16_run_is_one_processs, bf16, one_process_bf16
from helpers import assert_kv_gradients_summed_in_fp32, streams_restored
from helpers import assert_planned, built_in_a_fake_world, gpt_shapes
from helpers import (EVAL_6, GPT, NEEDS_CP, NOISY, REPO, SHARDED, as_script, command,
                     ddp_dropout_reference, ddp_reference, finish, in_process, needs_torch, ok,
                     one_process_reference, start, start_two_nodes, summary, trainer)

import benchmark_scaling as bench  # noqa: E402  (the repository is on sys.path: helpers)

pytestmark = needs_torch(*NEEDS_CP)
FOURD = "train_4d_minigpt.py"
ONE = SHARDED + ["--batch-size", 12]  # one replica: the global batch of one_process_reference
# Four blocks on three stages (uneven), 4 micro-batches of 3 (1F1B needs as many as stages)
THREE = SHARDED + ["--n-layer", 4, "--batch-size", 3, "--grad-accum", 4, "--max-steps", 3,
                   "--save", ""]


CONTRACT = {  # tests/README.md, "One proof for every GPT chapter"; None: not held yet
    "reference": ["test_pp2_cp2_tp2_at_8_processes_computes_what_one_process_computes",
                  "test_dp2_pp2_tp2_logs_one_processs_norms_about_a_binding_clip_and_padded_validation"],
    "norms": ["test_dp2_pp2_tp2_logs_one_processs_norms_about_a_binding_clip_and_padded_validation",
              "test_with_dropout_and_sp_off_dp2_x_tp2_logs_ddps_numbers_and_a_tp_pair_drops_alike"],
    "padded": ["test_dp2_pp2_tp2_logs_one_processs_norms_about_a_binding_clip_and_padded_validation",
               "test_with_dropout_and_sp_off_dp2_x_tp2_logs_ddps_numbers_and_a_tp_pair_drops_alike"],
    "dropout": ["test_with_dropout_and_sp_off_dp2_x_tp2_logs_ddps_numbers_and_a_tp_pair_drops_alike",
                "test_with_sequence_parallelism_every_rank_drops_its_own_tokens_with_its_own_mask"],
    "collectives": ["test_the_traffic_line_is_what_rank_0_sends_in_a_step",
                    "test_without_sequence_parallelism_tp_sends_what_the_traffic_line_says",
                    "test_a_recomputed_block_gathers_keys_and_values_as_the_traffic_line_says",
                    "test_under_bf16_the_traffic_line_counts_the_tied_shard_in_fp32"],
    "policy": ["test_fsdps_policy_computes_in_bf16_and_reduces_in_fp32",
               "test_under_bf16_the_validation_loss_is_summed_in_fp32"],
    "resume": ["test_pp2_cp2_goes_on_from_the_8_process_checkpoint",
               "test_the_4d_checkpoint_resumes_in_chapters_7_to_10"],
    "bf16": ["test_bf16_compiled_at_pp2_x_tp2_logs_one_processs_bf16_numbers"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's launches, side by side: pp 2 x cp 2 x tp 2 as two nodes of 4 for 8 steps,
    saved at 8 (`nodes`); meanwhile chapter 7 in this process to step 8, saved and exported, from
    which tp 2 x cp 2 at 4 processes goes on to step 16 (`square`). Once `nodes` is done (the two
    8-process runs one after the other: 16 processes on 2 cores cost more than twice 8): dp 2 x pp
    2 x tp 2 at 8 processes for 4 steps of CLIPPED with --debug (`grid`), and from `nodes`' step 8
    pp 2 x cp 2 at 4 processes to step 16 (`pipes`), one process to step 12, killed once step 10 is
    saved and renamed, before step 8 is dropped, and restarted by torchrun (`restarted`), and chapters 7-10 in this process to step 10.
    Once `grid` is done: dp 2 x tp 2 with NOISY's dropout and sequence parallelism off,
    recomputed and resharded after forward (`dropout`), and cp 2 x tp 2 with dropout under bf16
    for one step (`sp dropout`), both recorded, pp 3 over 4 blocks (`three`), and two
    interleaved stages per rank, recomputed (`interleaved`). `nodes` samples 4 tokens at random
    (top-k 40, temperature 0.8: the defaults), the others 1."""
    d = tmp_path_factory.mktemp("fourd")
    for name in ("nodes", "restarted"):
        (d / name).mkdir()
    nodes = start_two_nodes("tests/probe_4d.py", [
        "record", d / "nodes", *ONE, "--pp", 2, "--cp", 2, "--tp", 2, "--max-steps", 8,
        "--eval-every", 8, "--save", d / "ck", "--export", d / "4d.pt", "--max-new-tokens", 4],
        nproc=4)
    cmds = {"grid": command("tests/probe_4d.py", [
        "run", *CLIPPED, "--pp", 2, "--cp", 1, "--tp", 2, "--debug", "--export", ""], nproc=8)}
    for name in ("dropout", "sp dropout", "interleaved"):
        (d / name).mkdir()
    cmds["interleaved"] = command("tests/probe_4d.py", [
        "record", d / "interleaved", *THREE, "--pp", 2, "--cp", 1, "--tp", 2, "--schedule",
        "interleaved-1f1b", "--stages-per-rank", 2, "--grad-checkpointing", "--export", ""],
        nproc=4)
    cmds["dropout"] = command("tests/probe_4d.py", [
        "record", d / "dropout", *NOISY, "--pp", 1, "--cp", 1, "--tp", 2, "--sequence-parallel",
        "off", "--grad-checkpointing", "--reshard-after-forward", "yes", "--export", ""], nproc=4)
    cmds["three"] = command("tests/probe_4d.py", ["run", *THREE, "--pp", 3, "--cp", 1, "--tp", 1,
                                                  "--export", ""], nproc=3)
    cmds["bf16"] = command(FOURD, [*bf16(dropout=False), "--batch-size", 12, "--pp", 2, "--cp", 1,
                                   "--tp", 2, "--reshard-after-forward", "yes", "--compile",
                                   "--compile-backend", "aot_eager", "--export", ""], nproc=4)
    cmds["sp dropout"] = command("tests/probe_4d.py", [
        "record", d / "sp dropout", *SHARDED, "--dropout", 0.1, "--pp", 1, "--cp", 2, "--tp", 2,
        "--max-steps", 1, "--save", "", "--export", "", "--amp", "bf16"], nproc=4)
    launched = {}
    r = {"ch7": in_process("train_fsdp_minigpt.py", ONE + [  # one process's step 8
        "--max-steps", 8, "--eval-every", 8, "--save", d / "ch7", "--export", d / "ch7.pt"])}
    (d / "square").mkdir()
    cmds["square"] = command("tests/probe_4d.py", [
        "record", d / "square", *ONE, "--pp", 1, "--cp", 2, "--tp", 2, "--sequence-parallel", "off",
        "--max-steps", 16, *EVAL_6, "--resume", d / "ch7", "--save", "", "--export", ""], nproc=4)
    launched["square"] = start(cmds["square"], REPO)
    r.update(one=one_process_reference()[0], ddp=ddp_reference()[0], dir=d,
             ddp_dropout=ddp_dropout_reference()[0],
             one_of_three=in_process(GPT, THREE))
    one_process_clipped()  # the grid's global batch in this process
    one_process_bf16(dropout=False), one_process_bf16()
    outs = [out for out in nodes() if "world size 8 " in out]  # rank 0's node logs
    assert len(outs) == 1
    r["nodes"], step_8 = outs[0], d / "ck" / "step-000008"
    launched["grid"] = start(cmds["grid"], REPO)
    ck = d / "restarted" / "ck"  # the 8-process step 8, where --resume auto finds it
    shutil.copytree(step_8, ck / "step-000008")
    (d / "pipes").mkdir()
    cmds["pipes"] = command("tests/probe_4d.py", [
        "record", d / "pipes", *ONE, "--pp", 2, "--cp", 2, "--tp", 1, "--schedule", "gpipe", "--grad-checkpointing",
        "--max-steps", 16, "--resume", step_8, "--save", "", "--export", ""], nproc=4)
    cmds["restarted"] = command("tests/probe_4d.py", [
        "killsave", "renamed@10:0", d / "restarted", *ONE, "--pp", 1, "--cp", 1, "--tp", 1, "--max-steps",
        12, "--save-every", 2, "--save", ck, "--resume", "auto", "--export", ""], nproc=1,
        torchrun_args=["--max-restarts=1"])
    launched["pipes"] = start(cmds["pipes"], REPO)
    launched["restarted"] = start(cmds["restarted"], REPO,
                                  {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})  # pytorch#135712
    for script, flags in (("train_fsdp_minigpt.py", []), ("train_tp_minigpt.py", ["--tp", 1]),
                          ("train_pp_minigpt.py", ["--pp", 1]), ("train_cp_minigpt.py",
                                                                ["--cp", 1])):
        export = ["--export", d / "ch9.pt"] if script == "train_pp_minigpt.py" else ["--export", ""]
        r[script] = in_process(script, ONE + flags + ["--max-steps", 10, "--resume", step_8,
                                                      "--save", "", *export])
    r["grid"] = finish(launched.pop("grid"), cmds["grid"])
    for name in ("dropout", "sp dropout", "three", "interleaved"):  # once the grid is done
        launched[name] = start(cmds[name], REPO)
    for name, proc in launched.items():
        r[name] = finish(proc, cmds[name])
    r["bf16"] = finish(start(cmds["bf16"], REPO), cmds["bf16"])  # 4 more processes: alone
    for name in ("grid", "square", "pipes", "dropout", "sp dropout", "three", "interleaved",
                 "bf16"):
        r[name] = ok(r[name])
    return r


def assert_same_steps(out, reference, steps):
    """The run logged these steps, each with the reference's loss and gradient norm (clipped)."""
    assert sorted(losses(out)) == steps, losses(out)
    for step in steps:
        assert losses(out)[step] == pytest.approx(losses(reference)[step], rel=1e-5), step
        norm = grad_norms(out)[step]
        assert norm > 1.0 and norm == pytest.approx(grad_norms(reference)[step], abs=2e-3), step


def test_pp2_cp2_tp2_at_8_processes_computes_what_one_process_computes(runs):
    """Two nodes of one stage each, every stage 2 cp x 2 tp: chapter 3's one process, step by step,
    and its validation losses (each token scored once, by the last stage's cp ranks) before
    training and at step 8 (chapter 7 in one process: the control, training moved it)."""
    out, one = runs["nodes"], runs["one"]
    assert "world size 8 (2 pp x 1 dp x 2 cp x 2 tp) |" in out and "| schedule 1f1b" in out
    assert_same_steps(out, one, list(range(1, 9)))
    assert losses(out)[8] < losses(out)[1]
    assert sorted(val_losses(out)) == [0, 8]
    assert val_losses(out)[0] == pytest.approx(val_losses(one)[0], abs=2e-4)
    assert val_losses(out)[8] == pytest.approx(val_losses(runs["ch7"])[8], abs=2e-4)
    assert val_losses(out)[8] < val_losses(out)[0] - 0.1


def test_dp2_pp2_tp2_logs_one_processs_norms_about_a_binding_clip_and_padded_validation(runs):
    """Two replicas, each two stages of 2 tp ranks, with --clip 2.0 and 13 validation windows (7
    and 6: one replica's last batch padded): chapter 3's one process at the same global batch, its
    losses, its gradient norms before clipping where the clip binds (steps 1 and 2) and where it
    does not (3 and 4, the control), and its validation losses; dp index j reads what DDP's rank j
    reads (every stage and tp rank of a replica the same windows)."""
    grid, ddp = runs["grid"], runs["ddp"]
    assert "world size 8 (2 pp x 2 dp x 1 cp x 2 tp) |" in grid
    assert_clipped_run_is_one_processs(grid, val_abs=2e-4)
    windows = re.findall(r"^\[rank (\d)\] stage (\d), dp (\d), cp 0, tp (\d): \d+ micro-batches "
                         r"per epoch, first windows at tokens (\[[\d, ]+\])$", grid, re.M)
    ddp_windows = dict(re.findall(r"^\[rank (\d)\] \d+ micro-batches per epoch, first windows at "
                                  r"tokens (\[[\d, ]+\])$", ddp, re.M))
    assert len(windows) == 8 and ddp_windows["0"] != ddp_windows["1"]
    for rank, stage, dp, tp, first in windows:  # tp innermost, then cp (1), dp, pp outermost
        assert int(rank) == int(stage) * 4 + int(dp) * 2 + int(tp)
        assert first == ddp_windows[dp], rank


def test_with_dropout_and_sp_off_dp2_x_tp2_logs_ddps_numbers_and_a_tp_pair_drops_alike(runs):
    """With --dropout 0.1, sequence parallelism off, dp 2 x tp 2 (helpers.NOISY: a clip that binds
    in steps 1 and 2, 13 validation windows), its blocks recomputed in backward, logs chapter 3's
    DDP at 2 processes with dropout and without recomputation: the losses, gradient norms and
    validation losses (a recomputed block must draw its forward's masks again). The two tp ranks of
    a replica hold one stream and drop it alike (one recorded mask), the replicas differ; ranks
    seeded each their own would drop the copies apart, and the losses would leave DDP's."""
    out, ddp = runs["dropout"], runs["ddp_dropout"]
    assert "world size 4 (1 pp x 2 dp x 1 cp x 2 tp) |" in out
    assert sorted(losses(out)) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert losses(out)[step] == pytest.approx(losses(ddp)[step], rel=1e-5), step
        assert grad_norms(out)[step] == pytest.approx(grad_norms(ddp)[step], abs=2e-3), step
    assert val_losses(out) == pytest.approx(val_losses(ddp), abs=2e-4)
    masks = [record(runs["dir"] / "dropout", rank).get("dropout_mask") for rank in range(4)]
    assert None not in masks and masks[0] == masks[1] != masks[2] == masks[3], masks


def test_with_sequence_parallelism_every_rank_drops_its_own_tokens_with_its_own_mask(runs):
    """Under sequence parallelism (the default) at cp 2 x tp 2, each rank holds its own slice of
    the stream and draws its own mask: four different masks, where seeded by tp group a pair's
    ranks would drop the same units of different tokens. The control: the tp pair of the run with
    sequence parallelism off records one mask (the test above)."""
    masks = [record(runs["dir"] / "sp dropout", rank).get("dropout_mask") for rank in range(4)]
    assert "world size 4 (1 pp x 1 dp x 2 cp x 2 tp) |" in runs["sp dropout"]
    assert None not in masks and len(set(masks)) == 4, masks


def record(folder, rank):
    """What tests/probe_4d.py recorded for one rank."""
    return json.loads((folder / f"rank{rank}.json").read_text())


def test_pp3_over_4_blocks_sums_the_tied_gradient_over_the_end_stages_alone(runs):
    """Three stages over four blocks (one stage holds two; the middle stage no tied copy): one
    process's losses and gradient norms, clipped. The tied matrix's gradient is summed in the
    group of the two end stages; summed over every stage's group, the middle stage never joins
    the call, and the run stops."""
    out = runs["three"]
    assert "world size 3 (3 pp x 1 dp x 1 cp x 1 tp) |" in out
    assert_same_steps(out, runs["one_of_three"], [1, 2, 3])


def test_interleaved_stages_under_tp_compute_what_one_process_computes(runs):
    """pp 2 x tp 2 with two interleaved stages per rank (rank 0's stages 0 and 2: the embeddings,
    split by vocabulary, and blocks 0 and 2; rank 1's blocks 1 and 3 and the head): one process's
    losses and clipped gradient norms. Each micro-batch goes round the pp group twice, so rank 0
    sends activations on from stages 0 and 2 and gradients back from stage 2: three times what
    one stage per rank sends. The bytes recorded in step 2 are the traffic line's. Under
    --grad-checkpointing both of rank 0's stages recompute their blocks: at most its 2 blocks'
    inputs for each of the 4 micro-batches are saved at once (B x T / tp x C fp32 each, under
    sequence parallelism; half as much again allowed for the rest), where a stage left
    unrecomputed saves every activation of its block (245,248 bytes measured by a reviewer,
    against 27,904)."""
    out = runs["interleaved"]
    assert "| schedule interleaved-1f1b, 2 stages per rank" in out
    assert "stages 0, 2 (embeddings, blocks 0, 2)" in out
    assert "stages 1, 3 (blocks 1, 3, final norm and head)" in out
    assert_same_steps(out, runs["one_of_three"], [1, 2, 3])
    sent = record(runs["dir"] / "interleaved", 0)["sent"]
    line = re.search(r"traffic per step, rank 0 \(stages 0, 2, 2 blocks\): .* \| pp ([\d.]+) MiB",
                     out)
    once = 4 * 3 * 16 * 32 * 4  # K x B x T / tp (sequence parallel) x C x 4 bytes, one stage
    assert sent["pp"] == pytest.approx(3 * once, abs=8) and sent["tied"] > 0, sent
    assert sent["pp"] + sent["tied"] == pytest.approx(float(line.group(1)) * 2**20, abs=600)
    saved = record(runs["dir"] / "interleaved", 0)["peak_saved_bytes"]
    assert 0 < saved < 1.5 * 2 * 4 * (3 * 16 * 32 * 4), saved


def test_at_an_uneven_cut_the_traffic_line_counts_stage_0s_blocks(runs):
    """pp 3 over 4 blocks: stage 0 holds 1 block and stage 2 holds 2 (the memory line's parts);
    the traffic line, rank 0's, counts stage 0's 1, not 4 / 3 rounded up nor the last stage's 2.
    At --tp 1 the line names no tp collectives (there is no tp group); the control: at tp 2 (the
    8-process run) it names 10, 4 per block and 1 for the embedding, for each of 2 micro-batches."""
    out = runs["three"]
    assert re.search(r"stage 0 \(embeddings, block 0\) [\d.]+ MiB, [\d,]+ parameters; stage 1 "
                     r"\(block 1\) [\d.]+ MiB, [\d,]+ parameters; stage 2 \(blocks 2-3, final "
                     r"norm and head\)", out), out
    line = re.search(r"^traffic per step, .*$", out, re.M).group(0)
    assert re.fullmatch(r"traffic per step, rank 0 \(stage 0, 1 blocks\): tp 0\.000 MiB \| cp "
                        r"0\.000 MiB \| pp [\d.]+ MiB \(FSDP's gathers aside\)", line), line
    assert re.search(r"\(stage 0, 1 blocks\): .* \(tp: 10 collectives of ", runs["nodes"])


def test_bf16_compiled_at_pp2_x_tp2_logs_one_processs_bf16_numbers(runs):
    """Two stages, each split over a tp pair with sequence parallelism, under --amp bf16,
    --grad-checkpointing and --compile with the aot_eager backend, FSDP resharding after each
    forward, on a file of token ids, log chapter 3's one-process bf16 losses, gradient norms and
    validation losses within bf16's rounding (TP adds each pair's partial products after each is
    rounded to bf16), and the data and parameter lines the test computes. No dropout: under
    sequence parallelism each rank draws its own tokens' masks. Measured on 2 cores (torch 2.14):
    losses, norms and validation losses within 1.8e-3, 5e-3 and 7e-4 of one process's; allowed:
    5e-3, 1.5e-2 and 2e-3."""
    assert "world size 4 (2 pp x 1 dp x 1 cp x 2 tp) |" in runs["bf16"]
    assert_bf16_run_is_one_processs(runs["bf16"], dropout=False)


def test_under_bf16_the_validation_loss_is_summed_in_fp32(runs):
    """Under --amp bf16 (the cp 2 x tp 2 run with dropout) the logits come out in bf16, split by
    vocabulary, and evaluation sums their cross-entropy in fp32: before training, from one
    process's initial weights, the validation loss is one process's in fp32 to 3e-4 (1e-4 apart
    as measured, bf16's compute; summed in the logits' bf16, 1.1e-3). The control: one step of
    training moves it by more than 0.1."""
    out, one = runs["sp dropout"], runs["one"]
    assert "| amp bfloat16 |" in out and sorted(val_losses(out)) == [0, 1]
    assert val_losses(out)[0] == pytest.approx(val_losses(one)[0], abs=3e-4)
    assert val_losses(out)[1] < val_losses(out)[0] - 0.1


def test_the_layout_line_shows_one_ranks_place_and_groups(runs):
    assert ("mesh pp 2 x dp 1 x cp 2 x tp 2 | rank 7 at {'pp': 1, 'dp': 0, 'cp': 1, 'tp': 1}: "
            "groups pp [3, 7], dp [7], cp [5, 7], tp [6, 7], fsdp [5, 7]") in runs["nodes"]
    assert ("mesh pp 2 x dp 2 x cp 1 x tp 2 | rank 7 at {'pp': 1, 'dp': 1, 'cp': 0, 'tp': 1}: "
            "groups pp [3, 7], dp [5, 7], cp [7], tp [6, 7], fsdp [5, 7]") in runs["grid"]


def test_tp2_cp2_from_chapter_7s_checkpoint_computes_what_one_process_computes(runs):
    """tp x cp without stages, sequence parallelism off (the stream whole on a tp group's ranks,
    dropped out alike), resumed from chapter 7's checkpoint: one process's steps 9-16."""
    out, one = runs["square"], runs["one"]
    assert "world size 4 (1 pp x 1 dp x 2 cp x 2 tp) |" in out
    assert f"resumed from {runs['dir'] / 'ch7' / 'step-000008'} at step 8" in out
    assert_same_steps(out, one, list(range(9, 17)))
    assert val_losses(out)[12] == pytest.approx(val_losses(one)[12], abs=2e-4)


def test_pp2_cp2_goes_on_from_the_8_process_checkpoint(runs):
    """pp 2 x cp 2 (GPipe, activation checkpointing) from the 8-process run's step 8, another
    layout of this chapter: one process's steps 9-16."""
    out = runs["pipes"]
    assert "world size 4 (2 pp x 1 dp x 2 cp x 1 tp) |" in out and "| schedule gpipe" in out
    assert f"resumed from {runs['dir'] / 'ck' / 'step-000008'} at step 8" in out
    assert_same_steps(out, runs["one"], list(range(9, 17)))


def test_the_checkpoint_keeps_every_ranks_own_random_streams(runs):
    """The 8-process run (sequence parallelism on: each rank seeds its own stream) saves 8 random
    states in its run.json, one per rank and all different, so that a resume at this layout draws
    each rank's own masks on. The control: the states are real ones, of the size this torch's
    CPU generator keeps."""
    rng = json.loads((runs["dir"] / "ck" / "step-000008" / "run.json").read_text())["rng"]
    assert len(rng) == 8 and len({tuple(r["cpu"]) for r in rng}) == 8
    assert all(len(r["cpu"]) == len(torch.get_rng_state()) for r in rng)


def test_a_resumed_run_times_and_counts_only_its_own_steps(runs):
    """tp 2 x cp 2 resumed from chapter 7's step 8 and trained to step 16 (`square`): its summary
    counts the 8 steps it ran (it logged steps 9 to 16), and its tokens per second are those 8
    steps' tokens over their training time (a meter counting from step 0 would claim 16 steps in
    that time, and twice the speed)."""
    got = summary(runs["square"])
    assert sorted(losses(runs["square"])) == list(range(9, 17)) and got["steps"] == 8, got
    assert got["tokens_per_s"] == pytest.approx(8 * got["per_step"] / got["train_s"], rel=1e-3)


def test_a_killed_process_restarts_and_goes_on_from_the_8_process_checkpoint(runs):
    """The 8-process step 8 in one process (world size 1: the mesh all 1s), SIGKILLed once its
    step 10 is complete and renamed but step 8 not yet dropped, restarted by torchrun
    (--max-restarts=1), and --resume auto goes on from step 10, the newer of the two:
    one process's steps 9-12 across both attempts."""
    result, ck = runs["restarted"], runs["dir"] / "restarted" / "ck"
    out = ok(result)
    assert "world size 1 (1 pp x 1 dp x 1 cp x 1 tp) |" in out
    assert "failed (exitcode: -9) local_rank: 0" in result.stderr
    first, _, second = out.partition(f"resumed from {ck / 'step-000010'} at step 10")
    assert f"resumed from {ck / 'step-000008'} at step 8" in first
    assert sorted(losses(first)) == [9, 10] and sorted(losses(second)) == [11, 12]
    assert_same_steps(first + second, runs["one"], [9, 10, 11, 12])
    [killed] = kills(ck)  # step 10 renamed, complete, and step 8 not yet dropped
    assert killed["moment"] == "renamed" and sorted(killed["held"]) == ["step-000008",
                                                                        "step-000010"]


@pytest.mark.parametrize("script", ["train_fsdp_minigpt.py", "train_tp_minigpt.py",
                                    "train_pp_minigpt.py", "train_cp_minigpt.py"])
def test_the_4d_checkpoint_resumes_in_chapters_7_to_10(runs, script):
    out = runs[script]
    assert f"resumed from {runs['dir'] / 'ck' / 'step-000008'} at step 8" in out
    assert_same_steps(out, runs["one"], [9, 10])


def test_the_export_is_one_process_model_and_samples_in_chapter_3(runs):
    """The 8-process run's export (step 8) holds the weights one process holds at step 8 (chapter
    7 in one process: the tied matrix once, every tp and FSDP shard in place; the control, chapter
    9 two steps later, differs), and chapter 3 samples from both alike (greedy: no random draw);
    the run's own sample after training, 4 tokens drawn at random through both stages (the whole
    context padded, split by sequence, the logits gathered over tp, each token drawn alike by the
    last stage's tp ranks and broadcast), is chapter 3's text at the run's seed (0). The control:
    at seed 1 chapter 3 draws another text."""
    import torch
    mine, one, later = (torch.load(runs["dir"] / name, map_location="cpu", weights_only=True)
                        for name in ("4d.pt", "ch7.pt", "ch9.pt"))
    assert mine["model"].keys() == one["model"].keys() and mine["step"] == 8
    for name, value in mine["model"].items():
        assert torch.allclose(value, one["model"][name], atol=1e-4), name  # Adam: 2e-5 at most
    assert not torch.allclose(mine["model"]["blocks.0.attn.qkv.weight"],
                              later["model"]["blocks.0.attn.qkv.weight"], atol=1e-4)
    sampled = [in_process(GPT, ["--sample", "--ckpt", runs["dir"] / name, "--top-k", 1,
                                "--max-new-tokens", 12]) for name in ("4d.pt", "ch7.pt")]
    assert len(sampled[0]) > 8 and sampled[0] == sampled[1]
    own = runs["nodes"].split("sample:\n", 1)[1]
    drawn = [in_process(GPT, ["--sample", "--ckpt", runs["dir"] / "4d.pt", "--prompt", "\n",
                              "--max-new-tokens", 4, "--seed", seed]) for seed in (0, 1)]
    assert own == drawn[0] != drawn[1], (own, drawn)


def test_each_rank_holds_its_shards_and_the_memory_line_says_so(runs):
    """The parameters of every rank's shards add up to the model, the tied matrix twice (a copy on
    each end stage), what TP does not split (norms, row-wise biases, positions) once per tp rank,
    every (pp, cp, tp) place once; the memory line counts stage 0's first rank."""
    model = trainer(GPT).GPT(256, 32, 2, 2, 32, 0.0)
    whole, tied = sum(p.numel() for p in model.parameters()), model.head.weight.numel()
    copied = sum(p.numel() for name, p in model.named_parameters()  # on both tp ranks
                 if p.dim() == 1 and "qkv" not in name and "mlp.0" not in name or "pos" in name)
    seen = [json.loads((runs["dir"] / "nodes" / f"rank{r}.json").read_text()) for r in range(8)]
    assert sorted(tuple(s["coords"]) for s in seen) == [
        (p, 0, c, t) for p in range(2) for c in range(2) for t in range(2)]
    assert copied == 2 * (4 * 32 + 2 * 32) + 2 * 32 + 32 * 32  # 2 blocks, ln_f, positions
    assert sum(s["params"] for s in seen) == whole + tied + copied
    assert all(s["steps"] == 8 and s["peak_saved_bytes"] > 0 for s in seen)
    held = re.search(r"stage 0 \(embeddings, block 0\) [\d.]+ MiB, ([\d,]+) parameters; stage 1 "
                     r"\(block 1, final norm and head\)", runs["nodes"])
    assert int(held.group(1).replace(",", "")) == sum(s["params"] for s in seen if s["coords"]
                                                      [0] == 0 and s["coords"][2:] == [0, 0])


def test_each_cp_rank_holds_an_early_chunk_and_a_late_one(runs):
    """At cp 2 and 32 tokens, every rank with cp index 0 holds tokens 0-7 and 24-31 and index 1
    tokens 8-23, whatever its stage or tp index: causal attention costs each the same (keys
    before a query: 36 + 228 = 264 each). Contiguous halves, the same numbers, would cost 136 and
    392."""
    chunks = {0: [*range(0, 8), *range(24, 32)], 1: list(range(8, 24))}
    for rank in range(8):
        seen = record(runs["dir"] / "nodes", rank)
        assert seen["positions"] == chunks[seen["coords"][2]], (rank, seen["coords"])
    work = [sum(p + 1 for p in chunk) for chunk in chunks.values()]
    halves = [sum(p + 1 for p in range(16 * i, 16 * i + 16)) for i in (0, 1)]
    assert work == [264, 264] and halves == [136, 392]


def test_a_recomputed_block_gathers_keys_and_values_as_the_traffic_line_says(runs):
    """With --grad-checkpointing (pp 2 x cp 2, GPipe) the block's recomputation gathers the keys
    and values again, so CP's own checkpoint of its attention is left off: rank 0 sends over the
    cp group in a step what the traffic line says (a gather in forward, one in backward, the
    gradients' reduce-scatter); under both checkpoints a third gather sent more."""
    sent = record(runs["dir"] / "pipes", 0)["sent"]
    line = re.search(r"traffic per step, rank 0 \(stage 0, 1 blocks\): tp [\d.]+ MiB \| cp "
                     r"([\d.]+) MiB", runs["pipes"])
    assert sent["cp"] == pytest.approx(float(line.group(1)) * 2**20, abs=0.0006 * 2**20)
    assert sent["cp"] > 0 and sent.get("tp", 0) == 0  # tp 1: no TP traffic


def test_without_sequence_parallelism_tp_sends_what_the_traffic_line_says(runs):
    """tp 2 x cp 2 with sequence parallelism off: TP's all-reduces of the whole stream send what
    the line says for tp, as SP's all-gathers and reduce-scatters do (the test below); cp's gathers
    too. Recorded in the run's second step, rank 0 (tests/probe_4d.py)."""
    sent = record(runs["dir"] / "square", 0)["sent"]
    line = re.search(r"traffic per step, rank 0 \(stage 0, 2 blocks\): tp ([\d.]+) MiB \| cp "
                     r"([\d.]+) MiB", runs["square"])
    tp, cp = (float(x) * 2**20 for x in line.groups())
    assert sent["cp"] == pytest.approx(cp, abs=0.0006 * 2**20) and sent["cp"] > 0
    assert sent["tp"] == pytest.approx(tp, abs=0.0012 * 2**20) and sent["tp"] > 0


def test_at_pp1_each_micro_batch_reduce_scatters_and_under_a_schedule_the_step_once(runs):
    """At --pp 1 there is no schedule: each micro-batch's backward reduce-scatters every FSDP unit
    (2 blocks and the root, 2 micro-batches: 6 a step), so no rank keeps whole gradients through
    a step, as chapter 7 with --grad-sync every. Under a schedule (pp 2, stage 0: block 0 and the
    root) FSDP reduce-scatters once a step, after the last backward (2). Counted by the probe."""
    square = record(runs["dir"] / "square", 0)["calls"]
    pipes = record(runs["dir"] / "pipes", 0)["calls"]
    assert square["fsdp reduce_scatter"] == 3 * 2, square
    assert pipes["fsdp reduce_scatter"] == 2, pipes
    # --reshard-after-forward no (the default): each unit gathered once per micro-batch at pp 1
    # (resharded after its backward), once per step under the schedule; yes would gather block 0
    # again in each backward
    assert square["fsdp all_gather"] == 3 * 2 and pipes["fsdp all_gather"] == 2, (square, pipes)
    # with --reshard-after-forward yes (the dropout run, recomputed) block 0 is gathered again
    # for its backward (its recomputation uses that gather): 4 a micro-batch, the last block kept
    resharded = [record(runs["dir"] / "dropout", rank)["calls"] for rank in range(4)]
    assert [calls["fsdp all_gather"] for calls in resharded] == [(1 + 2 + 1) * 2] * 4, resharded


def test_inside_a_step_a_rank_holds_its_stages_gathered_and_their_gradients_whole(runs):
    """Under the schedule a rank holds its stages' weights gathered (TP's part) and their gradients
    whole until its last backward: measured just before each stage reduce-scatters
    (tests/probe_4d.py), the bytes the memory line gives at pp 2 x cp 2 x tp 2 (each stage's
    first rank) and with two interleaved stages per rank. At --pp 1 no schedule runs (the
    control: none measured), and each unit's gradients are reduce-scattered after its backward:
    the line counts the gathered weights alone (fp32: 4 bytes a parameter of TP's part)."""
    for name, ranks, label in (("nodes", (0, 4), r"stage \d"), ("interleaved", (0, 2),
                                                               r"stages \d, \d")):
        line = re.search(r"inside a step also the weights gathered and the gradients whole: "
                         rf"{label} ([\d.]+) MiB, {label} ([\d.]+) MiB", runs[name])
        for i, rank in enumerate(ranks):
            seen = record(runs["dir"] / name, rank)
            assert seen["in_step_bytes"] / 2**20 == pytest.approx(float(line.group(1 + i)),
                                                                  abs=0.005), (name, rank)
    square = record(runs["dir"] / "square", 0)  # cp 2 x tp 2: FSDP halves TP's even parts
    assert square["in_step_bytes"] == 0
    line = re.search(r"inside a step also the weights gathered and the gradients whole: stage 0 "
                     r"([\d.]+) MiB", runs["square"])
    assert float(line.group(1)) == pytest.approx(4 * 2 * square["params"] / 2**20, abs=0.005)


def test_the_traffic_line_is_what_rank_0_sends_in_a_step(runs):
    """The bytes rank 0 sent in a training step, by group (tests/probe_4d.py counts each collective
    as a ring sends it), against the traffic line's formula: cp's and pp's (with the tied
    matrix's all-reduce) exactly, tp's but for the position embedding's gradient, which sequence
    parallelism all-gathers once per micro-batch (T / cp x C, 1 / B of a stream)."""
    sent = json.loads((runs["dir"] / "nodes" / "rank0.json").read_text())["sent"]
    line = re.search(r"traffic per step, rank 0 \(stage 0, 1 blocks\): tp ([\d.]+) MiB \| cp "
                     r"([\d.]+) MiB \| pp ([\d.]+) MiB", runs["nodes"])
    tp, cp, pp = (float(x) * 2**20 for x in line.groups())
    positions = 2 * 16 * 32 * 4 / 2  # K x T / cp x C x 4 B, of which a rank sends (tp - 1) / tp
    assert sent["cp"] == pytest.approx(cp, abs=0.0006 * 2**20) and sent["cp"] > 0
    assert sent["pp"] + sent["tied"] == pytest.approx(pp, abs=0.0006 * 2**20)
    assert sent["pp"] > 0
    assert sent["tp"] == pytest.approx(tp + positions, abs=0.0012 * 2**20), (sent, tp)


def test_under_bf16_the_traffic_line_counts_the_tied_shard_in_fp32(runs):
    """The 8-process layout's traffic line, computed here: without --amp it is the run's own line,
    its pp the bytes rank 0 sent (recorded: activations, and the tied gradient's shard); under
    --amp bf16 the activations go in bf16, half, but the tied shard is FSDP's fp32 gradient
    whatever the compute dtype, its bytes as recorded (measured once at pp 2 in bf16, 2
    processes: 32,768, the whole matrix in fp32). The control: the activations and the tied
    shard both halved would be 0.004 MiB less."""
    module, sent = trainer(FOURD), record(runs["dir"] / "nodes", 0)["sent"]
    lines = {}
    for amp in ("off", "bf16"):
        args = module.parse_args([*map(str, ONE), "--pp", "2", "--cp", "2", "--tp", "2",
                                  "--amp", amp])
        run = types.SimpleNamespace(args=args, world_size=8,
                                    policy=module.mixed_precision(amp, torch.device("cpu"))[1])
        lines[amp] = module.traffic_line(run, 256)
    assert lines["off"] in runs["nodes"]
    pp = {amp: float(re.search(r"\| pp ([\d.]+) MiB", line).group(1)) * 2**20
          for amp, line in lines.items()}
    assert sent["tied"] == 256 * 32 * 4 / 4  # vocab x C x fp32 / (dp x cp x tp): a shard
    assert pp["off"] == pytest.approx(sent["pp"] + sent["tied"], abs=0.0006 * 2**20)
    assert pp["bf16"] == pytest.approx(sent["pp"] / 2 + sent["tied"], abs=0.0006 * 2**20)
    assert abs(pp["bf16"] - (sent["pp"] + sent["tied"]) / 2) > 0.003 * 2**20


def test_bad_inputs_are_one_line_and_exit_code_2():
    for flags, message in (
            (["--tp", 3, "--n-head", 4], "--tp 3 must divide --n-head 4"),
            (["--pp", 5, "--n-layer", 4], "--pp 5 is more stages than --n-layer 4"),
            (["--cp", 3, "--block-size", 32], "--block-size 32 must be a multiple of 2 x --cp = 6"),
            (["--cp", 2, "--tp", 4, "--n-head", 4, "--block-size", 12],
             "--sequence-parallel on splits a cp rank's 6 tokens in --tp 4 parts")):
        result = as_script(FOURD, [str(x) for x in flags])
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result
        assert message in result.stderr, result.stderr
    module = trainer(FOURD)
    with pytest.raises(module.InputError, match=r"--pp 2 x --cp 2 x --tp 2 = 8 does not divide "
                                                r"the world size 1"):
        in_process(FOURD, SHARDED + ["--max-steps", 1, "--save", "", "--export", ""])
    assert as_script(FOURD, ["--cp", 2, "--tp", 2]).stderr == (
        "error: not launched by torchrun: see the commands at the top of this script\n")
    cmd = command(FOURD, [], nproc=2)  # 2 pp x 2 cp x 2 tp at 2 processes: refused before a group
    result = finish(start(cmd, REPO), cmd)
    line = "error: --pp 2 x --cp 2 x --tp 2 = 8 does not divide the world size 2: start a multiple"
    assert result.returncode != 0 and (result.stdout + result.stderr).count(line) == 1, result


def test_a_context_longer_than_the_data_is_the_data_checks_line_before_the_context(monkeypatch):
    """A --block-size of 10^13 (a context of 80 TB of positions) is refused in load_data's own
    line, before make_run builds the context: without the guard the allocation fails first. Only
    rank 0 says it; the control: a context the data can hold passes the guard."""
    module = trainer(FOURD)
    huge = ["--pp", "1", "--cp", "1", "--tp", "1", "--block-size", str(10**13)]
    line = (r"^the default corpus has 1,800,000 training and 200,000 validation tokens: too few "
            r"for 1 replica\(s\) x --batch-size 6 x --block-size 10000000000000; give more data "
            r"or smaller sizes$")
    with pytest.raises(module.InputError, match=line) as err:
        in_process(FOURD, SHARDED + huge + ["--max-steps", 1, "--save", "", "--export", ""])
    assert err.value.code == 2
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_:  # the other ranks: exit code 2, without a word
        module.refuse_a_context_longer_than_the_data(module.parse_args(huge), 1)
    assert exit_.value.code == 2
    assert module.refuse_a_context_longer_than_the_data(module.parse_args([]), 1) is None


def test_a_tp_or_cp_group_across_nodes_is_named():
    """A tp group across nodes is warned of; cp groups across nodes (tp groups within them, as
    large runs plan) are noted as cp's traffic alone; groups within a node say nothing."""
    warn = trainer(FOURD).avoid_groups_across_nodes
    assert warn(2, 2, 8) is None and warn(8, 1, 8) is None and warn(1, 1, 3) is None
    assert warn(4, 1, 2).startswith("warning: a tp group (--tp 4) spans nodes of 2 processes")
    for tp, cp, node in ((2, 2, 6), (8, 4, 8), (8, 16, 8)):  # cp 4 x tp 8, Llama 3's cp 16 x tp 8
        assert warn(tp, cp, node).startswith(f"note: cp groups (--cp {cp}, ranks {tp} apart) span "
                                             f"nodes of {node} processes"), (tp, cp, node)
        assert "the tp groups do not" in warn(tp, cp, node)


def test_benchmark_scaling_reads_the_4d_trainers_summary(runs):
    row = bench.pace_row(summary(runs["grid"]), 8, 0.0)
    assert row["per_step"] == 6 * 32 * 2 * 2 and row["unit"] == "tokens/s"  # batch x T x K x dp
    assert row["throughput"] == pytest.approx(768 / (row["step_ms"] / 1000), rel=0.01)


def test_the_dropout_streams_and_the_tokens_per_step_go_by_the_right_ranks():
    """The dropout seed's offset: with sequence parallelism each rank its own (cp 2 x tp 2: 0, 1,
    2, 3); without, one per tp pair (0, 0, 1, 1), so a pair drops its copies of one stream alike
    and the cp ranks their different tokens differently. A step's tokens: batch x context x
    micro-batches x dp replicas; the cp and tp ranks of a replica read the same sequences."""
    module = trainer(FOURD)
    for sp, offsets in (("on", [0, 1, 2, 3]), ("off", [0, 0, 1, 1])):
        args = module.parse_args(["--cp", "2", "--tp", "2", "--sequence-parallel", sp])
        ranks = [types.SimpleNamespace(args=args, rank=r, dp_rank=0) for r in range(4)]
        assert [module.dropout_stream(run) for run in ranks] == offsets, sp
    args = module.parse_args(["--batch-size", "6", "--block-size", "32", "--grad-accum", "2",
                              "--cp", "2", "--tp", "2"])
    run = types.SimpleNamespace(args=args, dp_size=3, world_size=24)
    assert module.tokens_per_step(run) == 6 * 32 * 2 * 3


def test_random_streams_come_back_only_at_the_layout_and_sp_that_saved_them(monkeypatch):
    """A checkpoint's RNG states are restored rank by rank only at the pp, cp, tp, sequence
    parallelism and world size that saved them. With sequence parallelism each rank draws its
    own masks; without it a tp pair draws one (its fresh seed, by tp group): a switch either way
    keeps the fresh seeds, as another tp or world size does. The control: the same layout, with
    sequence parallelism or without, restores them."""
    module = trainer(FOURD)
    restored = streams_restored(module, monkeypatch)  # and, with no state to rename:
    monkeypatch.setattr(module, "as_whole_model", lambda run, model, optim_state: [])
    monkeypatch.setattr(module, "as_stage", lambda optim_state, own_names: optim_state)
    layout = {"pp": 1, "cp": 1, "tp": 2}
    for saved_sp, here_sp, here, world, expected in [
            ("on", "on", {}, 2, ["rank 1's"]), ("off", "off", {}, 2, ["rank 1's"]),
            ("on", "off", {}, 2, []), ("off", "on", {}, 2, []),
            ("on", "on", {"tp": 1}, 2, []), ("on", "on", {}, 4, [])]:
        args = types.SimpleNamespace(**{**layout, **here, "sequence_parallel": here_sp})
        run = types.SimpleNamespace(rank=1, world_size=world, device=torch.device("cpu"), args=args)
        state = {"args": {**layout, "sequence_parallel": saved_sp}, "rng": ["rank 0's", "rank 1's"]}
        restored.clear()
        module.load_shards("ck", state, run, None, None)
        assert restored == expected, (saved_sp, here_sp, here, world)


def test_the_memory_line_counts_16_bytes_per_parameter_of_a_ranks_shards():
    """Weights, gradients and AdamW's two moments, fp32: 16 bytes per parameter of the shards."""
    model = types.SimpleNamespace(parameters=lambda: iter([torch.zeros(1)]), whole_params=4096,
                                  parts=[None])  # one stage a rank
    held = [(True, "stage 0", "embeddings, block 0", 65536, 2**20)]
    line = trainer(FOURD).memory_line(model, held)
    assert "stage 0 (embeddings, block 0) 1.00 MiB, 65,536 parameters" in line, line
    assert "(of 4,096; DDP: 0.06 MiB)" in line, line


def test_key_and_value_gradients_are_summed_in_fp32(monkeypatch):
    """Under bf16 the reduce-scatter of dK and dV over the cp group adds in fp32 and rounds once,
    at the end (the control: the gradient that comes in is bf16)."""
    assert_kv_gradients_summed_in_fp32(trainer(FOURD), monkeypatch)


def test_fsdps_policy_computes_in_bf16_and_reduces_in_fp32():
    """FSDP's policy in this chapter: bf16 weights for compute, fp32 gradient reductions."""
    assert_bf16_policy_reduces_in_fp32(trainer(FOURD))
    assert_every_unit_computes_in_bf16_and_reduces_in_fp32(FOURD, SHARDED + ["--pp", 2, "--cp", 1, "--tp", 2])  # read off it


def test_the_planner_predicts_what_each_rank_holds_and_sends(runs):
    """Chapter 13's plan_layout.py, given each run's flags and world size, predicts its memory
    line (each stage's parameters, and what its first rank holds inside a step) and its traffic
    line, rank 0's bytes by group, to the character: at pp 2 x cp 2 x tp 2 and dp 2 x pp 2 x tp 2
    (8 processes), two interleaved stages per rank, tp 2 with dropout, pp 3 over 4 blocks, cp 2 x
    tp 2 (with and without sequence parallelism, bf16), pp 2 x cp 2 recomputed, and pp 2 x tp 2
    in bf16 on a 300-token vocabulary. The control: its lines for dp 2 x pp 2 x tp 2 are not the
    pp 2 x cp 2 x tp 2 run's."""
    def mesh(pp, cp, tp):
        return ["--pp", pp, "--cp", cp, "--tp", tp]
    assert_planned(11, [
        (runs["nodes"], 8, ONE + mesh(2, 2, 2)), (runs["grid"], 8, CLIPPED + mesh(2, 1, 2)),
        (runs["interleaved"], 4, THREE + mesh(2, 1, 2) + ["--schedule", "interleaved-1f1b",
                                                           "--stages-per-rank", 2]),
        (runs["dropout"], 4, NOISY + mesh(1, 1, 2) + ["--sequence-parallel", "off"]),
        (runs["three"], 3, THREE + mesh(3, 1, 1)),
        (runs["square"], 4, ONE + mesh(1, 2, 2) + ["--sequence-parallel", "off"]),
        (runs["sp dropout"], 4, SHARDED + mesh(1, 2, 2) + ["--dropout", 0.1, "--amp", "bf16"]),
        (runs["pipes"], 4, ONE + mesh(2, 2, 1) + ["--schedule", "gpipe", "--grad-checkpointing"]),
        (runs["bf16"], 4, bf16(dropout=False) + ["--batch-size", 12] + mesh(2, 1, 2))],
        other=(8, ONE + mesh(2, 1, 2)))


def test_a_world_of_one_applies_the_schedule_times_training_and_samples_in_eval_mode(
        tmp_path):
    """The warmup and cosine by hand, applied and logged at each step; ms/step leaves out the
    evaluations and saves (a clock the test moves); the closing sample in evaluation mode (no
    dropout); as a world of one with a 1 x 1 x 1 x 1 mesh."""
    assert_a_world_of_one_schedules_times_and_samples_as_it_should(
        FOURD, ["--pp", "1", "--cp", "1", "--tp", "1"], tmp_path)


def test_restore_rng_puts_back_the_cpu_stream_that_run_json_keeps():
    """A resume's random streams are the saved ones: the CPU's state taken by rng_state(), kept as
    run.json keeps it (run_state's lists of bytes), and given to restore_rng after 8 draws makes
    the next 8 draws those 8 again, so dropout after a resume draws the masks the unbroken run
    draws. The control: without restore_rng the next draws are new ones."""
    module, cpu = trainer(FOURD), torch.device("cpu")
    run = types.SimpleNamespace(args=module.parse_args([]))
    before = torch.get_rng_state()
    try:
        torch.manual_seed(1)
        kept = json.loads(module.run_state(run, types.SimpleNamespace(vocab_size=256), 0,
                                           [module.rng_state(cpu)]))["rng"][0]
        assert isinstance(kept["cpu"], list) and kept["cuda"] is None
        drawn = torch.rand(8)
        module.restore_rng(kept, cpu)
        assert torch.equal(torch.rand(8), drawn)
        assert not torch.equal(torch.rand(8), drawn)  # the control: the stream went on
    finally:
        torch.set_rng_state(before)


def test_with_compile_every_block_of_a_ranks_stages_is_compiled_in_place():
    """--compile compiles each block of the rank's stages in place (nn.Module.compile: the module
    keeps its FSDP and TP hooks and the schedule gets the very same object; torch.compile(block)
    would return a wrapper, and the block left eager). Rank 0's model, built at pp 2 x tp 2 in a
    fake world of 4: wrap_model returns the model itself, each block's call compiled. The
    control: without --compile no block is."""
    module = trainer(FOURD)
    flags = [*map(str, SHARDED), "--pp", "2", "--cp", "1", "--tp", "2"]
    model = built_in_a_fake_world(FOURD, flags)[0]
    blocks = list(model.blocks.values())
    assert len(blocks) == 1  # stage 0 of 2 over 2 blocks
    compiled_flags = ["--compile", "--compile-backend", "aot_eager"]
    for compile_, compiled in (([], False), (compiled_flags, True)):
        run = types.SimpleNamespace(args=module.parse_args(flags + compile_))
        assert module.wrap_model(run, model) is model
        assert [b._compiled_call_impl is not None for b in blocks] == [compiled] * len(blocks)


def test_at_tp_4_inside_a_step_the_embeddings_gradient_is_counted_whole():
    """At pp 2 x tp 4 (4 heads; rank 0 of a fake world of 8, no launch), stage 0 holds inside a
    step its weights gathered (TP's quarter of what TP splits, all the rest) and their gradients
    whole (fp32), of which the vocabulary-split embedding's comes back whole on every tp rank:
    the bytes counted here from the stage's shapes, as stage_holding gives them and the memory
    line prints them. At tp 2 the embedding's 1 - 1/tp and 1/tp are one number; at tp 4 the
    control, the embedding's gradient counted as 2/tp of it, is 16 KiB, 0.02 MiB, less."""
    module, tp, v, c, t = trainer(FOURD), 4, 256, 32, 32
    flags = [*map(str, SHARDED), "--pp", "2", "--cp", "1", "--tp", str(tp), "--n-head", "4"]
    model, printed = built_in_a_fake_world(FOURD, flags, world_size=8)
    split = [v * c, 3 * c * c, 3 * c, c * c, 4 * c * c, 4 * c, 4 * c * c]  # tok_emb, qkv, proj
    whole = [t * c, 2 * c, c, 2 * c, c]  # pos_emb, ln1, proj's bias, ln2, mlp.2's bias
    gathered = sum(split) // tp + sum(whole)  # TP's part of block 0 and the embeddings, fp32
    emb = v * c  # its gradient: every row's, where TP holds a quarter of the rows
    expected = 4 * gathered + 4 * (gathered + emb - emb // tp)
    run = types.SimpleNamespace(args=module.parse_args(flags), rank=0, world_size=8,
                                policy=module.mixed_precision("off", torch.device("cpu"))[1])
    assert module.stage_holding(run, model)[4] == expected
    line = re.search(r"inside a step also the weights gathered and the gradients whole: stage 0 "
                     r"([\d.]+) MiB", printed)
    assert line.group(1) == f"{expected / 2**20:.2f}", printed
    assert f"{(expected - 4 * (emb - 2 * emb // tp)) / 2**20:.2f}" != line.group(1)


def traffic(module, flags, world_size):
    """The traffic line of rank 0 at these flags, fp32, as build_model prints it."""
    run = types.SimpleNamespace(args=module.parse_args([*map(str, [*SHARDED, *flags])]),
                                world_size=world_size,
                                policy=module.mixed_precision("off", torch.device("cpu"))[1])
    return module.traffic_line(run, 256)


def test_at_tp_4_the_traffic_line_counts_the_rings_three_quarters():
    """At tp 4 (pp 1, cp 1, 4 heads) each of a step's tp collectives (4 a block, the embedding and
    the head: 10 a micro-batch, 2 micro-batches) moves a stream of B x T x C fp32 twice (an
    all-reduce, or an all-gather and a reduce-scatter), and a ring sends (n - 1) / n of the
    tensor each time: 3/4 at tp 4, as written out here. The control: at tp 2 it is 1/2 of it,
    where (n - 1) / n and 1 / n are one number."""
    module, ops, stream = trainer(FOURD), (4 * 2 + 2) * 2, 6 * 32 * 32 * 4
    for tp, share in ((4, 3 / 4), (2, 1 / 2)):
        line = traffic(module, ["--pp", 1, "--cp", 1, "--tp", tp, "--n-head", 4], tp)
        assert f": tp {2 * ops * stream * share / 2**20:.3f} MiB | cp 0.000 MiB" in line, line
        assert f"(tp: {ops} collectives of {stream / 2**20:.3f} MiB;" in line, line
    assert f"{2 * ops * stream * 3 / 4 / 2**20:.3f}" != f"{2 * ops * stream / 4 / 2**20:.3f}"


def test_at_cp_4_the_traffic_line_counts_the_rings_three_quarters():
    """At cp 4 (pp 1, tp 1) each block gathers the keys and values of the cp group's 4 chunks
    twice a micro-batch (forward, and backward's recompute) and reduce-scatters their fp32
    gradients: each a tensor of cp x 2 x B x T / cp x C, of which a ring sends (n - 1) / n,
    3/4 at cp 4, as written out here. The control: at cp 2 it is 1/2, where (n - 1) / n and one
    chunk's worth are one number."""
    module, blocks, k = trainer(FOURD), 2, 2
    for cp, share in ((4, 3 / 4), (2, 1 / 2)):
        gathered = cp * 2 * 6 * (32 // cp) * 32 * 4  # K and V of every chunk, fp32
        sent = blocks * k * share * gathered * (2 + 1)  # 2 gathers, 1 reduce-scatter (fp32)
        line = traffic(module, ["--pp", 1, "--cp", cp, "--tp", 1], cp)
        assert f"| cp {sent / 2**20:.3f} MiB | pp 0.000 MiB" in line, (cp, line)
        one_chunk = blocks * k * gathered / cp * (2 + 1)  # what (n - 1) / n is not, but at cp 2
        assert (f"{one_chunk / 2**20:.3f}" == f"{sent / 2**20:.3f}") == (cp == 2), cp


def test_mfu_counts_the_whole_gpts_flops_per_token_on_a_stage():
    """MFU's FLOPs per token are the whole GPT's (nanoGPT's 6 per parameter, the position
    embeddings aside, plus attention's 12 x layers x width x context), written out here from
    helpers.gpt_shapes, whichever stage a rank holds: rank 0's model at pp 2 (a fake world of 2)
    gives them. The control: the stage's own parameters are fewer, so counting them would put MFU
    low by about 1 / pp."""
    module = trainer(FOURD)
    flags = [*map(str, SHARDED), "--pp", "2", "--cp", "1", "--tp", "1"]
    model = built_in_a_fake_world(FOURD, flags, world_size=2)[0]
    n = sum(math.prod(shape) for shape in gpt_shapes()) - 32 * 32  # the GPT's, positions aside
    flops = 6 * n + 12 * 2 * 32 * 32  # attention: layers x width x context
    assert module.flops_per_token(model, module.parse_args(flags)) == flops
    block = 12 * 32 * 32 + 13 * 32  # qkv, proj and the MLP's weights and biases, two norms
    stage = sum(p.numel() for p in model.parameters())  # the control: the embeddings, block 0
    assert stage == 256 * 32 + 32 * 32 + block < n, (stage, n)


def test_a_stage_sends_a_tp_share_of_its_tokens_only_under_sequence_parallelism():
    """What a stage sends on for a micro-batch's ids (B, T / cp): with sequence parallelism each
    tp rank holds T / cp / tp of the tokens, so (B, T / cp / tp, C); without it every tp rank
    holds them all, (B, T / cp, C), and a receive buffer of the SP share would be tp times too
    small. The control: the two differ at tp 2; at tp 1 they are one shape."""
    module = trainer(FOURD)
    for tp, sp, expected in ((2, "on", (6, 8, 32)), (2, "off", (6, 16, 32)),
                             (1, "on", (6, 16, 32)), (1, "off", (6, 16, 32))):
        args = module.parse_args([*map(str, SHARDED), "--tp", str(tp), "--sequence-parallel", sp])
        run = types.SimpleNamespace(args=args)
        assert module.stream_shape(run, (6, 32 // 2)) == expected, (tp, sp)
