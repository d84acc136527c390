"""Chapter 12, train_moe_minigpt.py (a mixture of experts in every block, expert parallelism over
--ep ranks, FSDP as in chapter 7), under real torchrun launches on CPU/gloo. These tests prove:

1. expert parallelism computes one process's math: at --ep 2 on 2 processes (2 experts a rank,
   each rank its own 6 sequences, 2 micro-batches a step), the losses and the gradient norms
   before clipping of 8 steps are those of one process at --ep 1 with the same global batch
   (--batch-size 12), to 1e-5 relative (every digit train_step returns, recorded by
   tests/probe_moe.py), with a clip of 2.0 that binds in steps 1 and 2 and not after (the
   control); the balance loss and the experts' shares of the token copies, counted over the
   global batch, are logged alike, and so are the validation losses (13 windows: one rank runs a
   padded batch, whose forward still trades tokens); every step makes 20 all-to-alls per rank
   (2 blocks x 2 micro-batches x (the counts, the tokens there and back, and the two backward));
   at 4 processes of 3 sequences, the same global batch, both at 2 edp x 2 ep (each expert
   sharded by FSDP over a column of 2 ranks; 8 steps) and at --ep 4 (one expert a rank; 4 steps),
   the losses and gradient norms are one process's too (1e-5); the exports at --ep 2 and at 2 x 2
   hold every expert, with one process's weights (1e-5, each expert its own: the control), and
   sample their text in one plain process; chapter 3's --sample refuses them in one line (exit
   code 2);
2. --experts 0 is the dense model, and dropout draws DDP's masks: with dropout, a clip that binds
   and a padded validation, --experts 0 at 2 processes logs chapter 3's losses, gradient norms and
   validation losses at 2 processes (DDP), and with experts, a shared expert and a capacity
   factor of 1.0, --ep 2 logs --ep 1's at 2 processes, drops included, under --grad-checkpointing
   (recomputation draws the forward's masks again) and across a kill and a resume at step 2
   (each rank resumes its own random streams); the experts change the losses, and so does
   dropout (the controls);
3. checkpoints resume at another --ep: saved at --ep 2 on 2 processes (step 4), resumed at --ep 1
   in one process with the same global batch, steps 5 to 8 log the uninterrupted one-process
   run's losses (DCP names each expert by its number in the block, whichever rank holds it);
4. the policy: with --amp bf16 the weights (the experts' too) compute in bf16 and the gradients
   reduce in fp32;
5. a capacity drops copies, and the run then depends on its layout: at --capacity-factor 1.0,
   --ep 2 at 2 processes drops some copies each step (logged) and its losses differ from one
   process's at the same global batch; at 2.0 (E / K) nothing can drop and one process logs its
   dropless losses;
6. bad input is one line and exit code 2: --ep that does not divide the experts, or with no
   experts (expert parallelism needs them), --experts-per-token of 0 or above the experts (or not
   dividing 4 x --n-embd), a capacity factor or balance weight that is not finite (NaN, inf) or
   not positive, a capacity without experts or above them (1e300 overflowed a step); an --ep that does not divide the world size is one
   line from rank 0 alone, before any group is joined (a launch of 2 processes at --ep 4), as
   chapter 11 refuses its sizes.
7. the layer itself, in one plain process: each token's output is the gate-weighted sum of its
   K likeliest experts' outputs (gates rescaled to add up to 1; the control: unscaled, it
   differs), and the router gets a gradient through the gates with no balance loss; the log's
   balance loss, expert shares and dropped copies over two micro-batches are what the test
   counts from the routers, at a capacity that drops;
8. the size lines against counts written out in the test, at 1, 2 and 4 processes (--ep 1, 2, 4
   and 2 edp x 2 ep): the model's parameters, every expert counted, the experts line (a token's
   share, the experts rank 0 holds, a capacity's cap), each rank's memory and the gradients its
   reduce-scatters take in; under bf16 with recomputation, compiled, with --grad-sync last, on a
   file of token ids, --ep 2 logs one process's bf16 numbers and the data line the test computes.
The eight launches run side by side in one module fixture while the one-process references run in
this process.
The schedule and the clock, in this process as a world of one: each step applies and logs
the warmup and cosine worked out by hand, and ms/step leaves out evaluation and saving (the
test moves the clock: 1 s a step, 100 s an evaluation or a save); with dropout, the closing
sample runs every module in evaluation mode.
"""
import ast
import difflib
import json
import math
import re

import pytest
import torch
from helpers import assert_a_world_of_one_schedules_times_and_samples_as_it_should
from helpers import logged_grad_norms as norms, logged_losses as losses
from helpers import kills, logged_val_losses as val_losses
from helpers import NOISY, SHARDED, as_script, command, finish, in_process, ok, start, trainer
from helpers import REPO, ddp_dropout_reference, start_two_nodes, summary, run_single
import benchmark_scaling as bench  # noqa: E402  (the repository is on sys.path: helpers)
from helpers import assert_every_unit_computes_in_bf16_and_reduces_in_fp32
from helpers import assert_planned, fake_world
from helpers import assert_bf16_policy_reduces_in_fp32, assert_dropout_run_is_ddps
from helpers import assert_data_line, token_data

