"""The GPU and cluster paths, checked on CPU wherever a CPU can show them (the GPU runs themselves are
in test_gpu.py, which skips itself without CUDA). These tests prove:

1. --resume on several nodes, under real torchrun: rank 0 decides whether `--resume auto` finds a
   checkpoint and every rank follows, in both DDP trainers (a rank that sees no file does not start
   fresh on its own; a rank told to resume that cannot read the file fails in one line, exit code
   2); in the LM every rank then stops with one line naming the rank that could not read it;
2. --amp auto picks fp16, and --amp bf16 is refused, on a GPU that only emulates bf16 (V100, T4);
3. more processes than GPUs is one line and exit code 2 in every trainer, not "invalid device
   ordinal";
4. MFU's peak comes from the GPU's whole model name and the autocast dtype (A100 fp32 is 16x below
   bf16, an H100 3x above an A100; an H100 NVL, an L40 and an A10G are not the GPUs whose names
   they contain), --gpu-peak-tflops overrides it, nothing is claimed for unknown GPUs,
   and the FLOPs leave out position embeddings, as nanoGPT counts them;
5. the logged ms/step leaves out evaluation time even when --eval-every is not a multiple of
   --log-every;
6. resuming keeps the fused AdamW this run built, its step counts loaded as fused AdamW keeps them
   (float32 beside the parameters: on a GPU, on the GPU), and a bf16 or fp32 checkpoint resumes
   under fp16 (a fresh GradScaler) instead of being refused;
7. on GPUs the LM trainers print every rank's measured peak memory, gathered to rank 0 in rank
   order (a monkeypatched CUDA device: the gather runs on gloo), and nothing on a CPU;
8. the classifiers run cuDNN in exact fp32 with deterministic algorithms, so that 2 processes with
   --batch-size 16 each (per process; a global batch of 32) and 1 with --batch-size 32 (the same
   global batch) pick comparable kernels (the GPU equivalence itself: test_gpu.py);
9. --compile with --grad-checkpointing trains under DDP (DDP's graph splitting is turned off for that
   combination: some torch 2.x releases raise "DDPOptimizer backend: Found a higher order op"
   without it; the torch this suite installs trains either way, so this guards the combination).
"""
import re
import time

import pytest
import torch
from helpers import (DDP, DETAIL, DETAIL_WARNING, GPT, REPO, SINGLE, SMALL, TINY_GPT, command,
                     in_process, ok, one_process_group, started, trainer)

gpt = trainer(GPT)


@pytest.fixture(scope="module", autouse=True)
def starting(tmp_path_factory):
    """The module's three 2-process launches, started side by side as the module starts (the tests
    that read them come last: the in-process tests run meanwhile), each with a probe that hides
    the checkpoint from one rank: the LM told --resume auto with it hidden from rank 0 (and
    TORCH_DISTRIBUTED_DEBUG=DETAIL in its environment: test_hermetic.py), and told --resume PATH
    with it hidden from rank 1; the classifier with it hidden from rank 1."""
    d = tmp_path_factory.mktemp("hidden")
    lm, classifier = d / "lm.pt", d / "classifier.pt"
    in_process(GPT, TINY_GPT + ["--max-steps", 2, "--save", lm])
    in_process(SINGLE, SMALL + ["--epochs", 1, "--save", classifier])
    lm_flags, flags = [*TINY_GPT, "--max-steps", 4, "--save", lm], [*SMALL, "--epochs", 2]
    wait = started({
        "lm_hidden_on_0": (command("tests/probe_minigpt.py", ["hide", 0, *lm_flags, "--resume",
                                                              "auto"], nproc=2), REPO, DETAIL),
        "lm_hidden_on_1": (command("tests/probe_minigpt.py", ["hide", 1, *lm_flags, "--resume",
                                                              lm], nproc=2), REPO, None),
        "classifier": (command("tests/probe_classifier.py", ["hide", 1, *flags, "--save",
                                                             classifier, "--resume", "auto"],
                               nproc=2), REPO, None)})
    yield lambda: {name: (result, classifier if name == "classifier" else lm)
                   for name, result in wait().items()}
    wait()  # never leave one running


@pytest.fixture(scope="module")
def launched(starting):
    """{name: (CompletedProcess, the checkpoint's path)}."""
    return starting()


