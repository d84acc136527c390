"""Chapter 7, train_fsdp_minigpt.py (FSDP2's fully_shard), under real torchrun launches on CPU/gloo.
These tests prove:

1. the same math as DDP: at the same seed, data and flags (2 accumulation steps), 2 FSDP processes
   log the losses of 2 DDP processes (1e-5 relative) and their validation losses at steps 0, 6, 12
   and 18 (4 printed decimals), and end with the same weights to float32
   rounding; the exported plain file samples in one process through train_ddp_minigpt.py; a
   padded evaluation (13 windows on 2 ranks: one padded batch) gives one process's loss;
2. accumulation stays sharded: with --grad-sync every (the default) FSDP reduce-scatters every
   sharded group once per micro-batch and holds no whole gradient between micro-batches; with
   --grad-sync last once per step, holding every parameter's whole fp32 gradient in between (the
   bytes read from FSDP's state), with the same losses; both print what they hold and send; FSDP
   gathers 4 times per micro-batch of 2 blocks: the root and the last block stay whole from
   forward to backward (a counting probe), 3 times with --reshard-after-forward no;
3. memory: the memory line gives rank 0's share of the parameters (and so of the gradients
   and AdamW state) as the test counts it from the model's shapes split on dim 0, at 1, 2 and 3
   processes and on a 300-token vocabulary;
4. checkpoints are shards that resume at another world size: saved at 2 processes (step 14) and
   at 3 (step 2, of the full-disk run below), resumed at 1, with the same global batch, the next
   losses are the uninterrupted 2-process run's (the windows of each global batch are the same;
   only the order of float sums differs); a step folder without DCP's .metadata or run.json (a save
   killed half-way, or a removal cut short) is named in one line and never resumed, and a
   --resume that names no complete step is an error; a full disk during a sharded save (3 processes) is one line on every rank (exit
   code 5), leaves no half-written step, and the previous step resumes; at one process FSDP, built on the meta
   device, ends with chapter 3's weights, and saves and exports them after an evaluation with
   --reshard-after-forward no; a rank SIGKILLed while it saves, at each of four moments (between the
   shards, after DCP's .metadata, once renamed, while a failed save is removed), is restarted
   with its peer under `torchrun --max-restarts=4`, and `--resume auto` goes on each time from the
   newest complete step with the uninterrupted run's losses; a run never writes into a folder of
   another run's steps, nor continues them (--seed), and a --save or --export that cannot be
   written is refused before training; random streams come
   back only at the world size that saved them and without tp (a tp row's ranks draw alike);
5. bad input is one line and exit code 2: a DDP checkpoint file given to --resume, --amp fp16,
   a wrong --reshard-after-forward, a step whose .metadata was cut in half (DCP's reason, and
   none of DCP's warnings with tracebacks beside it), a run.json without its step (the other
   run.json and number checks of chapters 7-12: test_bad_runs.py);
6. benchmark_scaling.py reads its summary (tokens per step over the ranks; the launches through
   benchmark_scaling.py are test_benchmark.py's), and chapter 4's launcher runs it on two nodes (two
   agents on this machine, meeting at 127.0.0.1) with the losses of one node's two DDP processes,
   from a shell that holds a SLURM allocation and debug switches (test_hermetic.py);
7. a run as a GPU user starts one: 2 processes under --amp bf16, --grad-checkpointing, --compile
   (aot_eager), --debug, on a file of token ids (--data, --vocab-size, --val-fraction) log chapter
   3's one-process bf16 numbers within bf16's rounding, and the data and parameter lines the test
   computes; the dropout runs of 1 and 4 set --weight-decay, --dist-timeout and --amp off too.
The launches run side by side in one module fixture (`runs`); the counted run of 1-3 is the
two-node run of 6; --grad-sync last is a counted run of 4 steps beside it.
The schedule and the clock, in this process as a world of one: each step applies and logs
the warmup and cosine worked out by hand, and ms/step leaves out evaluation and saving (the
test moves the clock: 1 s a step, 100 s an evaluation or a save); with dropout, the closing
sample runs every module in evaluation mode.
"""
import json
import logging
import os
import re
import shutil
import subprocess
import types

import pytest
import torch
from helpers import assert_a_world_of_one_schedules_times_and_samples_as_it_should
from helpers import kills, logged_val_losses as val_losses
from helpers import assert_bf16_run_is_one_processs, bf16, one_process_bf16
from helpers import assert_every_unit_computes_in_bf16_and_reduces_in_fp32
from helpers import assert_bf16_policy_reduces_in_fp32, assert_dropout_run_is_ddps, streams_restored
from helpers import assert_planned, first_rank_share, gpt_shapes, memory_words
from helpers import (CONSTANT_LR, EVAL_6, GPT, NOISY, REPO, SHARDED, TINY_GPT, VOCAB, command,
                     ddp_dropout_reference, ddp_reference, finish, hostile_shell, in_process, ok,
                     start, start_two_nodes, summary, trainer)