MOE = "train_moe_minigpt.py"
moe = trainer(MOE)
# 8 steps of 2 micro-batches of 6 sequences a rank; a clip of 2.0 that binds in steps 1 and 2;
# 13 validation windows (7 and 6 on 2 ranks: one padded batch)
FLAGS = SHARDED + ["--clip", "2.0", "--eval-windows", 13, "--max-steps", 8, "--eval-every", 8,
                   "--save", "", "--export", ""]
EXPERTS = ["--experts", 4, "--experts-per-token", 2, "--aux-weight", 0.01]
SHARED = EXPERTS + ["--shared-expert"]  # one more expert, on every token
CAPACITY = ["--max-steps", 3, "--eval-every", 3, "--capacity-factor", 1.0]
ROOM = ["--capacity-factor", 1.0]  # the dropout runs' capacity: each rank drops past it alike
# bf16 with recomputation, as a GPU run turns them on: 6 steps, evaluated every 3
BF16 = [*FLAGS, *EXPERTS, "--max-steps", 6, "--eval-every", 3, "--grad-checkpointing", "--amp",
        "bf16"]

CONTRACT = {  # tests/README.md, "One proof for every GPT chapter"; None: not held yet
    "reference": ["test_expert_parallel_runs_compute_what_one_process_computes",
                  "test_no_experts_is_the_dense_model_and_dropout_draws_ddps_masks"],
    "norms": ["test_expert_parallel_runs_compute_what_one_process_computes"],
    "padded": ["test_expert_parallel_runs_compute_what_one_process_computes"],
    "dropout": ["test_no_experts_is_the_dense_model_and_dropout_draws_ddps_masks"],
    "collectives": ["test_expert_parallel_runs_compute_what_one_process_computes"],
    "policy": ["test_the_policy_computes_in_bf16_and_reduces_gradients_in_fp32"],
    "resume": ["test_two_nodes_restarted_after_a_kill_and_resumed_at_ep_1_log_the_uninterrupted_"
               "losses"],
    "bf16": ["test_bf16_with_recomputation_at_ep_2_logs_one_processs_bf16_numbers"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """--ep 2 at 2 processes through the probe (its records in "dir"), and --experts 0 at 2
    processes, launched; meanwhile, in this process, their one-process references: --ep 1 with
    --batch-size 12 (every digit of its losses and norms recorded), and chapter 7 alike."""
    d = tmp_path_factory.mktemp("moe")
    (d / "grid").mkdir()
    (d / "ep4").mkdir()
    cmds = {"ep2": command("tests/probe_moe.py", ["record", d, *FLAGS, *EXPERTS, "--ep", 2,
                                                  "--export", d / "ep2.pt"], nproc=2),
            "ep4": command("tests/probe_moe.py", ["record", d / "ep4", *FLAGS, *EXPERTS, "--ep",
                                                  4, "--batch-size", 3, "--max-steps", 4], nproc=4),
            "capacity": command(MOE, [*FLAGS, *EXPERTS, *CAPACITY, "--ep", 2], nproc=2),
            "dense": command(MOE, [*NOISY, "--experts", 0, "--export", ""], nproc=2),
            "noisy": command("tests/probe_moe.py",
                             ["killsave", "renamed@2:0", d / "noisy", *NOISY, *SHARED, *ROOM,
                              "--ep", 2, "--grad-checkpointing", "--save-every", 2, "--save",
                              d / "noisy",
                              "--resume", "auto", "--export", ""],
                             nproc=2, torchrun_args=["--max-restarts=1"]),
            "noisy ep1": command(MOE, [*NOISY, *SHARED, *ROOM, "--export", ""], nproc=2),
            "bf16": command(MOE, [*BF16, *token_data(), "--ep", 2, "--reshard-after-forward",
                                  "no", "--grad-sync", "last", "--compile", "--compile-backend",
                                  "aot_eager", "--debug", "--dist-timeout", 600], nproc=2),
            "grid": command("tests/probe_moe.py", ["record", d / "grid", *FLAGS, *EXPERTS, "--ep",
                                                   2, "--batch-size", 3, "--export",
                                                   d / "grid.pt"], nproc=4),
            }
    restart_fix = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch/pytorch#135712
    started = {name: start(cmd, REPO, restart_fix if name == "noisy" else None)
               for name, cmd in cmds.items()}
    bad_ep = command(MOE, ["--ep", 4], nproc=2)  # refused before any group: its test reads it
    refused = start(bad_ep, REPO)
    # two nodes of one process through chapter 4's launcher, rank 1's disk full in the save of
    # step 4 and rank 0 killed removing it; the group restarted (--max-restarts 1): it resumes
    # from step 2 and saves step 4
    (d / "restarted").mkdir()
    restarted = start_two_nodes("tests/probe_moe.py", [
        "killsave", "cleanup@4:1", d / "restarted", *FLAGS, *EXPERTS, "--ep", 2, "--max-steps", 4,
        "--eval-every", 4, "--save-every", 2, "--save", d / "ck", "--resume", "auto"], restarts=1)
    one, recorded = {}, {"losses": [], "norms": []}
    step = moe.train_step

    def recording(*args):
        loss, norm = step(*args)
        recorded["losses"].append(loss.item())
        recorded["norms"].append(norm.item())
        return loss, norm
    moe.train_step = recording
    try:
        one["moe"] = in_process(MOE, [*FLAGS, *EXPERTS, "--batch-size", 12,
                                      "--export", d / "one.pt"])
    finally:
        moe.train_step = step
    one["capacity"] = in_process(MOE, [*FLAGS, *EXPERTS, *CAPACITY, "--batch-size", 12])
    one["bf16"] = in_process(MOE, [*BF16, *token_data(), "--batch-size", 12])
    one["fp32"] = in_process(MOE, [*BF16[:-1], "off", *token_data(), "--batch-size", 12])
    one["roomy"] = in_process(MOE, [*FLAGS, *EXPERTS, *CAPACITY[:-1], 2.0, "--batch-size", 12])
    one["still"] = in_process(MOE, [*FLAGS, "--experts", 0, "--batch-size", 12,
                                    "--max-steps", 1])  # no dropout
    ddp_dropout_reference()  # chapter 3 at 2 processes, with dropout: run now, while they run
    r = {name: ok(finish(proc, cmds[name])) for name, proc in started.items()}
    before, after = r["noisy"].split(f"resumed from {d / 'noisy' / 'step-000002'} at step 2\n")
    r["noisy killed"] = "step 2/4 | loss" in before and "step 3/4 | loss" in after
    # the resumed run's first evaluation aside: the uninterrupted run evaluates at 0 and 4 only
    r["noisy"] = before + re.sub(r"^step 2/4 \| val loss .*\n", "", after, flags=re.M)
    r["bad ep"] = finish(refused, bad_ep)
    r["restarted"] = next(out for out in restarted() if "world size 2 " in out)  # rank 0's node
    r["resumed"] = in_process(MOE, [*FLAGS, *EXPERTS, "--batch-size", 12, "--resume", d / "ck"])
    return {**r, "one": one, "recorded": recorded, "dir": d}


def test_expert_parallel_runs_compute_what_one_process_computes(runs):
    ep2 = json.loads((runs["dir"] / "rank0.json").read_text())
    one = runs["recorded"]
    assert len(ep2["losses"]) == len(one["losses"]) == 8
    assert ep2["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert ep2["norms"] == pytest.approx(one["norms"], rel=1e-5)
    assert [n > 2.0 for n in one["norms"]] == [True, True] + [False] * 6  # the clip binds
    assert one["losses"][-1] < one["losses"][0] - 0.5  # it learns
    assert ep2["all_to_alls"] == [2 * 2 * (3 + 2)] * 8
    # A block's micro-batch sends 2 of its 4 counts (int64) to the other rank, then in forward
    # and again in backward the s copies for the other rank's experts and the r outputs it owes
    # the other rank, rows of 32 fp32 values: 2 x (s + r) rows, each of s, r at most 384 copies.
    for sent in ep2["sent"]:
        rows = (sent - 2 * 2 * 2 * 8) / 128
        assert rows % 2 == 0 and 0.25 < rows / (2 * 2 * 2 * 2 * 384) < 0.75, sent
    grid = json.loads((runs["dir"] / "grid" / "rank0.json").read_text())
    assert grid["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert grid["norms"] == pytest.approx(one["norms"], rel=1e-5)
    assert "world size 4 (2 edp x 2 ep)" in runs["grid"]
    ep4 = json.loads((runs["dir"] / "ep4" / "rank0.json").read_text())
    assert ep4["losses"] == pytest.approx(one["losses"][:4], rel=1e-5)  # its 4 steps
    assert ep4["norms"] == pytest.approx(one["norms"][:4], rel=1e-5)
    assert "world size 4 (1 edp x 4 ep)" in runs["ep4"] and "holds experts 0-0" in runs["ep4"]
    out, ref = runs["ep2"], runs["one"]["moe"]
    assert "world size 2 (1 edp x 2 ep)" in out and "rank 0 holds experts 0-1" in out
    shares = [line.split("| aux ")[1] for line in out.splitlines() if "| aux " in line]
    assert len(shares) == 8 and shares == [line.split("| aux ")[1] for line in ref.splitlines()
                                          if "| aux " in line]
    assert sorted(val_losses(out)) == [0, 8]
    assert val_losses(out) == pytest.approx(val_losses(ref), abs=1e-4)


def test_no_experts_is_the_dense_model_and_dropout_draws_ddps_masks(runs):
    """With dropout 0.1, a clip of 2.0 that binds in steps 1 and 2, and 13 validation windows: at
    --experts 0, 2 processes log chapter 3's numbers at 2 processes (DDP: each rank draws its own
    masks, seeded by its rank); with experts, --ep 2 logs --ep 1's (the router draws nothing, so
    each rank's masks stay DDP's), both at a capacity factor of 1.0 (each rank caps each expert
    at a share of its own copies, wherever the expert lives: the same drops), the --ep 2 run under
    --grad-checkpointing (the backward recomputes each block with the masks its forward drew, so
    the routing and the all-to-alls' sizes repeat) and killed once step 2 is saved and restarted
    (every rank resumes its own random streams). The controls: the experts change the losses, the
    capacity drops copies, and without dropout the first loss differs."""
    dense = runs["dense"]
    assert_dropout_run_is_ddps(dense)
    assert "| aux " not in dense and "experts" not in dense.split("memory per rank")[0]
    noisy, ep1 = runs["noisy"], runs["noisy ep1"]
    assert runs["noisy killed"]  # the control: rank 0 was killed once step 2 was saved
    assert sorted(losses(noisy)) == [1, 2, 3, 4]
    assert losses(noisy) == pytest.approx(losses(ep1), rel=1e-5)
    assert norms(noisy) == pytest.approx(norms(ep1), rel=1e-5)
    assert val_losses(noisy) == pytest.approx(val_losses(ep1), abs=1e-4)
    dropped = [re.findall(r"\| dropped (\S+)%", out) for out in (noisy, ep1)]
    assert dropped[0] == dropped[1] and len(dropped[0]) == 4 and min(map(float, dropped[0])) > 1
    assert abs(losses(noisy)[4] - losses(dense)[4]) > 1e-3  # the control: experts differ
    assert abs(losses(dense)[1] - losses(runs["one"]["still"])[1]) > 1e-3  # dropout was on


def test_an_ep_row_is_consecutive_ranks_and_every_mixture_trades_in_it():
    """Built as rank 0 of a fake world of 4 at --ep 2 and of 8 at --ep 4 (no launch): rank 0's ep
    row, the group every block's all-to-alls run in, is ranks 0 to ep - 1, so that on GPUs a row
    sits in one node; its edp column (the same experts' other holders) is every ep-th rank; the
    balance loss sums over the world. The control: the column is not the row."""
    import torch.distributed as dist
    for world, ep in ((4, 2), (8, 4)):
        args = moe.parse_args([*map(str, FLAGS + EXPERTS), "--ep", str(ep), "--device", "cpu"])
        with fake_world(world):
            run = moe.make_run(args, torch.device("cpu"), 0, world)
            layers = moe.mixtures(moe.build_model(run, 256)[0])
            rows = {tuple(dist.get_process_group_ranks(m.groups.ep)) for m in layers}
            worlds = {tuple(dist.get_process_group_ranks(m.groups.world)) for m in layers}
            column = dist.get_process_group_ranks(run.mesh["edp"].get_group())
        assert len(layers) == 2 and rows == {tuple(range(ep))}, rows
        assert worlds == {tuple(range(world))} and column == list(range(0, world, ep)) != list(
            range(ep))


def test_the_size_lines_are_what_the_test_counts_at_every_layout(runs):
    """What rank 0 prints of the model, the experts, its memory and its accumulation, against
    counts written out here, at five layouts: one process, --ep 1 at 2 processes (each expert
    sharded over its column of 2, a shared expert too), --ep 2 (2 experts a rank, whole), --ep 4
    and 2 edp x 2 ep (one expert's worth a rank); and the capacity line at --ep 2. A block holds
    2 norms, qkv and proj with biases, a router of 4 scores without bias, and 4 experts of two
    matrices (32 x 64 and 64 x 32: 4 x 32 hidden units over a token's 2 experts) with biases.
    FSDP shards the dense weights over every rank and each expert over its column, and every
    size here divides, so each rank holds 1/world of the model; its reduce-scatters take in the
    whole fp32 gradients of the dense units and of the experts in its row. The control: a run
    without a capacity prints no capacity."""
    c, hidden, vocab, context, blocks, experts, k = 32, 64, 256, 32, 2, 4, 2
    expert = 2 * c * hidden + hidden + c
    dense = (vocab * c + context * c + 2 * c
             + blocks * (2 * 2 * c + 3 * c * c + 3 * c + c * c + c + c * experts))
    layouts = {  # name: (world, ep, shared expert, what it printed)
        "one": (1, 1, False, runs["one"]["moe"]), "noisy ep1": (2, 1, True, runs["noisy ep1"]),
        "ep2": (2, 2, False, runs["ep2"]), "ep4": (4, 4, False, runs["ep4"]),
        "grid": (4, 2, False, runs["grid"])}
    for name, (world, ep, shared, out) in layouts.items():
        whole = dense + blocks * (experts + shared) * expert
        mine = whole // world
        assert f"model {whole:,} parameters | 2 layers, 2 heads, 32 wide, context 32" in out, name
        assert (f"experts 4 per block, 2 per token, each 64 wide: a token uses {k * expert:,} of "
                f"their {experts * expert:,} parameters (the dense MLP: {8 * c * c + 5 * c:,}) | "
                f"rank 0 holds experts 0-{experts // ep - 1}") in out, name
        assert (f"weights, gradients and AdamW state {16 * mine / 2**20:.2f} MiB ({mine:,} of "
                f"{whole:,} parameters; DDP: {16 * whole / 2**20:.2f} MiB)") in out, name
        # a reduce-scatter takes a unit's whole fp32 gradient: the dense ones and its experts'
        held = whole - blocks * (experts - experts // ep) * expert
        assert (f"the {4 * held / 2**20:.2f} MiB of them reduce-scattered 2 times per step"
                in out), name
    copies = 6 * 32 * k  # a rank's micro-batch: 6 sequences of 32 tokens, each sent to k experts
    assert (f"capacity 1.0: at most {math.ceil(copies / experts)} of a rank's {copies} copies "
            "per expert, the rest dropped") in runs["capacity"]
    assert "at most 96 of a rank's 384 copies" not in runs["ep2"]  # the control: no capacity


def test_bf16_with_recomputation_at_ep_2_logs_one_processs_bf16_numbers(runs):
    """--amp bf16 with --grad-checkpointing at --ep 2, compiled (aot_eager), --grad-sync last and
    --debug, on a file of token ids, logs the one-process bf16 run's losses and validation losses
    within 1e-3 and gradient norms within 3e-3, 3 units of their last printed digit (measured on 2
    cores, torch 2.14: 2e-4, 5e-4 and 2e-3, the same without compile and --grad-sync last; EP
    splits no product, only the order of the sums over ranks differs), and the data line the test
    computes. The control: one process in fp32 logs losses further than 1e-3 from it (1.9e-3
    measured)."""
    ep2, one, fp32 = runs["bf16"], runs["one"]["bf16"], runs["one"]["fp32"]
    assert "| amp bfloat16 |" in ep2 and "| amp bfloat16 |" in one and "| amp off |" in fp32
    assert_data_line(ep2)  # on a file of token ids: the split and baseline the test computes
    assert sorted(losses(ep2)) == sorted(norms(ep2)) == list(range(1, 7))
    for step in range(1, 7):
        assert losses(ep2)[step] == pytest.approx(losses(one)[step], abs=1e-3), step
        assert norms(ep2)[step] == pytest.approx(norms(one)[step], abs=3e-3), step
    assert sorted(val_losses(ep2)) == [0, 3, 6]
    assert val_losses(ep2) == pytest.approx(val_losses(one), abs=1e-3)
    assert max(abs(losses(fp32)[step] - losses(one)[step]) for step in range(1, 7)) > 1e-3


def test_the_policy_computes_in_bf16_and_reduces_gradients_in_fp32():
    """The one policy of every unit, the experts' included (the control: --amp off casts
    nothing)."""
    assert_bf16_policy_reduces_in_fp32(moe)
    assert_every_unit_computes_in_bf16_and_reduces_in_fp32(MOE, SHARDED + [*EXPERTS, "--ep", 2])  # read off it


def test_two_nodes_restarted_after_a_kill_and_resumed_at_ep_1_log_the_uninterrupted_losses(runs):
    """--ep 2 on two nodes of one process (the launcher), rank 1's disk full in the save of
    step 4 and rank 0 SIGKILLed while it removes the failed step, torchrun restarting both
    (--max-restarts 1): --resume auto goes on from step 2, and steps 3
    and 4 log one process's losses and norms; the step-4 checkpoint, resumed at --ep 1 in one
    process, logs steps 5 to 8 of the uninterrupted run (DCP names each expert by its number in
    the block, whichever rank holds it)."""
    restarted, one = runs["restarted"], runs["recorded"]
    assert "resumed from" in restarted and "step-000002 at step 2" in restarted
    [killed] = kills(runs["dir"] / "ck")  # rank 0 cut short removing the failed step 4
    assert killed["moment"] == "cleanup" and "step-000002" in killed["held"]
    assert "run.json" not in killed["held"]["partial-step-000004"]
    after = json.loads((runs["dir"] / "restarted" / "rank0.json").read_text())
    assert after["losses"] == pytest.approx(one["losses"][2:4], rel=1e-5)
    assert after["norms"] == pytest.approx(one["norms"][2:4], rel=1e-5)
    resumed, one = runs["resumed"], runs["one"]["moe"]
    assert "resumed from" in resumed and "step-000004 at step 4" in resumed
    assert sorted(losses(resumed)) == [5, 6, 7, 8]
    for step in range(5, 9):
        assert losses(resumed)[step] == pytest.approx(losses(one)[step], rel=1e-5), step
    assert val_losses(resumed)[8] == pytest.approx(val_losses(one)[8], abs=1e-4)


def test_the_export_at_ep_2_holds_every_expert_and_samples_in_one_process(runs):
    """At --ep 2 on 2 processes (each expert whole on one rank) and on 4 (2 x 2: each expert
    sharded over a column), the export holds one process's weights, every expert's."""
    one = torch.load(runs["dir"] / "one.pt", weights_only=True)["model"]
    for name in ("grid", "ep2"):
        ep2 = torch.load(runs["dir"] / f"{name}.pt", weights_only=True)["model"]
        assert ep2.keys() == one.keys() and "blocks.1.mlp.experts.3.2.weight" in ep2
        for key, w in one.items():  # 8 AdamW steps of 3e-3 move a weight by up to 0.024
            assert torch.allclose(ep2[key], w, rtol=0, atol=1e-5), (name, key)
    a, b = ep2["blocks.0.mlp.experts.2.0.weight"], ep2["blocks.0.mlp.experts.0.0.weight"]
    assert not torch.allclose(a, b, atol=1e-3)  # the control: each expert its own weights
    texts = [in_process(MOE, ["--sample", "--ckpt", runs["dir"] / f"{name}.pt", "--prompt",
                              "def ", "--top-k", 0, "--max-new-tokens", 24])  # drawn, seed 0
             for name in ("ep2", "one")]
    assert texts[0] == texts[1] and len(set(texts[0])) > 8
    refused = as_script("train_ddp_minigpt.py", ["--sample", "--ckpt", runs["dir"] / "ep2.pt"])
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "holds a model with experts, top_k, which this script's GPT has not" in refused.stderr


def test_a_capacity_drops_copies_and_the_run_then_depends_on_its_layout(runs):
    """At a capacity factor of 1.0 each rank drops the copies past its experts' capacity: which
    ones depends on the tokens the rank holds, so 2 ranks of 6 sequences differ from one process
    of 12, where dropless runs matched (the control above); at E / K = 2.0 nothing can drop."""
    ep2, one, roomy = runs["capacity"], runs["one"]["capacity"], runs["one"]["roomy"]
    dropped = [float(line.split("| dropped ")[1].rstrip("%")) for line in ep2.splitlines()
               if "| dropped " in line]
    assert len(dropped) == 3 and min(dropped) > 1.0
    assert "at most 96 of a rank's 384 copies per expert" in ep2
    assert sorted(losses(ep2)) == sorted(losses(one)) == [1, 2, 3]
    assert abs(losses(ep2)[3] - losses(one)[3]) > 1e-4
    assert "| dropped 0.0%" in roomy
    for out in (ep2, one):  # evaluation is dropless: before any step, the dropless run's loss
        assert val_losses(out)[0] == pytest.approx(val_losses(runs["one"]["moe"])[0], abs=1e-4)
    for step in (1, 2, 3):
        assert losses(roomy)[step] == pytest.approx(losses(runs["one"]["moe"])[step], rel=1e-6)


def test_benchmark_scaling_reads_the_moe_trainers_summary(runs):
    """benchmark_scaling.py runs any trainer the same way (its launches: test_benchmark.py); what
    it needs of a trainer is its summary's pace keys: every rank's tokens per step."""
    row = bench.pace_row(summary(runs["ep2"]), 2, 0.0)
    assert row["per_step"] == 6 * 32 * 2 * 2 and row["unit"] == "tokens/s"  # batch x T x K x N
    assert row["throughput"] == pytest.approx(768 / (row["step_ms"] / 1000), rel=0.01)


def test_the_layer_sends_each_token_to_its_k_experts_and_the_router_learns_through_the_gates():
    """In one plain process (no group: every expert here), checked against formulas written out
    here: the mixture's output is, token by token, the gate-weighted sum of its K likeliest
    experts' outputs, the gates rescaled to add up to 1 (the control: with the raw probabilities
    it differs; at K = 1 the raw probability is the gate); its balance loss is E x sum_e f_e P_e;
    the model's loss is the cross-entropy plus --aux-weight times every block's; with no balance
    loss the router still gets a gradient, through the gates, at K = 2 and at K = 1; in bf16 the
    router's softmax, and so the balance loss, is fp32."""
    torch.manual_seed(0)
    for k in (2, 1):
        layer = moe.MixtureOfExperts(8, experts=4, top_k=k, held=range(4))
        x = torch.randn(2, 5, 8)
        out = layer(x)
        probs = layer.router(x.view(10, 8)).softmax(dim=-1)
        top, chosen = probs.topk(k, dim=-1)
        for raw in (False, True):
            gates = top if raw or k == 1 else top / top.sum(dim=-1, keepdim=True)
            ref = torch.stack([sum(g * layer.experts[str(int(e))](t) for g, e in zip(gs, es))
                               for t, gs, es in zip(x.view(10, 8), gates, chosen)])
            close = torch.allclose(out.view(10, 8), ref, atol=1e-6)
            assert close == (not raw or k == 1), (k, raw)
        f = torch.bincount(chosen.flatten(), minlength=4) / chosen.numel()
        assert layer.aux.item() == pytest.approx(4 * (f * probs.mean(dim=0)).sum().item(), rel=1e-6)
        out.square().sum().backward()
        assert layer.router.weight.grad.abs().sum() > 1e-4, k
    shared = moe.MixtureOfExperts(8, experts=4, top_k=2, held=range(4), shared=True)
    x = torch.randn(2, 5, 8)
    routed = shared.state_dict()
    alone = moe.MixtureOfExperts(8, experts=4, top_k=2, held=range(4))
    alone.load_state_dict({k: v for k, v in routed.items() if not k.startswith("shared.")})
    assert torch.allclose(shared(x), alone(x) + shared.shared(x.view(10, 8), [10]).view(2, 5, 8))
    model = moe.mixture_gpt({"vocab_size": 16, "block_size": 8, "n_layer": 2, "n_head": 2,
                             "n_embd": 8, "dropout": 0.0, "experts": 4, "top_k": 2})
    model.aux_weight = 0.5
    idx = torch.randint(0, 16, (2, 8))
    logits, loss = model(idx, idx)
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
    aux = [m.aux for m in moe.mixtures(model)]
    assert len(aux) == 2 and loss.item() == pytest.approx((plain + 0.5 * sum(aux)).item())
    layer = moe.MixtureOfExperts(8, experts=4, top_k=2, held=range(4))
    x = torch.randn(2, 5, 8)
    out = layer(x)
    layer.capacity_factor = 0.5  # at most 5 of the 20 copies an expert: some must drop
    assert not torch.allclose(layer(x), out)  # the control: in training, copies dropped
    layer.eval()
    assert torch.equal(layer(x), out)  # evaluation stays dropless
    layer.to(torch.bfloat16)(x.bfloat16())  # the router's logits in bf16, its softmax in fp32
    logits = layer.router(x.view(10, 8).bfloat16())
    for probs, same in ((logits.float().softmax(dim=-1), True), (logits.softmax(dim=-1), False)):
        f = torch.bincount(probs.topk(2, dim=-1).indices.flatten(), minlength=4) / 20
        ref = 4 * (f * probs.float().mean(dim=0)).sum()
        assert (layer.aux.item() == pytest.approx(ref.item(), rel=1e-6)) == same


def test_the_log_lines_balance_loss_shares_and_drops_are_what_the_test_counts():
    """The log's ` | aux | expert share min max | dropped` after two micro-batches through two
    layers (one plain process), against counts made here from each layer's router: the mean of
    the layers' last balance losses (E x sum_e f_e P_e of the last micro-batch); the smallest and
    largest share of the copies routed to any expert of any layer, over both micro-batches; and,
    at a capacity factor of 0.75 (an expert takes at most ceil(0.75 x 20 / 4) = 4 of a
    micro-batch's 20 copies), the copies left out over those routed. The control: the last
    micro-batch's shares alone differ from both micro-batches'."""
    torch.manual_seed(1)
    layers = [moe.MixtureOfExperts(8, experts=4, top_k=2, held=range(4)) for _ in range(2)]
    routed, kept, aux = torch.zeros(2, 4), torch.zeros(2, 4), [0.0, 0.0]
    for _ in range(2):  # micro-batches
        x = torch.randn(2, 5, 8)
        for i, layer in enumerate(layers):
            layer.capacity_factor = 0.75
            layer(x)
            probs = layer.router(x.view(10, 8)).softmax(dim=-1).detach()
            counts = torch.bincount(probs.topk(2, dim=-1).indices.flatten(), minlength=4)
            routed[i], kept[i] = routed[i] + counts, kept[i] + counts.clamp(max=4)
            aux[i] = 4 * (counts / 20 * probs.mean(dim=0)).sum().item()
    last = counts / 20  # the control: the last layer's last micro-batch alone
    shares = routed / routed.sum(dim=1, keepdim=True)
    dropped = 1 - kept.sum() / routed.sum()
    assert 0 < dropped < 0.5
    assert [float(last.min()), float(last.max())] != [float(shares.min()), float(shares.max())]
    assert moe.expert_shares(layers) == (
        f" | aux {sum(aux) / 2:.4f} | expert share min {100 * float(shares.min()):.1f}% max "
        f"{100 * float(shares.max()):.1f}% | dropped {100 * float(dropped):.1f}%")


@pytest.mark.parametrize("flags,words", [
    (["--experts", 4, "--ep", 3], "--ep 3 must divide --experts 4"),
    (["--experts", 0, "--ep", 2], "--ep 2 needs --experts: expert parallelism splits the experts"),
    (["--experts", 4, "--experts-per-token", 0], "--experts-per-token 0 must be between 1 and"),
    (["--experts", 4, "--experts-per-token", 5], "--experts-per-token 5 must be between 1 and"),
    (["--experts", 4, "--experts-per-token", 3], "--experts-per-token 3 must divide 4 x"),
    (["--capacity-factor", 0], "argument --capacity-factor: must be a finite number, positive, "
                               "got 0"),
    (["--capacity-factor", "nan"], "argument --capacity-factor: must be a finite number, positive, "
                                   "got nan"),
    (["--capacity-factor", "inf"], "argument --capacity-factor: must be a finite number, positive, "
                                   "got inf"),
    (["--aux-weight", "nan"], "argument --aux-weight: must be a finite number, at least 0, "
                              "got nan"),
    (["--experts", 0, "--capacity-factor", 1], "--capacity-factor 1.0 needs --experts"),
    (["--experts", 4, "--capacity-factor", "1e300"], "--capacity-factor 1e+300 must be at most "
                                                      "--experts 4: from E / K = 2 on, no copy"),
    (["--experts", 0, "--shared-expert"], "--shared-expert needs --experts")])
def test_bad_experts_are_one_line_and_exit_code_2(flags, words):
    result = as_script(MOE, flags)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"{MOE}: error: {words}"), result.stderr


def test_an_ep_the_world_size_cannot_hold_is_one_line_from_rank_0_before_any_group(runs):
    """--ep 4 at 2 processes (launched with the module's runs): rank 0 alone says why, before any
    rank joins a group (the other exits with code 2 and no word), as chapter 11 refuses its
    sizes; in this process, a world of one refuses --ep 2, and the control: --ep 2 at a world of
    4 passes the guard."""
    result = runs["bad ep"]
    line = ("error: --ep 4 does not divide the world size 2: start a multiple of 4 processes, or "
            "give --ep 1\n")
    said = result.stdout + result.stderr
    assert result.returncode != 0 and said.count("error: --ep") == 1 and line in said, said
    assert "exitcode  : 2" in result.stderr and "train_moe_minigpt.py\", line" not in said, said
    with pytest.raises(moe.InputError, match=r"^--ep 2 does not divide the world size 1: "):
        in_process(MOE, [*FLAGS, *EXPERTS, "--ep", 2])
    assert moe.InputError.code == 2  # __main__ prints the one line, exits with it
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WORLD_SIZE", "4")
        env.setenv("RANK", "0")
        assert moe.refuse_a_mesh_the_world_cannot_hold(moe.parse_args(["--ep", "2"])) is None


PIECES = ["Groups", "MixtureOfExperts", "Experts", "AllToAll", "SumOverRanks"]
PAGE = REPO / "docs" / "moe_in_your_trainer.md"


def pieces():
    """{name: source} of the mixture's pieces, cut out of the script from their first decorator
    or their class line."""
    source = (REPO / MOE).read_text()
    lines = source.splitlines()
    return {n.name: "\n".join(lines[min([n.lineno, *(d.lineno for d in n.decorator_list)]) - 1:
                                    n.end_lineno])
            for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name in PIECES}


def page_blocks():
    return re.findall(r"^```(?:python|diff)\n(.*?)^```", PAGE.read_text(), re.M | re.S)


def test_the_ep_page_holds_the_scripts_pieces_as_they_stand():
    single, mine, diff = page_blocks()
    assert sorted(pieces()) == sorted(PIECES)
    for name, source in pieces().items():
        assert source in single and source in mine, f"{PAGE.name} lost {name} as the script has it"
    real = difflib.unified_diff(single.splitlines(), mine.splitlines(), "my_moe_single.py",
                                "my_moe_ep.py", n=1, lineterm="")
    assert diff.rstrip("\n") == "\n".join(real)


def test_the_ep_pieces_stand_alone_under_torchrun(tmp_path):
    """The page's EP trainer, its pieces copied afresh out of the script, logs its one-process
    trainer's losses and gradient norms at 2 processes (4 printed decimals; a clip of 0.7 binds
    in steps 1 to 3). The control: with the experts' gradients averaged like the rest (not
    divided by the world size), the norms differ."""
    single, mine, _ = page_blocks()
    first, last = mine.index("@dataclasses.dataclass\nclass Groups"), mine.index("def main(")
    fresh = mine[:first] + "\n\n\n".join(pieces()[n] for n in PIECES) + "\n\n\n" + mine[last:]
    divided = "            p.grad /= world  # an expert's holds every rank's tokens already\n"
    mutant = fresh.replace(divided, "            if p not in experts:\n"
                                    "                p.grad /= world\n")
    assert mutant != fresh
    (tmp_path / "my_moe_ep.py").write_text(fresh)
    (tmp_path / "mutant.py").write_text(mutant)
    (tmp_path / "my_moe_single.py").write_text(single)
    cmds = [command(tmp_path / name, nproc=2) for name in ("my_moe_ep.py", "mutant.py")]
    launched = [start(cmd, tmp_path) for cmd in cmds]
    printed = run_single(tmp_path / "my_moe_single.py")
    found = r"loss (\d+\.\d+) \| norm (\d+\.\d+)"
    ep, wrong = [re.findall(found, ok(finish(p, cmd))) for p, cmd in zip(launched, cmds)]
    one = re.findall(found, printed)
    assert len(ep) == 6 and ep == one, (ep, one)
    assert [float(norm) > 0.7 for _, norm in one] == [True] * 3 + [False] * 3
    assert float(one[-1][0]) < float(one[0][0]) - 0.5  # it learns
    assert wrong[0][1] != one[0][1]  # the control: the experts' gradients twice too large


def test_the_planner_predicts_what_each_rank_holds_and_sends(runs):
    """Chapter 13's plan_layout.py, given each run's flags and world size, predicts its experts,
    memory and accumulation lines to the character: --ep 2, --ep 4, 2 edp x 2 ep, a capacity,
    --experts 0, a shared expert at --ep 2 and at --ep 1, and bf16 with --grad-sync last on a
    300-token vocabulary. The control: its lines for --ep 4 are not the --ep 2 run's."""
    assert_planned(12, [
        (runs["ep2"], 2, FLAGS + EXPERTS + ["--ep", 2]),
        (runs["ep4"], 4, FLAGS + EXPERTS + ["--ep", 4, "--batch-size", 3]),
        (runs["grid"], 4, FLAGS + EXPERTS + ["--ep", 2, "--batch-size", 3]),
        (runs["capacity"], 2, FLAGS + EXPERTS + CAPACITY + ["--ep", 2]),
        (runs["dense"], 2, NOISY + ["--experts", 0]),
        (runs["noisy"], 2, NOISY + SHARED + ROOM + ["--ep", 2]),
        (runs["noisy ep1"], 2, NOISY + SHARED + ROOM),
        (runs["bf16"], 2, BF16 + token_data() + ["--ep", 2, "--grad-sync", "last"])],
        other=(4, FLAGS + EXPERTS + ["--ep", 4]))


def test_a_world_of_one_applies_the_schedule_times_training_and_samples_in_eval_mode(
        tmp_path):
    """The warmup and cosine by hand, applied and logged at each step; ms/step leaves out the
    evaluations and saves (a clock the test moves); the closing sample in evaluation mode (no
    dropout); as a world of one with --ep 1."""
    assert_a_world_of_one_schedules_times_and_samples_as_it_should(
        MOE, [], tmp_path, dense=False)
