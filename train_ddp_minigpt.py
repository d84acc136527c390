"""Chapter 3: a GPT language model trained under DDP, with what a real trainer needs: mixed precision,
gradient accumulation with no_sync, clipping, a warmup + cosine schedule, evaluation across ranks,
resumable checkpoints, and sampling.

    python train_ddp_minigpt.py                                         # 1 process, no torchrun needed
    torchrun --standalone --nproc_per_node=2 train_ddp_minigpt.py       # 2 processes: CPU (gloo) or 2 GPUs
    torchrun --standalone --nproc_per_node=gpu train_ddp_minigpt.py     # one process per GPU of this machine
    # and on each of 2 nodes with 8 GPUs each (chapter 4):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=NODE0:29500 train_ddp_minigpt.py
    # inference runs in ONE plain process, no torchrun:
    python train_ddp_minigpt.py --sample --ckpt checkpoints/minigpt.pt --prompt "def main("

Default data: the first 2,000,000 bytes of this Python's own standard library (its top-level .py files in
sorted order), tokenized as bytes (vocab 256), so nothing is downloaded. `--data FILE` takes any text file,
or a nanoGPT-style .bin of uint16 token ids with `--vocab-size`. DDP-only lines carry `# DDP k/10` tags,
numbered as in chapter 2 (see README.md).
"""
import argparse
import contextlib
import ctypes
import datetime  # DDP 1/10
import glob
import hashlib  # DDP 9/10
import json
import math
import os
import statistics
import sys
import sysconfig
import time

import numpy as np
import torch
import torch.distributed as dist  # DDP 1/10
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP  # DDP 6/10
from torch.utils.checkpoint import checkpoint

DEFAULT_CORPUS_BYTES = 2_000_000


