"""Chapter 3: a GPT language model trained under DDP, with what a real trainer needs: mixed
precision, gradient accumulation with no_sync, clipping, a warmup + cosine schedule, evaluation
across ranks, resumable checkpoints, and sampling.

    torchrun --standalone --nproc_per_node=1 train_ddp_minigpt.py    # 1 process: CPU or 1 GPU
    torchrun --standalone --nproc_per_node=2 train_ddp_minigpt.py    # 2 processes: CPU or 2 GPUs
    torchrun --standalone --nproc_per_node=gpu train_ddp_minigpt.py  # one process per GPU here
    ./launch_multinode_ddp.sh --nnodes 2 --nproc-per-node 8 --master-addr NODE0 train_ddp_minigpt.py
    python train_ddp_minigpt.py --sample --ckpt checkpoints/minigpt.pt --prompt "def main("

The multi-node line prints the torchrun command for each node; sampling runs in one process. The
default data, this Python's standard library (2,000,000 bytes, a token per byte, vocab 256), needs
no download; `--data` also takes a text file, a .bin of uint16 token ids, or a nanoGPT folder.

Terms. torchrun starts the processes, usually one per device; each runs this whole file. The
world size is the number of processes; a process's rank is its number, from 0 to world size - 1,
and its LOCAL_RANK its number on its own machine, which picks its GPU. The process group lets the
processes communicate; its backend moves the data (NCCL between GPUs, gloo on CPUs). A collective
is a call that every rank makes, in the same order, to exchange data; a rank that reaches it
waits there for the others. An all-reduce is the collective that adds a tensor up over all ranks
and gives every rank the sum; a broadcast sends one rank's data to every rank; an all-gather
gives every rank what each rank sent. Under DDP each rank holds a replica, a whole copy of the
model, and trains it on data of its own. A window is block_size + 1 consecutive tokens, the
inputs and targets of one sequence. A micro-batch is --batch-size windows through one forward and
backward; an optimizer step runs --grad-accum of them on every rank.

Read it top-down: main(), then its core steps in the order it calls them, the model, and the steps
beyond the core (debugging, the benchmark, the report). Every call that communicates with other
ranks sits above the line that ends `the plumbing`. Below it, no line communicates with another
rank: guards, flags, data, files, logging, sampling, errors.

Tags. `# DDP k` marks each line DDP adds to a one-process trainer, numbered in reading order:
  DDP 1   init_process_group joins the processes torchrun started; every collective needs it
  DDP 2   each process picks its GPU by LOCAL_RANK, before any CUDA work, so not all use GPU 0
  DDP 3   only rank 0 logs and writes files
  DDP 4   each rank reads its own windows, in training and evaluation; no two ranks read one
  DDP 5   every rank shuffles the windows in the same order, a new order each epoch
  DDP 6   dropout is seeded by rank, so the replicas draw different masks
  DDP 7   rank 0 looks for the checkpoint to resume; every rank loads it, or all stop
  DDP 8   DDP(model) copies rank 0's weights to every rank and averages gradients in backward()
  DDP 9   sums are all-reduced, then divided (gloo has no average); evaluation runs model.module
  DDP 10  no_sync() holds the gradient all-reduce back until a step's last micro-batch
  DDP 11  the checkpoint keeps every rank's random-number state
  DDP 12  rank 0 writes the checkpoint; every rank waits and learns whether it worked
  DDP 13  every process leaves the group on every path, error or not
  DDP 14  --debug: rank 0 prints which windows each rank reads
  DDP 15  --check-sync: the ranks compare hashes of their weights and stop if they differ
  DDP 16  rank 0 prints every rank's peak GPU memory
Lines tagged `# guard:` each avoid one known failure, all before the process group is joined.
See also docs/ddp_in_your_trainer.md (these cores, ready to copy) and docs/conventions.md.
"""
import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import errno
import gc
import glob
import hashlib
import json
import math
import os
import pickle
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint


