r"""Chapter 6: how well does distributed training scale on this machine? This script runs a trainer
under torchrun at several process counts and reports its throughput, speedup and scaling efficiency.
With --collectives it times the collectives themselves instead.

    python benchmark_scaling.py --device cpu      # train_ddp_basic.py at 1, 2, 4... processes
    python benchmark_scaling.py --nproc 1 2 4 8 --json scaling.json --svg scaling.svg   # 8 GPUs
    python benchmark_scaling.py --strong 256      # 256 samples per step at every process count
    # another trainer; the flags after -- go to the trainer
    python benchmark_scaling.py --trainer train_ddp_minigpt.py -- --benchmark --max-steps 20
    python benchmark_scaling.py --collectives --max-bytes 64M   # all_reduce, broadcast, barrier
    # the collectives on 2 nodes of 8 GPUs: the launcher prints the torchrun command of each node
    ./launch_multinode_ddp.sh --nnodes 2 --nproc-per-node 8 --master-addr NODE0 \
        benchmark_scaling.py --collectives

Terms. Each process that torchrun starts is a rank, numbered from 0. The world size is the number
of ranks. A collective is an operation that every rank must call, and it completes only when all
have called it. An all-reduce is a collective that sums a tensor over all ranks and gives each
rank the sum. A broadcast copies one rank's tensor to every rank. A barrier only waits until every
rank has reached it.

Weak scaling is the default. It keeps the trainer's batch per process, so the global batch grows
with the process count, and ideally N times the processes give N times the throughput. Strong
scaling (--strong GLOBAL) splits one fixed global batch over the processes instead. The speedup
is a count's throughput over the smallest count's. The efficiency is the speedup over the ideal.
A run's throughput comes from the `summary` line its trainer prints, the median over the steps
after warm-up, so start-up, evaluation and checkpoints do not count.

See also docs/conventions.md (the `summary` line) and nccl-tests' PERFORMANCE.md (algbw, busbw).
"""
import argparse
import datetime
import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# The bus bandwidth (busbw) is the algorithm bandwidth (algbw, bytes over time) times this factor
# at n ranks. It counts what each link carries, so it compares with the links' speed.
BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0}
WEEK_S = 7 * 86400  # the longest --timeout: more than any run here needs