class InputError(Exception):
    """Bad input from the user: reported as one line and exit code 2, never a traceback."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, instead of argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(kind, zero_ok=False):
    """An argparse type: a number of `kind` (int or float) above zero, or at least zero if zero_ok."""
    def parse(text):
        value = kind(text)
        if value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {'at least 0' if zero_ok else 'positive'}, got {text}")
        return value
    parse.__name__ = f"positive {kind.__name__}"  # argparse names it in "invalid positive int value"
    return parse


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    a = p.add_argument_group("data").add_argument
    a("--data", metavar="FILE", help="text file (bytes are tokens) or .bin of uint16 ids (default: Python stdlib)")
    a("--vocab-size", type=positive(int), metavar="N", help="token ids of a .bin file are below N (required for .bin)")
    a("--val-fraction", type=float, default=0.1, metavar="F", help="the tail of the data held out (default: 0.1)")
    a = p.add_argument_group("model").add_argument
    a("--n-layer", type=positive(int), default=4, metavar="N", help="transformer blocks (default: 4)")
    a("--n-head", type=positive(int), default=4, metavar="N", help="attention heads, must divide --n-embd (default: 4)")
    a("--n-embd", type=positive(int), default=128, metavar="N", help="width of the residual stream (default: 128)")
    a("--block-size", type=positive(int), default=128, metavar="T", help="context length in tokens (default: 128)")
    a("--dropout", type=float, default=0.0, metavar="P", help="dropout probability (default: 0.0)")
    a("--grad-checkpointing", action="store_true", help="recompute each block's activations in backward")
    a("--compile", action="store_true", help="torch.compile the model (off by default)")
    a("--compile-backend", default="inductor", metavar="NAME", help="torch.compile backend (default: inductor)")
    a = p.add_argument_group("training").add_argument
    a("--batch-size", type=positive(int), default=16, metavar="B", help="per micro-step and process (default: 16)")
    a("--grad-accum", type=positive(int), default=1, metavar="K", help="micro-steps per optimizer step (default: 1)")
    a("--max-steps", type=positive(int), default=300, metavar="N", help="optimizer steps (default: 300)")
    a("--lr", type=positive(float), default=3e-3, help="peak learning rate (default: 0.003)")
    a("--min-lr", type=positive(float, zero_ok=True), default=3e-4, metavar="LR", help="cosine floor (default: 0.0003)")
    a("--warmup-steps", type=positive(int, zero_ok=True), default=30, metavar="N", help="linear warmup (default: 30)")
    a("--weight-decay", type=positive(float, zero_ok=True), default=0.1, metavar="W", help="on matrices (default: 0.1)")
    a("--clip", type=positive(float, zero_ok=True), default=1.0, metavar="NORM", help="0 = off (default: 1.0)")
    a("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto", help="auto: bf16/fp16 on GPUs, off on CPUs")
    a("--seed", type=int, default=0, help="seeds the weights, the data order and dropout (default: 0)")
    a("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto = cuda if present (default)")
    a("--dist-timeout", type=positive(float), default=300, metavar="S", help="default: 300 s")  # DDP 1/10
    a("--check-sync", action="store_true", help="compare replicas at each evaluation")  # DDP 9/10
    a("--debug", action="store_true", help="checked collectives, data per rank, --check-sync")  # DDP 9/10
    a = p.add_argument_group("evaluation, logging, checkpoints").add_argument
    a("--eval-every", type=positive(int), default=100, metavar="N", help="steps between evaluations (default: 100)")
    a("--eval-windows", type=positive(int), default=128, metavar="N", help="validation sequences (default: 128)")
    a("--log-every", type=positive(int), default=10, metavar="N", help="steps between log lines (default: 10)")
    a("--save", default="checkpoints/minigpt.pt", metavar="PATH", help="'' for none (default: %(default)s)")
    a("--save-every", type=positive(int, zero_ok=True), default=0, metavar="N", help="and every N steps (default: 0)")
    a("--resume", metavar="PATH", help="go on from this checkpoint; 'auto': from --save if it exists")
    a("--gpu-peak-tflops", type=positive(float), default=312.0, metavar="T", help="for MFU (default: 312)")
    a("--benchmark", action="store_true", help="time --max-steps steps after 5 warm-up steps; no eval, no save")
    a = p.add_argument_group("sampling (one process, no torchrun)").add_argument
    a("--sample", action="store_true", help="generate text from --ckpt instead of training")
    a("--ckpt", metavar="PATH", help="checkpoint to sample from")
    a("--prompt", default="\n", metavar="TEXT", help="text the sample starts from (default: a newline)")
    a("--max-new-tokens", type=positive(int), default=300, metavar="N", help="tokens to generate (default: 300)")
    a("--temperature", type=positive(float), default=0.8, metavar="T", help="below 1: safer choices (default: 0.8)")
    a("--top-k", type=positive(int, zero_ok=True), default=40, metavar="K", help="draw from the K likeliest (0: all)")
    args = p.parse_args(argv)
    if args.n_embd % args.n_head:
        p.error(f"--n-head {args.n_head} must divide --n-embd {args.n_embd}")
    if not 0 <= args.dropout < 1 or not 0 < args.val_fraction < 1:
        p.error("--dropout must be in [0, 1) and --val-fraction in (0, 1)")
    if args.sample and not args.ckpt:
        p.error("--sample needs --ckpt PATH")
    return args


def print0(is_main, message):
    """Print a log line if this process is the one that logs; flush so lines appear at once under torchrun."""
    if is_main:
        print(message, flush=True)


def pick_device(name):
    """'auto' means the GPU if this machine has one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda, but no CUDA device is visible (try --device cpu)")
    return torch.device(name)


def keep_freed_memory_on_cpu(device):
    """CPU runs on Linux (glibc): keep freed memory inside the process. Each step allocates and frees tensors
    of tens of MB (the logits: batch x context x vocab floats); by default glibc returns such blocks to the
    OS at once, and the next step pays page faults to map them again (10-30% of a step, measured here)."""
    if device.type != "cpu":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc (macOS, musl, Windows): nothing to tune
    libc.mallopt(-4, 0)  # M_MMAP_MAX = 0: serve large blocks from the heap, not from fresh mmaps
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD = 1 GiB: keep up to that much freed heap for reuse