# ------------------- the distributed lesson: main(), then its core steps in the order it calls them
def main(argv=None):
    args = parse_args(argv)
    if args.sample:  # sampling runs in one plain process, with no process group
        return sample(args)
    avoid_known_failures(args)  # guard: refuses a bad launch, avoids known failures
    # Setup: one process per device, one group. Every rank calls the collectives in the same order.
    device, rank, world_size = init_distributed(args.device, args.dist_timeout)  # DDP 1: join
    run = make_run(args, device, rank, world_size)
    # Data: each replica reads its own windows of the training tokens.
    data = build_data(run)  # a collective with --debug: rank 0 prints every rank's windows
    # Model: every rank builds the same weights, resumes them if asked, then wraps them in DDP.
    raw_model, optimizer = build_model(run, data.vocab_size)
    # Resuming comes before the wrap, so the weights DDP copies from rank 0 are the resumed ones.
    start = resumed_step(run, raw_model, optimizer, data)  # a collective: one agreed start step
    model = wrap_model(run, raw_model)  # a collective: DDP copies rank 0's weights to every rank
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
            if args.check_sync or args.debug:  # before this step's save, if it has one
                check_replicas_in_sync(model, f"step {done}")  # a collective: every rank's hash
        # Save: rank 0 writes the file, and every rank waits to learn whether that worked.
        due = done == args.max_steps or (args.save_every and done % args.save_every == 0)
        if args.save and due:
            save_checkpoint(run, raw_model, optimizer, data, done)  # a collective
        meter.start_clock()
    # Cleanup: the summary and a sample. __main__'s `finally` leaves the process group.
    report(run, raw_model, data, val_loss, meter)  # a collective on GPUs: every rank's peak memory


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
    amp: str  # the autocast dtype's name ("bfloat16", "float16"), or "off"
    autocast: torch.autocast  # the context in which the forward's matrix products use that dtype
    scaler: torch.amp.GradScaler  # loss scaling for fp16; a no-op for bf16 and fp32


def make_run(args, device, rank, world_size):
    """This process's Run; logs the run's shape (world size, device, precision, batch)."""
    is_main = rank == 0  # DDP 3: only rank 0 logs and writes files
    amp, autocast, scaler = mixed_precision(args.amp, device)
    run = Run(args, device, rank, world_size, is_main, amp, autocast, scaler)
    print0(is_main, f"world size {world_size} | device {device} | amp {amp} | "
                    f"{tokens_per_step(run):,} tokens per step ({args.batch_size} x "
                    f"{args.block_size} x {args.grad_accum} accumulation x {world_size} processes)")
    return run


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
    train, val, vocab_size, itos = load_data(args, run.world_size)
    windows = Windows(train, args.block_size, args.batch_size, run.rank, run.world_size,
                      args.seed)  # DDP 4: this rank reads only its own windows
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


def build_model(run, vocab_size):
    """The plain model on this rank's device, and its optimizer."""
    args = run.args
    config = model_config(args, vocab_size)
    raw_model = GPT(**config).to(run.device)
    raw_model.init_weights(args.seed)  # same on every rank, so runs at any world size start alike
    raw_model.grad_checkpointing = args.grad_checkpointing
    optimizer = make_optimizer(raw_model, args, run.device)
    torch.manual_seed(args.seed + run.rank)  # DDP 6: each rank draws its own dropout masks
    print0(run.is_main, f"model {sum(p.numel() for p in raw_model.parameters()):,} parameters | "
                        f"{args.n_layer} layers, {args.n_head} heads, {args.n_embd} wide, "
                        f"context {args.block_size}")
    return raw_model, optimizer


def resumed_step(run, raw_model, optimizer, data):
    """A collective: the step to go on from, 0 or --resume's; every rank loads it, or all stop."""
    path, step, problem = resume_path(run), None, None  # a collective: rank 0 looks for it
    try:
        step = load_checkpoint(path, run, raw_model, optimizer, data) if path else 0
    except InputError as err:  # told to every rank below, so that none waits for this one
        problem = str(err)
    step = agree_on_start(step, problem, path)  # a collective: one step on every rank, or a stop
    if path:
        print0(run.is_main, f"resumed from {path} at step {step}")
    return step


def resume_path(run):
    """The checkpoint to resume from, or None. `auto` (a collective) takes --save if rank 0 finds
    it, so a restart after a crash reruns the same command; ranks looking alone could disagree."""
    resume, save = run.args.resume, run.args.save
    if resume != "auto":
        return resume
    if not save:
        raise InputError("--resume auto needs a --save path to look for")
    found = [os.path.isfile(save)]
    dist.broadcast_object_list(found, src=0)  # DDP 7: rank 0 decides for every rank
    return save if found[0] else None


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


