"""The mistakes learners make, runnable: each is the line(s) a learner plausibly writes in place of
the course's, applied to a temporary copy of the repository; the mistaken script runs once, tiny,
to measure its symptom, and the tests named to catch it run against it. Not part of
`python -m pytest` (it takes tens of minutes); tests/test_mistakes.py checks, fast, that every
entry still applies to its script.

    python tests/mistakes.py                       # every mistake, chapter by chapter
    python tests/mistakes.py 8                     # chapter 8's
    python tests/mistakes.py tp-retie-forgotten    # one, by name
    python tests/mistakes.py --list                # the catalogue, nothing run
    python tests/mistakes.py --markdown docs/mistakes.md   # also write the table there

It prints one row per mistake: its name, the symptom measured (the last loss, validation loss or
accuracy against the course's run of the same command, an error line, or a hang stopped by the
timeout), and the first test that failed, or "survived". It exits 1 if any mistake survives, and
2 if a patch no longer applies to its script (the catalogue must follow the scripts).
"""
import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_FLAGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
             "--batch-size", "6", "--grad-accum", "2", "--max-steps", "6", "--eval-every", "6",
             "--eval-windows", "13", "--log-every", "1", "--save", "", "--max-new-tokens", "1"]
CLASSIFIER_FLAGS = ["--train-samples", "512", "--val-samples", "101", "--seed", "3",
                    "--epochs", "2", "--batch-size", "16", "--save", ""]
SYMPTOM_RUNS = {  # script: (processes, flags) of the tiny run that measures a symptom
    "train_ddp_basic.py": (2, CLASSIFIER_FLAGS),
    "train_ddp_minigpt.py": (2, GPT_FLAGS + ["--dropout", "0.1"]),
    "train_fsdp_minigpt.py": (2, GPT_FLAGS + ["--export", ""]),
    "train_tp_minigpt.py": (4, GPT_FLAGS + ["--tp", "2", "--export", ""]),
    "train_pp_minigpt.py": (2, GPT_FLAGS + ["--pp", "2", "--export", ""]),
    "train_cp_minigpt.py": (2, GPT_FLAGS + ["--cp", "2", "--export", ""]),
    "train_4d_minigpt.py": (8, GPT_FLAGS + ["--pp", "2", "--cp", "2", "--tp", "2", "--export", ""]),
    "train_moe_minigpt.py": (2, GPT_FLAGS + ["--ep", "2", "--export", ""]),
}


@dataclasses.dataclass
class Mistake:
    name: str
    chapter: int
    script: str
    patch: list  # [(the course's text, the learner's)]: each course text found exactly once
    writes: str  # what the learner writes, in words
    avoids: str  # the course's line or idea that avoids it
    catches: list  # the tests that must fail: pytest node ids
    flags: list = dataclasses.field(default_factory=list)  # more flags for the symptom run
    command: list = None  # a symptom run of its own: a plain command, its output compared
    pick: str = None  # in that output, the text to show beside the course's (a regex's match)


C2, C3 = "train_ddp_basic.py", "train_ddp_minigpt.py"
C7, C8, C9, C10 = ("train_fsdp_minigpt.py", "train_tp_minigpt.py", "train_pp_minigpt.py",
                   "train_cp_minigpt.py")
C11, T_4D = "train_4d_minigpt.py", "tests/test_4d.py::"
C12, T_MOE = "train_moe_minigpt.py", "tests/test_moe.py::"
C13, T_PLAN = "plan_layout.py", "tests/test_planner.py::"
PLAN_TERMS = T_PLAN + "test_the_estimates_are_the_formulas_written_out_here"
PLAN_EXPERTS = T_PLAN + "test_experts_send_and_count_as_written_out_here"
PLAN_405B = [sys.executable, "plan_layout.py", "--preset", "llama3-405b", "--gpus", "16384",
             "--layout", "pp=16,tp=8,dp=128,schedule=interleaved-1f1b,v=4,recompute=full"]
PLAN_DSV3 = [sys.executable, "plan_layout.py", "--preset", "deepseek-v3", "--gpus", "2048",
             "--layout", "pp=16,dp=128,ep=64,recompute=full"]
MOE_EQUAL = T_MOE + "test_expert_parallel_runs_compute_what_one_process_computes"
MOE_DROPOUT = T_MOE + "test_no_experts_is_the_dense_model_and_dropout_draws_ddps_masks"
SCHEDULE = "test_a_world_of_one_applies_the_schedule_times_training_and_samples_in_eval_mode"
PAGE_7, PAGE_11 = "docs/fsdp_in_your_trainer.md", "docs/4d_in_your_trainer.md"  # copy pages


def page_run(name):
    """A copy page's mistake is measured by the page's launch test, which catches it: the symptom
    shown is the test's first assertion line."""
    test = f"tests/test_pages.py::test_the_{name}_page_trains_one_processs_model"
    return {"catches": [test], "pick": r"^E +(?:AssertionError: )?(.{1,100})",
            "command": [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test]}
T_LAYER = (T_MOE  # chapter 12's layer against formulas written out in the test
           + "test_the_layer_sends_each_token_to_its_k_experts_and_the_router_learns_through_the_gates")
EIGHT_EQUAL = T_4D + "test_pp2_cp2_tp2_at_8_processes_computes_what_one_process_computes"
T_CLS = "tests/test_classifier.py::"
T_GPT, T_FSDP, T_TP = "tests/test_minigpt.py::", "tests/test_fsdp.py::", "tests/test_tp.py::"
T_PP, T_CP = "tests/test_pp.py::", "tests/test_cp.py::"
CP_LINES = T_CP + "test_the_world_memory_accumulation_and_split_lines_are_what_the_test_counts"
T_IL = (T_PP  # chapter 9's interleaved run
        + "test_interleaved_stages_compute_what_one_process_computes_from_chapter_7s_checkpoint")
T_LAUNCH, T_FAULTS = "tests/test_launcher.py::", "tests/test_faults.py::"
T_BAD = "tests/test_bad_runs.py::"
RULE = T_BAD + "test_each_sharded_trainer_finds_keeps_and_refuses_step_folders_by_one_rule"
T_PATHS, T_BENCH = "tests/test_cluster_paths.py::", "tests/test_benchmark.py::"
LAUNCHER, BENCH = "launch_multinode_ddp.sh", "benchmark_scaling.py"
PRINTED = ["bash", LAUNCHER, "--nnodes", "2", "--nproc-per-node", "8", "--master-addr", "10.0.0.1",
           "--master-port", "29500", "train_ddp_basic.py"]
SCALED = [sys.executable, BENCH, "--device", "cpu", "--nproc", "1", "2", "--", "--epochs", "1",
          "--train-samples", "256", "--val-samples", "32"]
WINDOWS_BY_RANK = (  # the windows of a row (or column) dealt by global rank instead
    "    windows = Windows(train, args.block_size, args.batch_size, run.dp_rank, run.dp_size,",
    "    windows = Windows(train, args.block_size, args.batch_size, run.rank, run.world_size,")
SAMPLER = "    sampler = DistributedSampler(train_set, seed=args.seed)  # DDP 4: each rank its own share\n"
SET_EPOCH = "        sampler.set_epoch(epoch)  # DDP 6: a new order each epoch, the same on every rank\n"
DDP_EQUAL = T_CLS + "test_ddp_two_processes_equal_one_process_with_twice_the_batch"
VAL_EQUAL = (T_CLS + "test_val_metrics_identical_at_world_size_1_2_and_3_and_checkpoints_"
             "cross_load")

