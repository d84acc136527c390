"""Chapter 11: every parallelism in one run. Chapter 9's pipeline stages, whose blocks gain chapter
8's tensor parallelism (TP, with sequence parallelism and loss parallel) and chapter 10's context
parallelism (CP), FSDP over the data-parallel and context ranks of each stage: one 4-D mesh of
(pp, dp, cp, tp) ranks. The same math as one process.

    torchrun --standalone --nproc_per_node=8 train_4d_minigpt.py          # 2 pp x 2 cp x 2 tp: CPU
    torchrun --standalone --nproc_per_node=4 train_4d_minigpt.py --pp 1   # 2 cp x 2 tp: CPU or GPUs
    torchrun --standalone --nproc_per_node=gpu train_4d_minigpt.py --pp 1 --cp 2 --tp 4  # 8 GPUs
    ./launch_multinode_ddp.sh --nnodes 2 --nproc-per-node 8 --master-addr N0 \
        train_4d_minigpt.py --pp 2 --cp 2 --tp 4 --block-size 1024 --grad-accum 8
    python train_ddp_minigpt.py --sample --ckpt checkpoints/minigpt_4d.pt --prompt "def main("

The multi-node line prints the torchrun command to run on each node (chapter 4): with --pp 2 on 2
nodes of 8, each node is one stage, its 8 GPUs 2 cp x 4 tp; dp is what the world size leaves (here
1). Sampling runs in one plain process. Default data: the first 2,000,000 bytes of this Python's
own standard library, one token per byte (vocab 256), so nothing is downloaded; `--data` also takes
a text file, a .bin of uint16 token ids, or a nanoGPT folder.

Read it top-down: main(), then its core steps in the order it calls them, the model, and what goes
beyond the core (debugging, the benchmark, the report). All that talks to other processes is above
the line that ends `the plumbing`; below it, guards, flags, data, files, logging, sampling, errors.

Tags: `# 4D k` marks each line this chapter changes in chapter 9's trainer, in reading order:
  4D 1  --pp, --cp, --tp: one (pp, dp, cp, tp) mesh, tp innermost, dp the rest; its layout printed
  4D 2  data and global batch by dp: a replica's cp x tp ranks read the same sequences
  4D 3  Context: cp rank i holds chunks i and 2 cp - 1 - i of each sequence; global positions
  4D 4  attention over the cp group's keys and values, all-gathered (backward: reduce-scatter)
  4D 5  TP's plan in each block and at the stage's ends, then FSDP over dp x cp; dropout streams
  4D 6  what a stage sends: a cp share, split by tp under sequence parallelism; bytes per group
  4D 7  checkpoints: random streams restored only at the layout that saved them
  4D 8  loss parallel around the schedule and evaluation: the logits stay split by vocabulary
  4D 9  the gradient norm per mesh (dp x cp, and dp x cp x tp), summed over the stages
  4D 10 sampling: every rank the whole context, padded; a replica's ranks draw alike
How the splits nest: CP gives each rank T / cp tokens of every sequence; sequence parallelism
splits those again by tp (T / (cp x tp): the norms, dropout and what goes between stages); TP's
all-gather makes them T / cp again before attention and the MLP, whose heads and hidden units it
splits by tp; CP's all-gather then brings the whole sequence's keys and values of this rank's heads.
Kept from the pipeline trainer (chapter 9), where they mark the same lines:
  PP 1  a PipelineStage in a schedule                PP 2  --pp N: a stage is consecutive ranks
  PP 3  data by the dp index                         PP 4  the tied embedding and head: 2 copies
  PP 5  Stage: a run of blocks, their own names      PP 6  checkpoints name no stage
  PP 7  forward-only pipelines: eval, sampling       PP 8  the gradient norm over every stage
Kept from the DDP trainer (chapter 3), where they mark the same lines:
  DDP 1  join the group torchrun started             DDP 9   SUM over ranks, then divide
  DDP 2  one GPU per process, by LOCAL_RANK          DDP 11  every rank's RNG state, saved
  DDP 3  is_main: rank 0 alone logs and saves        DDP 12  rank 0 writes, every rank waits
  DDP 4  each rank its own windows of an epoch       DDP 13  leave the group on every path
  DDP 5  one shuffled order, the same on all ranks   DDP 14  --debug: each rank's windows
  DDP 7  resume: rank 0 looks, every rank agrees     DDP 16  every rank's peak GPU memory
Kept from the FSDP trainer (chapter 7), where they mark the same lines:
  FSDP 1  bf16 by FSDP's MixedPrecisionPolicy        FSDP 4  no wrapper: fully_shard hooks the model
  FSDP 2  built on the meta device, then sharded     FSDP 5  every rank runs every forward
  FSDP 3  DCP checkpoints: every rank its shards     FSDP 8  --export: one plain file
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
import logging  # 4D 5
import math
import os
import pickle
import shutil
import statistics
import sys
import sysconfig
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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # PP 1
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
    if args.sample:  # inference: one plain process, no process group
        return sample(args)
    avoid_known_failures(args)  # guard: refuses a bad launch, avoids known failures
    # setup: one process per device, joined in one group; rank 0 logs and saves. A step that
    # "talks" waits for the others: every rank calls it, in the same order
    device, rank, world_size = init_distributed(args.device, args.dist_timeout)  # talks
    run = make_run(args, device, rank, world_size)
    # data: each data-parallel replica reads its own windows of the training tokens
    data = build_data(run)  # talks with --debug: rank 0 prints each rank's windows
    # model: one process's initial weights, whole or sharded, resumed if asked, then wrapped
    raw_model, optimizer = build_model(run, data.vocab_size)  # talks where the model is sharded
    start = resumed_step(run, raw_model, optimizer, data)  # talks: rank 0 finds it, all agree
    model = wrap_model(run, raw_model)  # talks under DDP (rank 0's weights to all); FSDP: silent
    schedule = pipeline_schedule(run, model)  # PP 1: this rank's stage in a pipeline schedule
    if args.benchmark:
        return benchmark(run, schedule, model, optimizer, data.windows)  # PP 1; talks
    # train: log, evaluate and save on schedule
    val_loss = evaluate(run, model, data.val)  # talks: the loss sums of every rank add up
    print0(run.is_main, f"step {start}/{args.max_steps} | val loss {val_loss:.4f}")
    meter = Meter(run, raw_model, start)  # the training clock starts now
    for step in range(start, args.max_steps):  # every step talks
        loss, grad_norm = train_step(run, schedule, model, optimizer, data.windows, step)  # PP 1
        done = step + 1
        if done % args.log_every == 0 or done == args.max_steps:
            print0(run.is_main, meter.log_line(done, loss.item(), grad_norm.item()))
        meter.stop_clock()  # evaluation and checkpoints are not training time
        if done % args.eval_every == 0 or done == args.max_steps:
            val_loss = evaluate(run, model, data.val)  # talks
            print0(run.is_main, f"step {done}/{args.max_steps} | val loss {val_loss:.4f} | "
                                f"baseline {data.baseline:.4f}")
        # save: rank 0 writes, every rank waits for it
        due = done == args.max_steps or (args.save_every and done % args.save_every == 0)
        if args.save and due:
            save_checkpoint(run, raw_model, optimizer, data, done)  # talks
        meter.start_clock()
    # cleanup: the summary and a sample; the group is left by __main__'s `finally`
    report(run, raw_model, data, val_loss, meter)  # talks: GPU peaks; a sharded model's export


def init_distributed(device_name, timeout_s):  # DDP 1: join the group torchrun describes
    """A collective: join the group torchrun started; returns (device, rank, world size)."""
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cpu")
    if device_name == "cuda":  # DDP 2: one GPU per process, picked by LOCAL_RANK, before CUDA work
        # LOCAL_RANK numbers the processes of this node (its GPUs: 0, 1...); RANK, of all nodes
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # no address given: it reads torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if backend == "nccl" else None)  # NCCL: bind it
    return device, dist.get_rank(), dist.get_world_size()


@dataclasses.dataclass
class Run:
    """What every step of one process's run shares, set once at the start."""
    args: argparse.Namespace  # the flags
    device: torch.device
    rank: int
    world_size: int
    is_main: bool  # rank 0: the one process that logs and writes files
    amp: str  # FSDP 1: the compute dtype's name ("bfloat16"), or "off"
    policy: MixedPrecisionPolicy  # FSDP 1: casts the gathered weights; no autocast, no scaler
    mesh: object  # 4D 1: the (pp, dp, cp, tp) grid of ranks, a DeviceMesh
    stage: int  # PP 2: this rank's stage, 0 to pp - 1: the blocks it holds
    dp_rank: int  # PP 3: this rank's column: the data it reads
    dp_size: int  # 4D 2: the replicas: world size / (pp x cp x tp)
    tied: object  # PP 4: this column's first and last stage, a process group; None elsewhere
    context: "Context"  # 4D 3: this rank's share of every sequence, and its attention


