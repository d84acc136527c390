"""The suite gives the same answer whatever the user's shell holds: inside a SLURM allocation, with
TORCHRUN set, with torch's and NCCL's debug variables, on a machine with GPUs. These tests prove that

1. every launch gets the user's environment without the variables that the scripts, the launcher,
   torchrun, torch.distributed, gloo and NCCL read (helpers.INHERITED_NOT), one thread per process
   and no GPU visible (tests/test_gpu.py alone passes the user's GPUs on); a test sets what it needs;
2. a trainer run in the test process is told `--device cpu` (a test's own --device still wins);
3. under a hostile shell (helpers.HOSTILE_SHELL: a simulated two-node SLURM allocation,
   TORCHRUN=false, a MASTER_PORT where nothing listens, WORLD_SIZE=64, RANK=3, DETAIL debugging,
   GLOO_SOCKET_IFNAME naming no interface, a visible GPU) the launcher prints its commands and
   refuses bad input as in a clean shell. Two launches elsewhere run under the same shell, so that
   one run serves both proofs: the shared 2-process chapter 3 run (helpers.ddp_reference, read by
   test_minigpt.py::test_disjoint_windows_one_allreduce_per_step_and_accumulation_is_exact) and the
   two-node run of test_fsdp.py::test_two_nodes_through_the_launcher_train_like_one_node;
4. nothing of that shell reaches a trainer run in the test process either: not its variables, and
   not the TORCH_DISTRIBUTED_DEBUG level that torch read when this process imported it;
5. a user's TORCH_DISTRIBUTED_DEBUG=DETAIL, which crashes DDP on gloo (a segfault in torch 2.13
   and 2.14), is one warning line and the run goes on at INFO: every LM trainer and chapter 2 in
   this process; chapter 3 launched at 2 processes with it is one of test_cluster_paths.py's
   launches (test_the_lm_resumes_only_when_rank_0_finds_the_checkpoint_and_every_rank_follows).
"""
import os

import pytest
import test_launcher
import torch.distributed as dist
from helpers import (DDP, DETAIL, DETAIL_UNTESTED, DETAIL_WARNING, GPT, HOSTILE_SHELL, SMALL,
                     TINY_GPT, environment, hostile_shell, in_process, trainer)


@pytest.fixture
def hostile():
    with hostile_shell():
        yield


def test_launches_inherit_none_of_it(hostile):
    env = environment()
    assert not {name for name in HOSTILE_SHELL if name in env} - {"CUDA_VISIBLE_DEVICES",
                                                                   "OMP_NUM_THREADS"}
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "1"
    assert environment(cuda=True)["CUDA_VISIBLE_DEVICES"] == "0"  # test_gpu.py's launches
    assert environment({"RANK": "1"})["RANK"] == "1"  # what a test sets, it gets


def test_a_trainer_in_this_process_is_told_to_take_the_cpu(monkeypatch):
    module, devices = trainer(GPT), []
    monkeypatch.setattr(module, "main", lambda argv: devices.append(module.parse_args(argv).device))
    in_process(GPT, TINY_GPT + ["--max-steps", 1])
    in_process(GPT, ["--device", "cuda"])  # what a test asks for itself still wins
    assert devices == ["cpu", "cuda"]


def test_the_launcher_answers_as_in_a_clean_shell(hostile):
    test_launcher.test_prints_one_identical_c10d_command_per_node()
    cases = next(m for m in test_launcher.test_each_bad_input_exits_2_with_one_line.pytestmark
                 if m.name == "parametrize").args[1]
    for args, message in cases:  # "--nnodes is required" among them: no allocation is seen
        test_launcher.test_each_bad_input_exits_2_with_one_line(args, message)


def test_a_trainer_in_this_process_sees_nothing_of_the_shell(hostile, monkeypatch):
    level = dist.get_debug_level()
    dist.set_debug_level_from_env()  # DETAIL: what torch reads on import in such a shell
    module, seen = trainer(GPT), []
    monkeypatch.setattr(module, "main", lambda argv: seen.append(
        (dist.get_debug_level(), {k for k, v in HOSTILE_SHELL.items() if os.environ.get(k) == v})))
    try:
        in_process(GPT, [])
        assert seen == [(dist.DebugLevel.OFF, {"CUDA_VISIBLE_DEVICES", "MASTER_ADDR"})]
        assert dist.get_debug_level() == dist.DebugLevel.DETAIL  # the shell's again, afterwards
    finally:
        dist.set_debug_level(level)


def test_detail_debugging_on_gloo_is_one_warning_and_the_run_goes_on_at_info():
    flags = TINY_GPT + ["--max-steps", 2, "--save", ""]
    for script, args in ((GPT, flags), (DDP, SMALL + ["--epochs", 1, "--save", ""]),
                         ("train_fsdp_minigpt.py", flags + ["--export", ""]),
                         ("train_tp_minigpt.py", flags + ["--tp", 1, "--export", ""])):
        out = in_process(script, args, env=DETAIL)  # without the warning, a segfault ends pytest
        said = DETAIL_WARNING if script in (GPT, DDP) else DETAIL_UNTESTED  # FSDP: no DDP to crash
        assert out.splitlines().count(said) == 1 and "\nsummary {" in out, (script, out)