import benchmark_scaling as bench  # noqa: E402  (the repository is on sys.path: helpers)

FSDP = "train_fsdp_minigpt.py"
fsdp = trainer(FSDP)
FLAGS = SHARDED
# the restarted run's kills, one per attempt (helpers.kill_in_save): rank 1 between the shards of
# step 8, rank 0 after its .metadata, rank 0 once it is renamed, rank 0 removing step 12 that
# rank 1's full disk failed
KILLS = ["shards@8:1", "metadata@8:0", "renamed@8:0", "cleanup@12:1"]
RESUMED = TINY_GPT + ["--grad-accum", 2, *CONSTANT_LR, "--max-steps", 18, "--export", "",
                      "--max-new-tokens", 1]  # resumed runs: 12 sequences per micro-step


CONTRACT = {  # tests/README.md, "One proof for every GPT chapter"; None: not held yet
    "reference": ["test_fsdp_computes_what_ddp_computes",
                  "test_checkpoints_of_two_and_three_processes_resume_at_one"],
    "norms": ["test_with_dropout_a_binding_clip_and_padding_fsdp_logs_ddps_numbers"],
    "padded": ["test_with_dropout_a_binding_clip_and_padding_fsdp_logs_ddps_numbers",
               "test_a_padded_evaluation_counts_each_window_once"],
    "dropout": ["test_with_dropout_a_binding_clip_and_padding_fsdp_logs_ddps_numbers"],
    "collectives": ["test_accumulation_stays_sharded_or_with_grad_sync_last_holds_whole_gradients"],
    "policy": ["test_the_policy_computes_in_bf16_and_reduces_gradients_in_fp32"],
    "resume": ["test_checkpoints_of_two_and_three_processes_resume_at_one"],
    "bf16": ["test_bf16_compiled_with_recomputation_logs_one_processs_bf16_numbers"],
}


def losses(out):
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"^step (\d+)/\d+ \| loss (\d+\.\d+)", out, re.M)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's launches, side by side: FSDP (counted) for 18 steps on two nodes through the
    launcher, from a hostile shell (`fsdp`: rank 0's node's output); FSDP for 14 steps with a
    rank killed in four saves and restarted (its last checkpoint: step 14); FSDP at 3 processes
    whose rank 1 finds the disk full at its 2nd save (its step 2 stays); chapter 3's 18 steps
    (ddp_reference, shared with chapters 3 and 8's tests)."""
    d = tmp_path_factory.mktemp("fsdp")
    (d / "count").mkdir()
    (d / "last").mkdir()
    cmds = {"restarted": command("tests/probe_fsdp.py",
                                 ["killsave", ",".join(KILLS), *FLAGS, "--max-steps", 14,
                                  "--save-every", 4, "--save", d / "f14", "--resume", "auto",
                                  "--export", ""],
                                 nproc=2, torchrun_args=[f"--max-restarts={len(KILLS)}"]),
            "nospace": command("tests/probe_fsdp.py", ["nospace", "2:1", *FLAGS, "--batch-size", 4,
                                                       "--save-every", 2, "--save", d / "full",
                                                       "--export", "", "--max-steps", 4], nproc=3),
            "last": command("tests/probe_fsdp.py", ["count", d / "last", *FLAGS, "--grad-sync",
                                                    "last", "--reshard-after-forward", "no",
                                                    "--max-steps", 4, "--save", "",
                                                    "--eval-windows", 13,  # a padded batch
                                                    "--export", ""], nproc=2),
            "dropout": command("tests/probe_fsdp.py",
                               ["killsave", "renamed@2:0", *NOISY, "--grad-checkpointing",
                                "--save-every", 2, "--save", d / "noisy",
                                "--resume", "auto", "--export", ""],
                               nproc=2, torchrun_args=["--max-restarts=1"]),
            "bf16": command(FSDP, [*bf16(dropout=False), "--batch-size", 6, "--compile",
                                   "--compile-backend", "aot_eager", "--debug", "--export", ""],
                            nproc=2)}
    restart_fix = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch/pytorch#135712
    started = {name: start(cmd, REPO, restart_fix if name in ("restarted", "dropout") else None)
               for name, cmd in cmds.items()}
    with hostile_shell():  # a SLURM allocation, debug switches...: the helpers' launches ignore it
        nodes = start_two_nodes("tests/probe_fsdp.py", ["count", d / "count", *FLAGS, "--max-steps",
                                                        18, *EVAL_6, "--save", d / "f18",
                                                        "--export", d / "f18.pt"])
    ddp, ddp_ckpt, _ = ddp_reference()
    one_process_bf16(dropout=False), one_process_bf16()  # in this process, while they run
    r = {name: finish(proc, cmds[name]) for name, proc in started.items()}
    ok(r["restarted"])
    ok(r["last"])
    ok(r["dropout"])
    ok(r["bf16"])
    outs = nodes()
    logged = [out for out in outs if "world size 2 |" in out]  # rank 0's node logs
    assert len(logged) == 1, outs
    r["fsdp"] = subprocess.CompletedProcess("two nodes", 0, logged[0], "")
    return {**r, "ddp": ddp, "ddp.pt": ddp_ckpt, "dir": d}


def test_fsdp_computes_what_ddp_computes(runs):
    a, b = losses(runs["fsdp"].stdout), losses(runs["ddp"])
    assert sorted(a) == list(range(1, 19)) and a[18] < a[1]
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-5), step
    val, ddp_val = val_losses(runs["fsdp"].stdout), val_losses(runs["ddp"])
    assert sorted(val) == sorted(ddp_val) == [0, 6, 12, 18]  # 4 decimals; the control: they differ
    assert val == pytest.approx(ddp_val, abs=1e-4) and ddp_val[18] < ddp_val[0] - 0.5
    fsdp_weights = torch.load(runs["dir"] / "f18.pt", map_location="cpu", weights_only=True)
    ddp_weights = torch.load(runs["ddp.pt"], map_location="cpu", weights_only=True)
    assert fsdp_weights["config"] == ddp_weights["config"]
    for key, value in ddp_weights["model"].items():
        torch.testing.assert_close(fsdp_weights["model"][key], value, rtol=1e-4, atol=1e-4)
    sampled = in_process(GPT, ["--sample", "--ckpt", runs["dir"] / "f18.pt", "--prompt", "def ",
                               "--max-new-tokens", 20, "--device", "cpu"])
    assert sampled.startswith("def ")


