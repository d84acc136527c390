"""Chapter 1: train a small image classifier in one process, on one GPU or the CPU.

    python train_single_gpu.py                  # the GPU if there is one, else the CPU
    python train_single_gpu.py --device cpu     # the CPU, even on a GPU machine

The default data is synthetic and shaped like MNIST (1x28x28 images, 10 classes). It is made from
--seed, so nothing is downloaded. `--dataset mnist --data-dir data` reads the real MNIST files from
data/MNIST/raw/ instead.

See also `diff train_single_gpu.py train_ddp_basic.py`: it shows every line that training with
DDP (DistributedDataParallel) changes, each tagged `# DDP k`.
"""
import argparse
import errno
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset


class Stop(Exception):
    """A run that cannot go on. It ends in one line on stderr and exit code `code`, no traceback."""
    code = 1


class InputError(Stop):
    """Bad input from the user, such as a flag, a data file or a checkpoint."""
    code = 2


class Diverged(Stop):
    """A step whose gradient norm is not finite. The step is not applied and the run stops."""
    code = 4


class SaveFailed(Stop):
    """A checkpoint that could not be written. The previous checkpoint file is left as it was."""
    code = 5


class Parser(argparse.ArgumentParser):
    def error(self, message):  # print one line and exit with code 2, not argparse's usage block
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
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=positive(int), default=3, metavar="N",
                   help="how many passes to make over the training data (default: 3)")
    p.add_argument("--batch-size", type=positive(int), default=64, metavar="N",
                   help="samples in each step of each process (default: 64)")
    p.add_argument("--lr", type=positive(float), default=1e-3,
                   help="Adam's learning rate, the same at every step (default: 0.001)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the synthetic data, the initial weights and the order (default: 0)")
    p.add_argument("--num-workers", type=positive(int, zero_ok=True), default=0, metavar="N",
                   help="DataLoader worker processes; 0 loads in the training process (default: 0)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto picks cuda if this machine has a GPU, else cpu (default: auto)")
    p.add_argument("--model", choices=["cnn", "resnet18"], default="cnn",
                   help="a tiny CNN or torchvision's ResNet-18 (default: cnn)")
    p.add_argument("--dataset", choices=["synthetic", "mnist"], default="synthetic",
                   help="data made from --seed, or the real MNIST files (default: synthetic)")
    p.add_argument("--data-dir", default="data", metavar="DIR",
                   help="the folder that holds MNIST/raw/ (default: data)")
    p.add_argument("--train-samples", type=positive(int), metavar="N",
                   help="train on the first N samples (default: 8000 synthetic, or all of MNIST)")
    p.add_argument("--val-samples", type=positive(int), metavar="N",
                   help="evaluate the first N samples (default: 2000 synthetic, or all of MNIST)")
    p.add_argument("--save", default="checkpoints/classifier.pt", metavar="PATH",
                   help="the checkpoint written at the end; '' writes none (default: %(default)s)")
    p.add_argument("--save-every", type=positive(int, zero_ok=True), default=0, metavar="N",
                   help="also save every N epochs; 0 saves only at the end (default: 0)")
    p.add_argument("--resume", metavar="PATH",
                   help="continue from this checkpoint; 'auto' continues from --save if it exists")
    p.add_argument("--eval-only", action="store_true",
                   help="evaluate the starting weights once and train nothing")
    args = p.parse_args(argv)
    if not 0 <= args.seed < 2**63:  # torch takes seeds below 2**64: seed + epoch fits too
        p.error(f"--seed must be between 0 and {2**63 - 1}, got {args.seed}")
    return args


def print0(is_main, message):
    """Print a log line if this process is the one that logs. Flush it, so it shows at once."""
    if is_main:
        print(message, flush=True)