CATALOGUE = [
    # chapter 2: DDP, the classifier
    Mistake("ddp-no-distributed-sampler", 2, C2,
            [(SAMPLER, ""), (SET_EPOCH, ""),
             ("DataLoader(train_set, args.batch_size, sampler=sampler, **workers)",
              "DataLoader(train_set, args.batch_size, shuffle=True, **workers)")],
            "shuffle=True instead of a DistributedSampler: every rank trains on every sample",
            "DistributedSampler(train_set, seed=args.seed)  # DDP 4", [DDP_EQUAL]),
    Mistake("ddp-no-set-epoch", 2, C2, [(SET_EPOCH, "")],
            "no sampler.set_epoch(epoch): every epoch repeats the first one's order",
            "sampler.set_epoch(epoch)  # DDP 6", [DDP_EQUAL]),
    Mistake("ddp-sampler-seeded-by-rank", 2, C2,
            [(SAMPLER, SAMPLER.replace("seed=args.seed)", "seed=args.seed + rank)"))],
            "DistributedSampler(..., seed=args.seed + rank): the ranks' shares overlap",
            "one seed for every rank: one order, each rank its own slice", [DDP_EQUAL]),
    Mistake("ddp-validation-sampler-pads", 2, C2,
            [("    val_set = Subset(val_set, range(rank, len(val_set), world_size))  # disjoint: "
              "no padding\n", ""),
             ("val_loader = DataLoader(val_set, args.batch_size, **workers)",
              "val_loader = DataLoader(val_set, args.batch_size, "
              "sampler=DistributedSampler(val_set, shuffle=False), **workers)")],
            "a DistributedSampler for validation: it pads with repeats, counted twice",
            "Subset(val_set, range(rank, len(val_set), world_size))  # disjoint", [VAL_EQUAL]),
    Mistake("ddp-metrics-not-reduced", 2, C2,
            [("    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # DDP 7\n", "")],
            "validation metrics not all-reduced: rank 0 reports its own half",
            "dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # DDP 7", [VAL_EQUAL]),
    Mistake("ddp-reduce-op-avg", 2, C2,
            [("    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # DDP 7\n",
              "    dist.all_reduce(totals, op=dist.ReduceOp.AVG)  # DDP 7\n")],
            "ReduceOp.AVG on the sums and counts: the mean survives, the counts are divided by N",
            "SUM, then divide  # DDP 7", [VAL_EQUAL]),
    Mistake("ddp-module-prefix-saved", 2, C2,
            [("save_checkpoint(path, model.module, optimizer, epoch, args)",
              "save_checkpoint(path, model, optimizer, epoch, args)")],
            "the DDP wrapper's state_dict saved: every key starts with module.",
            "save_checkpoint(path, model.module, ...)  # DDP 8",
            [T_CLS + "test_readme_demo_learns_logs_once_and_saves_once"]),

    # chapter 3: the GPT under DDP
    Mistake("gpt-forward-outside-no-sync", 3, C3,
            [("        with contextlib.nullcontext() if last else model.no_sync():\n"
              "            with autocast:\n                _, loss = model(x, y)\n",
              "        with autocast:\n            _, loss = model(x, y)\n"
              "        with contextlib.nullcontext() if last else model.no_sync():\n")],
            "the forward outside no_sync(), only the backward inside: DDP all-reduces anyway",
            "forward and backward inside no_sync()  # DDP 10",
            [T_GPT + "test_no_sync_holds_the_forward_too_or_every_micro_batch_all_reduces"]),
    Mistake("gpt-loss-not-divided", 3, C3,
            [("            loss = loss / len(batches)\n", "")],
            "each micro-batch's loss not divided by --grad-accum: K times the gradient",
            "loss = loss / len(batches)",
            [T_GPT + "test_three_processes_log_one_processs_norms_and_validation_and_resume_at_one",
             T_GPT + "test_disjoint_windows_one_allreduce_per_step_and_accumulation_is_exact"]),
    Mistake("gpt-dropout-same-on-every-rank", 3, C3,
            [("torch.manual_seed(args.seed + run.rank)  # DDP 6",
              "torch.manual_seed(args.seed)  # DDP 6")],
            "one dropout seed for every rank: the replicas drop the same units",
            "torch.manual_seed(args.seed + run.rank)  # DDP 6",
            [T_GPT + "test_on_two_nodes_each_rank_reads_its_own_windows_and_draws_its_own_masks",
             T_TP + "test_with_dropout_and_a_padded_evaluation_dp2_x_tp2_logs_ddps_numbers"]),
    Mistake("gpt-every-rank-same-windows", 3, C3,
            [("return (offset + order * (self.block + 1))[self.rank::self.world].numpy()",
              "return (offset + order * (self.block + 1))[:count // self.world].numpy()")],
            "no share per rank: every rank reads the same windows",
            "[self.rank::self.world]  # DDP 4",
            [T_GPT + "test_disjoint_windows_one_allreduce_per_step_and_accumulation_is_exact"]),
    Mistake("gpt-order-seeded-by-rank", 3, C3,
            [("g = torch.Generator().manual_seed(self.seed + epoch)  # DDP 5",
              "g = torch.Generator().manual_seed(self.seed + epoch + self.rank)  # DDP 5")],
            "the window order seeded by rank: the ranks' slices overlap",
            "seeded by epoch, not by rank  # DDP 5",
            [T_GPT + "test_disjoint_windows_one_allreduce_per_step_and_accumulation_is_exact"]),
    Mistake("gpt-validation-counts-tokens-once-per-rank", 3, C3,
            [("    return (totals[0] / totals[1]).item()\n\n\ndef train_step",
              "    return (totals[0] / totals[1] / dist.get_world_size()).item()\n\n\n"
              "def train_step")],
            "the summed loss divided by the world size again: a mean of means, off by N",
            "sum on every rank, then divide once  # DDP 9",
            [T_GPT + "test_disjoint_windows_one_allreduce_per_step_and_accumulation_is_exact"]),
    Mistake("gpt-validation-mean-of-rank-means", 3, C3,
            [("    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # DDP 9: all ranks' sums",
              "    totals = torch.stack([totals[0] / totals[1], totals[1] ** 0])  # my mean, 1\n"
              "    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # DDP 9: all ranks' sums")],
            "each rank's mean validation loss averaged over the ranks: wrong where their windows "
            "are unequal",
            "sum on every rank, then divide once  # DDP 9",
            [T_GPT + "test_three_processes_log_one_processs_norms_and_validation_and_resume_at_one"]),
    Mistake("gpt-every-rank-scores-every-window", 3, C3,
            [("    mine = starts[run.rank::run.world_size]\n", "    mine = starts\n")],
            "every rank scores every validation window: the same mean, world size times the work",
            "starts[run.rank::run.world_size]  # DDP 4",
            [T_GPT + "test_each_rank_evaluates_its_own_validation_windows_once"]),
    Mistake("gpt-one-order-for-every-epoch", 3, C3,
            [("manual_seed(self.seed + epoch)  # DDP 5", "manual_seed(self.seed)  # DDP 5")],
            "the window order seeded without the epoch: every epoch repeats the first",
            "seed + epoch  # DDP 5",
            [T_GPT + "test_each_epoch_deals_a_new_order_that_the_ranks_share_out"]),
    Mistake("gpt-lr-of-the-next-step", 3, C3,
            [('        group["lr"] = lr_at(step, args)', '        group["lr"] = lr_at(step + 1, args)')],
            "each step applies the next step's learning rate; the log still shows the schedule's",
            "lr_at(step) before the step",
            [T_GPT + "test_each_step_applies_and_logs_the_schedules_learning_rate"]),
    Mistake("gpt-lr-logged-off-by-one", 3, C3,
            [("lr_at(step - 1, self.args):.2e}", "lr_at(step, self.args):.2e}")],
            "the log shows the learning rate of the step after the one it reports",
            "the log's lr: lr_at(done - 1)",
            [T_GPT + "test_each_step_applies_and_logs_the_schedules_learning_rate"]),
    Mistake("gpt-validation-summed-in-bf16", 3, C3,
            [("F.cross_entropy(logits.flatten(0, -2).float(), y.flatten()",
              "F.cross_entropy(logits.flatten(0, -2), y.flatten()")],
            "the validation cross-entropy summed in bf16 under --amp bf16: off in the third digit",
            "logits.float() before the loss",
            [T_GPT + "test_the_validation_loss_is_summed_in_fp32_from_bf16_logits"],
            ["--amp", "bf16"]),
    Mistake("gpt-clip-before-unscale", 3, C3,
            [("    run.scaler.unscale_(optimizer)  # fp16: true gradients before clipping (no-op "
              "otherwise)\n    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip "
              "or float(\"inf\"))\n",
              "    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip or "
              "float(\"inf\"))\n    run.scaler.unscale_(optimizer)\n")],
            "fp16: the gradients clipped while still scaled: the clip binds always, the norm 65,536x",
            "scaler.unscale_ before clip_grad_norm_",
            [T_GPT + "test_fp16_clips_and_logs_the_unscaled_gradient_norm"]),
    Mistake("gpt-windows-by-local-rank", 3, C3,
            [("    windows = Windows(train, args.block_size, args.batch_size, run.rank, run.world_size,",
              "    windows = Windows(train, args.block_size, args.batch_size,\n"
              "                      int(os.environ[\"LOCAL_RANK\"]), run.world_size,")],
            "the windows dealt by the rank on its node: on two nodes both read the same",
            "run.rank, the global rank  # DDP 4",
            [T_GPT + "test_on_two_nodes_each_rank_reads_its_own_windows_and_draws_its_own_masks"]),
    Mistake("gpt-model-cast-to-bf16", 3, C3,
            [("    raw_model = GPT(**config).to(run.device)\n",
              "    raw_model = GPT(**config).to(run.device, torch.bfloat16 if args.amp == 'bf16' "
              "else None)\n")],
            "the model cast to bf16 for --amp bf16: weights, gradients and DDP's all-reduce round "
            "in bf16",
            "the weights stay fp32; autocast runs the products in bf16",
            [T_GPT + "test_bf16_computes_in_bf16_while_ddp_all_reduces_fp32_gradients"],
            flags=["--amp", "bf16"]),

    # chapter 4: many nodes, the launcher
    Mistake("launch-standalone-on-each-node", 4, LAUNCHER,
            [("       \"--rdzv-backend=c10d\" \"--rdzv-endpoint=$addr:$port\" \"--rdzv-id=$rdzv_id\"\n",
              "       \"--standalone\"\n")],
            "--standalone on every node: each node starts a job of its own",
            "--rdzv-backend=c10d --rdzv-endpoint=ADDR:PORT --rdzv-id=ID, the same everywhere",
            [T_LAUNCH + "test_prints_one_identical_c10d_command_per_node"], command=PRINTED),
    Mistake("launch-rdzv-id-per-node", 4, LAUNCHER,
            [("rdzv_id=${rdzv_id:-ddp-$addr-$port}", "rdzv_id=${rdzv_id:-ddp-$(hostname)-$$}")],
            "a rendezvous id made on each node (its host, its process): the nodes never meet",
            "one --rdzv-id for the job, the same on every node",
            [T_LAUNCH + "test_prints_one_identical_c10d_command_per_node"],
            command=PRINTED),
    Mistake("launch-join-timeout-dropped", 4, LAUNCHER,
            [(' "--rdzv-conf=join_timeout=$join_timeout"', "")],
            "no join timeout: a node whose peer never comes waits torchrun's default 600 s",
            "--rdzv-conf=join_timeout=N",
            [T_LAUNCH + "test_prints_one_identical_c10d_command_per_node"], command=PRINTED),
    Mistake("launch-slurm-job-nodes", 4, LAUNCHER,
            [("nnodes=${nnodes:-${SLURM_STEP_NUM_NODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}}}",
              "nnodes=${nnodes:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}}")],
            "the allocation's node count for a step that runs on part of it",
            "SLURM_STEP_NUM_NODES first",
            [T_LAUNCH + "test_an_srun_step_on_part_of_the_allocation_uses_the_steps_nodes"],
            command=["env", "SLURM_JOB_ID=7", "SLURM_JOB_NUM_NODES=4", "SLURM_STEP_NUM_NODES=2",
                     "bash", LAUNCHER, "--nproc-per-node", "8", "--master-addr", "10.0.0.1",
                     "train_ddp_basic.py"]),
    Mistake("launch-node-rank-unchecked", 4, LAUNCHER,
            [("  (( 10#$node_rank < 10#$nnodes )) || die \"--node-rank must be 0..$((nnodes - 1)) "
              "for --nnodes $nnodes, got '$node_rank'\"\n", "")],
            "--node-rank taken as given: node 2 of 2 waits for a job it can never join",
            "--node-rank checked against --nnodes: one line, exit 2",
            [T_LAUNCH + "test_each_bad_input_exits_2_with_one_line"],
            command=PRINTED[:-1] + ["--node-rank", "2", "--run", "train_ddp_basic.py"]),
    Mistake("launch-no-exec", 4, LAUNCHER,
            [('  exec "${cmd[@]}"\n', '  "${cmd[@]}"\n')],
            "torchrun run as a child of the script: a signal to the script never reaches it",
            'exec "${cmd[@]}": the script becomes torchrun',
            [T_LAUNCH + "test_slurm_gives_nodes_rank_and_head_node_and_run_execs"],
            command=PRINTED),

    # chapter 5: faults
    Mistake("fault-every-rank-looks-for-the-checkpoint", 5, C3,
            [("    dist.broadcast_object_list(found, src=0)  # DDP 7: rank 0 decides for every rank\n",
              "")],
            "each rank looks for --resume auto's file itself: ranks that see different files "
            "disagree", "rank 0 looks, broadcast_object_list tells every rank  # DDP 7",
            [T_PATHS + "test_the_lm_resumes_only_when_rank_0_finds_the_checkpoint_and_every_rank_"
             "follows"]),
    Mistake("fault-checkpoint-written-in-place", 5, C3,
            [('    tmp = f"{path}.tmp{os.getpid()}"', "    tmp = path")],
            "torch.save straight to the checkpoint's name: a failed write destroys the last good one",
            "a temp file, fsync, os.replace",
            [T_FAULTS + "test_a_failed_checkpoint_write_leaves_the_previous_file_whole"]),
    Mistake("fault-resumed-one-step-late", 5, C3,
            [('    return state["step"]\n\n\n', '    return state["step"] + 1\n\n\n')],
            "resume at the step after the saved one: a step skipped",
            "the saved step is the number of steps done",
            [T_GPT + "test_a_crashed_worker_is_restarted_and_resumes_exactly"]),
    Mistake("fault-rank-0s-random-stream-everywhere", 5, C3,
            [('        torch.set_rng_state(state["rng"][run.rank]["cpu"])',
              '        torch.set_rng_state(state["rng"][0]["cpu"])')],
            "every rank restores rank 0's random stream: the replicas drop the same units",
            "each rank its own stream back  # DDP 11",
            [T_GPT + "test_a_crashed_worker_is_restarted_and_resumes_exactly"]),
    Mistake("fault-rank-0s-stream-saved-alone", 5, C3,
            [("    dist.all_gather_object(rng_states, rng_state(run.device))  # so rank 0 can save "
              "them all\n", "    rng_states = [rng_state(run.device)]  # rank 0's\n")],
            "only rank 0's random stream in the checkpoint: the others restart theirs afresh",
            "every rank's RNG state, gathered to rank 0  # DDP 11",
            [T_GPT + "test_a_crashed_worker_is_restarted_and_resumes_exactly"]),
    Mistake("fault-classifier-resumed-an-epoch-late", 5, C2,
            [("    start_epoch = load_checkpoint(resume, model, optimizer, args) if resume else 0",
              "    start_epoch = load_checkpoint(resume, model, optimizer, args) + 1 if resume else 0")],
            "the restarted classifier begins after the saved epoch: one epoch never trained",
            "the saved epoch is the number of epochs done",
            [T_FAULTS + "test_sigkill_with_a_restart_resumes_to_the_uninterrupted_result"]),

    # chapter 6: speed and debugging
    Mistake("bench-efficiency-is-speedup", 6, BENCH,
            [('        row["efficiency"] = round(row["speedup"] / row["ideal"], 3)',
              '        row["efficiency"] = round(row["speedup"], 3)')],
            "efficiency reported as the speedup, not the speedup over linear scaling",
            "efficiency = speedup / (N / N0)",
            [T_BENCH + "test_weak_scaling_table_chart_json_and_svg_agree"], command=SCALED,
            pick=r"^ +2 \|.*\| +(\d+%) \|"),
    Mistake("bench-busbw-as-algbw", 6, BENCH,
            [('BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,',
              'BUSBW_FACTOR = {"all_reduce": lambda n: 1.0,')],
            "an all-reduce's bus bandwidth taken as its algorithm bandwidth",
            "busbw = algbw x 2 (N - 1) / N (nccl-tests)",
            [T_BENCH + "test_collectives_report_correct_results_and_nccl_tests_bandwidths"],
            command=[sys.executable, "-c", "import benchmark_scaling as b; print('busbw/algbw at "
                     "8 ranks:', b.BUSBW_FACTOR['all_reduce'](8))"], pick=r"at 8 ranks: ([\d.]+)"),
    Mistake("bench-strong-batch-not-split", 6, BENCH,
            [('        extra += ["--batch-size", str(strong // nproc)]',
              '        extra += ["--batch-size", str(strong)]')],
            "strong scaling with the whole global batch on every process",
            "--strong GLOBAL: GLOBAL / N per process",
            [T_BENCH + "test_strong_scaling_splits_the_global_batch_and_refuses_uneven_splits"],
            command=SCALED[:2] + ["--strong", "64"] + SCALED[2:],
            pick=r"^ +2 \| +(\d+) \|"),
    Mistake("bench-speedup-from-the-largest-count", 6, BENCH,
            [("    base = rows[0]\n    for row in rows:", "    base = rows[-1]\n    for row in rows:")],
            "speedup measured against the largest process count, not the smallest",
            "speedup = throughput / the smallest count's",
            [T_BENCH + "test_weak_scaling_table_chart_json_and_svg_agree"], command=SCALED,
            pick=r"^ +2 \|.*\| +([\d.]+x) \|"),
    Mistake("debug-check-sync-compares-nothing", 6, C3,
            [("    dist.all_gather_object(digests, hashlib.sha256(weights).hexdigest()[:12])  "
              "# every rank's\n",
              "    digests = [hashlib.sha256(weights).hexdigest()[:12]] * len(digests)\n")],
            "each rank checks its own hash against itself: drift never seen",
            "all_gather_object of every rank's hash  # DDP 15",
            ["tests/test_debugging.py::test_check_sync_stops_a_desynchronised_replica_before_it_"
             "saves"]),
    Mistake("debug-step-time-counts-evaluation", 6, C3,
            [("        meter.stop_clock()  # evaluation and checkpoints are not training time\n", ""),
             ("        meter.start_clock()\n", "")],
            "the step time measured around evaluation and saves too",
            "meter.stop_clock() before evaluating, start_clock() after",
            [T_PATHS + "test_logged_step_time_leaves_out_evaluation"]),
    # chapter 7: FSDP
    Mistake("fsdp-optimizer-before-shard", 7, C7,
            [("    shard(run, raw_model)  # FSDP 2: before the optimizer, which must see the shards\n",
              ""),
             ("    raw_model.to_empty(device=run.device)  # FSDP 2: this rank's shards, not yet "
              "filled\n",
              "    optimizer = make_optimizer(raw_model, args, run.device)\n"
              "    shard(run, raw_model)\n"
              "    raw_model.to_empty(device=run.device)  # FSDP 2: this rank's shards, not yet "
              "filled\n"),
             ("    raw_model.grad_checkpointing = args.grad_checkpointing\n"
              "    optimizer = make_optimizer(raw_model, args, run.device)\n",
              "    raw_model.grad_checkpointing = args.grad_checkpointing\n")],
            "the optimizer made before fully_shard: it holds the unsharded parameters",
            "shard(run, raw_model) before make_optimizer  # FSDP 2",
            [T_FSDP + "test_fsdp_computes_what_ddp_computes"]),
    Mistake("fsdp-weights-never-filled", 7, C7,
            [("    init_shards(raw_model, args.seed)  # FSDP 2: one process's initial weights\n",
              "")],
            "to_empty() and no fill: the shards hold whatever memory held",
            "init_shards(raw_model, args.seed)  # FSDP 2",
            [T_FSDP + "test_fsdp_computes_what_ddp_computes"]),
    Mistake("fsdp-no-sync-while-accumulating", 7, C7,
            [("model.set_requires_gradient_sync(every or i == len(batches) - 1)",
              "model.set_requires_gradient_sync(i == len(batches) - 1)")],
            "DDP's no_sync habit: gradient sync off until the last micro-batch, whole gradients",
            "set_requires_gradient_sync(True) each micro-batch  # FSDP 7",
            [T_FSDP + "test_accumulation_stays_sharded_or_with_grad_sync_last_holds_whole_"
             "gradients"]),
    Mistake("fsdp-padding-counted", 7, C7,
            [("        totals[1] += (y != -100).sum()  # FSDP 5: the padding counts no token\n",
              "        totals[1] += y.numel()\n")],
            "the validation padding's targets counted as tokens",
            "totals[1] += (y != -100).sum()  # FSDP 5",
            [T_FSDP + "test_a_padded_evaluation_counts_each_window_once"]),
    Mistake("fsdp-rng-restored-at-any-layout", 7, C7,
            [("    if saved == (1, run.world_size):\n"
              "        restore_rng(state[\"rng\"][run.rank], run.device)",
              "    if True:\n        restore_rng(state[\"rng\"][run.rank % len(state[\"rng\"])], "
              "run.device)")],
            "every rank restores a saved random stream, whatever layout saved it",
            "restore only at the layout that saved them  # FSDP 3",
            [T_FSDP + "test_random_streams_come_back_only_at_the_layout_that_saved_them"]),
    Mistake("fsdp-dropout-one-seed", 7, C7,
            [("    torch.manual_seed(args.seed + run.rank)  # DDP 6: each rank draws its own "
              "dropout masks\n", "    torch.manual_seed(args.seed)\n")],
            "one dropout seed on every rank: the replicas drop the same units of different data",
            "torch.manual_seed(args.seed + run.rank)  # DDP 6",
            [T_FSDP + "test_with_dropout_a_binding_clip_and_padding_fsdp_logs_ddps_numbers"],
            ["--dropout", "0.1"]),
    Mistake("fsdp-loss-divided-in-the-log-only", 7, C7,
            [("        loss = loss / len(batches)\n", ""),
             ("        total += loss.detach()\n", "        total += loss.detach() / len(batches)\n")],
            "the backward on each micro-batch's undivided loss, the division only in the log: "
            "gradients --grad-accum times too large",
            "loss = loss / len(batches) before loss.backward()",
            [T_FSDP + "test_with_dropout_a_binding_clip_and_padding_fsdp_logs_ddps_numbers"]),
    Mistake("fsdp-gradients-reduced-in-bf16", 7, C7,
            [("MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)",
              "MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)")],
            "the policy's reductions in the compute dtype: bf16 sums that round, more with more "
            "ranks", "reduce_dtype=torch.float32  # FSDP 1",
            [T_FSDP + "test_the_policy_computes_in_bf16_and_reduces_gradients_in_fp32"],
            ["--amp", "bf16"]),
    Mistake("fsdp-initial-weights-sent-from-rank-0", 7, C7,
            [("src_data_rank=None))", "))")],
            "distribute_tensor left to its default: rank 0's values scattered to every rank, "
            "though each computes the same ones", "src_data_rank=None: each rank keeps its slice",
            [T_FSDP + "test_building_saving_and_exporting_send_only_what_they_must"]),
    Mistake("fsdp-blocks-without-the-policy", 7, C7,
            [("fully_shard(block, mesh=mesh, mp_policy=run.policy,", "fully_shard(block, mesh=mesh,")],
            "the blocks sharded without the policy: bf16 inputs meet fp32 weights",
            "mp_policy=run.policy on every unit  # FSDP 1",
            [T_FSDP + "test_bf16_trains_under_the_policy_on_a_cpu"], ["--amp", "bf16"]),
    Mistake("fsdp-root-without-the-policy", 7, C7,
            [("fully_shard(model, mesh=mesh, mp_policy=run.policy)", "fully_shard(model, mesh=mesh)")],
            "the root sharded without the policy: its embeddings and head stay fp32 while the "
            "blocks compute in bf16", "mp_policy=run.policy on the root too  # FSDP 1",
            [T_FSDP + "test_bf16_trains_under_the_policy_on_a_cpu"], ["--amp", "bf16"]),
    Mistake("fsdp-checkpoint-gathered-whole", 7, C7,
            [("get_state_dict(raw_model, optimizer)))  # shards",
              "get_state_dict(raw_model, optimizer,\n"
              "        options=StateDictOptions(full_state_dict=True))))")],
            "a full state dict saved through DCP: every rank gathers the whole model and AdamW "
            "state at each save", "get_state_dict(raw_model, optimizer): each rank its shards",
            [T_FSDP + "test_building_saving_and_exporting_send_only_what_they_must"]),
    Mistake("fsdp-export-kept-on-every-rank", 7, C7,
            [("StateDictOptions(full_state_dict=True, cpu_offload=True)",
              "StateDictOptions(full_state_dict=True)")],
            "the export gathered without cpu_offload: every rank holds the whole model",
            "StateDictOptions(full_state_dict=True, cpu_offload=True)  # FSDP 8",
            [T_FSDP + "test_building_saving_and_exporting_send_only_what_they_must"]),
    Mistake("fsdp-finite-check-gathers-the-weights", 7, C7,
            [("mine = all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())",
              "mine = all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())")],
            "the finite check on full_tensor(): every save and export gathers every parameter",
            "p.to_local(): each rank checks its shards, one all-reduce says all",
            [T_FSDP + "test_building_saving_and_exporting_send_only_what_they_must"]),
    Mistake("fsdp-evaluation-with-autograd", 7, C7,
            [("@torch.no_grad()\ndef mean_loss_over_ranks", "def mean_loss_over_ranks")],
            "evaluation without no_grad: every batch's activations kept for a backward that never "
            "comes", "@torch.no_grad()", [T_FSDP + "test_building_saving_and_exporting_send_only_what_they_must"]),
    Mistake("fsdp-gradients-kept-after-the-step", 7, C7,
            [("optimizer.zero_grad(set_to_none=True)", "optimizer.zero_grad(set_to_none=False)")],
            "zero_grad keeping the gradient tensors: they stay allocated through evaluation and "
            "saves", "optimizer.zero_grad(set_to_none=True)", [T_FSDP + "test_building_saving_and_exporting_send_only_what_they_must"]),
    Mistake("fsdp-root-resharded", 7, C7,
            [("    fully_shard(model, mesh=mesh, mp_policy=run.policy)  # the root",
              "    fully_shard(model, mesh=mesh, mp_policy=run.policy,\n"
              "                reshard_after_forward=True)  # the root")],
            "reshard_after_forward=True passed to the root: gathered again at once",
            "the root left to torch's choice: whole from forward to backward",
            [T_FSDP + "test_accumulation_stays_sharded_or_with_grad_sync_last_holds_whole_"
             "gradients"]),

    Mistake("fsdp-step-removed-metadata-last", 7, C7,
            [("    with contextlib.suppress(FileNotFoundError):\n"
              "        os.remove(os.path.join(folder, \".metadata\"))\n", "")],
            "a step removed by shutil.rmtree alone: a removal killed part-way can leave .metadata "
            "and run.json beside missing shards, a step every restart takes for complete",
            "remove_step: .metadata first  # FSDP 3", [RULE]),
    Mistake("fsdp-fresh-run-beside-steps-when-resumed-elsewhere", 7, C7,
            [("    if newest and not ours:\n", "    if newest and not path:\n")],
            "any resume lets a run save into a --save holding steps: a run resumed from another "
            "folder then deletes this folder's steps", "not ours: a step of --save itself", [RULE]),
    Mistake("fsdp-step-folder-by-dirname", 7, C7,
            [("        os.path.dirname(os.path.abspath(path)), save)", "        os.path.dirname(path), save)")],
            "the resumed step's folder taken as dirname(path): --resume DIR/step-N/ (a shell's "
            "completion) names the step itself, and the run's own --save is refused",
            "dirname(abspath(path))", [RULE]),
    Mistake("fsdp-steps-ordered-by-name", 7, C7,
            [("    done = sorted((s for s in steps if complete(s) and not cut_short(s)), key=steps.get)",
              "    done = sorted(s for s in steps if complete(s) and not cut_short(s))")],
            "step folders ordered by name: past step 999,999 (step-1000000 < step-999000) every "
            "restart goes back to step 999,000", "key=steps.get: numbers as numbers", [RULE]),
    Mistake("fsdp-step-saved-again-onto-the-old", 7, C7,
            [("    remove_step(folder)\n    os.replace(partial, folder)",
              "    os.replace(partial, folder)")],
            "the partial folder renamed onto a step of the same number without removing it: a run "
            "that went back fails its save (Directory not empty)", "rename_step: remove_step "
            "first", [RULE]),
    Mistake("fsdp-rank-0s-streams-saved-for-all", 7, C7,
            [("    dist.all_gather_object(rng_states, rng_state(run.device))  # so rank 0 can save "
              "them all", "    rng_states = [rng_state(run.device)] * run.world_size")],
            "rank 0's random streams saved for every rank: after a resume rank 1 draws rank 0's "
            "dropout masks", "all_gather_object of every rank's streams  # DDP 11",
            [T_FSDP + "test_with_dropout_a_binding_clip_and_padding_fsdp_logs_ddps_numbers"]),
    Mistake("fsdp-seeded-after-the-resume", 7, C7,
            [("    model = wrap_model(run, raw_model)  # the same shards: raw_model, or its compiled "
              "form\n", "    model = wrap_model(run, raw_model)  # the same shards: raw_model, or "
              "its compiled form\n    torch.manual_seed(args.seed + run.rank)\n")],
            "the dropout stream seeded after the checkpoint restored it: a resumed run draws the "
            "first step's masks again", "torch.manual_seed in build_model, before the resume",
            [T_FSDP + "test_a_resume_draws_the_masks_and_learning_rates_the_run_would_have"]),

    # chapter 8: TP
    Mistake("tp-data-by-rank", 8, C8,
            [WINDOWS_BY_RANK],
            "the windows dealt by rank: a row's two halves of a layer read different sequences",
            "Windows(..., run.dp_rank, run.dp_size, ...)  # TP 2",
            [T_TP + "test_dp2_x_tp2_computes_what_ddp_computes"]),
    Mistake("tp-retie-forgotten", 8, C8,
            [("        model.head.weight = model.tok_emb.weight  # TP 4: one matrix again\n", "")],
            "no re-tie after parallelize_module: the head and embedding train apart",
            "model.head.weight = model.tok_emb.weight  # TP 4",
            [T_TP + "test_dp2_x_tp2_computes_what_ddp_computes"]),
    Mistake("tp-dropout-by-row-under-sp", 8, C8,
            [("    return run.rank if run.args.sequence_parallel == \"on\" else run.dp_rank",
              "    return run.dp_rank")],
            "dropout seeded by row under sequence parallelism: both halves of a sequence share "
            "one mask", "dropout_stream: by rank where the sequence is split  # TP 2",
            [T_TP + "test_sequence_parallel_drops_out_each_ranks_tokens_with_its_own_masks"],
            ["--dropout", "0.1"]),
    Mistake("tp-mesh-dims-swapped", 8, C8,
            [("    shape, names = (world_size // tp, tp), (\"dp\", \"tp\")",
              "    shape, names = (tp, world_size // tp), (\"tp\", \"dp\")")],
            "the mesh's dims swapped: a tp row is every other rank, across nodes",
            "(world // tp, tp), (\"dp\", \"tp\"): tp innermost  # TP 1",
            [T_TP + "test_a_tp_row_is_consecutive_ranks_and_draws_one_sample"]),
    Mistake("tp-sp-reduction-left-whole", 8, C8,
            [("            \"attn.proj\": RowwiseParallel(output_layouts=Shard(1)),",
              "            \"attn.proj\": RowwiseParallel(),")],
            "sequence parallel, but attn.proj still all-reduces: its output whole, not split",
            "RowwiseParallel(output_layouts=Shard(1))  # TP 4",
            [T_TP + "test_dp2_x_tp2_computes_what_ddp_computes"]),
    Mistake("tp-nanogpt-qkv-layout", 8, C8,
            [("        qkv = self.qkv(x).view(B, T, -1, 3, C // self.n_head)\n"
              "        q, k, v = qkv.permute(3, 0, 2, 1, 4)",
              "        qkv = self.qkv(x).view(B, T, 3, -1, C // self.n_head)\n"
              "        q, k, v = qkv.permute(2, 0, 3, 1, 4)")],
            "nanoGPT's q|k|v layout: split in two, rank 0 holds every q",
            "qkv's outputs head by head  # the model's comment",
            [T_TP + "test_the_model_computes_chapter_3s_logits_from_its_weights"]),

    Mistake("tp-streams-restored-across-sp", 8, C8,
            [("    if (saved.get(\"tp\"), saved.get(\"sequence_parallel\"), len(state[\"rng\"])) == (\n"
              "            run.args.tp, run.args.sequence_parallel, run.world_size):",
              "    if (saved.get(\"tp\"), len(state[\"rng\"])) == (run.args.tp, run.world_size):")],
            "random streams restored whatever --sequence-parallel saved them: a row's ranks, "
            "now needing one stream, get two", "the layout that saved them, SP included  # TP 5",
            [T_TP + "test_a_switch_of_sequence_parallelism_on_resume_keeps_the_copies_equal"]),
    Mistake("tp-sample-padded-on-the-left", 8, C8,
            [("        logits, _ = model(F.pad(window, (0, model.block_size - window.shape[1])))",
              "        logits, _ = model(F.pad(window, (model.block_size - window.shape[1], 0)))"),
             ("        logits = logits[:, window.shape[1] - 1] / args.temperature",
              "        logits = logits[:, -1] / args.temperature")],
            "the sampling context padded on the left: every position moves",
            "padded on the right, read at the last real token  # TP 6",
            [T_TP + "test_sampling_pads_on_the_right_and_draws_what_one_process_draws"]),

    Mistake("tp-grad-sync-ignored", 8, C8,
            [("model.set_requires_gradient_sync(every or i == len(batches) - 1)",
              "model.set_requires_gradient_sync(True)")],
            "--grad-sync ignored: every micro-batch reduce-scatters, while the log says the whole "
            "gradients are held", "set_requires_gradient_sync(every or last)  # FSDP 7",
            [T_TP + "test_fsdp_under_tp_reduce_scatters_as_grad_sync_says_and_keeps_the_last_"
             "block"]),
    Mistake("tp-last-block-resharded", 8, C8,
            [("reshard_after_forward=reshard and not last)", "reshard_after_forward=reshard)")],
            "the last block freed after its forward, though its backward comes next: gathered "
            "again at once", "reshard_after_forward=reshard and not last",
            [T_TP + "test_fsdp_under_tp_reduce_scatters_as_grad_sync_says_and_keeps_the_last_"
             "block"]),
    Mistake("tp-sp-dropout-by-tp-rank", 8, C8,
            [("    return run.rank if run.args.sequence_parallel == \"on\" else run.dp_rank",
              "    return run.rank % run.args.tp if run.args.sequence_parallel == \"on\" "
              "else run.dp_rank")],
            "sequence parallelism's dropout seeded by tp rank: the rows repeat each other's masks",
            "dropout_stream: by rank (global) under sequence parallelism  # TP 2",
            [T_TP + "test_sequence_parallel_masks_differ_across_rows_too"], ["--dropout", "0.1"]),
    Mistake("tp-whole-gradients-counted-whole", 8, C8,
            [("    whole = 4 * sum(p.numel() // (args.tp if s else 1)  # TP 3: fp32, TP's part\n"
              "                    for p, s in zip(model.parameters(), split)) / 2**20",
              "    whole = 4 * sum(p.numel() for p in model.parameters()) / 2**20")],
            "the gradients held under --grad-sync last counted at the model's size: a DTensor's "
            "numel() is the whole parameter's, not the rank's", "p.numel() // tp where TP splits it",
            [T_TP + "test_the_whole_gradients_a_rank_holds_are_its_tp_part"]),
    Mistake("tp-loss-in-bf16", 8, C8,
            [("        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())",
              "        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())")],
            "the training loss computed from bf16 logits under --amp bf16: the log-softmax over "
            "the vocabulary rounds in bf16", "cross_entropy(logits...float(), ...)",
            [T_TP + "test_bf16_with_recomputation_and_dropout_logs_one_processs_numbers"],
            ["--amp", "bf16"]),

    Mistake("tp-unfinished-step-resumed", 8, C8,
            [("    done = sorted((s for s in steps if complete(s) and not cut_short(s)), key=steps.get)",
              "    done = sorted(steps, key=steps.get)")],
            "every step folder taken for complete in the twin's own copy: a save killed before "
            "its .metadata is resumed", "complete(s) and not cut_short(s)", [RULE]),

    # chapter 9: PP
    Mistake("pp-lr-of-the-next-step", 9, C9,
            [('        group["lr"] = lr_at(step, args)',
              '        group["lr"] = lr_at(step + 1, args)')],
            "each step applies the next step's learning rate: the warmup skips a step, and the "
            "log still shows the schedule's", "lr_at(step) before the step",
            [T_PP + SCHEDULE]),
    Mistake("pp-lr-logged-ahead", 9, C9,
            [("lr_at(step - 1, self.args):.2e}", "lr_at(step, self.args):.2e}")],
            "the log shows the learning rate of the step after the one it reports",
            "the log's lr: lr_at(done - 1)", [T_PP + SCHEDULE]),
    Mistake("pp-recomputation-draws-new-masks", 9, C9,
            [("        for block in self.blocks.values():\n"
              "            if self.grad_checkpointing and self.training:  # keep block inputs; "
              "recompute the rest\n"
              "                x = checkpoint(block, x, use_reentrant=False)",
              "        for block in self.blocks.values():\n"
              "            if self.grad_checkpointing and self.training:  # keep block inputs; "
              "recompute the rest\n"
              "                x = checkpoint(block, x, use_reentrant=False, "
              "preserve_rng_state=False)")],
            "a stage recomputes its blocks without the forward's random state: with dropout the "
            "backward drops other units than the forward did",
            "checkpoint keeps the RNG state (its default)",
            [T_PP + "test_dropout_in_the_pipeline_draws_what_one_process_draws"],
            ["--dropout", "0.1", "--grad-checkpointing"]),
    Mistake("pp-export-of-local-shards", 9, C9,
            [("    stage = get_model_state_dict(raw_model, options=options)",
              "    stage = {k: v.to_local() for k, v in raw_model.state_dict().items()}")],
            "the export takes each rank's shards of its stage, not the stage gathered over its "
            "replicas: right only at dp 1", "get_model_state_dict(full_state_dict=True)",
            [T_PP + "test_the_dp2_x_pp2_export_holds_every_whole_weight_and_samples_in_chapter_3"]),
    Mistake("pp-export-from-the-first-ranks", 9, C9,
            [("    dist.gather_object(stage if run.dp_rank == 0 else {}, stages, dst=0)",
              "    dist.gather_object(stage if run.rank < run.args.pp else {}, stages, dst=0)")],
            "rank 0 gathers the stages of the first pp ranks, as if a replica were consecutive "
            "ranks: at dp 2 the export holds stage 0 alone",
            "each stage from the replica 0 rank that holds it",
            [T_PP + "test_the_dp2_x_pp2_export_holds_every_whole_weight_and_samples_in_chapter_3"]),
    Mistake("pp-mfu-peak-of-one-replica", 9, C9,
            [("    return peak * 1e12 * run.world_size, note",
              "    return peak * 1e12 * run.dp_size, note")],
            "MFU's denominator counts one replica's GPUs, not every stage's: pp times too high",
            "peak x every GPU of the job",
            [T_BAD + "test_mfu_counts_the_peak_of_every_gpu_of_the_job"]),
    Mistake("pp-data-check-counts-ranks", 9, C9,
            [("load_data(args, run.dp_size)  # PP 3: a batch per replica",
              "load_data(args, run.world_size)  # PP 3: a batch per replica")],
            "the data check sized for a batch per rank, where a replica's stages share one: at pp "
            "2, data that is enough is refused", "a batch per replica",
            [T_BAD + "test_the_data_check_counts_the_replicas_where_a_rows_ranks_share_a_batch"]),
    Mistake("pp-sample-drawn-in-training-mode", 9, C9,
            [("        raw_model.eval()\n        start = 10 if unit", "        start = 10 if unit")],
            "the closing sample drawn with the model still in training mode: dropout on while it "
            "generates", "raw_model.eval() before sampling", [T_PP + SCHEDULE],
            ["--dropout", "0.1"]),
    Mistake("pp-recomputation-on-the-first-stage-only", 9, C9,
            [("    for part in raw_model.parts:\n        part.grad_checkpointing = "
              "args.grad_checkpointing",
              "    raw_model.parts[0].grad_checkpointing = args.grad_checkpointing")],
            "--grad-checkpointing set on a rank's first stage alone: with interleaved stages the "
            "second keeps every activation", "every stage this rank holds recomputes",
            [T_PP + "test_interleaved_stages_compute_what_one_process_computes_from_chapter_7s_"
                    "checkpoint"], ["--grad-checkpointing"]),
    Mistake("pp-padding-counted", 9, C9,
            [("        totals[1] += (y != -100).sum()  # FSDP 5: the padding counts no token\n",
              "        totals[1] += y.numel()\n")],
            "the validation padding's targets counted as tokens", "(y != -100).sum()  # FSDP 5",
            [T_PP + "test_dp2_x_pp2_logs_one_processs_norms_about_a_binding_clip_and_padded_"
             "validation"]),
    Mistake("pp-every-stage-scores-validation", 9, C9,
            [("        if logits is None:  # PP 7: only the last stage scores; the others add 0\n"
              "            continue\n", "        if logits is None:\n"
              "            logits = torch.zeros(*y.shape, 256, device=y.device)\n")],
            "every stage adds a validation loss and count, not the last alone",
            "only the last stage scores; the others add 0  # PP 7",
            [T_PP + "test_pp2_at_2_processes_computes_what_one_process_computes"]),
    Mistake("pp-loss-not-scaled-by-stages", 9, C9,
            [("    loss = mean_over_ranks(loss) * args.pp  # a collective of every rank",
              "    loss = mean_over_ranks(loss)  # a collective of every rank")],
            "the logged loss averaged over every rank, the stages that add 0 included",
            "mean_over_ranks(loss) * args.pp  # PP 1",
            [T_PP + "test_pp2_at_2_processes_computes_what_one_process_computes"]),
    Mistake("pp-tied-gradients-not-summed", 9, C9,
            [("    sum_tied_gradients(run, model)  # PP 4: a collective of the two ends\n", "")],
            "the tied embedding and head's two copies each step on their own gradient",
            "sum_tied_gradients(run, model)  # PP 4",
            [T_PP + "test_the_tied_copies_stay_equal_and_the_export_is_chapter_3s_model"]),
    Mistake("pp-data-by-rank", 9, C9,
            [WINDOWS_BY_RANK],
            "the windows dealt by rank: the stages of one column read different batches",
            "Windows(..., run.dp_rank, run.dp_size, ...)  # PP 3",
            [T_PP + "test_dp2_x_pp2_at_4_processes_computes_what_ddp_computes"]),
    Mistake("pp-norm-of-one-stage", 9, C9,
            [("    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=run.mesh.get_group(\"pp\"))  "
              "# PP 8: stages\n", "")],
            "each stage clips by its own gradient norm, not the whole model's",
            "the squared norms summed over the stages  # PP 8",
            [T_PP + "test_pp2_at_2_processes_computes_what_one_process_computes"]),
    Mistake("pp-blocks-cut-unevenly", 9, C9,
            [("    return range(first, first + size + (stage >= light))",
              "    return range(first, first + size + (stage == 0) * extra)")],
            "the blocks pp does not divide all go to stage 0: stages overlap",
            "stage_blocks: contiguous, as even as can be  # PP 5",
            [T_PP + "test_the_stages_cut_the_blocks_once_in_order"]),
    Mistake("pp-activations-sent-in-fp32", 9, C9,
            [("    return run.policy.param_dtype or torch.float32  # PP 7",
              "    return torch.float32  # PP 7")],
            "the activations between stages declared fp32 under bf16: the stages disagree, NaN",
            "activation_dtype(): FSDP's compute dtype  # PP 7",
            [T_PP + "test_dropout_draws_its_own_masks_on_every_rank_of_dp2_x_pp2"],
            ["--amp", "bf16"]),
    Mistake("pp-tied-traffic-of-the-whole-matrix", 9, C9,
            [("    tied = vocab_size * args.n_embd * 4 / run.dp_size  # PP 4",
              "    tied = vocab_size * args.n_embd * 4  # PP 4")],
            "the traffic line's tied all-reduce counted as the whole matrix, not a replica's shard",
            "vocab x C x 4 / dp_size  # PP 4",
            [T_PP + "test_the_traffic_line_gives_the_tied_all_reduce_that_the_end_stages_send"]),
    Mistake("pp-dropout-seeded-by-stage", 9, C9,
            [("    torch.manual_seed(args.seed + run.rank)  # DDP 6",
              "    torch.manual_seed(args.seed + run.stage)  # DDP 6")],
            "dropout seeded by stage: the replicas of a stage drop the same units",
            "torch.manual_seed(args.seed + run.rank)  # DDP 6",
            [T_PP + "test_dropout_draws_its_own_masks_on_every_rank_of_dp2_x_pp2"],
            ["--dropout", "0.1"]),
    Mistake("pp-dropout-seeded-by-replica", 9, C9,
            [("    torch.manual_seed(args.seed + run.rank)  # DDP 6",
              "    torch.manual_seed(args.seed + run.dp_rank)  # DDP 6")],
            "dropout seeded by replica, as DDP's rank: a column's stages repeat one mask stream",
            "torch.manual_seed(args.seed + run.rank)  # DDP 6",
            [T_PP + "test_dropout_draws_its_own_masks_on_every_rank_of_dp2_x_pp2"],
            ["--dropout", "0.1"]),

    Mistake("pp-interleaved-sends-counted-once", 9, C9,
            [("    tensor *= args.stages_per_rank  # PP 5: a micro-batch passes each rank once per "
              "stage it holds\n", "")],
            "the traffic line counts one send per micro-batch with several stages per rank",
            "tensor *= args.stages_per_rank  # PP 5",
            [T_PP + "test_interleaved_stages_compute_what_one_process_computes_from_chapter_7s_checkpoint"]),
    Mistake("pp-interleaved-roots-left-gathered", 9, C9,
            [("    for module in [*model.modules(), *model.parts]:  # PP 5: the stages are roots, "
              "not children\n", "    for module in model.modules():\n")],
            "after evaluation only the registered modules resharded: the stages, FSDP roots that "
            "are not children, keep the embeddings and head gathered",
            "[*model.modules(), *model.parts]  # PP 5", [T_PP + "test_interleaved_stages_compute_what_one_process_computes_from_chapter_7s_checkpoint"]),
    Mistake("pp-interleaved-gradients-not-divided", 9, C9,
            [("        return ScheduleInterleaved1F1B(stages, run.args.grad_accum, "
              "loss_fn=mean_token_loss,\n                                       scale_grads=True)",
              "        return ScheduleInterleaved1F1B(stages, run.args.grad_accum, "
              "loss_fn=mean_token_loss,\n                                       scale_grads=False)")],
            "the interleaved schedule's gradients left as the sum of the micro-batches' means",
            "scale_grads=True, as for the other schedules  # PP 1", [T_PP + "test_interleaved_stages_compute_what_one_process_computes_from_chapter_7s_checkpoint"]),
    Mistake("pp-interleaved-blocks-as-a-range", 9, C9,
            [("    if len(model.parts) > 1:  # PP 5: interleaved stages hold blocks that are not "
              "neighbours\n        span = \"blocks \" + \", \".join(blocks)\n", "")],
            "the memory line shows a rank's interleaved blocks 0 and 2 as the run 0-2",
            "each block named when the stages are interleaved  # PP 5", [T_PP + "test_interleaved_stages_compute_what_one_process_computes_from_chapter_7s_checkpoint"]),

    Mistake("pp-whole-gradients-at-compute-width", 9, C9,
            [("    in_step = sum(p.numel() for p in model.parameters()) * (activation_dtype(run)"
              ".itemsize + 4)", "    in_step = sum(p.numel() for p in model.parameters()) * 2 * "
              "activation_dtype(run).itemsize")],
            "the memory line counts the whole gradients of a step in the compute dtype: under "
            "bf16 FSDP accumulates them in fp32 while its sync is off",
            "gathered weights in the compute dtype, whole gradients in fp32  # PP 5",
            [T_PP + "test_inside_a_step_a_rank_holds_its_stage_gathered_and_its_gradients_whole"]),

    Mistake("pp-interleaved-memory-of-one-stage", 9, C9,
            [("    in_step = sum(p.numel() for p in model.parameters()) * (activation_dtype(run)"
              ".itemsize + 4)", "    in_step = sum(p.numel() for p in model.parts[0].parameters()"
              ") * (activation_dtype(run).itemsize + 4)")],
            "the memory line counts a rank's first stage alone inside a step",
            "every part the rank holds  # PP 5", [T_IL]),
    Mistake("pp-interleaved-middle-stages-without-root", 9, C9,
            [("        fully_shard(part, mesh=mesh, mp_policy=run.policy)  # the root: whole until "
              "its backward", "        if part.tok_emb is not None or part.head is not None:\n"
              "            fully_shard(part, mesh=mesh, mp_policy=run.policy)")],
            "only the stages that hold an end made FSDP roots: a middle stage's blocks, roots of "
            "their own, reduce-scatter every micro-batch", "fully_shard(part) for every stage  "
            "# PP 5", [T_IL]),
    Mistake("pp-interleaved-rounds-of-pp", 9, C9,
            [("    rounds = max(1, args.grad_accum // args.pp)",
              "    rounds = args.grad_accum // args.pp")],
            "torch's rounds counted as --grad-accum // --pp without its floor of one: "
            "--grad-accum 1 dies in a ZeroDivisionError", "max(1, K // pp)  # PP 1",
            [T_PP + "test_bad_inputs_are_one_line_and_exit_code_2"]),
    Mistake("pp-interleaved-forward-from-the-wrong-rank", 9, C9,
            [("group_src=(run.stage - 1) % pp)", "group_src=abs(run.stage - 1))")],
            "the forward pipeline's stage before as abs(stage - 1): right at pp 2, but at pp 3 "
            "rank 0 waits for rank 1, which waits for it", "(run.stage - 1) % pp  # PP 7",
            [T_PP + "test_three_ranks_of_interleaved_stages_evaluate_and_sample_as_one_process"]),
    Mistake("pp-checkpointing-set-on-the-container", 9, C9,
            [("    for part in raw_model.parts:\n        part.grad_checkpointing = "
              "args.grad_checkpointing\n",
              "    raw_model.grad_checkpointing = args.grad_checkpointing\n")],
            "--grad-checkpointing set on the rank's container, which runs no forward: nothing "
            "is recomputed", "each stage told  # PP 5",
            [T_PP + "test_recomputation_keeps_a_micro_batch_to_its_blocks_inputs"]),

    # chapter 10: CP
    Mistake("cp-ring-peers-by-global-rank", 10, C10,
            [("        dist.P2POp(dist.isend, send, group=group, group_peer=(r + 1) % n),",
              "        dist.P2POp(dist.isend, send, (r + 1) % n, group=group),"),
             ("        dist.P2POp(dist.irecv, receive, group=group, group_peer=(r - 1) % n)])",
              "        dist.P2POp(dist.irecv, receive, (r - 1) % n, group=group)])")],
            "the ring's peers named by global rank: right at dp 1, another row's ranks at dp 2",
            "group_peer=: the rank within the row's group  # CP 5",
            [T_CP + "test_two_rings_at_dp2_x_cp2_log_one_processs_norms_and_padding"], ["--cp-rotate", "ring"]),
    Mistake("cp-backward-divided-by-micro-batches", 10, C10,
            [("        loss.backward()  # CP 4: each block reduce-scatters its K, V gradients",
              "        (loss / len(batches)).backward()  # CP 4: each block reduce-scatters its K, V "
              "gradients")],
            "each micro-batch's backward divided by --grad-accum again, as in chapter 3: the "
            "logged loss right, the gradients K times too small",
            "scale = world size / all ranks' targets, once  # CP 3",
            [T_CP + "test_two_rings_at_dp2_x_cp2_log_one_processs_norms_and_padding"]),
    Mistake("cp-padding-counted", 10, C10,
            [("        totals[1] += (y != -100).sum()  # FSDP 5: the padding counts no token\n",
              "        totals[1] += y.numel()\n")],
            "the validation padding's targets counted as tokens", "(y != -100).sum()  # FSDP 5",
            [T_CP + "test_a_padded_evaluation_at_dp2_x_cp2_counts_each_target_once"]),
    Mistake("cp-dropout-by-row", 10, C10,
            [("    torch.manual_seed(args.seed + run.rank)  # DDP 6: each rank draws its own dropout "
              "masks\n", "    torch.manual_seed(args.seed + run.dp_rank)\n")],
            "dropout seeded by row: a row's cp ranks drop the same units of different tokens",
            "torch.manual_seed(args.seed + run.rank)  # DDP 6",
            [T_CP + "test_dropout_draws_its_own_masks_on_every_rank_of_a_row"], ["--dropout", "0.1"]),
    Mistake("cp-grad-sync-ignored", 10, C10,
            [("model.set_requires_gradient_sync(every or i == len(batches) - 1)",
              "model.set_requires_gradient_sync(True)")],
            "--grad-sync ignored: every micro-batch reduce-scatters, while the log says the whole "
            "gradients are held", "set_requires_gradient_sync(every or last)  # FSDP 7",
            [T_CP + "test_fsdp_under_cp_reduce_scatters_as_grad_sync_says_and_keeps_the_last_"
             "block"]),
    Mistake("cp-last-block-resharded", 10, C10,
            [("reshard_after_forward=reshard and not last)", "reshard_after_forward=reshard)")],
            "the last block freed after its forward, though its backward comes next: gathered "
            "again at once", "reshard_after_forward=reshard and not last",
            [T_CP + "test_fsdp_under_cp_reduce_scatters_as_grad_sync_says_and_keeps_the_last_"
             "block"]),
    Mistake("cp-positions-local", 10, C10,
            [("        if context is not None:  # CP 6: the tokens' places in the whole sequence\n"
              "            positions = context.positions\n", "")],
            "positions counted from 0 on every rank: each chunk embedded as the sequence's start",
            "positions = context.positions  # CP 6",
            [T_CP + "test_cp2_logs_one_processs_losses_gradient_norms_and_validation_losses"]),
    Mistake("cp-contiguous-chunks", 10, C10,
            [("    chunks = (cp_rank, 2 * cp - 1 - cp_rank)",
              "    chunks = (2 * cp_rank, 2 * cp_rank + 1)")],
            "contiguous shares: rank 0 the first half, rank 1 the second (unequal work)",
            "chunks i and 2 cp - 1 - i  # CP 3",
            [T_CP + "test_each_rank_holds_an_early_chunk_and_a_late_one"]),
    Mistake("cp-gather-backward-without-reduce-scatter", 10, C10,
            [("        dist.reduce_scatter_single(mine, parts, group=ctx.group)  # CP 4: my keys' "
              "summed gradients\n",
              "        mine = parts.chunk(n)[dist.get_rank(ctx.group)].clone()\n")],
            "the all-gather's backward keeps its own slice: other ranks' queries' gradients lost",
            "GatherContext.backward: a reduce-scatter  # CP 4",
            [T_CP + "test_cp2_logs_one_processs_losses_gradient_norms_and_validation_losses"]),
    Mistake("cp-validation-counted-per-rank", 10, C10,
            [("        totals[1] += (y != -100).sum()  # FSDP 5: the padding counts no token\n"
              "    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # CP 3",
              "        totals[1] += (y != -100).sum() * context.cp\n"
              "    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # CP 3")],
            "validation tokens counted as if each rank held whole sequences",
            "each token on one rank: counted once  # CP 3",
            [T_CP + "test_cp2_logs_one_processs_losses_gradient_norms_and_validation_losses"]),
    Mistake("cp-rows-by-global-rank", 10, C10,
            [WINDOWS_BY_RANK],
            "the windows dealt by rank: a row's ranks hold chunks of different sequences",
            "Windows(..., run.dp_rank, run.dp_size, ...)  # CP 2",
            [T_CP + "test_dp2_x_cp2_on_two_nodes_logs_ddps_losses_and_gradient_norms"]),
    Mistake("cp-loss-mean-per-rank", 10, C10,
            [("        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), "
              "reduction=\"sum\") * scale",
              "        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / "
              "len(batches)")],
            "each rank's mean loss over its own tokens, as one process computes it",
            "a sum over the global count of targets  # CP 3",
            [T_CP + "test_the_training_loss_is_the_global_sum_over_the_global_count_of_targets"]),
    Mistake("cp-streams-restored-at-any-cp", 10, C10,
            [("    if saved == (1, run.args.cp, run.world_size):",
              "    if saved[::2] == (1, run.world_size):")],
            "random streams restored by rank at another --cp: each rank's stream drew masks "
            "for other chunks",
            "restored only at the cp that saved them  # CP 3",
            [T_CP + "test_random_streams_come_back_only_at_the_cp_that_saved_them"]),

    # chapter 11: 4-D
    Mistake("4d-tp-not-innermost", 11, C11,
            [('("pp", "dp", "cp", "tp")', '("pp", "dp", "tp", "cp")'),
             ("(args.pp, world_size // inner, args.cp, args.tp)",
              "(args.pp, world_size // inner, args.tp, args.cp)")],
            "the mesh's dims as (pp, dp, tp, cp): a tp group's ranks cp apart, not neighbours",
            "tp innermost: a tp group is consecutive ranks, one node  # 4D 1",
            [T_4D + "test_the_layout_line_shows_one_ranks_place_and_groups"]),
    Mistake("4d-fsdp-over-dp-alone", 11, C11,
            [('    mesh = run.mesh["dp", "cp"]._flatten("dp_cp")  # 4D 5',
              '    mesh = run.mesh["dp"]  # 4D 5')],
            "FSDP over the dp ranks alone: a replica's cp ranks never add up their gradients",
            'FSDP over mesh["dp", "cp"] flattened  # 4D 5',
            [EIGHT_EQUAL]),
    Mistake("4d-cp-gather-over-tp", 11, C11,
            [('Context(mesh["cp"].get_group(),', 'Context(mesh["tp"].get_group(),')],
            "the context built on the tp group: keys and values gathered from the wrong ranks",
            'Context(mesh["cp"].get_group(), ...)  # 4D 3',
            [EIGHT_EQUAL]),
    Mistake("4d-positions-local", 11, C11,
            [("self.pos_emb(context.positions))  # 4D 3",
              "self.pos_emb(torch.arange(x.shape[1], device=x.device)))")],
            "positions 0 .. T / cp - 1 on every cp rank, as chapter 9 counts them",
            "self.pos_emb(context.positions)  # 4D 3",
            [EIGHT_EQUAL]),
    Mistake("4d-norm-over-one-mesh", 11, C11,
            [("    norms = [nn.utils.get_total_norm([p.grad for p in ps if p is not twin])\n"
              "             for ps in on_mesh.values()]",
              "    norms = [nn.utils.get_total_norm([p.grad for p in model.parameters() if p is not "
              "twin])]")],
            "chapter 9's norm: one get_total_norm over parameters on two meshes",
            "the norm per mesh, then summed  # 4D 9",
            [EIGHT_EQUAL]),
    Mistake("4d-evaluation-on-whole-sequences", 11, C11,
            [("    batches = [run.context.share(x, y) for x, y in batches]  # 4D 3: this rank's "
              "tokens\n", "")],
            "validation batches left whole on every cp rank: CP's forward on the whole sequence",
            "batches = [run.context.share(x, y) ...]  # 4D 3",
            [EIGHT_EQUAL]),
    Mistake("4d-stream-not-split-by-tp", 11, C11,
            [('    split = run.args.tp if run.args.sequence_parallel == "on" else 1\n',
              "    split = 1\n")],
            "the stages expect a cp share whole, but sequence parallelism sends 1 / tp of it",
            "stream_shape: (B, T / tp, C) under SP  # 4D 6",
            [EIGHT_EQUAL]),
    Mistake("4d-tokens-counted-per-rank", 11, C11,
            [("    return run.args.batch_size * run.args.block_size * run.args.grad_accum * "
              "run.dp_size  # PP 3",
              "    return run.args.batch_size * run.args.block_size * run.args.grad_accum * "
              "run.world_size")],
            "the global batch counted over every rank, not the dp replicas",
            "tokens_per_step(): x dp_size  # PP 3",
            [T_4D + "test_benchmark_scaling_reads_the_4d_trainers_summary"]),
    Mistake("4d-cp-contiguous-chunks", 11, C11,
            [("    chunks = (cp_rank, 2 * cp - 1 - cp_rank)", "    chunks = (2 * cp_rank, 2 * cp_rank + 1)")],
            "each cp rank holds contiguous tokens: the same numbers, the last rank most of the work",
            "chunks i and 2cp - 1 - i: an early one and a late one  # 4D 3",
            [T_4D + "test_each_cp_rank_holds_an_early_chunk_and_a_late_one"]),
    Mistake("4d-tied-summed-over-pp", 11, C11,
            [("group=run.tied)  # PP 4: SUM", "group=run.mesh[\"pp\"].get_group())  # PP 4: SUM")],
            "the tied gradient summed over the pp group: right at pp 2, a middle stage never joins "
            "at pp 3",
            "the end stages' own group  # PP 4",
            [T_4D + "test_pp3_over_4_blocks_sums_the_tied_gradient_over_the_end_stages_alone"]),
    Mistake("4d-pp1-through-the-schedule", 11, C11,
            [("        if args.pp > 1:\n            schedule.step(",
              "        if args.pp >= 1:\n            schedule.step(")],
            "--pp 1 through the pipeline schedule: whole gradients held through every step",
            "no schedule at --pp 1: each backward reduce-scatters  # 4D 8",
            [T_4D + "test_at_pp1_each_micro_batch_reduce_scatters_and_under_a_schedule_the_step_once"],
            ["--pp", "1"]),
    Mistake("4d-dropout-sp-off-by-replica", 11, C11,
            [("    return run.rank if run.args.sequence_parallel == \"on\" else run.rank // run.args.tp",
              "    return run.rank if run.args.sequence_parallel == \"on\" else run.dp_rank")],
            "dropout with SP off seeded by replica: a replica's cp ranks drop their different tokens "
            "with one mask",
            "dropout_stream(): by tp group where its ranks hold copies  # 4D 5",
            [T_4D + "test_the_dropout_streams_and_the_tokens_per_step_go_by_the_right_ranks"],
            ["--dropout", "0.1", "--sequence-parallel", "off"]),
    Mistake("4d-tokens-counted-by-cp", 11, C11,
            [("run.args.grad_accum * run.dp_size  # PP 3",
              "run.args.grad_accum * run.dp_size * run.args.cp  # PP 3")],
            "the tokens per step counted once per cp rank: the pace logged cp times too high",
            "tokens_per_step(): x dp_size alone  # PP 3",
            [T_4D + "test_the_dropout_streams_and_the_tokens_per_step_go_by_the_right_ranks"]),
    Mistake("4d-memory-line-12-bytes", 11, C11,
            [("({parts}) {16 * n / 2**20:.2f} MiB, {n:,}", "({parts}) {12 * n / 2**20:.2f} MiB, {n:,}")],
            "the memory line counts 12 bytes a parameter: the gradients left out",
            "16 bytes: weights, gradients, two AdamW moments",
            [T_4D + "test_the_memory_line_counts_16_bytes_per_parameter_of_a_ranks_shards"]),
    Mistake("4d-interleaved-sends-counted-per-stage", 11, C11,
            [("    hops = K * (2 * V - 1)", "    hops = K * V")],
            "the traffic line counts one send per stage a rank holds, not the gradients its "
            "later stages send back", "K x (2 V - 1) sends a step  # PP 5",
            [T_4D + "test_interleaved_stages_under_tp_compute_what_one_process_computes"]),
    Mistake("4d-embedding-gradient-counted-split", 11, C11,
            [("    grads = 4 * (gathered + emb - emb // run.args.tp) * (run.args.pp > 1)",
              "    grads = 4 * gathered * (run.args.pp > 1)")],
            "the memory line counts the embedding's whole gradient as TP's part: torch's "
            "vocabulary-split embedding gets it back whole", "emb - emb // tp more  # 4D 5",
            [T_4D + "test_inside_a_step_a_rank_holds_its_stages_gathered_and_their_gradients_"
             "whole"]),
    Mistake("4d-gradients-counted-at-pp1", 11, C11,
            [("    grads = 4 * (gathered + emb - emb // run.args.tp) * (run.args.pp > 1)",
              "    grads = 4 * (gathered + emb - emb // run.args.tp)")],
            "the memory line counts whole gradients at --pp 1, where each unit's are "
            "reduce-scattered after its backward", "0 at --pp 1  # 4D 1",
            [T_4D + "test_inside_a_step_a_rank_holds_its_stages_gathered_and_their_gradients_"
             "whole"]),
    Mistake("4d-reshard-flag-as-a-truth-value", 11, C11,
            [('    reshard = run.args.reshard_after_forward == "yes"',
              '    reshard = bool(run.args.reshard_after_forward)')],
            "--reshard-after-forward read as a truth value: \"no\" reshards too, more all-gathers",
            'reshard_after_forward == "yes"',
            [T_4D + "test_at_pp1_each_micro_batch_reduce_scatters_and_under_a_schedule_the_step_once"]),
    Mistake("4d-kv-gradients-summed-in-bf16", 11, C11,
            [("        parts = torch.cat(grad.chunk(n, dim=-2)).float()\n",
              "        parts = torch.cat(grad.chunk(n, dim=-2))\n")],
            "dK and dV reduce-scattered in bf16 under --amp bf16: each addition rounds",
            "the reduce-scatter in fp32, rounded once  # 4D 4",
            [T_4D + "test_key_and_value_gradients_are_summed_in_fp32"], ["--amp", "bf16"]),
    Mistake("4d-padding-counted", 11, C11,
            [("        totals[1] += (y != -100).sum()  # FSDP 5: the padding counts no token\n",
              "        totals[1] += y.numel()\n")],
            "the validation padding's targets counted as tokens", "(y != -100).sum()  # FSDP 5",
            [T_4D + "test_dp2_pp2_tp2_logs_one_processs_norms_about_a_binding_clip_and_padded_validation"],
            ["--pp", "1", "--cp", "1", "--tp", "2"]),
    Mistake("4d-dropout-by-rank-with-sp-off", 11, C11,
            [("    return run.rank if run.args.sequence_parallel == \"on\" else run.rank // run.args.tp",
              "    return run.rank")],
            "dropout seeded by rank with sequence parallelism off: a tp pair drops its copies of "
            "one stream apart",
            "dropout_stream(): by tp group where its ranks hold copies  # 4D 5",
            [T_4D + "test_with_dropout_and_sp_off_dp2_x_tp2_logs_ddps_numbers_and_a_tp_pair_drops_alike"],
            ["--dropout", "0.1", "--sequence-parallel", "off"]),
    Mistake("4d-dropout-by-tp-group-under-sp", 11, C11,
            [("    return run.rank if run.args.sequence_parallel == \"on\" else run.rank // run.args.tp",
              "    return run.rank // run.args.tp")],
            "dropout seeded by tp group under sequence parallelism: a pair's ranks drop the same "
            "units of different tokens",
            "dropout_stream(): by rank where each rank holds its own tokens  # 4D 5",
            [T_4D + "test_with_sequence_parallelism_every_rank_drops_its_own_tokens_with_its_own_mask"],
            ["--dropout", "0.1"]),
    Mistake("4d-tied-traffic-at-the-activations-width", 11, C11,
            [("vocab_size * args.n_embd * 4 / (run.world_size // args.pp)",
              "vocab_size * args.n_embd * width / (run.world_size // args.pp)")],
            "the traffic line's tied shard at the activations' width: half its bytes under bf16",
            "the tied gradient's shard in fp32 (4 bytes) whatever --amp  # 4D 6",
            [T_4D + "test_under_bf16_the_traffic_line_counts_the_tied_shard_in_fp32"],
            ["--amp", "bf16"]),
    Mistake("4d-sample-seeded-by-rank", 11, C11,
            [("torch.manual_seed(run.args.seed + run.dp_rank)  # 4D 10: a replica's ranks draw "
              "alike", "torch.manual_seed(run.args.seed + run.rank)")],
            "sampling seeded by rank: tp ranks draw different tokens from the same logits",
            "seed + dp_rank: a replica's ranks draw alike  # 4D 10",
            [T_4D + "test_the_export_is_one_process_model_and_samples_in_chapter_3"]),
    Mistake("4d-traffic-blocks-rounded-up", 11, C11,
            [("sum(len(stage_blocks(args.n_layer, args.pp * V, stage)) for stage in mine)",
              "math.ceil(args.n_layer / args.pp)")],
            "the traffic line's blocks as n_layer / pp rounded up: at an uneven cut, stage 0's "
            "count and its tp and cp bytes too high",
            "stage_blocks() of rank 0's stages: the blocks it holds",
            [T_4D + "test_at_an_uneven_cut_the_traffic_line_counts_stage_0s_blocks"]),
    Mistake("4d-validation-summed-in-bf16", 11, C11,
            [('loss = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten(), reduction="sum")',
              'loss = F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="sum")')],
            "the validation cross-entropy taken and summed in the logits' bf16 under --amp bf16",
            "logits.float() before the sum  # 4D 8",
            [T_4D + "test_under_bf16_the_validation_loss_is_summed_in_fp32"], ["--amp", "bf16"]),
    Mistake("4d-streams-restored-across-sp", 11, C11,
            [('    if [saved.get(k) for k in ("pp", "cp", "tp", "sequence_parallel")] + '
              '[len(state["rng"])] == [\n'
              "            args.pp, args.cp, args.tp, args.sequence_parallel, run.world_size]:",
              '    if [saved.get(k) for k in ("pp", "cp", "tp")] + [len(state["rng"])] == [\n'
              "            args.pp, args.cp, args.tp, run.world_size]:")],
            "random streams restored at the layout that saved them whatever --sequence-parallel: "
            "saved with it, a tp pair without it draws its copies' masks apart",
            "restored only at the same --sequence-parallel too  # 4D 7",
            [T_4D + "test_random_streams_come_back_only_at_the_layout_and_sp_that_saved_them"],
            ["--dropout", "0.1"]),
    Mistake("moe-split-sizes-not-exchanged", 12, C12,
            [("        got = torch.empty_like(counts)  # from each rank: its copies for each of my "
              "experts\n        dist.all_to_all_single(got, counts, group=group)  # EP 4: E / ep "
              "counts to each rank\n",
              "        got = counts.clone()  # as many as I send\n")],
            "the split sizes of the token all-to-all guessed from the rank's own counts, not "
            "exchanged first", "the counts' all-to-all before the tokens'  # EP 4", [MOE_EQUAL]),
    Mistake("moe-balance-of-one-rank", 12, C12,
            [("        if self.groups:\n            counts = counts.clone()\n"
              "            dist.all_reduce(counts, group=self.groups.world)  # EP 3: every rank's "
              "copies\n            sums = SumOverRanks.apply(sums, self.groups.world)  # EP 3: "
              "every rank's, with grad\n", "")],
            "the balance loss from each rank's own token counts and probabilities",
            "counts and probabilities all-reduced over every rank  # EP 3", [MOE_EQUAL]),
    Mistake("moe-reverse-all-to-all-missing", 12, C12,
            [("        rows = AllToAll.apply(copies, sent, received, group)  # EP 4: each copy to "
              "its expert\n",
              "        rows = copies.new_empty((sum(received), copies.shape[1]))\n"
              "        dist.all_to_all_single(rows, copies, received, sent, group=group)\n")],
            "the tokens sent to their experts by a plain all_to_all_single: no gradient goes "
            "back to the tokens' ranks", "AllToAll, whose backward is the opposite all-to-all  "
            "# EP 4", [MOE_EQUAL]),
    Mistake("moe-gates-detached", 12, C12,
            [("            gates = gates / gates.sum(dim=-1, keepdim=True)  # else the router "
              "learns nothing\n",
              "            gates = (gates / gates.sum(dim=-1, keepdim=True)).detach()\n")],
            "the gates detached: the router learns from the balance loss alone",
            "gates kept in the graph  # EP 7",
            [T_MOE + "test_the_layer_sends_each_token_to_its_k_experts_and_the_router_learns_"
             "through_the_gates"]),
    Mistake("moe-gates-not-rescaled", 12, C12,
            [("        if self.top_k > 1:  # EP 7: rescaled to add up to 1; one expert keeps its "
              "probability,\n            gates = gates / gates.sum(dim=-1, keepdim=True)  # else "
              "the router learns nothing\n", "")],
            "the K chosen probabilities used as gates as they are, not rescaled to add up to 1",
            "gates / gates.sum(dim=-1, keepdim=True)  # EP 7",
            [T_MOE + "test_the_layer_sends_each_token_to_its_k_experts_and_the_router_learns_"
             "through_the_gates"]),
    Mistake("moe-experts-numbered-per-rank", 12, C12,
            [("nn.Linear(hidden, n_embd)) for e in held})",
              "nn.Linear(hidden, n_embd)) for e, _ in enumerate(held)})")],
            "each rank numbers its experts from 0: seeded alike, saved under one another's names",
            "experts keyed by their number in the block  # EP 2", [MOE_EQUAL]),
    Mistake("moe-shares-of-one-rank", 12, C12,
            [("        counts, sums = routed_and_sent, probs.sum(dim=0)  # the sums are "
              "differentiable\n",
              "        counts, sums = routed_and_sent, probs.sum(dim=0)\n"
              "        if self.training:\n"
              "            self.load = counts if self.load is None else self.load + counts\n"),
             ("        if self.training:  # the log's shares: training micro-batches only\n"
              "            self.load = counts if self.load is None else self.load + counts\n", "")],
            "the log's expert shares counted from rank 0's tokens only",
            "the shares counted after the all-reduce  # EP 3", [MOE_EQUAL]),
    Mistake("moe-expert-gradients-not-divided-by-ep", 12, C12,
            [("        p.grad.div_(args.ep)  # EP 5: each rank its shard, sending nothing\n",
              "        pass\n")],
            "the experts' gradients left as FSDP averaged them over the column: ep times too "
            "large", "p.grad.div_(args.ep)  # EP 5", [MOE_EQUAL]),
    Mistake("moe-norm-of-own-shards", 12, C12,
            [("    dist.all_reduce(squares, op=dist.ReduceOp.SUM)  # EP 6: every rank's squares, "
              "so the norm\n", "")],
            "the gradient norm of each rank's own shards: ranks clip by different norms",
            "every rank's squares all-reduced  # EP 6", [MOE_EQUAL]),
    Mistake("moe-capacity-of-tokens-not-copies", 12, C12,
            [("        capacity = math.ceil(self.capacity_factor * len(order) / "
              "self.experts_total)\n",
              "        capacity = math.ceil(self.capacity_factor * len(order) // self.top_k / "
              "self.experts_total)\n")],
            "an expert's capacity counted from the tokens, not their K copies: K times too few",
            "c x copies / E  # EP 4",
            [T_MOE + "test_a_capacity_drops_copies_and_the_run_then_depends_on_its_layout"],
            ["--capacity-factor", "2.0"]),
    Mistake("moe-balance-gradient-of-one-rank", 12, C12,
            [("        dist.all_reduce(grad, group=ctx.group)  # EP 3: every rank's gradient of "
              "it\n", "")],
            "the balance loss's all-reduce passes each rank's own gradient back, not every "
            "rank's", "SumOverRanks.backward all-reduces  # EP 3", [MOE_EQUAL],
            ["--aux-weight", "1"]),
    Mistake("moe-export-of-local-shards", 12, C12,
            [("            whole = p.full_tensor()  # EP 2: a collective over the column that holds the "
              "expert", "            whole = p.to_local()")],
            "the export takes each rank's shard of its experts, not the expert gathered over its "
            "column: right only where a column is one rank", "p.full_tensor()  # EP 2",
            [T_MOE + "test_the_export_at_ep_2_holds_every_expert_and_samples_in_one_process"]),
    Mistake("moe-capacity-in-evaluation", 12, C12,
            [("        if not (self.capacity_factor and self.training):",
              "        if not self.capacity_factor:")],
            "the capacity applied in evaluation too: the validation loss drops copies",
            "dropless evaluation: capacity in training only  # EP 4", [T_LAYER],
            ["--capacity-factor", "1.0"]),
    Mistake("moe-router-softmax-in-bf16", 12, C12,
            [(".float().softmax(dim=-1)  # EP 7", ".softmax(dim=-1)  # EP 7")],
            "the router's softmax in the compute dtype: under bf16 the probabilities and the "
            "balance loss round", "the softmax in fp32  # EP 7", [T_LAYER], ["--amp", "bf16"]),
    Mistake("moe-gate-on-the-input", 12, C12,
            [("        out = self.dispatch(x[kept // self.top_k], sent)",
              "        out = self.dispatch(x[kept // self.top_k] * gates.flatten()[kept, None]"
              ".to(x.dtype), sent)"),
             ("        out = (out * gates.unsqueeze(-1).to(out.dtype)).sum(dim=1)",
              "        out = out.sum(dim=1)")],
            "the gate scales the token sent to the expert, not the expert's output",
            "the outputs weighted by the gates  # EP 7", [T_LAYER]),
    Mistake("moe-balance-of-the-gates", 12, C12,
            [("        self.aux = self.balance_loss(probs, torch.stack([counts, sent]))",
              "        self.aux = self.balance_loss(torch.zeros_like(probs).scatter(-1, chosen, "
              "gates), torch.stack([counts, sent]))")],
            "P_e taken from the chosen experts' gates, not every expert's probability",
            "P_e: the mean router probability  # EP 3", [T_LAYER]),
    Mistake("moe-balance-per-layer-averaged", 12, C12,
            [("            loss = loss + self.aux_weight * sum(moe.aux for moe in mixtures(self))",
              "            loss = loss + self.aux_weight * sum(moe.aux for moe in mixtures(self)) / "
              "len(self.blocks)")],
            "the blocks' balance losses averaged, not added: --aux-weight per block no longer",
            "--aux-weight times every block's  # EP 3", [T_LAYER]),
    Mistake("moe-balance-without-e", 12, C12,
            [("        return self.experts_total * (routed / routed.sum() * sums / tokens).sum()",
              "        return (routed / routed.sum() * sums / tokens).sum()")],
            "the balance loss without its factor E: 1 / E when even, and E times weaker",
            "E x sum_e f_e P_e  # EP 3", [T_LAYER]),
    Mistake("moe-one-gate-rescaled", 12, C12,
            [("        if self.top_k > 1:  # EP 7: rescaled to add up to 1; one expert keeps its "
              "probability,\n", "        if True:\n")],
            "the gates rescaled at K = 1 too: the one gate is always 1 and the router learns "
            "nothing from the loss", "one expert keeps its probability  # EP 7", [T_LAYER],
            ["--experts-per-token", "1"]),
    Mistake("moe-another-seed-continues", 12, C12,
            [("    if ours and seed != run.args.seed:  # --resume auto, or a step of --save by name\n"
              "        raise InputError(f\"{path} is another run's step (--seed {seed}, this run --seed \"\n"
              "                         f\"{run.args.seed}): --save into another folder\")\n", "")],
            "no seed check in the twin's own copy: --resume auto with another --seed continues, "
            "then deletes, another run's steps", "check_save_folder: the seed of the step", [RULE]),
    # The copy pages: a learner's slip in the page's trainer, caught by the page's launch test.
    Mistake("fsdp-page-every-rank-the-whole-batch", 7, PAGE_7,
            [("\n        mine = [t.chunk(world_size)[rank].to(device) for t in batch(step)]",
              "\n        mine = [t.to(device) for t in batch(step)]")],
            "every rank trains on the whole batch: one process's numbers, each rank doing all the "
            "work", "each rank's share, chunk(world_size)[rank]", **page_run("fsdp")),
    Mistake("fsdp-page-only-the-root-sharded", 7, PAGE_7,
            [("\n    for block in model.blocks:\n        fully_shard(block, mesh=mesh)", "\n")],
            "only the root made an FSDP unit: the whole model gathered at once, one process's "
            "numbers", "each block a unit of its own", **page_run("fsdp")),
    Mistake("fsdp-page-export-gathered-on-every-rank", 7, PAGE_7,
            [("\n    options = StateDictOptions(full_state_dict=True, cpu_offload=True)",
              "\n    options = StateDictOptions(full_state_dict=True)")],
            "the export without cpu_offload: every rank receives the whole model",
            "cpu_offload=True: rank 0 alone", **page_run("fsdp")),
    Mistake("4d-page-loss-times-cp-only", 11, PAGE_11,
            [("\n    loss_fn = functools.partial(share_of_loss, averaged_over=dp * CP)",
              "\n    loss_fn = functools.partial(share_of_loss, averaged_over=CP)")],
            "the loss multiplied by cp alone: FSDP averages over dp x cp, so at dp 2 every gradient "
            "is half", "times dp x cp, the ranks FSDP averages over", **page_run("4d")),

    # issue 59: switches a real run sets, proven by launches that set them
    Mistake("fsdp-weight-decay-fixed", 7, C7,
            [('    groups = [{"params": decay, "weight_decay": args.weight_decay},',
              '    groups = [{"params": decay, "weight_decay": 0.1},')],
            "AdamW's weight decay written as the default 0.1: --weight-decay is parsed and ignored",
            '"weight_decay": args.weight_decay',
            [T_FSDP + "test_with_dropout_a_binding_clip_and_padding_fsdp_logs_ddps_numbers"],
            ["--weight-decay", "0.3"]),
    Mistake("pp-val-fraction-fixed", 9, C9,
            [("        n_val, itos = int(len(tokens) * args.val_fraction), None",
              "        n_val, itos = int(len(tokens) * 0.1), None")],
            "the validation tail written as 10% of the data: --val-fraction is parsed and ignored",
            "int(len(tokens) * args.val_fraction)",
            [T_PP + "test_bf16_compiled_at_pp2_logs_one_processs_bf16_numbers"],
            ["--val-fraction", "0.25"]),
    Mistake("cp-vocabulary-read-off-the-ids", 10, C10,
            [('    return read_ids(args.data, args.vocab_size, "--vocab-size"), args.vocab_size',
              '    tokens = read_ids(args.data, args.vocab_size, "--vocab-size")\n'
              '    return tokens, int(tokens.max()) + 1')],
            "the vocabulary taken as the largest id in a .bin plus one, not --vocab-size: a "
            "tokenizer's ids that the data never uses get no row, and the model is another",
            "the vocabulary --vocab-size gives",
            [T_CP + "test_bf16_compiled_at_cp2_logs_one_processs_bf16_numbers"]),
    Mistake("4d-loss-in-bf16", 11, C11,
            [("    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # PP 1",
              "    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # PP 1")],
            "the last stage's training loss computed from bf16 logits under --amp bf16: the "
            "log-softmax over the vocabulary rounds in bf16", "cross_entropy(logits...float(), ...)",
            [T_4D + "test_bf16_compiled_at_pp2_x_tp2_logs_one_processs_bf16_numbers"],
            ["--amp", "bf16"]),
    Mistake("moe-grad-sync-at-the-first-micro-batch", 12, C12,
            [("model.set_requires_gradient_sync(every or i == len(batches) - 1)",
              "model.set_requires_gradient_sync(every or i == 0)")],
            "under --grad-sync last, the reduce-scatter switched on for the first micro-batch, not "
            "the last: the later micro-batches' gradients are never reduced",
            "set_requires_gradient_sync(every or i == len(batches) - 1)",
            [T_MOE + "test_bf16_with_recomputation_at_ep_2_logs_one_processs_bf16_numbers"],
            ["--grad-sync", "last"]),
    Mistake("moe-memory-line-counts-held-experts-as-whole", 12, C12,
            [("    full = whole_model_size(model)  # EP 2: the experts of the other ranks of my row too",
              "    full = sum(p.numel() for p in model.parameters())")],
            "the memory line's whole model counted from what this rank built: at --ep 2 the other "
            "rank's experts are missing, and DDP's cost looks half what it is",
            "whole_model_size(model): every expert, held or not",
            [T_MOE + "test_the_size_lines_are_what_the_test_counts_at_every_layout"]),

    # a CP practitioner's review (issue 59): the numbers chapter 10's start-up lines print
    Mistake("cp-split-line-in-fp32-under-bf16", 10, C10,
            [('    width = 2 if run.amp in ("bfloat16", "float16") else 4', "    width = 4")],
            "the split line counts K and V in 4 bytes under bf16: a GPU's run reads 1.5x the "
            "traffic it sends", "width = 2 under a 16-bit autocast",
            [CP_LINES], ["--amp", "bf16"]),
    Mistake("cp-world-line-counts-ranks-as-replicas", 10, C10,
            [('f"{run.dp_size} replicas)")  # CP 2', 'f"{world_size} replicas)")  # CP 2')],
            "the world line's replicas counted as ranks: at dp 2 x cp 2 it says x 4 replicas "
            "beside 768 tokens per step", "run.dp_size: a row's ranks share each batch",
            [CP_LINES]),
    Mistake("cp-memory-line-without-gradients", 10, C10,
            [('            f"{16 * mine / 2**20:.2f} MiB "', '            f"{12 * mine / 2**20:.2f} MiB "')],
            "the memory line counts 12 bytes a parameter: the gradient forgotten beside the weight "
            "and AdamW's two moments", "16 bytes: weight, gradient and two moments in fp32",
            [CP_LINES]),
    Mistake("cp-accumulation-line-counts-the-shard", 10, C10,
            [("    whole = 4 * sum(p.numel() for p in model.parameters()) / 2**20  # fp32 gradients",
              "    whole = 4 * sum(p.to_local().numel() for p in model.parameters()) / 2**20  #")],
            "the accumulation line counts this rank's shard of the gradients, where a reduce-scatter "
            "takes the whole gradient in (and --grad-sync last holds it whole)",
            "p.numel(): the whole gradient", [CP_LINES], ["--grad-sync", "last"]),
    Mistake("cp-vocabulary-check-off-by-one", 10, C10,
            [("    if len(tokens) and int(tokens.max()) >= vocab_size:",
              "    if len(tokens) and int(tokens.max()) > vocab_size:")],
            "an id equal to --vocab-size let through: no row of the embedding holds it, and the run "
            "fails mid-step (a device assert on a GPU) instead of in one line",
            "ids must be below the vocabulary size",
            [T_BAD + "test_a_token_id_equal_to_the_vocabulary_size_is_one_line"]),
    Mistake("cp-mfu-peak-of-the-replicas", 10, C10,
            [("    return peak * 1e12 * run.world_size, note", "    return peak * 1e12 * run.dp_size, note")],
            "MFU's peak counted over the dp rows alone: at cp 8 MFU reads 8x what the GPUs do",
            "the peak of every GPU of the job",
            [T_BAD + "test_mfu_counts_the_peak_of_every_gpu_of_the_job"]),
    Mistake("cp-ring-recompute-not-counted", 10, C10,
            [("    kv_sends, grad_sends = (cp - 1) * (2 + args.grad_checkpointing * ring), cp - 1 + ring",
              "    kv_sends, grad_sends = (cp - 1) * 2, cp - 1 + ring")],
            "the split line forgets that a recomputed block runs its forward ring again: with "
            "--cp-rotate ring and --grad-checkpointing it under-reports cp - 1 passes",
            "3 passes of K, V when the block is recomputed",
            [T_CP + "test_a_ring_under_bf16_sends_keys_in_bf16_and_their_gradients_in_fp32"],
            ["--cp-rotate", "ring", "--grad-checkpointing"]),
    Mistake("cp-recomputation-draws-new-masks", 10, C10,
            [("                x = checkpoint(block, x, context, use_reentrant=False)  # CP 6",
              "                x = checkpoint(block, x, context, use_reentrant=False,\n"
              "                               preserve_rng_state=False)  # CP 6")],
            "recomputation without the forward's random state: the backward drops other units "
            "than the forward did, so the gradients belong to no forward",
            "checkpoint keeps the RNG state (its default)",
            [T_CP + "test_recomputation_draws_the_forwards_dropout_masks_again"],
            ["--dropout", "0.1", "--grad-checkpointing"]),
    Mistake("cp-data-check-counts-ranks", 10, C10,
            [("load_data(args, run.dp_size)  # CP 2: sized for a batch per row",
              "load_data(args, run.world_size)  # CP 2: sized for a batch per row")],
            "the data check sized for a batch per rank, where a row's ranks share one: at cp 8 in "
            "one row, data that is enough is refused 8x too early",
            "a batch per replica (row)",
            [T_BAD + "test_the_data_check_counts_the_replicas_where_a_rows_ranks_share_a_batch"]),
    Mistake("fsdp-lr-set-after-the-step", 7, C7,
            [('    for group in optimizer.param_groups:\n        group["lr"] = lr_at(step, args)\n'
              '    grad_norm = nn.utils.clip_grad_norm_(',
              '    grad_norm = nn.utils.clip_grad_norm_('),
             ("    optimizer.step()  # FSDP 1: no scaler; each rank steps its shards\n",
              "    optimizer.step()  # FSDP 1: no scaler; each rank steps its shards\n"
              "    for group in optimizer.param_groups:\n"
              '        group["lr"] = lr_at(step, args)\n')],
            "the learning rate set after optimizer.step(): each step applies the one before's, and "
            "the first the peak --lr, not the warmup's first", "lr_at(step) before the step",
            [T_FSDP + SCHEDULE]),
    Mistake("fsdp-warmup-from-zero", 7, C7,
            [("return args.lr * (step + 1) / args.warmup_steps",
              "return args.lr * step / args.warmup_steps")],
            "the warmup starts at lr 0: the first step changes nothing but AdamW's moments",
            "(step + 1) / warmup_steps: step 0 moves the weights", [T_FSDP + SCHEDULE]),
    Mistake("fsdp-lr-logged-off-by-one", 7, C7,
            [("lr_at(step - 1, self.args):.2e}", "lr_at(step, self.args):.2e}")],
            "the log shows the learning rate of the step after the one it reports",
            "the log's lr: lr_at(done - 1)", [T_FSDP + SCHEDULE]),
    Mistake("fsdp-clock-runs-through-evaluation", 7, C7,
            [("        meter.stop_clock()  # evaluation and checkpoints are not training time\n",
              ""),
             ("  # a collective\n        meter.start_clock()\n    # Cleanup", "  # a collective\n"
              "    # Cleanup")],
            "the training clock left running through evaluation and saving: ms/step and tokens/s "
            "count them, worse the more often a run evaluates",
            "stop_clock() before evaluating, start_clock() after saving", [T_FSDP + SCHEDULE]),
    Mistake("fsdp-root-policy-without-a-reduce-dtype", 7, C7,
            [("fully_shard(model, mesh=mesh, mp_policy=run.policy)",
              "fully_shard(model, mesh=mesh,\n"
              "                mp_policy=MixedPrecisionPolicy(run.policy.param_dtype))")],
            "the root's policy built again with only the compute dtype: the embedding's and final "
            "norm's gradients reduce-scatter in bf16", "mp_policy=run.policy on the root too",
            [T_FSDP + "test_the_policy_computes_in_bf16_and_reduces_gradients_in_fp32"],
            ["--amp", "bf16"]),
    Mistake("fsdp-memory-line-counts-an-even-split", 7, C7,
            [("    mine = sum(p.to_local().numel() for p in model.parameters())",
              "    mine = sum(p.numel() for p in model.parameters()) // dist.get_world_size()")],
            "the memory line divides the model by the ranks: FSDP2 gives each rank ceil(rows / "
            "ranks) rows of every parameter, so at 3 processes rank 0 holds 11,728 of 34,688, "
            "not 11,562", "count the local shards: p.to_local().numel()",
            [T_FSDP + "test_the_memory_line_is_rank_0s_share_at_one_two_and_three_processes"]),
    Mistake("tp-lr-counted-in-micro-batches", 8, C8,
            [('        group["lr"] = lr_at(step, args)',
              '        group["lr"] = lr_at(step * args.grad_accum, args)')],
            "the schedule counted in micro-batches: warmup and cosine run --grad-accum times too "
            "fast, while the log shows the schedule by steps", "lr_at(step): one a step",
            [T_TP + SCHEDULE]),
    Mistake("tp-lr-logged-off-by-one", 8, C8,
            [("lr_at(step - 1, self.args):.2e}", "lr_at(step, self.args):.2e}")],
            "the log shows the learning rate of the step after the one it reports",
            "the log's lr: lr_at(done - 1)", [T_TP + SCHEDULE]),
    Mistake("tp-streams-restored-by-row", 8, C8,
            [('        restore_rng(state["rng"][run.rank], run.device)',
              '        restore_rng(state["rng"][run.dp_rank], run.device)')],
            "each rank resumes the random streams of the rank numbered as its row: after a resume "
            "with dropout every row draws row 0's masks",
            "state[\"rng\"][run.rank]: this rank's own streams",
            [T_TP + "test_with_dropout_and_a_padded_evaluation_dp2_x_tp2_logs_ddps_numbers"]),
    Mistake("tp-mfu-peak-of-the-replicas", 8, C8,
            [("    return peak * 1e12 * run.world_size, note",
              "    return peak * 1e12 * run.dp_size, note")],
            "MFU's denominator counts one GPU per replica, not every GPU of a row: tp times too "
            "high", "peak x every GPU of the job",
            [T_BAD + "test_mfu_counts_the_peak_of_every_gpu_of_the_job"]),
    Mistake("tp-world-line-counts-ranks-as-replicas", 8, C8,
            [('f"{run.dp_size} replicas)")', 'f"{run.world_size} replicas)")')],
            "the world line's batch counts every rank as a replica: its factors no longer make "
            "the tokens per step it prints", "a batch per replica (row)",
            [T_TP + "test_dp2_x_tp2_computes_what_ddp_computes"]),
    Mistake("tp-sample-drawn-in-training-mode", 8, C8,
            [("        raw_model.eval()\n        start = 10", "        start = 10")],
            "the closing sample drawn with the model still in training mode: dropout on while it "
            "generates", "raw_model.eval() before sampling", [T_TP + SCHEDULE],
            ["--dropout", "0.1"]),
    Mistake("tp-traffic-line-recompute-gathers-once", 8, C8,
            [("        gathers, scatters = each + 2 * again, each + reduced",
              "        gathers, scatters = each + reduced, each + reduced")],
            "the traffic line counts a recomputed block's gathers once: without dropout its "
            "forward gathers twice again (attention and MLP) but reduces once",
            "each + 2 x again gathers", [T_TP + "test_the_traffic_line_counts_the_collectives_a_step_makes"], ["--grad-checkpointing"]),
    Mistake("tp-recomputation-reentrant", 8, C8,
            [("                x = checkpoint(block, x, use_reentrant=False)",
              "                x = checkpoint(block, x, use_reentrant=True)")],
            "the reentrant checkpoint: its recompute runs the MLP's reduction again too, a "
            "reduce-scatter per block more than the traffic line says",
            "use_reentrant=False: recompute up to what backward needs", [T_TP + "test_the_traffic_line_counts_the_collectives_a_step_makes"],
            ["--grad-checkpointing"]),
    Mistake("tp-traffic-sent-without-the-ring-share", 8, C8,
            [("    sent = halves * tensor * (tp - 1) / tp", "    sent = halves * tensor")],
            "the traffic line's MiB sent counts each half whole: a rank of a ring sends (tp - 1) / "
            "tp of the tensor in an all-gather or a reduce-scatter, half of it at tp 2",
            "(tp - 1) / tp of each half", [T_TP + "test_the_traffic_line_counts_the_collectives_a_"
                                           "step_makes"]),
    Mistake("tp-dropout-seed-without-seed", 8, C8,
            [("    torch.manual_seed(args.seed + dropout_stream(run))",
              "    torch.manual_seed(dropout_stream(run))")],
            "the dropout streams seeded by the rank's offset alone: every --seed draws seed 0's "
            "masks (the weights and the data order still follow --seed)",
            "args.seed + the offset", [T_TP + SCHEDULE], ["--dropout", "0.1", "--seed", "7"]),
    Mistake("4d-recomputation-draws-new-masks", 11, C11,
            [("                x = checkpoint(block, x, context, use_reentrant=False)  # 4D 3",
              "                x = checkpoint(block, x, context, use_reentrant=False, "
              "preserve_rng_state=False)  # 4D 3")],
            "a block recomputed without the forward's random state: with dropout the backward "
            "drops other units than the forward did", "checkpoint keeps the RNG state (default)",
            [T_4D + "test_with_dropout_and_sp_off_dp2_x_tp2_logs_ddps_numbers_and_a_tp_pair_"
             "drops_alike"], ["--dropout", "0.1", "--grad-checkpointing"]),
    Mistake("4d-reshard-flag-misread", 11, C11,
            [('    reshard = run.args.reshard_after_forward == "yes"',
              '    reshard = run.args.reshard_after_forward == "true"')],
            "--reshard-after-forward yes read as no: every block stays gathered from forward to "
            "backward, the numbers unchanged and the memory not what was asked",
            "reshard_after_forward from the flag's yes",
            [T_4D + "test_at_pp1_each_micro_batch_reduce_scatters_and_under_a_schedule_the_step_"
             "once"], ["--reshard-after-forward", "yes"]),
    Mistake("4d-meter-counts-from-step-0", 11, C11,
            [("    meter = Meter(run, raw_model, start)  # the training clock starts now",
              "    meter = Meter(run, raw_model, 0)  # the training clock starts now")],
            "the meter counts a resumed run's steps from 0: its first log line's ms/step, and "
            "the summary's steps and tokens/s, count steps it never ran",
            "Meter(run, raw_model, start)",
            [T_4D + "test_a_resumed_run_times_and_counts_only_its_own_steps"]),
    Mistake("4d-recomputation-on-the-first-stage-only", 11, C11,
            [("    for part in raw_model.parts:\n        part.grad_checkpointing = "
              "args.grad_checkpointing",
              "    raw_model.parts[0].grad_checkpointing = args.grad_checkpointing")],
            "--grad-checkpointing set on a rank's first stage alone: with interleaved stages the "
            "second keeps every activation", "every stage this rank holds recomputes",
            [T_4D + "test_interleaved_stages_under_tp_compute_what_one_process_computes"]),
    Mistake("4d-rank-0s-streams-saved-for-all", 11, C11,
            [("    rng_states = [None] * run.world_size  # DDP 11: every rank's RNG, for an exact "
              "resume\n    dist.all_gather_object(rng_states, rng_state(run.device))  # so rank 0 "
              "can save them all",
              "    rng_states = [rng_state(run.device)] * run.world_size  # DDP 11: every rank's "
              "RNG")],
            "rank 0 saves its own random state for every rank: a resumed run draws rank 0's "
            "masks on every rank", "all_gather_object of every rank's state",
            [T_4D + "test_the_checkpoint_keeps_every_ranks_own_random_streams"]),
    Mistake("gpt-tokens-per-step-of-one-rank", 3, C3,
            [("        self.args, self.tokens = run.args, tokens_per_step(run)\n",
              "        self.args, self.tokens = run.args, tokens_per_step(run) // run.world_size\n")],
            "tok/s, MFU and the summary's tokens per step count one rank's tokens: N times too "
            "low at N processes", "tokens_per_step(run): every rank's",
            [T_GPT + "test_three_processes_log_one_processs_norms_and_validation_and_resume_at_one"]),
    Mistake("gpt-meter-counts-from-step-0", 3, C3,
            [("    meter = Meter(run, raw_model, start)  # the training clock starts now",
              "    meter = Meter(run, raw_model, 0)  # the training clock starts now")],
            "the meter counts a resumed run's steps from 0: its first ms/step, and the summary's "
            "steps and tokens/s, count steps it never ran", "Meter(run, raw_model, start)",
            [T_GPT + "test_a_crashed_worker_is_restarted_and_resumes_exactly"]),
    Mistake("tp-streams-restored-across-tp", 8, C8,
            [('    if (saved.get("tp"), saved.get("sequence_parallel"), len(state["rng"])) == (\n'
              '            run.args.tp, run.args.sequence_parallel, run.world_size):',
              '    if (saved.get("sequence_parallel"), len(state["rng"])) == (\n'
              '            run.args.sequence_parallel, run.world_size):')],
            "the saved random streams restored whenever the world size matches, whatever tp saved "
            "them: saved at dp 2 x tp 2 without sequence parallelism, a resume at dp 4 x tp 1 "
            "gives two replicas one stream", "restore only at the tp, SP and world that saved",
            [T_TP + "test_random_streams_come_back_only_at_the_tp_and_sp_that_saved_them"]),
    # chapter 3, a reviewer's survivors (each caught by a test written for it, or named)
    Mistake("gpt-recompute-rng", 3, C3,
            [("                x = checkpoint(block, x, use_reentrant=False)\n",
              "                x = checkpoint(block, x, use_reentrant=False, "
              "preserve_rng_state=False)\n")],
            "blocks recomputed without the forward's random state: with dropout the backward "
            "drops other units than the forward did, and the gradients are not the forward's",
            "checkpoint keeps and replays the RNG state (its default)",
            [T_GPT + "test_recomputation_draws_the_forwards_dropout_masks_again"],
            ["--grad-checkpointing"]),
    Mistake("gpt-decay-everything", 3, C3,
            [("    decay = [p for p in model.parameters() if p.dim() >= 2]\n"
              "    no_decay = [p for p in model.parameters() if p.dim() < 2]\n",
              "    decay = [p for p in model.parameters()]\n    no_decay = []\n")],
            "weight decay on every parameter: the LayerNorms' gains pulled towards 0, the biases "
            "too", "decay the 2-D tensors alone, norms and biases at 0",
            [T_GPT + "test_weight_decay_falls_on_the_matrices_and_embeddings_alone"]),
    Mistake("gpt-clock-stop-dropped", 3, C3,
            [("        meter.stop_clock()  # evaluation and checkpoints are not training time\n",
              "")],
            "the clock restarted after each step but never stopped: the steps between log lines "
            "are thrown away, ms/step about 1/--log-every of the truth",
            "stop_clock() and start_clock() in pairs",
            [T_GPT + "test_a_world_of_one_schedules_times_training_alone_and_samples_in_eval_mode"],
            ["--log-every", "2"]),
    Mistake("gpt-epoch-count-per-rank", 3, C3,
            [("        count = self.per_epoch * self.batch * self.world\n",
              "        count = self.per_epoch * self.batch\n")],
            "an epoch deals per_epoch x batch windows in all, not per rank: halfway through the "
            "epoch the micro-batches run short, then empty, and the run dies",
            "per_epoch x batch x world windows an epoch",
            [T_GPT + "test_every_micro_batch_of_two_epochs_is_whole_on_both_ranks"]),
    Mistake("gpt-rng-by-local-rank", 3, C3,
            [('        if run.rank < len(state["rng"]):  # the ranks it knows get their own RNG '
              'state back\n            torch.set_rng_state(state["rng"][run.rank]["cpu"])\n',
              '        local = int(os.environ["LOCAL_RANK"])  # this process\'s own RNG stream\n'
              '        if local < len(state["rng"]):  # the ranks it knows get their own RNG '
              'state back\n            torch.set_rng_state(state["rng"][local]["cpu"])\n')],
            "the resume restores the random state saved by the rank on this node: on two nodes "
            "ranks 0 and 1 resume one dropout stream", "state[\"rng\"][run.rank], the global rank",
            [T_GPT + "test_a_resume_restores_the_random_state_of_the_global_rank"]),
    Mistake("gpt-mfu-one-gpu-peak", 3, C3,
            [("    return peak * 1e12 * run.world_size, note", "    return peak * 1e12, note")],
            "MFU's denominator one GPU's peak, not the job's: N times too high on N GPUs",
            "peak x every GPU of the job",
            [T_BAD + "test_mfu_counts_the_peak_of_every_gpu_of_the_job",
             T_PATHS + "test_mfu_counts_flops_without_position_embeddings_and_takes_the_override"]),
    Mistake("gpt-mfu-tied-twice", 3, C3,
            [("    n = sum(p.numel() for p in raw_model.parameters()) - raw_model.pos_emb",
              "    n = sum(p.numel() for p in raw_model.state_dict().values()) - "
              "raw_model.pos_emb")],
            "FLOPs per token counted from the state dict: the tied embedding and head matrix "
            "twice, MFU 22% too high on the tiny GPT",
            "parameters(), each tensor once",
            [T_PATHS + "test_mfu_counts_flops_without_position_embeddings_and_takes_the_override"]),
    Mistake("tp-export-without-cpu-offload", 8, C8,
            [("    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to "
              "rank 0",
              "    options = StateDictOptions(full_state_dict=True)  # gathered to rank 0")],
            "the export gathered without cpu_offload: every rank is handed the whole model on "
            "its device, a second copy of the model on each GPU", "cpu_offload=True: rank 0's CPU",
            [T_TP + "test_the_export_gathers_the_whole_model_to_rank_0s_cpu_alone"]),
    Mistake("pp-streams-restored-by-replica", 9, C9,
            [('        restore_rng(state["rng"][run.rank], run.device)',
              '        restore_rng(state["rng"][run.dp_rank], run.device)')],
            "each rank resumes the random streams of the rank numbered as its replica: after a "
            "dropout resume at dp 2 x pp 2 the stages of both replicas draw one replica's masks",
            "state[\"rng\"][run.rank]: this rank's own streams",
            [T_PP + "test_each_rank_resumes_its_own_random_streams_at_the_pp_and_world_that_saved_"
             "them"]),
    Mistake("cp-reshard-flag-ignored", 10, C10,
            [('    reshard = run.args.reshard_after_forward == "yes"\n    for i, block in '
              'enumerate(model.blocks):  # sharding',
              '    reshard = True\n    for i, block in enumerate(model.blocks):  # sharding')],
            "--reshard-after-forward no ignored: every block but the last is gathered again for "
            "its backward, the numbers unchanged and the memory and traffic not what was asked",
            "reshard_after_forward from the flag",
            [T_CP + "test_fsdp_under_cp_reduce_scatters_as_grad_sync_says_and_keeps_the_last_"
             "block"], ["--reshard-after-forward", "no"]),
    Mistake("4d-resume-forgets-the-cpu-stream", 11, C11,
            [('    torch.set_rng_state(torch.tensor(saved["cpu"], dtype=torch.uint8))\n', "")],
            "restore_rng sets the GPU's stream alone: on a CPU a resumed run with dropout draws "
            "from the fresh seed, not the saved stream",
            "torch.set_rng_state(saved[\"cpu\"])  # FSDP 3",
            [T_4D + "test_restore_rng_puts_back_the_cpu_stream_that_run_json_keeps"],
            command=[sys.executable, "-c", "import torch, train_4d_minigpt as m; "
                     "c = torch.device('cpu'); torch.manual_seed(1); s = m.rng_state(c); "
                     "a = torch.rand(4); m.restore_rng({'cpu': s['cpu'].tolist(), 'cuda': None}, "
                     "c); print('draws after restore_rng:', 'the saved stream again' if "
                     "torch.equal(torch.rand(4), a) else 'new ones')"],
            pick=r"^draws after restore_rng: (.*)$"),
    Mistake("4d-compiled-block-discarded", 11, C11,
            [("        block.compile(backend=run.args.compile_backend)",
              "        torch.compile(block, backend=run.args.compile_backend)")],
            "torch.compile(block) with its result dropped: --compile compiles nothing, and the "
            "numbers, eager's, pass", "block.compile(): in place  # PP 1",
            [T_4D + "test_with_compile_every_block_of_a_ranks_stages_is_compiled_in_place"],
            command=[sys.executable, "-c", "import types, torch, train_4d_minigpt as m; "
                     "b = torch.nn.ModuleDict({'0': torch.nn.Linear(2, 2)}); "
                     "m.wrap_model(types.SimpleNamespace(args=m.parse_args(['--compile'])), "
                     "types.SimpleNamespace(blocks=b)); print('blocks compiled:', "
                     "sum(x._compiled_call_impl is not None for x in b.values()), 'of 1')"],
            pick=r"^blocks compiled: (.*)$"),
    Mistake("4d-embedding-gradient-counted-over-tp", 11, C11,
            [("    grads = 4 * (gathered + emb - emb // run.args.tp) * (run.args.pp > 1)",
              "    grads = 4 * (gathered + emb // run.args.tp) * (run.args.pp > 1)")],
            "the memory line's gradients inside a step count the vocabulary-split embedding's "
            "as 2 / tp of it: right at tp 2 only", "emb - emb // tp more  # 4D 5",
            [T_4D + "test_at_tp_4_inside_a_step_the_embeddings_gradient_is_counted_whole"],
            command=[sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); "
                     "import helpers; print(helpers.built_in_a_fake_world('train_4d_minigpt.py', "
                     "helpers.SHARDED + ['--pp', '2', '--cp', '1', '--tp', '4', '--n-head', '4'], "
                     "world_size=8)[1])"],
            pick=r"gradients whole: stage 0 ([\d.]+ MiB)"),
    Mistake("4d-traffic-tp-ring-as-1-over-tp", 11, C11,
            [('    sent = {"tp": 2 * tp_ops * stream * (tp - 1) / tp,',
              '    sent = {"tp": 2 * tp_ops * stream / tp * (tp > 1),')],
            "the traffic line's tp bytes as 1 / tp of each collective's tensor, not a ring's "
            "(tp - 1) / tp: right at tp 2, 3 times too few at tp 4", "(tp - 1) / tp  # 4D 6",
            [T_4D + "test_at_tp_4_the_traffic_line_counts_the_rings_three_quarters"],
            command=[sys.executable, "-c", "import types, torch, train_4d_minigpt as m; "
                     "a = m.parse_args(['--pp', '1', '--cp', '1', '--tp', '4', '--n-head', '4']); "
                     "print(m.traffic_line(types.SimpleNamespace(args=a, world_size=4, "
                     "policy=m.mixed_precision('off', torch.device('cpu'))[1]), 256))"],
            pick=r": tp ([\d.]+ MiB)"),
    Mistake("4d-traffic-cp-ring-as-one-chunk", 11, C11,
            [('            "cp": blocks * K * (cp - 1) * kv * (2 + 4 / width),',
              '            "cp": blocks * K * kv * (2 + 4 / width) * (cp > 1),')],
            "the traffic line's cp bytes as one chunk's keys and values per gather, not the "
            "ring's cp - 1: right at cp 2, 3 times too few at cp 4", "(cp - 1) x kv  # 4D 6",
            [T_4D + "test_at_cp_4_the_traffic_line_counts_the_rings_three_quarters"],
            command=[sys.executable, "-c", "import types, torch, train_4d_minigpt as m; "
                     "a = m.parse_args(['--pp', '1', '--cp', '4', '--tp', '1']); "
                     "print(m.traffic_line(types.SimpleNamespace(args=a, world_size=4, "
                     "policy=m.mixed_precision('off', torch.device('cpu'))[1]), 256))"],
            pick=r"\| cp ([\d.]+ MiB)"),
    Mistake("4d-mfu-counts-the-stage", 11, C11,
            [("    n = raw_model.whole_params - args.block_size * args.n_embd  # PP 5: the "
              "whole GPT",
              "    n = sum(p.numel() for p in raw_model.parameters()) - args.block_size * "
              "args.n_embd")],
            "MFU's FLOPs per token from the rank's stage's parameters, not the GPT's: about "
            "1 / pp of the true MFU on a GPU", "raw_model.whole_params  # PP 5",
            [T_4D + "test_mfu_counts_the_whole_gpts_flops_per_token_on_a_stage"],
            command=[sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); "
                     "import helpers, train_4d_minigpt as m; "
                     "f = helpers.SHARDED + ['--pp', '2', '--cp', '1', '--tp', '1']; "
                     "print('flops per token', m.flops_per_token(helpers.built_in_a_fake_world("
                     "'train_4d_minigpt.py', f, world_size=2)[0], m.parse_args(f)))"],
            pick=r"^flops per token (\d+)"),
    Mistake("4d-stage-sends-an-sp-share-with-sp-off", 11, C11,
            [('    split = run.args.tp if run.args.sequence_parallel == "on" else 1\n'
              "    return size[0], size[1] // split, run.args.n_embd  # 4D 6",
              "    return size[0], size[1] // run.args.tp, run.args.n_embd  # 4D 6")],
            "a stage's activations always split by tp: with --sequence-parallel off the receive "
            "buffer is tp times too small, and the run aborts at the first evaluation",
            "stream_shape: (B, T / tp, C) under SP alone  # 4D 6",
            [T_4D + "test_a_stage_sends_a_tp_share_of_its_tokens_only_under_sequence_parallelism"],
            command=[sys.executable, "-c", "import types, train_4d_minigpt as m; "
                     "a = m.parse_args(['--tp', '2', '--sequence-parallel', 'off']); "
                     "print('a stage sends', m.stream_shape(types.SimpleNamespace(args=a), "
                     "(6, 16)))"],
            pick=r"^a stage sends (.*)$"),
    Mistake("4d-dropout-seed-without-seed", 11, C11,
            [("    torch.manual_seed(args.seed + dropout_stream(run))",
              "    torch.manual_seed(dropout_stream(run))")],
            "the dropout streams seeded by the rank's offset alone: every --seed draws seed 0's "
            "masks (the weights and the data order still follow --seed)",
            "args.seed + the offset", [T_4D + SCHEDULE], ["--dropout", "0.1", "--seed", "7"]),
    Mistake("pp-memory-line-counts-the-whole-stage", 9, C9,
            [("    mine = sum(p.to_local().numel() for p in model.parameters())",
              "    mine = sum(p.numel() for p in model.parameters())")],
            "the memory line counts a stage's whole parameters where FSDP shards them over the "
            "stage's dp ranks: at dp 2 x pp 2 each rank holds half", "p.to_local(): this rank's "
            "shard", [T_PP + "test_the_memory_line_holds_each_stages_parameters_as_the_test_"
                      "counts_them"], ["--n-layer", "2"]),
    Mistake("moe-shares-of-the-last-micro-batch", 12, C12,
            [("            self.load = counts if self.load is None else self.load + counts",
              "            self.load = counts")],
            "the log's expert shares and drops count the last micro-batch alone, not every "
            "micro-batch since the last line", "add each micro-batch's counts",
            [T_MOE + "test_the_log_lines_balance_loss_shares_and_drops_are_what_the_test_counts"]),
    Mistake("moe-experts-without-the-policy", 12, C12,
            [("    fully_shard(experts, mesh=run.mesh[\"edp\"], mp_policy=run.policy,",
              "    fully_shard(experts, mesh=run.mesh[\"edp\"],")],
            "the experts sharded without the mixed-precision policy: under bf16 they keep fp32 "
            "weights and meet bf16 tokens", "every fully_shard call takes mp_policy=run.policy",
            [T_MOE + "test_the_policy_computes_in_bf16_and_reduces_gradients_in_fp32"],
            ["--amp", "bf16"]),
    Mistake("moe-capacity-rounded-down", 12, C12,
            [("        capacity = math.ceil(self.capacity_factor * len(order) / "
              "self.experts_total)\n",
              "        capacity = int(self.capacity_factor * len(order) / self.experts_total)\n")],
            "an expert's capacity rounded down: at 0.75 x 20 copies / 4 experts it takes 3, not "
            "4, and the log says ceil", "math.ceil: c x copies / E, rounded up",
            [T_MOE + "test_the_log_lines_balance_loss_shares_and_drops_are_what_the_test_counts"],
            ["--capacity-factor", "1.5"]),
    Mistake("moe-capacity-split-over-the-row", 12, C12,
            [("        capacity = math.ceil(self.capacity_factor * len(order) / "
              "self.experts_total)\n",
              "        senders = dist.get_world_size(self.groups.ep) if self.groups else 1\n"
              "        capacity = math.ceil(self.capacity_factor * len(order) / "
              "self.experts_total / senders)\n")],
            "each sender given 1 / ep of an expert's capacity, as if the capacity were the "
            "expert's whole intake: at --ep 2 a rank drops far more than at --ep 1",
            "each rank caps each expert at c x its own copies / E  # EP 4", [MOE_DROPOUT],
            ["--capacity-factor", "1.5"]),
    Mistake("moe-balance-from-the-kept-copies", 12, C12,
            [("        routed = counts[0]\n", "        routed = counts[1]\n")],
            "f_e counted from the copies a capacity kept, not those the router sent: a dropping "
            "expert's share looks smaller than the router made it",
            "f_e: the copies routed  # EP 3",
            [T_MOE + "test_the_log_lines_balance_loss_shares_and_drops_are_what_the_test_counts"],
            ["--capacity-factor", "1.0"]),
    Mistake("moe-log-aux-summed-over-the-blocks", 12, C12,
            [("    aux = sum(float(m.aux.detach()) for m in moes) / len(moes)  # 1: even f or P",
              "    aux = sum(float(m.aux.detach()) for m in moes)")],
            "the log's balance loss the sum of the blocks', not their mean: 2 when even at 2 "
            "blocks", "the mean over the blocks",
            [T_MOE + "test_the_log_lines_balance_loss_shares_and_drops_are_what_the_test_counts"]),
    Mistake("moe-recomputation-draws-new-masks", 12, C12,
            [("                x = checkpoint(block, x, use_reentrant=False)",
              "                x = checkpoint(block, x, use_reentrant=False, "
              "preserve_rng_state=False)")],
            "recomputation without the forward's random state: new dropout masks route tokens "
            "elsewhere, and the backward's all-to-alls no longer match the forward's sizes",
            "checkpoint keeps the RNG state (its default)", [MOE_DROPOUT],
            ["--grad-checkpointing"]),
    Mistake("moe-rank-0s-streams-resumed-everywhere", 12, C12,
            [('        restore_rng(state["rng"][run.rank], run.device)',
              '        restore_rng(state["rng"][0], run.device)')],
            "every rank resumes rank 0's random streams: after a resume rank 1 draws rank 0's "
            "dropout masks", "state[\"rng\"][run.rank]: this rank's streams  # FSDP 3",
            [MOE_DROPOUT]),
    Mistake("moe-ep-rows-strided", 12, C12,
            [('    shape, names = (world_size // ep, ep), ("edp", "ep")',
              '    shape, names = (ep, world_size // ep), ("ep", "edp")')],
            "the ep groups strided, every (world size / ep)-th rank: the same numbers, but on "
            "GPUs each block's all-to-alls cross nodes", "a row of ep consecutive ranks  # EP 1",
            [T_MOE + "test_an_ep_row_is_consecutive_ranks_and_every_mixture_trades_in_it"]),
    Mistake("moe-accumulation-line-times-the-micro-batches", 12, C12,
            [("    return (f\"--grad-sync last: every rank holds the whole gradients, {whole:.2f} "
              "MiB", "    return (f\"--grad-sync last: every rank holds the whole gradients, "
              "{whole * args.grad_accum:.2f} MiB")],
            "under --grad-sync last the gradients held counted once per micro-batch: they add "
            "up in one whole copy", "one whole fp32 copy, whatever --grad-accum",
            [T_MOE + "test_the_planner_predicts_what_each_rank_holds_and_sends"],
            ["--grad-sync", "last"]),
    Mistake("moe-experts-policy-without-a-reduce-dtype", 12, C12,
            [("    fully_shard(experts, mesh=run.mesh[\"edp\"], mp_policy=run.policy,",
              "    fully_shard(experts, mesh=run.mesh[\"edp\"],\n"
              "                mp_policy=MixedPrecisionPolicy(run.policy.param_dtype),")],
            "the experts' policy built again with only the compute dtype: their gradients "
            "reduce-scatter in bf16", "mp_policy=run.policy",
            [T_MOE + "test_the_policy_computes_in_bf16_and_reduces_gradients_in_fp32"],
            ["--amp", "bf16"]),
    Mistake("plan-bubble-ignores-the-stages-per-rank", 13, C13,
            [("    bubble = (layout.pp - 1) / (layout.v * steps + layout.pp - 1)",
              "    bubble = (layout.pp - 1) / (steps + layout.pp - 1)")],
            "the bubble of an interleaved schedule counted as 1F1B's: V stages a rank divide the "
            "fill and drain by V", "(pp - 1) / (V m + pp - 1)", [PLAN_TERMS],
            command=PLAN_405B, pick=r"^bubble ([\d.]+%)"),
    Mistake("plan-interleaved-in-flight-times-v", 13, C13,
            [("layout.pp + (layout.pp - 2 * rank - 1) / layout.v)",
              "layout.pp + (layout.pp - 2 * rank - 1) * layout.v)")],
            "an interleaved rank's extra micro-batches in flight multiplied by V, not divided: each "
            "warm-up chunk is 1 / V of a micro-batch", "pp + (pp - 1 - 2r) / V", [PLAN_TERMS],
            command=PLAN_405B, pick=r"^  activations +([\d.]+)"),
    Mistake("plan-recomputation-costs-no-flops", 13, C13,
            [('    again = 4 / 3 if layout.recompute == "full" else 1', "    again = 1")],
            "recomputation costs memory only: the forward run again in backward is 2 of a "
            "parameter's 6 FLOPs more", "4/3 of the layers' FLOPs", [PLAN_TERMS],
            command=PLAN_405B, pick=r"^  compute +([\d.]+)"),
    Mistake("plan-fsdp-reduces-in-bf16", 13, C13,
            [('        per, how = BF16 + FP32, "(2 + 4) B once"',
              '        per, how = BF16 + BF16, "(2 + 4) B once"')],
            "FSDP's reduce-scatter counted in bf16: the course's policy reduces gradients in fp32",
            "4 bytes a gradient", [PLAN_TERMS], command=PLAN_405B, pick=r"^  dp +([\d.]+)"),
    Mistake("plan-ep-without-the-copies", 13, C13,
            [("        \"ep\": (steps * moe * trades * tokens / tp * m.top_k * m.width",
              "        \"ep\": (steps * moe * trades * tokens / tp * m.width")],
            "the all-to-alls send each token once: a token goes to K experts, K copies",
            "tokens x K copies", [PLAN_EXPERTS], command=PLAN_DSV3, pick=r"^  ep +([\d.]+)"),
    Mistake("plan-logits-whole-on-every-tp-rank", 13, C13,
            [("    value = tokens * m.vocab / layout.tp * (BF16 + FP32) * part.last",
              "    value = tokens * m.vocab * (BF16 + FP32) * part.last")],
            "the last stage's logits counted whole: TP's head splits them by vocabulary",
            "vocab / tp of each token's logits", [PLAN_TERMS], command=PLAN_405B,
            pick=r"^  logits +([\d.]+)"),
    Mistake("plan-groups-cross-nodes-by-their-size", 13, C13,
            [('             "dp": (layout.tp, layout.dp * layout.cp)}',
              '             "dp": (1, layout.dp * layout.cp)}')],
            "a dp group judged by its size alone: its ranks stand tp apart, so 2 of them cross "
            "nodes at tp 8", "stride x size against the GPUs of a node", [PLAN_TERMS],
            command=PLAN_405B, pick=r"^  dp +[\d.]+ +[\d.,]+ GB (\w+ \w+)"),
]