def test_with_dropout_a_binding_clip_and_padding_fsdp_logs_ddps_numbers(runs):
    """--dropout 0.1 (each rank its own masks, seeded by rank as DDP's are), --clip 2.0 and 13
    validation windows (one padded batch), under --grad-checkpointing (the backward recomputes
    each block with the masks its forward drew): 2 FSDP processes log 2 DDP processes' losses,
    gradient norms before clipping, and validation losses, DDP computing without recomputation.
    Rank 0 is killed once step 2 is saved: the restarted job resumes every rank's random streams
    and draws the masks the uninterrupted run would. The controls: the clip binds in steps 1 and 2
    and not in 3 and 4, and without dropout the first loss differs."""
    ddp = ddp_dropout_reference()[0]
    before, after = runs["dropout"].stdout.split(
        f"resumed from {runs['dir'] / 'noisy' / 'step-000002'} at step 2\n")
    assert "step 2/4 | loss" in before and "step 3/4 | loss" in after  # the control: a kill
    after = after.replace(re.search(r"^step 2/4 \| val loss .*\n", after, re.M).group(), "")
    assert_dropout_run_is_ddps(before + after)  # the resumed run's first evaluation aside
    assert sorted(val_losses(ddp)) == [0, 4] and val_losses(ddp)[4] < val_losses(ddp)[0] - 0.1
    assert abs(losses(ddp)[1] - losses(runs["ddp"])[1]) > 1e-3  # dropout was on


def test_bf16_compiled_with_recomputation_logs_one_processs_bf16_numbers(runs):
    """2 processes of 6 sequences under --amp bf16, --grad-checkpointing and --compile with the
    aot_eager backend, on a file of token ids (--data, --vocab-size, --val-fraction), log chapter
    3's one-process bf16 losses, gradient norms and validation losses at a batch of 12, within
    bf16's rounding, and the data and parameter lines the test computes. No dropout: each rank
    draws its own masks, which one process cannot draw. Measured on 2 cores (torch 2.14):
    losses, norms and validation losses within 1.8e-3, 5e-3 and 8e-4 of one process's; allowed:
    5e-3, 1.5e-2 and 2e-3."""
    assert_bf16_run_is_one_processs(runs["bf16"].stdout, dropout=False)


def test_the_policy_computes_in_bf16_and_reduces_gradients_in_fp32():
    """FSDP's MixedPrecisionPolicy with --amp bf16: weights gathered and used in bf16, gradients
    reduce-scattered in fp32 (in bf16 the sums would round, more with more ranks). The control:
    with --amp off the weights stay fp32."""
    assert_bf16_policy_reduces_in_fp32(fsdp)
    assert_every_unit_computes_in_bf16_and_reduces_in_fp32(FSDP, SHARDED)  # read off it


