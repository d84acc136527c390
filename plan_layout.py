r"""Chapter 13: which layout for my model on my cluster? A planner, without torch or a GPU:

    python plan_layout.py --preset llama3-70b --gpus 64       # the layouts that fit, best first
    python plan_layout.py --preset llama3-405b --gpus 16384 --seq-len 131072 --top 5
    python plan_layout.py --preset llama3-70b --gpus 64 --layout pp=2,tp=8,micro=1,recompute=full
    python plan_layout.py --layers 32 --width 4096 --heads 32 --kv-heads 8 --mlp-width 14336 \
        --mlp swiglu --vocab 128256 --gpus 16 --cluster a100-80gb --json plans.json --svg plans.svg
    python plan_layout.py --chapter-lines 11 --world-size 8 -- --n-layer 2 --n-head 2 \
        --n-embd 32 --block-size 32 --batch-size 6 --grad-accum 2   # chapter 11's rank 0 lines
    python plan_layout.py --preset llama3-405b --layout tp=8,pp=16,dp=128 \
        --layout tp=8,pp=16,dp=128,recompute=full      # layouts side by side, a row each
    python plan_layout.py --bubble 16 --micro-batches 16 64 --stages-per-rank 1 2 4
    python plan_layout.py --chapter-lines 7 --world-size 2 8 64   # a line per world size

It tries every layout the course's trainers can run, estimates each one's memory per GPU and step
time from the course's formulas, and ranks those that fit, fastest first, in under a second.

Terms. A rank is one process and its GPU. A layout cuts the GPUs into a mesh of pp x dp x cp x tp
ranks: pp pipeline stages, dp replicas (data parallelism), cp context ranks (each holds a part of
every sequence) and tp tensor ranks (each holds a part of every matrix), tp innermost, so that a tp
group is consecutive ranks on one node. FSDP shards a stage's parameters over its dp x cp ranks;
with experts, ep of those ranks trade tokens by all-to-all and each holds E / ep experts of a
layer. A micro-batch is the sequences one forward takes; a replica runs m of them a step, and the
pipeline schedule (gpipe, 1f1b, interleaved-1f1b with V stages per rank) decides how many a stage
holds at once. The bubble is the share of a step a stage idles while the pipeline fills and
drains. Full recomputation keeps each layer's input alone and runs its forward again in backward.
The gradient sync is FSDP's reduce-scatter: after every micro-batch, or deferred to the last (a
pipeline schedule always defers it). MFU is the model's FLOPs per second over the GPUs' peak.

How to read it: every number is an estimate from the sizes (16 bytes of fp32 state a parameter,
bf16 compute, fp32 gradient reduction, as the course's trainers run on GPUs); `--layout` prints one
layout's terms, each with its formula and inputs, and its place in the ranking ("place 3 of 250":
place, since a rank is a process). The overlap model: a rank's compute, its tp, cp
and ep collectives and its pipeline sends run one after another (the trainers overlap none of
them); the pipeline bubble stretches that by 1 / (1 - bubble); FSDP's gathers and reduce-scatters
hide behind compute alone (not behind the other collectives), all of it when they run every
micro-batch and one micro-batch's worth when deferred (they then run before the first forward and
after the last backward), and the rest adds.

See also docs/planner.md (reading the table, the model's limits, the published layouts).
"""
import argparse
import dataclasses
import functools
import json
import math
import os
import sys

USABLE = 0.9  # of a GPU's memory; the rest is the CUDA context, NCCL's buffers, fragmentation
MIN_CP_TOKENS = 1024  # a cp rank's share of a sequence: less leaves attention's products small
BF16, FP32 = 2, 4  # bytes: the compute dtype, and the state's and gradient reduction's


class InputError(Exception):
    """Bad input, or no layout that fits: one line on stderr and exit code 2."""


def main(argv=None):
    """Parse, then one of: a chapter's lines, one layout explained, or the ranked table."""
    try:
        args = parse_args(argv)
        if args.bubble:
            print(bubble_table(args.bubble, args.micro_batches, args.stages_per_rank))
            return 0
        if args.chapter_lines:
            print("\n".join(sized_lines(args.chapter_lines, args.world_size, args.rest)))
            return 0
        model, cluster = model_from(args), cluster_from(args)
        if args.layout:
            print(compare(model, cluster, args.layout) if len(args.layout) > 1 else
                  explain(model, cluster, parse_layout(args.layout[0], model, cluster)))
            if args.json:
                write_text(args.json, layouts_json(model, cluster, args.layout))
            return 0
        plans = [estimate(model, cluster, layout) for layout in layouts(model, cluster)]
        fitting = sorted((p for p in plans if p["fits"]), key=speed)
        if not fitting:
            raise InputError(nearest_change(model, cluster, plans))
        misses = sorted((p for p in plans if not p["fits"]), key=speed)[:args.misses]
        print(report(model, cluster, fitting[:args.top], misses, len(plans)))
        write_outputs(args, model, cluster, fitting, misses, plans)
        return 0
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def speed(plan):
    """The ranking: the estimated step time, then the memory, then the layout's own order."""
    return plan["step_s"], plan["memory"]["total"], plan["name"]


# ------------------------------------------------------------------------------- the model
# Each preset's numbers and their source. "gelu" models are the course's GPT block (biases,
# LayerNorm, learned positions, the head tied to the embedding); "swiglu" ones Llama's (no biases,
# RMSNorm, rotary positions, an untied head). tokens_per_step and seq_len are the defaults.
PRESETS = {
    # train_4d_minigpt.py's parse_args defaults: 4 blocks, 4 heads, 128 wide, context 128, the
    # 256 byte values; 16 sequences x 4 micro-batches a replica: 8,192 tokens (842,496 params).
    "course-gpt": dict(layers=4, width=128, heads=4, kv_heads=4, mlp_width=512, mlp="gelu",
                       vocab=256, seq_len=128, tokens_per_step=8192),
    # GPT-2 small: the released config (n_layer 12, n_embd 768, n_head 12, n_ctx 1024, vocab
    # 50,257), 124,439,808 parameters; 0.5M tokens a step: the GPT-3 paper's Table 2.1 (125M).
    "gpt2-124m": dict(layers=12, width=768, heads=12, kv_heads=12, mlp_width=3072, mlp="gelu",
                      vocab=50257, seq_len=1024, tokens_per_step=2**19),
    # Llama 3 8B, 70B, 405B: "The Llama 3 Herd of Models" (2024), Table 3 (layers, width, FFN
    # width, heads, key/value heads); vocabulary 128,256 from the released config.json. 8K
    # context; 16M tokens a step for 405B (Section 3.4.1, Table 4); 4M for 8B, 70B (assumed).
    "llama3-8b": dict(layers=32, width=4096, heads=32, kv_heads=8, mlp_width=14336,
                      mlp="swiglu", vocab=128256, seq_len=8192, tokens_per_step=2**22),
    "llama3-70b": dict(layers=80, width=8192, heads=64, kv_heads=8, mlp_width=28672,
                       mlp="swiglu", vocab=128256, seq_len=8192, tokens_per_step=2**22),
    "llama3-405b": dict(layers=126, width=16384, heads=128, kv_heads=8, mlp_width=53248,
                        mlp="swiglu", vocab=128256, seq_len=8192, tokens_per_step=2**24),
    # Mixtral 8x7B: "Mixtral of Experts" (Jiang et al. 2024), Table 1 (dim 4096, 32 layers, 32
    # heads, 8 kv heads, hidden 14,336, vocab 32,000, 8 experts, top 2); 46.7B total and 12.9B
    # active: Mistral's announcement "Mixtral of experts". 4K sequences, 4M tokens (assumed).
    "mixtral-8x7b": dict(layers=32, width=4096, heads=32, kv_heads=8, mlp_width=14336,
                         mlp="swiglu", vocab=32000, seq_len=4096, tokens_per_step=2**22,
                         experts=8, top_k=2),
    # DeepSeek-V3: "DeepSeek-V3 Technical Report" (arXiv:2412.19437), Section 4.2: 61 layers,
    # 7,168 wide, 128 heads; latent attention with query rank 1,536, key-value rank 512, head
    # dims 128 + 64 rotary, values 128; the first 3 layers dense (18,432 wide, config.json), the
    # rest 256 routed experts of 2,048 and 1 shared, 8 a token; vocab 129,280 (config.json); 4K
    # sequences, 15,360 a step at the end of its batch-size schedule. 671B total, 37B active.
    "deepseek-v3": dict(layers=61, width=7168, heads=128, kv_heads=128, mlp_width=18432,
                        mlp="swiglu", vocab=129280, seq_len=4096, tokens_per_step=15360 * 4096,
                        experts=256, top_k=8, shared=1, expert_width=2048, dense_layers=3,
                        mla=(1536, 512, 128, 64, 128)),
}


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: cheap cache keys
class Model:
    name: str
    layers: int
    width: int
    heads: int
    kv_heads: int
    mlp_width: int
    mlp: str  # "gelu": the course's GPT block; "swiglu": Llama's
    vocab: int
    seq_len: int
    tokens_per_step: int
    experts: int = 0  # routed experts per layer; 0: a dense model
    top_k: int = 0  # the experts a token goes to
    shared: int = 0  # experts every token goes to
    expert_width: int = 0  # 0: as wide as --mlp-width
    dense_layers: int = 0  # the first layers keep a dense MLP (DeepSeek-V3's 3)
    mla: tuple = ()  # DeepSeek's latent attention: (q rank, kv rank, nope, rope, value dims)


SHAPE = ("layers", "width", "heads", "kv_heads", "mlp_width", "mlp", "vocab", "experts", "top_k",
         "shared")


def model_from(args):
    """The Model of --preset, each flag given replacing the preset's number; then its checks."""
    fields = dict(PRESETS[args.preset or "course-gpt"])
    shape = any(getattr(args, name) is not None for name in SHAPE)
    if shape and not args.preset:  # a model of your own: sequences and steps of a large one
        fields.update(seq_len=4096, tokens_per_step=2**22)
    for name in SHAPE + ("seq_len", "tokens_per_step"):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    if args.preset is None and args.kv_heads is None:
        fields["kv_heads"] = fields["heads"]  # a shape by flags: full attention unless told
    if args.preset is None and args.mlp_width is None:
        fields["mlp_width"] = 4 * fields["width"]
    if fields.get("experts") and not fields.get("top_k"):
        fields["top_k"] = 1
    model = Model(args.preset or ("custom" if shape else "course-gpt"), **fields)
    check_model(model)
    return model