def pick_device(name, index=0):
    """The device to train on. 'auto' means the GPU if this machine has one, else the CPU.
    `index` picks which GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda, but no CUDA device is visible (try --device cpu)")
    if name == "cuda" and index >= torch.cuda.device_count():  # more processes than GPUs here
        raise InputError(f"GPU {index} asked for, but {torch.cuda.device_count()} visible: start "
                         "at most one process per GPU (--nproc_per_node)")
    return torch.device(name, index) if name == "cuda" else torch.device(name)


def synthetic_images(n, seed):
    """Make n MNIST-shaped images, with labels, that a CNN can learn; the same seed gives the
    same data. Each class has one random, smooth 20x20 template. An image puts its class's
    template at a random offset in a 28x28 frame, scales its brightness and adds strong noise."""
    g = torch.Generator().manual_seed(seed)
    blobs = (torch.rand(10, 1, 5, 5, generator=g) > 0.5).float()
    templates = F.interpolate(blobs, size=(20, 20), mode="bilinear")
    frames = torch.zeros(10, 9, 9, 1, 28, 28)  # each class's template at each of the 9 x 9 offsets
    for dy in range(9):
        for dx in range(9):
            frames[:, dy, dx, :, dy:dy + 20, dx:dx + 20] = templates
    labels = torch.randint(0, 10, (n,), generator=g)
    offsets = torch.randint(0, 9, (n, 2), generator=g)
    brightness = torch.empty(n, 1, 1, 1).uniform_(0.5, 1.5, generator=g)
    images = frames[labels, offsets[:, 0], offsets[:, 1]] * brightness
    return images + 0.6 * torch.randn(images.shape, generator=g), labels


def load_mnist(data_dir):
    """The real MNIST, read by torchvision: images as floats in [0, 1], and their labels. Nothing
    is downloaded, so the four uncompressed files must already be in DATA_DIR/MNIST/raw/."""
    raw = os.path.join(data_dir, "MNIST", "raw")
    files = [f"{split}-{kind}-idx{dims}-ubyte" for split in ("train", "t10k")
             for kind, dims in (("images", 3), ("labels", 1))]
    missing = [name for name in files if not os.path.isfile(os.path.join(raw, name))]
    if missing:
        raise InputError(f"MNIST not found: place the uncompressed files {', '.join(missing)} "
                         f"in {raw}/")
    import torchvision  # imported here, as only MNIST and --model resnet18 need it
    try:
        train = torchvision.datasets.MNIST(data_dir, train=True, download=False)
        val = torchvision.datasets.MNIST(data_dir, train=False, download=False)
    except (AssertionError, KeyError, RuntimeError, TypeError, ValueError) as err:
        reason = f"{type(err).__name__}: {err}"
        raise InputError(f"cannot read the MNIST files in {raw}/ ({reason})") from None
    for split, prefix in ((train, "train"), (val, "t10k")):
        check_mnist_split(raw, prefix, split.data, split.targets)
    x_train, x_val = (split.data.unsqueeze(1).float() / 255 for split in (train, val))  # N,1,28,28
    return x_train, train.targets, x_val, val.targets


def check_mnist_split(raw, prefix, images, labels):
    """Raise InputError if a split's two files disagree, with each other or with MNIST: as many
    labels as images, at least one, images of 28x28 pixels, labels from 0 to 9. Unchecked, such
    files stop the run later, in a traceback from the model or the loss."""
    files = f"{raw}/{prefix}-images-idx3-ubyte and {prefix}-labels-idx1-ubyte"
    if len(images) != len(labels) or not len(images):
        raise InputError(f"{files} hold {len(images)} images and {len(labels)} labels: a split "
                         "needs a label for each image, and at least one")
    if tuple(images.shape[1:]) != (28, 28):
        raise InputError(f"{raw}/{prefix}-images-idx3-ubyte holds images of {images.shape[1]}x"
                         f"{images.shape[2]} pixels, not MNIST's 28x28")
    if int(labels.max()) > 9:  # the file holds bytes, so none is below 0
        raise InputError(f"{raw}/{prefix}-labels-idx1-ubyte holds label {int(labels.max())}, "
                         "not a digit from 0 to 9")


def build_datasets(args):
    """The training and validation TensorDatasets, both normalized by the training split's mean
    and std."""
    if args.dataset == "mnist":
        x_train, y_train, x_val, y_val = load_mnist(args.data_dir)
        x_train, y_train = x_train[:args.train_samples], y_train[:args.train_samples]
        x_val, y_val = x_val[:args.val_samples], y_val[:args.val_samples]
    else:
        n_train, n_val = args.train_samples or 8000, args.val_samples or 2000
        images, labels = synthetic_images(n_train + n_val, args.seed)
        x_train, y_train = images[:n_train], labels[:n_train]
        x_val, y_val = images[n_train:], labels[n_train:]
    mean, std = x_train.mean(), x_train.std()  # statistics of the training split only
    x_train, x_val = (x_train - mean) / std, (x_val - mean) / std
    return TensorDataset(x_train, y_train), TensorDataset(x_val, y_val)


def build_model(name):
    """A tiny CNN (about 20k weights), or ResNet-18 with a 1-channel 3x3 first convolution for
    28x28 input."""
    # The CNN strides its convolutions instead of pooling. It is as accurate here, and 4x faster
    # on a CPU.
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 5, stride=2, padding=2), nn.ReLU(),   # 16 x 14 x 14
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),  # 32 x 7 x 7
            nn.Flatten(), nn.Linear(32 * 7 * 7, 10))
    import torchvision  # imported here, as it takes seconds that the CNN does not need
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()  # keep the 28x28 resolution for the residual stages
    return model


def main(argv=None):
    args = parse_args(argv)
    # setup
    device = pick_device(args.device)
    is_main, world_size = True, 1  # the only process, so it logs and saves
    global_batch = args.batch_size * world_size  # samples in one optimizer step
    print0(is_main, f"world size {world_size} | global batch {global_batch}")
    refuse_an_unwritable_save(args, is_main)  # now, not after the training
    torch.manual_seed(args.seed)  # the same --seed makes the same initial weights
    # By default cuDNN runs convolutions in TF32 and picks their algorithms by batch shape, so a
    # batch of 32 and two batches of 16 could differ by 1e-3. Full fp32 and deterministic
    # algorithms keep runs with different batch sizes comparable.
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = False, True

    # data
    train_set, val_set = build_datasets(args)
    print0(is_main, f"data {args.dataset} | {len(train_set)} train / {len(val_set)} val samples | "
                    f"batch {args.batch_size}")
    sampler = RandomSampler(train_set, generator=torch.Generator())
    workers = {"num_workers": args.num_workers, "pin_memory": device.type == "cuda",
               "persistent_workers": args.num_workers > 0}  # workers start once, not every epoch
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, **workers)
    val_loader = DataLoader(val_set, args.batch_size, **workers)

    # model
    model = build_model(args.model).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    resume = resolve_resume(args.resume, args.save)
    start_epoch = load_checkpoint(resume, model, optimizer, args) if resume else 0
    n_weights = sum(p.numel() for p in model.parameters())
    resumed = f" | resumed from {resume} after epoch {start_epoch}" if resume else ""
    print0(is_main, f"model {args.model} | {n_weights:,} weights | device {device}{resumed}")

    # train: evaluate the starting weights first, then log one line per epoch
    val_loss, val_acc, val_n = loss_and_accuracy(evaluate(model, val_loader, device))
    print0(is_main, f"epoch {start_epoch}/{args.epochs} | val loss {val_loss:.4f} | "
                    f"val acc {100 * val_acc:.2f}%")
    samples, seconds, step_times = 0, 0.0, []
    for epoch in range(start_epoch, start_epoch if args.eval_only else args.epochs):
        sampler.generator.manual_seed(args.seed + epoch)  # a new order each epoch, from --seed
        start = time.perf_counter()
        totals = train_one_epoch(model, train_loader, optimizer, device, step_times, epoch)
        train_loss, _, n = loss_and_accuracy(totals)
        train_s = time.perf_counter() - start
        samples, seconds = samples + n, seconds + train_s
        val_loss, val_acc, val_n = loss_and_accuracy(evaluate(model, val_loader, device))
        print0(is_main, f"epoch {epoch + 1}/{args.epochs} | train loss {train_loss:.4f} | "
                        f"val loss {val_loss:.4f} | val acc {100 * val_acc:.2f}% | "
                        f"{n / train_s:,.0f} samples/s | {train_s:.1f} s")
        if args.save_every and (epoch + 1) % args.save_every == 0 and epoch + 1 < args.epochs:
            save_once(args.save, model, optimizer, epoch + 1, args, is_main)

    # summary: one line of JSON that other programs can read. step_ms and throughput come from
    # the median step, so start-up, evaluation and checkpoints do not count.
    step_s = median_step_seconds(step_times)
    summary = {"val_loss": val_loss, "val_acc": val_acc, "val_samples": val_n,
               "train_samples": samples, "train_s": round(seconds, 3),
               "samples_per_s": round(samples / seconds, 1) if seconds else 0.0,
               "step_ms": round(1000 * step_s, 3), "per_step": global_batch,
               "throughput_unit": "samples/s",
               "throughput": round(global_batch / step_s, 1) if step_s else 0.0}
    print0(is_main, f"done | val loss {val_loss:.4f} | val acc {100 * val_acc:.2f}% | "
                    f"{summary['samples_per_s']:,.0f} samples/s over {seconds:.1f} s of training")
    print0(is_main, summary_line(summary))

    # save
    if not args.eval_only:
        save_once(args.save, model, optimizer, max(start_epoch, args.epochs), args, is_main)


def stop_if_diverged(grad_norm, loss, epoch, step, optimizer):
    """Raise Diverged if the gradient norm is not finite, before the optimizer applies the step.
    A loss that is not finite makes the norm so too."""
    if not torch.isfinite(grad_norm):
        raise Diverged(f"epoch {epoch + 1} step {step}: loss {loss.item():.4g}, gradient norm "
                       f"{grad_norm.item():.4g}: not finite, step not applied; try a lower --lr "
                       f"(now {optimizer.param_groups[0]['lr']:g})")


def train_one_epoch(model, loader, optimizer, device, step_times, epoch):
    """Train one pass over the loader, and return the float64 sums [loss sum, correct, samples].
    Each step's seconds, data loading included, go to step_times. The host waits for the GPU only
    once per step, in the finiteness check."""
    model.train()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    tick = time.perf_counter()
    for step, (images, labels) in enumerate(loader, start=1):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(images)
        loss = F.cross_entropy(logits, labels)  # the mean over this batch
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # measures only
        stop_if_diverged(grad_norm, loss, epoch, step, optimizer)  # the step's one wait for the GPU
        step_times.append(time.perf_counter() - tick)  # one whole step, from wait to wait
        tick = time.perf_counter()
        optimizer.step()
        totals[0] += loss.detach() * len(labels)  # summed on the device, so the host does not wait
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    return totals


@torch.no_grad()
def evaluate(model, loader, device):
    """The float64 sums [loss sum, correct, samples] over the loader, each sample counted once."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        logits = model(images)
        loss_sum = F.cross_entropy(logits, labels, reduction="sum")
        n, correct = labels.new_tensor(len(labels)), (logits.argmax(1) == labels).sum()
        totals += torch.stack([loss_sum, correct, n])
    return totals


