"""Chapter 11: every parallelism in one run, on one 4-D mesh of (pp, dp, cp, tp) ranks. Pipeline
parallelism (PP) gives each stage a run of the GPT's blocks; in a stage, tensor parallelism (TP,
with sequence parallelism and loss parallel) splits each block by tp, context parallelism (CP) each
sequence by cp, and FSDP shards it all over dp x cp. The same math as one process.

    torchrun --standalone --nproc_per_node=8 train_4d_minigpt.py          # 2 pp x 2 cp x 2 tp: CPU
    torchrun --standalone --nproc_per_node=4 train_4d_minigpt.py --pp 1   # 2 cp x 2 tp: CPU or GPUs
    torchrun --standalone --nproc_per_node=gpu train_4d_minigpt.py --pp 1 --cp 2 --tp 4  # 8 GPUs
    ./launch_multinode_ddp.sh --nnodes 2 --nproc-per-node 8 --master-addr N0 \
        train_4d_minigpt.py --pp 2 --cp 2 --tp 4 --block-size 1024 --grad-accum 8
    python train_4d_minigpt.py --sample --ckpt checkpoints/minigpt_4d.pt --prompt "def main("

The multi-node line prints the torchrun command to run on each node: with --pp 2 on 2
nodes of 8, each node is one stage, its 8 GPUs 2 cp x 4 tp; dp is what the world size leaves (here
1). --sample runs in one plain process. Default data: the first 2,000,000 bytes of this Python's
own standard library, one token per byte (vocab 256), so nothing is downloaded; `--data` also takes
a text file, a .bin of uint16 token ids, or a nanoGPT folder.

Read it top-down: main(), then its core steps in the order it calls them, the model, and what goes
beyond the core (debugging, the benchmark, the report). Every call that communicates with other
ranks sits above the line that ends `the plumbing`. Below it, no line communicates with another
rank: guards, flags, data, files, logging, sampling, errors, and small helpers that the core calls
(dtypes, shapes, freeing gathered weights).

Terms. A rank is one of the processes torchrun starts, one per device, numbered from 0; the world
size is how many there are. A process group is a set of ranks that communicate with each other. A
collective is a call that every rank of a group makes, in the same order; each rank waits in it
until all have made it. An all-reduce sums a tensor over a group and gives every rank the sum; an
all-gather gives every rank all the ranks' parts; a reduce-scatter sums a tensor and gives each
rank one part of the sum. A shard is the part of a tensor that one rank holds. The mesh (a
DeviceMesh) lays the ranks out as a pp x dp x cp x tp grid; the ranks that differ in one coordinate
alone form a group of that dim (a tp group, a cp group...). A stage is a run of consecutive blocks,
held by the ranks of one pp coordinate; each stage hands its activations to the next. A replica is
the ranks of one dp coordinate: together they run the whole model's forward and backward on batches
of their own. A micro-batch is --batch-size sequences; --grad-accum of them pass through the stages
one after another and make one optimizer step. fully_shard makes each block a unit whose weights
are gathered and freed together; the root is the unit of the rest (embeddings, final norm, head).
DCP, torch.distributed.checkpoint, saves and loads every rank's shards, at any layout. A rank's
place is its (dp, cp, tp) coordinates: the ranks at one place, one per stage, form its pp group and
pass activations along it; the end stages, the first and the last, each hold a copy of the tied
embedding and head. With --schedule interleaved-1f1b a rank holds --stages-per-rank stages, every
pp-th (rank r of the pp group: stages r, r + pp, ...), and a micro-batch goes round the group once
per stage a rank holds: a smaller bubble, for more sends.

TP and CP's terms. TP splits a linear layer column-wise (each rank computes some of its outputs
from the whole input) or row-wise (each rank computes, from some of the inputs, a partial sum of
every output; a collective adds the partial sums up). Loss parallel computes the cross-entropy from
logits split by vocabulary, without gathering them. A DTensor is a tensor spread over a mesh:
Shard(d) splits it along its dim d, Replicate() puts a whole copy on every rank. CP gives each rank
of a cp group two of 2 x cp equal chunks of every sequence of T tokens, an early one and a late one,
so that causal attention costs every rank the same; each holds T / cp tokens. Sequence parallelism
(sp) splits those again by tp, T / (cp x tp) tokens, where each token is worked on alone: the
norms, dropout, and what a stage sends. Before attention and the MLP, TP's all-gather makes them T
/ cp again, and TP splits the heads and hidden units by tp; CP's all-gather then brings the keys
and values of the whole sequence, for this rank's heads.

Tags: each `# 4D k` comment marks a line this chapter adds or changes, numbered in reading order:
  4D 1   --pp, --cp, --tp: the (pp, dp, cp, tp) mesh, tp innermost, dp what is left; its layout
  4D 2   data and global batch by dp rank: the ranks of a replica read the same sequences
  4D 3   Context: cp rank i holds chunks i and 2 x cp - 1 - i of each sequence, at their positions
  4D 4   attention over the cp group's keys and values, all-gathered; backward reduce-scatters
  4D 5   TP's plans in each block and at the stage's ends, then FSDP over dp x cp; dropout seeds
  4D 6   what a stage sends: a cp rank's tokens, split by tp under sequence parallelism; bytes sent
  4D 7   checkpoints: random states restored only at the layout that saved them
  4D 8   loss parallel, in training and evaluation: the logits stay split by vocabulary
  4D 9   the gradient norm per mesh (dp x cp, and dp x cp x tp), summed over the stages
  4D 10  sampling: every rank the whole context, padded; the ranks of a replica draw alike
Lines tagged PP k, FSDP k or DDP k mark what chapters 9, 7 and 3 changed; the key of each is in
its chapter, and most say on the line what it does.

One micro-batch at the default 8 ranks (pp 2 x cp 2 x tp 2, dp 1), through one block of stage 0:
  in         (B, T / 4, C) on each rank: its cp chunks, split again by tp (sequence parallelism)
  ln1        on those tokens alone; no collective
  into attn  TP's all-gather over the tp group: this cp rank's T / 2 tokens, whole
  qkv        this rank's heads only; then CP's all-gather over the cp group brings the keys and
             values of the whole sequence, for those heads
  attention  this rank's queries against every earlier key, under a lower-right causal mask
  proj       partial sums, reduce-scattered over the tp group back to (B, T / 4, C)
  the MLP    TP's pair again: an all-gather in, a reduce-scatter out
  out        after its last block, stage 0 sends (B, T / 4, C) to stage 1 over the pp group
Backward runs it in reverse: TP's pairs swap roles, and attention is computed again (it was
checkpointed), with a second all-gather of K and V, whose gradients are reduce-scattered over the
cp group in fp32. FSDP all-gathers a block's weights over dp x cp before their first use in a
step, and reduce-scatters the gradients after the step's last backward; then the two end stages
sum the tied matrix's gradient, and the stages sum their squared gradient norms.

See also: docs/4d.md (the layout, what each group sends, measured), docs/4d_in_your_trainer.md.
"""
import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import errno
import gc
import glob
import io  # FSDP 8
import json
import logging  # FSDP 3
import logging  # 4D 5
import math
import os
import pickle
import shutil
import statistics
import sys
import sysconfig
import tempfile  # FSDP 3
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed.checkpoint as dcp  # FSDP 3
from torch.distributed.checkpoint.api import CheckpointException  # FSDP 3
from torch.distributed.checkpoint.state_dict import (StateDictOptions,  # FSDP 3
                                                     get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh  # FSDP 2
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # FSDP 1
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,  # PP 1
                                          ScheduleInterleaved1F1B)
from torch.distributed.tensor import DTensor, Replicate, Shard  # 4D 5
from torch.distributed.tensor import distribute_tensor  # FSDP 2
from torch.distributed.tensor.parallel import (ColwiseParallel,  # 4D 5
                                               PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)
from torch.nn.attention.bias import causal_lower_right  # 4D 3
from torch.utils.checkpoint import checkpoint


# ------------------- the distributed lesson: main(), then its core steps in the order it calls them
def main(argv=None):
    args = parse_args(argv)
    if args.sample:  # sampling runs in one plain process, with no process group
        return sample(args)
    avoid_known_failures(args)  # guard: refuses a bad launch, avoids known failures
    # Setup: one process per device, one group. Every rank calls the collectives in the same order.
    device, rank, world_size = init_distributed(args.device, args.dist_timeout)  # DDP 1: join
    run = make_run(args, device, rank, world_size)  # a collective: the mesh and the tied groups
    # Data: each replica reads its own windows of the training tokens.
    data = build_data(run)  # a collective with --debug: rank 0 prints every rank's windows
    # Model: this stage's blocks, split by TP across the tp group, sharded by FSDP across dp x cp.
    raw_model, optimizer = build_model(run, data.vocab_size)  # every rank shards alike
    start = resumed_step(run, raw_model, optimizer, data)  # a collective: one agreed start step
    model = wrap_model(run, raw_model)  # the same shards: raw_model, its blocks compiled in place
    schedule = pipeline_schedule(run, model)  # PP 1: the stage in its schedule; sends nothing yet
    if args.benchmark:
        return benchmark(run, schedule, model, optimizer, data.windows)  # PP 1: a collective
    # Train: log, evaluate and save on schedule.
    val_loss = evaluate(run, model, data.val)  # a collective: every rank's loss sums add up
    print0(run.is_main, f"step {start}/{args.max_steps} | val loss {val_loss:.4f}")
    meter = Meter(run, raw_model, start)  # the training clock starts now
    for step in range(start, args.max_steps):  # every step runs collectives
        loss, grad_norm = train_step(run, schedule, model, optimizer, data.windows, step)  # PP 1
        done = step + 1
        if done % args.log_every == 0 or done == args.max_steps:
            print0(run.is_main, meter.log_line(done, loss.item(), grad_norm.item()))
        meter.stop_clock()  # evaluation and checkpoints are not training time
        if done % args.eval_every == 0 or done == args.max_steps:
            val_loss = evaluate(run, model, data.val)  # a collective
            print0(run.is_main, f"step {done}/{args.max_steps} | val loss {val_loss:.4f} | "
                                f"baseline {data.baseline:.4f}")
        # Save: every rank writes its shards, rank 0 the run's state; all learn whether it worked.
        due = done == args.max_steps or (args.save_every and done % args.save_every == 0)
        if args.save and due:
            save_checkpoint(run, raw_model, optimizer, data, done)  # a collective
        meter.start_clock()
    # Cleanup: the summary and a sample. __main__'s `finally` leaves the process group.
    report(run, raw_model, data, val_loss, meter)  # a collective: --export gathers the weights


def init_distributed(device_name, timeout_s):
    """A collective: join the process group torchrun started. Returns (device, rank, world size)."""
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cpu")
    if device_name == "cuda":
        # LOCAL_RANK numbers this node's processes from 0, like its GPUs; RANK numbers all nodes'.
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # DDP 2: this process's GPU, before any CUDA work
    backend = "nccl" if device.type == "cuda" else "gloo"
    # With no address given, it reads torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
    # With NCCL, device_id ties the group to this GPU, so NCCL connects now, not at first use.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if backend == "nccl" else None)  # DDP 1: join
    return device, dist.get_rank(), dist.get_world_size()


@dataclasses.dataclass
class Run:
    """What every step of one process's run shares, set once at the start."""
    args: argparse.Namespace  # the flags
    device: torch.device
    rank: int
    world_size: int
    is_main: bool  # True on rank 0 alone, the one process that logs and writes files
    amp: str  # FSDP 1: the compute dtype's name ("bfloat16"), or "off"
    policy: MixedPrecisionPolicy  # FSDP 1: bf16 compute, fp32 reduce-scatters; no autocast/scaler
    mesh: object  # 4D 1: the (pp, dp, cp, tp) grid of ranks, a DeviceMesh
    stage: int  # PP 2: this rank's stage, 0 to pp - 1: the blocks it holds
    dp_rank: int  # PP 3: this rank's replica, which sets the data it reads
    dp_size: int  # 4D 2: the replicas: world size / (pp x cp x tp)
    tied: object  # PP 4: the end stages' group at this rank's (dp, cp, tp) place, or None
    context: "Context"  # 4D 3: which tokens of each sequence this rank holds, and its attention


def make_run(args, device, rank, world_size):
    """This process's Run; logs the run's shape (world size, device, precision, batch)."""
    is_main = rank == 0  # DDP 3: only rank 0 logs and writes files
    amp, policy = mixed_precision(args.amp, device)  # FSDP 1: FSDP's dtypes
    mesh = grid(args, device, world_size)  # 4D 1: pp x dp x cp x tp ranks, tp innermost
    stage, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    context = Context(mesh["cp"].get_group(), mesh.get_local_rank("cp"),  # 4D 3: the tokens of
                      args.cp, args.block_size, device)  # each sequence this rank holds
    context.gather_again = not args.grad_checkpointing  # 4D 4: recomputed once, not twice
    run = Run(args, device, rank, world_size, is_main, amp, policy, mesh, stage, dp_rank,
              mesh.size(1), ends_group(mesh, stage, rank),  # 4D 1: ends_group: a collective
              context)  # 4D 3
    print0(is_main, f"world size {world_size} ({args.pp} pp x {run.dp_size} dp x {args.cp} cp x "
                    f"{args.tp} tp) | device {device} | amp {amp} | {tokens_per_step(run):,} "
                    f"tokens per step ({args.batch_size} x {args.block_size} x {args.grad_accum} "
                    f"micro-batches x {run.dp_size} replicas) | schedule {args.schedule}"  # 4D 2
                    + f", {args.stages_per_rank} stages per rank" * (args.stages_per_rank > 1))
    print0(is_main, layout_line(mesh, world_size - 1))  # 4D 1: one rank's place and groups
    return run


