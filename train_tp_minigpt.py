"""Chapter 8: a GPT trainer with tensor parallelism (TP) inside FSDP, on a 2-D mesh of ranks.
TP splits each block's matrices across --tp ranks; FSDP shards what each rank holds across the
data-parallel replicas. Without dropout it computes, up to rounding, what one process computes.

    torchrun --standalone --nproc_per_node=2 train_tp_minigpt.py --tp 2  # dp 1, tp 2: CPU or 2 GPUs
    torchrun --standalone --nproc_per_node=4 train_tp_minigpt.py --tp 2  # dp 2, tp 2: CPU or 4 GPUs
    torchrun --standalone --nproc_per_node=gpu train_tp_minigpt.py --tp 8 --n-head 8  # one node
    ./launch_multinode_ddp.sh --nnodes 2 --nproc-per-node 8 --master-addr N0 \
        train_tp_minigpt.py --tp 8 --n-head 8
    python train_tp_minigpt.py --sample --ckpt checkpoints/minigpt_tp.pt --prompt "def main("

The multi-node line prints the torchrun command to run on each node; with --tp 8, each node holds
one tp group. --sample runs in one plain process. Default data: the first 2,000,000 bytes of this
Python's own standard library, one token per byte (vocab 256), so nothing is downloaded; `--data`
also takes a text file, a .bin of uint16 token ids, or a nanoGPT folder.

Read it top-down: main(), then its core steps in the order it calls them, the model, and the steps
beyond the core (debugging, the benchmark, the report). Every call that communicates with other
ranks sits above the line that ends `the plumbing`. Below it, no line communicates with another
rank: guards, flags, data, files, logging, sampling, errors, and small helpers that the core calls
(dtypes, shapes, freeing gathered weights).

Terms. A rank is one of the processes torchrun starts, one per device, numbered from 0; the world
size is how many there are. A process group is a set of ranks that communicate with each other. A
collective is a call that every rank of a group makes, in the same order; each rank waits in it
until all have made it. An all-reduce sums a tensor over a group and gives every rank the sum; a
reduce-scatter sums it and gives each rank one part of the sum; an all-gather gives every rank all
the ranks' parts. A shard is the part of a tensor that one rank holds. The mesh (a DeviceMesh) lays
the ranks out as a grid of world size / tp by tp, its dims named "dp" and "tp": rank r has dp rank r
// tp and tp rank r % tp. A tp group is the tp consecutive ranks of one dp rank: they split every
layer among them and together compute one replica, the model's forward and backward on that dp
rank's own batches. A dp group is the ranks that share a tp rank, one in each replica: FSDP shards
their part of every parameter across them and averages their gradients. fully_shard makes each block
a unit whose weights are gathered and freed together; the root is the unit of the rest (embeddings,
final norm, head). DCP, torch.distributed.checkpoint, saves and loads every rank's shards, at any
layout.

TP's own terms. A column-wise split of a linear layer gives each rank of a tp group some of its
outputs, from the whole input; a row-wise split gives each some of its inputs, so that each computes
a partial sum of every output, which a collective adds up. Sequence parallelism splits the
activations between those layers by position across the tp group, for the norms and dropout. Loss
parallel computes the cross-entropy from logits split by vocabulary, without gathering them. A
DTensor is a tensor spread over a mesh, one placement per mesh dim: Shard(d), split along dim d;
Replicate(), a whole copy on every rank; Partial, one part of a sum. A micro-batch is the batch of
one forward and backward; --grad-accum of them make one optimizer step. A plan maps a module's name
to a style, which splits the module's weights and runs the collectives around it. By default
ColwiseParallel takes a whole input and returns this rank's outputs, RowwiseParallel takes the input
split by its last dim and returns the whole sum, both as plain tensors; SequenceParallel and
PrepareModuleInput return DTensors. input_layouts says how an input arrives, desired_input_layouts
how the module needs it, output_layouts how its output leaves; use_local_output=False keeps the
output a DTensor. The model's two ends are the tied embedding and head.

Where each weight lives (TP's placement on the tp dim; FSDP then shards dim 0 over dp):
  attn.qkv (3C, C), mlp.0 (4C, C)  Shard(0): whole heads, or hidden units; biases alike
  attn.proj (C, C), mlp.2 (C, 4C)  Shard(1): the matching inputs; biases Replicate
  tok_emb = head (V, C)            Shard(0): rows of the vocabulary, for both (nn.Linear's
                                   weight is (out, in), so column-wise splits its dim 0)
  norms                            Replicate with sequence parallelism; else not TP's
  pos_emb (T, C)                   not TP's: FSDP alone
At dp 2 x tp 2 a rank holds (3C / 4, C) of qkv's weight, (C / 2, C / 2) of proj's, (V / 4, C) of
the vocabulary matrix and (C / 2,) of a norm's weight.

One block in one micro-batch, on a tp group's ranks, with sequence parallelism (the default):
  ln1, ln2     on this rank's T / tp positions of the residual stream; no collective
  attn, mlp    an all-gather over tp rebuilds the whole (B, T, C), as a Replicate DTensor; qkv and
               mlp.0 compute this rank's heads or hidden units, as plain tensors
  proj, mlp.2  partial sums, reduce-scattered over tp back to a plain (B, T / tp, C)
  backward     each all-gather's backward is a reduce-scatter, and the reverse. The norms, which
               each tp rank holds whole, get partial gradients, summed over tp (an all-reduce
               DTensor makes when FSDP asks for them whole) before FSDP's reduce-scatter over dp.
               A row-wise bias's gradient comes out whole on each tp rank: no sum
Without it, each all-gather and reduce-scatter pair is one all-reduce, after proj and after mlp.2
(and, in backward, one for the input gradients of qkv and of mlp.0), and every tensor between the
layers is a plain whole (B, T, C). FSDP all-gathers the block's weights over dp before it runs and
reduce-scatters their gradients over dp after its backward. The head's logits stay a DTensor split
by vocabulary, for loss parallel.
Under --amp bf16, FSDP's reduce-scatters over dp run in fp32 (the policy's reduce_dtype), and so
do loss parallel's sums (the logits are cast to fp32 first). TP's sums over tp run in bf16: the
activations' gradients, and the norms' gradients, which DTensor sums before FSDP casts them (with
--grad-sync last and --grad-accum above 1, FSDP casts first and sums them once a step, in fp32).

Tags: each `# TP k` comment marks a line that TP adds or changes, numbered in reading order:
  TP 1   --tp N: the (world size / N, N) mesh; a tp group is N consecutive ranks, on one node
  TP 2   data and batch by dp rank; dropout seeds too, or by rank under sequence parallelism
  TP 3   the log lines of what each rank holds, and of what TP's collectives send per step
  TP 4   TP's plans in each tp group (sequence parallel by default), then FSDP in each dp group
  TP 5   checkpoints: random states restored only at the layout that saved them; own file names
  TP 6   loss parallel: the loss and its backward from logits split by vocabulary
  TP 7   the gradient norm per mesh, then combined, since clip_grad_norm_ cannot mix meshes
  TP 8   --check-sync: the copies a tp group's ranks hold of unsplit weights, compared by hash
Lines tagged DDP k or FSDP k mark what chapters 3 and 7 changed; the key of each is in its
chapter, and most say on the line what it does.

See also: docs/tp.md (why TP stays inside one node, measured) and docs/tp_in_your_trainer.md.
"""
import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import errno
import gc
import glob
import hashlib  # TP 8
import io  # FSDP 8
import json
import logging  # FSDP 3
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
from torch.distributed.tensor import distribute_tensor  # FSDP 2
from torch.distributed.tensor import DTensor, Replicate, Shard  # TP 4
from torch.distributed.tensor.parallel import (ColwiseParallel,  # TP 4
                                               PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)