def make_run(args, device, rank, world_size):
    """This process's Run; logs the run's shape (world size, device, precision, batch)."""
    is_main = rank == 0  # DDP 3: rank 0 alone logs and saves
    amp, policy = mixed_precision(args.amp, device)  # FSDP 1
    mesh = grid(args, device, world_size)  # 4D 1: pp x dp x cp x tp ranks, tp innermost
    stage, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    context = Context(mesh["cp"].get_group(), mesh.get_local_rank("cp"),  # 4D 3: chapter 10's
                      args.cp, args.block_size, device)  # split of each sequence
    run = Run(args, device, rank, world_size, is_main, amp, policy, mesh, stage, dp_rank,
              mesh.size(1), ends_group(mesh, stage, rank),  # 4D 1; talks: every rank, all groups
              context)  # 4D 3
    print0(is_main, f"world size {world_size} ({args.pp} pp x {run.dp_size} dp x {args.cp} cp x "
                    f"{args.tp} tp) | device {device} | amp {amp} | {tokens_per_step(run):,} "
                    f"tokens per step ({args.batch_size} x {args.block_size} x {args.grad_accum} "
                    f"micro-batches x {run.dp_size} replicas) | schedule {args.schedule}")  # 4D 2
    print0(is_main, layout_line(mesh, world_size - 1))  # 4D 1: one rank's place and groups
    return run


def grid(args, device, world_size):  # 4D 1: one 4-D mesh, from the slowest links out
    """The ranks as a pp x dp x cp x tp DeviceMesh, dp what the world size leaves. Innermost, the
    most traffic on the fastest links: a tp group is consecutive ranks (one node's GPUs), for TP's
    collectives of every block and micro-batch; then cp (a gather of keys per block), dp (FSDP's
    gathers, a reduce-scatter per step); pp outermost, a stage per node or group of nodes: one send
    of activations per micro-batch between stages, the least of all, crosses the network."""
    inner = args.pp * args.cp * args.tp
    if world_size % inner:
        raise InputError(f"--pp {args.pp} x --cp {args.cp} x --tp {args.tp} = {inner} does not "
                         f"divide the world size {world_size}: start a multiple of {inner} "
                         "processes, or give smaller sizes")
    shape, names = (args.pp, world_size // inner, args.cp, args.tp), ("pp", "dp", "cp", "tp")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)  # a group per line of each
    # all but pp as one dim, for DTensor: the norm's sum over them in one collective, not one per
    # dim (torch warns of that); _flatten is private in torch 2.14, as torchtitan uses it
    mesh["dp", "cp", "tp"]._flatten("dp_cp_tp")  # 4D 1
    return mesh


def ends_group(mesh, stage, rank):  # 4D 1: PP 4's two copies, per (dp, cp, tp) place
    """A collective: a process group of each column's first and last stage (every rank makes every
    group). Returns this rank's; None on a middle stage, and at --pp 1 (one matrix, no copies)."""
    pp = mesh.size(0)
    ends = mesh.mesh[[0, -1]].flatten(1).T.tolist() if pp > 1 else []  # 4D 1: per (dp, cp, tp)
    groups = [dist.new_group(ranks) for ranks in ends]  # every rank joins the making of each
    return groups[rank % len(groups)] if pp > 1 and stage in (0, pp - 1) else None  # 4D 1


class Context:  # 4D 3: this rank's share of every sequence, and how its queries see the rest
    """Chapter 10's split: rank i of a cp group holds chunks i and 2 cp - 1 - i of 2 cp, one early,
    one late, equal work; its attention all-gathers the group's keys and values (backward keeps
    none: it gathers again). Sequence parallelism then splits a rank's share by tp (inside TP)."""

    def __init__(self, group, cp_rank, cp, block_size, device):
        # cp 2, 16 tokens, 4 chunks of 4: rank 0 holds positions 0-3 and 12-15, rank 1 4-7, 8-11.
        # Gathered in rank order the keys stand as 0-3, 12-15, 4-7, 8-11; order [0-3, 8-15, 4-7]
        # (indices into the gathered keys) sorts them to 0-15. ends: rank 0 [4, 16], rank 1 [8, 12]
        every = [chunk_positions(r, cp, block_size) for r in range(cp)]
        self.group, self.cp, self.positions = group, cp, every[cp_rank].to(device)
        self.order = torch.cat(every).argsort().to(device)  # gathered -> sequence order
        self.ends = [int(chunk[-1]) + 1 for chunk in self.positions.chunk(2)]
        self.masks = [causal_lower_right(len(self.positions) // 2, end) for end in self.ends]

    def share(self, x, y):  # this rank's tokens of each sequence, and their targets
        return x[:, self.positions], y[:, self.positions]

    def attention(self, q, k, v):  # 4D 4: each chunk's queries over every key up to its end
        if self.cp == 1:  # the whole sequence is here: plain causal attention
            return causal_attention(q, k, v)
        return checkpoint(self.gathered_attention, q, k, v, use_reentrant=False)  # recomputed

    def gathered_attention(self, q, k, v):  # 4D 4: talks: the cp group's keys and values
        kv = GatherContext.apply(torch.stack([k, v]), self.group)  # (2, B, heads, T, head size)
        k, v = kv.index_select(-2, self.order)  # the whole sequence, in order of position
        chunks = q.chunk(2, dim=-2)  # an early chunk's queries and a late one's
        return torch.cat([causal_attention(part, k[..., :end, :], v[..., :end, :], mask)
                          for part, end, mask in zip(chunks, self.ends, self.masks)], dim=-2)


def chunk_positions(cp_rank, cp, block_size):  # 4D 3: an early chunk and a late one
    """The positions context rank cp_rank holds in a sequence of block_size tokens: chunks cp_rank
    and 2 cp - 1 - cp_rank of 2 cp equal chunks."""
    size = block_size // (2 * cp)
    chunks = (cp_rank, 2 * cp - 1 - cp_rank)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])


class GatherContext(torch.autograd.Function):  # 4D 4: an all-gather that carries gradients
    """All-gather over the context ranks along the sequence (dim -2), in rank order. Backward: a
    reduce-scatter, as every rank's queries read each rank's keys: their gradients add up."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, n = group, dist.get_world_size(group)
        parts = x.new_empty((n * x.shape[0], *x.shape[1:]))  # rank r's x at [r * len(x):]
        dist.all_gather_single(parts, x.contiguous(), group=group)  # talks: every rank's share
        return torch.cat(parts.chunk(n), dim=-2)

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        parts = torch.cat(grad.chunk(n, dim=-2)).float()  # rank r's at [r * len(mine):]; fp32 sums:
        mine = parts.new_empty((parts.shape[0] // n, *parts.shape[1:]))  # bf16 would round each
        dist.reduce_scatter_single(mine, parts, group=ctx.group)  # talks: sums, each rank its own
        return mine.to(grad.dtype), None


@dataclasses.dataclass
class Data:
    windows: "Windows"  # this rank's training batches
    val: np.ndarray  # held out: the last --val-fraction of the tokens, or a folder's val.bin
    vocab_size: int
    itos: dict  # id -> text, from a nanoGPT folder's meta.pkl; None for bytes or plain ids
    baseline: float  # the loss of predicting each token by its frequency: the loss to beat


def build_data(run):
    """This rank's training windows and the validation tokens (--debug: a collective)."""
    args = run.args
    train, val, vocab_size, itos = load_data(args, run.dp_size)  # PP 3: a batch per column
    windows = Windows(train, args.block_size, args.batch_size, run.dp_rank, run.dp_size,
                      args.seed)  # PP 3: each column its own windows, the same on every stage
    baseline = unigram_loss(train, val, vocab_size)
    unit = "byte" if vocab_size == 256 else "token"
    print0(run.is_main, f"data {args.data or 'Python standard library'} | {len(train):,} train "
                        f"/ {len(val):,} val tokens | vocab {vocab_size} | "
                        f"{unit}-frequency baseline loss {baseline:.4f}")
    if args.debug:
        log_windows(run, windows)  # talks: rank 0 prints every rank's
    return Data(windows, val, vocab_size, itos, baseline)


class Windows:
    """This rank's training batches. An epoch cuts the token stream into non-overlapping windows of
    block_size + 1 tokens from a random offset, shuffles them (seed + epoch) and deals them to the
    ranks round-robin: each token at most once an epoch, on one rank (a DataLoader's equivalent:
    DistributedSampler(drop_last=True) and set_epoch(epoch)). Micro-batch k depends on k and the
    ranks alone, so a run resumed with as many ranks reads what the uninterrupted one would have."""

    def __init__(self, tokens, block_size, batch_size, rank, world_size, seed):
        self.tokens, self.block, self.batch = tokens, block_size, batch_size
        self.rank, self.world, self.seed = rank, world_size, seed
        per_rank = (len(tokens) - block_size) // (block_size + 1) // world_size  # at any offset
        # as many micro-batches on every rank: a rank with one more would wait in its collectives
        self.per_epoch = per_rank // batch_size  # micro-batches per rank per epoch
        self.span = np.arange(block_size + 1)
        self.epoch, self.starts = None, None

    def starts_of_epoch(self, epoch):  # DDP 4: every rank its own share of the windows
        """The first token of every window this rank reads in `epoch`, in order."""
        # seeded by epoch, not by rank: every rank draws the same order, then keeps its own slice
        g = torch.Generator().manual_seed(self.seed + epoch)  # DDP 5: a new order each epoch
        offset = int(torch.randint(0, self.block + 1, (1,), generator=g))
        count = self.per_epoch * self.batch * self.world
        order = torch.randperm((len(self.tokens) - offset) // (self.block + 1), generator=g)[:count]
        return (offset + order * (self.block + 1))[self.rank::self.world].numpy()

    def rows(self, k):
        """Micro-batch k of this rank: (B, block_size + 1) token ids, inputs and the next token."""
        epoch, i = divmod(k, self.per_epoch)
        if epoch != self.epoch:
            self.epoch, self.starts = epoch, self.starts_of_epoch(epoch)
        rows = self.tokens[self.starts[i * self.batch:(i + 1) * self.batch, None] + self.span]
        return torch.from_numpy(rows.astype(np.int64))


def build_model(run, vocab_size):  # FSDP 2: built on the meta device, sharded, then filled
    """The sharded model (1/N of every parameter here; no rank ever holds it whole), and AdamW."""
    args = run.args
    with torch.device("meta"):  # FSDP 2: shapes and dtypes, no memory
        raw_model = Stage(GPT(**model_config(args, vocab_size)), run.stage, args.pp,  # 4D 3
                          run.context)  # PP 5; the split the schedule's forwards see
    shard(run, raw_model)  # FSDP 2: before the optimizer, which must see the shards
    raw_model.to_empty(device=run.device)  # FSDP 2: this rank's shards, not yet filled
    init_shards(raw_model, args.seed, args.n_layer)  # PP 5: one process's weights, the GPT's depth
    raw_model.grad_checkpointing = args.grad_checkpointing
    optimizer = make_optimizer(raw_model, args, run.device)
    torch.manual_seed(args.seed + dropout_stream(run))  # 4D 5: by rank, or by tp group
    print0(run.is_main, f"model {raw_model.whole_params:,} parameters | "  # PP 5: the GPT's
                        f"{args.n_layer} layers, {args.n_head} heads, {args.n_embd} wide, "
                        f"context {args.block_size}")
    held = [None] * run.world_size  # PP 5: what every rank holds, gathered for rank 0's line
    dist.all_gather_object(held, stage_holding(run, raw_model))  # rank 0 prints every stage's
    print0(run.is_main, memory_line(raw_model, held))  # PP 5: what each stage holds
    print0(run.is_main, traffic_line(run, vocab_size))  # 4D 6: and what each group sends
    return raw_model, optimizer


def shard(run, model):  # 4D 5: each block split by TP in its tp group, then FSDP over dp x cp
    """parallelize_module splits each block's four matrices, and the tied embedding and head by
    vocabulary, across the tp ranks (DTensors on the tp mesh; chapter 8); then fully_shard shards
    every parameter of the stage over its dp x cp ranks (FSDP: a block's weights gathered before
    its forward, its gradients reduce-scattered after its backward), a block at a time."""
    sp = run.args.sequence_parallel == "on"
    # 4D 5: FSDP over dp and cp as one dim (chapter 10: the cp ranks of a replica hold the same
    # weights, and their gradients add up), not over dp alone
    mesh = run.mesh["dp", "cp"]._flatten("dp_cp")  # 4D 5
    reshard = run.args.reshard_after_forward == "yes"
    for i, block in enumerate(model.blocks.values()):  # PP 5: the stage's blocks
        last = i == len(model.blocks) - 1  # its backward comes first: no gather in between
        if run.args.tp > 1:  # 4D 5: --tp 1 is chapter 9's stages alone
            parallelize_module(block, run.mesh["tp"], block_plan(sp))  # collectives in forward
        fully_shard(block, mesh=mesh, mp_policy=run.policy,
                    reshard_after_forward=reshard and not last)  # hooks
    plan = ends_plan(model, sp)  # 4D 5: the ends this stage holds, split by vocabulary
    if run.args.tp > 1 and plan:
        parallelize_module(model, run.mesh["tp"], plan)  # collectives in forward
        if model.tok_emb is not None and model.head is not None:  # --pp 1: one matrix again
            model.head.weight = model.tok_emb.weight  # each split it by rows alike
    fully_shard(model, mesh=mesh, mp_policy=run.policy)  # the root: whole from forward to backward


def block_plan(sp):  # 4D 5: chapter 8's split of a block, then its sequence parallelism
    """Column-wise: q, k, v (whole heads: GPT.qkv orders its outputs head by head) and the MLP's
    first matrix, each rank its share of the outputs from the whole input. Row-wise: attn.proj and
    the MLP's second matrix give partial sums, which one all-reduce adds up. sp: a reduce-scatter
    instead, each rank the sum for its part of this cp rank's tokens, which the norms and dropout
    work on alone; an all-gather makes them whole for the next split (the context rides along)."""
    if not sp:
        return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    whole = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    with_context = PrepareModuleInput(input_layouts=(Shard(1), None),  # attn(x, context)
                                      desired_input_layouts=(Replicate(), None))
    return {"ln1": SequenceParallel(), "attn": with_context, "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),  # each rank its tokens' sum
            "ln2": SequenceParallel(), "mlp": whole, "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(output_layouts=Shard(1))}


def ends_plan(model, sp):  # 4D 5: the ends of the model this stage holds, split by vocabulary
    """The tied embedding and head, each rank a share of the vocabulary's rows (chapter 8), for
    what this stage holds: the embeddings on the first, the final norm and head on the last. sp:
    the embedding's sum goes straight to each rank's part of the tokens, the positions sliced
    alike; the head's logits stay split (a DTensor) for loss parallel."""
    stream = Shard(1) if sp else Replicate()  # (B, T, C): by sequence, or whole on every rank
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
            "head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1),
                                    use_local_output=False)}  # the logits: split by vocabulary
    if sp:
        plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(),
                                              desired_output_layouts=Shard(0))  # (T, C): my part
        plan["ln_f"] = SequenceParallel()
    return {name: style for name, style in plan.items() if getattr(model, name) is not None}