def test_a_padded_evaluation_counts_each_window_once(runs):
    """13 validation windows on 2 ranks, 7 and 6: with batch 6 rank 0 runs 2 batches and rank 1
    one and a padded one (every rank must run each forward: its targets -100, no token). The
    step-0 validation loss is one process's over the same 13 windows (4 decimals)."""
    one = in_process(GPT, [*FLAGS, "--max-steps", 1, "--eval-windows", 13, "--save", ""])
    assert val_losses(runs["last"].stdout)[0] == pytest.approx(val_losses(one)[0], abs=1e-4)


def test_accumulation_stays_sharded_or_with_grad_sync_last_holds_whole_gradients(runs):
    """--grad-sync every (the default): each micro-batch (2 a step) reduce-scatters every group's
    gradients and no whole gradient outlives its backward; --grad-sync last: one reduce-scatter
    per group and step, and between micro-batches every rank holds the whole fp32 gradients of
    all 34,688 parameters (FSDP's no_sync); the same losses either way. The --grad-sync last run
    also keeps gathered weights (--reshard-after-forward no): 3 all-gathers per micro-batch, not
    4."""
    groups = 2 + 1  # --n-layer 2 blocks, then the root (embeddings, final norm, head)
    assert "--grad-sync every: gradients stay sharded between micro-batches; the 0.13 MiB of " \
           "them reduce-scattered 2 times per step, unit by unit" in runs["fsdp"].stdout
    assert "--grad-sync last: every rank holds the whole gradients, 0.13 MiB, from the first " \
           "micro-batch to the last; reduce-scattered once per step" in runs["last"].stdout
    assert sorted(losses(runs["last"].stdout)) == [1, 2, 3, 4]
    for step, loss in losses(runs["last"].stdout).items():
        assert loss == pytest.approx(losses(runs["fsdp"].stdout)[step], rel=1e-5), step
    for rank in (0, 1):
        last = json.loads((runs["dir"] / "last" / f"rank{rank}.json").read_text())
        assert (last["steps"], last["reduce_scatters"]) == (4, groups * 4), last
        assert last["whole_grad_bytes"] == 4 * 34_688, last
        # --reshard-after-forward no (this run too): the blocks stay whole from their forward to
        # their backward, so a micro-batch gathers each group once: the root and 2 blocks
        assert last["all_gathers"] == (1 + 2) * 2 * 4, last
        seen = json.loads((runs["dir"] / "count" / f"rank{rank}.json").read_text())
        assert seen["steps"] == 18 and seen["reduce_scatters"] == groups * 2 * 18, seen
        assert seen["whole_grad_bytes"] == 0, seen
        # per micro-batch: the root once (whole from its forward to its backward), both blocks
        # before their forward, block 0 again before its backward (the last block stays whole)
        assert seen["all_gathers"] == (1 + 2 + 1) * 2 * 18, seen  # resharding the root and the
        # last block after their forward, as torch does when told to, would make it 6, not 4


def test_building_saving_and_exporting_send_only_what_they_must(runs):
    """Outside the training steps (the counted two-node run): building the model sends nothing
    (each rank computes its own slices, src_data_rank=None); a sharded save gathers nothing (DCP:
    each rank writes its shards); the export gathers each of its 29 tensors once, to rank 0's CPU
    alone (the other ranks' state dicts are empty). Evaluation keeps no autograd graph, and a
    step leaves no .grad behind (set_to_none). The controls: the export's gathers are counted
    (29), and rank 0 holds the whole export."""
    for rank in (0, 1):
        seen = json.loads((runs["dir"] / "count" / f"rank{rank}.json").read_text())
        assert seen["outside"] == {"build": 0, "save": 0, "export": 29}, seen
        assert seen["exported"] == (29 if rank == 0 else 0), seen
        assert not seen["eval_with_grad"] and seen["grads_kept"] == 0, seen


def test_bf16_trains_under_the_policy_on_a_cpu():
    """--amp bf16 on a CPU, in one process: the policy casts every unit's weights (the blocks and
    the root alike) and the run trains; a unit left without the policy would meet bf16 inputs
    with fp32 weights and stop at its first matmul."""
    flags = FLAGS + ["--max-steps", 2, "--save", "", "--export", ""]
    out, plain = (in_process(FSDP, flags + ["--amp", amp]) for amp in ("bf16", "off"))
    assert "| amp bfloat16 |" in out and sorted(losses(out)) == sorted(losses(plain)) == [1, 2]
    assert losses(out)[2] != losses(plain)[2]  # the control: with no policy anywhere, both fp32