from torch.utils.checkpoint import checkpoint


# ------------------- the distributed lesson: main(), then its core steps in the order it calls them
def main(argv=None):
    args = parse_args(argv)
    if args.sample:  # sampling runs in one plain process, with no process group
        return sample(args)
    avoid_known_failures(args)  # guard: refuses a bad launch, avoids known failures
    # Setup: one process per device, one group. Every rank calls the collectives in the same order.
    device, rank, world_size = init_distributed(args.device, args.dist_timeout)  # DDP 1: join
    run = make_run(args, device, rank, world_size)  # TP 1: builds the mesh, a collective
    # Data: each replica reads its own windows of the training tokens.
    data = build_data(run)  # a collective with --debug: rank 0 prints every rank's windows
    # Model: every rank computes the initial weights a single process would, one parameter at a
    # time, and keeps only its shards of them; a resume then overwrites them.
    raw_model, optimizer = build_model(run, data.vocab_size)  # every rank shards alike
    start = resumed_step(run, raw_model, optimizer, data)  # a collective: one agreed start step
    model = wrap_model(run, raw_model)  # the same shards: raw_model, its blocks compiled in place
    if args.benchmark:
        return benchmark(run, model, optimizer, data.windows)  # collectives: timed steps
    # Train: log, evaluate and save on schedule.
    val_loss = evaluate(run, model, data.val)  # a collective: every rank's loss sums add up
    print0(run.is_main, f"step {start}/{args.max_steps} | val loss {val_loss:.4f}")
    meter = Meter(run, raw_model, start)  # the training clock starts now
    for step in range(start, args.max_steps):  # every step runs collectives
        loss, grad_norm = train_step(run, model, optimizer, data.windows, step)  # collectives
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
    mesh: object  # TP 1: the (dp, tp) grid of ranks, a DeviceMesh
    dp_rank: int  # TP 2: the replica this rank's tp group computes, so the data it reads
    dp_size: int  # TP 2: how many replicas (tp groups) there are: world size / tp