@torch.no_grad()
def init_shards(model, seed, n_layer):  # PP 5: n_layer, the GPT's: a stage holds fewer blocks
    """Fill this rank's shards with one process's initial weights: each parameter whole from the
    seed, one at a time; each rank keeps its slice, sending nothing (src_data_rank=None)."""
    for name, p in model.named_parameters():
        name = "tok_emb.weight" if name == "head.weight" else name  # PP 4: both copies alike
        full = initial_value(name, p.shape, seed, n_layer).to(p.device)
        p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None))  # mine


def dropout_stream(run):  # 4D 5: which ranks draw the same dropout masks
    """This rank's offset to the dropout seed. Where the activations dropout acts on are whole on
    every rank of a tp group (--sequence-parallel off), the group draws alike, or its copies drift
    apart; sequence parallel, each rank drops out its own part of the sequence: by rank."""
    return run.rank if run.args.sequence_parallel == "on" else run.rank // run.args.tp


def resumed_step(run, raw_model, optimizer, data):
    """A collective: the step to go on from, 0 or --resume's after loading it. Rank 0 decides
    whether `--resume auto` finds a checkpoint; all ranks load it, or all stop with one line."""
    path, state, problem = resume_path(run), None, None  # FSDP 3: read the small file, agree,
    try:  # and only then load the shards, a collective
        state = read_run_state(path, run, data) if path else None
    except InputError as err:  # told to every rank below, so that none waits for this one
        problem = str(err)
    step = agree_on_start(state["step"] if state else 0, problem, path)  # FSDP 3; talks
    if path:
        load_shards(path, state, run, raw_model, optimizer)  # FSDP 3: every rank, at once
        print0(run.is_main, f"resumed from {path} at step {step}")
    return step


def resume_path(run):
    """A collective: the checkpoint to resume from, or None. --resume auto: the --save checkpoint
    if it exists (so that a restart after a crash runs the same command and goes on from the last
    checkpoint). Rank 0 looks and tells the rest: ranks that looked on their own could disagree."""
    resume, save = run.args.resume, run.args.save
    if resume != "auto":
        return resume and newest_complete_step(resume, run.is_main) or resume  # FSDP 3: a step
    if not save:
        raise InputError("--resume auto needs a --save path to look for")
    found = [newest_complete_step(save, run.is_main) if run.is_main else None]  # FSDP 3
    dist.broadcast_object_list(found, src=0)  # DDP 7: rank 0 decides for every rank
    return found[0]  # FSDP 3