def wrap_model(run, raw_model):
    """A collective: DDP(raw_model), compiled first with --compile. `raw_model`, `model` and
    `model.module` are one set of weights, because DDP wraps the model without copying it."""
    compiled = raw_model
    if run.args.compile:  # compiled first, so DDP's communication hooks stay outside the graph
        compiled = torch.compile(raw_model, backend=run.args.compile_backend)
    # The wrap copies rank 0's weights to every rank; they already match, so nothing changes.
    return DDP(compiled, device_ids=[run.device] if run.device.type == "cuda" else None)  # DDP 8


def evaluate(run, model, val):
    """The mean validation loss per token, each window once; a collective. It runs the
    plain model.module, whose forward runs no collective, so ranks may run unequal batch counts."""
    batches = validation_batches(run, val)  # DDP 4: this rank's windows, none repeated
    return mean_loss_over_ranks(model.module, batches, run.autocast)  # DDP 9: the plain model


def validation_batches(run, val):
    """This rank's validation batches, (inputs, targets) on its device: the first --eval-windows
    windows, dealt to the ranks in turn and never padded with repeats, so each counts once."""
    args = run.args
    starts = np.arange(0, len(val) - args.block_size, args.block_size + 1)[:args.eval_windows]
    mine = starts[run.rank::run.world_size]
    for i in range(0, len(mine), args.batch_size):
        rows = val[mine[i:i + args.batch_size, None] + np.arange(args.block_size + 1)]
        yield on_device(torch.from_numpy(rows.astype(np.int64)), run.device)


@torch.no_grad()
def mean_loss_over_ranks(model, batches, autocast):
    """A collective: the mean cross-entropy per target over all ranks' batches (inputs, targets).
    Each rank sums its own losses and counts them; one all-reduce adds those up over the ranks."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for x, y in batches:
        with autocast:
            logits, _ = model(x)
        totals[0] += F.cross_entropy(logits.flatten(0, -2).float(), y.flatten(), reduction="sum")
        totals[1] += y.numel()
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # DDP 9: all ranks' sums, divided below
    model.train()
    return (totals[0] / totals[1]).item()


def train_step(run, model, optimizer, windows, step):
    """One optimizer step over --grad-accum micro-batches; a collective. Returns the loss (mean
    over all ranks) and the gradient norm before clipping, both device tensors."""
    args = run.args
    batches = [on_device(windows.rows(step * args.grad_accum + i), run.device)
               for i in range(args.grad_accum)]
    loss = accumulate_gradients(model, batches, run.autocast, run.scaler)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args)
    run.scaler.unscale_(optimizer)  # fp16: true gradients before clipping (no-op otherwise)
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip or float("inf"))
    loss = mean_over_ranks(loss)  # DDP 9: the same mean on every rank, so all stop or none
    stop_if_diverged(run, step, loss, grad_norm)
    run.scaler.step(optimizer)
    run.scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def accumulate_gradients(model, batches, autocast, scaler):
    """Forward and backward over each micro-batch (inputs, targets); returns the mean loss. The
    forward runs inside no_sync() too, since DDP decides in forward whether backward all-reduces."""
    total = 0.0
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1  # DDP 10: no_sync() below for all but the last micro-batch
        with contextlib.nullcontext() if last else model.no_sync():
            with autocast:
                _, loss = model(x, y)
            # Every micro-batch has as many targets, none masked, so the mean of their means is
            # the mean over all targets. With masked targets, divide the sum by the global count.
            loss = loss / len(batches)
            # The last backward averages the gradients over the ranks; every rank holds the mean.
            scaler.scale(loss).backward()
        total += loss.detach()
    return total


def mean_over_ranks(value):
    """A collective: the mean of a scalar tensor over all ranks, summed then divided."""
    value = value.detach().clone().float()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # DDP 9: every rank gets the sum of all ranks'
    return value / dist.get_world_size()


def save_checkpoint(run, raw_model, optimizer, data, step):
    """A collective: rank 0 writes --save with every rank's RNG state; all learn if it worked."""
    rng_states = [None] * run.world_size  # DDP 11: each rank's RNG draws its own dropout masks
    dist.all_gather_object(rng_states, rng_state(run.device))  # so rank 0 can save them all

    def write():
        state = checkpoint_state(run, raw_model, optimizer, data, step, rng_states)
        write_file(run.args.save, state)
        print(f"step {step}/{run.args.max_steps} | saved {run.args.save}", flush=True)
    save_on_rank_0(write, run.is_main)  # a collective: rank 0 writes; all ranks learn the outcome


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
        # The -1 counts the heads (n_head).
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