def grid(args, device, world_size):
    """The ranks as a pp x dp x cp x tp DeviceMesh, dp what the world size leaves. tp varies
    fastest, so a tp group is consecutive ranks, on one node's fast links for TP's collectives in
    every block; pp varies slowest, as a stage sends the least. The default 8 ranks (pp 2, dp 1,
    cp 2, tp 2) are one replica: all read the same sequences. Stage 0 is ranks 0-3, stage 1 4-7.
    cp pairs (0, 2) (1, 3) (4, 6) (5, 7) split each sequence, and FSDP shards over each; tp pairs
    (0, 1) (2, 3) (4, 5) (6, 7) split blocks; pp pairs (0, 4) (1, 5) (2, 6) (3, 7) link stages."""
    inner = args.pp * args.cp * args.tp  # it divides the world size: avoid_known_failures
    shape, names = (args.pp, world_size // inner, args.cp, args.tp), ("pp", "dp", "cp", "tp")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)  # 4D 1: groups along each dim
    # dp x cp x tp as one mesh too, for speed only: DTensor merges a collective over those dims
    # (a norm's all-reduce in clip_gradients) into one call on it; without it, one call per dim.
    mesh["dp", "cp", "tp"]._flatten("dp_cp_tp")  # 4D 1: one group of a stage's ranks
    return mesh


def ends_group(mesh, stage, rank):  # 4D 1: the tied matrix's two copies, by (dp, cp, tp)
    """A collective: a group of the end stages at each (dp, cp, tp) place; None elsewhere."""
    pp = mesh.size(0)
    ends = mesh.mesh[[0, -1]].flatten(1).T.tolist() if pp > 1 else []  # 4D 1: a pair per place
    groups = [dist.new_group(ranks) for ranks in ends]  # every rank joins the making of each
    return groups[rank % len(groups)] if pp > 1 and stage in (0, pp - 1) else None  # 4D 1


def layout_line(mesh, rank):  # the mesh's sizes, and one rank's place and groups (fsdp: dp x cp)
    grid, names = mesh.mesh, mesh.mesh_dim_names  # 4D 1
    where = [int(i) for i in (grid == rank).nonzero()[0]]
    def along(*dims):  # the ranks that share every coordinate with `rank` but these
        index = tuple(slice(None) if d in dims else i for d, i in enumerate(where))
        return grid[index].flatten().tolist()
    groups = [f"{name} {along(d)}" for d, name in enumerate(names)] + [f"fsdp {along(1, 2)}"]
    return (f"mesh {' x '.join(f'{n} {s}' for n, s in zip(names, grid.shape))} | rank {rank} at "
            f"{dict(zip(names, where))}: groups " + ", ".join(groups))


class Context:
    """Which tokens of each sequence this rank holds, and how its queries see the rest. Each cp rank
    holds an early chunk and a late one, so that causal attention costs every rank the same."""

    def __init__(self, group, cp_rank, cp, block_size, device):
        # With cp 2 and 16 tokens in 4 chunks, rank 0 holds positions 0-3 and 12-15, rank 1 4-11.
        # Gathered in rank order, the keys stand as 0-3, 12-15, 4-7, 8-11; `order` sorts them back
        # to 0-15. `ends`: rank 0's two chunks see keys up to 4 and 16, rank 1's up to 8 and 12.
        every = [chunk_positions(r, cp, block_size) for r in range(cp)]  # 4D 3: every rank's
        self.group, self.cp, self.positions = group, cp, every[cp_rank].to(device)
        self.order = torch.cat(every).argsort().to(device)  # gathered -> sequence order
        self.ends = [int(chunk[-1]) + 1 for chunk in self.positions.chunk(2)]
        self.masks = [causal_lower_right(len(self.positions) // 2, end) for end in self.ends]
        self.gather_again = True  # False where the whole block is recomputed, this gather with it

    def share(self, x, y):  # this rank's tokens of each sequence, and their targets
        return x[:, self.positions], y[:, self.positions]

    def attention(self, q, k, v):  # each chunk's queries over every key up to the chunk's end
        if self.cp == 1:  # the whole sequence is here: plain causal attention
            return causal_attention(q, k, v)
        if not self.gather_again:  # --grad-checkpointing recomputes the block, the gather too
            return self.gathered_attention(q, k, v)
        return checkpoint(self.gathered_attention, q, k, v, use_reentrant=False)  # 4D 4: recomputed

    def gathered_attention(self, q, k, v):  # a collective of the cp group, run again in backward
        kv = GatherContext.apply(torch.stack([k, v]), self.group)  # 4D 4: every rank's k and v
        k, v = kv.index_select(-2, self.order)  # each (B, heads, T, head size), in position order
        chunks = q.chunk(2, dim=-2)  # an early chunk's queries and a late one's
        return torch.cat([causal_attention(part, k[..., :end, :], v[..., :end, :], mask)
                          for part, end, mask in zip(chunks, self.ends, self.masks)], dim=-2)


def chunk_positions(cp_rank, cp, block_size):
    """The positions of chunks cp_rank and 2 x cp - 1 - cp_rank of 2 x cp, in block_size tokens."""
    size = block_size // (2 * cp)
    chunks = (cp_rank, 2 * cp - 1 - cp_rank)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])  # 4D 3


class GatherContext(torch.autograd.Function):
    """An all-gather over the cp group along the sequence (dim -2), in rank order, that carries
    gradients. Its backward is a reduce-scatter that sums, as every rank's queries read each key.
    dist.all_gather_single and reduce_scatter_single are torch 2.13's new names for
    all_gather_into_tensor and reduce_scatter_tensor, which 2.14 deprecates; on an older torch,
    call the old names (and drop the version check)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, n = group, dist.get_world_size(group)
        parts = x.new_empty((n * x.shape[0], *x.shape[1:]))  # rank r's x lands at r * len(x)
        dist.all_gather_single(parts, x.contiguous(), group=group)  # 4D 4: a collective of cp ranks
        return torch.cat(parts.chunk(n), dim=-2)

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        # Rank by rank along dim 0, in fp32: a sum in bf16 would round.
        parts = torch.cat(grad.chunk(n, dim=-2)).float()
        mine = parts.new_empty((parts.shape[0] // n, *parts.shape[1:]))
        dist.reduce_scatter_single(mine, parts, group=ctx.group)  # each rank gets its part, summed
        return mine.to(grad.dtype), None


@dataclasses.dataclass
class Data:
    windows: "Windows"  # this rank's training batches
    val: np.ndarray  # the last --val-fraction of the tokens, or a folder's val.bin
    vocab_size: int
    itos: dict  # id -> text, from a nanoGPT folder's meta.pkl; None for bytes or plain ids
    baseline: float  # the loss of predicting each token by its frequency, the loss to beat


def build_data(run):
    """This rank's training windows and the validation tokens; a collective with --debug."""
    args = run.args
    train, val, vocab_size, itos = load_data(args, run.dp_size)  # PP 3: a batch per replica
    windows = Windows(train, args.block_size, args.batch_size, run.dp_rank, run.dp_size,
                      args.seed)  # PP 3: its ranks are the replicas; their stages read alike
    baseline = unigram_loss(train, val, vocab_size)
    unit = "byte" if vocab_size == 256 else "token"
    print0(run.is_main, f"data {args.data or 'Python standard library'} | {len(train):,} train "
                        f"/ {len(val):,} val tokens | vocab {vocab_size} | "
                        f"{unit}-frequency baseline loss {baseline:.4f}")
    if args.debug:
        log_windows(run, windows)  # a collective: rank 0 prints every rank's windows
    return Data(windows, val, vocab_size, itos, baseline)


class Windows:
    """This rank's training batches. Each epoch cuts the tokens into windows that do not overlap,
    from a random offset, shuffles them (seeded by seed + epoch), and deals them to the replicas in
    turn, as DistributedSampler(drop_last=True) with set_epoch(epoch) would. Micro-batch k depends
    only on k, the seed and the replicas: a run resumed with as many replicas reads what an
    unbroken run would."""

    def __init__(self, tokens, block_size, batch_size, rank, world_size, seed):
        self.tokens, self.block, self.batch = tokens, block_size, batch_size
        self.rank, self.world, self.seed = rank, world_size, seed  # DDP 4: replica index and count
        # The windows that fit whatever the offset (at most block_size), split evenly over ranks.
        per_rank = (len(tokens) - block_size) // (block_size + 1) // world_size
        self.per_epoch = per_rank // batch_size  # per rank: all ranks change epoch together
        self.span = np.arange(block_size + 1)
        self.epoch, self.starts = None, None

    def starts_of_epoch(self, epoch):
        """The first token of every window this rank reads in `epoch`, in order."""
        # Seeded by epoch, not by rank, so every rank draws the same order and keeps its own part.
        g = torch.Generator().manual_seed(self.seed + epoch)  # DDP 5: a new order each epoch
        offset = int(torch.randint(0, self.block + 1, (1,), generator=g))
        count = self.per_epoch * self.batch * self.world
        order = torch.randperm((len(self.tokens) - offset) // (self.block + 1), generator=g)[:count]
        # DDP 4: this rank keeps every world_size-th window of the order, starting at its rank.
        return (offset + order * (self.block + 1))[self.rank::self.world].numpy()

    def rows(self, k):
        """Micro-batch k of this rank: a (B, block_size + 1) tensor of token ids, B windows."""
        epoch, i = divmod(k, self.per_epoch)
        if epoch != self.epoch:
            self.epoch, self.starts = epoch, self.starts_of_epoch(epoch)
        rows = self.tokens[self.starts[i * self.batch:(i + 1) * self.batch, None] + self.span]
        return torch.from_numpy(rows.astype(np.int64))


def build_model(run, vocab_size):  # FSDP 2: built on the meta device, sharded, then filled
    """This rank's stage of the model, split by TP and sharded over dp x cp, and its AdamW."""
    args = run.args
    with torch.device("meta"):  # FSDP 2: shapes and dtypes, no memory
        gpt = GPT(**model_config(args, vocab_size))
        raw_model = RankStages(gpt, run.stage, args.pp, args.stages_per_rank,  # PP 5
                               run.context)  # 4D 3: the schedule's forwards use this Context
    shard(run, raw_model)  # FSDP 2: before the optimizer, which must see the shards
    raw_model.to_empty(device=run.device)  # FSDP 2: this rank's shards, not yet filled
    # PP 5: from --seed alone on every rank, so that any layout starts from one process's weights
    init_shards(raw_model, args.seed, args.n_layer)  # n_layer: the GPT's depth, not the stage's
    for part in raw_model.parts:
        part.grad_checkpointing = args.grad_checkpointing
    optimizer = make_optimizer(raw_model, args, run.device)
    torch.manual_seed(args.seed + dropout_stream(run))  # 4D 5: by rank, or by tp group
    print0(run.is_main, f"model {raw_model.whole_params:,} parameters | "  # PP 5: the GPT's
                        f"{args.n_layer} layers, {args.n_head} heads, {args.n_embd} wide, "
                        f"context {args.block_size}")
    held = [None] * run.world_size  # PP 5: what every rank holds, for rank 0's line
    dist.all_gather_object(held, stage_holding(run, raw_model))  # a collective: every rank gets all
    print0(run.is_main, memory_line(raw_model, held))  # PP 5: what each stage holds
    print0(run.is_main, traffic_line(run, vocab_size))  # 4D 6: and what each group sends
    return raw_model, optimizer


def shard(run, model):  # FSDP 2: every block a unit of its own, then the root
    """TP, then FSDP: parallelize_module splits each block's matrices across the tp group, and the
    tied embedding and head by vocabulary; fully_shard then shards the stage across dp x cp."""
    sp = run.args.sequence_parallel == "on"
    # 4D 5: the cp ranks hold the same weights, so FSDP shards across dp x cp. Its average of their
    # gradients is the gradient of the mean loss over all tokens, as each holds as many tokens.
    mesh = run.mesh["dp", "cp"]._flatten("dp_cp")  # 4D 5
    reshard = run.args.reshard_after_forward == "yes"
    for part in model.parts:  # PP 5: each stage the rank holds is a root of its own
        for i, block in enumerate(part.blocks.values()):  # PP 5: the stage's blocks
            last = i == len(part.blocks) - 1  # the backward starts with it: kept whole
            if run.args.tp > 1:  # 4D 5: --tp 1 leaves the blocks whole
                parallelize_module(block, run.mesh["tp"], block_plan(sp))  # collectives in forward
            fully_shard(block, mesh=mesh, mp_policy=run.policy,
                        reshard_after_forward=reshard and not last)  # its parameters: shards
        plan = ends_plan(part, sp)  # 4D 5: the ends this stage holds, split by vocabulary
        if run.args.tp > 1 and plan:
            parallelize_module(part, run.mesh["tp"], plan)  # collectives in forward
            if part.tok_emb is not None and part.head is not None:  # --pp 1: one matrix again
                part.head.weight = part.tok_emb.weight  # both split the vocabulary alike
        fully_shard(part, mesh=mesh, mp_policy=run.policy)  # the root: whole until its backward


def block_plan(sp):
    """TP's plan for one block. Column-wise: q, k, v (whole heads, as attn.qkv orders its outputs
    head by head) and the MLP's first matrix. Row-wise: attn.proj and the MLP's second matrix, whose
    partial sums an all-reduce adds up. With sequence parallelism (sp), a reduce-scatter leaves each
    rank the sums for its part of the tokens instead; an all-gather joins them before the next."""
    if not sp:
        return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),  # 4D 5
                "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    whole = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    with_context = PrepareModuleInput(input_layouts=(Shard(1), None),  # attn(x, context): gathers x
                                      desired_input_layouts=(Replicate(), None))
    return {"ln1": SequenceParallel(), "attn": with_context, "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),  # 4D 5: reduce-scattered
            "ln2": SequenceParallel(), "mlp": whole, "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(output_layouts=Shard(1))}


def ends_plan(model, sp):
    """TP's plan for the ends this stage holds (the embeddings on the first stage, the final norm
    and head on the last): the tied matrix split by vocabulary. With sp, the embedding's sums go to
    each rank's part of the tokens. The head's logits stay split by vocabulary for loss parallel."""
    stream = Shard(1) if sp else Replicate()  # activations (B, T, C): split by position, or whole
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),  # 4D 5
            "head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1),
                                    use_local_output=False)}  # the logits: split by vocabulary
    if sp:
        plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(),
                                              desired_output_layouts=Shard(0))  # its positions
        plan["ln_f"] = SequenceParallel()
    return {name: style for name, style in plan.items() if getattr(model, name) is not None}


@torch.no_grad()
def init_shards(model, seed, n_layer):  # PP 5: n_layer is the GPT's; a stage holds fewer blocks
    """Fill this rank's shards with one process's initial weights: each parameter whole from the
    seed, one at a time; each rank keeps its slice, sending nothing (src_data_rank=None)."""
    for name, p in model.named_parameters():
        name = "tok_emb.weight" if name == "head.weight" else name  # PP 4: both copies alike
        full = initial_value(name, p.shape, seed, n_layer).to(p.device)
        p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None))  # no send


def dropout_stream(run):
    """The dropout seed's offset: by rank, or by tp group where its ranks hold copies (sp off)."""
    return run.rank if run.args.sequence_parallel == "on" else run.rank // run.args.tp  # 4D 5