def test_random_streams_come_back_only_at_the_layout_that_saved_them(monkeypatch):
    """A checkpoint's RNG states are restored rank by rank only if it was saved at this world size
    without tensor parallelism: a tp row's ranks draw the same dropout masks (chapter 8), so
    restored here they would give two data-parallel ranks one stream; otherwise each rank keeps
    its seed by rank. The control: the same world size without tp restores them."""
    restored = streams_restored(fsdp, monkeypatch)
    run = types.SimpleNamespace(rank=1, world_size=2, device=torch.device("cpu"))
    for args, expected in [({"tp": 2}, []), ({}, ["rank 1's"]), ({"tp": 1}, ["rank 1's"])]:
        restored.clear()
        fsdp.load_shards("ck", {"args": args, "rng": ["rank 0's", "rank 1's"]}, run, None, None)
        assert restored == expected, args
    restored.clear()
    fsdp.load_shards("ck", {"args": {}, "rng": ["0", "1", "2"]}, run, None, None)  # 3 ranks
    assert restored == []


def test_the_memory_line_is_rank_0s_share_at_one_two_and_three_processes(runs):
    """The memory line gives rank 0's parameters, counted here from the model's shapes split on
    dim 0 as FSDP2 splits them: all 34,688 at one process, 17,344 at two, 11,728 at three (86 of
    the embedding's 256 rows, 11 of the 32 positions...), and at two on the bf16 run's 300-token
    vocabulary, 16 bytes each (fp32 weights, gradients and AdamW's two moments), against DDP's
    whole copy. The control: a third of the model at three processes would be 11,562."""
    one = in_process(FSDP, FLAGS + ["--max-steps", 1, "--save", "", "--export", ""])
    for out, shapes, ranks in [(one, gpt_shapes(), 1), (runs["fsdp"].stdout, gpt_shapes(), 2),
                               (runs["nospace"].stdout, gpt_shapes(), 3),
                               (runs["bf16"].stdout, gpt_shapes(vocab=VOCAB), 2)]:
        whole = first_rank_share(shapes, 1)
        said = memory_words(first_rank_share(shapes, ranks), whole)
        assert f"memory per rank (cpu): weights, gradients and AdamW state {said}; every " \
               "parameter is sharded, the embeddings too" in out, (ranks, out)
    assert first_rank_share(gpt_shapes(), 3) != 34_688 // 3


def test_a_rank_killed_while_it_saves_is_restarted_and_the_job_resumes_from_its_shards(runs):
    """Four attempts killed in a save (KILLS), each restarted by torchrun: every attempt resumes
    from the newest complete step, names the partial folder it ignores, and logs the uninterrupted
    run's losses (the same world size: every printed digit). What the --save folder held at each
    kill shows that each kill hit its moment; at the end it holds the last step alone."""
    out, folder = runs["restarted"].stdout, runs["dir"] / "f14"
    uninterrupted = losses(runs["fsdp"].stdout)
    resumed = re.findall(rf"^resumed from {re.escape(str(folder))}/step-(\d+) at step", out, re.M)
    assert [int(n) for n in resumed] == [4, 4, 8, 8]  # the control: no kill would resume none
    # named after the kill past .metadata (rank 0, which removes a failed save, was the one killed;
    # after the kill between the shards it may have removed the partial folder before it died)
    assert f"ignoring unfinished checkpoint steps: {folder}/partial-step-000008\n" in out
    assert f"ignoring unfinished checkpoint steps: {folder}/partial-step-000012" in out
    logged = re.findall(r"^step (\d+)/14 \| loss (\d+\.\d+)", out, re.M)
    assert len(logged) == 8 + 4 + 4 + 4 + 6  # every attempt's steps, each as printed
    for step, loss in logged:
        assert float(loss) == uninterrupted[int(step)], step
    killed = kills(folder)
    assert [k["moment"] for k in killed] == [k.split("@")[0] for k in KILLS]
    shards, metadata, renamed, cleanup = (k["held"] for k in killed)
    assert {".metadata", "run.json"} <= set(shards["step-000004"])
    assert ".metadata" not in shards["partial-step-000008"]  # some shards, no mark
    assert ".metadata" in metadata["partial-step-000008"]  # DCP done, run.json not yet
    assert "run.json" not in metadata["partial-step-000008"]
    assert sorted(renamed) == ["step-000004", "step-000008"]  # complete, older not yet dropped
    assert {".metadata", "run.json"} <= set(renamed["step-000008"])
    assert "run.json" not in cleanup["partial-step-000012"] and "step-000008" in cleanup
    assert sorted(os.listdir(folder)) == ["step-000014"]