def init_distributed(device, timeout_s, debug):  # DDP 1/10 join the process group torchrun describes in env vars
    if device.type == "cuda":  # DDP 2/10 one GPU per process, picked by LOCAL_RANK, before any CUDA work
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))  # DDP 2/10
        torch.cuda.set_device(device)  # DDP 2/10
    backend, timeout = ("nccl" if device.type == "cuda" else "gloo"), datetime.timedelta(seconds=timeout_s)  # DDP 1/10
    if debug:  # DDP 9/10 TORCH_DISTRIBUTED_DEBUG, before the group starts; DETAIL checks every collective across ranks
        dist.set_debug_level(dist.DebugLevel.DETAIL if backend == "nccl" else dist.DebugLevel.INFO)  # DDP 9/10 see docs
    if "RANK" in os.environ:  # DDP 1/10 launched by torchrun
        dist.init_process_group(backend, timeout=timeout)  # DDP 1/10
    else:  # DDP 1/10 plain `python`: a group of one, over an in-memory store
        print("not launched by torchrun: running as a one-process group (world size 1)", flush=True)  # DDP 1/10
        dist.init_process_group(backend, timeout=timeout, store=dist.HashStore(), rank=0, world_size=1)  # DDP 1/10
    return device, dist.get_rank(), dist.get_world_size()  # DDP 1/10


# ----------------------------------------------------------------------------------------------- data

def load_tokens(args):
    """All tokens as a 1-D numpy array, and the vocabulary size. Bytes of a text file are its tokens; a .bin
    file is memory-mapped, not read, so a corpus of many GB costs no RAM until its windows are read."""
    if args.data is None:
        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        raw = b"".join(open(f, "rb").read() for f in files)[:DEFAULT_CORPUS_BYTES]
        return np.frombuffer(raw, dtype=np.uint8), 256
    if not os.path.isfile(args.data):
        raise InputError(f"data file not found: {args.data}")
    if not args.data.endswith(".bin"):
        return np.fromfile(args.data, dtype=np.uint8), 256
    if args.vocab_size is None:
        raise InputError(f"{args.data} holds token ids: give --vocab-size (e.g. 50304 for GPT-2's BPE)")
    if os.path.getsize(args.data) % 2:
        raise InputError(f"{args.data} has an odd number of bytes: not a file of uint16 token ids")
    tokens = np.memmap(args.data, dtype=np.uint16, mode="r") if os.path.getsize(args.data) else np.zeros(0, np.uint16)
    if len(tokens) and int(tokens.max()) >= args.vocab_size:
        raise InputError(f"{args.data} holds token id {int(tokens.max())}, not below --vocab-size {args.vocab_size}")
    return tokens, args.vocab_size


def split_tokens(tokens, args, world_size):
    """Train on the head, validate on the tail; refuse data too short to give every rank a batch."""
    n_val = int(len(tokens) * args.val_fraction)
    train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    need = world_size * args.batch_size * (args.block_size + 1)
    if len(train) < need + args.block_size or len(val) < args.block_size + 1:
        where = args.data or "the default corpus"
        raise InputError(f"{where} has {len(tokens)} tokens: too short for {world_size} process(es) x "
                         f"--batch-size {args.batch_size} x --block-size {args.block_size} (+{args.val_fraction:.0%} "
                         f"validation); give more data or smaller sizes")
    return train, val