def make_run(args, device, rank, world_size):
    """This process's Run; logs the run's shape (world size, device, precision, batch)."""
    is_main = rank == 0  # DDP 3: only rank 0 logs and writes files
    amp, policy = mixed_precision(args.amp, device)  # FSDP 1: FSDP's dtypes
    mesh = grid(args.tp, device, world_size)  # TP 1: the (world size / tp, tp) mesh
    run = Run(args, device, rank, world_size, is_main, amp, policy, mesh,
              mesh.get_local_rank("dp"), mesh.size(0))
    print0(is_main, f"world size {world_size} ({run.dp_size} dp x {args.tp} tp) | device "
                    f"{device} | amp {amp} | {tokens_per_step(run):,} tokens per step "
                    f"({args.batch_size} x {args.block_size} x {args.grad_accum} accumulation x "
                    f"{run.dp_size} replicas)")  # TP 2: a batch per replica, not per rank
    return run


def grid(tp, device, world_size):
    """The ranks as a (world size / tp, tp) DeviceMesh, dims "dp" and "tp". A tp group is tp
    consecutive ranks, which torchrun starts on one node, so TP's collectives, run in every block,
    use the node's fast links (NVLink) instead of the network. A collective: every rank calls it."""
    if world_size % tp:
        raise InputError(f"--tp {tp} does not divide the world size {world_size}: start a "
                         f"multiple of {tp} processes, or give --tp 1")
    shape, names = (world_size // tp, tp), ("dp", "tp")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)  # TP 1: creates the groups
    # Both dims as one mesh too, for speed only: DTensor merges a collective over both dims (the
    # gradient norm's all-reduce in clip_gradients) into one call on it, not one call per dim.
    mesh["dp", "tp"]._flatten("dp_tp")  # TP 1: private in torch 2.14; torchtitan uses it too
    return mesh


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
    train, val, vocab_size, itos = load_data(args, run.dp_size)  # TP 2: a batch per replica
    windows = Windows(train, args.block_size, args.batch_size, run.dp_rank, run.dp_size,
                      args.seed)  # TP 2: dealt by dp rank, so a tp group's ranks read alike
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
    """The model split by TP and sharded by FSDP (this rank holds a part of it), and AdamW."""
    args = run.args
    with torch.device("meta"):  # FSDP 2: shapes and dtypes, no memory
        raw_model = GPT(**model_config(args, vocab_size))
    shard(run, raw_model)  # FSDP 2: before the optimizer, which must see the shards
    raw_model.to_empty(device=run.device)  # FSDP 2: this rank's shards, not yet filled
    init_shards(raw_model, args.seed)  # FSDP 2: one process's initial weights
    raw_model.grad_checkpointing = args.grad_checkpointing
    optimizer = make_optimizer(raw_model, args, run.device)
    torch.manual_seed(args.seed + dropout_stream(run))  # TP 2: by dp rank, or by rank
    print0(run.is_main, f"model {sum(p.numel() for p in raw_model.parameters()):,} parameters | "
                        f"{args.n_layer} layers, {args.n_head} heads, {args.n_embd} wide, "
                        f"context {args.block_size}")
    print0(run.is_main, memory_line(raw_model))  # FSDP 2: what each rank holds
    if args.grad_accum > 1:
        print0(run.is_main, accumulation_line(raw_model, args))  # FSDP 2: and while accumulating
    print0(run.is_main, traffic_line(run))  # TP 3: and what TP's collectives send
    return raw_model, optimizer


def shard(run, model):
    """TP splits each block, and the tied embedding and head, across the tp group; then FSDP
    shards every parameter across the dp group. A parameter a plan made a DTensor ends up on the
    2-D mesh; the rest (pos_emb; the norms without sequence parallelism) on "dp" alone."""
    mesh, sp = run.mesh["dp"], run.args.sequence_parallel == "on"  # TP 4: FSDP in the dp group
    reshard = run.args.reshard_after_forward == "yes"
    for i, block in enumerate(model.blocks):  # sharding sends nothing; hooks gather later
        if run.args.tp > 1:  # TP 4: --tp 1 is FSDP alone
            parallelize_module(block, run.mesh["tp"], block_plan(sp))  # TP 4: split across tp
        last = i == len(model.blocks) - 1  # the backward starts with it: kept whole
        fully_shard(block, mesh=mesh, mp_policy=run.policy,
                    reshard_after_forward=reshard and not last)  # its parameters become shards
    if run.args.tp > 1:  # TP 4: the ends of the model, split by vocabulary
        parallelize_module(model, run.mesh["tp"], ends_plan(sp))  # the embedding and head
        # The plans made two parameters; both split the vocabulary (dim 0).
        model.head.weight = model.tok_emb.weight  # TP 4: one matrix again
    fully_shard(model, mesh=mesh, mp_policy=run.policy)  # the root: whole until its backward


def block_plan(sp):
    """Megatron-LM's split of a block, as the tables at the top show. attn.qkv orders its outputs
    head by head: nanoGPT's q|k|v order would give a rank rows of q, k or v instead of whole heads,
    and train, with no error, a model unlike one process's. With sp, attn and mlp take their input
    whole (PrepareModuleInput): attention needs every position, column-wise layers a whole input."""
    if not sp:
        return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),  # TP 4
                "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    whole = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"ln1": SequenceParallel(), "attn": whole, "attn.qkv": ColwiseParallel(),  # TP 4
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),  # reduce-scattered
            "ln2": SequenceParallel(), "mlp": whole, "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(output_layouts=Shard(1))}