def check_model(m):
    """One line for a shape the planner cannot split."""
    if m.width % m.heads:
        raise InputError(f"--heads {m.heads} does not divide --width {m.width}")
    if m.heads % m.kv_heads:
        raise InputError(f"--kv-heads {m.kv_heads} does not divide --heads {m.heads}")
    if m.experts and not 1 <= m.top_k <= m.experts:
        raise InputError(f"--experts-per-token {m.top_k} must be between 1 and --experts "
                         f"{m.experts}")
    if (m.top_k or m.shared) and not m.experts:
        raise InputError("--experts-per-token and --shared-experts need --experts")
    if m.tokens_per_step % m.seq_len:
        raise InputError(f"--tokens-per-step {m.tokens_per_step} is not a whole number of "
                         f"sequences of --seq-len {m.seq_len}")


def gpt_style(m):  # the course's block: biases, LayerNorm, learned positions, a tied head
    return m.mlp == "gelu"


def head_dims(m):
    """(query and key dims, value dims) of one head."""
    if m.mla:
        return m.mla[2] + m.mla[3], m.mla[4]
    return m.width // m.heads, m.width // m.heads


def attention_params(m):
    """One layer's attention: its projections (and biases in the course's GPT)."""
    h, (qk, v) = m.width, head_dims(m)
    if m.mla:  # queries and keys/values pass through low-rank latents, each with its norm
        q_rank, kv_rank, nope, rope, _ = m.mla
        return (h * q_rank + q_rank + q_rank * m.heads * qk + h * (kv_rank + rope) + kv_rank
                + kv_rank * m.heads * (nope + v) + m.heads * v * h)
    q, kv = m.heads * qk, m.kv_heads * qk
    bias = q + 2 * kv + h if gpt_style(m) else 0
    return h * (q + 2 * kv) + q * h + bias


def mlp_params(m, width):
    """An MLP of `width` hidden units: two matrices and biases (GELU) or three (SwiGLU)."""
    if m.mlp == "swiglu":
        return 3 * m.width * width
    return 2 * m.width * width + width + m.width


def norm_params(m):
    return 2 * m.width if gpt_style(m) else m.width  # LayerNorm: weight and bias


@functools.lru_cache(maxsize=None)
def layer_table(m):
    """Per layer: (parameters outside the routed experts, routed experts' parameters, the
    routed experts' parameters a token uses)."""
    rows = []
    for i in range(m.layers):
        base = attention_params(m) + 2 * norm_params(m)
        if not m.experts or i < m.dense_layers:
            rows.append((base + mlp_params(m, m.mlp_width), 0, 0))
            continue
        expert = mlp_params(m, m.expert_width or m.mlp_width)
        router = m.experts * m.width
        rows.append((base + router + m.shared * expert, m.experts * expert, m.top_k * expert))
    return tuple(rows)


def end_params(m):
    """(the first stage's embeddings, the last stage's final norm and head). The course's GPT
    ties its head to the embedding: one matrix, held by both end stages under a pipeline."""
    first = m.vocab * m.width + (m.seq_len * m.width if gpt_style(m) else 0)
    return first, norm_params(m) + m.vocab * m.width


def total_params(m):
    """Every parameter once (a tied matrix once)."""
    first, last = end_params(m)
    tied = m.vocab * m.width if gpt_style(m) else 0
    return sum(a + e for a, e, _ in layer_table(m)) + first + last - tied


def active_params(m):
    """The parameters a token uses: all but the routed experts it does not go to."""
    return total_params(m) - sum(e - k for _, e, k in layer_table(m))