def check_replicas_in_sync(model, when):
    """A collective: raise OutOfSync (exit code 3) if the replicas' weights differ (by a hash)."""
    weights = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, hashlib.sha256(weights).hexdigest()[:12])  # every rank's
    if len(set(digests)) > 1:  # DDP 15: every rank sees the same hashes, so all of them stop
        raise OutOfSync(f"--check-sync: replicas differ after {when}: {digests}")


def report(run, raw_model, data, val_loss, meter):
    """Every rank's GPU peak (a collective on GPUs), then rank 0's done line, summary, sample."""
    log_peak_gpu_memory(run)  # a collective on GPUs: every rank's peak
    summary = {**meter.summary(), "val_loss": val_loss, "baseline_loss": data.baseline}
    unit = "byte" if data.vocab_size == 256 else "token"
    print0(run.is_main, f"done | val loss {val_loss:.4f} ({unit}-frequency baseline "
                        f"{data.baseline:.4f}) | {summary['tokens_per_s']:,.0f} tok/s over "
                        f"{summary['train_s']:.1f} s of training")
    print0(run.is_main, summary_line(summary))
    if run.is_main and (unit == "byte" or data.itos):  # text it can show: bytes, or a vocabulary
        raw_model.eval()
        start = 10 if unit == "byte" else min(data.itos)  # a newline, or the first piece
        first, args = torch.tensor([[start]], device=run.device), run.args
        out = raw_model.generate(first, args.max_new_tokens, args.temperature, args.top_k)
        print("sample:\n" + decode(out[0].tolist(), data.itos), flush=True)


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
    """Exit code 2 for a launch that could never join a group, or could never save; a workaround
    for each known fault."""
    refuse_a_bad_launch(args.device)  # guard: no torchrun, or more processes than GPUs
    refuse_an_unwritable_save(args)  # guard: a run that would train, then fail at its first save
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    backend = "nccl" if cuda else "gloo"
    level = safe_debug_level(backend, args.debug, dist.get_debug_level())  # guard: DETAIL on gloo
    dist.set_debug_level(level)  # before init_process_group, which reads it
    if not cuda:
        avoid_page_faults_on_cpu()  # guard: page faults every step on Linux CPUs
    if args.compile:
        avoid_ddp_graph_split_failure(args)  # guard: compile with --grad-checkpointing


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


def refuse_an_unwritable_save(args):  # guard: a --save that rank 0 could not write
    """InputError (exit code 2, one line) now, not after the training, if rank 0, the rank that
    saves, could not write --save. No group is joined yet, so torchrun's RANK says who saves."""
    saves = args.save and not args.benchmark and os.environ["RANK"] == "0"
    reason = why_unwritable(args.save) if saves else None
    if reason:
        raise InputError(f"--save {args.save} cannot be written: {reason}")


def safe_debug_level(backend, debug, level):  # guard: TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo
    """The debug level to run at, starting from the shell's. --debug asks for DETAIL on NCCL and
    INFO on gloo. DETAIL crashes DDP on gloo, so there it becomes INFO, with one warning."""
    if debug:
        level = dist.DebugLevel.DETAIL if backend == "nccl" else dist.DebugLevel.INFO
    if backend == "gloo" and level == dist.DebugLevel.DETAIL:  # the shell's
        if os.environ["RANK"] == "0":  # no group yet, so torchrun's RANK says who logs
            print("warning: TORCH_DISTRIBUTED_DEBUG=DETAIL crashes DDP on gloo "
                  "(docs/troubleshooting.md): going on at INFO", flush=True)
        level = dist.DebugLevel.INFO
    return level


