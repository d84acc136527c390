"""Chapter 9, train_pp_minigpt.py (pipeline parallelism, FSDP over each stage's dp ranks), under
real torchrun launches on CPU/gloo. These tests prove:

1. the same math as one process: at the same seed, data and flags (gradient norms above --clip, so
   clipping binds), --pp 2 at 2 processes logs chapter 3's one-process losses, gradient norms and
   validation losses for the same global batch (1e-5 relative), under 1F1B (18 steps, two nodes of
   one stage each through chapter 4's launcher); GPipe at --pp 3 (a middle stage) logs them too
   (13 steps through two resumes), and its greedy sample after training is chapter 3's text;
   dp 2 x pp 2 at 4 processes logs the losses and gradient norms of 2 DDP processes; the gradient
   norm is the global one (across the stages and the shards: each stage alone has a smaller one);
   with dropout, --pp 1 under --grad-checkpointing draws one process's masks (recomputation
   draws them again), and at dp 2 x pp 2 every rank draws its own; the dp 2 x pp 2 export holds
   chapter 3's names and whole shapes, and chapter 3 samples from it;
   three ranks of two interleaved stages each (6 blocks) evaluate and sample as one process, each
   forward going round the ranks twice;
2. the stages: the blocks are cut into contiguous runs that cover them once (any --n-layer and
   --pp); a column's stages read the same windows, the columns different ones, and column j reads
   what DDP's rank j reads; each stage holds its part of the model (the parameters add up to the
   whole plus the tied matrix's second copy);
3. the tied embedding and head: after training on two stages the exported copies are equal, and
   equal to chapter 3's one matrix (the copies would drift apart without the summed gradients, and
   the losses would leave chapter 3's if either half's gradient were missing);
4. checkpoints know no layout: the dp 2 x pp 2 checkpoint resumes at --pp 1 in this script and in
   chapter 7, each with the next losses of the uninterrupted DDP run; chapter 7's checkpoint resumes
   at --pp 1, whose checkpoint resumes at --pp 3; a stage SIGKILLed under
   `torchrun --max-restarts=1` is restarted and
   `--resume auto` goes on from its last step with the killed run's losses; the export samples in
   chapter 3;
5. what each stage holds and sends (measured by tests/probe_pp.py): at 4 micro-batches 1F1B's
   stage 0 holds 2 micro-batches' activations for backward and GPipe's 4, nothing more; the last
   stage keeps no logits after a step; FSDP reduce-scatters and all-gathers once per group and
   step, with --compile too (blocks compiled in place) and by default (--reshard-after-forward
   no); the traffic line counts the activations per micro-batch; the memory line's parameters
   per stage are replica 0's, as the test counts them from the model's shapes at six layouts
   (pp 2, dp 2 x pp 2, pp 3, two and three ranks of two interleaved stages, a 300-token
   vocabulary);
6. bad input is one line and exit code 2: a --pp that does not divide the world size, more stages
   than blocks, fewer micro-batches than stages under 1F1B, an unknown schedule;
7. benchmark_scaling.py reads its summary: the global batch counts the dp columns, not the ranks;
8. a run as a GPU user starts one: --pp 2 under --amp bf16, --grad-checkpointing, --compile
   (aot_eager), --reshard-after-forward yes, on a file of token ids (--data, --vocab-size,
   --val-fraction), logs chapter 3's one-process bf16 numbers within bf16's rounding, and the
   data and parameter lines the test computes; the clipped runs set --weight-decay,
   --dist-timeout and --amp off too.
The schedule and the clock, in this process as a world of one: each step applies and logs
the warmup and cosine worked out by hand, and ms/step leaves out evaluation and saving (the
test moves the clock: 1 s a step, 100 s an evaluation or a save); with dropout, the closing
sample runs every module in evaluation mode.
"""
import importlib
import json
import re
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
from helpers import VOCAB, assert_planned, first_rank_share, gpt_shapes, streams_restored
from helpers import (GPT, NEEDS_PP, REPO, SHARDED, TINY_GPT, as_script, command, ddp_reference,
                     finish, in_process, needs_torch, ok, one_process_reference, start,
                     start_two_nodes, summary, trainer)

import benchmark_scaling as bench  # noqa: E402  (the repository is on sys.path: helpers)

pytestmark = needs_torch(*NEEDS_PP)
PP, FSDP = "train_pp_minigpt.py", "train_fsdp_minigpt.py"


pp = trainer(PP)
# SHARDED's run (2 DDP processes of batch 6, 2 micro-batches: 24 sequences a step) as 2 stages of
# one column: 4 micro-batches of 6, so that 1F1B (2 held on stage 0) and GPipe (4) differ
COLUMN = SHARDED + ["--grad-accum", 4, "--pp", 2]
# three blocks for three stages, 4 micro-batches of 3 a step (12 sequences) in every run that uses
# it, clipped at 0.5 so that clipping binds at every step
THREE = SHARDED + ["--n-layer", 3, "--batch-size", 3, "--grad-accum", 4, "--clip", 0.5]
# four blocks for two ranks of two interleaved stages each, 4 micro-batches of 3 a step, and 13
# validation windows (5 batches of 3, the last one short)
FOUR = SHARDED + ["--n-layer", 4, "--batch-size", 3, "--grad-accum", 4, "--eval-windows", 13,
                  "--eval-every", 4]
INTERLEAVED = ["--pp", 2, "--schedule", "interleaved-1f1b", "--stages-per-rank", 2]
# six blocks, 3 micro-batches of 2 a step, one step, 7 validation windows, a greedy sample
SIX = SHARDED + ["--n-layer", 6, "--batch-size", 2, "--grad-accum", 3, "--max-steps", 1,
                 "--eval-every", 1, "--eval-windows", 7, "--save", "", "--top-k", 1,
                 "--max-new-tokens", 16]