def all_finite(state_dict):
    """True if every floating-point tensor of a state dict is free of NaN and infinity."""
    return all(bool(torch.isfinite(t).all()) for t in state_dict.values() if t.is_floating_point())


def state_bytes(state):
    """About how many bytes a checkpoint of `state` takes on disk: the bytes of its tensors, in
    nested dicts and lists."""
    if torch.is_tensor(state):
        return state.nbytes
    if isinstance(state, bytes):  # a file's bytes, ready to write
        return len(state)
    if isinstance(state, dict):
        state = list(state.values())
    return sum(map(state_bytes, state)) if isinstance(state, (list, tuple)) else 0


def why_not_written(err, tmp, needed):
    """Why writing `tmp` failed, in one line and in the user's words. A full disk or quota is
    named, with the space free once the partial file is gone and the space a checkpoint needs.
    The system's or torch's own message follows as the detail."""
    detail = getattr(err, "strerror", None) or (str(err).strip().splitlines() or [repr(err)])[0]
    folder = os.path.dirname(os.path.abspath(tmp))
    while not os.path.isdir(folder):  # its folder could not be made, so look further up
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder).free + (os.path.getsize(tmp) if os.path.isfile(tmp) else 0)
    if getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or free < needed:
        return (f"the disk holding {folder} is full: {readable_size(free)} free, a checkpoint "
                f"needs about {readable_size(needed)} ({detail})")
    return detail