def test_checkpoints_of_two_and_three_processes_resume_at_one(runs):
    """The restarted run's step 14 (2 processes) and the full-disk run's intact step 2 (3
    processes, shards padded unevenly) resume in one process, with 12 sequences per micro-step as
    in every run here: the next losses are the uninterrupted 2-process run's."""
    uninterrupted = losses(runs["fsdp"].stdout)
    for saved, folder in ((14, runs["dir"] / "f14"), (2, runs["dir"] / "full")):
        out = in_process(FSDP, RESUMED + ["--batch-size", 12, "--resume", folder, "--save", ""])
        assert f"resumed from {folder / f'step-{saved:06d}'} at step {saved}" in out
        resumed = losses(out)
        assert sorted(resumed) == list(range(saved + 1, 19))
        for step, loss in resumed.items():
            assert loss == pytest.approx(uninterrupted[step], rel=1e-4), (step, out)


def test_an_unfinished_step_is_never_resumed_and_is_named(tmp_path):
    """A step folder resumes only with DCP's .metadata and run.json, the one rule of the finder and
    the reader: --resume auto goes on from step 1 past the folder a cut-short removal left (its
    .metadata, not its run.json: before this rule, `no complete checkpoint` stopped the job), and
    past a save cut short before its .metadata; a --resume that names no complete step is an
    error."""
    folder = tmp_path / "ck"
    flags = FLAGS + ["--max-steps", 1, "--save", folder, "--export", ""]
    in_process(FSDP, flags)
    (folder / "step-000006").mkdir()  # run.json and shards removed, .metadata not yet
    shutil.copy(folder / "step-000001" / ".metadata", folder / "step-000006")
    (folder / "step-000099").mkdir()  # shards of a save killed before .metadata
    (folder / "step-000099" / "__0_0.distcp").write_bytes(b"half")
    out = in_process(FSDP, FLAGS + ["--max-steps", 2, "--save", folder, "--resume", "auto",
                                    "--export", ""])
    assert f"resumed from {folder / 'step-000001'} at step 1" in out and "step 2/2 | loss" in out
    assert (f"ignoring unfinished checkpoint steps: {folder / 'step-000006'}, "
            f"{folder / 'step-000099'}\n" in out)
    half = tmp_path / "half"  # --resume asked for by name: no complete step there is an error
    (half / "step-000007").mkdir(parents=True)
    shutil.copy(folder / "step-000002" / ".metadata", half / "step-000007")
    for path in (half / "step-000007", half):
        with pytest.raises(fsdp.InputError, match=rf"^no complete checkpoint at {path} \(it needs"):
            in_process(FSDP, FLAGS + ["--max-steps", 1, "--resume", path, "--save", ""])


def test_a_resume_draws_the_masks_and_learning_rates_the_run_would_have(tmp_path, monkeypatch):
    """One process with --dropout 0.1 and TINY_GPT's warm-up and cosine schedule: resumed from its
    step 2, a run logs the uninterrupted run's steps 3 and 4 (losses, learning rates, gradient
    norms, every printed digit). The controls: the learning rate moves from step 3 to 4, and
    without dropout step 3's loss is another."""
    plain_flags = TINY_GPT + ["--batch-size", 6, "--max-steps", 4, "--export", ""]
    flags = plain_flags + ["--dropout", 0.1]
    monkeypatch.setattr(fsdp, "drop_older_steps", lambda *args: None)  # step 2 stays
    whole = in_process(FSDP, flags + ["--save", tmp_path / "a", "--save-every", 2])
    resumed = in_process(FSDP, flags + ["--save", "", "--resume", tmp_path / "a" / "step-000002"])
    logged = re.compile(r"^step (\d)/4 \| loss (\S+) \| lr (\S+) \| grad norm (\S+)", re.M)
    steps = {m.group(1): m.groups()[1:] for m in logged.finditer(whole)}
    assert {m.group(1): m.groups()[1:] for m in logged.finditer(resumed)} == {
        "3": steps["3"], "4": steps["4"]}
    plain = in_process(FSDP, plain_flags + ["--save", ""])
    assert steps["3"][1] != steps["4"][1] and losses(plain)[3] != float(steps["3"][0])