def resumed_step(run, raw_model, optimizer, data):
    """A collective: the step to go on from, 0 or --resume's; every rank loads it, or all stop."""
    path, state, problem = resume_path(run), None, None  # FSDP 3: run.json first
    try:  # every rank reads it; the shards load only once all agree
        state = read_run_state(path, run, data) if path else None
        check_save_folder(run, path, state)  # FSDP 3: a folder of this run's steps alone
    except InputError as err:  # told to every rank below, so that none waits for this one
        problem = str(err)
    step = agree_on_start(state["step"] if state else 0, problem, path)  # FSDP 3: a collective
    if path:
        load_shards(path, state, run, raw_model, optimizer)  # FSDP 3: every rank, at once
        print0(run.is_main, f"resumed from {path} at step {step}")
    return step


def resume_path(run):
    """The checkpoint to resume from, or None. `auto` (a collective) takes --save if rank 0 finds
    it, so a restart after a crash reruns the same command; ranks looking alone could disagree."""
    resume, save = run.args.resume, run.args.save
    if resume != "auto":  # a folder every rank sees: each finds its newest complete step alike
        return resume and newest_complete_step(resume, run.is_main) or resume  # FSDP 3: newest
    if not save:
        raise InputError("--resume auto needs a --save path to look for")
    found = [newest_complete_step(save, run.is_main) if run.is_main else None]  # FSDP 3: newest
    dist.broadcast_object_list(found, src=0)  # DDP 7: rank 0 decides for every rank
    return found[0]  # FSDP 3: the newest complete step folder, or None


def agree_on_start(start, error, path):
    """A collective: the same step on every rank, or all stop with one line. A rank fails alone
    where its node cannot see the checkpoint, or sees another file than the other nodes."""
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (start, error))  # DDP 7: every rank gets every outcome
    failed = [(rank, problem) for rank, (_, problem) in enumerate(outcomes) if problem]
    if failed and len(failed) == len(outcomes) and len({p for _, p in failed}) == 1:
        raise InputError(failed[0][1])  # the same problem on every rank: the checkpoint's own
    if failed:
        raise InputError(f"rank {failed[0][0]}: {failed[0][1]} (every rank reads --resume: on "
                         "several nodes it must be on a filesystem they share, docs/multinode.md)")
    steps = [step for step, _ in outcomes]
    if len(set(steps)) > 1:
        raise InputError(f"the ranks read {path} at different steps {steps}: on several nodes it "
                         "must be one file on a filesystem they share (docs/multinode.md)")
    return start


def load_shards(path, state, run, raw_model, optimizer):  # FSDP 3
    """A collective: every rank reads the slices its shards hold, whatever world size wrote them
    (DCP knows which slice each file holds); then its RNG state, if this layout saved it."""
    model_state, optim_state = get_state_dict(raw_model, optimizer)  # my shards' state
    own_names = as_whole_model(run, raw_model, optim_state)  # PP 6: the whole model's names
    try:
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)  # every rank
    except (Exception, CheckpointException) as err:  # raised on every rank: DCP gathers them
        raise InputError(f"cannot load the shards of {path}: {first_reason(err)}") from None
    optim_state = as_stage(optim_state, own_names)  # PP 6: back to this stage's names
    set_state_dict(raw_model, optimizer, model_state_dict=model_state,  # into my shards
                   optim_state_dict=optim_state)
    if not shards_finite(raw_model):  # a collective: every rank gets the same answer
        raise InputError(f"{path} holds weights that are not finite: use an earlier checkpoint")
    saved, args = state["args"], run.args  # 4D 7: random states only at the layout that saved them
    if [saved.get(k) for k in ("pp", "cp", "tp", "sequence_parallel")] + [len(state["rng"])] == [
            args.pp, args.cp, args.tp, args.sequence_parallel, run.world_size]:
        restore_rng(state["rng"][run.rank], run.device)  # FSDP 3: this rank's streams


def shards_finite(model):  # FSDP 3: checked before every save
    """A collective: True on every rank if every rank's shards are free of NaN and infinity."""
    mine = all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())
    flag = torch.tensor([float(mine)], device=next(model.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # 0 if any rank's shards are not finite
    return bool(flag.item())


def wrap_model(run, raw_model):  # FSDP 4: no wrapper: the sharded model trains itself
    """The model that trains: the sharded raw_model, compiled with --compile. Two handles to one
    set of shards: `raw_model` (saved, exported) and `model`, the very same module object."""
    # PP 1: in place, so that the schedule gets the FSDP module (it switches its gradient sync).
    for block in raw_model.blocks.values() if run.args.compile else []:
        block.compile(backend=run.args.compile_backend)
    return raw_model


def pipeline_schedule(run, model):
    """This rank's stage in a schedule of K = --grad-accum micro-batches. After the last backward
    FSDP reduce-scatters once; the schedule then divides the gradients by K, for the mean loss.
    Until then a rank holds its stage's whole gradients and gathered weights: PipelineStage turns
    FSDP's gradient sync and its reshard after backward off for every micro-batch."""
    stages = [PipelineStage(part, part.index, len(model.parts) * run.args.pp, run.device,
                            *stage_shapes(run, part),  # given: no forward runs to infer them
                            group=run.mesh.get_group("pp"))  # PP 1: sends along the pp group
              for part in model.parts]
    if run.args.schedule == "interleaved-1f1b":  # PP 1: the rank's stages take turns
        return ScheduleInterleaved1F1B(stages, run.args.grad_accum, loss_fn=mean_token_loss,
                                       scale_grads=True)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[run.args.schedule]
    return kind(stages[0], run.args.grad_accum, loss_fn=mean_token_loss,  # PP 1: K micro-batches
                scale_grads=True)  # the gradients divided by K: each loss is a micro-batch's mean


def evaluate(run, model, val):  # FSDP 5: every rank runs as many forwards
    """The mean validation loss per token, each window once; a collective. Each forward
    needs every rank of its groups, so a rank with fewer batches adds padding (targets -100)."""
    batches = list(validation_batches(run, val))  # DDP 4: disjoint slices
    most = torch.tensor(len(batches), device=run.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the most batches any rank holds
    x = torch.zeros(1, run.args.block_size, dtype=torch.long, device=run.device)
    batches += [(x, torch.full_like(x, -100))] * (int(most) - len(batches))
    batches = [run.context.share(x, y) for x, y in batches]  # 4D 3: this rank's tokens
    return mean_loss_over_ranks(run, model, batches)  # PP 7: through the pipeline; a collective


def validation_batches(run, val):
    """This rank's validation batches, (inputs, targets) on its device: the first --eval-windows
    windows, dealt to the ranks in turn and never padded with repeats, so each counts once."""
    args = run.args
    starts = np.arange(0, len(val) - args.block_size, args.block_size + 1)[:args.eval_windows]
    mine = starts[run.dp_rank::run.dp_size]  # PP 3: by replica: its stages take the same ones
    for i in range(0, len(mine), args.batch_size):
        rows = val[mine[i:i + args.batch_size, None] + np.arange(args.block_size + 1)]
        yield on_device(torch.from_numpy(rows.astype(np.int64)), run.device)


@torch.no_grad()
def mean_loss_over_ranks(run, model, batches):  # PP 7: through every stage, summed over ranks
    """A collective: the mean cross-entropy per target over all ranks' batches (inputs, targets).
    Each rank sums its own losses and counts them; one all-reduce adds those up over the ranks."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for x, y in batches:
        logits = pipeline_forward(run, model, x)  # PP 7: None but on the last stage
        if logits is None:  # PP 7: only the last stage scores; the others add 0
            continue
        with loss_parallel():  # 4D 8: from this rank's logits, split by vocabulary
            loss = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten(), reduction="sum")
        totals[0] += local(loss)  # 4D 8: a tp group adds tp copies of its sum, and of its count
        totals[1] += (y != -100).sum()  # FSDP 5: the padding counts no token
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # DDP 9: all ranks' sums, divided below
    free_gathered_weights(model)  # FSDP 5: forwards without a backward leave weights gathered
    model.train()
    return (totals[0] / totals[1]).item()


@torch.no_grad()
def pipeline_forward(run, model, x, context=None):  # 4D 3: None: the run's Context
    """A forward through the replica's stages, a collective: the last stage's logits, else None.
    With several stages per rank, the activations go round the pp group once per stage held."""
    group, pp, shape = run.mesh.get_group("pp"), run.args.pp, stream_shape(run, x.shape)  # 4D 6
    for part in model.parts:  # PP 7: stage r, then r + pp, ...
        if part.tok_emb is None:  # every stage knows x's shape; stream_shape says what arrives
            x = torch.empty(shape, dtype=activation_dtype(run), device=run.device)
            dist.recv(x, group=group, group_src=(run.stage - 1) % pp)  # PP 7: the stage before
        x = part(x, context)  # 4D 3: with this rank's positions
        if part.head is None:  # the next stage's input, on the next rank of the pp group
            dist.send(x.contiguous(), group=group, group_dst=(run.stage + 1) % pp)  # PP 7
    return x if model.head is not None else None


def stream_shape(run, size):  # a stage sends (B, T, C) for ids (B, T), or (B, T / tp, C) with sp
    split = run.args.tp if run.args.sequence_parallel == "on" else 1
    return size[0], size[1] // split, run.args.n_embd  # 4D 6


def train_step(run, schedule, model, optimizer, windows, step):
    """A collective: one optimizer step; returns the global batch's loss and the unclipped norm."""
    args = run.args
    # PP 1: K micro-batches in a row, (K x B, T), cut by the schedule; stage 0 reads x, the last y
    rows = torch.cat([windows.rows(step * args.grad_accum + i) for i in range(args.grad_accum)])
    x, y = run.context.share(*on_device(rows, run.device))  # 4D 3: this rank's tokens, targets
    # Rank 0 of a pp group holds the first stage, rank pp - 1 the last, however many it holds.
    first, last, losses = run.stage == 0, run.stage == args.pp - 1, []
    inputs, target = ((x,) if first else ()), (y if last else None)
    with loss_parallel():  # 4D 8: the loss and its backward from logits split by vocabulary
        if args.pp > 1:
            schedule.step(*inputs, target=target, losses=losses if last else None,
                          return_outputs=False)  # each cp rank's mean; all have as many targets
        else:  # no pipeline: each backward reduce-scatters at once, so no rank keeps whole
            # gradients through the step (a schedule turns that off until its last backward)
            for xs, ys in zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum)):
                loss = mean_token_loss(model.parts[0](xs), ys)  # 4D 8: one micro-batch's mean
                (loss / args.grad_accum).backward()  # a K-th of the step's mean loss
                losses.append(loss.detach())
    losses = [local(part) for part in losses]  # 4D 8: plain tensors, a copy on each tp rank
    loss = torch.stack(losses).mean() if last else torch.zeros((), device=run.device)
    sum_tied_gradients(run, model)  # PP 4: a collective of the two ends
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args)
    grad_norm = clip_gradients(run, model, args.clip or float("inf"))  # PP 8: a collective
    # mean_over_ranks sums over all pp x dp x cp x tp ranks and divides by their number. The tp
    # ranks hold copies of one loss, so tp cancels; the stages but the last add 0, so x pp.
    loss = mean_over_ranks(loss) * args.pp  # PP 1: the other stages add 0: the last stage's mean
    stop_if_diverged(run, step, loss, grad_norm)
    optimizer.step()  # FSDP 1: no scaler; each rank steps its shards
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def sum_tied_gradients(run, model):
    """A collective of the two end stages: each tied copy gets the sum of both copies' gradients."""
    if run.tied is not None:  # None: a middle stage, or --pp 1 (one matrix, one gradient)
        copy = model.tok_emb.weight if run.stage == 0 else model.head.weight
        dist.all_reduce(copy.grad.to_local(), op=dist.ReduceOp.SUM, group=run.tied)  # PP 4: SUM


def local(loss):  # loss_parallel's loss, the same on each rank of a tp group
    return loss.to_local() if isinstance(loss, DTensor) else loss  # 4D 8: a plain tensor


def clip_gradients(run, model, max_norm):
    """The whole model's clip_grad_norm_: the stages' squared norms summed, the tied matrix once."""
    twin = model.head.weight if run.stage > 0 and model.head is not None else None  # PP 4: a copy
    on_mesh = {}  # 4D 9: FSDP's dp x cp mesh, or dp x cp x tp for parameters TP placed
    for p in model.parameters():
        on_mesh.setdefault(p.device_mesh, []).append(p)
    norms = [nn.utils.get_total_norm([p.grad for p in ps if p is not twin])
             for ps in on_mesh.values()]  # one per mesh: get_total_norm cannot mix meshes
    norm = sum(n.full_tensor() ** 2 for n in norms)  # each a collective: the stage's squared norm
    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=run.mesh.get_group("pp"))  # PP 8: stages
    norm = norm.sqrt()
    for ps in on_mesh.values():  # 4D 9: one clip per mesh, by the global norm
        nn.utils.clip_grads_with_norm_(ps, max_norm, norm)
    return norm


def mean_over_ranks(value):
    """A collective: the mean of a scalar tensor over all ranks, summed then divided."""
    value = value.detach().clone().float()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # DDP 9: every rank gets the sum of all ranks'
    return value / dist.get_world_size()


def save_checkpoint(run, raw_model, optimizer, data, step):  # FSDP 3: every rank its shards
    """A collective: every rank writes its shards of weights and AdamW state (DCP: no gather), rank
    0 then run.json (step, flags, vocabulary, every rank's RNG), all into DIR/partial-step-N, which
    takes its name DIR/step-N only once complete. Failed: SaveFailed on every rank, the partial
    folder removed, every complete step intact."""
    rng_states = [None] * run.world_size  # DDP 11: every rank's RNG, for an exact resume
    dist.all_gather_object(rng_states, rng_state(run.device))  # so rank 0 can save them all
    folder = os.path.join(run.args.save, f"step-{step:06d}")  # FSDP 3: a folder per step
    partial = os.path.join(run.args.save, f"partial-{os.path.basename(folder)}")  # FSDP 3
    if not shards_finite(raw_model):  # a collective: every rank gets the same answer
        raise SaveFailed(f"not saving {folder}: the weights are not finite")
    state = dict(zip(("model", "optimizer"), get_state_dict(raw_model, optimizer)))  # shards
    as_whole_model(run, raw_model, state["optimizer"])  # PP 6: named as the whole model names it
    try:  # a killed save leaves a partial folder, which no resume reads
        save_on_rank_0(lambda: remove_step(partial), run.is_main)  # a collective: a stale one
        dcp.save(state, checkpoint_id=partial)  # every rank its shards; .metadata last, by rank 0
        save_on_rank_0(lambda: write_file(os.path.join(partial, "run.json"),  # a collective
                                          run_state(run, data, step, rng_states)), run.is_main)
        save_on_rank_0(lambda: rename_step(partial, folder), run.is_main)  # FSDP 3: now complete
    except (SaveFailed, OSError, RuntimeError, CheckpointException) as err:  # DCP: on every rank
        save_on_rank_0(lambda: remove_step(partial), run.is_main)  # a collective
        failed = SaveFailed(f"cannot save {folder}: {first_reason(err, partial, state)}")
        raise (err if isinstance(err, SaveFailed) else failed) from None
    save_on_rank_0(lambda: drop_older_steps(run.args.save, folder), run.is_main)  # a collective
    print0(run.is_main, f"step {step}/{run.args.max_steps} | saved {folder}")


