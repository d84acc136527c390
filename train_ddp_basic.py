"""Chapter 2: the same training under DistributedDataParallel (DDP), one process per GPU or CPU share.

    python train_ddp_basic.py                                      # 1 process, no torchrun needed
    torchrun --standalone --nproc_per_node=2 train_ddp_basic.py    # 2 processes: CPU (gloo) or 2 GPUs (nccl)
    torchrun --standalone --nproc_per_node=gpu train_ddp_basic.py  # one process per GPU of this machine
    # and on each of 2 nodes with 8 GPUs each (chapter 4):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=NODE0:29500 train_ddp_basic.py

The default data is synthetic and MNIST-shaped (1x28x28, 10 classes), made from --seed, so nothing is
downloaded; `--dataset mnist --data-dir data` reads the real MNIST files from data/MNIST/raw/.
`diff train_single_gpu.py train_ddp_basic.py` shows every line DDP changes, each tagged `# DDP k/10`.
"""
import argparse
import datetime  # DDP 1/10
import hashlib  # DDP 9/10
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist  # DDP 1/10
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP  # DDP 6/10
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset  # DDP 4/10

MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


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
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=positive(int), default=3, metavar="N", help="passes over the data (default: 3)")
    p.add_argument("--batch-size", type=positive(int), default=64, metavar="N", help="per process (default: 64)")
    p.add_argument("--lr", type=positive(float), default=1e-3, help="Adam, constant (default: 0.001)")
    p.add_argument("--seed", type=int, default=0, help="seeds data, weights, order (default: 0)")
    p.add_argument("--num-workers", type=positive(int, zero_ok=True), default=0, metavar="N",
                   help="DataLoader worker processes, 0 = load in this one (default: 0)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto = cuda if present (default)")
    p.add_argument("--model", choices=["cnn", "resnet18"], default="cnn", help="tiny CNN (default) or ResNet-18")
    p.add_argument("--dataset", choices=["synthetic", "mnist"], default="synthetic", help="default: synthetic")
    p.add_argument("--data-dir", default="data", metavar="DIR", help="holds MNIST/raw/ (default: data)")
    p.add_argument("--train-samples", type=positive(int), metavar="N", help="default: 8000 synthetic, all of MNIST")
    p.add_argument("--val-samples", type=positive(int), metavar="N", help="default: 2000 synthetic, all of MNIST")
    p.add_argument("--save", default="checkpoints/classifier.pt", metavar="PATH",
                   help="checkpoint written at the end, '' for none (default: %(default)s)")
    p.add_argument("--save-every", type=positive(int, zero_ok=True), default=0, metavar="N", help="and every N epochs")
    p.add_argument("--resume", metavar="PATH", help="go on from this checkpoint; 'auto': from --save if it exists")
    p.add_argument("--eval-only", action="store_true", help="evaluate once, train nothing")
    p.add_argument("--dist-timeout", type=positive(float), default=300, metavar="S", help="default: 300 s")  # DDP 1/10
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm (GPU only)")  # DDP 6/10
    p.add_argument("--check-sync", action="store_true", help="compare replicas each epoch")  # DDP 9/10
    p.add_argument("--debug", action="store_true", help="checked collectives, data per rank, --check-sync")  # DDP 9/10
    return p.parse_args(argv)


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


def synthetic_images(n, seed):
    """MNIST-shaped data that a CNN can learn: one random smooth 20x20 template per class, placed at a
    random offset in a 28x28 frame, scaled in brightness and buried in noise. Same seed, same data."""
    g = torch.Generator().manual_seed(seed)
    templates = F.interpolate((torch.rand(10, 1, 5, 5, generator=g) > 0.5).float(), size=(20, 20), mode="bilinear")
    frames = torch.zeros(10, 9, 9, 1, 28, 28)  # every class at every offset (0..8, 0..8)
    for dy in range(9):
        for dx in range(9):
            frames[:, dy, dx, :, dy:dy + 20, dx:dx + 20] = templates
    labels = torch.randint(0, 10, (n,), generator=g)
    offsets = torch.randint(0, 9, (n, 2), generator=g)
    images = frames[labels, offsets[:, 0], offsets[:, 1]] * torch.empty(n, 1, 1, 1).uniform_(0.5, 1.5, generator=g)
    return images + 0.6 * torch.randn(images.shape, generator=g), labels