class Windows:
    """This rank's training batches. An epoch cuts the token stream into non-overlapping windows of
    block_size + 1 tokens, starting at a random offset, shuffles them (seed + epoch) and deals them to the
    ranks round-robin, like DistributedSampler: every rank reads different windows, and an epoch reads each
    token once. Micro-batch k is a pure function of k, so a resumed run reads what the uninterrupted one did."""

    def __init__(self, tokens, block_size, batch_size, rank, world_size, seed):
        self.tokens, self.block, self.batch = tokens, block_size, batch_size
        self.rank, self.world, self.seed = rank, world_size, seed
        windows_per_rank = (len(tokens) - block_size) // (block_size + 1) // world_size  # for any offset
        self.per_epoch = windows_per_rank // batch_size  # micro-batches per rank per epoch
        self.span = np.arange(block_size + 1)
        self.epoch, self.starts = None, None

    def deal(self, epoch):
        g = torch.Generator().manual_seed(self.seed + epoch)
        offset = int(torch.randint(0, self.block + 1, (1,), generator=g))
        count = self.per_epoch * self.batch * self.world
        order = torch.randperm((len(self.tokens) - offset) // (self.block + 1), generator=g)[:count]
        return (offset + order * (self.block + 1))[self.rank::self.world].numpy()  # DDP 4/10 this rank's windows

    def get(self, k):
        """Micro-batch k of this rank: inputs and targets (the inputs shifted by one token), (B, T) each."""
        epoch, i = divmod(k, self.per_epoch)
        if epoch != self.epoch:
            self.epoch, self.starts = epoch, self.deal(epoch)
        rows = torch.from_numpy(self.tokens[self.starts[i * self.batch:(i + 1) * self.batch, None] + self.span]
                                .astype(np.int64))
        return rows[:, :-1], rows[:, 1:]


def unigram_loss(train, val, vocab_size):
    """Cross-entropy (nats/token) on the validation tokens of predicting each token by its frequency in the
    training tokens: the loss to beat, for a model that ignores context."""
    counts = np.bincount(train, minlength=vocab_size) + 1.0  # +1: no token has probability 0
    return float(-np.log(counts / counts.sum())[val].mean())


# ---------------------------------------------------------------------------------------------- model

def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v over earlier positions only, through PyTorch's fused kernel (flash attention
    on GPUs): is_causal builds no mask tensor. No dropout on the attention weights: on a CPU it would force the
    slow unfused path (dropout acts on the residual branches instead). On a CPU, attention runs in fp32 even
    under bf16 autocast: PyTorch's bf16 CPU backward kernel is 3x slower than its fp32 one (measured here)."""
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.autocast("cpu", enabled=False):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(q.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = causal_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout, grad_checkpointing=False):
        super().__init__()
        self.block_size, self.grad_checkpointing = block_size, grad_checkpointing
        self.tok_emb, self.pos_emb = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying: one matrix embeds and un-embeds tokens
        self.apply(self.init_weights)
        for name, p in self.named_parameters():  # GPT-2: shrink the residual branches' outputs with depth
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            if self.grad_checkpointing and self.training:  # keep only block inputs; recompute the rest
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature, top_k):
        """Append max_new_tokens tokens to idx (1, T), one at a time, each drawn from the model's prediction."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size:])[0][:, -1] / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1)], dim=1)
        return idx


def model_config(args, vocab_size):
    return {"vocab_size": vocab_size, "block_size": args.block_size, "n_layer": args.n_layer,
            "n_head": args.n_head, "n_embd": args.n_embd, "dropout": args.dropout}


# -------------------------------------------------------------------------------------------- training

def make_optimizer(model, args, device):
    """AdamW; weight decay on matrices (embeddings, linear weights) only, never on biases or norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def lr_at(step, args):
    """Linear warmup to --lr over --warmup-steps, then a cosine down to --min-lr at --max-steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (args.lr - args.min_lr)


def amp_dtype(choice, device):
    """The autocast dtype, or None for full fp32. bf16 has fp32's range: no loss scaling. fp16 needs a GradScaler."""
    if choice == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if choice == "fp16" and device.type != "cuda":
        raise InputError("--amp fp16 needs a CUDA device; on a CPU use --amp bf16 or --amp off")
    if choice == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise InputError("--amp bf16: this GPU has no bf16 support; use --amp fp16")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[choice]