def agree_on_start(start, error, path):
    """Every rank resumed from the same step, or all stop with the same line (a rank on a node that
    cannot see the checkpoint, or sees another file: checkpoints need a shared filesystem)."""
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (start, error))  # DDP 7: a collective, so no rank hangs
    failed = [(rank, problem) for rank, (_, problem) in enumerate(outcomes) if problem]
    if failed and len(failed) == len(outcomes) and len({p for _, p in failed}) == 1:
        raise InputError(failed[0][1])  # the same problem everywhere: the checkpoint itself
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
    (DCP knows which slice each file holds); then its RNG, at the world size that saved."""
    model_state, optim_state = get_state_dict(raw_model, optimizer)  # my shards' state
    own_names = as_whole_model(run, raw_model, optim_state)  # PP 6: the whole model's names
    try:
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)  # every rank
    except (Exception, CheckpointException) as err:  # raised on every rank: DCP gathers them
        raise InputError(f"cannot load the shards of {path}: {first_reason(err)}") from None
    optim_state = as_stage(optim_state, own_names)  # PP 6: back to this stage's names
    set_state_dict(raw_model, optimizer, model_state_dict=model_state,  # into my shards
                   optim_state_dict=optim_state)
    if not shards_finite(raw_model):  # talks: every rank gets the same answer
        raise InputError(f"{path} holds weights that are not finite: use an earlier checkpoint")
    saved, args = state["args"], run.args  # 4D 7: streams only at the layout that saved them
    if [saved.get(k) for k in ("pp", "cp", "tp", "sequence_parallel")] + [len(state["rng"])] == [
            args.pp, args.cp, args.tp, args.sequence_parallel, run.world_size]:
        restore_rng(state["rng"][run.rank], run.device)  # FSDP 3: this rank's streams


def shards_finite(model):  # FSDP 3
    """A collective: True on every rank if every rank's shards are free of NaN and infinity."""
    mine = all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())
    flag = torch.tensor([float(mine)], device=next(model.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # 0 if any rank's shards are not finite
    return bool(flag.item())


def wrap_model(run, raw_model):  # FSDP 4: no wrapper: the sharded model trains itself
    """The model that trains: the sharded raw_model, compiled with --compile. Two handles to one
    set of shards: `raw_model` (saved, exported) and `model`, the same or its compiled form."""
    for block in raw_model.blocks.values() if run.args.compile else []:  # PP 1: in place, so the
        block.compile(backend=run.args.compile_backend)  # schedule still sees an FSDP module
    return raw_model


def pipeline_schedule(run, model):  # PP 1: the stage, in a schedule of the step's micro-batches
    """This rank's stage in a schedule of --grad-accum micro-batches, which sends each one's
    activations to the next stage and their gradients back; FSDP reduce-scatters once, after the
    last backward. The schedule divides the gradients by K: one process's mean of micro-batches."""
    inputs, outputs = stage_shapes(run, model)  # given, so no forward is run to infer them
    stage = PipelineStage(model, run.stage, run.args.pp, run.device, inputs, outputs,
                          group=run.mesh.get_group("pp"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[run.args.schedule]
    return kind(stage, run.args.grad_accum, loss_fn=mean_token_loss)


def evaluate(run, model, val):  # FSDP 5: every rank runs as many forwards
    """The mean validation loss per token, exact at any world size; a collective. Each forward
    all-gathers with every rank, so fewer batches are padded with targets of -100: counted 0."""
    batches = list(validation_batches(run, val))  # DDP 4: disjoint slices
    most = torch.tensor(len(batches), device=run.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the most batches any rank holds
    x = torch.zeros(1, run.args.block_size, dtype=torch.long, device=run.device)
    batches += [(x, torch.full_like(x, -100))] * (int(most) - len(batches))
    batches = [run.context.share(x, y) for x, y in batches]  # 4D 3: this rank's tokens
    return mean_loss_over_ranks(run, model, batches)  # PP 7


def validation_batches(run, val):
    """This rank's validation batches, (inputs, targets) on its device: the first --eval-windows
    non-overlapping windows of the validation tokens, dealt to the ranks round-robin: disjoint
    slices, never padded with repeats as a DistributedSampler pads them, so each counts once."""
    args = run.args
    starts = np.arange(0, len(val) - args.block_size, args.block_size + 1)[:args.eval_windows]
    mine = starts[run.dp_rank::run.dp_size]  # PP 3: by column
    for i in range(0, len(mine), args.batch_size):
        rows = val[mine[i:i + args.batch_size, None] + np.arange(args.block_size + 1)]
        yield on_device(torch.from_numpy(rows.astype(np.int64)), run.device)


@torch.no_grad()
def mean_loss_over_ranks(run, model, batches):  # PP 7; FSDP 1: no autocast; DDP 9: sum, divide
    """The mean cross-entropy per target over all ranks' batches (inputs, targets): each rank
    sums its own, one all-reduce adds the sums and the counts up. A collective: every rank calls
    it (evaluate() says how many batches each rank may bring)."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for x, y in batches:
        logits = pipeline_forward(run, model, x)  # PP 7: None but on the last stage
        if logits is None:  # PP 7: only the last stage scores; the others add 0
            continue
        with loss_parallel():  # 4D 8: from each rank's share of the logits
            loss = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten(), reduction="sum")
        totals[0] += local(loss)  # 4D 8
        totals[1] += (y != -100).sum()  # FSDP 5: the padding counts no token
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # 4D 8: a tp group's sums tp times, counts too
    free_gathered_weights(model)  # FSDP 5: forwards without a backward leave them
    model.train()
    return (totals[0] / totals[1]).item()


@torch.no_grad()  # PP 7: a pipeline without a schedule: receive, run, send
def pipeline_forward(run, model, x, context=None):  # 4D 3: None: the run's split
    """A forward through every stage of this rank's pp column (a collective of it): stage 0 embeds
    the token ids x (B, T); every later stage receives the activations (B, T, C) from the stage
    before, runs its blocks and sends them on. Returns the logits on the last stage, else None."""
    group, last = run.mesh.get_group("pp"), run.args.pp - 1
    if run.stage > 0:  # every stage knows x: its shape is the shape of what arrives
        h = torch.empty(*stream_shape(run, x.shape), dtype=activation_dtype(run),  # 4D 6
                        device=run.device)
        dist.recv(h, group=group, group_src=run.stage - 1)  # waits for the stage before
        x = h
    out = model(x, context)  # 4D 3
    if run.stage == last:
        return out
    dist.send(out.contiguous(), group=group, group_dst=run.stage + 1)  # the next stage's input
    return None


def train_step(run, schedule, model, optimizer, windows, step):  # PP 1: the schedule steps
    """One optimizer step over --grad-accum micro-batches; a collective. Returns the loss (mean
    over all ranks) and the gradient norm before clipping, both device tensors."""
    args = run.args
    # PP 1: K micro-batches in a row, (K x B, T), cut by the schedule; stage 0 reads x, the last y
    rows = torch.cat([windows.rows(step * args.grad_accum + i) for i in range(args.grad_accum)])
    x, y = run.context.share(*on_device(rows, run.device))  # 4D 3: this rank's tokens of each
    first, last, losses = run.stage == 0, run.stage == args.pp - 1, []
    inputs, target = ((x,) if first else ()), (y if last else None)
    with loss_parallel():  # 4D 8: the loss from the vocabulary's shares, and its backward
        schedule.step(*inputs, target=target, losses=losses if last else None,
                      return_outputs=False)  # each cp rank's mean: every rank has as many targets
    losses = [local(part) for part in losses]  # 4D 8: loss_parallel's losses, as tensors
    loss = torch.stack(losses).mean() if last else torch.zeros((), device=run.device)
    sum_tied_gradients(run, model)  # PP 4
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args)
    grad_norm = clip_gradients(run, model, args.clip or float("inf"))  # PP 8
    loss = mean_over_ranks(loss) * args.pp  # PP 1: the other stages add 0: the last stage's mean
    stop_if_diverged(run, step, loss, grad_norm)
    optimizer.step()  # FSDP 1
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def sum_tied_gradients(run, model):  # PP 4: one matrix, two copies: the sum of both gradients
    """A collective of this column's first and last stage: the GPT's one embedding and head matrix
    is two copies here; each gets the sum of both gradients, so both take the one matrix's steps."""
    if run.tied is not None:  # None: a middle stage, or --pp 1 (one matrix, one gradient)
        copy = model.tok_emb.weight if run.stage == 0 else model.head.weight
        dist.all_reduce(copy.grad.to_local(), op=dist.ReduceOp.SUM, group=run.tied)  # both copies


def local(loss):  # 4D 8: loss_parallel's loss, the same on each rank of a tp group
    return loss.to_local() if isinstance(loss, DTensor) else loss


def clip_gradients(run, model, max_norm):  # 4D 9: over every stage, shard and mesh
    """clip_grad_norm_ over the whole model: each stage's squared norm over its shards, per mesh
    (FSDP's dp x cp and, for what TP split, dp x cp x tp: clip_grad_norm_ cannot mix them), summed
    over the stages, the tied matrix counted once. Returns the norm before clipping, everywhere."""
    twin = model.head.weight if run.stage > 0 and model.head is not None else None  # PP 4
    on_mesh = {}  # 4D 9: by mesh
    for p in model.parameters():
        on_mesh.setdefault(p.device_mesh, []).append(p)
    norms = [nn.utils.get_total_norm([p.grad for p in ps if p is not twin])
             for ps in on_mesh.values()]  # each mesh's, a DTensor over its ranks
    norm = sum(n.full_tensor() ** 2 for n in norms)  # talks: each mesh's ranks; the stage's
    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=run.mesh.get_group("pp"))  # all stages
    norm = norm.sqrt()
    for ps in on_mesh.values():  # 4D 9
        nn.utils.clip_grads_with_norm_(ps, max_norm, norm)
    return norm


def mean_over_ranks(value):  # DDP 9
    """A collective: the average of a scalar tensor over all ranks (SUM, then divide)."""
    value = value.detach().clone().float()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # every rank gets the sum of all ranks'
    return value / dist.get_world_size()


def save_checkpoint(run, raw_model, optimizer, data, step):  # FSDP 3: every rank its shards
    """A collective: rank 0 writes DIR/step-N/run.json (step, flags, vocabulary, every rank's RNG),
    every rank its shards of weights and AdamW state (DCP: no gather; .metadata last marks it
    complete). Failed: SaveFailed on every rank, the folder removed, the previous step intact."""
    rng_states = [None] * run.world_size  # DDP 11: each rank has its own dropout stream
    dist.all_gather_object(rng_states, rng_state(run.device))  # so rank 0 can save them all
    folder = os.path.join(run.args.save, f"step-{step:06d}")  # FSDP 3: a folder per step
    if not shards_finite(raw_model):  # a collective: every rank gets the same answer
        raise SaveFailed(f"not saving {folder}: the weights are not finite")
    state = dict(zip(("model", "optimizer"), get_state_dict(raw_model, optimizer)))  # mine
    as_whole_model(run, raw_model, state["optimizer"])  # PP 6: named as the whole model names it
    try:  # rank 0 writes run.json, then every rank its shards
        save_on_rank_0(lambda: write_file(os.path.join(folder, "run.json"),  # talks
                                          run_state(run, data, step, rng_states)), run.is_main)
        dcp.save(state, checkpoint_id=folder)  # every rank its shards; .metadata last, by rank 0
    except (SaveFailed, OSError, RuntimeError, CheckpointException) as err:  # DCP: on every rank
        save_on_rank_0(lambda: shutil.rmtree(folder, ignore_errors=True), run.is_main)  # talks
        failed = SaveFailed(f"cannot save {folder}: {first_reason(err, folder, state)}")
        raise (err if isinstance(err, SaveFailed) else failed) from None
    save_on_rank_0(lambda: drop_older_steps(run.args.save, folder), run.is_main)  # talks
    print0(run.is_main, f"step {step}/{run.args.max_steps} | saved {folder}")


def save_on_rank_0(write, is_main):  # DDP 12: one writer; every rank waits and learns the outcome
    """A collective: rank 0 calls write(); every rank waits for it and raises what it raised.
    Never call it inside `if is_main:`: the other ranks would not reach the broadcast."""
    error = None
    if is_main:
        try:
            write()
        except Exception as err:  # sent to every rank below, so that none goes on alone
            error = err
    outcome = [error]
    dist.broadcast_object_list(outcome, src=0)  # every rank waits here for rank 0's write
    if outcome[0] is not None:
        raise outcome[0]


def leave_distributed():  # DDP 13: leave the process group on every path, error or not
    """Free what a failed run left (a model's hooks may hold the group), then leave the group."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()  # waits for no one: each rank leaves on its own


# --------------------------------------------------------------------------------- the model: a GPT
def causal_attention(q, k, v, causal=None):  # 4D 4: causal: Context's mask
    """softmax(q k^T / sqrt(d)) v over earlier positions, through PyTorch's fused kernel (flash
    attention on GPUs: no causal mask is built). No dropout on the attention weights: on a CPU it
    forces the slow unfused path. On a CPU, attention runs in fp32 even under bf16 autocast: the
    bf16 CPU backward kernel is 3x slower than the fp32 one (measured: docs/performance.md)."""
    # 4D 4: q holds the last positions of k's sequence. The lower-right mask aligns the last
    # query with the last key: queries 12-15 over 16 keys, query 12 reads keys 0-12 (is_causal=True
    # would align the first query with the first key: key 0 alone, and train wrong)
    if causal is None and q.shape[-2] != k.shape[-2]:  # as many queries as keys: is_causal
        causal = causal_lower_right(q.shape[-2], k.shape[-2])
    cpu = q.device.type == "cpu"  # 4D 4: one call, one mask, on every device
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

    def forward(self, x, context=None):  # 4D 3: context: this rank's share of the sequence
        B, T, C = x.shape
        # qkv's outputs come head by head (head 0's q, k, v, then head 1's...): equal parts are
        # whole heads, as a tensor-parallel split by heads needs; -1: the heads this module holds
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

    def forward(self, x, context=None):  # 4D 3
        x = x + self.drop(self.attn(self.ln1(x), context))
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
        if not self.head.weight.is_meta:  # on the meta device there is nothing to fill yet
            self.init_weights(seed=0)

    @torch.no_grad()
    def init_weights(self, seed):
        """Every parameter from initial_value(): the same weights for the same seed, whether
        the model is made whole here or one parameter at a time (a sharded build, where each rank
        fills only its own slice)."""
        for name, p in self.named_parameters():
            p.copy_(initial_value(name, p.shape, seed, len(self.blocks)))

    def forward(self, idx, targets=None):
        """Logits (B, T, vocab), and the mean cross-entropy per token if targets are given."""
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
    """The initial value of parameter `name`, GPT-2's scheme: N(0, 0.02) for matrices (residual
    projections shrink with depth), zero biases, unit norm weights. Each parameter draws from a
    generator of its own, seeded by (seed, name), so any one can be made without the others."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if len(shape) == 1:  # a LayerNorm's weight
        return torch.ones(shape)
    residual = name.endswith(("attn.proj.weight", "mlp.2.weight"))
    std = 0.02 / math.sqrt(2 * n_layer) if residual else 0.02
    generator = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * std


class Stage(nn.Module):  # PP 5: a run of the GPT's blocks, and the ends of the model it holds
    """Stage `stage` of `pp` of a GPT: its consecutive blocks under their own indices (blocks.2
    stays blocks.2, so a checkpoint knows nothing of the stages), the embeddings on the first
    stage, the final norm and the head on the last. Its forward takes token ids (first stage) or
    the previous stage's activations, and returns activations, or the logits (last stage)."""

    def __init__(self, gpt, stage, pp, context):  # 4D 3: the split of the run's forwards
        super().__init__()
        self.context = context  # 4D 3
        first, last = stage == 0, stage == pp - 1
        self.whole_params = sum(p.numel() for p in gpt.parameters())  # the tied matrix once
        self.whole_groups = [[n for n, p in gpt.named_parameters() if p.dim() >= 2],  # AdamW's
                             [n for n, p in gpt.named_parameters() if p.dim() < 2]]  # groups
        self.grad_checkpointing = False  # True: recompute each block's activations in backward
        self.tok_emb, self.pos_emb, self.drop = (gpt.tok_emb, gpt.pos_emb, gpt.drop) if first \
            else (None, None, None)
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i]
                                     for i in stage_blocks(len(gpt.blocks), pp, stage)})
        self.ln_f, self.head = (gpt.ln_f, gpt.head) if last else (None, None)

    def forward(self, x, context=None):  # 4D 3: None: the run's split (the schedule's forwards)
        context = context or self.context  # 4D 3: the tokens' places in the whole sequence
        if self.tok_emb is not None:  # token ids (B, T) -> the residual stream (B, T, C)
            x = self.drop(self.tok_emb(x) + self.pos_emb(context.positions))  # 4D 3
        for block in self.blocks.values():
            if self.grad_checkpointing and self.training:  # keep block inputs; recompute the rest
                x = checkpoint(block, x, context, use_reentrant=False)  # 4D 3
            else:
                x = block(x, context)  # 4D 3
        return x if self.head is None else self.head(self.ln_f(x))