class InputError(Exception):
    """Bad input, or a run that failed. It is reported in one line, then the run's last lines if
    there was a run, and exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # print one line and exit with code 2, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text):
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return int(text)


def byte_size(text):
    """The bytes in a size such as '65536', '64K', '64M' or '1G', in powers of 1024. A trailing
    'B' or 'iB' is allowed. The size must be at least 1 KiB, and at most this machine's memory:
    each rank holds a message of the largest size, so a larger one cannot run here at all. (A
    GPU's memory is smaller still: a message beyond it fails its run, reported as runs are.)"""
    m = re.fullmatch(r"(\d+)\s*([KMG]?)(i?B)?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size like 64K, 64M or 1G: {text!r}")
    size = int(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " ")
    if size < 1024:
        raise argparse.ArgumentTypeError(f"must be at least 1K, got {text!r}")
    memory = memory_bytes()
    if memory is not None and size > memory:
        raise argparse.ArgumentTypeError(
            f"must be at most this machine's memory, {human_bytes(memory)}, got {text!r}")
    return size


def memory_bytes():
    """This machine's physical memory in bytes, or None where the system does not say (Windows)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def parse_args(argv):
    """This script's flags come before `--`, and the trainer's after it."""
    ours, trainer_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = Parser(description=__doc__.split("\n\n")[0].replace("\n", " "),
               epilog="Everything after -- goes to the trainer, e.g. `-- --epochs 1` (see the trainer's --help).")
    p.add_argument("--trainer", default="train_ddp_basic.py", metavar="SCRIPT",
                   help="the training script to run (default: %(default)s); its flags go after --")
    p.add_argument("--nproc", type=positive_int, nargs="+", metavar="N",
                   help="process counts to run (default: 1, 2, 4... up to the GPUs or cores here)")
    p.add_argument("--strong", type=positive_int, metavar="GLOBAL",
                   help="strong scaling: at N processes, the trainer gets --batch-size GLOBAL/N")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto picks cuda if there is a GPU (default); cpu runs a process per core")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--svg", metavar="PATH", help="also draw the chart as an SVG picture")
    p.add_argument("--repeat", type=positive_int, default=1, metavar="K",
                   help="runs per count; the run of median throughput is reported (default: 1)")
    p.add_argument("--timeout", type=positive_int, default=1800, metavar="S",
                   help="seconds each run may take, at most a week (default: 1800)")
    c = p.add_argument_group("--collectives (nccl-tests' definitions of time, algbw and busbw)")
    c.add_argument("--collectives", action="store_true",
                   help="time all_reduce, broadcast and barrier instead of a trainer")
    c.add_argument("--max-bytes", type=byte_size, default=byte_size("64M"), metavar="SIZE",
                   help="the largest message; sizes grow 4-fold from 1K up to it (default: 64M)")
    c.add_argument("--iters", type=positive_int, default=20, metavar="N",
                   help="timed calls per size (default: 20)")
    c.add_argument("--warmup", type=positive_int, default=5, metavar="N",
                   help="untimed calls before the timed ones (default: 5)")
    args = p.parse_args(ours)
    args.trainer_flags = trainer_flags
    if args.timeout > WEEK_S:  # beyond 24.8 days (2**31 ms), Python's wait for a run crashes
        p.error(f"--timeout must be between 1 and {WEEK_S} seconds (a week), got {args.timeout}")
    if args.collectives and (trainer_flags or args.strong or args.svg):
        p.error("--collectives runs no trainer and draws no chart: drop --strong, --svg and the flags after --")
    return args


# -------------------------------------------------------------------------------------- launching

def devices(choice):
    """The device type, and how many processes this machine can run: one per GPU or CPU core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if choice == "cpu":
        return "cpu", cores
    import torch  # imported only here, as it takes seconds
    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count()
    if choice == "cuda":
        raise InputError("--device cuda, but no CUDA device is visible (try --device cpu)")
    return "cpu", cores


def process_counts(requested, device, available):
    if requested is None:
        return [2 ** k for k in range(int(math.log2(available)) + 1)]
    counts = sorted(set(requested))
    if counts[-1] > available:
        what = f"{available} GPU(s)" if device == "cuda" else f"{available} CPU core(s) (one process per core)"
        raise InputError(f"--nproc {counts[-1]}: this machine has {what}, so {available} is the most it can measure")
    return counts


def launch(script, nproc, script_args, device, timeout):
    """Run `torchrun --standalone --nproc_per_node=N script args`; return (stdout, wall seconds).
    If the run fails or outlives `timeout`, raise InputError with its last lines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
           *script_args]
    env = dict(os.environ)
    # One thread per process, at every count. torchrun sets this only for 2 or more processes, so
    # without it one process would use every core, and the speedups would be understated.
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = stop(proc)
        raise InputError(failure(script, nproc, f"still running after --timeout {timeout} s", out, err)) from None
    except KeyboardInterrupt:  # Ctrl-C reached only this script, as the run has its own session
        stop(proc)
        raise
    if proc.returncode != 0:
        raise InputError(failure(script, nproc, f"exit code {proc.returncode}", out, err))
    return out, time.perf_counter() - start


def stop(proc):
    """End a torchrun launch and return what it printed. SIGTERM goes first, and torchrun passes it
    on to its workers. SIGKILL goes to its whole session if it is still there 30 s later."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


def failure(script, nproc, what, out, err, keep=12):
    """The error message for a failed run: what happened, then the workers' own last lines.
    torchrun's log lines and its failure report are left out, but for the exit codes it names."""
    lines, in_report = [], False
    for line in (out + "\n" + err).splitlines():
        # torchrun's report starts at a traceback without the [rankN]: prefix of workers' lines
        in_report = in_report or line.startswith("Traceback (most recent call last)")
        if line.strip() and not re.match(r"[EWI]\d{4} ", line) and (not in_report or "exitcode" in line):
            lines.append(line)
    return f"{os.path.basename(script)} failed at {nproc} process(es): {what}; its last lines:\n" + \
        "\n".join("    " + line for line in lines[-keep:])


def read_summary(out, script, nproc):
    lines = [line for line in out.splitlines() if line.startswith("summary ")]
    if not lines:
        raise InputError(failure(script, nproc, "no `summary {json}` line (docs/conventions.md)", out, ""))
    return json.loads(lines[-1][len("summary "):])


# ---------------------------------------------------------------------------------------- scaling

def trainer_args(flags, nproc, strong, device):
    """The trainer's flags for one run. They are the user's flags, then `--save ''` unless the user
    gave --save, the device, and under strong scaling the batch per process, GLOBAL / N."""
    given = {flag.split("=")[0] for flag in flags if flag.startswith("--")}
    extra = [] if "--save" in given else ["--save", ""]
    extra += [] if "--device" in given else ["--device", device]
    if strong:
        if "--batch-size" in given:
            raise InputError("give the batch as --strong GLOBAL, not as the trainer's --batch-size")
        if strong % nproc:
            raise InputError(f"--strong {strong} does not split evenly over {nproc} processes")
        extra += ["--batch-size", str(strong // nproc)]
    return flags + extra


def pace_row(summary, nproc, wall_s):
    """One table row, from the pace keys that every trainer's summary line holds."""
    return {"nproc": nproc, "per_step": summary["per_step"], "step_ms": summary["step_ms"],
            "throughput": summary["throughput"], "unit": summary["throughput_unit"], "wall_s": round(wall_s, 1)}


def measure(args, device, counts):
    """Run the trainer at each process count, --repeat times, and return one row per count. A row
    holds nproc, per_step, step_ms, throughput, unit, wall_s, speedup, ideal and efficiency."""
    script = args.trainer if os.path.isabs(args.trainer) else os.path.join(os.getcwd(), args.trainer)
    if not os.path.isfile(script):
        script = os.path.join(HERE, args.trainer)  # else beside this script, from any folder
    if not os.path.isfile(script):
        raise InputError(f"trainer not found: {args.trainer}")
    rows = []
    for n in counts:
        runs, flags = [], trainer_args(args.trainer_flags, n, args.strong, device)
        for k in range(args.repeat):
            print(f"running {os.path.basename(script)} on {n} process(es), run {k + 1}/{args.repeat}..", flush=True)
            out, wall = launch(script, n, flags, device, args.timeout)
            try:
                row = pace_row(read_summary(out, script, n), n, wall)
            except KeyError as err:
                reason = f"its summary has no {err} (docs/conventions.md)"
                raise InputError(failure(script, n, reason, out, "")) from None
            if not row["throughput"]:
                raise InputError(failure(script, n, "its summary reports no timed step (throughput 0)", out, ""))
            runs.append(row)
        # the run of median throughput (of two middle runs, the faster)
        rows.append(sorted(runs, key=lambda r: r["throughput"])[len(runs) // 2])
    base = rows[0]
    for row in rows:
        row["speedup"] = round(row["throughput"] / base["throughput"], 3)
        row["ideal"] = row["nproc"] / base["nproc"]  # linear scaling from the smallest count
        row["efficiency"] = round(row["speedup"] / row["ideal"], 3)
    return rows


def table(rows):
    unit = rows[0]["unit"]
    per = "tokens" if unit.startswith("token") else "samples"
    lines = [f"{'procs':>5} | {per + ' per step':>16} | {'ms/step':>8} | {unit:>12} | {'speedup':>7} | "
             f"{'efficiency':>10} | {'wall s':>6}"]
    for r in rows:
        lines.append(f"{r['nproc']:>5} | {r['per_step']:>16,} | {r['step_ms']:>8.1f} | {r['throughput']:>12,.0f} | "
                     f"{r['speedup']:>6.2f}x | {100 * r['efficiency']:>9.0f}% | {r['wall_s']:>6.1f}")
    return "\n".join(lines)


def ascii_chart(rows, width=50):
    """A text chart. '#' is the measured throughput, and '.' what linear scaling would add."""
    base = rows[0]["throughput"]
    top = max(max(r["throughput"], base * r["ideal"]) for r in rows)
    lines = [f"{rows[0]['unit']}: '#' measured, '.' missing to linear scaling from {plural(rows[0]['nproc'])}"]
    for r in rows:
        got, ideal = round(width * r["throughput"] / top), round(width * base * r["ideal"] / top)
        bar = "#" * got + "." * max(0, ideal - got)
        lines.append(f"{r['nproc']:>4} | {bar:<{width}} {r['throughput']:>10,.0f}  {100 * r['efficiency']:.0f}%")
    return "\n".join(lines)


def svg_chart(rows, title):
    """A bar chart as an SVG document, written as text without a plotting library. A bar is the
    throughput at one process count, and a dashed outline behind it shows the linear ideal."""
    w, h, left, bottom, top_pad = 640, 360, 70, 50, 50
    plot_w, plot_h = w - left - 20, h - bottom - top_pad
    base = rows[0]["throughput"]
    highest = max(max(r["throughput"], base * r["ideal"]) for r in rows) * 1.08  # room for labels
    # a round grid step (1, 2, 2.5 or 5 times a power of 10), 4 or 5 of them up to the top
    tick = min(m * 10 ** e for e in range(math.floor(math.log10(highest / 4)), math.floor(math.log10(highest / 4)) + 2)
               for m in (1, 2, 2.5, 5) if m * 10 ** e >= highest / 5)
    top = math.ceil(highest / tick) * tick
    slot = plot_w / len(rows)

    def y(v):  # the picture's y coordinate of value v
        return top_pad + plot_h * (1 - v / top)

    def esc(text):
        return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="15">{esc(title)}</text>',
             f'<text x="{w / 2}" y="40" text-anchor="middle" fill="#555">solid: measured; dashed: linear scaling '
             f'from {plural(rows[0]["nproc"])}; label: speedup, efficiency</text>']
    for k in range(round(top / tick) + 1):  # horizontal grid lines with their values
        v = tick * k
        parts.append(f'<line x1="{left}" x2="{w - 20}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:,.6g}</text>')
    for i, r in enumerate(rows):
        x, bw = left + i * slot + slot * 0.2, slot * 0.6
        ideal = base * r["ideal"]
        parts.append(f'<rect x="{x:.1f}" y="{y(ideal):.1f}" width="{bw:.1f}" height="{y(0) - y(ideal):.1f}" '
                     f'fill="none" stroke="#888" stroke-dasharray="5,4"/>')
        parts.append(f'<rect x="{x:.1f}" y="{y(r["throughput"]):.1f}" width="{bw:.1f}" '
                     f'height="{y(0) - y(r["throughput"]):.1f}" fill="#3b73b9"/>')
        parts.append(f'<text x="{x + bw / 2:.1f}" y="{y(r["throughput"]) - 6:.1f}" text-anchor="middle">'
                     f'{r["throughput"]:,.0f} ({r["speedup"]:.2f}x, {100 * r["efficiency"]:.0f}%)</text>')
        parts.append(f'<text x="{x + bw / 2:.1f}" y="{h - bottom + 18}" text-anchor="middle">'
                     f'{plural(r["nproc"])}</text>')
    parts.append(f'<text x="16" y="{top_pad + plot_h / 2}" transform="rotate(-90 16 {top_pad + plot_h / 2})" '
                 f'text-anchor="middle">{esc(rows[0]["unit"])}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def plural(nproc):
    return f"{nproc} process" + ("es" if nproc > 1 else "")


def check_writable(path):
    """For --json and --svg, before any run: the folder must exist or be creatable, and take the
    temporary file that write_atomically writes there. Trying it is the one test that root (which
    ignores permissions), a read-only disk and a name too long all answer truly."""
    if path is None:
        return
    if os.path.basename(path) in ("", ".", "..") or os.path.isdir(path):
        raise InputError(f"cannot write {path!r}: it names a folder, not a file" if path else
                         "cannot write '': the path is empty")
    folder, tmp = os.path.dirname(os.path.abspath(path)), f"{path}.tmp{os.getpid()}"
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise InputError(f"cannot write {path}: {folder} is a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise InputError(f"cannot write {path}: no folder {folder} ({err.strerror})") from None
    try:
        with open(tmp, "w"):
            pass
        os.remove(tmp)
    except OSError as err:
        raise InputError(f"cannot write {path}: no new file in {folder} ({err.strerror})") from None


def write_atomically(path, text):
    """Write `text` beside `path`, then rename it over `path`, so no one sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as err:  # after check_writable passed: the disk filled up meanwhile, say
        raise InputError(f"cannot write {path}: {err.strerror}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def describe(device, available):
    """The hardware, as the table and the chart name it: '8x NVIDIA H100 ..., NCCL' or
    '2-core CPU, gloo'."""
    if device == "cuda":
        import torch
        return f"{available}x {torch.cuda.get_device_name(0)}, NCCL"
    return f"{available}-core CPU, gloo"


# ------------------------------------------------------------------------------------ collectives

def collectives_worker(args):
    """Run by each rank under torchrun. Time each collective at each size; rank 0 prints the table
    and a summary line."""
    import torch
    import torch.distributed as dist
    device = torch.device("cpu")
    if args.device != "cpu" and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)  # one GPU per process, set before any CUDA work
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=300))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        sizes = [1024 * 4 ** k for k in range(int(math.log(args.max_bytes / 1024, 4)) + 1)]
        sizes += [args.max_bytes] if sizes[-1] != args.max_bytes else []
        rows = [time_collective(op, size, args, device, world) for op in ("all_reduce", "broadcast")
                for size in sizes] + [time_collective("barrier", 0, args, device, world)]
        if rank == 0:
            print(f"collectives | {world} processes | {dist.get_backend()} on {device.type} | float32 | "
                  f"{args.iters} timed calls after {args.warmup} warm-up; time = the slowest rank's mean", flush=True)
            print(collectives_table(rows), flush=True)
            print("summary " + json.dumps({"world_size": world, "backend": dist.get_backend(), "rows": rows}),
                  flush=True)
    finally:
        dist.destroy_process_group()


def time_collective(op, nbytes, args, device, world):
    """One table row for `op`: the mean time per call on the slowest rank, algbw, busbw, and the
    elements that came out wrong in an untimed first call. There every rank sends rank + 1, so an
    all-reduce must give the sum of those, and a broadcast rank 0's 1.0."""
    import torch
    import torch.distributed as dist

    def sync():  # a CUDA collective is only queued when its call returns, so wait for the GPU
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rank, wrong = dist.get_rank(), 0
    if op == "barrier":
        call = dist.barrier
    else:
        x = torch.full((nbytes // 4,), float(rank + 1), device=device)
        if op == "all_reduce":
            dist.all_reduce(x)
            wrong = int((x != world * (world + 1) / 2).sum())
            call = functools.partial(dist.all_reduce, x)
        else:
            dist.broadcast(x, src=0)
            wrong = int((x != 1.0).sum())
            call = functools.partial(dist.broadcast, x, src=0)
        x.zero_()  # time on zeros, so repeated sums stay finite
    for _ in range(args.warmup):
        call()
    sync()
    dist.barrier()  # every rank starts the clock together
    start = time.perf_counter()
    for _ in range(args.iters):
        call()
    sync()
    stats = torch.tensor([(time.perf_counter() - start) / args.iters, wrong], dtype=torch.float64, device=device)
    dist.all_reduce(stats[:1], op=dist.ReduceOp.MAX)  # the slowest rank's time
    dist.all_reduce(stats[1:], op=dist.ReduceOp.SUM)  # the wrong elements of all ranks
    seconds, wrong = stats.tolist()
    row = {"op": op, "bytes": nbytes, "time_us": round(1e6 * seconds, 2), "wrong": int(wrong)}
    if op != "barrier":
        algbw = nbytes / seconds / 1e9  # GB/s, 10^9 bytes as in nccl-tests
        row["algbw_gbps"], row["busbw_gbps"] = float(f"{algbw:.4g}"), float(f"{algbw * BUSBW_FACTOR[op](world):.4g}")
    return row


def human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024


def collectives_table(rows):
    lines = [f"{'op':<10} | {'size':>9} | {'time us':>10} | {'algbw GB/s':>10} | {'busbw GB/s':>10} | wrong"]
    for r in rows:
        size = human_bytes(r["bytes"]) if r["op"] != "barrier" else "-"
        bw = f"{r['algbw_gbps']:>10.3f} | {r['busbw_gbps']:>10.3f}" if "algbw_gbps" in r else f"{'-':>10} | {'-':>10}"
        lines.append(f"{r['op']:<10} | {size:>9} | {r['time_us']:>10.1f} | {bw} | {r['wrong']}")
    return "\n".join(lines)


def collectives(args, device, counts):
    """Launch this script under torchrun at each process count of 2 or more (or, if none is, at
    the largest), and return each run's summary. Each run prints its own table."""
    results = []
    for n in [c for c in counts if c > 1] or [counts[-1]]:
        flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("max_bytes", "iters", "warmup", "device")]
        out, _ = launch(os.path.abspath(__file__), n, ["--collectives", *flags], device, args.timeout)
        print("\n".join(line for line in out.splitlines() if not line.startswith("summary ")), flush=True)
        results.append(read_summary(out, __file__, n))
    return results


# ------------------------------------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.collectives and "RANK" in os.environ:  # this process is one of torchrun's workers
        return collectives_worker(args)
    for path in (args.json, args.svg):  # check now, not after minutes of runs
        check_writable(path)
    device, available = devices(args.device)
    counts = process_counts(args.nproc, device, available)
    if args.collectives:
        result = {"collectives": collectives(args, device, counts)}
    else:
        rows = measure(args, device, counts)
        where = describe(device, available)
        mode = f"strong scaling, {args.strong} per step" if args.strong else "weak scaling"
        print(f"\n{os.path.basename(args.trainer)} | {where} | {mode}\n{table(rows)}\n\n{ascii_chart(rows)}")
        result = {"trainer": os.path.basename(args.trainer), "hardware": where, "mode": mode,
                  "trainer_flags": args.trainer_flags, "runs": rows}
        if args.svg:
            write_atomically(args.svg, svg_chart(rows, f"{os.path.basename(args.trainer)} on {where}: {mode}"))
            print(f"wrote {args.svg}")
    if args.json:
        write_atomically(args.json, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    try:
        main()
    except InputError as err:
        sys.stderr.write(f"error: {err}\n")  # one write, so other output never splits the line
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