CONTRACT = {  # tests/README.md, "One proof for every GPT chapter"; None: not held yet
    "reference": ["test_pp2_at_2_processes_computes_what_one_process_computes",
                  "test_dp2_x_pp2_at_4_processes_computes_what_ddp_computes",
                  "test_gpipe_at_three_stages_computes_what_one_process_computes_and_resumes_"
                  "anywhere"],
    "norms": ["test_dp2_x_pp2_logs_one_processs_norms_about_a_binding_clip_and_padded_validation"],
    "padded": ["test_dp2_x_pp2_logs_one_processs_norms_about_a_binding_clip_and_padded_validation"],
    "dropout": ["test_dropout_in_the_pipeline_draws_what_one_process_draws",
                "test_dropout_draws_its_own_masks_on_every_rank_of_dp2_x_pp2"],
    "collectives": ["test_compiled_or_not_fsdp_gathers_and_reduces_once_per_group_and_step"],
    "policy": ["test_fsdps_policy_computes_in_bf16_and_reduces_in_fp32"],
    "resume": ["test_the_grid_checkpoint_resumes_at_one_process_here_and_in_chapter_7",
               "test_gpipe_at_three_stages_computes_what_one_process_computes_and_resumes_"
               "anywhere"],
    "bf16": ["test_bf16_compiled_at_pp2_logs_one_processs_bf16_numbers"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's launches, side by side: 1F1B at --pp 2 for 18 steps on two nodes through the
    launcher (`nodes`); dp 2 x pp 2 for 10 steps, saved, FSDP's calls counted (`grid`); GPipe at
    --pp 3 (three blocks, `THREE`) from a step-10 checkpoint of this trainer at --pp 1, which
    itself went on from chapter 7's step 5, its middle stage killed in the save of step 14 and restarted
    (`restarted`); chapter 3 at 2 processes (ddp_reference) and at 1 (one_process_reference), for
    18 steps, and at 1 with THREE for 18 steps (`one of three`)."""
    d = tmp_path_factory.mktemp("pp")
    for name in ("nodes", "restarted", "counted", "dropout"):
        (d / name).mkdir()
    grid_cmd = command("tests/probe_pp.py", ["record", d / "counted", *SHARDED, "--pp", 2,
                                             "--max-steps", 10, "--debug", "--save", d / "grid",
                                             "--export", d / "grid.pt"], nproc=4)
    grid = start(grid_cmd, REPO)
    dropout_cmd = command("tests/probe_pp.py", ["record", d / "dropout", *SHARDED, "--pp", 2,
                                                "--dropout", 0.1, "--schedule", "gpipe",
                                                "--grad-checkpointing", "--amp", "bf16",
                                                "--max-steps", 2,
                                                "--save", "", "--export", ""], nproc=4)
    dropout = start(dropout_cmd, REPO)
    nodes = start_two_nodes("tests/probe_pp.py", ["record", d / "nodes", *COLUMN, "--max-steps",
                                                   18, "--save", "", "--export", d / "pp.pt"])
    # chapter 7 to step 3 with FOUR, from which two ranks of interleaved stages go on to step 8
    in_process(FSDP, FOUR + ["--max-steps", 3, "--save", d / "ch7four", "--export", ""])
    (d / "il").mkdir()
    interleaved_cmd = command("tests/probe_pp.py", [
        "record", d / "il", *FOUR, *INTERLEAVED, "--grad-checkpointing", "--max-steps", 8,
        "--resume", d / "ch7four",
        "--save", d / "il" / "ck", "--export", d / "il.pt", "--top-k", 1, "--max-new-tokens", 16],
        nproc=2)
    interleaved = start(interleaved_cmd, REPO)
    # meanwhile, in this process: chapter 7 to step 5, then this trainer at --pp 1 to step 10
    ck = d / "restarted" / "ck"
    in_process(FSDP, THREE + ["--max-steps", 5, "--save", d / "ch7", "--export", ""])
    one_stage = in_process(PP, THREE + ["--pp", 1, "--max-steps", 10, "--resume", d / "ch7",
                                        "--save", ck, "--export", ""])
    restart_cmd = command("tests/probe_pp.py",
                          ["killsave", "shards@14:1", d / "restarted", *THREE, "--pp", 3,
                           "--schedule", "gpipe", "--max-steps", 18, "--save-every", 2, "--save", ck, "--resume",
                           "auto", "--export", d / "three.pt", "--top-k", 1, "--max-new-tokens",
                           16], nproc=3, torchrun_args=["--max-restarts=1"])
    restarted = start(restart_cmd, REPO, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})  # #135712
    ddp, ddp_ckpt, ddp_records = ddp_reference()
    one, one_ckpt = one_process_reference()
    one_of_three = in_process(GPT, THREE + ["--max-steps", 18, "--save", ""])  # chapter 3
    r = {"ddp": ddp, "ddp_records": ddp_records, "one": one, "one.pt": one_ckpt, "dir": d,
         "grid": ok(finish(grid, grid_cmd)), "restarted": finish(restarted, restart_cmd),
         "one stage": one_stage, "one of three": one_of_three,
         "dropout": ok(finish(dropout, dropout_cmd)),
         "one of four": in_process(GPT, FOUR + ["--max-steps", 8, "--save", ""]),
         "interleaved": ok(finish(interleaved, interleaved_cmd))}
    outs = [out for out in nodes() if "world size 2 " in out]  # rank 0's node logs
    assert len(outs) == 1
    r["nodes"] = outs[0]
    cmd = command(PP, CLIPPED + ["--pp", 2, "--export", ""], nproc=4)
    proc = start(cmd, REPO)
    bf16_cmd = command(PP, [*bf16(dropout=False), "--batch-size", 12, "--pp", 2,
                            "--reshard-after-forward", "yes", "--compile", "--compile-backend",
                            "aot_eager", "--export", ""], nproc=2)
    bf16_proc = start(bf16_cmd, REPO)
    # three ranks of two interleaved stages each: 6 blocks, a step, evaluated and sampled
    six_cmd = command(PP, SIX + ["--pp", 3, "--schedule", "interleaved-1f1b",
                                 "--stages-per-rank", 2, "--export", ""], nproc=3)
    six = start(six_cmd, REPO)
    one_process_clipped()  # meanwhile: the same global batch in this process
    one_process_bf16(dropout=False), one_process_bf16()
    r["one of six"] = in_process(GPT, SIX)  # chapter 3
    r["clipped"] = ok(finish(proc, cmd))
    r["six"] = ok(finish(six, six_cmd))
    r["bf16"] = ok(finish(bf16_proc, bf16_cmd))
    return r


def test_dp2_x_pp2_logs_one_processs_norms_about_a_binding_clip_and_padded_validation(runs):
    """dp 2 x pp 2 with --clip 2.0 and 13 validation windows (7 and 6 on the two replicas: one
    padded batch) logs chapter 3's one process at the same global batch: its losses, its gradient
    norms before clipping in the steps where the clip binds (1 and 2) and where it does not (3 and
    4, the control), and its validation losses."""
    assert "(2 pp x 2 dp)" in runs["clipped"]
    assert_clipped_run_is_one_processs(runs["clipped"])


def test_pp2_at_2_processes_computes_what_one_process_computes(runs):
    """1F1B over two nodes of one stage each equals chapter 3 in one process with the same global
    batch (24 sequences a step), clipping that binds, the norm of the whole model, and the
    validation loss (each token counted once, by the last stage)."""
    one, out = runs["one"], runs["nodes"]
    assert "world size 2 (2 pp x 1 dp) |" in out and "| schedule 1f1b" in out
    assert sorted(losses(out)) == list(range(1, 19)) and losses(out)[18] < losses(out)[1]
    for step, loss in losses(out).items():
        assert loss == pytest.approx(losses(one)[step], rel=1e-5), step
    for step, norm in grad_norms(out).items():  # above --clip 1.0: clipping binds
        assert norm > 1.0 and norm == pytest.approx(grad_norms(one)[step], abs=2e-3), step
    assert sorted(val_losses(out)) == [0, 18]  # before training, and after: the last stage's sums
    for step, loss in val_losses(out).items():
        assert loss == pytest.approx(val_losses(one)[step], abs=2e-4), step


def test_interleaved_stages_compute_what_one_process_computes_from_chapter_7s_checkpoint(runs):
    """Two ranks of two interleaved stages each (rank 0: stages 0 and 2, blocks 0 and 2; rank 1:
    blocks 1 and 3 and the head) go on from chapter 7's step-3 checkpoint and log chapter 3's
    one-process steps 4-8 at the same global batch: losses, gradient norms where the clip binds,
    and the validation loss over 13 windows (a short last batch). Inside a step each rank holds
    what the memory line says for its two stages (measured before each reduce-scatter; at pp 2
    and 2 rounds of 2 micro-batches the two stages' gradients overlap). Their checkpoint of step
    8 and the export carry the whole model's names; the greedy sample after training, each token
    a forward that goes round the two ranks twice, is chapter 3's text from the export. Under
    --grad-checkpointing both of rank 0's stages recompute their blocks: at most its 2 blocks'
    inputs for each of the 4 micro-batches are saved at once (B x T x C fp32 each, half as much
    again allowed for the rest), where a stage left unrecomputed saves every block's activations
    (876,480 bytes measured by a reviewer, against 105,664)."""
    out, one = runs["interleaved"], runs["one of four"]
    assert "world size 2 (2 pp x 1 dp) |" in out
    assert "| schedule interleaved-1f1b, 2 stages per rank" in out
    assert "stages 0, 2 (embeddings, blocks 0, 2)" in out  # not neighbours: interleaved
    assert "stages 1, 3 (blocks 1, 3, final norm and head)" in out
    mib = 2 * 3 * 32 * 32 * 4 / 2**20  # a micro-batch's activations (B, T, C), fp32, sent twice
    assert f"PP traffic per rank: {mib:.2f} MiB of activations to the next stage" in out
    assert "between stage 0 and stage 3; rank 0 sends one gradient fewer" in out
    line = re.search(r"inside a step also the weights gathered and the gradients whole: "
                     r"stages 0, 2 ([\d.]+) MiB, stages 1, 3 ([\d.]+) MiB", out)
    for rank in range(2):  # each rank's two stages, both gathered, both with whole gradients
        seen = json.loads((runs["dir"] / "il" / f"rank{rank}.json").read_text())
        assert seen["in_step_bytes"] / 2**20 == pytest.approx(float(line.group(1 + rank)),
                                                              abs=0.005), rank
    assert f"resumed from {runs['dir'] / 'ch7four' / 'step-000003'} at step 3" in out
    assert sorted(losses(out)) == list(range(4, 9))
    for step, loss in losses(out).items():
        assert loss == pytest.approx(losses(one)[step], rel=1e-5), step
        assert grad_norms(out)[step] == pytest.approx(grad_norms(one)[step], abs=2e-3), step
    assert min(grad_norms(out).values()) > 1.0  # above --clip 1.0: clipping binds every step
    assert sorted(val_losses(out)) == [3, 4, 8]
    for step in (4, 8):
        assert val_losses(out)[step] == pytest.approx(val_losses(one)[step], abs=2e-4), step
    assert val_losses(out)[8] != pytest.approx(val_losses(out)[4], abs=1e-3)  # a control
    assert (runs["dir"] / "il" / "ck" / "step-000008" / ".metadata").exists()
    saved = json.loads((runs["dir"] / "il" / "rank0.json").read_text())["peak_saved_bytes"]
    assert 0 < saved < 1.5 * 2 * 4 * (3 * 32 * 32 * 4), saved
    sampled = in_process(GPT, ["--sample", "--ckpt", runs["dir"] / "il.pt", "--prompt", "\n",
                               "--top-k", 1, "--max-new-tokens", 16])
    assert len(sampled) > 10 and out.split("sample:\n", 1)[1] == sampled, (out, sampled)


def test_three_ranks_of_interleaved_stages_evaluate_and_sample_as_one_process(runs):
    """At --pp 3 with two stages a rank (6 blocks), each forward of evaluation and sampling goes
    round the three ranks twice, each rank receiving from the one before it in the ring (rank 0
    from rank 2): the step's loss, the validation losses before and after it, and the greedy
    sample (16 tokens, each a forward round the ranks) are chapter 3's in one process at the same
    global batch."""
    out, one = runs["six"], runs["one of six"]
    assert "world size 3 (3 pp x 1 dp) |" in out and "stages 0, 3 (embeddings, blocks 0, 3)" in out
    assert losses(out)[1] == pytest.approx(losses(one)[1], rel=1e-5)
    assert sorted(val_losses(out)) == [0, 1]
    assert val_losses(out) == pytest.approx(val_losses(one), abs=2e-4)
    assert val_losses(out)[1] != pytest.approx(val_losses(out)[0], abs=1e-3)  # a control
    assert out.split("sample:\n", 1)[1] == one.split("sample:\n", 1)[1], (out, one)


def test_gpipe_at_three_stages_computes_what_one_process_computes_and_resumes_anywhere(runs):
    """GPipe at --pp 3 (its middle stage receives, runs its block and sends on: no loss, no tied
    copy) logs chapter 3's one-process steps 11-18, gradient norms and validation loss. It went
    on from this trainer's --pp 1 checkpoint of step 10 (another pipeline layout), which went on
    from chapter 7's of step 5, each with one process's losses. Its middle stage, SIGKILLed as
    it writes its shards of step 14, is restarted with the others by torchrun, and `--resume auto`
    goes on from step 12 with the killed run's own step-13 and 14 losses, to the printed digit. Its sample after
    training (greedy, --top-k 1: no draw is random) is the text chapter 3 generates from the
    exported weights."""
    result, ck, one = runs["restarted"], runs["dir"] / "restarted" / "ck", runs["one of three"]
    out = ok(result)
    assert "world size 3 (3 pp x 1 dp)" in out and "stage 1 (block 1)" in out
    assert "| schedule gpipe" in out and "failed (exitcode: -9) local_rank: 1" in result.stderr
    first, _, second = out.partition(f"resumed from {ck / 'step-000012'} at step 12")
    assert f"resumed from {ck / 'step-000010'} at step 10" in first  # the --pp 1 checkpoint
    assert sorted(losses(first)) == [11, 12, 13, 14] and sorted(losses(second)) == list(range(13, 19))
    assert losses(second)[13] == losses(first)[13] and losses(second)[14] == losses(first)[14]
    [killed] = kills(ck)  # between the shards: step 12 complete, step 14 a partial folder
    assert killed["moment"] == "shards" and "step-000012" in killed["held"]
    assert ".metadata" not in killed["held"]["partial-step-000014"]
    one_stage = runs["one stage"]
    assert f"resumed from {runs['dir'] / 'ch7' / 'step-000005'} at step 5" in one_stage
    logged = {**losses(one_stage), **losses(first), **losses(second)}
    norms = {**grad_norms(one_stage), **grad_norms(first), **grad_norms(second)}
    assert sorted(logged) == list(range(6, 19))
    for step, loss in logged.items():  # resumed twice, from other layouts' shards
        assert loss == pytest.approx(losses(one)[step], rel=1e-4), step
        assert norms[step] > 0.5 and norms[step] == pytest.approx(grad_norms(one)[step], abs=2e-3)
    assert val_losses(second)[18] == pytest.approx(val_losses(one)[18], abs=2e-4)
    sampled = in_process(GPT, ["--sample", "--ckpt", runs["dir"] / "three.pt", "--prompt", "\n",
                               "--top-k", 1, "--max-new-tokens", 16])
    assert len(sampled) > 10 and second.split("sample:\n", 1)[1] == sampled, (second, sampled)


def test_dp2_x_pp2_at_4_processes_computes_what_ddp_computes(runs):
    grid, ddp = runs["grid"], runs["ddp"]
    assert "world size 4 (2 pp x 2 dp) |" in grid
    assert sorted(losses(grid)) == list(range(1, 11))
    for step, loss in losses(grid).items():
        assert loss == pytest.approx(losses(ddp)[step], rel=1e-5), step
    for step, norm in grad_norms(grid).items():  # the norm over both stages and both shards
        assert norm > 1.0 and norm == pytest.approx(grad_norms(ddp)[step], abs=2e-3), step


def test_a_column_reads_one_batch_and_column_j_reads_what_ddp_rank_j_reads(runs):
    windows = dict(re.findall(r"^\[rank (\d)\] stage \d, replica \d: \d+ micro-batches per "
                              r"epoch, first windows at tokens (\[[\d, ]+\])$", runs["grid"], re.M))
    ddp = dict(re.findall(r"^\[rank (\d)\] \d+ micro-batches per epoch, first windows at tokens "
                          r"(\[[\d, ]+\])$", runs["ddp"], re.M))
    assert "[rank 2] stage 1, replica 0:" in runs["grid"]  # a stage is consecutive ranks
    assert windows["0"] == windows["2"] == ddp["0"] and windows["1"] == windows["3"] == ddp["1"]
    assert windows["0"] != windows["1"]


def test_the_stages_cut_the_blocks_once_in_order():
    """Every block once, in order, runs at most one block apart; the longer runs on the later
    stages, away from stage 0 (the embeddings, and 1F1B's most micro-batches in flight)."""
    for n_layer in range(1, 9):
        for stages in range(1, n_layer + 1):
            cut = [list(pp.stage_blocks(n_layer, stages, s)) for s in range(stages)]
            assert sum(cut, []) == list(range(n_layer)), cut  # in order, each block once
            assert all(cut) and max(map(len, cut)) - min(map(len, cut)) <= 1, cut
            assert [len(run) for run in cut] == sorted(len(run) for run in cut), cut
    assert [list(pp.stage_blocks(5, 2, s)) for s in (0, 1)] == [[0, 1], [2, 3, 4]]


def test_each_stage_holds_its_part_and_the_traffic_line_counts_activations(runs):
    model = trainer(GPT).GPT(256, 32, 2, 2, 32, 0.0)
    whole, tied = sum(p.numel() for p in model.parameters()), model.head.weight.numel()
    held = re.search(r"stage 0 \(embeddings, block 0\) [\d.]+ MiB, ([\d,]+) parameters; stage 1 "
                     r"\(block 1, final norm and head\) [\d.]+ MiB, ([\d,]+) parameters \(of "
                     r"([\d,]+);", runs["nodes"])
    first, last, total = (int(n.replace(",", "")) for n in held.groups())
    assert total == whole and first + last == whole + tied  # no block twice, the head a copy
    mib = 6 * 32 * 32 * 4 / 2**20  # a micro-batch's activations: batch x context x width, fp32
    assert (f"PP traffic per rank: {mib:.2f} MiB of activations to the next stage and {mib:.2f} "
            f"MiB of their gradients back, per micro-batch (4 per step)") in runs["nodes"]


def counted_stages(stages, vocab=256, dp=1):
    """The memory line's stages, counted here from the model's shapes (helpers.gpt_shapes):
    `stages` is (label, parts, blocks) for each rank of replica 0; a stage with the embeddings
    holds the tied matrix and the positions, one with the head the final norm and its own copy
    of the tied matrix; each of its blocks 12 tensors. Replica 0's share at dp replicas."""
    layers = sum(len(blocks) for _, _, blocks in stages)
    shapes = gpt_shapes(vocab=vocab, layers=layers)
    words = []
    for label, parts, blocks in stages:
        held = [*shapes[:2] * parts.startswith("embeddings"),
                *(shape for i in blocks for shape in shapes[2 + 12 * i:14 + 12 * i]),
                *(shapes[-2:] + shapes[:1]) * parts.endswith("head")]
        n = first_rank_share(held, dp)
        words.append(f"{label} ({parts}) {16 * n / 2**20:.2f} MiB, {n:,} parameters")
    whole = first_rank_share(shapes, 1)
    return f"{'; '.join(words)} (of {whole:,}; DDP: {16 * whole / 2**20:.2f} MiB)"


def test_the_memory_line_holds_each_stages_parameters_as_the_test_counts_them(runs):
    """What the memory line gives for each stage of replica 0, counted from the model's shapes at
    six layouts: pp 2 (two nodes), dp 2 x pp 2 (replica 0's half of each stage), pp 3 over 3
    blocks, 2 ranks of two interleaved stages over 4 blocks, 3 ranks of two over 6, and pp 2 on
    the bf16 run's 300-token vocabulary. The control: the grid's line is not the one-replica
    count of its stages."""
    first, last = "embeddings, block 0", "block 1, final norm and head"
    pp2 = [("stage 0", first, [0]), ("stage 1", last, [1])]
    for name, stages, vocab, dp in [
            ("nodes", pp2, 256, 1), ("grid", pp2, 256, 2), ("bf16", pp2, VOCAB, 1),
            ("restarted", [("stage 0", first, [0]), ("stage 1", "block 1", [1]),
                           ("stage 2", "block 2, final norm and head", [2])], 256, 1),
            ("interleaved", [("stages 0, 2", "embeddings, blocks 0, 2", [0, 2]),
                             ("stages 1, 3", "blocks 1, 3, final norm and head", [1, 3])], 256, 1),
            ("six", [("stages 0, 3", "embeddings, blocks 0, 3", [0, 3]),
                     ("stages 1, 4", "blocks 1, 4", [1, 4]),
                     ("stages 2, 5", "blocks 2, 5, final norm and head", [2, 5])], 256, 1)]:
        out = runs[name].stdout if name == "restarted" else runs[name]
        said = f"weights, gradients and AdamW state: {counted_stages(stages, vocab, dp)}; inside"
        assert said in out, (name, out)
    assert counted_stages(pp2, dp=1) not in runs["grid"]


def test_1f1b_holds_two_micro_batches_gpipe_four_and_the_last_stage_keeps_no_logits(runs):
    """At 4 micro-batches, GPipe's stage 0 (of 3) holds all 4 micro-batches' activations before
    its first backward; 1F1B's (of 2) holds 2 (its warm-up forward and one more), nothing else
    (the stages' shapes are given, so no forward runs to infer them and leaves its tensors); the
    last stage keeps no micro-batch's logits once a step is over (return_outputs=False)."""
    held = {}
    for schedule, name in (("1f1b", "nodes"), ("gpipe", "restarted")):
        seen = json.loads((runs["dir"] / name / "rank0.json").read_text())
        assert seen["stage"] == 0 and seen["micro_batch_saved_bytes"] > 0
        held[schedule] = seen["peak_saved_bytes"] / seen["micro_batch_saved_bytes"]
    assert 1.95 <= held["1f1b"] <= 2.05 and 3.9 <= held["gpipe"] <= 4.05, held
    for name, rank in (("nodes", 1), ("restarted", 2)):  # the last stages
        last = json.loads((runs["dir"] / name / f"rank{rank}.json").read_text())
        assert last["stage"] == rank and last["steps"] > 0 and last["kept_outputs"] == 0, last


def test_inside_a_step_a_rank_holds_its_stage_gathered_and_its_gradients_whole(runs):
    """Under the schedule a rank holds, from the first micro-batch to the last backward, its
    stage's weights gathered (the compute dtype) and its gradients whole (fp32): measured just
    before each stage reduce-scatters (tests/probe_pp.py), the bytes the memory line gives for
    each stage, in fp32 (dp 2 x pp 2) and under bf16 (6 bytes a parameter, not 8: the control)."""
    held = {}
    for name, folder in (("grid", "counted"), ("dropout", "dropout")):
        line = re.search(r"inside a step also the weights gathered and the gradients whole: "
                         r"stage 0 ([\d.]+) MiB, stage 1 ([\d.]+) MiB", runs[name])
        for rank in range(4):
            seen = json.loads((runs["dir"] / folder / f"rank{rank}.json").read_text())
            mib = float(line.group(1 + seen["stage"]))
            assert seen["in_step_bytes"] / 2**20 == pytest.approx(mib, abs=0.005), (name, rank)
            held[name, seen["stage"]] = seen["in_step_bytes"]
    assert held["dropout", 0] * 8 == held["grid", 0] * 6 and held["grid", 0] > 0, held


def test_recomputation_keeps_a_micro_batch_to_its_blocks_inputs(runs):
    """--grad-checkpointing (the bf16 dropout run) leaves a micro-batch's forward holding its
    blocks' inputs alone: stage 0 saves under a quarter of what it saves without (the fp32 dp 2 x
    pp 2 run, same model and batch; bf16 alone would halve it)."""
    held = [json.loads((runs["dir"] / name / "rank0.json").read_text())["micro_batch_saved_bytes"]
            for name in ("dropout", "counted")]
    assert 0 < 4 * held[0] < held[1], held


def test_the_traffic_line_gives_the_tied_all_reduce_that_the_end_stages_send(runs):
    """At dp 2 x pp 2 each end stage all-reduces its shard of the tied gradient once a step: the
    bytes recorded (tests/probe_pp.py, 10 steps) are the traffic line's per step: the shard of
    the matrix's 32,768 fp32 bytes that FSDP leaves each of the 2 replicas, not the whole."""
    line = re.search(r"the tied matrix: an all-reduce of ([\d.]+) MiB per step", runs["grid"])
    for rank in range(4):
        seen = json.loads((runs["dir"] / "counted" / f"rank{rank}.json").read_text())
        assert seen["tied_bytes"] == 10 * 256 * 32 * 4 / 2, (rank, seen)  # vocab x C x fp32 / dp
        assert float(line.group(1)) == pytest.approx(seen["tied_bytes"] / 10 / 2**20, abs=0.005)


def test_compiled_or_not_fsdp_gathers_and_reduces_once_per_group_and_step(runs, monkeypatch):
    """FSDP's reduce-scatters and all-gathers inside the training steps: one of each per FSDP group
    (each block, and the stage's root) and step, counted on every rank of dp 2 x pp 2 (2
    micro-batches a step; tests/probe_pp.py) with --reshard-after-forward no, the default here
    (yes, the default before, all-gathers every block for every micro-batch). With --compile the
    blocks are compiled in place, so the schedule still sees an FSDP module and FSDP reduces the
    step's gradients once: counted in this process (FSDP's own foreach_reduce, which runs at one
    rank too) at 4 micro-batches a step, with and without --compile; a compiled stage was no FSDP
    module and reduced every micro-batch's."""
    assert pp.parse_args([]).reshard_after_forward == "no"
    for rank in range(4):
        seen = json.loads((runs["dir"] / "counted" / f"rank{rank}.json").read_text())
        assert seen["steps"] == 10, seen
        assert seen["reduce_scatters"] == seen["all_gathers"] == 2 * 10, seen  # 2 groups a stage
    reduced, fsdp = [], importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param_group")
    reduce, step = fsdp.foreach_reduce, pp.train_step

    def counted_reduce(*args, **kwargs):
        reduced[-1] += 1
        return reduce(*args, **kwargs)

    def counted_step(*args):
        reduced.append(0)  # the reductions of this step
        return step(*args)
    monkeypatch.setattr(fsdp, "foreach_reduce", counted_reduce)
    monkeypatch.setattr(pp, "train_step", counted_step)
    flags = TINY_GPT + ["--pp", 1, "--batch-size", 3, "--grad-accum", 4, "--max-steps", 2,
                        "--eval-windows", 6, "--save", "", "--export", "", "--max-new-tokens", 1]
    for compiled in ([], ["--compile", "--compile-backend", "eager"]):
        reduced.clear()
        in_process(PP, flags + compiled)
        assert reduced == [3, 3], (compiled, reduced)  # 2 blocks and the root, once a step


def test_dropout_draws_its_own_masks_on_every_rank_of_dp2_x_pp2(runs):
    """With --dropout 0.1 at dp 2 x pp 2 (tests/probe_pp.py records each rank's first mask, of one
    shape on every stage) the four masks all differ: the two replicas of a stage drop other units
    of other data, and the two stages of a column draw from seeds of their own. That run, under
    GPipe with its blocks recomputed in backward, makes FSDP's calls of the default run: one
    reduce-scatter and one all-gather per group and step (recomputing gathers nothing more). It
    runs in bf16, whose activations cross between the stages in bf16: its losses are finite."""
    out = runs["dropout"]
    assert "| schedule gpipe" in out and "amp bfloat16" in out
    assert sorted(losses(out)) == [1, 2] and all(5 < loss < 6 for loss in losses(out).values())
    seen = [json.loads((runs["dir"] / "dropout" / f"rank{r}.json").read_text()) for r in range(4)]
    masks = [rank.get("dropout_mask") for rank in seen]
    assert None not in masks and len(set(masks)) == 4, masks
    assert [(rank["reduce_scatters"], rank["all_gathers"]) for rank in seen] == [(4, 4)] * 4, seen
    plain = json.loads((runs["dir"] / "counted" / "rank0.json").read_text())
    assert "dropout_mask" not in plain  # the control: without dropout, no mask is recorded


def test_bf16_compiled_at_pp2_logs_one_processs_bf16_numbers(runs):
    """Two stages of one block each under --amp bf16, --grad-checkpointing and --compile with the
    aot_eager backend, FSDP resharding after each forward, on a file of token ids, log chapter 3's
    one-process bf16 losses, gradient norms and validation losses within bf16's rounding (the
    activations cross between the stages in bf16, as one process holds them), and the data line
    the test computes from the file. No dropout: two stages draw masks on two ranks. Measured on 2 cores (torch 2.14):
    losses, norms and validation losses within 1.8e-3, 5e-3 and 9e-4 of one process's; allowed:
    5e-3, 1.5e-2 and 2e-3."""
    assert_bf16_run_is_one_processs(runs["bf16"], dropout=False)


def test_dropout_in_the_pipeline_draws_what_one_process_draws():
    """With --dropout 0.1 the pipeline at --pp 1 under --grad-checkpointing logs chapter 3's
    one-process losses without it: the same masks, drawn in the same order, and drawn again alike
    when the backward recomputes a block; without dropout chapter 3's losses differ, so dropout
    was on."""
    flags = SHARDED + ["--batch-size", 12, "--max-steps", 3, "--save", "", "--dropout", 0.1]
    piped = losses(in_process(PP, flags + ["--pp", 1, "--grad-checkpointing", "--export", ""]))
    one = losses(in_process(GPT, flags))
    plain = losses(one_process_reference()[0])  # the same run without dropout
    assert sorted(piped) == sorted(one) == [1, 2, 3]
    for step, loss in piped.items():
        assert loss == pytest.approx(one[step], rel=1e-5), step
        assert abs(one[step] - plain[step]) > 1e-3, step


def test_the_dp2_x_pp2_export_holds_every_whole_weight_and_samples_in_chapter_3(runs):
    """At dp 2 x pp 2 each stage's weights are sharded over its 2 replicas: the export gathers
    them whole, from every stage, into chapter 3's names, shapes and order (one process's export,
    the control: its own keys and shapes), and chapter 3 samples from it."""
    grid = torch.load(runs["dir"] / "grid.pt", map_location="cpu", weights_only=True)
    one = torch.load(runs["one.pt"], map_location="cpu", weights_only=True)
    assert grid["config"] == one["config"] and grid["step"] == 10
    assert [(k, v.shape) for k, v in grid["model"].items()] == [
        (k, v.shape) for k, v in one["model"].items()]
    sampled = in_process(GPT, ["--sample", "--ckpt", runs["dir"] / "grid.pt", "--prompt", "def ",
                               "--max-new-tokens", 8])
    assert sampled.startswith("def ") and len(sampled) > 8


def test_the_tied_copies_stay_equal_and_the_export_is_chapter_3s_model(runs):
    exported = torch.load(runs["dir"] / "pp.pt", map_location="cpu", weights_only=True)
    one = torch.load(runs["one.pt"], map_location="cpu", weights_only=True)
    assert exported["config"] == one["config"] and list(exported["model"]) == list(one["model"])
    assert torch.equal(exported["model"]["tok_emb.weight"], exported["model"]["head.weight"])
    for key, value in one["model"].items():
        torch.testing.assert_close(exported["model"][key], value, rtol=1e-4, atol=1e-4, msg=key)
    sampled = in_process(GPT, ["--sample", "--ckpt", runs["dir"] / "pp.pt", "--prompt", "def ",
                               "--max-new-tokens", 20])
    assert sampled.startswith("def ") and len(sampled) > 10


@pytest.mark.parametrize("script", [PP, FSDP])
def test_the_grid_checkpoint_resumes_at_one_process_here_and_in_chapter_7(runs, script):
    ck, flags = runs["dir"] / "grid", SHARDED + ["--max-steps", 18, "--batch-size", 12]
    out = in_process(script, flags + ["--pp", 1] * (script == PP) + ["--resume", ck, "--save", "",
                                                                        "--export", ""])
    assert f"resumed from {ck / 'step-000010'} at step 10" in out
    resumed, ddp = losses(out), losses(runs["ddp"])
    assert sorted(resumed) == list(range(11, 19))
    for step, loss in resumed.items():  # 24 sequences a step in every run
        assert loss == pytest.approx(ddp[step], rel=1e-4), (step, out)


def test_bad_inputs_are_one_line_and_exit_code_2(capsys):
    with pytest.raises(pp.InputError, match=r"^--pp 2 does not divide the world size 1: start a"):
        in_process(PP, TINY_GPT + ["--max-steps", 1, "--save", "", "--export", ""])
    for flags, words in ((["--pp", 5], "--pp 5 is more stages than --n-layer 4 blocks"),
                         (["--pp", 4, "--grad-accum", 3], "--schedule 1f1b needs at least --pp 4 "
                          "micro-batches per step, got --grad-accum 3: give more, or --schedule "
                          "gpipe"),
                         (["--schedule", "zb"], "argument --schedule: invalid choice: 'zb'"),
                         (INTERLEAVED + ["--stages-per-rank", 3], "--pp 2 x --stages-per-rank 3 "
                          "is more stages than --n-layer 4 blocks"),
                         (["--stages-per-rank", 2], "--schedule interleaved-1f1b needs --pp 2 or "
                          "more and --stages-per-rank 2 or more, and is the only schedule for "
                          "them: got --schedule 1f1b, --pp 2, --stages-per-rank 2"),
                         (INTERLEAVED + ["--stages-per-rank", 1], "got --schedule "
                          "interleaved-1f1b, --pp 2, --stages-per-rank 1"),
                         (INTERLEAVED + ["--pp", 1], "got --schedule interleaved-1f1b, --pp 1, "
                          "--stages-per-rank 2"),
                         (INTERLEAVED + ["--grad-accum", 5], "--schedule interleaved-1f1b runs "
                          "--grad-accum 5 in 2 rounds (--grad-accum // --pp, at least 1) of equal "
                          "size: give a multiple of 2, or of --pp")):
        result = as_script(PP, flags)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result
        assert words in result.stderr, result.stderr
    for k in (1, 3):  # the control: torch runs these in one round, and so does the trainer
        assert pp.parse_args([str(a) for a in INTERLEAVED + ["--grad-accum", k]]).grad_accum == k


def test_benchmark_scaling_reads_the_pp_trainers_summary(runs):
    """benchmark_scaling.py runs any trainer the same way (its launches: test_benchmark.py); what
    it needs of a trainer is its summary's pace keys: tokens per step over the dp columns."""
    row = bench.pace_row(summary(runs["grid"]), 4, 0.0)
    assert row["per_step"] == 6 * 32 * 2 * 2 and row["unit"] == "tokens/s"  # batch x T x K x dp
    assert row["throughput"] == pytest.approx(768 / (row["step_ms"] / 1000), rel=0.01)


def test_fsdps_policy_computes_in_bf16_and_reduces_in_fp32():
    """FSDP's policy in this chapter: bf16 weights for compute, fp32 gradient reductions."""
    assert_bf16_policy_reduces_in_fp32(pp)
    assert_every_unit_computes_in_bf16_and_reduces_in_fp32(PP, SHARDED + ["--pp", 2])  # read off it


def test_the_planner_predicts_what_each_rank_holds_and_sends(runs):
    """Chapter 13's plan_layout.py, given each run's flags and world size, predicts its memory
    line (each stage's parameters, and what a rank holds inside a step) and its PP traffic line
    to the character: pp 2 under 1F1B, dp 2 x pp 2, GPipe over 3 stages, two and three ranks of
    two interleaved stages, dp 2 x pp 2 in bf16 with recomputation, and pp 2 in bf16 on a
    300-token vocabulary. The control: its lines for dp 2 x pp 2 are not the pp 2 run's."""
    assert_planned(9, [
        (runs["nodes"], 2, COLUMN), (runs["grid"], 4, SHARDED + ["--pp", 2]),
        (runs["restarted"].stdout, 3, THREE + ["--pp", 3, "--schedule", "gpipe"]),
        (runs["interleaved"], 2, FOUR + INTERLEAVED + ["--grad-checkpointing"]),
        (runs["six"], 3, SIX + ["--pp", 3, "--schedule", "interleaved-1f1b",
                                "--stages-per-rank", 2]),
        (runs["dropout"], 4, SHARDED + ["--pp", 2, "--dropout", 0.1, "--schedule", "gpipe",
                                        "--grad-checkpointing", "--amp", "bf16"]),
        (runs["bf16"], 2, bf16(dropout=False) + ["--batch-size", 12, "--pp", 2])],
        other=(4, COLUMN))


def test_each_rank_resumes_its_own_random_streams_at_the_pp_and_world_that_saved_them(
        monkeypatch):
    """A checkpoint saved at dp 2 x pp 2 holds each rank's random streams (rank 3: stage 1 of
    replica 1); resumed at that layout, rank 3 restores rank 3's, not its replica's (rank 1's,
    stage 1 of replica 0: with dropout the two replicas' stage 1 would draw one mask). At
    another pp or world size the fresh seeds stay. The control: the layout that saved them."""
    restored = streams_restored(pp, monkeypatch)  # and, with no state to rename:
    monkeypatch.setattr(pp, "as_whole_model", lambda run, model, optim_state: [])
    monkeypatch.setattr(pp, "as_stage", lambda optim_state, own_names: optim_state)
    state = {"args": {"pp": 2}, "rng": ["rank 0's", "rank 1's", "rank 2's", "rank 3's"]}
    for here_pp, world, expected in [(2, 4, ["rank 3's"]), (4, 4, []), (2, 8, [])]:
        run = types.SimpleNamespace(rank=3, dp_rank=1, pp_rank=1, world_size=world,
                                    device=torch.device("cpu"),
                                    args=types.SimpleNamespace(pp=here_pp))
        restored.clear()
        pp.load_shards("ck", state, run, None, None)
        assert restored == expected, (here_pp, world)


def test_a_world_of_one_applies_the_schedule_times_training_and_samples_in_eval_mode(
        tmp_path):
    """The warmup and cosine by hand, applied and logged at each step; ms/step leaves out the
    evaluations and saves (a clock the test moves); the closing sample in evaluation mode (no
    dropout); as a world of one with --pp 1."""
    assert_a_world_of_one_schedules_times_and_samples_as_it_should(
        PP, ["--pp", "1"], tmp_path)