def train_step(model, optimizer, scaler, windows, step, args, autocast, device):
    """One optimizer step over --grad-accum micro-batches. DDP all-reduces gradients during the last
    micro-batch's backward only: the others run under no_sync() and just accumulate locally.
    Returns the mean loss per token (a device tensor: no host sync here) and the gradient norm."""
    loss_sum = torch.zeros((), device=device)
    for micro in range(args.grad_accum):
        x, y = windows.get(step * args.grad_accum + micro)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        last = micro == args.grad_accum - 1
        with contextlib.nullcontext() if last else model.no_sync():  # DDP 6/10 one all-reduce per optimizer step
            with autocast:
                _, loss = model(x, y)
            loss = loss / (y.numel() * args.grad_accum)  # mean over all tokens of the step, on this rank
            scaler.scale(loss).backward()
        loss_sum += loss.detach()
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args)
    scaler.unscale_(optimizer)  # fp16: true gradients before clipping (a no-op when the scaler is off)
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip or float("inf"))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


@torch.no_grad()
def evaluate(model, val, args, rank, world_size, autocast):
    """Mean loss per token over the first --eval-windows non-overlapping validation windows, each rank taking
    a disjoint slice: token-loss sums and token counts are all-reduced, so the mean is exact."""
    model.eval()
    device = next(model.parameters()).device
    starts = np.arange(0, len(val) - args.block_size, args.block_size + 1)[:args.eval_windows]
    mine = starts[rank::world_size]  # DDP 4/10 disjoint validation slices, no padding
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(0, len(mine), args.batch_size):
        rows = torch.from_numpy(val[mine[i:i + args.batch_size, None] + np.arange(args.block_size + 1)]
                                .astype(np.int64)).to(device)
        with autocast:
            _, loss_sum = model(rows[:, :-1], rows[:, 1:])
        totals += torch.stack([loss_sum.double(), totals.new_tensor(rows[:, 1:].numel())])
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # DDP 7/10 sums over all ranks, then one division
    model.train()
    return (totals[0] / totals[1]).item()


def check_replicas_in_sync(model, when):  # DDP 9/10 --check-sync: compare hashes of every rank's weights
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()))  # DDP 9/10
    digests = [None] * dist.get_world_size()  # DDP 9/10
    dist.all_gather_object(digests, digest.hexdigest()[:12])  # DDP 9/10
    if len(set(digests)) > 1:  # DDP 9/10
        sys.stderr.write(f"error: --check-sync: replicas differ after {when}: {digests}\n")  # DDP 9/10
        sys.exit(3)  # DDP 9/10


def mean_over_ranks(value, world_size):
    """The average of a scalar tensor over all ranks (SUM then divide: gloo has no AVG)."""
    value = value.detach().clone().float()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # DDP 7/10 every rank calls it, not only rank 0
    return value.item() / world_size


# ----------------------------------------------------------------------------------------- checkpoints

def save_checkpoint(path, raw_model, optimizer, scaler, step, args, vocab_size, rng_states):
    """Write atomically: a temp file in the same folder, fsync, then rename over the final name."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
             "step": step, "config": model_config(args, vocab_size), "args": vars(args), "rng": rng_states}
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, never half of one
    finally:
        if os.path.exists(tmp):  # the write failed: drop the partial file (a killed process leaves it behind)
            os.remove(tmp)


def resolve_resume(resume, save):
    """--resume auto: continue from the --save checkpoint if one exists (after a crash, a restart runs the
    same command again and picks up where the last checkpoint left it), else start fresh."""
    if resume != "auto":
        return resume
    if not save:
        raise InputError("--resume auto needs a --save path to look for")
    return save if os.path.isfile(save) else None


def rng_state(device):
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def read_checkpoint(path):
    """The checkpoint dict, loaded to the CPU with weights_only=True; any problem is an InputError."""
    if not os.path.isfile(path):
        raise InputError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not {"model", "config", "step"} <= state.keys():
            raise ValueError("not a checkpoint of this script (no model, config and step)")
        return state
    except Exception as err:  # truncated, not a torch file, not a checkpoint of ours: bad input all the same
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        raise InputError(f"cannot read checkpoint {path}: {reason}") from None


def resume(path, raw_model, optimizer, scaler, args, vocab_size, rank, device):
    """Restore weights, optimizer, scaler and this rank's RNG; return the step to continue from."""
    state = read_checkpoint(path)
    if state["config"] != model_config(args, vocab_size):
        raise InputError(f"{path} was trained with {state['config']}, this run builds {model_config(args, vocab_size)}")
    try:
        raw_model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise InputError(f"cannot resume from {path}: {type(err).__name__}: {str(err).splitlines()[0]}") from None
    if rank < len(state["rng"]):  # the same world size gets its exact dropout streams back
        torch.set_rng_state(state["rng"][rank]["cpu"])
        if state["rng"][rank]["cuda"] is not None and device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"][rank]["cuda"])
    return state["step"]