def load_mnist(data_dir):
    """The real MNIST through torchvision, as uint8 tensors. Offline: the four files must already be there."""
    raw = os.path.join(data_dir, "MNIST", "raw")
    missing = [name for name in MNIST_FILES if not os.path.isfile(os.path.join(raw, name))]
    if missing:
        raise InputError(f"MNIST not found: place the uncompressed files {', '.join(missing)} in {raw}/")
    import torchvision  # only this path and --model resnet18 need it
    try:
        train = torchvision.datasets.MNIST(data_dir, train=True, download=False)
        val = torchvision.datasets.MNIST(data_dir, train=False, download=False)
    except (AssertionError, KeyError, RuntimeError, TypeError, ValueError) as err:
        raise InputError(f"cannot read the MNIST files in {raw}/ ({type(err).__name__}: {err})") from None
    return train.data.unsqueeze(1).float() / 255, train.targets, val.data.unsqueeze(1).float() / 255, val.targets


def build_datasets(args):
    """(train, val) TensorDatasets of normalized images and labels."""
    if args.dataset == "mnist":
        x_train, y_train, x_val, y_val = load_mnist(args.data_dir)
        x_train, y_train = x_train[:args.train_samples], y_train[:args.train_samples]
        x_val, y_val = x_val[:args.val_samples], y_val[:args.val_samples]
    else:
        n_train, n_val = args.train_samples or 8000, args.val_samples or 2000
        images, labels = synthetic_images(n_train + n_val, args.seed)
        x_train, y_train, x_val, y_val = images[:n_train], labels[:n_train], images[n_train:], labels[n_train:]
    mean, std = x_train.mean(), x_train.std()  # statistics of the training split only
    return TensorDataset((x_train - mean) / std, y_train), TensorDataset((x_val - mean) / std, y_val)


def build_model(name):
    """A tiny CNN (about 20k weights), or torchvision's ResNet-18 with a 1-channel 3x3 stem for 28x28 input."""
    if name == "cnn":  # strided convolutions instead of pooling: the same accuracy here, 4x faster on a CPU
        return nn.Sequential(
            nn.Conv2d(1, 16, 5, stride=2, padding=2), nn.ReLU(),   # 16 x 14 x 14
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),  # 32 x 7 x 7
            nn.Flatten(), nn.Linear(32 * 7 * 7, 10))
    import torchvision  # here, not at the top: importing it costs seconds that the default run does not need
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()  # keep the 28x28 resolution for the residual stages
    return model


def check_replicas_in_sync(model, when):  # DDP 9/10 --check-sync: compare hashes of every rank's weights
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()))  # DDP 9/10
    digests = [None] * dist.get_world_size()  # DDP 9/10
    dist.all_gather_object(digests, digest.hexdigest()[:12])  # DDP 9/10
    if len(set(digests)) > 1:  # DDP 9/10
        sys.stderr.write(f"error: --check-sync: replicas differ after {when}: {digests}\n")  # DDP 9/10
        sys.exit(3)  # DDP 9/10


def train_one_epoch(model, loader, optimizer, device, step_times):
    """One pass over the loader. Returns [loss sum, correct, samples] as float64 (summed, not averaged), and
    appends each step's seconds (data loading included) to step_times."""
    model.train()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    tick = time.perf_counter()
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(images)
        loss = F.cross_entropy(logits, labels)  # mean over this batch
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        correct = (logits.argmax(1) == labels).sum()
        totals += torch.stack([loss.detach() * len(labels), correct, labels.new_tensor(len(labels))])
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a GPU step is only queued until now: wait, then read the clock
        step_times.append(time.perf_counter() - tick)
        tick = time.perf_counter()
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # DDP 7/10 reduce the metrics: sums over all ranks
    return totals


