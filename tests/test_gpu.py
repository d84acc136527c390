"""What only a GPU can show: every trainer on CUDA under torchrun with NCCL. Skipped, with the reason,
where CUDA is absent (the CPU suite covers the same logic on gloo); on a GPU machine
`python -m pytest tests/test_gpu.py` runs just these. Each launch uses min(2, GPUs) processes, so the
module also runs on a single GPU. These tests prove, on NCCL:

1. chapter 2's demo learns (val acc >= 90%), logs each line once and saves one checkpoint; its
   weights equal one process with the whole global batch (float32 rounding, cuDNN's nondeterminism
   allowed for); validation metrics are the same at world size 1 and N; `--model resnet18` trains;
2. the LM trains in bf16 (if the GPU has native bf16) and fp16: the fp16 checkpoint holds the
   GradScaler's state and resumes; MFU is logged against the GPU's own peak, in a sane range;
3. `--compile` (inductor) trains, with and without --grad-checkpointing;
4. `benchmark_scaling.py --collectives` gives correct results and bandwidths on NCCL;
5. chapter 7's FSDP trainer trains on NCCL in bf16 (its MixedPrecisionPolicy), saves sharded, resumes,
   and exports a file that samples in one process; it compiles with inductor; at 2 GPUs its
   measured peak memory per rank is below DDP's;
6. a checkpoint saved on the CPU resumes on a GPU with fused AdamW, and FSDP asked for the CPU on a
   GPU machine keeps its shards on the CPU;
7. chapter 8's TP trainer, its tp group the min(2, GPUs) GPUs, trains on NCCL in bf16 (fused AdamW
   over two meshes), saves, resumes, and exports a file that samples in one process;
8. chapter 9's PP trainer, one stage per GPU of min(2, GPUs), trains on NCCL in bf16 (bf16 activations
   sent between the stages), saves, resumes, and exports a file that samples in one process;
9. chapter 10's CP trainer, its cp group the min(2, GPUs) GPUs, trains on NCCL in bf16 (the keys and
   values gathered in bf16, flash attention aligned at each chunk's end), saves, resumes, and exports;
10. chapter 11's 4-D trainer, its tp group and then its cp group the min(2, GPUs) GPUs, trains on
   NCCL in bf16, saves, resumes, and exports a file that samples in one process.
The CPU tests hide the GPUs (helpers.environment); these launches alone see them (cuda=True).
"""
import math
import re

import pytest
import torch
from helpers import (DDP, GPT, NEEDS_CP, NEEDS_PP, SINGLE, SMALL, TINY_GPT, needs_torch, ok, run,
                     summary, weights)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: NCCL, autocast fp16 and inductor on GPUs")
NPROC = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0
LM = TINY_GPT + ["--device", "cuda"]