# ------------------------------------------------------------------------------------------- sampling

def sample(args):
    """Inference: ONE plain process, no process group (generation has no gradients to average)."""
    device = pick_device(args.device)
    state = read_checkpoint(args.ckpt)
    if state["config"]["vocab_size"] != 256:
        raise InputError(f"{args.ckpt} was trained on token ids (vocab {state['config']['vocab_size']}): "
                         "--prompt text needs a byte-level checkpoint (vocab 256)")
    model = GPT(**state["config"]).to(device)
    model.load_state_dict(state["model"])
    model.eval()
    torch.manual_seed(args.seed)
    prompt = torch.tensor([list(args.prompt.encode("utf-8")) or [10]], device=device)
    out = model.generate(prompt, args.max_new_tokens, args.temperature, args.top_k)
    print(bytes(out[0].tolist()).decode("utf-8", errors="replace"), flush=True)


# ----------------------------------------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    if args.sample:
        return sample(args)
    # setup
    device = pick_device(args.device)
    device, rank, world_size = init_distributed(device, args.dist_timeout, args.debug)  # DDP 1/10
    is_main = rank == 0  # DDP 3/10 rank 0 alone logs and saves
    keep_freed_memory_on_cpu(device)
    dtype = amp_dtype(args.amp, device)
    autocast = torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # fp16 only; bf16 needs none
    tokens_per_step = args.batch_size * args.block_size * args.grad_accum * world_size
    print0(is_main, f"world size {world_size} | device {device} | amp {str(dtype or 'off').replace('torch.', '')} | "
                    f"{tokens_per_step:,} tokens per step ({args.batch_size} x {args.block_size} x "
                    f"{args.grad_accum} accumulation x {world_size} processes)")

    # data
    tokens, vocab_size = load_tokens(args)
    train, val = split_tokens(tokens, args, world_size)
    windows = Windows(train, args.block_size, args.batch_size, rank, world_size, args.seed)  # DDP 4/10 per rank
    baseline, unit = unigram_loss(train, val, vocab_size), "byte" if vocab_size == 256 else "token"
    print0(is_main, f"data {args.data or 'Python standard library'} | {len(train):,} train / {len(val):,} val "
                    f"tokens | vocab {vocab_size} | {unit}-frequency baseline loss {baseline:.4f}")
    if args.debug:  # DDP 9/10 every rank names the windows it reads; rank 0 prints the lines in rank order
        shards = [None] * world_size  # DDP 9/10 one process writes: lines from many ranks never splice together
        dist.all_gather_object(shards, f"[rank {rank}] {windows.per_epoch} micro-batches per epoch, first windows "
                                       f"at tokens {windows.deal(0)[:4].tolist()}")  # DDP 9/10
        print0(is_main, "\n".join(shards))  # DDP 9/10

    # model
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    raw_model = GPT(**model_config(args, vocab_size), grad_checkpointing=args.grad_checkpointing).to(device)
    optimizer = make_optimizer(raw_model, args, device)
    torch.manual_seed(args.seed + rank)  # DDP 4/10 each rank its own dropout masks, as it has its own data
    resume_from = resolve_resume(args.resume, args.save)
    start = resume(resume_from, raw_model, optimizer, scaler, args, vocab_size, rank, device) if resume_from else 0
    model = torch.compile(raw_model, backend=args.compile_backend) if args.compile else raw_model
    model = DDP(model, device_ids=[device] if device.type == "cuda" else None)  # DDP 6/10 averages gradients
    n_params = sum(p.numel() for p in raw_model.parameters())
    resumed = f" | resumed from {resume_from} at step {start}" if resume_from else ""
    print0(is_main, f"model {n_params:,} parameters | {args.n_layer} layers, {args.n_head} heads, {args.n_embd} wide, "
                    f"context {args.block_size}{resumed}")

    # train
    if args.benchmark:
        return benchmark(model, optimizer, scaler, windows, args, autocast, device, tokens_per_step, is_main)
    fail_at, fail_mode = crash_step(rank)
    val_loss = evaluate(model.module, val, args, rank, world_size, autocast)  # DDP 7/10 the plain module
    print0(is_main, f"step {start}/{args.max_steps} | val loss {val_loss:.4f}")
    timer, train_s, last, paces = time.perf_counter(), 0.0, start, []  # paces: seconds per step, per log line
    for step in range(start, args.max_steps):
        if step + 1 == fail_at and fail_mode == "crash":
            os._exit(17)  # like a killed process: no cleanup, no goodbye to the group
        if step + 1 == fail_at:  # "hang": alive but stuck, so never at this step's all-reduce; the other
            time.sleep(3600)  # ranks wait there until --dist-timeout fails them, and torchrun ends the job
        loss, grad_norm = train_step(model, optimizer, scaler, windows, step, args, autocast, device)
        done = step + 1
        if done % args.log_every == 0 or done == args.max_steps:
            loss = mean_over_ranks(loss, world_size)  # DDP 7/10 the loss of all ranks' tokens
            seconds = time.perf_counter() - timer
            train_s, timer, steps, last = train_s + seconds, time.perf_counter(), done - last, done
            paces.append(seconds / steps)
            print0(is_main, log_line(done, args, loss, grad_norm.item(), seconds / steps, tokens_per_step, n_params,
                                     device, world_size))
        if done % args.eval_every == 0 or done == args.max_steps:
            val_loss = evaluate(model.module, val, args, rank, world_size, autocast)  # DDP 7/10
            print0(is_main, f"step {done}/{args.max_steps} | val loss {val_loss:.4f} | baseline {baseline:.4f}")
            if args.check_sync or args.debug:  # DDP 9/10
                check_replicas_in_sync(model, f"step {done}")  # DDP 9/10
            timer = time.perf_counter()  # evaluation is not training time
        if args.save and (done == args.max_steps or (args.save_every and done % args.save_every == 0)):
            checkpoint_all(args.save, raw_model, optimizer, scaler, done, args, vocab_size, device, is_main)

    # summary, and a taste of what the model learned (rank 0, the plain model: no collectives)
    trained = max(0, args.max_steps - start)
    summary = {"steps": trained, "val_loss": val_loss, "baseline_loss": baseline, "train_s": round(train_s, 3),
               "tokens_per_s": round(trained * tokens_per_step / train_s, 1) if train_s else 0.0}
    step_s = statistics.median(paces[1:] or paces) if paces else 0.0  # the first log interval warms up
    summary.update(pace(step_s, tokens_per_step))
    print0(is_main, f"done | val loss {val_loss:.4f} ({unit}-frequency baseline {baseline:.4f}) | "
                    f"{summary['tokens_per_s']:,.0f} tok/s over {train_s:.1f} s of training")
    print0(is_main, "summary " + json.dumps(summary))
    if is_main and vocab_size == 256:
        raw_model.eval()
        out = raw_model.generate(torch.tensor([[10]], device=device), 200, 0.8, 40)
        print("sample:\n" + bytes(out[0].tolist()).decode("utf-8", errors="replace"), flush=True)