def save_on_rank_0(write, is_main):
    """A collective: rank 0 calls write(); every rank waits for it and raises what it raised.
    Never call it inside `if is_main:`, because the other ranks would not reach the broadcast."""
    error = None
    if is_main:
        try:
            write()
        except Exception as err:  # sent to every rank below, so that none goes on alone
            error = err
    outcome = [error]
    dist.broadcast_object_list(outcome, src=0)  # DDP 12: every rank waits here for rank 0's write
    if outcome[0] is not None:
        raise outcome[0]


def leave_distributed():
    """Free what a failed run left (its model may still hold the group), then leave it."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()  # DDP 13: each rank leaves once, when it is done


# --------------------------------------------------------------------------------- the model: a GPT
def causal_attention(q, k, v, causal=None):  # 4D 4: causal, the mask Context passes, or None
    """softmax(q k^T / sqrt(d)) v over earlier positions, in PyTorch's fused kernel, with a mask
    where q is shorter than k (Context's chunks). No dropout on the attention weights: on a CPU it
    forces the slow unfused path. On a CPU, attention runs in fp32 even in a bf16 run: the
    bf16 CPU backward kernel measured 3x slower than the fp32 one."""
    # 4D 4: where q holds the last positions of k's sequence, a lower-right mask aligns the last
    # query with the last key: of queries 12-15 over 16 keys, query 12 reads keys 0-12.
    # is_causal=True would align the first query with the first key, and train wrong.
    if causal is None and q.shape[-2] != k.shape[-2]:  # equal lengths use is_causal, no mask
        causal = causal_lower_right(q.shape[-2], k.shape[-2])
    cpu = q.device.type == "cpu"  # 4D 4: the same call on every device; a CPU runs it in fp32
    with torch.autocast("cpu", enabled=False) if cpu else contextlib.nullcontext():
        y = F.scaled_dot_product_attention(*(t.float() if cpu else t for t in (q, k, v)),
                                           attn_mask=causal, is_causal=causal is None)
    return y.to(q.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x, context=None):  # 4D 3: context, the tokens of each sequence held here
        B, T, C = x.shape
        # qkv's outputs hold each head's q, k and v side by side.
        # The -1 counts the heads this rank holds, n_head / tp.
        qkv = self.qkv(x).view(B, T, -1, 3, C // self.n_head)
        q, k, v = qkv.permute(3, 0, 2, 1, 4)  # each (B, heads, T, head size)
        if context is None:  # 4D 3: the whole sequence is here
            y = causal_attention(q, k, v)
        else:  # 4D 3: this rank's queries over the keys and values of every rank of its cp group
            y = context.attention(q, k, v)
        return self.proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, context=None):
        x = x + self.drop(self.attn(self.ln1(x), context))  # 4D 3
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout):
        super().__init__()
        self.block_size = block_size
        self.grad_checkpointing = False  # True: recompute each block's activations in backward
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying: one matrix embeds and un-embeds
        if not self.head.weight.is_meta:  # a weight with no storage (is_meta) cannot be filled
            self.init_weights(seed=0)

    @torch.no_grad()
    def init_weights(self, seed):
        """Set every parameter to initial_value(), so the same seed gives the same weights."""
        for name, p in self.named_parameters():
            p.copy_(initial_value(name, p.shape, seed, len(self.blocks)))

    def forward(self, idx, targets=None):
        """Logits (B, T, vocab), and the mean cross-entropy per token if targets are given. With
        tp > 1 the logits are a DTensor split by vocabulary, and the loss needs loss_parallel()."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            if self.grad_checkpointing and self.training:  # keep block inputs; recompute the rest
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature, top_k):
        """Append max_new_tokens tokens to idx (1, T), each drawn from the model's prediction."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size:])[0][:, -1] / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1)], dim=1)
        return idx


def initial_value(name, shape, seed, n_layer):
    """The initial value of parameter `name` in GPT-2's scheme: N(0, 0.02) for matrices, std
    0.02 / sqrt(2 x layers) for residual projections, zero biases, LayerNorm weights of one. Each
    draws from a generator seeded by (seed, name), so its value depends on nothing else."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if len(shape) == 1:  # a LayerNorm's weight
        return torch.ones(shape)
    residual = name.endswith(("attn.proj.weight", "mlp.2.weight"))
    std = 0.02 / math.sqrt(2 * n_layer) if residual else 0.02
    key = seed * 2**32 + zlib.crc32(name.encode())  # a seed past 32 bits: folded into 64
    generator = torch.Generator().manual_seed((key % 2**64) ^ (key >> 64))
    return torch.randn(shape, generator=generator) * std


class RankStages(nn.Module):
    """The stages rank r of the pp group holds: stages r, r + pp, ... of pp x per_rank, so that a
    micro-batch goes round the pp group per_rank times. Their parts sit under the whole model's
    names (tok_emb, blocks.2, head), registered once, here; `parts` lists the stages themselves,
    one PipelineStage each, in a plain list, so that no parameter has two names."""

    def __init__(self, gpt, rank, pp, per_rank, context):  # 4D 3: the run's Context
        super().__init__()
        self.parts = [Stage(gpt, rank + k * pp, pp * per_rank,  # PP 5
                            context) for k in range(per_rank)]  # 4D 3: shared by its stages
        first, last = self.parts[0], self.parts[-1]
        self.whole_params, self.whole_groups = first.whole_params, first.whole_groups
        self.tok_emb, self.pos_emb, self.drop = first.tok_emb, first.pos_emb, first.drop
        self.blocks = nn.ModuleDict({i: block for part in self.parts
                                     for i, block in part.blocks.items()})
        self.ln_f, self.head = last.ln_f, last.head

    def train(self, mode=True):  # the parts are not registered, so they are told here
        for part in self.parts:
            part.train(mode)
        return super().train(mode)


class Stage(nn.Module):
    """Stage `index` of `n_stages` of a GPT: its consecutive blocks under their own indices
    (blocks.2 stays blocks.2, so a checkpoint knows nothing of the stages), the embeddings on the
    first stage, the final norm and the head on the last. Its forward takes token ids (first
    stage) or the previous stage's activations, and returns activations, or the logits (last)."""

    def __init__(self, gpt, index, n_stages, context):  # 4D 3: the run's Context, for forwards
        super().__init__()
        self.context = context  # 4D 3: shared with every block's attention
        self.index, first, last = index, index == 0, index == n_stages - 1
        self.whole_params = sum(p.numel() for p in gpt.parameters())  # the tied matrix once
        self.whole_groups = [[n for n, p in gpt.named_parameters() if p.dim() >= 2],  # AdamW's
                             [n for n, p in gpt.named_parameters() if p.dim() < 2]]  # groups
        self.grad_checkpointing = False  # True: recompute each block's activations in backward
        self.tok_emb, self.pos_emb, self.drop = (gpt.tok_emb, gpt.pos_emb, gpt.drop) if first \
            else (None, None, None)
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i]  # PP 5: this stage's run of blocks
                                     for i in stage_blocks(len(gpt.blocks), n_stages, index)})
        self.ln_f, self.head = (gpt.ln_f, gpt.head) if last else (None, None)

    def forward(self, x, context=None):  # None: the run's Context (the schedule's forwards)
        context = context or self.context  # 4D 3: the tokens' places in the whole sequence
        if self.tok_emb is not None:  # the first stage: token ids (B, T) -> activations (B, T, C)
            x = self.drop(self.tok_emb(x) + self.pos_emb(context.positions))  # 4D 3
        for block in self.blocks.values():
            if self.grad_checkpointing and self.training:  # keep block inputs; recompute the rest
                x = checkpoint(block, x, context, use_reentrant=False)  # 4D 3
            else:
                x = block(x, context)  # 4D 3
        return x if self.head is None else self.head(self.ln_f(x))


def stage_blocks(n_layer, pp, stage):
    """The indices of the blocks that `stage` holds: the stages cut the blocks in order, into runs
    of equal length, the later stages one block more when pp does not divide n_layer."""
    size, extra = divmod(n_layer, pp)
    # Stage 0 holds the embeddings too and, under 1F1B, the most micro-batches in flight, so the
    # first stages take one block fewer.
    light = pp - extra
    first = stage * size + max(0, stage - light)
    return range(first, first + size + (stage >= light))  # PP 5: consecutive, as even as can be


def mean_token_loss(logits, targets):
    """The mean cross-entropy per token of logits (B, T, vocab) against targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # PP 1: last stage


# -------------------------------------------- beyond the core: debugging, the benchmark, the report
def log_windows(run, windows):
    """A collective: rank 0 prints each rank's windows, in rank order, so lines never splice."""
    line = (f"[rank {run.rank}] stage {run.stage}, dp {run.dp_rank}, cp "  # 4D 2
            f"{run.mesh.get_local_rank('cp')}, tp {run.mesh.get_local_rank('tp')}: "
            f"{windows.per_epoch} micro-batches per epoch, "
            f"first windows at tokens {windows.starts_of_epoch(0)[:4].tolist()}")
    lines = [None] * run.world_size
    dist.all_gather_object(lines, line)  # DDP 14: every rank gets all lines; rank 0 prints
    print0(run.is_main, "\n".join(lines))


def benchmark(run, schedule, model, optimizer, windows):  # PP 1: steps through the schedule
    """--benchmark: 5 warm-up steps, then --max-steps timed ones; median ms/step and tokens/s."""
    times = []
    for step in range(5 + run.args.max_steps):
        start = time.perf_counter()
        loss, _ = train_step(run, schedule, model, optimizer, windows, step)  # PP 1: a collective
        loss.item()  # wait for the device: the step is over
        times.append(time.perf_counter() - start)
    result = {**pace_keys(statistics.median(times[5:]), tokens_per_step(run)),
              "timed_steps": run.args.max_steps}
    log_peak_gpu_memory(run)  # a collective on GPUs: every rank's peak
    print0(run.is_main, f"benchmark | {result['step_ms']} ms/step | "
                        f"{result['throughput']:,.0f} tok/s")
    print0(run.is_main, summary_line(result))


def report(run, raw_model, data, val_loss, meter):
    """Every rank's GPU peak (a collective on GPUs), then rank 0's done line, summary, sample."""
    log_peak_gpu_memory(run)  # a collective on GPUs: every rank's peak
    summary = {**meter.summary(), "val_loss": val_loss, "baseline_loss": data.baseline}
    unit = "byte" if data.vocab_size == 256 else "token"
    print0(run.is_main, f"done | val loss {val_loss:.4f} ({unit}-frequency baseline "
                        f"{data.baseline:.4f}) | {summary['tokens_per_s']:,.0f} tok/s over "
                        f"{summary['train_s']:.1f} s of training")
    print0(run.is_main, summary_line(summary))
    if run.args.export:  # FSDP 8: one plain file, for one-process sampling
        export(run, raw_model, data)  # a collective: the weights gathered to rank 0
    if unit == "byte" or data.itos:  # FSDP 5: every rank generates: each forward gathers weights
        raw_model.eval()
        start = 10 if unit == "byte" else min(data.itos)  # a newline, or the first piece
        torch.manual_seed(run.args.seed + run.dp_rank)  # 4D 10: a replica's ranks draw alike
        out = generate(run, raw_model, torch.tensor([[start]], device=run.device))  # PP 7
        print0(run.is_main, "sample:\n" + decode(out[0].tolist(), data.itos))  # FSDP 5: rank 0's


def export(run, raw_model, data):  # FSDP 8: one plain file, as one process saves it
    """A collective: every rank's shards to rank 0's CPU, which writes one plain state_dict."""
    if not shards_finite(raw_model):  # a collective: every rank gets the same answer
        raise SaveFailed(f"not exporting {run.args.export}: the weights are not finite")
    options = StateDictOptions(full_state_dict=True)  # PP 6: each rank gathers its stage whole
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")  # 4D 5: it warns
    level = redistribute.level  # that a matrix split two ways is gathered by two all-gathers,
    redistribute.setLevel(logging.ERROR)  # one per dim; true, and silenced for this call only
    try:
        stage = get_model_state_dict(raw_model, options=options)  # all-gathers within the stage
    finally:
        redistribute.setLevel(level)
    stage = {k: v.cpu() for k, v in stage.items()}
    stages = [None] * run.world_size if run.is_main else None
    first = run.rank % (run.world_size // run.args.pp) == 0  # 4D 1: a stage's first rank sends
    dist.gather_object(stage if first else {}, stages, dst=0)  # PP 6: to rank 0
    weights = {k: v for part in stages or [] for k, v in part.items()}  # in the GPT's order
    save_on_rank_0(lambda: write_export(run, weights, data), run.is_main)  # a collective


@torch.no_grad()
def generate(run, model, idx):
    """Append --max-new-tokens tokens to idx (1, T); a collective of every rank. The last stage
    draws each token from its logits and sends it to every stage at its place."""
    args = run.args
    whole = Context(None, 0, 1, args.block_size, run.device)  # 4D 10: cp 1, every rank all tokens
    for _ in range(args.max_new_tokens):
        window = idx[:, -args.block_size:]  # 4D 10: padded on the right to --block-size, so that
        padded = F.pad(window, (0, args.block_size - window.shape[1]))  # sp can split it by tp;
        logits = pipeline_forward(run, model, padded, whole)  # causal: no token reads the padding
        token = torch.zeros(1, 1, dtype=torch.long, device=run.device)
        if logits is not None:  # the last stage draws the token; the broadcast sends it to all
            logits = logits[:, window.shape[1] - 1]  # 4D 10: the last token's
            logits = logits.full_tensor() if isinstance(logits, DTensor) else logits  # all-gather
            token = next_token(logits, args.temperature, args.top_k)
        dist.broadcast(token, group=run.mesh.get_group("pp"), group_src=args.pp - 1)  # to all
        idx = torch.cat([idx, token], dim=1)
    return idx


def log_peak_gpu_memory(run):  # DDP 16: every rank's peak, printed by rank 0
    """A collective on CUDA: rank 0 prints every rank's peak of allocated GPU memory, in order."""
    if run.device.type != "cuda":
        return
    peaks = [None] * run.world_size
    dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(run.device))  # DDP 16: all peaks
    print0(run.is_main, "peak GPU memory per rank (max_memory_allocated): " +
           ", ".join(f"rank {rank} {peak / 2**20:,.1f} MiB" for rank, peak in enumerate(peaks)))