def test_a_run_never_continues_nor_deletes_another_runs_steps(tmp_path):
    """Run A (seed 1) leaves ck/step-000002. Run B (seed 2) is refused, in one line before it
    trains, both fresh into ck and with --resume auto; A's step stays. The control: A itself goes
    on from its step with --resume auto, and drops it once step 3 is saved. A --benchmark, which
    writes nothing, runs beside A's step. A --save or --export that cannot be written is refused
    before training, not at the first save."""
    ck, base = tmp_path / "ck", FLAGS + ["--export", ""]
    in_process(FSDP, base + ["--seed", 1, "--max-steps", 2, "--save", ck])
    step_2 = ck / "step-000002"
    with pytest.raises(fsdp.InputError, match=rf"^--save {ck} holds another run's steps "
                                              rf"\({step_2}\): go on with that run by"):
        in_process(FSDP, base + ["--seed", 2, "--max-steps", 1, "--save", ck])
    with pytest.raises(fsdp.InputError, match=rf"^{step_2} is another run's step \(--seed 1, "
                                              r"this run --seed 2\)"):
        in_process(FSDP, base + ["--seed", 2, "--max-steps", 3, "--save", ck, "--resume", "auto"])
    out = in_process(FSDP, base + ["--seed", 2, "--max-steps", 1, "--save", ck, "--benchmark"])
    assert "benchmark |" in out  # it writes nothing, so the folder's steps are no obstacle
    assert sorted(os.listdir(ck)) == ["step-000002"]
    out = in_process(FSDP, base + ["--seed", 1, "--max-steps", 3, "--save", ck, "--resume", "auto"])
    assert f"resumed from {step_2} at step 2" in out and sorted(os.listdir(ck)) == ["step-000003"]
    with pytest.raises(fsdp.InputError, match=rf"^{ck / 'step-000003'} is at step 3, past "
                                              r"--max-steps 2$"):  # it would log "step 3/2"
        in_process(FSDP, base + ["--seed", 1, "--max-steps", 2, "--save", ck, "--resume", "auto"])
    (tmp_path / "file").write_text("")
    for flag, path, reason in (("--save", tmp_path / "file", "File exists"),
                               ("--save", tmp_path / "file" / "ck", "Not a directory"),
                               ("--export", tmp_path, "Is a directory"),
                               ("--export", tmp_path / "file" / "f.pt", "File exists")):
        paths = {"--save": "", "--export": "", flag: path}
        with pytest.raises(fsdp.InputError, match=rf"^{flag} {path} cannot be written: {reason}$"):
            in_process(FSDP, FLAGS + ["--max-steps", 1, *[x for kv in paths.items() for x in kv]])