def log_line(step, args, loss, grad_norm, seconds_per_step, tokens_per_step, n_params, device, world_size):
    """step N/M | loss | lr | grad norm | ms/step | tok/s, plus MFU on CUDA (conventions.md)."""
    line = (f"step {step}/{args.max_steps} | loss {loss:.4f} | lr {lr_at(step - 1, args):.2e} | "
            f"grad norm {grad_norm:.3f} | {1000 * seconds_per_step:.1f} ms/step | "
            f"{tokens_per_step / seconds_per_step:,.0f} tok/s")
    if device.type == "cuda":  # model FLOPs utilisation: 6N per token plus attention (PaLM, appendix B)
        flops_per_token = 6 * n_params + 12 * args.n_layer * args.n_embd * args.block_size
        mfu = flops_per_token * tokens_per_step / seconds_per_step / (world_size * args.gpu_peak_tflops * 1e12)
        line += f" | MFU {100 * mfu:.1f}%"
    return line


def checkpoint_all(path, raw_model, optimizer, scaler, step, args, vocab_size, device, is_main):
    """Every rank hands rank 0 its RNG state (a collective: all ranks call it); rank 0 writes; all wait."""
    rng_states = [None] * dist.get_world_size()  # DDP 8/10
    dist.all_gather_object(rng_states, rng_state(device))  # DDP 8/10 dropout streams of every rank
    if is_main:
        save_checkpoint(path, raw_model, optimizer, scaler, step, args, vocab_size, rng_states)
        print(f"step {step}/{args.max_steps} | saved {path}", flush=True)
    dist.barrier()  # DDP 8/10 save once: nobody goes on (or reads the file) before rank 0 has written it