# ---------------------------------------------------------------------------------- the runner
def apply(mistake, root):
    """Write the mistake into root's copy of its script. Raises ValueError if a patch's course
    text is not in the script exactly once (the catalogue no longer follows the script)."""
    path = os.path.join(root, mistake.script)
    with open(path) as f:
        text = f.read()
    for old, new in mistake.patch:
        if text.count(old) != 1:
            raise ValueError(f"{mistake.name}: {mistake.script} holds {text.count(old)} copies "
                             f"of {old.strip()[:60]!r}")
        text = text.replace(old, new)
    with open(path, "w") as f:
        f.write(text)


def copy_repo(dest):
    """The repository's tracked and untracked (not ignored) files, copied to dest."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    for name in filter(None, files):
        if os.path.isfile(os.path.join(REPO, name)):
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), os.path.join(dest, name))


def environment():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH", "NCCL", "MASTER"))}
    return {**env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"}


def symptom_run(root, mistake, limit=120):
    """(the symptom line, its numbers) of the tiny run of root's script; for a plain command,
    (its output's first line that the course's does not print, or its exit line, None)."""
    if mistake.command:
        return plain_run(root, mistake.command), None
    nproc, flags = SYMPTOM_RUNS[mistake.script]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", mistake.script, *flags, *mistake.flags]
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=limit,
                              env=environment())
    except subprocess.TimeoutExpired:
        return f"hang: stopped after {limit} s", None
    if done.returncode:
        said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        raised = [line for line in done.stderr.splitlines() if re.search(r"\w+(Error|Exception):",
                                                                          line)]
        line = (said or raised or done.stderr.splitlines()[-1:] or ["?"])[0]
        return f"exit {done.returncode}: {line.split(']: ')[-1][:110]}", None
    return measured(done.stdout)


def plain_run(root, command, limit=60):
    """What a plain command prints (stdout, then stderr) and its exit status."""
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=limit,
                              env=environment())
    except subprocess.TimeoutExpired:
        return f"hang: stopped after {limit} s"
    return f"exit {done.returncode}\n" + done.stdout + done.stderr


def measured(out):
    """The numbers a run ends with: its summary's validation loss (and accuracy), its last loss."""
    summary = json.loads(next(line for line in reversed(out.splitlines())
                              if line.startswith("summary "))[len("summary "):])
    numbers = {"val loss": summary["val_loss"]}
    if "val_acc" in summary:
        numbers["val acc"] = summary["val_acc"]
    steps = re.findall(r"^step \d+/\d+ \| loss ([\d.]+)", out, re.M)
    if steps:
        numbers["loss"] = float(steps[-1])
    return None, numbers