# ============================================================================== the plumbing


# ---------------------------------------- guards: each stops one thing going wrong in production
def avoid_known_failures(args):  # guard: all guards, in one place, before the group is joined
    """Exit code 2 for a launch that could never join a group; a workaround for each known fault."""
    if not hasattr(dist, "all_gather_single"):  # 4D 4: GatherContext's collectives (torch 2.13)
        sys.stderr.write("error: this chapter needs torch 2.13 or newer (dist.all_gather_single): "
                         f"this is {torch.__version__}\n")
        sys.exit(2)  # as for any launch that cannot work; asking for the call, not the version,
        # lets a nightly (2.13.0a0, which compares below 2.13) through
    refuse_a_bad_launch(args.device)  # guard: no torchrun, or more processes than GPUs
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    backend = "nccl" if cuda else "gloo"
    level = safe_debug_level(backend, args.debug, dist.get_debug_level())  # guard: DETAIL on gloo
    dist.set_debug_level(level)  # before init_process_group, which reads it
    if not cuda:
        avoid_page_faults_on_cpu()  # guard: page faults every step on Linux CPUs
    logging.getLogger().addFilter(avoid_dcp_tracebacks)  # FSDP 3: DCP's logged tracebacks
    refuse_a_mesh_the_world_cannot_hold(args)  # guard: 4D 1, one line before the group
    node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))  # 4D 1: per node
    warning = avoid_groups_across_nodes(args.tp, args.cp, node)  # guard: 4D 1
    if warning and os.environ["RANK"] == "0":
        print(warning, flush=True)
    replicas = int(os.environ["WORLD_SIZE"]) // (args.pp * args.cp * args.tp)  # 4D 3: dp
    refuse_a_context_longer_than_the_data(args, replicas)  # guard: one line before the context


def refuse_a_context_longer_than_the_data(args, replicas):  # guard: before the context is made
    """load_data's one line for a --block-size the data cannot hold, said before make_run makes
    the context (8 bytes a position: at 10^13, 80 TB asked for). A file's bytes bound its tokens
    (the default corpus: 2,000,000 bytes): only a context past them reads the data here."""
    data, folder = args.data, args.data is not None and os.path.isdir(args.data)
    files = glob.glob(os.path.join(glob.escape(data), "*.bin")) if folder else [data]
    size = sum(os.path.getsize(f) for f in files if f is not None and os.path.isfile(f))
    if args.block_size < (2_000_000 if data is None else size):
        return
    if os.environ["RANK"] != "0":
        sys.exit(2)  # rank 0 says why; torchrun reports every rank's exit code
    load_data(args, replicas)  # 4D 3: raises its InputError, too few tokens (or no such file)


def refuse_a_mesh_the_world_cannot_hold(args):  # guard: sizes that torchrun's world cannot split
    """InputError on rank 0, and a quiet exit code 2 elsewhere, where pp x cp x tp does not divide
    the world size: one line for the whole launch, before any rank joins a group."""
    world, inner = int(os.environ["WORLD_SIZE"]), args.pp * args.cp * args.tp
    if world % inner == 0:
        return
    if os.environ["RANK"] != "0":
        sys.exit(2)  # rank 0 says why; torchrun reports every rank's exit code
    raise InputError(f"--pp {args.pp} x --cp {args.cp} x --tp {args.tp} = {inner} does not divide "
                     f"the world size {world}: start a multiple of {inner} processes, or give "
                     "smaller sizes")


def avoid_groups_across_nodes(tp, cp, per_node):  # guard: tp or cp traffic over the network
    """A line naming the groups that span nodes of per_node processes, or None. A tp group (tp
    consecutive ranks) across nodes sends TP's collectives of every block over the network: a
    warning. A cp group (cp ranks, tp apart) across nodes sends only the key and value gathers
    there, as large runs plan: a note. Neither is refused (a small run may choose it)."""
    if per_node % tp:
        return (f"warning: a tp group (--tp {tp}) spans nodes of {per_node} processes: TP's "
                "collectives of every block and micro-batch cross the network")
    if per_node % (tp * cp):
        return (f"note: cp groups (--cp {cp}, ranks {tp} apart) span nodes of {per_node} "
                "processes: their key and value gathers cross the network, the tp groups do not")
    return None


def refuse_a_bad_launch(device_name):  # guard: a process that could never join a group
    """Exit code 2 and one line if torchrun did not start this process, or its GPU is missing."""
    def refuse(problem):
        sys.stderr.write(f"error: {problem}\n")
        sys.exit(2)

    if "RANK" not in os.environ:  # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
        refuse("not launched by torchrun: see the commands at the top of this script")
    if device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available()):
        local_rank, visible = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        if local_rank >= visible:
            refuse(f"--device cuda: GPU {local_rank} asked for, but {visible} visible: start at "
                   "most one process per GPU (--nproc_per_node), or --device cpu")


def safe_debug_level(backend, debug, level):  # guard: TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo
    """The debug level to run at, starting from the shell's. --debug asks for DETAIL on NCCL and
    INFO on gloo. DETAIL on gloo is untested here (it crashes other trainers), so there it
    becomes INFO, with one warning."""
    if debug:
        level = dist.DebugLevel.DETAIL if backend == "nccl" else dist.DebugLevel.INFO
    if backend == "gloo" and level == dist.DebugLevel.DETAIL:  # the shell's
        if os.environ["RANK"] == "0":  # no group yet, so torchrun's RANK says who logs
            print("warning: TORCH_DISTRIBUTED_DEBUG=DETAIL is untested on gloo "
                  "(docs/troubleshooting.md): going on at INFO", flush=True)
        level = dist.DebugLevel.INFO
    return level


def avoid_page_faults_on_cpu():  # guard: glibc returning freed memory at once
    """On Linux CPUs (glibc), keep freed memory in the process. Otherwise glibc hands each step's
    tens of MB (the logits) back to the OS, and the page faults cost 10-30% of a step."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc (macOS, musl, Windows): nothing to tune
    libc.mallopt(-4, 0)  # M_MMAP_MAX = 0: serve large blocks from the heap, not fresh mmaps
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD = 1 GiB: keep that much freed heap for reuse


def avoid_dcp_tracebacks(record):  # guard: a filter of the root logger, which DCP logs to
    """False for DCP's warnings that carry a traceback. A truncated .metadata makes DCP log one
    per way it tries to read it, beside load_shards' one line that says what failed."""
    where = record.pathname.replace(os.sep, "/")  # FSDP 3: DCP's own files
    return not (record.exc_info and "torch/distributed/checkpoint/" in where)