def ends_plan(sp):
    """The tied embedding and head split by vocabulary. A rank's embedding looks up only its tokens
    (zeros for the rest), and a reduction adds the lookups up: an all-reduce, or with sp a
    reduce-scatter by position. The head's logits stay split, a DTensor, for loss parallel. With
    sp, pos_emb's output is sliced alike: no collective in forward, an all-gather in backward."""
    stream = Shard(1) if sp else Replicate()  # activations (B, T, C): by sequence, or whole
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),  # TP 4
            "head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1),
                                    use_local_output=False)}  # the logits: split by vocabulary
    if sp:
        plan["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(),
                                              desired_output_layouts=Shard(0))  # (T, C): its part
        plan["ln_f"] = SequenceParallel()
    return plan


@torch.no_grad()
def init_shards(model, seed):  # FSDP 2: one whole parameter at a time, each rank keeps its slice
    """Fill this rank's shards with one process's initial weights: each parameter whole from the
    seed, one at a time; each rank keeps its slice, sending nothing (src_data_rank=None)."""
    for name, p in model.named_parameters():
        full = initial_value(name, p.shape, seed, len(model.blocks)).to(p.device)
        p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None))  # no send


def dropout_stream(run):
    """This rank's offset to the dropout seed. Without sequence parallelism a tp group's ranks hold
    the same activations and must draw the same masks, or their copies drift apart. With it, each
    rank holds its own part of the sequence and seeds by rank, or every part would get the same
    mask."""
    return run.rank if run.args.sequence_parallel == "on" else run.dp_rank  # TP 2: which seed


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
    try:
        dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)  # every rank
    except (Exception, CheckpointException) as err:  # raised on every rank: DCP gathers them
        raise InputError(f"cannot load the shards of {path}: {first_reason(err)}") from None
    set_state_dict(raw_model, optimizer, model_state_dict=model_state,  # into my shards
                   optim_state_dict=optim_state)
    if not shards_finite(raw_model):  # a collective: every rank gets the same answer
        raise InputError(f"{path} holds weights that are not finite: use an earlier checkpoint")
    # TP 5: the saved random states fit dropout_stream's rule only at the layout that saved them
    saved = state["args"]
    if (saved.get("tp"), saved.get("sequence_parallel"), len(state["rng"])) == (
            run.args.tp, run.args.sequence_parallel, run.world_size):  # else the seeds stay
        restore_rng(state["rng"][run.rank], run.device)  # FSDP 3: this rank's streams