def stage_blocks(n_layer, pp, stage):  # PP 5: contiguous, as even as can be
    """The indices of the blocks that `stage` holds: the stages cut the blocks in order, into runs
    of equal length, the earlier stages one block more when pp does not divide n_layer."""
    size, extra = divmod(n_layer, pp)
    first = stage * size + min(stage, extra)
    return range(first, first + size + (stage < extra))


def mean_token_loss(logits, targets):  # PP 1: the last stage's loss, per micro-batch
    """The mean cross-entropy per token of logits (B, T, vocab) against targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# -------------------------------------------- beyond the core: debugging, the benchmark, the report
def log_windows(run, windows):  # DDP 14: --debug, which windows each rank reads
    """A collective: every rank describes its data; rank 0 prints the lines in rank order, so
    that lines from several processes never splice into each other."""
    line = (f"[rank {run.rank}] stage {run.stage}, dp {run.dp_rank}, cp "  # 4D 2
            f"{run.mesh.get_local_rank('cp')}, tp {run.mesh.get_local_rank('tp')}: "
            f"{windows.per_epoch} micro-batches per epoch, "
            f"first windows at tokens {windows.starts_of_epoch(0)[:4].tolist()}")
    lines = [None] * run.world_size
    dist.all_gather_object(lines, line)  # to rank 0, which prints them in rank order
    print0(run.is_main, "\n".join(lines))


def benchmark(run, schedule, model, optimizer, windows):  # PP 1
    """--benchmark: 5 warm-up steps, then --max-steps timed ones; median ms/step and tokens/s."""
    times = []
    for step in range(5 + run.args.max_steps):
        start = time.perf_counter()
        loss, _ = train_step(run, schedule, model, optimizer, windows, step)  # PP 1; talks
        loss.item()  # wait for the device: the step is over
        times.append(time.perf_counter() - start)
    result = {**pace_keys(statistics.median(times[5:]), tokens_per_step(run)),
              "timed_steps": run.args.max_steps}
    log_peak_gpu_memory(run)  # talks on GPUs: every rank's peak
    print0(run.is_main, f"benchmark | {result['step_ms']} ms/step | "
                        f"{result['throughput']:,.0f} tok/s")
    print0(run.is_main, summary_line(result))


def report(run, raw_model, data, val_loss, meter):
    """The done line, the summary line, and a taste of what it learned, printed by rank 0; on GPUs
    first every rank's peak memory (a collective)."""
    log_peak_gpu_memory(run)  # talks on GPUs: every rank's peak
    summary = {**meter.summary(), "val_loss": val_loss, "baseline_loss": data.baseline}
    unit = "byte" if data.vocab_size == 256 else "token"
    print0(run.is_main, f"done | val loss {val_loss:.4f} ({unit}-frequency baseline "
                        f"{data.baseline:.4f}) | {summary['tokens_per_s']:,.0f} tok/s over "
                        f"{summary['train_s']:.1f} s of training")
    print0(run.is_main, summary_line(summary))
    if run.args.export:  # FSDP 8: one plain file, for one-process sampling
        export(run, raw_model, data)  # talks: every rank's shards to rank 0
    if unit == "byte" or data.itos:  # FSDP 5: every rank generates: each forward gathers weights
        raw_model.eval()
        start = 10 if unit == "byte" else min(data.itos)  # a newline, or the first piece
        torch.manual_seed(run.args.seed + run.dp_rank)  # 4D 10: a replica's ranks draw alike
        out = generate(run, raw_model, torch.tensor([[start]], device=run.device))  # PP 7
        print0(run.is_main, "sample:\n" + decode(out[0].tolist(), data.itos))  # FSDP 5