def avoid_ddp_graph_split_failure(args):  # guard: --compile with --grad-checkpointing
    """Compiled DDP splits the graph at its buckets so that all-reduces overlap backward, but it
    cannot split checkpointed blocks (pytorch#104674). With both flags, compile one whole graph."""
    if args.grad_checkpointing:
        torch._dynamo.config.optimize_ddp = False


def avoid_page_faults_on_cpu():  # guard: glibc returning freed memory at once
    """On Linux CPUs (glibc), keep freed memory in the process. Otherwise glibc hands each step's
    tens of MB (the logits) back to the OS, and the page faults cost 10-30% of a step."""
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
      help="windows per micro-batch, on each rank (default: 16)")
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
      help="autocast dtype; auto: bf16 (or fp16) on GPUs, off on CPUs (default: auto)")
    a("--seed", type=int, default=0, help="seeds the weights, data order, dropout (default: 0)")
    a("--device", choices=["auto", "cpu", "cuda"], default="auto",
      help="auto = cuda if there is one, else cpu (default: auto)")
    a = p.add_argument_group("distributed: timeouts, debugging and the layout").add_argument
    a("--dist-timeout", type=positive(float, most=7 * 86400), default=300, metavar="S",
      help="seconds a collective waits for the other ranks before the job fails (default: 300)")
    a("--check-sync", action="store_true",
      help="at each evaluation, check that every replica's weights are identical (exit 3 if not)")
    a("--debug", action="store_true",
      help="TORCH_DISTRIBUTED_DEBUG, each rank's data windows, and --check-sync")
    a = p.add_argument_group("evaluation, logging, checkpoints").add_argument
    a("--eval-every", type=positive(int), default=100, metavar="N",
      help="steps between evaluations (default: 100)")
    a("--eval-windows", type=positive(int), default=128, metavar="N",
      help="validation sequences per evaluation (default: 128)")
    a("--log-every", type=positive(int), default=10, metavar="N",
      help="steps between log lines (default: 10)")
    a("--save", default="checkpoints/minigpt.pt", metavar="PATH",
      help="checkpoint written at the end, '' for none (default: %(default)s)")
    a("--save-every", type=positive(int, zero_ok=True), default=0, metavar="N",
      help="also save every N steps, 0 = only at the end (default: 0)")
    a("--resume", metavar="PATH",
      help="go on from this checkpoint; 'auto': from --save if it exists")
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
    """The autocast dtype, or None for fp32. bf16 has fp32's range, so it needs no loss scaling;
    fp16 needs a GradScaler. Only native bf16 counts: V100s and T4s emulate it, slower than fp16."""
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


def mixed_precision(choice, device):
    """(the dtype's name, an autocast context, a GradScaler): the scaler runs for fp16 only."""
    dtype = amp_dtype(choice, device)
    autocast = torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # bf16 needs none
    return str(dtype or "off").replace("torch.", ""), autocast, scaler


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
    finite. Both are the same on every rank, so every rank stops at this step. With
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


def checkpoint_state(run, raw_model, optimizer, data, step, rng_states):
    """Everything a run needs to go on exactly: weights, optimizer, scaler, step, model config,
    flags, vocabulary and every rank's random-number state."""
    weights = raw_model.state_dict()
    if not all_finite(weights):
        raise SaveFailed(f"not saving {run.args.save} at step {step}: the weights are not finite")
    return {"model": weights, "optimizer": optimizer.state_dict(),
            "scaler": run.scaler.state_dict(), "step": step,
            "config": model_config(run.args, data.vocab_size), "args": vars(run.args),
            "itos": data.itos, "rng": rng_states}