def shards_finite(model):  # FSDP 3: checked before every save
    """A collective: True on every rank if every rank's shards are free of NaN and infinity."""
    mine = all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())
    flag = torch.tensor([float(mine)], device=next(model.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # 0 if any rank's shards are not finite
    return bool(flag.item())


def wrap_model(run, raw_model):  # FSDP 4: no wrapper: the sharded model trains itself
    """The model that trains: the sharded raw_model, compiled with --compile. Two handles to one
    set of weights: `model` is `raw_model` itself here, --compile compiles its blocks in place."""
    if run.args.compile:  # TP 4: block by block, as torchtitan does, since torch 2.14 cannot
        for block in raw_model.blocks:  # compile the vocabulary-split embedding (pytorch#160697)
            block.compile(backend=run.args.compile_backend)
    return raw_model


def evaluate(run, model, val):  # FSDP 5: every rank runs as many forwards
    """The mean validation loss per token, each window once; a collective. Each forward
    runs collectives in dp and tp groups, so a rank with fewer batches pads with -100 targets."""
    batches = list(validation_batches(run, val))  # DDP 4: disjoint slices
    most = torch.tensor(len(batches), device=run.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the most batches any rank holds
    x = torch.zeros(1, run.args.block_size, dtype=torch.long, device=run.device)
    batches += [(x, torch.full_like(x, -100))] * (int(most) - len(batches))
    return mean_loss_over_ranks(model, batches)  # a collective: every rank's sums and counts


def validation_batches(run, val):
    """This rank's validation batches, (inputs, targets) on its device: the first --eval-windows
    windows, dealt to the ranks in turn and never padded with repeats, so each counts once."""
    args = run.args
    starts = np.arange(0, len(val) - args.block_size, args.block_size + 1)[:args.eval_windows]
    mine = starts[run.dp_rank::run.dp_size]  # TP 2: by dp rank, so a tp group's ranks read alike
    for i in range(0, len(mine), args.batch_size):
        rows = val[mine[i:i + args.batch_size, None] + np.arange(args.block_size + 1)]
        yield on_device(torch.from_numpy(rows.astype(np.int64)), run.device)


@torch.no_grad()
def mean_loss_over_ranks(model, batches):  # FSDP 1: no autocast; DDP 9: sum, divide once
    """A collective: the mean cross-entropy per target over all ranks' batches (inputs, targets).
    Each rank sums its own losses and counts them; one all-reduce adds those up over the ranks."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for x, y in batches:
        logits, _ = model(x)  # FSDP 1: no autocast; the policy casts
        with loss_parallel():  # TP 6: from the logits split by vocabulary
            loss = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten(), reduction="sum")
        totals[0] += local(loss)  # TP 6: the whole sum, on every rank of the tp group
        totals[1] += (y != -100).sum()  # FSDP 5: the padding counts no token
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # TP 2: each total tp times; same ratio
    free_gathered_weights(model)  # FSDP 5: forwards without a backward leave weights gathered
    model.train()
    return (totals[0] / totals[1]).item()


def train_step(run, model, optimizer, windows, step):
    """One optimizer step over --grad-accum micro-batches; a collective. Returns the loss (mean
    over all ranks) and the gradient norm before clipping, both device tensors."""
    args = run.args
    batches = [on_device(windows.rows(step * args.grad_accum + i), run.device)
               for i in range(args.grad_accum)]
    loss = accumulate_gradients(model, batches, args.grad_sync == "every")  # FSDP 1, 7
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args)
    grad_norm = clip_gradients(model, args.clip or float("inf"))  # TP 7: over both meshes
    loss = mean_over_ranks(loss)  # DDP 9: the same mean on every rank, so all stop or none
    stop_if_diverged(run, step, loss, grad_norm)
    optimizer.step()  # FSDP 1: no scaler; each rank steps its shards
    optimizer.zero_grad(set_to_none=True)
    if args.check_sync:  # TP 8: debugging: compare a tp group's copies after every step
        check_replicas_in_sync(run, model, f"step {step + 1}")  # a collective in each tp group
    return loss, grad_norm


def accumulate_gradients(model, batches, every=True):  # FSDP 7: stay sharded, or not
    """Forward and backward over each micro-batch (inputs, targets); returns their mean loss. every:
    each backward reduce-scatters a unit's gradients into the shards, which add up there, so no
    rank holds a whole gradient past its unit's backward; else (--grad-sync last)
    whole gradients add up on every rank and the last backward reduce-scatters them once."""
    total = 0.0
    for i, (x, y) in enumerate(batches):
        model.set_requires_gradient_sync(every or i == len(batches) - 1)  # FSDP 7: when to reduce
        with loss_parallel():  # TP 6: the loss and its backward from logits split by vocabulary
            _, loss = model(x, y)
            # Every micro-batch has as many targets, none masked, so the mean of their means is
            # the mean over all targets. With masked targets, divide the sum by the global count.
            loss = loss / len(batches)
            loss.backward()  # TP's collectives, and FSDP's reduce-scatter when sync is on
        total += local(loss.detach())  # TP 6: a plain tensor, the same across the tp group
    return total


def local(loss):  # loss_parallel's loss is a DTensor, whole on every rank of the tp group
    return loss.to_local() if isinstance(loss, DTensor) else loss  # TP 6: as a plain tensor


def clip_gradients(model, max_norm):
    """clip_grad_norm_ for parameters on two meshes, (dp, tp) and "dp" alone, whose norms it cannot
    combine. It takes each mesh's gradient norm over all its ranks, then the norm of those two.
    Returns the norm before clipping, the same on every rank."""
    on_mesh = {}
    for p in model.parameters():
        on_mesh.setdefault(p.device_mesh, []).append(p)
    norms = [nn.utils.get_total_norm([p.grad for p in ps]).full_tensor()  # TP 7: a collective
             for ps in on_mesh.values()]
    norm = torch.linalg.vector_norm(torch.stack(norms))
    for ps in on_mesh.values():
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
def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v over earlier positions, by PyTorch's fused kernel (flash attention
    on GPUs). No dropout on the attention weights: on a CPU it forces the slow path. A CPU runs it
    in fp32 even in a bf16 run, since the bf16 CPU backward measured 3x slower than fp32."""
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.autocast("cpu", enabled=False):  # fp32 even under a caller's autocast
        y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    return y.to(q.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        # qkv's outputs hold each head's q, k and v side by side.
        # The -1 counts the heads this rank holds, n_head / tp.
        qkv = self.qkv(x).view(B, T, -1, 3, C // self.n_head)
        q, k, v = qkv.permute(3, 0, 2, 1, 4)  # each (B, heads, T, head size)
        y = causal_attention(q, k, v)
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

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
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


# -------------------------------------------- beyond the core: debugging, the benchmark, the report
def log_windows(run, windows):
    """A collective: rank 0 prints each rank's windows, in rank order, so lines never splice."""
    line = (f"[rank {run.rank}] {windows.per_epoch} micro-batches per epoch, "
            f"first windows at tokens {windows.starts_of_epoch(0)[:4].tolist()}")
    lines = [None] * run.world_size
    dist.all_gather_object(lines, line)  # DDP 14: every rank gets all lines; rank 0 prints
    print0(run.is_main, "\n".join(lines))


def benchmark(run, model, optimizer, windows):
    """--benchmark: 5 warm-up steps, then --max-steps timed ones; median ms/step and tokens/s."""
    times = []
    for step in range(5 + run.args.max_steps):
        start = time.perf_counter()
        loss, _ = train_step(run, model, optimizer, windows, step)  # a collective
        loss.item()  # wait for the device: the step is over
        times.append(time.perf_counter() - start)
    result = {**pace_keys(statistics.median(times[5:]), tokens_per_step(run)),
              "timed_steps": run.args.max_steps}
    log_peak_gpu_memory(run)  # a collective on GPUs: every rank's peak
    print0(run.is_main, f"benchmark | {result['step_ms']} ms/step | "
                        f"{result['throughput']:,.0f} tok/s")
    print0(run.is_main, summary_line(result))


def check_replicas_in_sync(run, model, when):
    """A collective in each tp group: raise OutOfSync (exit code 3) if its ranks' copies of what TP
    does not split differ, by a hash of their FSDP shards of it. Only such a group raises; the other
    ranks wait in their next collective until torchrun ends the job (or --dist-timeout does)."""
    tp = run.mesh["tp"]

    def copied(p):  # whole on each tp rank: the position embedding, norms, row-wise biases
        names = p.device_mesh.mesh_dim_names or ()
        return "tp" not in names or p.placements[names.index("tp")].is_replicate()
    weights = b"".join(p.to_local().detach().cpu().numpy().tobytes()
                       for p in model.parameters() if copied(p))
    digests = [None] * tp.size()
    dist.all_gather_object(digests, hashlib.sha256(weights).hexdigest()[:12],  # TP 8: a collective
                           group=tp.get_group())  # in this tp group only
    if len(set(digests)) > 1:  # every rank of the tp group sees the same digests: all of them stop
        raise OutOfSync(f"--check-sync: the tp group of rank {run.rank} holds copies that differ "
                        f"after {when}: {digests}")


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
        first, args = torch.tensor([[start]], device=run.device), run.args
        torch.manual_seed(args.seed + run.dp_rank)  # TP 2: a tp group's ranks draw alike
        out = generate_in_row(raw_model, first, args)  # TP 6: every rank: tp's and dp's collectives
        print0(run.is_main, "sample:\n" + decode(out[0].tolist(), data.itos))  # FSDP 5: rank 0's


@torch.no_grad()
def generate_in_row(model, idx, args):
    """GPT.generate for logits split by vocabulary; a collective in each tp group, whose ranks all
    draw the same tokens. Each forward reads a whole context, padded on the right, since sequence
    parallelism splits it in tp equal parts; attention is causal, so no position reads the padding
    after it. The ranks' parts of the last position's logits are gathered for the draw."""
    for _ in range(args.max_new_tokens):
        window = idx[:, -model.block_size:]
        logits, _ = model(F.pad(window, (0, model.block_size - window.shape[1])))  # a collective
        logits = logits[:, window.shape[1] - 1] / args.temperature  # the last token's
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()  # TP 6: gathered from the tp group, a collective
        if args.top_k:
            kth = torch.topk(logits, min(args.top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1)], dim=1)
    return idx


def export(run, raw_model, data):  # FSDP 8: one plain file, as one process saves it
    """A collective: every rank's shards to rank 0's CPU, which writes one plain state_dict."""
    if not shards_finite(raw_model):  # a collective: every rank gets the same answer
        raise SaveFailed(f"not exporting {run.args.export}: the weights are not finite")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to rank 0
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")  # TP 4: DTensor
    level = redistribute.level  # it warns that a matrix split over both dims is gathered by two
    redistribute.setLevel(logging.ERROR)  # all-gathers, one per dim; true, and silenced here
    try:
        weights = get_model_state_dict(raw_model, options=options)  # empty on the other ranks
    finally:
        redistribute.setLevel(level)
    save_on_rank_0(lambda: write_export(run, weights, data), run.is_main)  # a collective


def log_peak_gpu_memory(run):
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
    refuse_a_bad_launch(args.device)  # guard: no torchrun, or more processes than GPUs
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    backend = "nccl" if cuda else "gloo"
    level = safe_debug_level(backend, args.debug, dist.get_debug_level())  # guard: DETAIL on gloo
    dist.set_debug_level(level)  # before init_process_group, which reads it
    if not cuda:
        avoid_page_faults_on_cpu()  # guard: page faults every step on Linux CPUs
    logging.getLogger().addFilter(avoid_dcp_tracebacks)  # FSDP 3: DCP's logged tracebacks
    node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))  # TP 1: per node
    warning = avoid_tp_across_nodes(args.tp, node)  # guard: TP 1
    if warning and os.environ["RANK"] == "0":
        print(warning, flush=True)


def avoid_tp_across_nodes(tp, per_node):  # guard: a tp group whose collectives cross nodes
    """A warning if a tp group (tp consecutive ranks) may span nodes of per_node processes each."""
    if per_node % tp:
        return (f"warning: --tp {tp} with {per_node} processes per node: a tp group spans nodes, "
                "and its collectives of every block and micro-batch cross the network")


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
    a("--compile", action="store_true", help="torch.compile the model (default: off)")
    a("--compile-backend", default="inductor",
      choices=("inductor", "aot_eager", "eager", "cudagraphs"),
      help="torch.compile backend (default: inductor)")
    a = p.add_argument_group("training").add_argument
    a("--batch-size", type=positive(int), default=16, metavar="B",
      help="sequences per micro-step, per tp group (default: 16)")  # TP 2: not per rank
    a("--grad-accum", type=positive(int), default=1, metavar="K",
      help="micro-batches per optimizer step (default: 1)")
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
    a("--tp", type=positive(int), default=2, metavar="N",  # TP 1
      help="ranks per tp group, which splits every layer: consecutive ranks, one node's GPUs; "
           "must divide the world size and --n-head; 1: FSDP alone (default: 2)")
    a("--grad-sync", choices=["every", "last"], default="every",  # FSDP 7
      help="with --grad-accum: every: reduce-scatter each micro-batch's gradients, they stay "
           "sharded; last: keep them whole and reduce-scatter once (default: every)")
    a("--reshard-after-forward", choices=["yes", "no"], default="yes",  # FSDP 2
      help="yes: free each block's gathered weights (but the last's) after its forward; "
           "no: keep them "
           "until its backward (fewer all-gathers, more memory) (default: yes)")
    a("--sequence-parallel", choices=["on", "off"], default="on",  # TP 4
      help="split the activations of the norms and dropout by sequence position across the tp "
           "group (default: on)")
    a("--check-sync", action="store_true",  # TP 8
      help="after every step, compare by hash the copies that a tp group's ranks hold of what "
           "TP does not split; copies that differ stop the run (exit code 3)")
    a("--debug", action="store_true", help="TORCH_DISTRIBUTED_DEBUG and each rank's data windows")
    a = p.add_argument_group("evaluation, logging, checkpoints").add_argument
    a("--eval-every", type=positive(int), default=100, metavar="N",
      help="steps between evaluations (default: 100)")
    a("--eval-windows", type=positive(int), default=128, metavar="N",
      help="validation sequences per evaluation (default: 128)")
    a("--log-every", type=positive(int), default=10, metavar="N",
      help="steps between log lines (default: 10)")
    a("--save", default="checkpoints/minigpt_tp", metavar="DIR",  # TP 5: this trainer's own folder
      help="a folder of step-N folders, new or resumed from; '' for none (default: %(default)s)")
    a("--export", default="checkpoints/minigpt_tp.pt", metavar="PATH",  # TP 5: its own file too
      help="the final weights in one file that --sample reads, '' for none (default: %(default)s)")
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
    if args.n_head % args.tp:  # TP 1: every tp rank holds whole heads
        p.error(f"--tp {args.tp} must divide --n-head {args.n_head}: each rank holds whole heads")
    if args.sequence_parallel == "on" and args.block_size % args.tp:  # TP 4: tp equal parts
        p.error(f"--sequence-parallel on splits the context in --tp parts: --tp {args.tp} must "
                f"divide --block-size {args.block_size} (or give --sequence-parallel off)")
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


def free_gathered_weights(model):  # FSDP 5: a forward alone leaves the root and last block whole
    """Reshard every FSDP module of the model: the weights a forward without a backward (evaluation,
    sampling) gathered are freed, and the parameters are this rank's shards again."""
    for module in model.modules():
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


def memory_line(model):  # FSDP 2: what each rank holds, against a whole copy
    """Bytes of weights + gradients + AdamW's two moments (fp32: 4 copies) held by this rank."""
    mine = sum(p.to_local().numel() for p in model.parameters())
    full = sum(p.numel() for p in model.parameters())
    where = next(model.parameters()).device.type
    return (f"memory per rank ({where}): weights, gradients and AdamW state "
            f"{16 * mine / 2**20:.2f} MiB "
            f"({mine:,} of {full:,} parameters; DDP: {16 * full / 2**20:.2f} MiB)")  # TP 3


def traffic_line(run):
    """The log line of TP's collectives on the activations (B, T, C), in the compute dtype, per
    rank and optimizer step. Each block runs 2 all-reduces per
    micro-batch in forward and 2 in backward. With sequence parallelism each all-reduce is an
    all-gather and a reduce-scatter, its two halves, each sending (tp - 1) / tp of the tensor. The
    embedding and head add 2 per micro-batch. With --grad-checkpointing, backward runs each block's
    forward again as far as it needs: through the attention's reduction, and through the MLP's too
    if dropout's mask after it is drawn again. That is 1 or 2 all-reduces more per block and
    micro-batch, or with sequence parallelism 2 all-gathers and 1 or 2 reduce-scatters. FSDP's
    gathers of the weights and reduce-scatters of the gradients come on top, not counted here."""
    args, tp = run.args, run.args.tp
    if tp == 1:
        return "TP traffic per rank: none (--tp 1: FSDP alone)"
    width = 2 if run.amp in ("bfloat16", "float16") else 4
    tensor = args.batch_size * args.block_size * args.n_embd * width
    again = args.n_layer * args.grad_accum if args.grad_checkpointing else 0  # recomputed
    reduced = again * (2 if args.dropout else 1)  # forwards, and the reductions they run again
    each = (4 * args.n_layer + 2) * args.grad_accum  # TP 3: per step, either way
    if args.sequence_parallel == "on":
        gathers, scatters = each + 2 * again, each + reduced
        what, halves = f"{gathers} all-gathers and {scatters} reduce-scatters", gathers + scatters
    else:
        what, halves = f"{each + reduced} all-reduces", 2 * (each + reduced)
    sent = halves * tensor * (tp - 1) / tp
    return (f"TP traffic per rank: {what} of {tensor / 2**20:.2f} MiB per step, "
            f"{sent / 2**20:.2f} MiB sent (tp {tp}, sequence parallel {args.sequence_parallel})")


def accumulation_line(model, args):  # FSDP 2: the gradients held, and reduce-scattered
    """What a rank holds of the gradients between micro-batches, and the reduce-scatters a step
    makes (each takes a unit's whole fp32 gradient in and gives back its shard)."""
    # A rank's whole gradient is its tp part (FSDP gathers over dp alone): 1/tp of a split one.
    split = [p.device_mesh.ndim == 2 and p.placements[1].is_shard() for p in model.parameters()]
    whole = 4 * sum(p.numel() // (args.tp if s else 1)  # TP 3: fp32, TP's part
                    for p, s in zip(model.parameters(), split)) / 2**20
    if args.grad_sync == "every":
        return (f"--grad-sync every: gradients stay sharded between micro-batches; the {whole:.2f} "
                f"MiB of them reduce-scattered {args.grad_accum} times per step, unit by unit")
    return (f"--grad-sync last: every rank holds the whole gradients, {whole:.2f} MiB, from the "
            f"first micro-batch to the last; reduce-scattered once per step")


# --------------------------------------------------------------------------- logging and timing
def print0(is_main, message):
    """Print a log line if this process is the one that logs; flush, so it shows at once."""
    if is_main:
        print(message, flush=True)


def tokens_per_step(run):
    return run.args.batch_size * run.args.block_size * run.args.grad_accum * run.dp_size  # TP 2


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
    n = sum(p.numel() for p in raw_model.parameters()) - raw_model.pos_emb.weight.numel()
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


class OutOfSync(Stop):  # TP 8
    """--check-sync found a tp group whose ranks hold different copies of an unsplit parameter."""
    code = 3


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