@pytest.fixture
def emulated_bf16_gpu(monkeypatch):
    """A CUDA device that, like a V100 or T4, runs bf16 only by emulation."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True:
                        including_emulation)
    return torch.device("cuda", 0)


def test_amp_auto_is_fp16_and_bf16_is_refused_where_bf16_is_emulated(emulated_bf16_gpu):
    assert gpt.amp_dtype("auto", emulated_bf16_gpu) == torch.float16
    with pytest.raises(gpt.InputError, match="no native bf16"):
        gpt.amp_dtype("bf16", emulated_bf16_gpu)
    assert gpt.amp_dtype("auto", torch.device("cpu")) is None


@pytest.mark.parametrize("script", [SINGLE, DDP])  # the LM's: test_minigpt_inputs.py
def test_more_processes_than_gpus_is_one_line(script, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    module = trainer(script)
    assert module.pick_device("cuda", 1) == torch.device("cuda", 1)
    with pytest.raises(module.InputError, match=r"^GPU 2 asked for, but 2 visible: start at most "
                                                r"one process per GPU \(--nproc_per_node\)$"):
        module.pick_device("cuda", 2)


def test_mfu_peak_from_the_gpu_name_and_dtype():
    assert gpt.peak_tflops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312
    assert gpt.peak_tflops("NVIDIA A100-SXM4-80GB", "off") == 19.5  # fp32: 16x lower
    assert gpt.peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989  # about 3x an A100
    assert gpt.peak_tflops("NVIDIA H100 PCIe", "float16") == 756
    assert gpt.peak_tflops("NVIDIA A10", "bfloat16") == 125  # not an A100
    assert gpt.peak_tflops("NVIDIA L4", "bfloat16") == 121 and gpt.peak_tflops("NVIDIA L40S",
                                                                               "bfloat16") == 362
    assert gpt.peak_tflops("Tesla T4", "float16") == 65
    assert gpt.peak_tflops("NVIDIA GeForce RTX 4090", "off") == 82.6
    assert gpt.peak_tflops("Some Future GPU", "bfloat16") is None
    # whole model names: none of these is the GPU whose name it contains
    assert gpt.peak_tflops("NVIDIA H100 NVL", "bfloat16") == 835  # not the SXM's 989
    assert gpt.peak_tflops("NVIDIA L40", "bfloat16") == 181  # not an L4
    assert gpt.peak_tflops("NVIDIA A10G", "bfloat16") is None  # not an A10: no MFU, the hint
    assert gpt.peak_tflops("NVIDIA A100 80GB PCIe", "bfloat16") == 312
    assert gpt.peak_tflops("Tesla V100-SXM2-16GB", "float16") == 125
    assert gpt.peak_tflops("NVIDIA GeForce RTX 3090", "bfloat16") == 71  # fp32 accumulation


def test_mfu_counts_flops_without_position_embeddings_and_takes_the_override(monkeypatch):
    args = gpt.parse_args(["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size",
                           "16", "--gpu-peak-tflops", "100"])
    model = gpt.GPT(256, 16, 2, 2, 32, 0.0)
    n = sum(p.numel() for p in model.parameters()) - 16 * 32  # no position embeddings
    assert gpt.flops_per_token(model, args) == 6 * n + 12 * 2 * 32 * 16

    def run(device, world_size=2):
        return gpt.Run(args, device, 0, world_size, True, "bfloat16", None, None)
    assert gpt.gpu_peak_flops(run(torch.device("cpu"))) == (None, None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert gpt.gpu_peak_flops(run(torch.device("cuda", 0))) == (
        2 * 100e12, "MFU against 100 TFLOPS per GPU (Some Future GPU, bfloat16)")
    args.gpu_peak_tflops = None
    assert gpt.gpu_peak_flops(run(torch.device("cuda", 0))) == (
        None, "MFU: Some Future GPU is not in the table; give --gpu-peak-tflops")


def test_logged_step_time_leaves_out_evaluation(monkeypatch):
    evaluate = gpt.evaluate

    def slow_evaluate(*args):
        time.sleep(1.0)
        return evaluate(*args)

    monkeypatch.setattr(gpt, "evaluate", slow_evaluate)
    out = in_process(GPT, TINY_GPT + ["--max-steps", 6, "--log-every", 3, "--eval-every", 2,
                                      "--save", ""])
    step_ms = [float(m) for m in re.findall(r"\| ([\d.]+) ms/step \|", out)]
    # counted, each interval's evaluation would add 1 s over 3 steps: 333 ms a step at least; a
    # step takes a few ms here, tens on a machine twice as busy
    assert len(step_ms) == 2 and max(step_ms) < 250, out


def test_resume_keeps_fused_adamw_and_switches_amp_to_fp16(tmp_path):
    path = tmp_path / "ck.pt"
    in_process(GPT, TINY_GPT + ["--max-steps", 2, "--amp", "bf16", "--save", path])  # no scaler
    args = gpt.parse_args([str(a) for a in TINY_GPT + ["--max-steps", 4]])
    model = gpt.GPT(**gpt.model_config(args, 256))
    groups = [[p for p in model.parameters() if p.dim() >= 2],  # make_optimizer's two groups
              [p for p in model.parameters() if p.dim() < 2]]
    optimizer = torch.optim.AdamW([{"params": g} for g in groups], fused=True)  # as on a GPU
    scaler = torch.amp.GradScaler("cpu", enabled=True)  # as --amp fp16 builds it
    run = gpt.Run(args, torch.device("cpu"), 0, 1, True, "float16", None, scaler)
    data = gpt.Data(None, None, 256, None, 0.0)
    seen, load = [], optimizer.load_state_dict  # the groups torch reads while it loads the state

    def spy(state_dict):
        seen.extend(group.get("fused") for group in state_dict["param_groups"])
        return load(state_dict)
    optimizer.load_state_dict = spy
    assert gpt.load_checkpoint(str(path), run, model, optimizer, data) == 2
    assert all(group["fused"] for group in optimizer.param_groups)
    # the saved groups said fused=False; torch places each step count by the loaded group's flag
    # (fused: float32 beside the parameter, on a GPU where the fused kernel reads it)
    assert seen == [True, True]
    steps = [optimizer.state[p]["step"] for p in model.parameters()]
    assert all(s.dtype == torch.float32 and s.device == p.device and s.item() == 2
               for s, p in zip(steps, model.parameters()))
    assert scaler.get_scale() == 2.0 ** 16  # a fresh loss scale


def test_compile_with_grad_checkpointing_trains_under_ddp():
    out = in_process(GPT, TINY_GPT + ["--max-steps", 2, "--compile", "--compile-backend",
                                      "aot_eager", "--grad-checkpointing", "--save", ""])
    assert "step 2/2 | loss" in out


def test_peak_gpu_memory_of_every_rank_is_printed_by_rank_0_in_rank_order(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**20 + 2**19)
    run = gpt.Run(gpt.parse_args([]), torch.device("cuda", 0), 0, 1, True, "bfloat16", None, None)
    with one_process_group():
        torch.distributed.init_process_group("gloo")  # gathers Python objects on the CPU
        gpt.log_peak_gpu_memory(run)
    assert capsys.readouterr().out == "peak GPU memory per rank (max_memory_allocated): rank 0 3.5 MiB\n"
    gpt.log_peak_gpu_memory(gpt.Run(gpt.parse_args([]), torch.device("cpu"), 0, 1, True, "off",
                                    None, None))  # a CPU: nothing measured, no collective
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("script", [SINGLE, DDP])
def test_the_classifiers_run_cudnn_in_exact_fp32_with_fixed_algorithms(script, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)  # PyTorch's defaults, restored
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)  # after the test
    in_process(script, SMALL + ["--epochs", 1, "--save", ""])
    assert torch.backends.cudnn.allow_tf32 is False and torch.backends.cudnn.deterministic is True


@pytest.mark.parametrize("script", [SINGLE, DDP])
def test_a_classifier_step_waits_for_the_device_once(script, monkeypatch):
    """Every way a step could make the host wait for a GPU, counted over an epoch on the CPU (the
    same Python runs on a GPU): one `bool` of a tensor per step, the finiteness check; no .item(),
    no host-to-device copy of a count, no torch.cuda.synchronize."""
    module, waits = trainer(script), []
    for name in ("__bool__", "item", "tolist", "__float__", "__int__", "new_tensor"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _f=original, _n=name, **k:
                            waits.append(_n) or _f(*a, **k))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waits.append("synchronize"))
    torch.manual_seed(0)
    model, images = module.build_model("cnn"), torch.randn(64, 1, 28, 28)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        images, torch.randint(0, 10, (64,))), batch_size=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with one_process_group():  # chapter 2's copy all-reduces the totals at the end of the epoch
        torch.distributed.init_process_group("gloo")
        module.train_one_epoch(model, loader, optimizer, torch.device("cpu"), [], 0)
    # 4 steps of 16: one check each, after the DataLoader's .item() of a CPU seed for the epoch
    assert waits == ["item"] + ["__bool__"] * 4, waits


# ------------------------------------------ the launches, started with the module, read last

def test_the_lm_resumes_only_when_rank_0_finds_the_checkpoint_and_every_rank_follows(launched):
    out = ok(launched["lm_hidden_on_0"][0])  # rank 1 sees the file, but follows rank 0: a fresh
    assert "step 0/4 | val loss" in out and "resumed from" not in out  # start on every rank
    assert out.splitlines().count(DETAIL_WARNING) == 1  # DETAIL (a segfault) became INFO, rank 0 said
    hidden_on_1, path = launched["lm_hidden_on_1"]
    assert hidden_on_1.returncode != 0 and "exitcode  : 2" in hidden_on_1.stderr
    lines = [line for line in hidden_on_1.stderr.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: rank 1: checkpoint not found: {path} (every rank reads --resume: "
                     "on several nodes it must be on a filesystem they share, "
                     "docs/multinode.md)"] * 2


def test_the_classifier_follows_rank_0s_decision_to_resume(launched):
    result, path = launched["classifier"]  # rank 0 finds it: all resume, and rank 1 cannot
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr  # (torchrun stops the job)
    assert f"error: checkpoint not found: {path}\n" in result.stderr