def described(numbers, course):
    return ", ".join(f"{key} {value:.4f} (course {course[key]:.4f})"
                     for key, value in numbers.items())


def caught_by(root, mistake, limit=1500):
    """The first named test that fails against the mistake, or None (it survived)."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               *mistake.catches]
    try:
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=limit,
                              env=environment())
    except subprocess.TimeoutExpired:
        return f"(timed out after {limit} s)"
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
    if done.returncode not in (0, 1) and not failed:
        return f"(pytest exit {done.returncode})"
    return failed[0].split("::")[-1] if failed else None


def course_numbers(mistake, cache):
    """What the course's own script gives in the mistake's symptom run (run once per command)."""
    key = json.dumps([mistake.script, mistake.flags, mistake.command])
    if key not in cache:
        course = dataclasses.replace(mistake, patch=[])
        with tempfile.TemporaryDirectory() as root:
            copy_repo(root)
            line, numbers = symptom_run(root, course)
            if numbers is None and not mistake.command:
                raise RuntimeError(f"the course's {mistake.script} fails its symptom run: {line}")
            cache[key] = numbers or line
    return cache[key]


def compared(printed, course, pick=None):
    """The first line a plain command prints that the course's does not, and the exit status; or
    with pick, what the regex finds in each."""
    if pick and not printed.startswith("hang"):
        found = [re.search(pick, text, re.M) for text in (printed, course)]
        ours, theirs = (" ".join(f.groups()) if f else "(none)" for f in found)
        return f"{ours} (course {theirs})"
    ours, theirs = printed.splitlines(), course.splitlines()
    new = [line for line in ours[1:] if line not in theirs] or ["(nothing new)"]
    status = ours[0] if ours[0] != theirs[0] else ours[0] + " (as the course)"
    return f"{status}; prints: {new[0].strip()[:160]}" if not printed.startswith("hang") \
        else printed


def run_one(mistake, cache):
    """(symptom, caught by or None) of one mistake, run in a copy of the repository."""
    course = course_numbers(mistake, cache)
    with tempfile.TemporaryDirectory() as root:
        copy_repo(root)
        apply(mistake, root)
        line, numbers = symptom_run(root, mistake)
        if mistake.command:
            symptom = compared(line, course, mistake.pick)
        else:
            symptom = line or described(numbers, course)
        return symptom, caught_by(root, mistake)


def selected(which):
    if not which:
        return CATALOGUE
    chosen = [m for m in CATALOGUE if str(m.chapter) == which or m.name == which]
    if not chosen:
        raise SystemExit(f"error: no chapter or mistake named {which!r} (--list shows them)")
    return chosen


CHAPTERS = {2: "DDP", 3: "a GPT under DDP", 4: "many nodes", 5: "faults",
            6: "speed and debugging", 7: "FSDP", 8: "tensor parallelism",
            9: "pipeline parallelism", 10: "context parallelism", 11: "every parallelism at once",
            12: "mixture of experts", 13: "the planner"}


def markdown(results, note):
    """docs/mistakes.md's tables, one per chapter (anchors #chapter-N), from results {name:
    [symptom, caught by or None, date]}, and the results themselves in a comment (a later run of
    some mistakes updates their rows and keeps the others')."""
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731  (a table cell)
    ran = [m for m in CATALOGUE if m.name in results]
    text = note + "\n"
    for chapter in sorted({m.chapter for m in ran}):
        text += (f"\n### Chapter {chapter}\n\n{CHAPTERS[chapter]}\n\n| mistake | what the "
                 "learner writes | symptom (measured) | the course's line | caught by |\n"
                 "|---|---|---|---|---|\n")
        text += "".join(f"| `{m.name}` | {cell(m.writes)} | {cell(results[m.name][0])} | "
                        f"{cell(m.avoids)} | {cell(results[m.name][1] or '**survived**')} |\n"
                        for m in ran if m.chapter == chapter)
    return text + f"\n<!-- results: {json.dumps(results)} -->\n"


def earlier_results(path):
    """The results a previous run left in path's comment, or {}."""
    with open(path) as f:
        found = re.search(r"<!-- results: (.*) -->", f.read())
    return json.loads(found.group(1)) if found else {}


def run_note(rows, seconds, everything, earlier=""):
    """The line above the tables: the whole catalogue's last run, then any partial runs since."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    if not everything and earlier:
        return (f"{earlier} Re-run {when} UTC: " + ", ".join(
            f"{m.name} ({'caught' if caught else 'survived'})" for m, _, caught in rows) + ".")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    caught = sum(1 for _, _, c in rows if c)
    return (f"Last run of the catalogue {when} UTC, {machine}, torch {torch_version()}: "
            f"{len(rows)} mistakes in {seconds / 60:.0f} min, {caught} caught "
            "(`python tests/mistakes.py --markdown docs/mistakes.md`).")


def earlier_note(path):
    """The line a previous run left above the tables, or ''."""
    with open(path) as f:
        text = f.read()
    begin = "<!-- mistakes table: begin -->\n"
    return text[text.index(begin) + len(begin):].split("\n")[0] if begin in text else ""


def torch_version():
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True).stdout.strip()


def write_table(path, table):
    """Replace the text between the markers of path with table."""
    begin, end = "<!-- mistakes table: begin -->\n", "<!-- mistakes table: end -->"
    with open(path) as f:
        text = f.read()
    if begin not in text or end not in text:
        raise SystemExit(f"error: {path} has no table markers")
    text = text[:text.index(begin) + len(begin)] + table + text[text.index(end):]
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("which", nargs="?", help="a chapter number or a mistake's name (default: all)")
    p.add_argument("--list", action="store_true", help="print the catalogue, run nothing")
    p.add_argument("--markdown", metavar="FILE", help="write the table between FILE's markers")
    args = p.parse_args(argv)
    mistakes = selected(args.which)
    if args.list:
        for m in mistakes:
            print(f"{m.chapter:>2}  {m.name:<44} {m.writes}")
        return 0
    try:
        with tempfile.TemporaryDirectory() as root:
            copy_repo(root)
            for m in mistakes:  # all of them apply, or nothing runs
                apply(m, root)
                shutil.copy2(os.path.join(REPO, m.script), os.path.join(root, m.script))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows, cache, start = [], {}, time.time()
    for m in mistakes:
        symptom, caught = run_one(m, cache)
        rows.append((m, symptom, caught))
        print(f"{m.chapter:>2} | {m.name:<44} | {symptom} | {caught or 'SURVIVED'}", flush=True)
    survived = [m.name for m, _, caught in rows if not caught or caught.startswith("(")]
    print(f"{len(rows)} mistakes, {len(rows) - len(survived)} caught, {len(survived)} survived"
          + (f": {', '.join(survived)}" if survived else ""))
    if args.markdown:
        when = datetime.datetime.now().strftime("%Y-%m-%d")
        results = {} if len(mistakes) == len(CATALOGUE) else earlier_results(args.markdown)
        results.update({m.name: [symptom, caught, when] for m, symptom, caught in rows})
        note = run_note(rows, time.time() - start, len(mistakes) == len(CATALOGUE),
                        earlier_note(args.markdown))
        write_table(args.markdown, markdown(results, note))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