@torch.no_grad()
def evaluate(model, loader, device):
    """Loss and accuracy over the loader's samples, each counted once. Returns [loss sum, correct, samples]."""
    model = model.module  # DDP 7/10 plain module: ranks may run unequal batch counts
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(images)
        loss_sum = F.cross_entropy(logits, labels, reduction="sum")
        totals += torch.stack([loss_sum, (logits.argmax(1) == labels).sum(), labels.new_tensor(len(labels))])
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # DDP 7/10
    return totals


def save_checkpoint(path, model, optimizer, epoch, args):
    """Write atomically: a temp file in the same folder, fsync, then rename over the final name."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    device = next(model.parameters()).device
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "args": vars(args),
             "rng": rng}
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


def save_once(path, model, optimizer, epoch, args, is_main):
    """The checkpoint after `epoch` epochs, written by the one process that saves ('' path: none)."""
    if is_main and path:
        save_checkpoint(path, model.module, optimizer, epoch, args)  # DDP 8/10 the unwrapped model: no "module."
        print(f"saved {path} after epoch {epoch}", flush=True)
    dist.barrier()  # DDP 8/10 save once: no rank goes on (or reads the file) before rank 0 has written it


def load_checkpoint(path, model, optimizer, args):
    """Restore weights, optimizer and RNG; return the epochs already done. Any problem is an InputError."""
    if not os.path.isfile(path):
        raise InputError(f"checkpoint not found: {path}")
    try:  # to the CPU first: load_state_dict then copies each tensor onto this process's own device
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["args"]["model"] != args.model:
            raise InputError(f"{path} holds a --model {state['args']['model']}, this run builds --model {args.model}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"])
        if state["rng"]["cuda"] is not None and next(model.parameters()).is_cuda:
            torch.cuda.set_rng_state(state["rng"]["cuda"])
        return state["epoch"]
    except InputError:
        raise
    except Exception as err:  # truncated, not a checkpoint of ours, wrong shapes: bad input all the same
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"
        raise InputError(f"cannot resume from {path}: {reason}") from None


def resolve_resume(resume, save):
    """--resume auto: continue from the --save checkpoint if one exists (after a crash, a restart runs the
    same command again and picks up where the last checkpoint left it), else start fresh."""
    if resume != "auto":
        return resume
    if not save:
        raise InputError("--resume auto needs a --save path to look for")
    return save if os.path.isfile(save) else None


def median_step_seconds(step_times, warmup=5):
    """The median seconds per step, leaving out the first `warmup` steps (lazy initialisation, caches, the
    allocator) when there are more; 0.0 when no step ran."""
    timed = step_times[warmup:] or step_times
    return statistics.median(timed) if timed else 0.0


def loss_and_accuracy(totals):
    """[loss sum, correct, samples] -> (mean loss, accuracy, samples)."""
    loss_sum, correct, n = totals.tolist()
    return loss_sum / n, correct / n, int(n)


def main(argv=None):
    args = parse_args(argv)
    # setup
    device = pick_device(args.device)
    device, rank, world_size = init_distributed(device, args.dist_timeout, args.debug)  # DDP 1/10
    is_main = rank == 0  # DDP 3/10 rank 0 alone logs and saves
    global_batch = args.batch_size * world_size  # DDP 3/10 samples per optimizer step, all ranks together
    print0(is_main, f"world size {world_size} | global batch {global_batch}")  # DDP 3/10
    torch.manual_seed(args.seed)  # the same initial weights for the same seed

    # data
    train_set, val_set = build_datasets(args)
    print0(is_main, f"data {args.dataset} | {len(train_set)} train / {len(val_set)} val samples | "
                    f"batch {args.batch_size}")
    if world_size > min(len(train_set), len(val_set)):  # DDP 4/10 shard the data: every rank needs a sample
        raise InputError(f"{world_size} processes but {len(train_set)} train / {len(val_set)} val samples")  # DDP 4/10
    sampler = DistributedSampler(train_set, seed=args.seed)  # DDP 4/10 this rank's share of a shuffled order
    val_set = Subset(val_set, range(rank, len(val_set), world_size))  # DDP 4/10 disjoint slices: no padding to count
    if args.debug:  # DDP 9/10 every rank names the samples it holds; rank 0 prints the lines in rank order
        shard = f"[rank {rank}] train {len(sampler)}: {list(sampler)[:4]}.. | val {len(val_set)}"  # DDP 9/10
        shards = [None] * world_size  # DDP 9/10 one process writes: lines from many ranks never splice together
        dist.all_gather_object(shards, shard)  # DDP 9/10
        print0(is_main, "\n".join(shards))  # DDP 9/10
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.num_workers,
                              pin_memory=device.type == "cuda")
    val_loader = DataLoader(val_set, args.batch_size, num_workers=args.num_workers, pin_memory=device.type == "cuda")

    # model
    model = build_model(args.model).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    resume = resolve_resume(args.resume, args.save)
    start_epoch = load_checkpoint(resume, model, optimizer, args) if resume else 0
    if args.sync_bn and device.type != "cuda":  # DDP 6/10 wrap the model
        raise InputError("--sync-bn needs CUDA devices: PyTorch's SyncBatchNorm runs on GPUs only")  # DDP 6/10
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if args.sync_bn else model  # DDP 6/10
    model = DDP(model, device_ids=[device] if device.type == "cuda" else None)  # DDP 6/10 averages gradients
    print0(is_main, f"model {args.model} | {sum(p.numel() for p in model.parameters()):,} weights | device {device}"
                    + (f" | resumed from {resume} after epoch {start_epoch}" if resume else ""))

    # train: one line per epoch, after a first evaluation of the starting weights
    val_loss, val_acc, val_n = loss_and_accuracy(evaluate(model, val_loader, device))
    print0(is_main, f"epoch {start_epoch}/{args.epochs} | val loss {val_loss:.4f} | val acc {100 * val_acc:.2f}%")
    samples, seconds, step_times = 0, 0.0, []
    for epoch in range(start_epoch, start_epoch if args.eval_only else args.epochs):
        sampler.set_epoch(epoch)  # DDP 5/10 a new shuffled order each epoch, the same on every rank
        start = time.perf_counter()
        train_loss, _, n = loss_and_accuracy(train_one_epoch(model, train_loader, optimizer, device, step_times))
        train_s = time.perf_counter() - start
        samples, seconds = samples + n, seconds + train_s
        val_loss, val_acc, val_n = loss_and_accuracy(evaluate(model, val_loader, device))
        print0(is_main, f"epoch {epoch + 1}/{args.epochs} | train loss {train_loss:.4f} | val loss {val_loss:.4f} | "
                        f"val acc {100 * val_acc:.2f}% | {n / train_s:,.0f} samples/s | {train_s:.1f} s")
        if args.check_sync or args.debug:  # DDP 9/10 before any save: never write a diverged replica
            check_replicas_in_sync(model, f"epoch {epoch + 1}")  # DDP 9/10
        if args.save_every and (epoch + 1) % args.save_every == 0 and epoch + 1 < args.epochs:
            save_once(args.save, model, optimizer, epoch + 1, args, is_main)
    summary = {"val_loss": val_loss, "val_acc": val_acc, "val_samples": val_n, "train_samples": samples,
               "train_s": round(seconds, 3), "samples_per_s": round(samples / seconds, 1) if seconds else 0.0}
    step_s = median_step_seconds(step_times)  # the steady pace, for benchmark_scaling.py (docs/conventions.md)
    summary.update(step_ms=round(1000 * step_s, 3), per_step=global_batch, throughput_unit="samples/s",
                   throughput=round(global_batch / step_s, 1) if step_s else 0.0)
    print0(is_main, f"done | val loss {val_loss:.4f} | val acc {100 * val_acc:.2f}% | "
                    f"{summary['samples_per_s']:,.0f} samples/s over {seconds:.1f} s of training")
    print0(is_main, "summary " + json.dumps(summary))

    # save
    if not args.eval_only:
        save_once(args.save, model, optimizer, max(start_epoch, args.epochs), args, is_main)


if __name__ == "__main__":
    try:
        main()
    except InputError as err:
        sys.stderr.write(f"error: {err}\n")  # one write: error lines from several ranks never splice
        sys.exit(2)
    finally:  # DDP 10/10 leave the process group on every path, error or not
        if dist.is_initialized():  # DDP 10/10
            dist.destroy_process_group()  # DDP 10/10