def test_at_one_process_fsdp_ends_with_chapter_3s_weights(tmp_path):
    """Built on the meta device and filled one parameter at a time, FSDP starts from chapter 3's
    initial weights and, at world size 1, trains to the same weights. With
    --reshard-after-forward no, the evaluation just before the save and the export leaves no
    gathered weights behind (they are freed): both write the shards, not the gathered copies."""
    flags = FLAGS + ["--max-steps", 3, "--eval-every", 3, "--dropout", 0]
    in_process(FSDP, flags + ["--save", tmp_path / "ck", "--export", tmp_path / "fsdp.pt",
                              "--reshard-after-forward", "no"])
    assert (tmp_path / "ck" / "step-000003" / ".metadata").is_file()
    in_process(GPT, flags + ["--save", tmp_path / "ddp.pt"])
    exported = torch.load(tmp_path / "fsdp.pt", weights_only=True)["model"]
    for key, value in torch.load(tmp_path / "ddp.pt", weights_only=True)["model"].items():
        torch.testing.assert_close(exported[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_full_disk_during_a_sharded_save_is_one_line_and_the_last_step_resumes(runs):
    result, ck = runs["nospace"], runs["dir"] / "full"  # 3 processes; rank 1's disk is full
    assert result.returncode != 0 and "exitcode  : 5" in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 3, lines  # each rank measures the room on its own disk
    for line in lines:
        assert re.match(rf"error: cannot save {re.escape(str(ck / 'step-000004'))}: the disk "
                        rf"holding {re.escape(str(ck))} is full: \d+\.\d [kM]B free, a checkpoint "
                        r"needs about \d+\.\d [kM]B \(No space left on device\)$", line), line
    assert not re.search(r"\[rank\d\]: Traceback", result.stderr)  # no worker's traceback
    assert sorted(p.name for p in ck.iterdir()) == ["step-000002"]  # no half-written step
    # step 2 resumes: test_checkpoints_of_two_and_three_processes_resume_at_one


def test_bad_inputs_are_one_line(runs, capsys):
    with pytest.raises(fsdp.InputError, match=r"is one file, as train_ddp_minigpt.py saves"):
        in_process(FSDP, FLAGS + ["--max-steps", 1, "--resume", runs["ddp.pt"]])
    with pytest.raises(fsdp.InputError, match=r"^--amp fp16: this FSDP trainer runs bf16 or fp32"):
        fsdp.mixed_precision("fp16", torch.device("cuda", 0))  # fp16 on a GPU: refused
    with pytest.raises(SystemExit) as exit_:
        fsdp.parse_args(["--reshard-after-forward", "maybe"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "invalid choice: 'maybe'" in err


def test_a_truncated_metadata_or_a_run_json_without_its_step_is_one_line(runs, tmp_path, capfd):
    """Step 14 with its .metadata (DCP's index of the shards) cut in half, resumed: one line
    naming why DCP could not read it, and none of the warnings with tracebacks DCP logs on the
    way; with a run.json that lost its step: one line, from every rank's agreement, before any
    shard loads. The filter's control: DCP's warnings with a traceback are dropped, and one
    without a traceback or from elsewhere is kept."""
    cut, stepless = tmp_path / "cut", tmp_path / "stepless"
    for folder in (cut, stepless):
        shutil.copytree(runs["dir"] / "f14" / "step-000014", folder / "step-000014")
    metadata = (cut / "step-000014" / ".metadata").read_bytes()
    (cut / "step-000014" / ".metadata").write_bytes(metadata[:len(metadata) // 2])
    state = json.loads((stepless / "step-000014" / "run.json").read_text())
    del state["step"]
    (stepless / "step-000014" / "run.json").write_text(json.dumps(state))
    capfd.readouterr()
    with pytest.raises(fsdp.InputError) as err:
        in_process(FSDP, RESUMED + ["--batch-size", 12, "--resume", cut, "--save", ""])
    said = str(err.value)
    assert said.startswith(f"cannot load the shards of {cut / 'step-000014'}: ") and \
        "pickle data was truncated" in said and "\n" not in said, said
    assert "Traceback" not in capfd.readouterr().err and err.value.code == 2
    with pytest.raises(fsdp.InputError) as err:
        in_process(FSDP, RESUMED + ["--batch-size", 12, "--resume", stepless, "--save", ""])
    assert str(err.value) == f"cannot resume from {stepless / 'step-000014' / 'run.json'}: it " \
                             "has no step"
    record = logging.LogRecord("root", logging.WARNING, fsdp.dcp.__file__, 1, "not found", None,
                               None)  # a warning of DCP's, as it logs on the root logger
    assert fsdp.avoid_dcp_tracebacks(record)  # no traceback: kept
    record.exc_info = (ValueError, ValueError("truncated"), None)
    assert not fsdp.avoid_dcp_tracebacks(record)  # DCP's, with a traceback: dropped
    record.pathname = __file__
    assert fsdp.avoid_dcp_tracebacks(record)  # another file's: kept


def test_benchmark_scaling_reads_the_fsdp_trainers_summary(runs):
    """What benchmark_scaling.py needs of a trainer is its summary's pace keys (its launches:
    test_benchmark.py, with a stand-in trainer); chapter 7's are tokens per step over the ranks."""
    row = bench.pace_row(summary(runs["fsdp"].stdout), 2, 0.0)
    assert row["per_step"] == 6 * 32 * 2 * 2 and row["unit"] == "tokens/s"  # batch x T x K x 2
    assert row["throughput"] == pytest.approx(768 / (row["step_ms"] / 1000), rel=0.01)


def test_two_nodes_through_the_launcher_train_like_one_node(runs):
    """The counted run above is two nodes (two torchrun agents meeting at 127.0.0.1 through the
    launcher's commands): it logs one node's DDP losses (test_fsdp_computes_what_ddp_computes);
    here, that it was two agents of one process each that the launcher started."""
    out = runs["fsdp"].stdout
    assert "world size 2 |" in out and losses(out) == pytest.approx(losses(runs["ddp"]), rel=1e-5)


def test_the_planner_predicts_what_each_rank_holds_and_sends(runs):
    """Chapter 13's plan_layout.py, given each run's flags and world size, predicts its memory and
    accumulation lines to the character: at 2 processes (--grad-sync every and last), at 3
    (batch 4), and under bf16 on a 300-token vocabulary. The control: its lines for 3 processes
    are not the 2-process run's."""
    assert_planned(7, [(runs["fsdp"].stdout, 2, FLAGS), (runs["last"].stdout, 2, FLAGS + [
                       "--grad-sync", "last"]), (runs["nospace"].stdout, 3, FLAGS + [
                       "--batch-size", 4]), (runs["bf16"].stdout, 2, bf16(dropout=False))],
                   other=(3, FLAGS))


def test_a_world_of_one_applies_the_schedule_times_training_and_samples_in_eval_mode(
        tmp_path):
    """The warmup and cosine by hand, applied and logged at each step; ms/step leaves out the
    evaluations and saves (a clock the test moves); the closing sample in evaluation mode (no
    dropout); as a world of one with one rank."""
    assert_a_world_of_one_schedules_times_and_samples_as_it_should(
        FSDP, [], tmp_path)
