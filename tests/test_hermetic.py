"""The suite gives the same answer whatever the user's shell holds: inside a SLURM allocation, with
TORCHRUN set, with torch's and NCCL's debug variables, on a machine with GPUs. These tests prove that

1. every launch gets the user's environment without the variables that the scripts, the launcher,
   torchrun, torch.distributed, gloo and NCCL read (helpers.INHERITED_NOT), one thread per process
   and no GPU visible (tests/test_gpu.py alone passes the user's GPUs on); a test sets what it needs;
2. a trainer run in the test process takes the CPU even where CUDA is available;
3. under a hostile shell (a simulated two-node SLURM allocation, TORCHRUN=false, MASTER_ADDR and a
   MASTER_PORT where nothing listens, WORLD_SIZE=64, RANK=3, TORCH_DISTRIBUTED_DEBUG=DETAIL,
   GLOO_SOCKET_IFNAME naming no interface, a GPU made visible) the launcher's printed commands and
   bad inputs, a 2-process trainer run and a two-node run through the launcher pass as in a clean
   shell. Every hostile address is loopback: nothing leaves this machine even if the stripping broke.
"""
import pytest
import test_launcher
import torch
from helpers import DDP, GPT, SMALL, TINY_GPT, environment, in_process, ok, run, summary

HOSTILE = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[01-02]",
           "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_GPUS_ON_NODE": "8", "SLURM_PROCID": "3", "SLURM_CPUS_PER_TASK": "16",
           "TORCHRUN": "false", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
           "WORLD_SIZE": "64", "RANK": "3", "LOCAL_RANK": "3", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
           "GLOO_SOCKET_IFNAME": "nonexistent0", "TP_SOCKET_IFNAME": "nonexistent0",
           "NCCL_SOCKET_IFNAME": "nonexistent0", "PET_NPROC_PER_NODE": "8",
           "CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "7"}


@pytest.fixture
def hostile(monkeypatch):
    for name, value in HOSTILE.items():
        monkeypatch.setenv(name, value)


def test_launches_inherit_none_of_it(hostile):
    env = environment()
    assert not {name for name in HOSTILE if name in env} - {"CUDA_VISIBLE_DEVICES",
                                                             "OMP_NUM_THREADS"}
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "1"
    assert environment(cuda=True)["CUDA_VISIBLE_DEVICES"] == "0"  # test_gpu.py's launches
    assert environment({"RANK": "1"})["RANK"] == "1"  # what a test sets, it gets


def test_a_trainer_in_this_process_takes_the_cpu_where_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = in_process(GPT, TINY_GPT + ["--max-steps", 1, "--save", ""])
    assert "| device cpu |" in out


def test_the_launcher_answers_as_in_a_clean_shell(hostile):
    test_launcher.test_prints_one_identical_c10d_command_per_node()
    cases = next(m for m in test_launcher.test_each_bad_input_exits_2_with_one_line.pytestmark
                 if m.name == "parametrize").args[1]
    for args, message in cases:  # "--nnodes is required" among them: no allocation is seen
        test_launcher.test_each_bad_input_exits_2_with_one_line(args, message)


def test_trainers_and_two_nodes_run_as_in_a_clean_shell(hostile, tmp_path):
    out = ok(run(DDP, SMALL + ["--epochs", 1, "--save", ""], nproc=2))
    assert "world size 2 |" in out and summary(out)["val_samples"] == 101
    test_launcher.test_two_nodes_on_one_machine_train_like_one_node_with_two_processes(tmp_path)