def export(run, raw_model, data):  # PP 6: by stage; FSDP 8: one plain file
    """A collective: each stage all-gathers its whole parameters and its first rank sends them to
    rank 0's CPU, which writes --export as one process saves it (train_ddp_minigpt.py --sample)."""
    if not shards_finite(raw_model):  # talks: every rank gets the same answer
        raise SaveFailed(f"not exporting {run.args.export}: the weights are not finite")
    options = StateDictOptions(full_state_dict=True)  # PP 6: every rank its whole stage
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")  # 4D 5: it warns
    level = redistribute.level  # that each block matrix's gather takes two all-gathers, one per
    redistribute.setLevel(logging.ERROR)  # dim: true, and once, here; silenced for this call only
    try:
        stage = get_model_state_dict(raw_model, options=options)  # all-gathers within the stage
    finally:
        redistribute.setLevel(level)
    stage = {k: v.cpu() for k, v in stage.items()}
    stages = [None] * run.world_size if run.is_main else None
    first = run.rank % (run.world_size // run.args.pp) == 0  # 4D 1: a stage's first rank sends
    dist.gather_object(stage if first else {}, stages, dst=0)  # PP 6: to rank 0
    weights = {k: v for part in stages or [] for k, v in part.items()}  # in the GPT's order
    save_on_rank_0(lambda: write_export(run, weights, data), run.is_main)  # talks


@torch.no_grad()  # PP 7: each new token is a forward through every stage
def generate(run, model, idx):
    """Append --max-new-tokens tokens to idx (1, T); a collective of the pp column. The last stage
    draws each token from its logits and sends it to every stage of the column."""
    args = run.args
    whole = Context(None, 0, 1, args.block_size, run.device)  # 4D 10: cp 1: each rank all tokens
    for _ in range(args.max_new_tokens):
        window = idx[:, -args.block_size:]  # 4D 10: padded on the right to --block-size, which
        padded = F.pad(window, (0, args.block_size - window.shape[1]))  # SP splits in tp parts;
        logits = pipeline_forward(run, model, padded, whole)  # causal: no token reads the padding
        token = torch.zeros(1, 1, dtype=torch.long, device=run.device)
        if logits is not None:
            logits = logits[:, window.shape[1] - 1]  # 4D 10: the last token's
            logits = logits.full_tensor() if isinstance(logits, DTensor) else logits  # talks: tp
            token = next_token(logits, args.temperature, args.top_k)
        dist.broadcast(token, group=run.mesh.get_group("pp"), group_src=args.pp - 1)  # to all
        idx = torch.cat([idx, token], dim=1)
    return idx


def log_peak_gpu_memory(run):  # DDP 16: every rank's peak, printed by rank 0
    """A collective on CUDA: rank 0 prints every rank's peak of allocated GPU memory, in rank
    order (measured: weights, gradients, optimizer state, activations; docs/fsdp.md)."""
    if run.device.type != "cuda":
        return
    peaks = [None] * run.world_size
    dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(run.device))  # for rank 0
    print0(run.is_main, "peak GPU memory per rank (max_memory_allocated): " +
           ", ".join(f"rank {rank} {peak / 2**20:,.1f} MiB" for rank, peak in enumerate(peaks)))


# ============================================================================== the plumbing


# ---------------------------------------- guards: each stops one thing going wrong in production
def avoid_known_failures(args):  # guard: every guard, in one place, before the group is joined
    """Exit code 2 for a launch that could never join a group; a workaround for each known fault."""
    if torch.__version__ < "2.13":  # 4D 4: GatherContext's collectives, from torch 2.13 on
        sys.stderr.write(f"error: this chapter needs torch 2.13 or newer: {torch.__version__}\n")
        sys.exit(2)  # as refuse_a_bad_launch: a launch that cannot work (a TorchVersion compares)
    refuse_a_bad_launch(args.device)  # guard: no torchrun, or more processes than GPUs
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    backend = "nccl" if cuda else "gloo"
    level = safe_debug_level(backend, args.debug, dist.get_debug_level())  # guard: DETAIL on gloo
    dist.set_debug_level(level)  # before init_process_group, which reads it
    if not cuda:
        avoid_page_faults_on_cpu()  # guard: page faults every step on Linux CPUs
    node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))  # 4D 1: per node
    warning = avoid_groups_across_nodes(args.tp, args.cp, node)  # guard: 4D 1
    if warning and os.environ["RANK"] == "0":
        print(warning, flush=True)


def avoid_groups_across_nodes(tp, cp, per_node):  # guard: tp or cp traffic over the network
    """A warning if a tp group (tp consecutive ranks), or a replica's cp x tp block, may span nodes
    of per_node processes: warned, not refused (a small run may choose it)."""
    for size, what in ((tp, f"a tp group (--tp {tp})"), (tp * cp, f"--cp {cp} x --tp {tp}")):
        if per_node % size:
            return (f"warning: {what} with {per_node} processes per node spans nodes: its "
                    "collectives of every block and micro-batch cross the network")
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
    """The debug level to run at, from the shell's: --debug asks DETAIL (NCCL) or INFO (gloo); a
    shell's DETAIL on gloo, where it crashes DDP, becomes INFO with one warning from rank 0."""
    if debug:
        level = dist.DebugLevel.DETAIL if backend == "nccl" else dist.DebugLevel.INFO
    if backend == "gloo" and level == dist.DebugLevel.DETAIL:  # the shell's
        if os.environ["RANK"] == "0":  # before the group: torchrun's RANK says who logs
            print("warning: TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DDP on gloo "
                  "(docs/troubleshooting.md): going on at INFO", flush=True)
        level = dist.DebugLevel.INFO
    return level