def readable_size(n):
    """A number of bytes for a person: MB, or kB below 0.1 MB."""
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def save_checkpoint(path, model, optimizer, epoch, args):
    """Write the checkpoint atomically: to a temporary file in the same folder, synced to disk,
    then renamed over the final name. Weights that are not finite are never written. Any failure
    leaves the previous file as it was."""
    weights = model.state_dict()
    if not all_finite(weights):
        raise SaveFailed(f"not saving {path} after epoch {epoch}: the weights are not finite")
    device = next(model.parameters()).device
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    state = {"model": weights, "optimizer": optimizer.state_dict(), "epoch": epoch,
             "args": vars(args), "rng": {"cpu": torch.get_rng_state(), "cuda": cuda_rng}}
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
    except (OSError, RuntimeError) as err:  # a full disk, no permission, a folder named `path`...
        needed = state_bytes(state)
        raise SaveFailed(f"cannot save {path}: {why_not_written(err, tmp, needed)}") from None
    finally:
        if os.path.exists(tmp):  # the write failed, so remove the partial file
            os.remove(tmp)


def save_once(path, model, optimizer, epoch, args, is_main):
    """Save the checkpoint after `epoch` epochs from the process that saves; an empty path saves
    nothing. A failed save raises SaveFailed in every process."""
    error = None
    if is_main and path:
        try:
            save_checkpoint(path, model, optimizer, epoch, args)
            print(f"saved {path} after epoch {epoch}", flush=True)
        except SaveFailed as err:
            error = err
    if error is not None:
        raise error