def write_file(path, state):
    """Write atomically: a temp file in the same folder, fsync, then rename over the final name.
    Any failure is SaveFailed and leaves the previous file as it was."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, never half
    except (OSError, RuntimeError) as err:  # disk full, no permission, a folder at `path`...
        needed = state_bytes(state)
        raise SaveFailed(f"cannot save {path}: {why_not_written(err, tmp, needed)}") from None
    finally:
        if os.path.exists(tmp):  # the write failed: drop the partial file
            os.remove(tmp)


def why_unwritable(path):
    """Why no checkpoint could be written at `path`, in the system's words, or None if one could.
    The test writes a file without a name (O_TMPFILE) in its folder: nothing is left behind."""
    if os.path.isdir(path):
        return os.strerror(errno.EISDIR)
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(folder):  # the save makes the folders that are missing
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return os.strerror(errno.ENOTDIR)
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:  # a read-only folder or file system, no permission
        return err.strerror
    return None


def rng_state(device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


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


def resume_problem(state):
    """What a checkpoint lacks of what a resume reads besides the model, in a few words, or None.
    A file only to sample from, with no optimizer state, or one edited by hand, stops here."""
    expected = {  # each key in the order checked: a test of its value, and what it should be
        "optimizer": (is_optimizer_state,
                      "an optimizer's state dict: a file only to sample from cannot be resumed"),
        "scaler": (lambda s: isinstance(s, dict), "a loss scaler's state dict"),
        "args": (lambda a: isinstance(a, dict) and type(a.get("max_steps")) is int,
                 "the flags of the run that saved it"),
        "step": (lambda n: type(n) is int and 0 <= n <= state["args"]["max_steps"],
                 "a step from 0 to the --max-steps of the run that saved it"),
        "rng": (lambda r: isinstance(r, list) and r and all(map(is_rng_state, r)),
                "every rank's random-number states")}
    for key, (fits, what) in expected.items():
        value = state.get(key)
        if not fits(value):  # a number or a text is shown, anything else named by its type
            shown = repr(value) if isinstance(value, (int, float, str)) else type(value).__name__
            return f"its {key} ({shown if key in state else 'none'}) is not {what}"
    return None


def is_optimizer_state(value):
    """True if `value` is what optimizer.state_dict() returns: its state and its groups' dicts."""
    if not isinstance(value, dict) or not isinstance(value.get("param_groups"), list):
        return False
    return "state" in value and all(isinstance(group, dict) for group in value["param_groups"])


def is_rng_state(rng):
    """True if `rng` is what a save writes: this CPU generator's state, of its size in bytes, and
    a GPU generator's state in bytes, or None."""
    def is_bytes(t):
        return torch.is_tensor(t) and t.dtype == torch.uint8 and t.dim() == 1
    if not isinstance(rng, dict) or not {"cpu", "cuda"} <= rng.keys():
        return False
    cpu, cuda = rng["cpu"], rng["cuda"]
    return is_bytes(cpu) and len(cpu) == len(torch.get_rng_state()) and (
        cuda is None or is_bytes(cuda))


def load_checkpoint(path, run, raw_model, optimizer, data):
    """Restore weights, optimizer, scaler and this rank's RNG from `path`; return its step."""
    state, config = read_checkpoint(path), model_config(run.args, data.vocab_size)
    problem = resume_problem(state)  # the keys a resume reads besides the model's
    if problem:
        raise InputError(f"cannot resume from {path}: {problem}")
    if state["config"] != config:
        raise InputError(f"{path} was trained with {state['config']}, this run builds {config}")
    fused = [group.get("fused") for group in optimizer.param_groups]
    # Keep this run's `fused`, not the saving run's: it decides where AdamW's step counts go.
    for group, ours in zip(state["optimizer"]["param_groups"], fused):
        group["fused"] = ours
    try:
        raw_model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if run.scaler.is_enabled() and state["scaler"]:  # fp16 goes on with the saved loss
            run.scaler.load_state_dict(state["scaler"])  # scale, if the checkpoint has one
        if run.rank < len(state["rng"]):  # the ranks it knows get their own RNG state back
            torch.set_rng_state(state["rng"][run.rank]["cpu"])
            if state["rng"][run.rank]["cuda"] is not None and run.device.type == "cuda":
                torch.cuda.set_rng_state(state["rng"][run.rank]["cuda"])
    except (KeyError, RuntimeError, TypeError, ValueError) as err:
        reason = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
        raise InputError(f"cannot resume from {path}: {reason}") from None
    return state["step"]


# --------------------------------------------------------------------------- logging and timing
def print0(is_main, message):
    """Print a log line if this process is the one that logs; flush, so it shows at once."""
    if is_main:
        print(message, flush=True)


def tokens_per_step(run):
    return run.args.batch_size * run.args.block_size * run.args.grad_accum * run.world_size


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


class OutOfSync(Stop):
    """--check-sync found replicas whose weights differ."""
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