# ----------------------------------------------------------------------------- the cluster
# Per GPU: memory (GB), dense BF16 TFLOPS (no sparsity), NVLink and network GB/s one way.
CLUSTERS = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 989 dense BF16 TFLOPS (1,979
    # with sparsity), NVLink 900 GB/s both ways; DGX H100 datasheet: 8 GPUs, 8 x 400 Gb/s
    # ConnectX-7 (50 GB/s per GPU).
    "h100-sxm": dict(gpu_memory_gb=80, peak_tflops=989, gpus_per_node=8, intra_node_gbps=450,
                     inter_node_gbps=50),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 989 dense BF16 TFLOPS, NVLink
    # 900 GB/s; DGX H200 datasheet: 8 GPUs, 8 x 400 Gb/s ConnectX-7.
    "h200": dict(gpu_memory_gb=141, peak_tflops=989, gpus_per_node=8, intra_node_gbps=450,
                 inter_node_gbps=50),
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 312 dense BF16 TFLOPS, NVLink 600 GB/s
    # both ways; DGX A100 datasheet: 8 GPUs, 8 x 200 Gb/s ConnectX-6 HDR (25 GB/s per GPU).
    "a100-80gb": dict(gpu_memory_gb=80, peak_tflops=312, gpus_per_node=8, intra_node_gbps=300,
                      inter_node_gbps=25),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    gpus: int
    gpus_per_node: int
    gpu_memory_gb: float
    peak_tflops: float
    intra_node_gbps: float  # GB/s (bytes) a GPU sends one way to a GPU of its node
    inter_node_gbps: float  # GB/s (bytes) a GPU sends one way across the network
    efficiency: float  # the share of the peak that a layer's matrix products reach


def cluster_from(args):
    """The Cluster of --cluster, each flag given replacing the preset's number."""
    fields = dict(CLUSTERS[args.cluster])
    for name in fields:
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.gpus % fields["gpus_per_node"] and args.gpus > fields["gpus_per_node"]:
        raise InputError(f"--gpus {args.gpus} is not a whole number of nodes of "
                         f"{fields['gpus_per_node']} (--gpus-per-node)")
    return Cluster(args.cluster, args.gpus, efficiency=args.efficiency, **fields)


# ------------------------------------------------------------------------------ the layouts
@dataclasses.dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    cp: int
    tp: int
    ep: int
    schedule: str  # "none" at pp 1; gpipe, 1f1b or interleaved-1f1b
    v: int  # stages per rank
    micro: int  # sequences per micro-batch
    recompute: str  # "none" or "full"
    sync: str  # "every" micro-batch or deferred to the "last"


def layouts(m, c):
    """Every layout the sizes allow, as the trainers would run it."""
    found = []
    for pp, cp, tp in meshes(m, c):
        dp = c.gpus // (pp * cp * tp)
        sequences = m.tokens_per_step // m.seq_len
        if sequences % dp:
            continue  # every replica takes as many sequences
        for micro in micro_sizes(sequences // dp, 64 if pp == 1 else 4):
            for ep in divisors(dp * cp) if m.experts else [1]:
                if m.experts % ep == 0:
                    found += variants(m, pp, dp, cp, tp, (ep, micro))
    return found


def meshes(m, c):
    """(pp, cp, tp) whose product divides the GPUs: tp within a node dividing the heads, cp
    cutting each sequence into 2 cp chunks (cp x tp parts with sequence parallelism) of at
    least MIN_CP_TOKENS tokens a rank (or cp 2)."""
    for tp in divisors(c.gpus):
        if tp > c.gpus_per_node or m.heads % tp or (m.kv_heads % tp and not m.mla):
            continue
        for pp in divisors(c.gpus // tp):
            if pp > m.layers:
                continue
            for cp in divisors(c.gpus // (tp * pp)):
                short = cp > 2 and m.seq_len // cp < MIN_CP_TOKENS
                if m.seq_len % (2 * cp) == 0 and m.seq_len % (cp * tp) == 0 and not short:
                    yield pp, cp, tp


def variants(m, pp, dp, cp, tp, ep_micro):
    """The schedules, recomputation and gradient syncs of one mesh and micro-batch size."""
    ep, micro = ep_micro
    steps = m.tokens_per_step // m.seq_len // dp // micro  # m micro-batches a replica
    if pp == 1:
        plans = [("none", 1, sync) for sync in ("every", "last")]
    else:  # a schedule defers the sync; 1F1B needs m >= pp (else GPipe, as long, holds more)
        plans = [("1f1b" if steps >= pp else "gpipe", 1, "last")]
        plans += [("interleaved-1f1b", v, "last") for v in (2, 4)
                  if pp * v <= m.layers and steps % pp == 0]
    return [Layout(pp, dp, cp, tp, ep, schedule, v, micro, recompute, sync)
            for schedule, v, sync in plans for recompute in ("none", "full")]


def micro_sizes(sequences, most):
    """Sequences per micro-batch: the powers of two up to `most` that divide a replica's share.
    At pp 1 a larger one means fewer FSDP gathers a step; under a schedule it only grows the
    activations and the bubble, in this model, so 4 is the most tried there."""
    return [s for s in (1, 2, 4, 8, 16, 32, 64) if s <= most and sequences % s == 0]


@functools.lru_cache(maxsize=None)
def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def stage_blocks(n_layer, stages, stage):
    """The layers of `stage`: runs in order, as even as can be, the later stages one more."""
    size, extra = divmod(n_layer, stages)
    light = stages - extra
    first = stage * size + max(0, stage - light)
    return range(first, first + size + (stage >= light))


@functools.lru_cache(maxsize=None)
def rank_parts(m, pp, v):
    """For pp rank 0, the last and the middle rank with the most layers: (rank, its layers)."""
    held = {r: [i for k in range(v) for i in stage_blocks(m.layers, pp * v, r + k * pp)]
            for r in range(pp)}
    middle = max(range(1, pp - 1), key=lambda r: len(held[r]), default=0)
    return tuple((r, tuple(held[r])) for r in sorted({0, pp - 1, middle}))


# ----------------------------------------------------------------------- one layout's estimate
@dataclasses.dataclass(frozen=True)
class Part:
    """What one pp rank holds per tp rank, and its sums per token, computed once per mesh."""
    rank: int
    layers: tuple  # the model's layer indices it holds
    dense: float  # its parameters outside the routed experts, per tp rank
    experts: float  # its layers' routed experts, all E of them, per tp rank
    ends: float  # of `dense`, the embeddings, final norm and head
    largest: tuple  # its largest layer's (parameters outside experts, experts), per tp rank
    first: bool  # it holds the embedding
    last: bool  # it holds the final norm and head
    act: float  # activation bytes its layers keep per token, all of them (layer_bytes)
    act_max: float  # the largest layer's
    moe_layers: int  # its layers with experts
    flops: float  # its layers' FLOPs per token, forward and backward, and the head's


@functools.lru_cache(maxsize=None)
def parts_of(m, pp, v, tp):
    """The Parts of pp rank 0, the last and the middle rank with the most layers."""
    return tuple(part_of(m, (pp, tp), r, layers) for r, layers in rank_parts(m, pp, v))


def part_of(m, pp_tp, rank, layers):
    """The Part of pp rank `rank`. TP splits every matrix (the experts' too, an assumption) and
    the embedding and head by vocabulary; the norms, the course's row-wise biases and the
    learned positions stay whole on every tp rank."""
    (pp, tp), table, (emb, head) = pp_tp, layer_table(m), end_params(m)
    first, last = rank == 0, rank == pp - 1
    ends = emb * first + head * last - m.vocab * m.width * (first and last and gpt_style(m))
    whole = len(layers) * (2 * norm_params(m) + 2 * m.width * gpt_style(m)) + norm_params(m) * last
    whole += m.seq_len * m.width * (first and gpt_style(m))
    dense = (sum(table[i][0] for i in layers) + ends - whole) / tp + whole
    per = [layer_bytes(m, tp, table[i][1] > 0) for i in layers]
    flops = sum(6 * (table[i][0] + table[i][2]) + attention_flops(m) for i in layers)
    return Part(rank, tuple(layers), dense, sum(table[i][1] for i in layers) / tp,
                dense - sum(table[i][0] for i in layers) / tp,
                (max((table[i][0] for i in layers), default=0) / tp,
                 max((table[i][1] for i in layers), default=0) / tp),
                first, last, sum(per), max(per, default=0), sum(table[i][1] > 0 for i in layers),
                flops + 6 * m.vocab * m.width * last)


def estimate(m, c, layout):
    """One layout's plan: the memory of its fullest rank, the time of its slowest, the step."""
    steps = m.tokens_per_step // m.seq_len // layout.dp // layout.micro
    parts = parts_of(m, layout.pp, layout.v, layout.tp)
    held = max((memory_terms(m, layout, p, steps) for p in parts), key=lambda t: t["total"][0])
    timed = max((time_terms(m, c, layout, p, steps) for p in parts), key=lambda t: t["busy"])
    bubble = (layout.pp - 1) / (layout.v * steps + layout.pp - 1)
    window = timed["compute"][0] / (1 if layout.sync == "every" else steps)  # FSDP hides here
    step = timed["busy"] / (1 - bubble) + max(0.0, timed["dp"][0] - window)
    usable = USABLE * c.gpu_memory_gb * 1e9
    memory = {name: value for name, (value, _) in held.items()}
    breaks = max((k for k in memory if k != "total"), key=memory.get)
    return {"name": layout_name(layout), "layout": layout,
            "micro_batches": steps, "memory": memory, "memory_rank": held["rank"][0],
            "fits": memory["total"] <= usable, "breaks": None if memory["total"] <= usable
            else breaks, "bubble": bubble, "step_s": step, "time_rank": timed["rank"],
            "seconds": {k: timed[k][0] for k in GROUPS + ("compute",)},
            "bytes": {k: timed[k][1] for k in GROUPS}, "across_nodes": timed["across"],
            "mfu": model_flops(m) * m.tokens_per_step / (step * c.gpus * c.peak_tflops * 1e12),
            "runs_in": runs_in(m, layout), "terms": (held, timed)}


GROUPS = ("tp", "cp", "ep", "pp", "dp")


def layout_name(layout):
    """'pp 2 x dp 4 x cp 1 x tp 8, ep 1 | 1f1b | micro 1 | recompute full | sync last'."""
    schedule = layout.schedule + (f" V {layout.v}" if layout.v > 1 else "")
    return (f"pp {layout.pp} x dp {layout.dp} x cp {layout.cp} x tp {layout.tp}, ep {layout.ep} "
            f"| {schedule} | micro {layout.micro} | recompute {layout.recompute} "
            f"| sync {layout.sync}")


def runs_in(m, layout):
    """The course's chapter whose script runs this layout, or '-' where none does."""
    dims = tuple(d for d in ("pp", "cp", "tp") if getattr(layout, d) > 1)
    if m.experts:
        return "12" if not dims else "-"  # experts run beside FSDP alone
    if len(dims) > 1:  # the 4-D trainer: no --grad-sync; at pp 1 it syncs every micro-batch
        return "11" if layout.sync == "every" or layout.pp > 1 else "-"
    return {(): "7", ("tp",): "8", ("pp",): "9", ("cp",): "10"}[dims]


def memory_terms(m, layout, part, steps):
    """Bytes a rank holds at its peak, term by term: {name: (bytes, how)}."""
    g, mine = layout.dp * layout.cp, part.dense + part.experts / layout.ep
    terms = {"rank": (part.rank, lambda: f"pp rank {part.rank}, layers {span(part.layers)}")}
    terms["state"] = (16 * (part.dense + part.experts) / g, lambda: (
        f"16 B x ({part.dense:,.0f} + {part.experts:,.0f} expert) params / (dp {layout.dp} x "
        f"cp {layout.cp}): fp32 weights, gradients, AdamW's 2 moments, sharded"))
    deferred = layout.pp > 1 or layout.sync == "last"
    unit = part.largest[0] + part.largest[1] / layout.ep  # a layer FSDP gathers
    if layout.pp > 1:  # the schedule keeps the stage gathered from the first forward on
        gathered, how = mine, f"the rank's {mine:,.0f} params, gathered for the whole step"
    else:  # FSDP frees each layer after its forward and backward: two at a time, the root
        gathered = part.ends + 2 * unit
        how = f"the ends' {part.ends:,.0f} + 2 layers of {unit:,.0f} params"
    terms["gathered"] = (BF16 * gathered, lambda: f"2 B (bf16) x {how}")
    terms["gradients"] = gradient_term(m, layout, part, mine if deferred else 2 * unit)
    terms["activations"] = activation_term(m, layout, part, steps)
    terms["logits"] = logits_term(m, layout, part)
    terms["total"] = (sum(v for k, (v, _) in terms.items() if k != "rank"), lambda: "the sum")
    return terms


def span(layers):
    """'0-9, 40-49': a rank's layers as runs of consecutive indices (an interleaved rank's
    stages are apart)."""
    if not layers:
        return "none"
    runs, start = [], layers[0]
    for before, index in zip(layers, list(layers[1:]) + [None]):
        if index != before + 1:  # a run ends at `before`
            runs.append(f"{start}-{before}" if before > start else f"{start}")
            start = index
    return ", ".join(runs)


def gradient_term(m, layout, part, params):
    """Whole fp32 gradients until the sync; the course's TP embedding gets its whole."""
    deferred = layout.pp > 1 or layout.sync == "last"
    extra = m.vocab * m.width * (1 - 1 / layout.tp) * (part.first and deferred)
    return (FP32 * (params + extra), lambda: (
        f"4 B (fp32) x ({params:,.0f} params whole until the "
        + ("step's last backward" if deferred else "layer's reduce-scatter")
        + (f" + the embedding's {extra:,.0f} more, its gradient whole under TP" if extra else "")
        + ")"))


def layer_bytes(m, tp, moe):
    """Activation bytes one layer keeps for backward per token (bf16, flash attention, no
    dropout): split by tp (sequence parallel for the norms), and the inputs TP gathers whole."""
    h, (qk, v) = m.width, head_dims(m)
    kv_heads = m.heads if m.mla else m.kv_heads
    split = 2 * h + m.heads * qk + kv_heads * (qk + v) + m.heads * v  # norms' inputs; q, k, v, out
    hidden = 3 if m.mlp == "swiglu" else 2  # SwiGLU keeps gate, up, product; GELU in and out
    if moe:
        split += (m.top_k + m.shared) * hidden * (m.expert_width or m.mlp_width) + m.top_k * h
    else:
        split += hidden * m.mlp_width
    return BF16 * (split / tp + 2 * h)


def in_flight(layout, steps, rank):
    """Micro-batches whose activations a pp rank holds at once: GPipe all, 1F1B pp - rank,
    interleaved pp + (pp - 1 - 2 x rank) / V (Megatron-LM's and torch's warm-up of 2 (pp - rank
    - 1) + (V - 1) pp chunks, plus one, each 1 / V of a micro-batch), none of them beyond m."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return steps
    if layout.schedule == "interleaved-1f1b":  # the warm-up's chunks, plus one, V a micro-batch
        return min(steps, layout.pp + (layout.pp - 2 * rank - 1) / layout.v)
    return min(steps, layout.pp - rank)


def activation_term(m, layout, part, steps):
    """What backward needs, at the schedule's most micro-batches in flight; with recomputation
    each layer's input alone, and one layer's whole while it is recomputed."""
    tokens = layout.micro * m.seq_len / layout.cp  # a cp rank's tokens of a micro-batch
    count = in_flight(layout, steps, part.rank)
    n = len(part.layers)
    if layout.recompute == "none":
        value = count * tokens * part.act
        return value, lambda: (f"{count:g} micro-batches x {tokens:,.0f} tokens x "
                               f"{part.act / max(n, 1):,.0f} B per token and layer x {n} layers")
    kept = BF16 * m.width / layout.tp  # a layer's input, split by sequence parallelism
    value = count * tokens * n * kept + tokens * part.act_max
    return value, lambda: (f"{count:g} micro-batches x {tokens:,.0f} tokens x {n} layers x "
                           f"{kept:,.0f} B + one layer recomputed: {part.act_max:,.0f} B a token")


def logits_term(m, layout, part):
    """The last stage's logits of one micro-batch: bf16, and the loss's fp32 copy."""
    tokens = layout.micro * m.seq_len / layout.cp
    value = tokens * m.vocab / layout.tp * (BF16 + FP32) * part.last
    return value, lambda: (f"{tokens:,.0f} tokens x {m.vocab:,} / tp {layout.tp} x 6 B"
                           if part.last else "not on this rank")


def attention_flops(m):
    """Causal attention's FLOPs per token and layer, forward and backward: a query meets s / 2
    keys on average, 2 FLOPs a dimension for q.k and again for the values, times 3."""
    qk, v = head_dims(m)
    return 3 * m.seq_len * m.heads * (qk + v)


@functools.lru_cache(maxsize=None)
def model_flops(m):
    """The model's FLOPs per token of training: 6 per parameter a token uses in a matrix
    product (the head's, not the embedding's lookup), plus causal attention's."""
    used = sum(a + k for a, _, k in layer_table(m)) + m.vocab * m.width
    return 6 * used + m.layers * attention_flops(m)


def time_terms(m, c, layout, part, steps):
    """Seconds a rank spends in a step: its compute and each group's bytes over its links."""
    terms = {"rank": part.rank, "compute": compute_term(m, c, layout, part)}
    sent = group_bytes(m, layout, part, steps)
    spans = {"tp": (1, layout.tp), "cp": (layout.tp, layout.cp), "ep": (layout.tp, layout.ep),
             "pp": (layout.dp * layout.cp * layout.tp, layout.pp),
             "dp": (layout.tp, layout.dp * layout.cp)}  # (stride, size): tp innermost
    terms["across"] = {g: size > 1 and stride * size > c.gpus_per_node
                       for g, (stride, size) in spans.items()}
    for group, (sent_bytes, how) in sent.items():
        speed = c.inter_node_gbps if terms["across"][group] else c.intra_node_gbps
        terms[group] = (sent_bytes / (speed * 1e9), sent_bytes, how)
    terms["busy"] = sum(terms[k][0] for k in ("compute", "tp", "cp", "ep", "pp"))
    return terms


def compute_term(m, c, layout, part):
    """(seconds, FLOPs, how): the rank's layers and head over its 1 / (cp x tp) of its
    replica's tokens, at the peak times --efficiency; recomputation runs each layer's forward
    again (8 FLOPs a parameter instead of 6)."""
    tokens = m.tokens_per_step / layout.dp / (layout.cp * layout.tp)
    head = 6 * m.vocab * m.width * part.last
    layers = part.flops - head
    again = 4 / 3 if layout.recompute == "full" else 1
    flops = tokens * (layers * again + head)
    seconds = flops / (c.peak_tflops * 1e12 * c.efficiency)
    return seconds, flops, lambda: (
        f"{tokens:,.0f} tokens x ({layers / 1e9:,.2f} GFLOPs of {len(part.layers)} layers"
        + (" x 4/3" if again > 1 else "") + (" + the head's" if part.last else "")
        + f") / ({c.peak_tflops:g} TFLOPS x {c.efficiency:g})")


def group_bytes(m, layout, part, steps):
    """Bytes the rank sends a step in each group, {group: (bytes, how)}; a ring collective sends
    (n - 1) / n of its tensor per half (all-gather, reduce-scatter)."""
    tp, cp, ep, n = layout.tp, layout.cp, layout.ep, len(part.layers)
    tokens = layout.micro * m.seq_len / cp
    stream = tokens * m.width * BF16  # a micro-batch's activations on a cp rank
    halves = (8 + 3 * (layout.recompute == "full")) * n + 2 * part.first + 2 * part.last
    qk, v = head_dims(m)
    kv = tokens * (m.heads if m.mla else m.kv_heads) * (qk + v) * BF16 / tp  # K and V
    moe = part.moe_layers
    trades = 4 + 2 * (layout.recompute == "full")  # dispatch, combine; again if recomputed
    tied, hops = tied_bytes(m, layout, part), 2 * layout.v * (layout.pp > 1)
    return {
        "tp": (steps * halves * stream * (tp - 1) / tp, lambda: (
            f"{steps} micro-batches x {halves} halves x {stream / 1e6:,.1f} MB x ({tp}-1)/{tp}")),
        "cp": (steps * n * (cp - 1) * kv * 4, lambda: (
            f"{steps} x {n} layers x ({cp}-1) x K,V {kv / 1e6:,.2f} MB x (2 gathers + fp32 "
            "gradients)")),
        "ep": (steps * moe * trades * tokens / tp * m.top_k * m.width * BF16 * (ep - 1) / ep,
               lambda: (
            f"{steps} x {moe} layers x {trades} all-to-alls x {tokens / tp:,.0f} tokens x "
            f"{m.top_k} copies x {m.width} x 2 B x ({ep}-1)/{ep}")),
        "pp": (steps * hops * stream / tp + tied, lambda: (
            f"{steps} x {hops} sends x {stream / tp / 1e6:,.1f} MB"
            + (f" + the tied gradient's {tied / 1e6:,.1f} MB" if tied else ""))),
        "dp": fsdp_bytes(layout, part, steps)}


def tied_bytes(m, layout, part):
    """The course's tied matrix under a pipeline: the end stages all-reduce its gradient shard."""
    ends = gpt_style(m) and layout.pp > 1 and (part.first or part.last)
    return m.vocab * m.width * FP32 / (layout.dp * layout.cp * layout.tp) * ends


def fsdp_bytes(layout, part, steps):
    """FSDP's gathers (bf16) and reduce-scatters (fp32) over dp x cp, the experts over dp x cp /
    ep: once a step under a schedule; at pp 1 two gathers a micro-batch (forward, backward)."""
    g = layout.dp * layout.cp
    if layout.pp > 1:
        per, how = BF16 + FP32, "(2 + 4) B once"
    elif layout.sync == "every":
        per, how = steps * (2 * BF16 + FP32), f"{steps} micro-batches x (2 + 2 + 4) B"
    else:
        per, how = steps * 2 * BF16 + FP32, f"({steps} micro-batches x (2 + 2) + 4) B"
    edp = g // layout.ep
    dense = (g - 1) / g * part.dense * per
    experts = (edp - 1) / edp * part.experts / layout.ep * per
    return dense + experts, lambda: (
        f"({g}-1)/{g} x {part.dense:,.0f} params x {how}"
        + (f" + ({edp}-1)/{edp} x {part.experts / layout.ep:,.0f} expert params" if experts
           else ""))


# --------------------------------------------------------------------------------- the output
def report(m, c, fitting, misses, tried):
    """The table of the layouts that fit, best first, and the fastest that do not."""
    head = (f"{m.name}: {count(total_params(m))} parameters ({count(active_params(m))} "
            f"a token), {m.tokens_per_step:,} tokens a step of {m.seq_len:,} | {c.gpus:,} x "
            f"{c.name} ({c.gpus_per_node} a node, {c.gpu_memory_gb:g} GB, {USABLE:.0%} usable) "
            f"| {len(fitting):,} shown of the layouts that fit, of {tried:,} tried (estimates)")
    rows = [("#", "pp", "dp", "cp", "tp", "ep", "schedule", "micro x m", "recompute", "sync",
             "GB", "step s", "MFU", "bubble", "s in tp/cp/ep/pp/dp", "across nodes", "ch")]
    for i, p in enumerate(fitting, 1):
        rows.append((str(i),) + row(p))
    lines = [head, "", *table(rows)]
    if misses:
        lines += ["", "The fastest that do not fit, and the term that breaks each (GB):"]
        for p in misses:
            held = p["memory"]
            lines.append(f"  {p['name']}: {held['total'] / 1e9:,.1f} GB, {p['step_s']:,.3g} s; "
                         f"{p['breaks']} {held[p['breaks']] / 1e9:,.1f}")
    return "\n".join(lines)


def count(n):
    """842,496, 124M, 70.6B: a parameter count as people say it."""
    if n < 1e6:
        return f"{n:,}"
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def row(p):
    """One plan's cells, after its number."""
    lay, sec = dataclasses.asdict(p["layout"]), p["seconds"]
    schedule = lay["schedule"] + (f" V{lay['v']}" if lay["v"] > 1 else "")
    exposed = "/".join(f"{sec[g]:.2g}" for g in GROUPS)
    across = ",".join(g for g in GROUPS if p["across_nodes"][g] and p["bytes"][g]) or "none"
    return (str(lay["pp"]), str(lay["dp"]), str(lay["cp"]), str(lay["tp"]), str(lay["ep"]),
            schedule, f"{lay['micro']} x {p['micro_batches']}", lay["recompute"], lay["sync"],
            gigabytes(p["memory"]["total"]), f"{p['step_s']:,.3g}", f"{p['mfu']:.1%}",
            f"{p['bubble']:.1%}", exposed, across, p["runs_in"])


def gigabytes(n):
    return f"{n / 1e9:,.1f}" if n >= 0.95e9 else f"{n / 1e9:.2g}"


def table(rows):
    """Rows of cells as aligned text: numbers to the right, words to the left."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    numeric = [all(r[i].replace(",", "").replace(".", "").replace("%", "").isdigit()
                   for r in rows[1:]) for i in range(len(widths))]
    return ["  ".join(cell.rjust(w) if num else cell.ljust(w)
                      for cell, w, num in zip(r, widths, numeric)).rstrip() for r in rows]


def explain(m, c, layout):
    """One layout, term by term: each formula with its inputs, then the step."""
    plan = estimate(m, c, layout)
    held, timed = plan["terms"]
    lines = [f"{m.name} on {c.gpus:,} x {c.name}: {plan['name']} (estimates)", standing(m, c, plan),
             f"runs in chapter {plan['runs_in']}" if plan["runs_in"] != "-" else
             "no chapter's trainer runs this layout as a whole",
             f"memory of the fullest rank ({held['rank'][1]()}), GB:"]
    for name, (value, how) in held.items():
        if name not in ("rank", "total"):
            lines.append(f"  {name:<12} {value / 1e9:10,.2f}  = {how()}")
    usable = USABLE * c.gpu_memory_gb
    lines.append(f"  {'total':<12} {held['total'][0] / 1e9:10,.2f}  of {usable:g} usable: "
                 + ("fits" if plan["fits"] else f"does not fit ({plan['breaks']} the most)"))
    lines.append(f"time of the slowest rank (pp rank {timed['rank']}), s:")
    lines.append(f"  {'compute':<12} {timed['compute'][0]:10,.3f}  = {timed['compute'][2]()}")
    for g in GROUPS:
        seconds, sent, how = timed[g]
        where = "across nodes" if timed["across"][g] else "in a node"
        lines.append(f"  {g:<12} {seconds:10,.3f}  {sent / 1e9:,.2f} GB {where} = {how()}")
    lines += step_lines(plan, layout, timed)
    return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def ranked(m, c):
    """Every layout that fits, fastest first: the ranking, made once per model and cluster."""
    return tuple(sorted((p for p in map(lambda lay: estimate(m, c, lay), layouts(m, c))
                         if p["fits"]), key=speed))


def standing(m, c, plan):
    """Where the planner's ranking puts this layout: its place among those that fit."""
    fitting = ranked(m, c)
    names = [p["name"] for p in fitting]
    if plan["name"] not in names:
        skipped = not_tried(m, c, plan["layout"])
        why = f"the planner does not try it: {skipped}" if skipped else "it does not fit"
        why += "; nor does it fit" * bool(skipped and not plan["fits"])
        return (f"not among the {len(names):,} layouts the planner ranks ({why})"
                + (f"; the best: {names[0]}, {fitting[0]['step_s']:,.3g} s" if names else ""))
    best = fitting[0]
    return (f"place {names.index(plan['name']) + 1:,} of the {len(names):,} that fit; the best: "
            f"{best['name']}, {best['step_s']:,.3g} s, MFU {best['mfu']:.1%}")


def not_tried(m, c, lay):
    """In words, the rule of layouts() that leaves out a layout --layout accepts; None if none."""
    steps = m.tokens_per_step // m.seq_len // lay.dp // lay.micro
    most = 64 if lay.pp == 1 else 4
    rules = [
        (lay.tp > c.gpus_per_node, f"tp {lay.tp} spans more than a node's {c.gpus_per_node} GPUs"),
        (lay.cp > 2 and m.seq_len // lay.cp < MIN_CP_TOKENS,
         f"cp {lay.cp} leaves a rank {m.seq_len // lay.cp:,} tokens of each sequence, and it tries "
         f"at least {MIN_CP_TOKENS:,} a rank (or cp 2)"),
        (lay.micro not in micro_sizes(lay.micro, most),
         f"micro {lay.micro}: it tries powers of two up to {most} sequences"
         + " under a schedule" * (lay.pp > 1)),
        (lay.v not in (1, 2, 4), f"v {lay.v}: it tries V 2 and 4"),
        (lay.schedule == "gpipe" and steps >= lay.pp,
         f"gpipe where 1f1b runs (m {steps} >= pp {lay.pp}): 1f1b is as fast and holds less")]
    return next((words for bad, words in rules if bad), None)


def step_lines(plan, layout, timed):
    """How the step time and MFU follow from the terms (the overlap model)."""
    steps, busy = plan["micro_batches"], timed["busy"]
    window = timed["compute"][0] / (1 if layout.sync == "every" else steps)  # FSDP hides here
    return [f"bubble {plan['bubble']:.2%} = (pp - 1) / (V x m + pp - 1) = ({layout.pp} - 1) / "
            f"({layout.v} x {steps} + {layout.pp} - 1)",
            f"busy {busy:,.3f} s = compute + tp + cp + ep + pp (one after another)",
            f"step {plan['step_s']:,.3f} s = busy / (1 - bubble) + max(0, dp {timed['dp'][0]:,.3f}"
            f" - {window:,.3f} s: "
            + ("the step's compute, behind which FSDP's traffic of every micro-batch hides)"
               if layout.sync == "every" else "one micro-batch's compute, behind which FSDP's "
               "deferred traffic hides)"),
            f"MFU {plan['mfu']:.1%} = the model's FLOPs a step / (step x GPUs x peak)"]


COMPARED = ("layout", "GPUs", "micro x m", "state", "gathered", "gradients", "activations",
            "logits", "GB", "fits", "place", "GB sent tp/cp/ep/pp/dp", "s in tp/cp/ep/pp/dp",
            "compute s", "bubble", "step s", "MFU")


def compare(m, c, texts):
    """Several --layout side by side, a row each: the fullest rank's memory terms (GB), what
    each group sends a step (GB), the seconds. A layout naming dp runs on pp x dp x cp x tp GPUs."""
    rows = [COMPARED]
    for text in texts:
        own = own_gpus(text, c)
        p = estimate(m, own, parse_layout(text, m, own))
        held = [gigabytes(p["memory"][k]) for k in ("state", "gathered", "gradients",
                                                    "activations", "logits", "total")]
        sent = "/".join(gigabytes(p["bytes"][g]) for g in GROUPS)
        rows.append((text, f"{own.gpus:,}", f"{p['layout'].micro} x {p['micro_batches']}", *held,
                     "yes" if p["fits"] else "no", place(m, own, p), sent,
                     "/".join(seconds(p["seconds"][g]) for g in GROUPS),
                     seconds(p["seconds"]["compute"]), f"{p['bubble']:.1%}",
                     seconds(p["step_s"]), f"{p['mfu']:.1%}"))
    return "\n".join([f"{m.name}: {m.tokens_per_step:,} tokens a step of {m.seq_len:,} on "
                      f"{c.name}, {USABLE * c.gpu_memory_gb:g} GB usable (estimates; GB per GPU "
                      "of the fullest rank)", *table(rows)])


def place(m, c, plan):
    """The compared layout's place in the ranking of the layouts that fit its GPUs, as "3 of
    250", or "-" where it does not fit or is not among those the planner tries."""
    fitting = [p["name"] for p in ranked(m, c)]
    if plan["name"] not in fitting:
        return "-"
    return f"{fitting.index(plan['name']) + 1:,} of {len(fitting):,}"


def seconds(s):
    return f"{s:,.0f}" if s >= 1000 else f"{s:.3g}"


def own_gpus(text, c):
    """The cluster of a compared layout: pp x dp x cp x tp GPUs where it names dp, else --gpus."""
    given = {k.strip(): v.strip() for k, _, v in (item.partition("=") for item in text.split(","))}
    if "dp" not in given:
        return c
    sizes = [whole_number(given.get(k, "1"), k) for k in ("pp", "dp", "cp", "tp")]
    return dataclasses.replace(c, gpus=math.prod(sizes))


def bubble_table(pp, counts, per_rank):
    """--bubble: the share of a step a stage idles, for each m micro-batches and V stages a rank."""
    rows = [("m",) + tuple(f"V {v}" for v in per_rank)]
    for m in counts:
        rows.append((str(m),) + tuple(f"{(pp - 1) / (v * m + pp - 1):.1%}" for v in per_rank))
    return "\n".join([f"bubble at pp {pp} = (pp - 1) / (V x m + pp - 1), m micro-batches a step, "
                      "V stages a rank:", *table(rows)])


def write_outputs(args, model, cluster, fitting, misses, plans):
    """--json: every layout that fits and the misses shown; --svg: the chart."""
    if args.json:
        clean = [plain(p) for p in fitting + misses]
        doc = {"model": dataclasses.asdict(model), "cluster": dataclasses.asdict(cluster),
               "params": total_params(model), "active_params": active_params(model),
               "usable_share": USABLE, "tried": len(plans), "fitting": clean[:len(fitting)],
               "misses": clean[len(fitting):]}
        write_text(args.json, json.dumps(doc, indent=1) + "\n")
    if args.svg:
        write_text(args.svg, svg_chart(plans, f"{model.name} on {cluster.gpus:,} x {cluster.name}",
                                       USABLE * cluster.gpu_memory_gb))


def plain(plan):
    """A plan as JSON holds it: its formulas' texts left out, its layout a dict."""
    return {**{k: v for k, v in plan.items() if k != "terms"},
            "layout": dataclasses.asdict(plan["layout"])}


def layouts_json(m, c, texts):
    """--layout with --json: each layout's plan, as the table's --json writes one, with its
    cluster (a compared layout naming dp has its own GPUs) and its place in the ranking."""
    found = []
    for text in texts:
        own = own_gpus(text, c) if len(texts) > 1 else c
        plan = estimate(m, own, parse_layout(text, m, own))
        found.append({"given": text, "cluster": dataclasses.asdict(own),
                      "place": place(m, own, plan), **plain(plan)})
    doc = {"model": dataclasses.asdict(m), "params": total_params(m),
           "active_params": active_params(m), "usable_share": USABLE, "layouts": found}
    return json.dumps(doc, indent=1) + "\n"


def write_text(path, text):
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as err:
        raise InputError(f"cannot write {path}: {err.strerror}") from None


def svg_chart(plans, title, usable_gb):
    """Memory per GPU against step time, both on log scales, every layout a dot: blue if it fits,
    grey if not; the dashed line is the usable memory."""
    w, h, left, bottom, top = 720, 440, 80, 50, 50
    xs = [math.log10(p["step_s"]) for p in plans]
    ys = [math.log10(max(p["memory"]["total"] / 1e9, 1e-3)) for p in plans]
    x0, x1, y0 = math.floor(min(xs)), math.ceil(max(xs)), math.floor(min(ys))
    y1 = max(math.ceil(max(ys)), math.ceil(math.log10(usable_gb)))
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)  # at least one power of 10 each way

    def at(x, y):  # the picture's coordinates of log values x, y
        return (left + (w - left - 20) * (x - x0) / (x1 - x0),
                h - bottom - (h - bottom - top) * (y - y0) / (y1 - y0))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family='
             f'"sans-serif" font-size="12"><rect width="{w}" height="{h}" fill="white"/><text x='
             f'"{w / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}: memory per '
             'GPU against step time (estimates)</text>']
    parts += axes(at, (x0, x1, y0, y1), (w, h, left, bottom))
    usable_y = at(x0, math.log10(usable_gb))[1]
    parts.append(f'<line x1="{left}" x2="{w - 20}" y1="{usable_y:.1f}" y2="{usable_y:.1f}" '
                 'stroke="#c33" stroke-dasharray="5,4"/>')
    parts += [dot(p, *at(x, y)) for p, x, y in sorted(zip(plans, xs, ys),
                                                      key=lambda t: t[0]["fits"])]  # fits on top
    return "\n".join(parts + ["</svg>"]) + "\n"


def dot(plan, cx, cy):
    """One layout's dot, its name shown on hover."""
    return (f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="2.5" fill="'
            f'{"#3b73b9" if plan["fits"] else "#bbb"}"><title>{escape(plan["name"])}</title>'
            '</circle>')


def axes(at, bounds, frame):
    """Grid lines at the powers of 10, their labels, and the axes' names."""
    (x0, x1, y0, y1), (w, h, left, bottom) = bounds, frame
    parts = []
    for k in range(x0, x1 + 1):
        x = at(k, y0)[0]
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{at(k, y1)[1]:.1f}" '
                     f'y2="{h - bottom}" stroke="#ddd"/><text x="{x:.1f}" y="{h - bottom + 16}" '
                     f'text-anchor="middle">{10.0 ** k:g}</text>')
    for k in range(y0, y1 + 1):
        y = at(x0, k)[1]
        parts.append(f'<line x1="{left}" x2="{w - 20}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{10.0 ** k:g}</text>')
    parts.append(f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">step time, s</text>')
    parts.append(f'<text x="16" y="{h / 2}" transform="rotate(-90 16 {h / 2})" '
                 'text-anchor="middle">memory per GPU, GB (dashed: usable)</text>')
    return parts


def escape(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# ---------------------------------------------------------------- one layout named by the user
LAYOUT_KEYS = ("pp", "dp", "cp", "tp", "ep", "schedule", "v", "micro", "recompute", "sync")


def parse_layout(text, m, c):
    """--layout pp=2,tp=8,...: the Layout, its sizes checked; dp defaults to what is left."""
    given = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key.strip() not in LAYOUT_KEYS or not value.strip():
            raise InputError(f"--layout: {item!r} is not KEY=VALUE with KEY one of "
                             + ", ".join(LAYOUT_KEYS))
        if key.strip() in given:
            raise InputError(f"--layout: {key.strip()} given twice in {text!r}")
        given[key.strip()] = value.strip()
    sizes = {k: whole_number(given.get(k, "1"), k) for k in ("pp", "cp", "tp", "ep", "v", "micro")}
    rest = c.gpus // (sizes["pp"] * sizes["cp"] * sizes["tp"]) or 1
    sizes["dp"] = whole_number(given.get("dp", str(rest)), "dp")
    pp = sizes["pp"]
    schedule = given.get("schedule", "1f1b" if pp > 1 else "none")
    if schedule == "interleaved-1f1b" and "v" not in given:
        sizes["v"] = 2
    layout = Layout(schedule=schedule, recompute=given.get("recompute", "none"),
                    sync=given.get("sync", "last" if pp > 1 else "every"), **sizes)
    check_layout(layout, m, c)
    return layout


def whole_number(text, key):
    if not text.isdigit() or int(text) == 0:
        raise InputError(f"--layout: {key}={text} must be a positive whole number")
    return int(text)


def check_layout(lay, m, c):
    """One line for the first size that does not divide, or a schedule the trainers refuse."""
    sequences = m.tokens_per_step // m.seq_len
    ranks = lay.pp * lay.dp * lay.cp * lay.tp
    steps = sequences // lay.dp // lay.micro if sequences % lay.dp == 0 else 0
    problems = [
        (ranks != c.gpus, f"pp {lay.pp} x dp {lay.dp} x cp {lay.cp} x tp {lay.tp} is {ranks:,} "
                          f"ranks, not the {c.gpus:,} GPUs"),
        (m.heads % lay.tp, f"tp {lay.tp} does not divide the {m.heads} heads"),
        (m.kv_heads % lay.tp and not m.mla,
         f"tp {lay.tp} does not divide the {m.kv_heads} key-value heads"),
        (lay.ep > 1 and not m.experts, f"ep {lay.ep} needs a model with experts"),
        (m.experts % lay.ep, f"ep {lay.ep} does not divide the {m.experts} experts"),
        ((lay.dp * lay.cp) % lay.ep, f"ep {lay.ep} does not divide dp x cp = {lay.dp * lay.cp}"),
        (m.seq_len % (2 * lay.cp) or m.seq_len % (lay.cp * lay.tp),
         f"cp {lay.cp} (x tp {lay.tp}) does not cut the {m.seq_len:,} tokens of a sequence into "
         f"2 cp chunks and cp x tp parts"),
        (sequences % (lay.dp * lay.micro), f"dp {lay.dp} x micro {lay.micro} does not divide the "
                                           f"{sequences:,} sequences a step"),
    ]
    problems += schedule_problems(lay, m, steps)
    for bad, line in problems:
        if bad:
            raise InputError(f"--layout: {line}")


def schedule_problems(lay, m, steps):
    """The pipeline's rules, as the trainers enforce them."""
    schedules = ("gpipe", "1f1b", "interleaved-1f1b") if lay.pp > 1 else ("none",)
    return [
        (lay.schedule not in schedules, f"schedule={lay.schedule}: at pp {lay.pp} one of "
                                        + ", ".join(schedules)),
        (lay.recompute not in ("none", "full"), "recompute must be none or full"),
        (lay.sync not in ("every", "last") or (lay.pp > 1 and lay.sync != "last"),
         "sync must be every or last, and last under a pipeline schedule, which defers it"),
        ((lay.v > 1) != (lay.schedule == "interleaved-1f1b"),
         "v above 1 goes with schedule=interleaved-1f1b, and only with it"),
        (lay.pp * lay.v > m.layers, f"pp {lay.pp} x v {lay.v} stages exceed the {m.layers} layers"),
        (lay.schedule == "1f1b" and steps < lay.pp,
         f"1f1b needs at least pp = {lay.pp} micro-batches a step, not {steps}"),
        (lay.schedule == "interleaved-1f1b" and steps % lay.pp,
         f"interleaved-1f1b needs micro-batches in rounds of pp = {lay.pp}, not {steps}")]


def nearest_change(m, c, plans):
    """The line for a model that fits no layout: its least memory, and the nearest change that
    fits, more GPUs or a shorter sequence (recomputation was tried already)."""
    if not plans:
        return (f"no layout of {c.gpus:,} GPUs divides {m.name}'s "
                f"{m.tokens_per_step // m.seq_len:,} sequences a step: give --gpus a divisor")
    least = min(plans, key=lambda p: p["memory"]["total"])
    counts = gpu_counts(m, c)
    gpus = next((n for n in counts if fits_any(m, dataclasses.replace(c, gpus=n))), None)
    seq = next((s for s in (m.seq_len // 2**k for k in range(1, 12)) if s >= 2 and fits_any(
        dataclasses.replace(m, seq_len=s), c)), None)
    options = ([f"--gpus {gpus}, the fewest that fit"] if gpus else []) + (
        [f"--seq-len {seq}"] if seq else [])
    return (f"no layout of {m.name} fits {c.gpus:,} GPUs of {c.gpu_memory_gb:g} GB, full "
            f"recomputation tried: the least memory is {least['memory']['total'] / 1e9:,.1f} GB "
            f"({least['name']}; {least['breaks']} "
            f"{least['memory'][least['breaks']] / 1e9:,.1f} GB); the nearest change: "
            + (" or ".join(options) or f"none found in whole nodes from {counts[0]:,} to "
               f"{counts[-1]:,} GPUs, nor at shorter sequences"))


GPU_COUNTS = 64  # whole-node GPU counts the nearest change tries, from the first that could fit


def gpu_counts(m, c):
    """More GPUs, a whole node at a time: from the first count whose GPUs could hold the state
    (16 B a parameter over all of them, at most the usable memory each), GPU_COUNTS of them."""
    node, usable = c.gpus_per_node, USABLE * c.gpu_memory_gb * 1e9
    least = max(c.gpus + 1, math.ceil(16 * total_params(m) / usable))
    first = math.ceil(least / node) * node
    return [first + k * node for k in range(GPU_COUNTS)]


def fits_any(m, c):
    return any(estimate(m, c, layout)["fits"] for layout in layouts(m, c))


# ------------------------------------------------------- the numbers the chapters' rank 0 prints
# Each chapter's flags that change its lines, with that chapter's defaults; its other flags
# are ignored. The byte data (the default, or a text file) has 256 token values; --data FILE.bin
# or a folder of ids with --vocab-size N has N (a folder's meta.pkl is not read). --device auto
# is read as a CPU (fp32 under --amp auto): the planner cannot look for a GPU.
COMMON = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=16, grad_accum=1,
              amp="auto", device="auto", grad_checkpointing=False, dropout=0.0, vocab_size=None,
              data=None)
CHAPTER_FLAGS = {
    7: dict(grad_sync="every"),
    8: dict(tp=2, sequence_parallel="on", grad_sync="every"),
    9: dict(grad_accum=4, pp=2, schedule="1f1b", stages_per_rank=1),
    10: dict(cp=2, cp_rotate="allgather", grad_sync="every"),
    11: dict(grad_accum=4, pp=2, cp=2, tp=2, sequence_parallel="on", schedule="1f1b",
             stages_per_rank=1),
    12: dict(experts=4, experts_per_token=2, shared_expert=False, capacity_factor=None,
             grad_sync="every", ep=1),
}
SCRIPTS = {"train_fsdp_minigpt.py": 7, "train_tp_minigpt.py": 8, "train_pp_minigpt.py": 9,
           "train_cp_minigpt.py": 10, "train_4d_minigpt.py": 11, "train_moe_minigpt.py": 12}


def sized_lines(chapter, worlds, flags):
    """--chapter-lines at each of the world sizes; with several, each line led by its size."""
    if len(worlds) == 1:
        return chapter_lines(chapter, worlds[0], flags)
    return [f"{n} processes: {line}" for n in worlds for line in chapter_lines(chapter, n, flags)]


def chapter_lines(chapter, world, flags):
    """The lines chapter `chapter`'s rank 0 prints about what a rank holds and sends, at
    `world` processes with the chapter's `flags`, in the order it prints them."""
    number = SCRIPTS.get(chapter) or (int(chapter) if chapter.isdigit() else 0)
    if number not in CHAPTER_FLAGS:
        raise InputError(f"--chapter-lines {chapter}: a chapter 7-12 or one of "
                         + ", ".join(SCRIPTS))
    a = chapter_args(number, flags)
    ids = a.data and (a.data.endswith(".bin") or os.path.isdir(a.data))  # token ids, not bytes
    a.vocab = a.vocab_size if ids and a.vocab_size else 256
    a.width = 2 if a.amp == "bf16" or (a.amp == "auto" and a.device == "cuda") else 4
    a.where = "cuda" if a.device == "cuda" else "cpu"
    for bad, line in chapter_problems(a):
        if bad:
            raise InputError(line)
    return {7: fsdp_lines, 8: tp_lines, 9: pp_lines, 10: cp_lines, 11: mesh_lines,
            12: expert_lines}[number](a, world)


def chapter_args(number, flags):
    """The chapter's flags among `flags`, over its defaults."""
    p = Parser(prog=f"plan_layout.py --chapter-lines {number}", add_help=False, allow_abbrev=False)
    for name, default in {**COMMON, **CHAPTER_FLAGS[number]}.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true")
        elif name in ("amp", "device", "grad_sync", "sequence_parallel", "schedule", "cp_rotate",
                      "data"):
            p.add_argument(flag, default=default)
        else:
            p.add_argument(flag, type=float if name in ("dropout", "capacity_factor") else
                           whole if name == "experts" else positive_int, default=default)
    args, _ = p.parse_known_args(flags)
    return args


def chapter_problems(a):
    """(refused?, the line) for the sizes the chapters refuse before they print these lines."""
    tp, cp, pp = getattr(a, "tp", 1), getattr(a, "cp", 1), getattr(a, "pp", 1)
    stages, e = pp * getattr(a, "stages_per_rank", 1), getattr(a, "experts", 0)
    k, sp = getattr(a, "experts_per_token", 1), getattr(a, "sequence_parallel", "off") == "on"
    return [(a.n_embd % a.n_head, f"--n-head {a.n_head} does not divide --n-embd {a.n_embd}"),
            (a.n_head % tp, f"--tp {tp} does not divide --n-head {a.n_head}"),
            (stages > a.n_layer, f"{stages} stages exceed --n-layer {a.n_layer}"),
            (a.block_size % (2 * cp) or (sp and a.block_size % (cp * tp)),
             f"--block-size {a.block_size} is not a multiple of 2 x --cp {cp} (and of cp x tp)"),
            (e and not 1 <= k <= e, f"--experts-per-token {k} must be between 1 and {e}"),
            (e and (4 * a.n_embd) % k, f"--experts-per-token {k} must divide 4 x --n-embd")]


def gpt_tensors(a, stage_parts=None, mlp=None):
    """The course's GPT, parameter by parameter: (rows, columns, how TP splits it: by "rows",
    by "cols" or not). stage_parts: (embeddings?, block indices, final norm and head?); mlp:
    what stands in each block's MLP (the experts aside)."""
    c, first, blocks, last = a.n_embd, True, range(a.n_layer), True
    if stage_parts:
        first, blocks, last = stage_parts
    norm = [(c, 1, None), (c, 1, None)]  # LayerNorm: weight, bias
    dense = [(4 * c, c, "rows"), (4 * c, 1, "rows"), (c, 4 * c, "cols"), (c, 1, None)]
    block = norm + [(3 * c, c, "rows"), (3 * c, 1, "rows"), (c, c, "cols"), (c, 1, None)] + norm \
        + (dense if mlp is None else mlp)
    ends = [(a.vocab, c, "rows"), (a.block_size, c, None)] if first else []
    head = norm + [(a.vocab, c, "rows")] * (not first)  # tied: one matrix where both ends sit
    return ends + block * len(blocks) + (head if last else [])


def rank0_numel(tensor, tp, shards):
    """Rank 0's part of a parameter: TP's first part (ceil), then FSDP's first of `shards` rows
    (ceil: torch.chunk's first piece)."""
    rows, cols, split = tensor
    if tp > 1 and split == "rows":
        rows = -(-rows // tp)
    if tp > 1 and split == "cols":
        cols = -(-cols // tp)
    return -(-rows // shards) * cols


def numel(tensors):
    return sum(rows * cols for rows, cols, _ in tensors)


def memory_words(a, mine, full):
    return (f"memory per rank ({a.where}): weights, gradients and AdamW state "
            f"{16 * mine / 2**20:.2f} MiB ({mine:,} of {full:,} parameters; DDP: "
            f"{16 * full / 2**20:.2f} MiB)")


def accumulation_words(a, whole):
    """The gradients held between micro-batches, as chapters 7, 8, 10 and 12 print them."""
    if a.grad_sync == "every":
        return (f"--grad-sync every: gradients stay sharded between micro-batches; the "
                f"{whole / 2**20:.2f} MiB of them reduce-scattered {a.grad_accum} times per step, "
                "unit by unit")
    return (f"--grad-sync last: every rank holds the whole gradients, {whole / 2**20:.2f} MiB, "
            "from the first micro-batch to the last; reduce-scattered once per step")


def fsdp_lines(a, world):
    tensors = gpt_tensors(a)
    mine, full = sum(rank0_numel(t, 1, world) for t in tensors), numel(tensors)
    lines = [memory_words(a, mine, full) + "; every parameter is sharded, the embeddings too"]
    return lines + [accumulation_words(a, 4 * full)] * (a.grad_accum > 1)


def tp_lines(a, world):
    divides(world, a.tp, "--tp")
    tensors = gpt_tensors(a)
    mine = sum(rank0_numel(t, a.tp, world // a.tp) for t in tensors)
    whole = 4 * sum(r * c // (a.tp if s and a.tp > 1 else 1) for r, c, s in tensors)
    lines = [memory_words(a, mine, numel(tensors))]
    return lines + [accumulation_words(a, whole)] * (a.grad_accum > 1) + [tp_traffic(a)]


def divides(world, size, flag):
    if world % size:
        raise InputError(f"{flag} {size} does not divide the world size {world}")


def tp_traffic(a):
    """The TP traffic line: the collectives on the activations (B, T, C) a step."""
    if a.tp == 1:
        return "TP traffic per rank: none (--tp 1: FSDP alone)"
    tensor = a.batch_size * a.block_size * a.n_embd * a.width
    again = a.n_layer * a.grad_accum if a.grad_checkpointing else 0  # recomputed forwards
    reduced = again * (2 if a.dropout else 1)
    each = (4 * a.n_layer + 2) * a.grad_accum
    if a.sequence_parallel == "on":
        gathers, scatters = each + 2 * again, each + reduced
        what, halves = f"{gathers} all-gathers and {scatters} reduce-scatters", gathers + scatters
    else:
        what, halves = f"{each + reduced} all-reduces", 2 * (each + reduced)
    sent = halves * tensor * (a.tp - 1) / a.tp
    return (f"TP traffic per rank: {what} of {tensor / 2**20:.2f} MiB per step, "
            f"{sent / 2**20:.2f} MiB sent (tp {a.tp}, sequence parallel {a.sequence_parallel})")


def pipeline_holdings(a, world, tp, shards):
    """(stage label, parts, parameters of rank 0's shards, bytes inside a step) of each pp rank's
    first rank: its stages r, r + pp, ..., FSDP over `shards`, TP over `tp`."""
    out, v = [], a.stages_per_rank
    for r in range(a.pp):
        stages = [r + k * a.pp for k in range(v)]
        blocks = [b for s in stages for b in stage_blocks(a.n_layer, a.pp * v, s)]
        first, last = 0 in stages, a.pp * v - 1 in stages
        tensors = gpt_tensors(a, (first, blocks, last))
        span = f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}-{blocks[-1]}"
        span = "blocks " + ", ".join(map(str, blocks)) if v > 1 else span
        parts = ["embeddings"] * first + [span] + ["final norm and head"] * last
        mine = sum(rank0_numel(t, tp, shards) for t in tensors)
        gathered = sum(r_ * c // (tp if s and tp > 1 else 1) for r_, c, s in tensors)
        out.append(((f"stage {r}" if v == 1 else "stages " + ", ".join(map(str, stages))),
                    ", ".join(parts), mine, gathered, first))
    return out


def stages_memory(a, held, inside):
    """The memory line of chapters 9 and 11, from each stage's holdings and bytes in a step."""
    whole = numel(gpt_tensors(a))
    stages = [f"{label} ({parts}) {16 * n / 2**20:.2f} MiB, {n:,} parameters"
              for label, parts, n, _, _ in held]
    within = [f"{label} {b / 2**20:.2f} MiB" for (label, *_), b in zip(held, inside)]
    return (f"memory per rank ({a.where}): weights, gradients and AdamW state: "
            f"{'; '.join(stages)} (of {whole:,}; DDP: {16 * whole / 2**20:.2f} MiB); inside a "
            f"step also the weights gathered and the gradients whole: {', '.join(within)}, "
            "activations aside" + " (at most: the interleaved schedule's order decides which "
            "stages overlap)" * (a.stages_per_rank > 1))


def pp_lines(a, world):
    divides(world, a.pp, "--pp")
    dp, v = world // a.pp, a.stages_per_rank
    held = pipeline_holdings(a, world, 1, dp)
    memory = stages_memory(a, held, [g * (a.width + 4) for _, _, _, g, _ in held])
    if a.pp == 1:
        return [memory, "PP traffic per rank: none (--pp 1: FSDP alone)"]
    tensor = a.batch_size * a.block_size * a.n_embd * a.width * v
    tied = a.vocab * a.n_embd * 4 / dp
    return [memory, f"PP traffic per rank: {tensor / 2**20:.2f} MiB of activations to the next "
            f"stage and {tensor / 2**20:.2f} MiB of their gradients back, per micro-batch "
            f"({a.grad_accum} per step); the tied matrix: an all-reduce of {tied / 2**20:.2f} MiB "
            f"per step between stage 0 and stage {a.pp * v - 1}"
            + "; rank 0 sends one gradient fewer, the last rank one activation fewer" * (v > 1)]


def cp_lines(a, world):
    divides(world, a.cp, "--cp")
    tensors = gpt_tensors(a)
    mine, full = sum(rank0_numel(t, 1, world) for t in tensors), numel(tensors)
    memory = memory_words(a, mine, full) + "; every parameter is sharded, the embeddings too"
    return [split_words(a), memory] + [accumulation_words(a, 4 * full)] * (a.grad_accum > 1)


def split_words(a):
    """Chapter 10's split line: each rank's share of causal attention's (query, key) pairs, and
    the bytes a rank sends per block and micro-batch."""
    cp, t = a.cp, a.block_size
    size = t // (2 * cp)
    held = [[*range(r * size, (r + 1) * size), *range((2 * cp - 1 - r) * size, (2 * cp - r) * size)]
            for r in range(cp)]
    pairs = [sum(p + 1 for p in positions) for positions in held]  # query p reads p + 1 keys
    contiguous = [sum(range(r * t // cp + 1, (r + 1) * t // cp + 1)) for r in range(cp)]
    kv = 2 * a.batch_size * t // cp * a.n_embd * a.width
    ring = a.cp_rotate == "ring"
    kv_sends, grad_sends = (cp - 1) * (2 + a.grad_checkpointing * ring), cp - 1 + ring
    how = (f"K, V in {kv_sends} ring passes and their fp32 gradients in {grad_sends}" if ring else
           "K, V all-gathered in forward and backward and their fp32 gradients reduce-scattered")
    return (f"CP split: {2 * cp} chunks of {size} tokens, rank i of a row holds chunks i "
            f"and {2 * cp - 1} - i | attention pairs per rank: {percents(pairs)} (contiguous "
            f"shares would give {percents(contiguous)}) | sent per block and micro-batch: "
            f"{kv * (kv_sends + grad_sends * 4 / a.width) / 2**20:.2f} MiB, {how}")


def percents(counts):
    return ", ".join(f"{100 * n / sum(counts):.1f}%" for n in counts)


def mesh_lines(a, world):
    """Chapter 11: the memory line of each stage's first rank, and rank 0's traffic line."""
    divides(world, a.pp * a.cp * a.tp, "--pp x --cp x --tp")
    held = pipeline_holdings(a, world, a.tp, world // (a.pp * a.tp))
    inside = []
    for _, _, _, gathered, first in held:
        emb = a.vocab * a.n_embd if first and a.tp > 1 else 0  # its gradient comes back whole
        inside.append(gathered * a.width + 4 * (gathered + emb - emb // a.tp) * (a.pp > 1))
    return [stages_memory(a, held, inside), mesh_traffic(a, world)]


def mesh_traffic(a, world):
    """Chapter 11's line: what rank 0 (stage 0) sends a step in its tp, cp and pp groups."""
    k, tp, cp, v = a.grad_accum, a.tp, a.cp, a.stages_per_rank
    mine = range(0, a.pp * v, a.pp)
    blocks = sum(len(stage_blocks(a.n_layer, a.pp * v, s)) for s in mine)
    stream = a.batch_size * a.block_size // cp * a.n_embd * a.width
    tp_ops = (4 * blocks + 1 + (a.pp == 1)) * k
    split = tp if a.sequence_parallel == "on" else 1
    hop = a.batch_size * (a.block_size // cp // split) * a.n_embd * a.width
    sent = {"tp": 2 * tp_ops * stream * (tp - 1) / tp,
            "cp": blocks * k * (cp - 1) * (2 * stream / tp) * (2 + 4 / a.width),
            "pp": (k * (2 * v - 1) * hop + a.vocab * a.n_embd * 4 / (world // a.pp)) * (a.pp > 1)}
    stages = "stage 0" if v == 1 else "stages " + ", ".join(map(str, mine))
    ops = f"tp: {tp_ops} collectives of {stream / 2**20:.3f} MiB; " * (tp > 1)
    return (f"traffic per step, rank 0 ({stages}, {blocks} blocks): " + " | ".join(
        f"{dim} {n / 2**20:.3f} MiB" for dim, n in sent.items()) + f" ({ops}FSDP's gathers aside)")


def expert_lines(a, world):
    """Chapter 12: the experts line (with experts), the memory line, the accumulation line."""
    divides(world, a.ep, "--ep")
    c, e, k = a.n_embd, a.experts, a.experts_per_token
    if e % a.ep:
        raise InputError(f"--ep {a.ep} does not divide --experts {e}")
    hidden = 4 * c // k if e else 0
    expert = [(hidden, c, None), (hidden, 1, None), (c, hidden, None), (c, 1, None)]
    mixture = [(e, c, None)] + expert * a.shared_expert  # the router, the shared expert
    rest = gpt_tensors(a, mlp=mixture) if e else gpt_tensors(a)
    held = a.n_layer * (e // a.ep)  # rank 0's experts, each sharded over its column
    mine = sum(rank0_numel(t, 1, world) for t in rest) \
        + held * sum(rank0_numel(t, 1, world // a.ep) for t in expert)
    full = numel(rest) + a.n_layer * e * numel(expert)
    memory = memory_words(a, mine, full) + ("; every parameter is sharded, the embeddings too, "
                                            "and each expert over its column")
    whole = 4 * (numel(rest) + held * numel(expert))
    lines = [experts_words(a, numel(expert))] if e else []
    return lines + [memory] + [accumulation_words(a, whole)] * (a.grad_accum > 1)


def experts_words(a, expert):
    c, e, k = a.n_embd, a.experts, a.experts_per_token
    line = (f"experts {e} per block, {k} per token, each {4 * c // k} wide: a token uses "
            f"{k * expert:,} of their {e * expert:,} parameters (the dense MLP: "
            f"{2 * c * 4 * c + 5 * c:,}) | rank 0 holds experts 0-{e // a.ep - 1}")
    if a.capacity_factor:
        copies = a.batch_size * a.block_size * k
        line += (f" | capacity {a.capacity_factor}: at most "
                 f"{math.ceil(a.capacity_factor * copies / e)} of a rank's {copies} copies "
                 "per expert, the rest dropped")
    if a.shared_expert:
        line += f" | a shared expert too: {(k + 1) * expert:,} parameters a token"
    return line


# ------------------------------------------------------------------------------------ flags
class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text):
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return int(text)


def whole(text):
    """0 or a positive whole number (--misses 0 lists none)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number, 0 or more, got {text!r}")
    return int(text)


def amount(text):
    """A size or a speed: a finite number above 0 (a link of 0 GB/s would divide by zero)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def share(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, got {text!r}")
    return value


def parse_args(argv):
    """The flags; the ones after `--` are a chapter's, for --chapter-lines."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = Parser(prog="plan_layout.py", description="Which layout for my model on my cluster?")
    model_flags(p.add_argument_group("the model", MODEL_BY_FLAGS).add_argument)
    cluster_flags(p.add_argument_group("the cluster", presets_words()).add_argument)
    a = p.add_argument_group("what to print").add_argument
    a("--layout", metavar="K=V,...", action="append", help="explain one layout term by term: "
      "pp=2,tp=8,dp=4,cp=1,ep=1,schedule=1f1b,v=1,micro=1,recompute=full,sync=last (dp: what is "
      "left); given more than once, the layouts side by side, each naming dp on its own GPUs")
    a("--bubble", metavar="PP", type=positive_int, help="the bubble at PP stages, a row for each "
      "--micro-batches and a column for each --stages-per-rank")
    a("--micro-batches", metavar="M", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16])
    a("--stages-per-rank", metavar="V", type=positive_int, nargs="+", default=[1])
    a("--top", type=positive_int, default=15, help="the layouts that fit to list (default: 15)")
    a("--misses", type=whole, default=5,
      help="the fastest that do not fit to list, 0 for none (default: 5)")
    a("--json", metavar="FILE", help="also write the plans as JSON, for tools: the table's "
      "(every layout that fits, and the misses shown) or each --layout's")
    a("--svg", metavar="FILE", help="also draw memory against step time, every layout tried a "
      "dot (with the table only)")
    a("--chapter-lines", metavar="CHAPTER", help="print the lines chapter 7-12's rank 0 prints "
      "about what a rank holds and sends, for the flags after --")
    a("--world-size", type=positive_int, nargs="+", help="the chapter's process count, for "
      "--chapter-lines; several: a line for each, led by its count")
    args = p.parse_args(argv)
    refuse_flags_unused(p, args)
    args.rest = rest
    return args


def refuse_flags_unused(p, args):
    """A flag that needs another, or one that would do nothing: --json and --svg write the
    ranked table's plans (--json also --layout's), so they are refused elsewhere."""
    if args.chapter_lines and not args.world_size:
        p.error("--chapter-lines needs --world-size")
    if args.world_size and not args.chapter_lines:
        p.error("--world-size goes with --chapter-lines (a chapter's process count)")
    modes = [flag for flag, given in (("--bubble", args.bubble), ("--chapter-lines",
             args.chapter_lines), ("--layout", args.layout)) if given]
    if len(modes) > 1:
        p.error(f"{' and '.join(modes)} print different things: give one")
    alone = "--bubble" if args.bubble else "--chapter-lines" if args.chapter_lines else None
    if alone and (args.json or args.svg):
        p.error(f"--json and --svg write plans: {alone} makes none")
    if args.layout and args.svg:
        p.error("--svg draws every layout tried: it goes with the table, not with --layout")


MODEL_BY_FLAGS = ("--preset gives every number; a flag given replaces the preset's. Without "
                  "--preset, a model given by flags starts from course-gpt's shape and takes "
                  "--seq-len 4096, --tokens-per-step 4,194,304 (2^22), --mlp gelu, --kv-heads "
                  "= --heads and --mlp-width = 4 x --width unless given.")


def presets_words():
    """The cluster presets' numbers, for --help: what a flag not given takes."""
    rows = [f"{name}: {c['gpu_memory_gb']:g} GB, {c['peak_tflops']:g} TFLOPS, "
            f"{c['gpus_per_node']} GPUs a node, {c['intra_node_gbps']:g} GB/s in a node and "
            f"{c['inter_node_gbps']:g} across" for name, c in sorted(CLUSTERS.items())]
    return "--cluster gives every number a flag below leaves out: " + "; ".join(rows) + "."


def model_flags(a):
    a("--preset", choices=sorted(PRESETS), help="a model's shape (default: course-gpt)")
    for flag, what in (("--layers", "layers"), ("--width", "the residual stream's width"),
                       ("--heads", "attention heads"), ("--kv-heads", "key-value heads (GQA)"),
                       ("--mlp-width", "the MLP's hidden units (each expert's, with experts)"),
                       ("--vocab", "the vocabulary"), ("--seq-len", "tokens a sequence"),
                       ("--tokens-per-step", "tokens an optimizer step, all replicas"),
                       ("--experts", "routed experts per layer"),
                       ("--experts-per-token", "the experts a token goes to"),
                       ("--shared-experts", "experts every token goes to")):
        dest = {"--experts-per-token": "top_k", "--shared-experts": "shared"}.get(flag)
        a(flag, type=positive_int, dest=dest or flag[2:].replace("-", "_"), help=what)
    a("--mlp", choices=["gelu", "swiglu"], help="gelu: the course's GPT block (biases, LayerNorm, "
      "learned positions, tied head); swiglu: Llama's")


def cluster_flags(a):
    a("--cluster", choices=sorted(CLUSTERS), default="h100-sxm", help="(default: h100-sxm)")
    a("--gpus", type=positive_int, default=8, help="GPUs in all (default: 8)")
    a("--gpus-per-node", type=positive_int, help="GPUs a node: tp stays within one "
      "(default: the --cluster's)")
    a("--gpu-memory-gb", type=amount, help="one GPU's memory, GB; 90%% of it usable "
      "(default: the --cluster's)")
    a("--peak-tflops", type=amount, help="dense bf16 TFLOPS of one GPU (default: the --cluster's)")
    a("--intra-node-gbps", type=amount, help="GB/s (bytes) one GPU sends one way in its node "
      "(default: the --cluster's)")
    a("--inter-node-gbps", type=amount, help="GB/s (bytes) one GPU sends one way across nodes "
      "(default: the --cluster's)")
    a("--efficiency", type=share, default=0.6,
      help="the share of the peak a layer's matrix products reach (default: 0.6, assumed)")


def quiet_on_a_closed_pipe():
    """main(), where a reader such as `head` may close the pipe early: then no traceback, and the
    exit code a shell gives a command stopped by SIGPIPE (128 + 13)."""
    try:
        code = main()
        sys.stdout.flush()  # a late write fails here, inside the try, not at the interpreter's exit
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush
        code = 141
    return code


if __name__ == "__main__":
    sys.exit(quiet_on_a_closed_pipe())