# ------------------------------------------------------------------------------------------ flags
class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, instead of argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(kind, zero_ok=False, most=None):
    """An argparse type: a finite number of `kind` above zero (at least zero if zero_ok), at most
    `most` if given. NaN and infinity are refused here, before they reach a step."""
    def parse(text):
        value = kind(text)
        if kind is float and not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            bound = "at least 0" if zero_ok else "positive"
            raise argparse.ArgumentTypeError(f"must be a finite number, {bound}, got {text}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:g}, got {text}")
        return value
    parse.__name__ = f"positive {kind.__name__}"  # argparse names it: "invalid positive int value"
    return parse


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    a = p.add_argument_group("data").add_argument
    a("--data", metavar="PATH",
      help="a text file (its bytes are the tokens), a .bin of uint16 token ids, or a nanoGPT "
           "folder: train.bin, val.bin, meta.pkl (default: the Python standard library)")
    a("--vocab-size", type=positive(int), metavar="N",
      help="the ids of a .bin (or a folder without meta.pkl) are below N")
    a("--val-fraction", type=float, default=0.1, metavar="F",
      help="the tail of the data held out for validation (default: 0.1)")
    a = p.add_argument_group("model").add_argument
    a("--n-layer", type=positive(int), default=4, metavar="N",
      help="transformer blocks (default: 4)")
    a("--n-head", type=positive(int), default=4, metavar="N",
      help="attention heads, must divide --n-embd (default: 4)")
    a("--n-embd", type=positive(int), default=128, metavar="N",
      help="width of the residual stream (default: 128)")
    a("--block-size", type=positive(int), default=128, metavar="T",
      help="context length in tokens (default: 128)")
    a("--dropout", type=float, default=0.0, metavar="P", help="dropout probability (default: 0.0)")
    a("--grad-checkpointing", action="store_true",
      help="recompute each block's activations in backward: less memory, more time")
    a("--compile", action="store_true", help="torch.compile each block, in place (default: off)")
    a("--compile-backend", default="inductor",
      choices=("inductor", "aot_eager", "eager", "cudagraphs"),
      help="torch.compile backend (default: inductor)")
    a = p.add_argument_group("training").add_argument
    a("--batch-size", type=positive(int), default=16, metavar="B",  # PP 3: per replica
      help="sequences per micro-batch, per replica: every stage of a replica works on the same "
           "ones (default: 16)")
    a("--grad-accum", type=positive(int), default=4, metavar="K",  # PP 1
      help="micro-batches per optimizer step: the pipeline's; the more, the smaller its bubble "
           "((pp - 1) / (K + pp - 1) of the step idle, for equal stages) and the larger the "
           "global batch; 1f1b needs K >= --pp (default: 4)")
    a("--max-steps", type=positive(int), default=300, metavar="N",
      help="optimizer steps (default: 300)")
    a("--lr", type=positive(float), default=3e-3, help="peak learning rate (default: 0.003)")
    a("--min-lr", type=positive(float, zero_ok=True), default=3e-4, metavar="LR",
      help="where the cosine ends (default: 0.0003)")
    a("--warmup-steps", type=positive(int, zero_ok=True), default=30, metavar="N",
      help="steps of linear warmup (default: 30)")
    a("--weight-decay", type=positive(float, zero_ok=True), default=0.1, metavar="W",
      help="AdamW's, on matrices only (default: 0.1)")
    a("--clip", type=positive(float, zero_ok=True), default=1.0, metavar="NORM",
      help="clip the gradient norm to NORM, 0 = off (default: 1.0)")
    a("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto",
      help="the compute dtype of FSDP's policy; auto: bf16 on GPUs that have it natively, else "
           "off (fp32); fp16 is refused (default: auto)")
    a("--seed", type=int, default=0, help="seeds the weights, data order, dropout (default: 0)")
    a("--device", choices=["auto", "cpu", "cuda"], default="auto",
      help="auto = cuda if there is one, else cpu (default: auto)")
    a = p.add_argument_group("distributed: timeouts, debugging and the layout").add_argument
    a("--dist-timeout", type=positive(float, most=7 * 86400), default=300, metavar="S",
      help="seconds a collective waits for a peer before the job fails (default: 300)")
    a("--pp", type=positive(int), default=2, metavar="N",  # PP 2
      help="pipeline stages: runs of consecutive blocks, each on world size / N consecutive "
           "ranks; must divide the world size, at most --n-layer (default: 2)")
    a("--cp", type=positive(int), default=2, metavar="N",  # 4D 1
      help="context-parallel ranks: each sequence's tokens split in 2 x N chunks; 2 x N must "
           "divide --block-size; 1: no split (default: 2)")
    a("--tp", type=positive(int), default=2, metavar="N",  # 4D 1
      help="tensor-parallel ranks: consecutive ranks, one node's GPUs; must divide --n-head; 1: "
           "no split (default: 2). pp x cp x tp must divide the world size: dp is the rest")
    a("--sequence-parallel", choices=["on", "off"], default="on",  # 4D 5
      help="split the norms' and dropout's activations by sequence in a tp group (default: on)")
    a("--schedule", choices=["gpipe", "1f1b", "interleaved-1f1b"], default="1f1b",  # PP 1
      help="the order of a step's micro-batches: gpipe (all forwards, then all backwards), "
           "1f1b (after a warm-up, one forward and one backward in turn: fewer activations "
           "held) or interleaved-1f1b (1f1b over --stages-per-rank stages per rank: a smaller "
           "bubble, more sends) (default: 1f1b)")
    a("--stages-per-rank", type=positive(int), default=1, metavar="V",  # PP 5
      help="stages each rank holds, every pp-th (rank r: r, r + pp, ...); above 1 needs "
           "--schedule interleaved-1f1b, which needs it above 1 (default: 1)")
    a("--reshard-after-forward", choices=["yes", "no"], default="no",  # PP 1: no by default
      help="yes: free each block's gathered weights (but the last's) after each forward, "
           "from then to its backward only: the schedule keeps them after each backward, so "
           "the whole stage is gathered again by then (more all-gathers, no lower peak); "
           "no: one all-gather per block and step, or per micro-batch at --pp 1, where no "
           "schedule keeps them (default: no)")
    a("--debug", action="store_true", help="TORCH_DISTRIBUTED_DEBUG and each rank's data windows")
    a = p.add_argument_group("evaluation, logging, checkpoints").add_argument
    a("--eval-every", type=positive(int), default=100, metavar="N",
      help="steps between evaluations (default: 100)")
    a("--eval-windows", type=positive(int), default=128, metavar="N",
      help="validation sequences per evaluation (default: 128)")
    a("--log-every", type=positive(int), default=10, metavar="N",
      help="steps between log lines (default: 10)")
    a("--save", default="checkpoints/minigpt_4d", metavar="DIR",  # 4D 7
      help="a folder of step-N folders, new or resumed from; '' for none (default: %(default)s)")
    a("--export", default="checkpoints/minigpt_4d.pt", metavar="PATH",  # 4D 7
      help="the final weights in one plain file, which --sample reads, '' for none "
           "(default: %(default)s)")
    a("--save-every", type=positive(int, zero_ok=True), default=0, metavar="N",
      help="also save every N steps, 0 = only at the end (default: 0)")
    a("--resume", metavar="DIR",  # FSDP 3
      help="go on from this checkpoint folder's newest complete step; 'auto': from --save's")
    a("--gpu-peak-tflops", type=positive(float), metavar="T",
      help="one GPU's peak TFLOPS for MFU (default: from the GPU's name and --amp, for A100, "
           "H100, H200, L4, L40S, A10, V100, T4, RTX 3090/4090)")
    a("--benchmark", action="store_true",
      help="time --max-steps steps after 5 warm-up steps; no evaluation, no checkpoint")
    a = p.add_argument_group("sampling (one process, no torchrun)").add_argument
    a("--sample", action="store_true", help="generate text from --ckpt instead of training")
    a("--ckpt", metavar="PATH", help="the checkpoint to sample from")
    a("--prompt", default="\n", metavar="TEXT",
      help="text to start from, not empty (default: a newline)")
    a("--max-new-tokens", type=positive(int), default=300, metavar="N",
      help="tokens to generate, by --sample and after training (default: 300)")
    a("--temperature", type=positive(float), default=0.8, metavar="T",
      help="below 1: safer choices, above 1: wilder ones (default: 0.8)")
    a("--top-k", type=positive(int, zero_ok=True), default=40, metavar="K",
      help="draw from the K likeliest tokens, 0 = from all (default: 40)")
    args = p.parse_args(argv)
    if args.n_embd % args.n_head:
        p.error(f"--n-head {args.n_head} must divide --n-embd {args.n_embd}")
    if args.n_head % args.tp:  # 4D 1: every tp rank holds whole heads
        p.error(f"--tp {args.tp} must divide --n-head {args.n_head}: each rank holds whole heads")
    if args.block_size % (2 * args.cp):  # 4D 3: 2 x cp equal chunks
        p.error(f"--block-size {args.block_size} must be a multiple of 2 x --cp = {2 * args.cp}: "
                f"each sequence is cut into {2 * args.cp} equal chunks")
    split = args.tp if args.sequence_parallel == "on" else 1  # 4D 5: a cp rank's tokens by tp
    if args.block_size // args.cp % split:
        p.error(f"--sequence-parallel on splits a cp rank's {args.block_size // args.cp} tokens "
                f"in --tp {args.tp} parts: give a --block-size that --cp x --tp divides, or "
                "--sequence-parallel off")
    if args.pp * args.stages_per_rank > args.n_layer:  # PP 2: every stage holds a block
        stages = f" x --stages-per-rank {args.stages_per_rank}" * (args.stages_per_rank > 1)
        p.error(f"--pp {args.pp}{stages} is more stages than --n-layer {args.n_layer} blocks")
    interleaved = args.schedule == "interleaved-1f1b"  # PP 1: and only it, several per rank
    if interleaved != (args.stages_per_rank > 1) or (interleaved and args.pp == 1):
        p.error(f"--schedule interleaved-1f1b needs --pp 2 or more and --stages-per-rank 2 or "
                f"more, and is the only schedule for them: got --schedule {args.schedule}, "
                f"--pp {args.pp}, --stages-per-rank {args.stages_per_rank}")
    rounds = max(1, args.grad_accum // args.pp)  # PP 1: torch's interleaved 1F1B runs in rounds
    if interleaved and args.grad_accum % rounds:
        p.error(f"--schedule interleaved-1f1b runs --grad-accum {args.grad_accum} in "
                f"{rounds} rounds (--grad-accum // --pp, at least 1) of equal size: give a "
                f"multiple of {rounds}, or of --pp")
    if args.schedule == "1f1b" and args.grad_accum < args.pp:  # PP 1: torch's 1F1B needs K >= pp
        p.error(f"--schedule 1f1b needs at least --pp {args.pp} micro-batches per step, got "
                f"--grad-accum {args.grad_accum}: give more, or --schedule gpipe")
    if not 0 <= args.dropout < 1 or not 0 < args.val_fraction < 1:
        p.error("--dropout must be in [0, 1) and --val-fraction in (0, 1)")
    if args.dist_timeout < 1:  # below a second, a rank that is only slow looks dead
        p.error(f"--dist-timeout must be between 1 and 604800 seconds (a week), got "
                f"{args.dist_timeout:g}")
    if not 0 <= args.seed < 2**63:  # torch takes seeds below 2**64: seed + epoch fits too
        p.error(f"--seed must be between 0 and {2**63 - 1}, got {args.seed}")
    if args.sample and not args.ckpt:
        p.error("--sample needs --ckpt PATH")
    if not args.prompt:
        p.error("--prompt must not be empty")
    return args


# ------------------------------------------------------------------------------------------- data
def load_tokens(args, default_bytes=2_000_000):
    """All tokens as a 1-D numpy array, and the vocabulary size. A text file's bytes are its
    tokens; a .bin file is memory-mapped, so a corpus of many GB costs no RAM until it is read."""
    if args.data is None:
        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        raw = b"".join(open(f, "rb").read() for f in files)[:default_bytes]
        return np.frombuffer(raw, dtype=np.uint8), 256
    if not os.path.isfile(args.data):
        raise InputError(f"data file not found: {args.data}")
    if not args.data.endswith(".bin"):
        return np.fromfile(args.data, dtype=np.uint8), 256
    if args.vocab_size is None:
        raise InputError(f"{args.data} holds token ids: give --vocab-size "
                         "(e.g. 50304 for GPT-2's BPE)")
    return read_ids(args.data, args.vocab_size, "--vocab-size"), args.vocab_size


def read_meta(path):
    """nanoGPT's meta.pkl ({"vocab_size", "itos", "stoi"}), read without running it: a pickle may
    call any function; this unpickler refuses them all, and takes dicts, lists, strings and ints."""
    class PlainData(pickle.Unpickler):
        def find_class(self, module, name):
            raise pickle.UnpicklingError(f"it asks for {module}.{name}, not plain data")

    def plain(x):  # dicts, lists, strings and ints, all the way down
        if isinstance(x, dict):
            return all(plain(k) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return isinstance(x, (str, int))
    try:
        with open(path, "rb") as f:
            meta = PlainData(f).load()
    except Exception as err:  # refused, truncated, not a pickle
        raise InputError(f"cannot read {path}: {type(err).__name__}: {err}") from None
    size, itos = (meta.get("vocab_size"), meta.get("itos")) if isinstance(meta, dict) else (0, 0)
    ids_to_text = isinstance(itos, dict) and all(isinstance(v, str) for v in itos.values())
    if not (plain(meta) and ids_to_text and type(size) is int and set(itos) == set(range(size))):
        raise InputError(f"{path} is not a nanoGPT meta.pkl of plain dicts, strings and ints, with "
                         "itos naming each id below vocab_size")
    return size, itos


def load_folder(args):
    """A nanoGPT data folder: train.bin and val.bin of uint16 ids, and for character-level sets a
    meta.pkl with the vocabulary. Returns train, val, vocab size, and itos (id -> text) or None."""
    paths = [os.path.join(args.data, name) for name in ("train.bin", "val.bin", "meta.pkl")]
    missing = [p for p in paths[:2] if not os.path.isfile(p)]
    if missing:
        raise InputError(f"{args.data} is a folder but holds no {' and no '.join(missing)}")
    vocab_size, itos = read_meta(paths[2]) if os.path.isfile(paths[2]) else (args.vocab_size, None)
    if vocab_size is None:
        raise InputError(f"{args.data} has no meta.pkl: give --vocab-size (e.g. 50304 for GPT-2)")
    train, val = (read_ids(p, vocab_size, "its meta.pkl" if itos else "--vocab-size")
                  for p in paths[:2])
    return train, val, vocab_size, itos


def read_ids(path, vocab_size, source):
    """A .bin of uint16 token ids, memory-mapped; every id must be below vocab_size."""
    size = os.path.getsize(path)
    if size % 2:
        raise InputError(f"{path} has an odd number of bytes: not a file of uint16 token ids")
    tokens = np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, np.uint16)
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise InputError(f"{path} holds token id {int(tokens.max())}, not below the vocabulary "
                         f"size {vocab_size} ({source})")
    return tokens


def load_data(args, world_size):
    """Training and validation tokens, the vocabulary size and itos (id -> text, or None). A file
    is split: training on the head, validation on the tail. Refuses data too short for a batch."""
    if args.data is not None and os.path.isdir(args.data):
        train, val, vocab_size, itos = load_folder(args)
    else:
        tokens, vocab_size = load_tokens(args)
        n_val, itos = int(len(tokens) * args.val_fraction), None
        train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    need = world_size * args.batch_size * (args.block_size + 1)
    if len(train) < need + args.block_size or len(val) < args.block_size + 1:
        raise InputError(f"{args.data or 'the default corpus'} has {len(train):,} training and "
                         f"{len(val):,} validation tokens: too few for {world_size} replica(s) x "
                         f"--batch-size {args.batch_size} x --block-size {args.block_size}; give "
                         "more data or smaller sizes")
    return train, val, vocab_size, itos


def unigram_loss(train, val, vocab_size):
    """Cross-entropy (nats/token) on the validation tokens of predicting each token by its frequency
    in the training tokens: the loss to beat, for a model that ignores context."""
    counts = np.bincount(train, minlength=vocab_size) + 1.0  # +1: no token has probability 0
    return float(-np.log(counts / counts.sum())[val].mean())


def on_device(rows, device):
    """Token rows (B, T + 1) as inputs and targets (B, T) on `device`. On a GPU the rows are
    copied from page-locked memory, so the copy can overlap GPU work, and sliced there."""
    if device.type == "cuda":
        rows = rows.pin_memory()
    rows = rows.to(device, non_blocking=True)
    return rows[:, :-1], rows[:, 1:]


# -------------------------------------------------------------- precision, optimizer, schedule
def amp_dtype(choice, device):
    """The compute dtype, or None for fp32. bf16 has fp32's range, so it needs no loss scaling.
    Only native bf16 counts: V100s and T4s only emulate it."""
    native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    if choice == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if native_bf16 else torch.float16
    if choice == "fp16" and device.type != "cuda":
        raise InputError("--amp fp16 needs a CUDA device; on a CPU use --amp bf16 or --amp off")
    if choice == "bf16" and device.type == "cuda" and not native_bf16:
        raise InputError("--amp bf16: this GPU has no native bf16 (only slow emulation); "
                         "use --amp off")  # FSDP 1: not fp16, which this trainer refuses
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[choice]


def mixed_precision(choice, device):  # FSDP 1: FSDP's policy casts the weights, not autocast
    """(the dtype's name, FSDP's policy). Each shard is cast to bf16 before its all-gather, so
    gathers and compute run in bf16; FSDP reduce-scatters in fp32; shards stay fp32. No scaler."""
    dtype = amp_dtype(choice, device)
    if dtype == torch.float16 and choice == "auto":  # FSDP 1: no native bf16: fp32 here
        dtype = None
    if dtype == torch.float16:
        raise InputError("--amp fp16: this FSDP trainer runs bf16 or fp32 (fp16 would need loss "
                         "scaling of sharded gradients); use --amp bf16, or train_ddp_minigpt.py")
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return str(dtype or "off").replace("torch.", ""), policy


def model_config(args, vocab_size):
    return {"vocab_size": vocab_size, "block_size": args.block_size, "n_layer": args.n_layer,
            "n_head": args.n_head, "n_embd": args.n_embd, "dropout": args.dropout}


def make_optimizer(model, args, device):
    """AdamW; weight decay on matrices (embeddings, linear weights) only, never biases or norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def lr_at(step, args):
    """Linear warmup to --lr over --warmup-steps, then a cosine down to --min-lr at --max-steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))  # from 1 down to 0
    return args.min_lr + cosine * (args.lr - args.min_lr)


def stop_if_diverged(run, step, loss, grad_norm):
    """Raise Diverged, before the optimizer applies it, if a step's loss or gradient norm is not
    finite. Both are the same on every rank, so every rank stops at this step."""
    loss, grad_norm = loss.item(), grad_norm.item()  # a host sync per step: the price of the check
    if math.isfinite(loss) and math.isfinite(grad_norm):  # FSDP 1: no fp16, so no scaler to skip
        return
    args = run.args
    raise Diverged(f"step {step + 1}/{args.max_steps}: loss {loss:.4g}, grad norm {grad_norm:.4g}: "
                   f"not finite, step not applied; try a lower --lr (now {args.lr:g}), a --clip "
                   f"(now {args.clip:g})")


# ------------------------------------------------------------------------------- checkpoint files
def all_finite(state_dict):
    """True if every floating-point tensor of a state dict is free of NaN and infinity."""
    return all(bool(torch.isfinite(t).all()) for t in state_dict.values() if t.is_floating_point())


def state_bytes(state):
    """About the bytes a checkpoint of `state` takes: its tensors', in nested dicts and lists."""
    if torch.is_tensor(state):
        return state.nbytes
    if isinstance(state, bytes):  # a file's bytes, ready to write
        return len(state)
    if isinstance(state, dict):
        state = list(state.values())
    return sum(map(state_bytes, state)) if isinstance(state, (list, tuple)) else 0


def why_not_written(err, tmp, needed):
    """Why writing `tmp` failed, in one line: a full disk (or quota) says so, with the room left
    (the partial file gone) and the room a checkpoint needs; then the system's or torch's words."""
    detail = getattr(err, "strerror", None) or (str(err).strip().splitlines() or [repr(err)])[0]
    folder = os.path.dirname(os.path.abspath(tmp))
    while not os.path.isdir(folder):  # a folder that could not be made
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder).free + (os.path.getsize(tmp) if os.path.isfile(tmp) else 0)
    if getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or free < needed:
        return (f"the disk holding {folder} is full: {readable_size(free)} free, a checkpoint "
                f"needs about {readable_size(needed)} ({detail})")
    return detail


def readable_size(n):
    """A number of bytes for a person: MB, or kB below 0.1 MB."""
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def run_state(run, data, step, rng_states):  # FSDP 3: all of a step but the shards
    """What a step needs besides its shards, as JSON: the step, model config, flags and every
    rank's RNG states (their bytes as lists of numbers)."""
    rng = [{k: None if v is None else v.tolist() for k, v in r.items()} for r in rng_states]
    return json.dumps({"step": step, "config": model_config(run.args, data.vocab_size),
                       "args": vars(run.args), "rng": rng}).encode()