def avoid_page_faults_on_cpu():  # guard: glibc returning freed memory at once
    """On Linux CPUs (glibc), keep freed memory in the process: glibc hands each step's tens of MB
    (the logits) back to the OS, and page faults cost 10-30% of a step (docs/performance.md)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc (macOS, musl, Windows): nothing to tune
    libc.mallopt(-4, 0)  # M_MMAP_MAX = 0: serve large blocks from the heap, not fresh mmaps
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD = 1 GiB: keep that much freed heap for reuse


# ------------------------------------------------------------------------------------------ flags
class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, instead of argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(kind, zero_ok=False):
    """An argparse type: a number of `kind` above zero, or at least zero if zero_ok."""
    def parse(text):
        value = kind(text)
        if value < 0 or (value == 0 and not zero_ok):
            bound = "at least 0" if zero_ok else "positive"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
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
    a("--compile", action="store_true", help="torch.compile the model (default: off)")
    a("--compile-backend", default="inductor", metavar="NAME",
      help="torch.compile backend (default: inductor)")
    a = p.add_argument_group("training").add_argument
    a("--batch-size", type=positive(int), default=16, metavar="B",  # PP 3: per column
      help="sequences per micro-batch, per dp column: every stage of a column works on the same "
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
      help="autocast dtype; auto: bf16 (or fp16) on GPUs, off on CPUs (default: auto)")
    a("--seed", type=int, default=0, help="seeds the weights, data order, dropout (default: 0)")
    a("--device", choices=["auto", "cpu", "cuda"], default="auto",
      help="auto = cuda if there is one, else cpu (default: auto)")
    a = p.add_argument_group("distributed: timeouts and debugging (chapters 5 and 6)").add_argument
    a("--dist-timeout", type=positive(float), default=300, metavar="S",
      help="seconds a collective waits for a peer before the job fails (default: 300)")
    a("--pp", type=positive(int), default=2, metavar="N",  # PP 2
      help="pipeline stages: runs of consecutive blocks, each on world size / N consecutive "
           "ranks (a node); must divide the world size, at most --n-layer (default: 2)")
    a("--cp", type=positive(int), default=2, metavar="N",  # 4D 1
      help="context-parallel ranks: each sequence's tokens split in 2 x N chunks; 2 x N must "
           "divide --block-size; 1: no split (default: 2)")
    a("--tp", type=positive(int), default=2, metavar="N",  # 4D 1
      help="tensor-parallel ranks: consecutive ranks, one node's GPUs; must divide --n-head; 1: "
           "no split (default: 2). pp x cp x tp must divide the world size: dp is the rest")
    a("--sequence-parallel", choices=["on", "off"], default="on",  # 4D 5
      help="split the norms' and dropout's activations by sequence in a tp group (default: on)")
    a("--schedule", choices=["gpipe", "1f1b"], default="1f1b",  # PP 1
      help="the order of a step's micro-batches: gpipe (all forwards, then all backwards) or "
           "1f1b (after a warm-up, one forward and one backward in turn: fewer activations "
           "held) (default: 1f1b)")
    a("--reshard-after-forward", choices=["yes", "no"], default="no",  # PP 1: no, unlike ch. 7
      help="yes: free each block's gathered weights after each forward (ZeRO-3); no: keep them "
           "until the step's backwards end (one all-gather per block and step, not one per "
           "micro-batch; more memory) (default: no)")
    a("--debug", action="store_true", help="TORCH_DISTRIBUTED_DEBUG and each rank's data windows")
    a = p.add_argument_group("evaluation, logging, checkpoints").add_argument
    a("--eval-every", type=positive(int), default=100, metavar="N",
      help="steps between evaluations (default: 100)")
    a("--eval-windows", type=positive(int), default=128, metavar="N",
      help="validation sequences per evaluation (default: 128)")
    a("--log-every", type=positive(int), default=10, metavar="N",
      help="steps between log lines (default: 10)")
    a("--save", default="checkpoints/minigpt_4d", metavar="DIR",  # 4D 7
      help="checkpoint folder of step-N folders, '' for none (default: %(default)s)")
    a("--export", default="checkpoints/minigpt_4d.pt", metavar="PATH",  # 4D 7
      help="the final weights in one file, chapter 3's format, '' for none (default: %(default)s)")
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
    split = args.tp if args.sequence_parallel == "on" else 1  # 4D 5: a cp share in tp parts
    if args.block_size // args.cp % split:
        p.error(f"--sequence-parallel on splits a cp rank's {args.block_size // args.cp} tokens "
                f"in --tp {args.tp} parts: give a --block-size that --cp x --tp divides, or "
                "--sequence-parallel off")
    if args.pp > args.n_layer:  # PP 2: every stage holds a block
        p.error(f"--pp {args.pp} is more stages than --n-layer {args.n_layer} blocks")
    if args.schedule == "1f1b" and args.grad_accum < args.pp:  # PP 1: torch's 1F1B needs K >= pp
        p.error(f"--schedule 1f1b needs at least --pp {args.pp} micro-batches per step, got "
                f"--grad-accum {args.grad_accum}: give more, or --schedule gpipe")
    if not 0 <= args.dropout < 1 or not 0 < args.val_fraction < 1:
        p.error("--dropout must be in [0, 1) and --val-fraction in (0, 1)")
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
                         f"{len(val):,} validation tokens: too few for {world_size} process(es) x "
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
    """The autocast dtype, or None for fp32. bf16 has fp32's range: no loss scaling. fp16 needs a
    GradScaler. Only native bf16 counts: V100s and T4s emulate it, slower than fp16."""
    native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    if choice == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if native_bf16 else torch.float16
    if choice == "fp16" and device.type != "cuda":
        raise InputError("--amp fp16 needs a CUDA device; on a CPU use --amp bf16 or --amp off")
    if choice == "bf16" and device.type == "cuda" and not native_bf16:
        raise InputError("--amp bf16: this GPU has no native bf16 (only slow emulation); "
                         "use --amp fp16")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[choice]


def mixed_precision(choice, device):  # FSDP 1: FSDP's policy casts the weights, not autocast
    """(the dtype's name, FSDP's policy): compute in bf16 on the gathered weights, gradients
    reduced in fp32, shards kept in fp32; no GradScaler."""
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
    finite. Both are the same on every rank (all-reduced), so every rank stops at this step. With
    fp16 a non-finite gradient is the GradScaler's to skip; only a non-finite loss stops the run."""
    loss, grad_norm = loss.item(), grad_norm.item()  # a host sync per step: the price of the check
    fp16 = run.amp == "float16"
    if math.isfinite(loss) and (math.isfinite(grad_norm) or fp16):
        return
    args = run.args
    raise Diverged(f"step {step + 1}/{args.max_steps}: loss {loss:.4g}, grad norm {grad_norm:.4g}: "
                   f"not finite, step not applied; try a lower --lr (now {args.lr:g}), a --clip "
                   f"(now {args.clip:g}){', or --amp bf16 instead of fp16' if fp16 else ''}")


# ------------------------------------------------------------------------------- checkpoint files
def all_finite(state_dict):
    """True if every floating-point tensor of a state dict is free of NaN and infinity."""
    return all(bool(torch.isfinite(t).all()) for t in state_dict.values() if t.is_floating_point())


def state_bytes(state):
    """About the bytes a checkpoint of `state` takes on disk: its tensors', in nested dicts and
    lists (a DTensor counts whole)."""
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


def free_gathered_weights(model):  # FSDP 5: --reshard-after-forward no keeps them gathered
    """Reshard every FSDP module of the model: the weights a forward without a backward (evaluation,
    sampling) gathered are freed, and the parameters are this rank's shards again."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def write_export(run, weights, data):  # FSDP 8: rank 0's part of --export
    """Write the gathered weights to --export in chapter 3's checkpoint format, atomically."""
    path, step = run.args.export, run.args.max_steps
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


def newest_complete_step(folder, is_main):  # FSDP 3
    """The newest step folder in `folder` that DCP finished (.metadata is written last), or
    None; newer unfinished ones are named in one line and ignored."""
    steps = sorted(glob.glob(os.path.join(glob.escape(folder), "step-*")))
    done = [s for s in steps if os.path.isfile(os.path.join(s, ".metadata"))]
    unfinished = [s for s in steps if not done or s > done[-1]]
    print0(is_main and unfinished, f"ignoring unfinished checkpoint steps (no .metadata): "
                                   f"{', '.join(unfinished)}")
    return done[-1] if done else None


def drop_older_steps(folder, newest):  # FSDP 3
    """Remove every complete step in `folder` older than `newest`: first its .metadata (no longer
    complete), then the rest. A step left behind costs only disk."""
    for old in sorted(glob.glob(os.path.join(glob.escape(folder), "step-*"))):
        if old < newest:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(old, ".metadata"))
            shutil.rmtree(old, ignore_errors=True)


def read_checkpoint(path):
    """The checkpoint dict, loaded to the CPU with weights_only=True; a problem is an InputError."""
    if not os.path.isfile(path):
        raise InputError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not {"model", "config", "step"} <= state.keys():
            raise ValueError("not a checkpoint of this script (no model, config and step)")
    except Exception as err:  # truncated, not a torch file, not a checkpoint of ours: bad input
        reason = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
        raise InputError(f"cannot read checkpoint {path}: {reason}") from None
    if not all_finite(state["model"]):
        raise InputError(f"{path} holds weights that are not finite: use an earlier checkpoint")
    return state