def test_chapter_2_on_nccl_learns_logs_once_saves_once_and_equals_one_process(tmp_path):
    out = ok(run(DDP, ["--device", "cuda", "--save", tmp_path / "d.pt"], nproc=NPROC, cuda=True))
    assert summary(out)["val_acc"] >= 0.90
    assert sum(line.startswith("done |") for line in out.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.pt"]
    flags = SMALL + ["--device", "cuda", "--epochs", 1]
    ok(run(DDP, flags + ["--batch-size", 32 // NPROC, "--save", tmp_path / "n.pt"], nproc=NPROC, cuda=True))
    ok(run(SINGLE, flags + ["--batch-size", 32, "--save", tmp_path / "one.pt"], cuda=True))
    a, b = weights(tmp_path / "n.pt"), weights(tmp_path / "one.pt")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)
    evals = [summary(ok(run(DDP, SMALL + ["--device", "cuda", "--eval-only", "--resume",
                                          tmp_path / "one.pt"], nproc=n, cuda=True)))
             for n in sorted({1, NPROC})]
    assert all(e["val_samples"] == 101 and e["val_acc"] == evals[0]["val_acc"] for e in evals)


def test_resnet18_trains_on_nccl(tmp_path):
    out = ok(run(DDP, SMALL + ["--device", "cuda", "--model", "resnet18", "--epochs", 1,
                               "--save", ""], nproc=NPROC, cuda=True))
    assert "epoch 1/1 | train loss" in out and math.isfinite(summary(out)["val_loss"])


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_the_lm_in_mixed_precision_logs_mfu_and_resumes(amp, tmp_path):
    if amp == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16")
    ckpt = tmp_path / "lm.pt"
    out = ok(run(GPT, LM + ["--amp", amp, "--max-steps", 4, "--save", ckpt], nproc=NPROC, cuda=True))
    assert re.search(r"MFU against [\d.]+ TFLOPS per GPU", out) or "not in the table" in out
    for mfu in map(float, re.findall(r"\| MFU ([\d.]+)%", out)):
        assert 0 <= mfu < 100  # a tiny model: far below the peak, never above it
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert bool(state["scaler"]) == (amp == "fp16")  # the GradScaler's scale and growth tracker
    resumed = ok(run(GPT, LM + ["--amp", amp, "--max-steps", 6, "--resume", ckpt, "--save", ""],
                     nproc=NPROC, cuda=True))
    assert "resumed from" in resumed and "step 6/6 | loss" in resumed


@pytest.mark.parametrize("checkpointing", [[], ["--grad-checkpointing"]])
def test_the_lm_compiles_with_inductor(checkpointing):
    out = ok(run(GPT, LM + ["--compile", "--max-steps", 3, "--save", "", *checkpointing],
                 nproc=NPROC, cuda=True))
    assert "step 3/3 | loss" in out


def test_collectives_on_nccl(tmp_path):
    out = ok(run("benchmark_scaling.py", ["--device", "cuda", "--collectives", "--nproc", NPROC,
                                          "--max-bytes", "1M", "--iters", 3], cuda=True))
    assert "all_reduce" in out and "broadcast" in out


def test_fsdp_in_bf16_on_nccl_saves_resumes_and_exports(tmp_path):
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16")
    flags = LM + ["--amp", "bf16", "--save", tmp_path / "ck", "--export", tmp_path / "f.pt"]
    out = ok(run("train_fsdp_minigpt.py", flags + ["--max-steps", 4], nproc=NPROC, cuda=True))
    assert "memory per rank (cuda):" in out and "step 4/4 | saved" in out
    out = ok(run("train_fsdp_minigpt.py", flags + ["--max-steps", 6, "--resume", "auto"],
                 nproc=NPROC, cuda=True))
    assert "at step 4" in out and "step 6/6 | loss" in out
    sampled = ok(run(GPT, ["--sample", "--ckpt", tmp_path / "f.pt", "--max-new-tokens", 20], cuda=True))
    assert sampled.strip()


@pytest.mark.parametrize("script,flag,grid", [
    ("train_tp_minigpt.py", "--tp", f"(1 dp x {NPROC} tp)"),  # its tp group: the GPUs
    pytest.param("train_pp_minigpt.py", "--pp", f"({NPROC} pp x 1 dp)",  # a stage per GPU
                 marks=needs_torch(*NEEDS_PP)),
    pytest.param("train_cp_minigpt.py", "--cp", f"(1 dp x {NPROC} cp)",  # its cp group: the GPUs
                 marks=needs_torch(*NEEDS_CP))])
def test_tp_pp_and_cp_in_bf16_on_nccl_save_resume_and_export(script, flag, grid, tmp_path):
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16")
    flags = LM + ["--amp", "bf16", flag, NPROC, "--save", tmp_path / "ck",
                  "--export", tmp_path / "x.pt"]
    out = ok(run(script, flags + ["--max-steps", 4], nproc=NPROC, cuda=True))
    assert f"{grid} | device cuda:0 | amp bfloat16" in out and "step 4/4 | saved" in out
    out = ok(run(script, flags + ["--max-steps", 6, "--resume", "auto"], nproc=NPROC, cuda=True))
    assert "at step 4" in out and "step 6/6 | loss" in out
    sampled = ok(run(GPT, ["--sample", "--ckpt", tmp_path / "x.pt", "--max-new-tokens", 20], cuda=True))
    assert sampled.strip()


@needs_torch(*NEEDS_CP)
@pytest.mark.parametrize("sizes", [("1", "1", NPROC), ("1", NPROC, "1")], ids=["tp", "cp"])
def test_the_4d_trainer_in_bf16_on_nccl_saves_resumes_and_exports(sizes, tmp_path):
    """Chapter 11 on the GPUs here: its tp group, then its cp group, the GPUs (sequence parallel,
    loss parallel, the gathered keys on NCCL in bf16), saved, resumed and exported."""
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16")
    pp, cp, tp = sizes
    flags = LM + ["--amp", "bf16", "--pp", pp, "--cp", cp, "--tp", tp, "--save", tmp_path / "ck",
                  "--export", tmp_path / "x.pt"]
    out = ok(run("train_4d_minigpt.py", flags + ["--max-steps", 4], nproc=NPROC, cuda=True))
    assert f"({pp} pp x 1 dp x {cp} cp x {tp} tp) | device cuda:0 | amp bfloat16" in out
    out = ok(run("train_4d_minigpt.py", flags + ["--max-steps", 6, "--resume", "auto"],
                 nproc=NPROC, cuda=True))
    assert "at step 4" in out and "step 6/6 | loss" in out
    sampled = ok(run(GPT, ["--sample", "--ckpt", tmp_path / "x.pt", "--max-new-tokens", 20], cuda=True))
    assert sampled.strip()


def test_fsdp_compiles_with_inductor():
    out = ok(run("train_fsdp_minigpt.py", LM + ["--compile", "--max-steps", 3, "--save", "",
                                               "--export", ""], nproc=NPROC, cuda=True))
    assert "step 3/3 | loss" in out and "peak GPU memory per rank" in out


def test_a_cpu_checkpoint_resumes_on_the_gpu_with_fused_adamw(tmp_path):
    """Saved on the CPU (its AdamW groups say fused=False, its step counts on the CPU), resumed on
    CUDA with the fused AdamW this run builds: the step counts must land on the GPU, where the
    fused kernel reads them."""
    ckpt = tmp_path / "cpu.pt"
    ok(run(GPT, TINY_GPT + ["--device", "cpu", "--max-steps", 2, "--save", ckpt], nproc=1))
    out = ok(run(GPT, LM + ["--max-steps", 4, "--resume", ckpt, "--save", ""], nproc=1, cuda=True))
    assert f"resumed from {ckpt} at step 2" in out and "step 4/4 | loss" in out


def peak_mib(out):
    """The largest rank's peak allocated GPU memory, from the trainers' log line."""
    line = next(x for x in out.splitlines() if x.startswith("peak GPU memory per rank"))
    return max(float(m.replace(",", "")) for m in re.findall(r"rank \d+ ([\d,.]+) MiB", line))


@pytest.mark.skipif(NPROC < 2, reason="FSDP shards across GPUs: needs 2 of them")
def test_fsdp_holds_less_gpu_memory_per_rank_than_ddp_measured():
    big = ["--device", "cuda", "--amp", "off", "--n-layer", "8", "--n-head", "8", "--n-embd", "512",
           "--block-size", "64", "--batch-size", "2", "--max-steps", "3", "--eval-windows", "8",
           "--save", ""]  # ~25M parameters, few activations: the state dominates
    ddp = peak_mib(ok(run(GPT, big, nproc=2, cuda=True)))
    fsdp = peak_mib(ok(run("train_fsdp_minigpt.py", big + ["--export", ""], nproc=2, cuda=True)))
    assert fsdp < 0.75 * ddp, (fsdp, ddp)


def test_fsdp_on_the_cpu_of_a_gpu_machine_keeps_its_shards_on_the_cpu():
    """--device cpu with GPUs visible: the mesh is built from the process group's device (gloo,
    CPU), not from the accelerator, so the shards live on the CPU (the memory line says where)."""
    out = ok(run("train_fsdp_minigpt.py", TINY_GPT + ["--device", "cpu", "--max-steps", 2,
                                                      "--save", "", "--export", ""],
                 nproc=2, cuda=True))
    assert "| device cpu |" in out and "memory per rank (cpu):" in out and "step 2/2 | loss" in out