def write_file(path, state):  # FSDP 3: bytes: run.json, or the export
    """Write atomically: a temp file in the same folder, fsync, then rename over the final name.
    Any failure is SaveFailed and leaves the previous file as it was."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(state)  # FSDP 3
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, never half
    except (OSError, RuntimeError) as err:  # disk full, no permission, a folder at `path`...
        needed = state_bytes(state)
        raise SaveFailed(f"cannot save {path}: {why_not_written(err, tmp, needed)}") from None
    finally:
        if os.path.exists(tmp):  # the write failed: drop the partial file
            os.remove(tmp)


def free_gathered_weights(model):  # FSDP 5: a forward alone leaves weights gathered
    """Reshard every FSDP module of the model: the weights a forward without a backward (evaluation,
    sampling) gathered are freed, and the parameters are this rank's shards again."""
    for module in [*model.modules(), *model.parts]:  # PP 5: the stages are roots, not children
        if isinstance(module, FSDPModule):
            module.reshard()


def write_export(run, weights, data):  # FSDP 8: rank 0's part of --export
    """Write the gathered weights to --export in the one-file format --sample reads, atomically."""
    path, step = run.args.export, run.args.max_steps
    # A one-process checkpoint's keys, so that --sample reads it; no fp16 here, so no scaler state.
    state = {"model": weights, "optimizer": {}, "scaler": {}, "step": step, "args": vars(run.args),
             "config": model_config(run.args, data.vocab_size), "itos": data.itos, "rng": []}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_file(path, buffer.getvalue())
    print(f"step {step}/{step} | exported {path}", flush=True)