def read_run_state(path, run, data):  # FSDP 3
    """A step folder's run.json, checked against this run's model; a problem is an InputError."""
    if os.path.isfile(path):  # FSDP 3: folders, not files
        raise InputError(f"{path} is one file, as train_ddp_minigpt.py saves; this trainer "
                         "resumes from a checkpoint folder of its own (--save DIR)")
    file = os.path.join(path, "run.json")
    if not os.path.isfile(os.path.join(path, ".metadata")) or not os.path.isfile(file):
        raise InputError(f"no complete checkpoint at {path} (it needs .metadata and run.json)")
    try:
        with open(file, "rb") as f:  # FSDP 3
            state = json.load(f)
        config = state["config"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"cannot read {file}: {type(err).__name__}: {err}") from None
    if config != model_config(run.args, data.vocab_size):
        raise InputError(f"{path} was trained with {config}, this run builds "
                         f"{model_config(run.args, data.vocab_size)}")
    return state


def as_whole_model(run, model, optim_state):  # PP 6: a checkpoint that knows no stages
    """Rename this stage's optimizer state in place as chapter 7 names the whole model's (the tied
    matrix's under tok_emb.weight, as one process keeps it; param groups listing the whole model's
    parameters, so that every stage writes the same); return the stage's own lists of names."""
    if "head.weight" in optim_state["state"] and run.args.pp > 1:  # the last stage's copy
        optim_state["state"]["tok_emb.weight"] = optim_state["state"].pop("head.weight")
    own_names = [group["params"] for group in optim_state["param_groups"]]
    for group, names in zip(optim_state["param_groups"], model.whole_groups):
        group["params"] = names
    return own_names


def as_stage(optim_state, own_names):  # PP 6: back to this stage's names
    """The optimizer state as_whole_model() renamed, as this stage's optimizer names it."""
    moments = optim_state["state"]
    if "head.weight" in own_names[0] and "tok_emb.weight" not in own_names[0]:
        moments["head.weight"] = moments.pop("tok_emb.weight")
    for group, names in zip(optim_state["param_groups"], own_names):
        group["params"] = names
    return optim_state


def stage_holding(run, model):  # PP 5: what this rank holds
    """(dp rank, stage, the parts of the model it holds, the parameters of its shards)."""
    blocks = list(model.blocks)
    span = f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}"
    parts = ["embeddings"] * (model.tok_emb is not None) + [span] \
        + ["final norm and head"] * (model.head is not None)
    mine = sum(p.to_local().numel() for p in model.parameters())
    first = run.rank % (run.world_size // run.args.pp) == 0  # 4D 1: the stage's first rank
    return first, run.stage, ", ".join(parts), mine  # PP 5: for rank 0's memory line


def memory_line(model, held):  # PP 5: what a rank of each stage holds, against DDP's full copy
    """Bytes of weights + gradients + AdamW's two moments (fp32: 4 copies) held by the first rank
    of each stage, from every rank's stage_holding(), and the parts of the model it holds."""
    stages = [f"stage {stage} ({parts}) {16 * n / 2**20:.2f} MiB, {n:,} parameters"
              for first, stage, parts, n in held if first]  # 4D 1
    where, whole = next(model.parameters()).device.type, model.whole_params
    return (f"memory per rank ({where}): weights, gradients and AdamW state: {'; '.join(stages)} "
            f"(of {whole:,}; DDP: {16 * whole / 2**20:.2f} MiB)")


def traffic_line(run, vocab_size):  # 4D 6: what rank 0 sends in a step, group by group
    """The bytes rank 0 (stage 0) sends per optimizer step in each of its groups, without
    --grad-checkpointing (docs/4d.md): tp, per block and micro-batch 4 collectives of the stream
    (B, T / cp, C), 1 more for the embedding (and the head at --pp 1), each sending (tp - 1) / tp of
    it twice (an all-reduce, or an all-gather and a reduce-scatter); cp, per block and micro-batch
    K and V gathered twice (forward, backward's recompute), their fp32 gradients reduce-scattered;
    pp, the stream to stage 1 per micro-batch, the tied gradient's shard (fp32) with the last."""
    args, K, tp, cp = run.args, run.args.grad_accum, run.args.tp, run.args.cp
    width, blocks = activation_dtype(run).itemsize, len(stage_blocks(args.n_layer, args.pp, 0))
    stream = args.batch_size * args.block_size // cp * args.n_embd * width
    tp_ops = (4 * blocks + 1 + (args.pp == 1)) * K
    kv = 2 * stream / tp  # K and V of this rank's heads and tokens
    sent = {"tp": 2 * tp_ops * stream * (tp - 1) / tp,
            "cp": blocks * K * (cp - 1) * kv * (2 + 4 / width),
            "pp": (K * math.prod(stream_shape(run, (args.batch_size, args.block_size // cp)))
                   * width + vocab_size * args.n_embd * 4 / (run.world_size // args.pp))
            * (args.pp > 1)}
    return (f"traffic per step, rank 0 (stage 0, {blocks} blocks): " + " | ".join(
        f"{group} {mib / 2**20:.3f} MiB" for group, mib in sent.items())
        + f" (tp: {tp_ops} collectives of {stream / 2**20:.3f} MiB; FSDP's gathers aside)")


def layout_line(mesh, rank):  # 4D 1: where one rank sits, and whom it talks to
    """The mesh's sizes, and for `rank` its coordinates and the ranks of each group it belongs to:
    along one dim, the ranks that differ from it in that coordinate alone (FSDP's: dp and cp)."""
    grid, names = mesh.mesh, mesh.mesh_dim_names
    where = [int(i) for i in (grid == rank).nonzero()[0]]

    def along(*dims):  # the ranks that share every coordinate with `rank` but these
        index = tuple(slice(None) if d in dims else i for d, i in enumerate(where))
        return grid[index].flatten().tolist()
    groups = [f"{name} {along(d)}" for d, name in enumerate(names)] + [f"fsdp {along(1, 2)}"]
    return (f"mesh {' x '.join(f'{n} {s}' for n, s in zip(names, grid.shape))} | rank {rank} at "
            f"{dict(zip(names, where))}: groups " + ", ".join(groups))


def stage_shapes(run, model):  # PP 1: what a micro-batch brings to a stage, and what it sends
    """Meta tensors of a micro-batch's input to this stage (token ids on the first, activations
    after) and of its output (activations, logits on the last)."""
    size = (run.args.batch_size, run.args.block_size // run.args.cp)  # 4D 6: a cp share
    ids = torch.empty(*size, dtype=torch.long, device="meta")  # the first stage's input
    stream = stream_shape(run, size)  # 4D 6: sequence parallel, split by tp too
    inputs, outputs = (torch.empty(*shape, dtype=activation_dtype(run), device="meta",
                                   requires_grad=True)  # floats: gradients come back
                       for shape in (stream, stream if model.head is None else  # 4D 6
                                     (*size, model.head.out_features)))
    return ids if run.stage == 0 else inputs, outputs


def stream_shape(run, size):  # 4D 6: what goes between stages
    """The shape of the activations of token ids of shape `size` (B, T) on one rank: (B, T, C),
    or sequence parallel (B, T / tp, C): each rank of a tp group sends its own part on."""
    split = run.args.tp if run.args.sequence_parallel == "on" else 1
    return size[0], size[1] // split, run.args.n_embd


def activation_dtype(run):  # PP 7: what goes between stages
    """The dtype of the activations a stage sends: FSDP's compute dtype, or fp32."""
    return run.policy.param_dtype or torch.float32


# --------------------------------------------------------------------------- logging and timing
def print0(is_main, message):
    """Print a log line if this process is the one that logs; flush, so it shows at once."""
    if is_main:
        print(message, flush=True)


def tokens_per_step(run):
    return run.args.batch_size * run.args.block_size * run.args.grad_accum * run.dp_size  # PP 3


def peak_tflops(gpu_name, amp):
    """The dense peak TFLOPS of a GPU in the table (datasheets, no sparsity; 16-bit with fp32
    accumulation, as autocast runs) for the autocast dtype ("off": fp32 without TF32), or None.
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
    """The training clock and the log line. Time between log lines counts training only:
    main() stops the clock for evaluation and checkpoints."""

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
        """step N/M | loss | lr | grad norm | ms/step | tok/s, and MFU on CUDA, over the steps
        since the last log line (docs/conventions.md)."""
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
        """Steps, seconds and tokens/s of training, and the median pace (docs/conventions.md)."""
        steps, train_s = sum(n for n, _ in self.intervals), sum(s for _, s in self.intervals)
        timed = self.intervals[1:] or self.intervals  # the first interval is the warm-up
        step_s = statistics.median([s / n for n, s in timed]) if timed else 0.0
        return {"steps": steps, "train_s": round(train_s, 3),
                "tokens_per_s": round(steps * self.tokens / train_s, 1) if train_s else 0.0,
                **pace_keys(step_s, self.tokens)}


def pace_keys(step_s, tokens_per_step):
    """The summary keys benchmark_scaling.py reads (docs/conventions.md): the median ms per
    optimizer step, and the throughput of all ranks it implies."""
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
    state = read_checkpoint(args.ckpt)
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


def next_token(logits, temperature, top_k):  # PP 7: what GPT.generate draws, per token
    """A token id (1, 1) drawn from the logits (1, vocab) of the last position."""
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1)


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
        leave_distributed()  # DDP 13
    sys.exit(code)