def load_checkpoint(path, model, optimizer, args):
    """Restore the weights, the optimizer and the random generators, and return the epochs done.
    Any problem with the file raises InputError."""
    state = read_checkpoint(path, args)
    try:  # load_state_dict copies each tensor to this process's device
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"])
        if state["rng"]["cuda"] is not None and next(model.parameters()).is_cuda:
            torch.cuda.set_rng_state(state["rng"]["cuda"])
    except (KeyError, RuntimeError, TypeError, ValueError) as err:  # wrong shapes, another model
        reason = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
        raise InputError(f"cannot resume from {path}: {reason}") from None
    return state["epoch"]


def read_checkpoint(path, args):
    """The checkpoint at `path`, loaded to the CPU, holding every key load_checkpoint reads, each
    of the type it reads, and weights for this run's --model. Any problem raises InputError."""
    if not os.path.isfile(path):
        raise InputError(f"checkpoint not found: {path}")
    if not os.path.getsize(path):  # torch.load would say only "EOFError"
        raise InputError(f"cannot resume from {path}: the file is empty")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated file, a file of another kind
        reason = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
        raise InputError(f"cannot resume from {path}: {reason}") from None
    problem = checkpoint_problem(state)
    if problem:
        raise InputError(f"cannot resume from {path}: {problem}")
    if state["args"]["model"] != args.model:
        raise InputError(f"{path} holds a --model {state['args']['model']}, "
                         f"this run builds --model {args.model}")
    if not all_finite(state["model"]):
        raise InputError(f"{path} holds weights that are not finite: resume from another")
    return state


def checkpoint_problem(state):
    """What a loaded checkpoint lacks of what a resume reads, in a few words, or None. A file of
    another kind, or one edited by hand, stops here rather than in a traceback later."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a checkpoint"
    expected = {  # each key a resume reads: a test of its value, and what it should be
        "model": (lambda m: isinstance(m, dict) and all(
            isinstance(name, str) and torch.is_tensor(t) for name, t in m.items()),
            "a state dict of tensors"),
        "optimizer": (lambda o: isinstance(o, dict) and {"state", "param_groups"} <= o.keys(),
                      "an optimizer's state dict"),
        "epoch": (lambda n: type(n) is int and n >= 0, "a whole number of epochs done, 0 or more"),
        "args": (lambda a: isinstance(a, dict) and "model" in a, "the flags of the run it saved"),
        "rng": (is_rng_state, "the random generators' states a save writes")}
    missing = [key for key in expected if key not in state]
    if missing:
        return f"it has no {', '.join(missing)}: not a checkpoint of this script"
    for key, (fits, what) in expected.items():
        value = state[key]
        if not fits(value):  # a number or a text is shown, anything else named by its type
            shown = repr(value) if isinstance(value, (int, float, str)) else type(value).__name__
            return f"its {key} ({shown}) is not {what}"
    return None


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


def refuse_an_unwritable_save(args, is_main):
    """Raise InputError before any training if the process that saves could not write --save. A
    run would otherwise train to the end, then fail at its first save."""
    saves = is_main and args.save and not args.eval_only
    reason = why_unwritable(args.save) if saves else None
    if reason:
        raise InputError(f"--save {args.save} cannot be written: {reason}")


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


def resolve_resume(resume, save):
    """With --resume auto, continue from the --save checkpoint if it exists, else start fresh.
    A restart after a crash then runs the same command and goes on from the last checkpoint."""
    if resume != "auto":
        return resume
    if not save:
        raise InputError("--resume auto needs a --save path to look for")
    return save if os.path.isfile(save) else None


def median_step_seconds(step_times, warmup=5):
    """The median seconds per step, leaving out the first `warmup` steps when there are more
    (they pay for lazy set-up, caches and the allocator). 0.0 when no step ran."""
    timed = step_times[warmup:] or step_times
    return statistics.median(timed) if timed else 0.0


def loss_and_accuracy(totals):
    """Turn the sums [loss sum, correct, samples] into (mean loss, accuracy, samples)."""
    loss_sum, correct, n = totals.tolist()
    return loss_sum / n, correct / n, int(n)


def summary_line(summary):
    """The `summary {...}` line in strict JSON, where a value that is not finite becomes null."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v
              for k, v in summary.items()}
    return "summary " + json.dumps(finite, allow_nan=False)


if __name__ == "__main__":
    code = 0
    try:
        main()
    except Stop as err:  # caught here, so the traceback and the model it holds are freed at once
        sys.stderr.write(f"error: {err}\n")  # one write, so other output never splits the line
        code = err.code
    sys.exit(code)