def restore_rng(saved, device):  # FSDP 3: run.json keeps the states as lists of bytes
    """Set this process's RNG states (the CPU's, and its GPU's on a GPU) from run.json's lists."""
    torch.set_rng_state(torch.tensor(saved["cpu"], dtype=torch.uint8))
    if saved["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(torch.tensor(saved["cuda"], dtype=torch.uint8))


def rng_state(device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def first_reason(err, folder=None, state=None):  # FSDP 3
    """One line for a failed load, or save of `state` into `folder`; DCP's holds each rank's."""
    if isinstance(err, CheckpointException):
        err = next(iter(err.failures.values()))[0]
    if folder:
        return why_not_written(err, folder, state_bytes(state))
    return getattr(err, "strerror", None) or (str(err).strip().splitlines() or [repr(err)])[0]


def complete(step):  # FSDP 3: the one rule, for the finder and the reader alike
    """True if a step folder holds all a resume reads: DCP's .metadata and run.json."""
    return all(os.path.isfile(os.path.join(step, name)) for name in (".metadata", "run.json"))


def newest_complete_step(folder, is_main):  # FSDP 3
    """The newest complete step folder in `folder`, or None; the unfinished ones newer than it (a
    save cut short, or its partial folder) are named in one line and ignored."""
    steps = steps_in(folder)
    done = sorted((s for s in steps if complete(s) and not cut_short(s)), key=steps.get)
    unfinished = sorted((s for s in steps if s not in done and
                         (not done or steps[s] > steps[done[-1]])), key=steps.get)
    print0(is_main and unfinished, f"ignoring unfinished checkpoint steps: {', '.join(unfinished)}")
    return done[-1] if done else None


def steps_in(folder):  # FSDP 3
    """{path: step number} of this trainer's folders in `folder`: step-N, and partial-step-N of a
    save cut short. Other names (a user's copy, step-000005.keep) are not the trainer's to read
    or remove. Numbers compare as numbers: step 1,000,000 comes after step 999,999."""
    found = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        number = name.removeprefix("partial-").removeprefix("step-")
        if name in (f"step-{number}", f"partial-step-{number}") and number.isdecimal() \
                and number.isascii() and os.path.isdir(os.path.join(folder, name)):
            found[os.path.join(folder, name)] = int(number)
    return found


def cut_short(path):  # FSDP 3: a partial-step-N folder, whatever it holds
    return os.path.basename(os.path.normpath(path)).startswith("partial-")


def rename_step(partial, folder):  # FSDP 3: rank 0, once the step is complete
    """Give a complete step its final name; an older folder of that name (an earlier save of the
    same step, by a run that went back) is removed first, its .metadata before the rest."""
    remove_step(folder)
    os.replace(partial, folder)


def remove_step(folder):  # FSDP 3
    """Remove a step folder: first its .metadata, so that a removal cut short leaves a folder that
    no resume takes for complete, then the rest."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, ".metadata"))
    shutil.rmtree(folder, ignore_errors=True)


def drop_older_steps(folder, newest):  # FSDP 3
    """Remove every step in `folder` older than `newest`, and the partial folders of saves cut
    short. Only this run's steps are here: a run saves only into the folder whose step it
    resumed or one without steps. A step left behind costs only disk."""
    newest = int(os.path.basename(newest).removeprefix("step-"))
    for old, step in steps_in(folder).items():
        if step < newest or cut_short(old):
            remove_step(old)


def read_checkpoint(path):
    """The checkpoint dict, loaded to the CPU with weights_only=True; a problem is an InputError."""
    if not os.path.isfile(path):
        raise InputError(f"checkpoint not found: {path}")
    if not os.path.getsize(path):  # torch.load would say only "EOFError"
        raise InputError(f"cannot read checkpoint {path}: the file is empty")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not {"model", "config", "step"} <= state.keys():
            raise ValueError("not a checkpoint of this script (no model, config and step)")
        check_form(state)  # a state dict and a dict, as the lines below read them
    except Exception as err:  # truncated, not a torch file, not a checkpoint of ours: bad input
        reason = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
        raise InputError(f"cannot read checkpoint {path}: {reason}") from None
    if not all_finite(state["model"]):
        raise InputError(f"{path} holds weights that are not finite: use an earlier checkpoint")
    unknown = set(state["config"]) - {"vocab_size", "block_size", "n_layer", "n_head", "n_embd",
                                      "dropout"}
    if unknown:  # a model with parts that this script's GPT has not
        raise InputError(f"{path} holds a model with {', '.join(sorted(unknown))}, which this "
                         "script's GPT has not: sample it with the script that trained it")
    problem = config_problem(state["config"], state["model"], state.get("itos"))
    if problem:
        raise InputError(f"cannot read checkpoint {path}: {problem}")
    return state


def check_form(state):
    """Raise ValueError unless a checkpoint's model is a state dict of tensors and its config a
    dict."""
    weights = state["model"]
    if not isinstance(weights, dict) or not all(
            isinstance(name, str) and torch.is_tensor(t) for name, t in weights.items()):
        raise ValueError("its model is not a state dict of tensors")
    if not isinstance(state["config"], dict):
        raise ValueError(f"its config is a {type(state['config']).__name__}, not a dict")


def config_problem(config, weights, itos):
    """What in a checkpoint's config does not build a model its weights fit, or does not fit its
    vocabulary, in a few words, or None: --sample builds the model from the config alone."""
    sizes = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
    missing = [key for key in (*sizes, "dropout") if key not in config]
    if missing:
        return f"its config has no {', '.join(missing)}"
    wrong = [key for key in sizes if type(config[key]) is not int or config[key] < 1]
    if wrong:
        return f"its config's {wrong[0]} ({config[wrong[0]]!r}) is not a whole number above 0"
    if not isinstance(config["dropout"], (int, float)) or not 0 <= config["dropout"] < 1:
        return f"its config's dropout ({config['dropout']!r}) is not in [0, 1)"
    if config["n_embd"] % config["n_head"]:
        return f"its config's n_head {config['n_head']} does not divide n_embd {config['n_embd']}"
    problem = weights_problem(config, weights)  # first: the weights bound the vocabulary's size
    if not problem and not is_vocabulary(itos, config["vocab_size"]):
        problem = "its itos does not give a text for each token id below its vocab_size"
    return problem


def weights_problem(config, weights):
    """Which weight does not have the shape the config gives it, or is missing, or is not in the
    config's model, or None."""
    blocks = {key.split(".")[1] for key in weights if key.startswith("blocks.")}
    if len(blocks) != config["n_layer"]:  # checked first, so that no huge model is built
        return f"its weights hold {len(blocks)} blocks, its config's n_layer is {config['n_layer']}"
    with torch.device("meta"):  # the shapes alone: no memory, no initial values
        made = GPT(**config).state_dict()
    for key in sorted(made.keys() | weights.keys()):
        have, want = ["x".join(map(str, t.shape)) if t is not None else "none"
                      for t in (weights.get(key), made.get(key))]
        if have != want:
            return f"its weights do not fit its config: {key} is {have}, the config makes {want}"
    return None


def is_vocabulary(itos, vocab_size):
    """True if itos is None (the tokens are bytes), or gives a text for each token id below
    vocab_size, as a nanoGPT folder's meta.pkl does."""
    if itos is None:
        return True
    return isinstance(itos, dict) and set(itos) == set(range(vocab_size)) and all(
        isinstance(piece, str) for piece in itos.values())


def read_run_state(path, run, data):  # FSDP 3
    """A step folder's run.json, checked against this run's model; a problem is an InputError."""
    if os.path.isfile(path):  # FSDP 3: folders, not files
        raise InputError(f"{path} is one file, as train_ddp_minigpt.py saves; this trainer "
                         "resumes from a checkpoint folder of its own (--save DIR)")
    file = os.path.join(path, "run.json")
    if not complete(path) or cut_short(path):  # FSDP 3: the finder's rule
        raise InputError(f"no complete checkpoint at {path} (it needs .metadata and run.json, "
                         "under a step-N name: a partial-step-N folder is a save cut short)")
    try:
        with open(file, "rb") as f:  # FSDP 3
            state = json.load(f)
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read {file}: {type(err).__name__}: {err}") from None
    problem = run_state_problem(state)  # every key and type that resuming reads
    if problem:
        raise InputError(f"cannot resume from {file}: {problem}")
    if state["step"] > run.args.max_steps:  # its log would read "step 5/2"
        raise InputError(f"{path} is at step {state['step']}, past --max-steps "
                         f"{run.args.max_steps}")
    if state["config"] != model_config(run.args, data.vocab_size):
        raise InputError(f"{path} was trained with {state['config']}, this run builds "
                         f"{model_config(run.args, data.vocab_size)}")
    return state


def check_save_folder(run, path, state):  # FSDP 3
    """An InputError unless this run may write where it saves: a run resumed from a step of
    --save goes on only with the seed that saved it, and any other run wants a --save without
    complete steps. So no run continues, or deletes, a step another run wrote."""
    if run.args.benchmark:  # it writes nothing
        return
    save, seed = run.args.save, (state or {}).get("args", {}).get("seed")
    ours = bool(path and save and os.path.isdir(save)) and os.path.samefile(
        os.path.dirname(os.path.abspath(path)), save)  # "DIR/step-N/" and "step-N" alike
    if ours and seed != run.args.seed:  # --resume auto, or a step of --save by name
        raise InputError(f"{path} is another run's step (--seed {seed}, this run --seed "
                         f"{run.args.seed}): --save into another folder")
    newest = newest_complete_step(save, False) if save and os.path.isdir(save) else None
    if newest and not ours:
        raise InputError(f"--save {save} holds another run's steps ({newest}): go on with that "
                         "run by --resume auto, or --save into another folder")
    for flag, where in (("--save", save), ("--export", run.args.export)):
        if where:  # checked now, so that a run does not train for nothing
            writable(flag, where, folder=flag == "--save")


def writable(flag, path, folder):  # FSDP 3: --save a folder, --export a file
    """An InputError unless files can be written at `path`: a folder, or one file's place."""
    place = path if folder else os.path.dirname(path) or "."
    try:
        os.makedirs(place, exist_ok=True)
        if not folder and os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        with tempfile.TemporaryFile(dir=place):
            pass
    except OSError as err:
        raise InputError(f"{flag} {path} cannot be written: {err.strerror or err}") from None


def run_state_problem(state):  # FSDP 3: all that resumed_step and load_shards read of run.json
    """What is wrong with run.json's contents, in words, or None. It holds the step (an integer,
    0 or more), the config and args (objects), and rng: each rank's random states as restore_rng
    reads them, the CPU's bytes (as many as this torch's state has) and the GPU's bytes or null."""
    def byte_list(value, size=None):  # a list of integers from 0 to 255, `size` of them if given
        return isinstance(value, list) and (size is None or len(value) == size) and \
            all(type(b) is int and 0 <= b < 256 for b in value)

    keys = state.keys() if isinstance(state, dict) else ()
    missing = [key for key in ("step", "config", "args", "rng") if key not in keys]
    if missing:
        return f"it has no {', '.join(missing)}"
    if type(state["step"]) is not int or state["step"] < 0:
        return f"its step is {state['step']!r}, not an integer of 0 or more"
    if not isinstance(state["config"], dict) or not isinstance(state["args"], dict):
        return "its config or args is not an object"
    size = len(torch.get_rng_state())  # the bytes of this torch's CPU random state
    if not isinstance(state["rng"], list) or not all(
            isinstance(r, dict) and byte_list(r.get("cpu"), size) and "cuda" in r and
            (r["cuda"] is None or byte_list(r["cuda"])) for r in state["rng"]):
        return (f"its rng is not a list of each rank's random states, a cpu list of {size} "
                "bytes and a cuda list of bytes or null")
    return None


def as_whole_model(run, model, optim_state):
    """Rename this stage's optimizer state in place as one process names the whole model's (the tied
    matrix's under tok_emb.weight, as one process keeps it; param groups listing the whole model's
    parameters, so that every stage writes the same); return the stage's own lists of names."""
    if "head.weight" in optim_state["state"] and run.args.pp > 1:  # PP 6: the last stage's copy
        optim_state["state"]["tok_emb.weight"] = optim_state["state"].pop("head.weight")
    own_names = [group["params"] for group in optim_state["param_groups"]]
    for group, names in zip(optim_state["param_groups"], model.whole_groups):
        group["params"] = names
    return own_names


def as_stage(optim_state, own_names):
    """The optimizer state as_whole_model() renamed, as this stage's optimizer names it."""
    moments = optim_state["state"]
    if "head.weight" in own_names[0] and "tok_emb.weight" not in own_names[0]:  # PP 6: last stage
        moments["head.weight"] = moments.pop("tok_emb.weight")
    for group, names in zip(optim_state["param_groups"], own_names):
        group["params"] = names
    return optim_state


def stage_holding(run, model):
    """(whether this rank is its stage's first, its stage, the parts of the model it holds, the
    parameters of its shards, the bytes it holds inside a step on top of its shards)."""
    blocks = list(model.blocks)
    span = f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}"
    if len(model.parts) > 1:  # PP 5: interleaved stages hold blocks that are not neighbours
        span = "blocks " + ", ".join(blocks)
    parts = ["embeddings"] * (model.tok_emb is not None) + [span] \
        + ["final norm and head"] * (model.head is not None)
    mine = sum(p.to_local().numel() for p in model.parameters())
    # From the first micro-batch to the last the schedule keeps the stage's weights gathered (the
    # compute dtype) and its gradients whole (fp32, FSDP's reduce dtype, as they accumulate).
    gathered = sum(p.numel() // (run.args.tp if split_by_tp(p) else 1)  # 4D 5: TP's part
                   for p in model.parameters())
    # 4D 5: TP's vocabulary-split embedding gets its gradient back whole (Replicate, torch 2.14,
    # measured by the tests): every tp rank holds all its rows' gradient, not 1/tp of them.
    emb = model.tok_emb.weight.numel() if model.tok_emb is not None and run.args.tp > 1 else 0
    grads = 4 * (gathered + emb - emb // run.args.tp) * (run.args.pp > 1)  # 4D 1: 0 at --pp 1
    in_step = gathered * activation_dtype(run).itemsize + grads
    stages = ("stage " if len(model.parts) == 1 else "stages ") + ", ".join(  # PP 5: r, r + pp
        str(part.index) for part in model.parts)
    first = run.rank % (run.world_size // run.args.pp) == 0  # 4D 1: the stage's first rank
    return first, stages, ", ".join(parts), mine, in_step  # PP 5: for rank 0's memory line


def memory_line(model, held):
    """Bytes of weights + gradients + AdamW's two moments (fp32: 4 copies) held by the first rank
    of each stage, from every rank's stage_holding(), and the parts of the model it holds. "DDP"
    in the line is what a rank would hold with the whole model on every rank, for comparison.
    Inside a step a rank holds more: its stage's weights gathered and, under a schedule, its
    gradients whole until the last backward (stage_holding's last number)."""
    stages = [f"{stage} ({parts}) {16 * n / 2**20:.2f} MiB, {n:,} parameters"
              for first, stage, parts, n, _ in held if first]  # 4D 1
    inside = [f"{stage} {b / 2**20:.2f} MiB"
              for first, stage, _, _, b in held if first]  # 4D 1: each stage's first rank
    where, whole = next(model.parameters()).device.type, model.whole_params
    return (f"memory per rank ({where}): weights, gradients and AdamW state: {'; '.join(stages)} "
            f"(of {whole:,}; DDP: {16 * whole / 2**20:.2f} MiB); inside a step also the weights "
            f"gathered and the gradients whole: {', '.join(inside)}, activations aside"
            + " (at most: the interleaved schedule's order decides which stages overlap)"
            * (len(model.parts) > 1))


def traffic_line(run, vocab_size):  # what rank 0 sends in a step, group by group
    """The bytes rank 0 (stage 0) sends per optimizer step in each of its groups, without
    --grad-checkpointing. tp: per block and micro-batch, 4 collectives of the activations
    (B, T / cp, C), 1 more for the embedding (and the head at --pp 1), each sending (tp - 1) / tp
    of them twice (an all-reduce, or an all-gather and a reduce-scatter). cp: per block and
    micro-batch, K and V gathered twice (forward, and backward's recompute), their fp32 gradients
    reduce-scattered. pp: per micro-batch, the activations each of its V stages sends on, and
    the gradients each but stage 0 sends back; and the tied gradient's shard (fp32). At --tp 1
    there is no tp group, and the line counts no collectives."""
    args, K, tp, cp = run.args, run.args.grad_accum, run.args.tp, run.args.cp
    V = args.stages_per_rank  # PP 5: the stages a rank holds
    mine = range(0, args.pp * V, args.pp)  # PP 5: rank 0's stages, 0, pp, ...
    width = activation_dtype(run).itemsize
    blocks = sum(len(stage_blocks(args.n_layer, args.pp * V, stage)) for stage in mine)
    stream = args.batch_size * args.block_size // cp * args.n_embd * width
    tp_ops = (4 * blocks + 1 + (args.pp == 1)) * K
    kv = 2 * stream / tp  # K and V of this rank's heads and tokens
    hops = K * (2 * V - 1)  # PP 5: per micro-batch, V sends on and V - 1 gradients back
    sent = {"tp": 2 * tp_ops * stream * (tp - 1) / tp,  # 4D 6
            "cp": blocks * K * (cp - 1) * kv * (2 + 4 / width),
            "pp": (hops * math.prod(stream_shape(run, (args.batch_size, args.block_size // cp)))
                   * width + vocab_size * args.n_embd * 4 / (run.world_size // args.pp))
            * (args.pp > 1)}
    stages = "stage 0" if V == 1 else "stages " + ", ".join(map(str, mine))
    ops = f"tp: {tp_ops} collectives of {stream / 2**20:.3f} MiB; " * (tp > 1)  # none at tp 1
    return (f"traffic per step, rank 0 ({stages}, {blocks} blocks): " + " | ".join(
        f"{dim} {n / 2**20:.3f} MiB" for dim, n in sent.items()) + f" ({ops}FSDP's gathers aside)")


def split_by_tp(p):  # 4D 5: whether TP's plan split this parameter (FSDP aside)
    names = p.device_mesh.mesh_dim_names
    return "tp" in names and p.placements[names.index("tp")].is_shard()


def stage_shapes(run, part):
    """Meta tensors of a micro-batch's input to a stage (token ids on the first, activations
    after) and of its output (activations, logits on the last)."""
    size = (run.args.batch_size, run.args.block_size // run.args.cp)  # 4D 6: a cp rank's tokens
    ids = torch.empty(*size, dtype=torch.long, device="meta")  # the first stage's input
    stream = stream_shape(run, size)  # 4D 6: sequence parallel, split by tp too
    inputs, outputs = (torch.empty(*shape, dtype=activation_dtype(run), device="meta",
                                   requires_grad=True)  # floats: gradients come back
                       for shape in (stream, stream if part.head is None else  # 4D 6
                                     (*size, part.head.out_features)))
    return ids if part.tok_emb is not None else inputs, outputs  # PP 1: what it gets, and sends


def activation_dtype(run):
    """The dtype of the activations a stage sends: FSDP's compute dtype, or fp32."""
    return run.policy.param_dtype or torch.float32  # PP 7: what goes between stages


# --------------------------------------------------------------------------- logging and timing
def print0(is_main, message):
    """Print a log line if this process is the one that logs; flush, so it shows at once."""
    if is_main:
        print(message, flush=True)


def tokens_per_step(run):
    return run.args.batch_size * run.args.block_size * run.args.grad_accum * run.dp_size  # PP 3


def peak_tflops(gpu_name, amp):
    """The dense peak TFLOPS of a GPU in the table (datasheets, no sparsity; 16-bit with fp32
    accumulation) for the compute dtype ("off": fp32 without TF32), or None.
    Names match word by word: an "H100 NVL" is no H100 SXM, an "L40" no "L4", an "A10G" no "A10"."""
    words = gpu_name.replace("-", " ").split()
    table = {  # the words of a model's name: (16-bit tensor cores, fp32); variants first
        ("H100", "PCIe"): (756, 51), ("H100", "NVL"): (835, 60), ("H100",): (989, 67),
        ("H200", "NVL"): (835, 60), ("H200",): (989, 67), ("A100",): (312, 19.5),
        ("L40S",): (362, 91.6), ("L40",): (181, 90.5), ("L4",): (121, 30.3),
        ("A10",): (125, 31.2), ("V100",): (125, 15.7), ("T4",): (65, 8.1),
        ("RTX", "4090"): (165, 82.6), ("RTX", "3090"): (71, 35.6)}
    for model, (half, single) in table.items():
        if all(word in words for word in model):
            return single if amp == "off" else half
    return None


def flops_per_token(raw_model, args):
    """The model's FLOPs per token of training as nanoGPT counts them: 6 per parameter (forward
    and backward), position embeddings aside, plus attention's 12 x layers x width x context."""
    n = raw_model.whole_params - args.block_size * args.n_embd  # PP 5: the whole GPT
    return 6 * n + 12 * args.n_layer * args.n_embd * args.block_size


def gpu_peak_flops(run):
    """The peak FLOP/s of all the job's GPUs together and a line naming the peak used; (None,
    None) on a CPU, (None, a hint) for a GPU not in peak_tflops' table without --gpu-peak-tflops."""
    if run.device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(run.device)
    peak = run.args.gpu_peak_tflops or peak_tflops(name, run.amp)
    if peak is None:
        return None, f"MFU: {name} is not in the table; give --gpu-peak-tflops"
    precision = "fp32" if run.amp == "off" else run.amp
    note = f"MFU against {peak:g} TFLOPS per GPU ({name}, {precision})"
    return peak * 1e12 * run.world_size, note


class Meter:
    """The training clock and the log line; main() stops the clock for evaluation and saving."""

    def __init__(self, run, raw_model, start):
        self.args, self.tokens = run.args, tokens_per_step(run)
        peak, note = gpu_peak_flops(run)
        self.flops_over_peak = peak and self.tokens * flops_per_token(raw_model, run.args) / peak
        print0(run.is_main and note is not None, note)
        self.clock, self.last_step, self.intervals = Stopwatch(), start, []  # (steps, seconds)

    def stop_clock(self):
        self.clock.stop()

    def start_clock(self):
        self.clock.start()

    def log_line(self, step, loss, grad_norm):
        """step N/M | loss | lr | grad norm | ms/step | tok/s (and MFU), since the last log line."""
        self.intervals.append((step - self.last_step, self.clock.lap()))
        self.last_step = step
        step_s = self.intervals[-1][1] / self.intervals[-1][0]
        line = (f"step {step}/{self.args.max_steps} | loss {loss:.4f} | "
                f"lr {lr_at(step - 1, self.args):.2e} | grad norm {grad_norm:.3f} | "
                f"{1000 * step_s:.1f} ms/step | {self.tokens / step_s:,.0f} tok/s")
        if self.flops_over_peak:  # model FLOPs utilisation
            line += f" | MFU {100 * self.flops_over_peak / step_s:.1f}%"
        return line

    def summary(self):
        """Steps, seconds and tokens/s of training, and the median pace."""
        steps, train_s = sum(n for n, _ in self.intervals), sum(s for _, s in self.intervals)
        timed = self.intervals[1:] or self.intervals  # the first interval is the warm-up
        step_s = statistics.median([s / n for n, s in timed]) if timed else 0.0
        return {"steps": steps, "train_s": round(train_s, 3),
                "tokens_per_s": round(steps * self.tokens / train_s, 1) if train_s else 0.0,
                **pace_keys(step_s, self.tokens)}


def pace_keys(step_s, tokens_per_step):
    """The summary keys benchmark_scaling.py reads: median ms per step, all ranks' tokens/s."""
    return {"step_ms": round(1000 * step_s, 3), "per_step": tokens_per_step,
            "throughput_unit": "tokens/s",
            "throughput": round(tokens_per_step / step_s, 1) if step_s else 0.0}


class Stopwatch:
    """Training seconds between log lines; evaluation and checkpoints are left out (stop/start)."""

    def __init__(self):
        self.since, self.elapsed = time.perf_counter(), 0.0

    def stop(self):
        self.elapsed += time.perf_counter() - self.since

    def start(self):
        self.since = time.perf_counter()

    def lap(self):
        """Training seconds since the last lap (or the start), and start counting again."""
        self.stop()
        seconds, self.elapsed = self.elapsed, 0.0
        self.start()
        return seconds


def summary_line(summary):
    """`summary {...}` in strict JSON: a value that is not finite is written as null."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v
              for k, v in summary.items()}
    return "summary " + json.dumps(finite, allow_nan=False)


# --------------------------------------------------------------------------------------- sampling
def sample(args):
    """Inference: ONE plain process, no process group (generation has no gradients to average)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda, but no CUDA device is visible (try --device cpu)")
    cuda = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    state = read_checkpoint(args.ckpt)  # its config builds a model its weights fit
    itos = state.get("itos")
    if state["config"]["vocab_size"] != 256 and itos is None:
        raise InputError(f"{args.ckpt} was trained on token ids (vocab "
                         f"{state['config']['vocab_size']}) without a meta.pkl: --prompt text "
                         "needs a byte-level checkpoint or a nanoGPT folder's vocabulary")
    model = GPT(**state["config"]).to(device)
    model.load_state_dict(state["model"])
    model.eval()
    torch.manual_seed(args.seed)
    prompt = torch.tensor([encode(args.prompt, itos)], device=device)
    out = model.generate(prompt, args.max_new_tokens, args.temperature, args.top_k)
    print(decode(out[0].tolist(), itos), flush=True)


def encode(text, itos):
    """Token ids of text: its UTF-8 bytes, or through a nanoGPT vocabulary (itos: id -> text)."""
    if itos is None:
        return list(text.encode("utf-8"))
    stoi = {piece: i for i, piece in itos.items()}
    unknown = sorted({c for c in text if c not in stoi})
    if unknown:
        raise InputError(f"--prompt has characters the vocabulary lacks: {unknown}")
    return [stoi[c] for c in text]


def next_token(logits, temperature, top_k):
    """A token id (1, 1) drawn from the logits (1, vocab) of the last position, as GPT.generate
    draws it."""
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1)  # PP 7: on the last stage


def decode(ids, itos):
    """Text of token ids: UTF-8 bytes (a broken character shows as U+FFFD), or through itos."""
    if itos is None:
        return bytes(ids).decode("utf-8", errors="replace")
    return "".join(itos[i] for i in ids)


# ----------------------------------------------------------------------------------------- errors
class Stop(Exception):
    """A run that cannot go on: one line on stderr and exit code `code`, never a traceback."""
    code = 1


class InputError(Stop):
    """Bad input from the user: a flag, a file, a checkpoint."""
    code = 2


class Diverged(Stop):
    """A step whose loss or gradient norm is not finite: not applied, the run stops."""
    code = 4


class SaveFailed(Stop):
    """A checkpoint that could not be written; the previous one is left as it was."""
    code = 5


if __name__ == "__main__":
    code = 0
    try:
        main()
    except Stop as err:  # handled here, so the traceback (and the model it holds) is freed at once
        sys.stderr.write(f"error: {err}\n")  # one write: lines from several ranks never splice
        code = err.code
    finally:
        # A rank that fails mid-step leaves the group here and exits with a non-zero code. torchrun
        # then stops the other ranks, which wait in their next collective until it does.
        leave_distributed()  # DDP 13
    sys.exit(code)