def crash_step(rank):
    """Teaching aid for chapters 5 and 6 (docs/conventions.md): with DDP_FAIL_AT_STEP=N set, the process of
    rank DDP_FAIL_RANK (default 0) dies as if killed when step N begins (DDP_FAIL_MODE=crash, the default) or
    stops there as if stuck (DDP_FAIL_MODE=hang), on the first attempt only: torchrun counts restarts in
    TORCHELASTIC_RESTART_COUNT, so a restarted job gets past it. Returns (N or 0, mode)."""
    mode = os.environ.get("DDP_FAIL_MODE", "crash")
    try:
        step, victim = int(os.environ.get("DDP_FAIL_AT_STEP", 0)), int(os.environ.get("DDP_FAIL_RANK", 0))
        first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
    except ValueError:
        raise InputError("DDP_FAIL_AT_STEP and DDP_FAIL_RANK must be whole numbers") from None
    if mode not in ("crash", "hang"):
        raise InputError(f"DDP_FAIL_MODE must be crash or hang, not {mode!r}")
    return (step if rank == victim and first_attempt else 0), mode


def pace(step_s, tokens_per_step):
    """The summary keys benchmark_scaling.py reads (docs/conventions.md): median ms per optimizer step, and
    the throughput of all ranks it implies."""
    return {"step_ms": round(1000 * step_s, 3), "per_step": tokens_per_step, "throughput_unit": "tokens/s",
            "throughput": round(tokens_per_step / step_s, 1) if step_s else 0.0}


def benchmark(model, optimizer, scaler, windows, args, autocast, device, tokens_per_step, is_main):
    """--benchmark: 5 warm-up steps, then --max-steps timed ones; median ms/step and tokens/s."""
    times = []
    for step in range(5 + args.max_steps):
        start = time.perf_counter()
        loss, _ = train_step(model, optimizer, scaler, windows, step, args, autocast, device)
        loss.item()  # wait for the device: the step is over
        times.append(time.perf_counter() - start)
    result = {**pace(statistics.median(times[5:]), tokens_per_step), "timed_steps": args.max_steps}
    print0(is_main, f"benchmark | {result['step_ms']} ms/step | {result['throughput']:,.0f} tok/s")
    print0(is_main, "summary " + json.dumps(result))


if __name__ == "__main__":
    try:
        main()
    except InputError as err:
        sys.stderr.write(f"error: {err}\n")  # one write: error lines from several ranks never splice
        sys.exit(2)
    finally:  # DDP 10/10 leave the process group on every path, error or not
        if dist.is_initialized():  # DDP 10/10
            dist.destroy_process_group()  # DDP 10/10
