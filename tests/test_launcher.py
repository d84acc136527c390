"""Chapter 4, launch_multinode_ddp.sh. These tests prove that the launcher
- prints one ready-to-paste c10d torchrun command per node, all identical, with the endpoint and a
  rendezvous id; adds the restart workaround only when restarts are on; and quotes arguments safely;
- inside a SLURM allocation derives the node count, this node's rank and the head node (a fake
  `scontrol` stands in for SLURM's), and with --run execs this node's command;
- explains the troubleshooting switches on --help and --explain;
- answers every bad input with exit code 2 and one line: among them more than 100000 nodes, and
  --run without torchrun on PATH (printing needs none);
- is valid bash and shellcheck-clean;
- really runs a two-node job on this machine: two torchrun agents started from the printed commands, one
  process each, meet at 127.0.0.1, train as global ranks 0 and 1 (world size 2) on disjoint shards that
  cover the data and reshuffle every epoch, save one checkpoint, and end with the weights of one process
  with twice the batch (the same global batch). That job is chapter 2's shared 2-process run
  (helpers.classifier_runs' d2), which test_classifier.py and test_benchmark.py read too.
"""
import json
import os
import shlex
import shutil
import subprocess

import pytest
import torch
from helpers import REPO, classifier_runs, environment, weights

LAUNCHER = str(REPO / "launch_multinode_ddp.sh")


def launch(*args, env=None):
    return subprocess.run([LAUNCHER, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=environment(env))


def commands(stdout):
    return [line for line in stdout.splitlines() if line and not line.startswith("#")]


def test_prints_one_identical_c10d_command_per_node():
    result = launch("--nnodes", 3, "--nproc-per-node", 8, "--master-addr", "10.1.2.3", "--master-port", 29511,
                    "train_ddp_basic.py", "--epochs", 10, "--save", "my run/ckpt.pt")
    assert result.returncode == 0, result.stderr
    lines = commands(result.stdout)
    assert len(lines) == 3 and len(set(lines)) == 1  # with c10d, every node runs the same command
    words = shlex.split(lines[0])
    assert words[:9] == ["torchrun", "--nnodes=3", "--nproc-per-node=8", "--rdzv-backend=c10d",
                         "--rdzv-endpoint=10.1.2.3:29511", "--rdzv-id=ddp-10.1.2.3-29511",
                         "--rdzv-conf=join_timeout=300", "--max-restarts=0", "train_ddp_basic.py"]
    assert words[9:] == ["--epochs", "10", "--save", "my run/ckpt.pt"]  # quoted so that it pastes right
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in result.stdout
    restarts = commands(launch("--nnodes", 2, "--master-addr", "h", "--max-restarts", 1, "train_ddp_basic.py").stdout)
    assert restarts[0].startswith("env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ")


def test_slurm_gives_nodes_rank_and_head_node_and_run_execs(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(
        '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-09]" ] && printf "gpu07\\ngpu08\\ngpu09\\n"\n')
    (fake / "scontrol").chmod(0o755)
    slurm = {"PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "3",
             "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_GPUS_ON_NODE": "4"}
    printed = launch("train_ddp_basic.py", env=slurm)
    assert printed.returncode == 0, printed.stderr
    line = commands(printed.stdout)[0]
    for part in ["--nnodes=3", "--nproc-per-node=4", "--rdzv-endpoint=gpu07:24242", "--rdzv-id=slurm-4242"]:
        assert part in line  # the port from the job id: two jobs on one head node do not collide
    ran = launch("--run", "train_ddp_basic.py", "--epochs", 1, env={**slurm, "TORCHRUN": "echo torchrun"})
    assert ran.returncode == 0 and "node 2 of 3" in ran.stderr  # SLURM_NODEID, read on this node
    assert ran.stdout.strip() == line + " --epochs 1"  # exec'd: echo printed the very command


def test_an_srun_step_on_part_of_the_allocation_uses_the_steps_nodes(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(  # a long node list: the first host must not cost a SIGPIPE
        '#!/bin/sh\n[ "$3" = "gpu[08-09]" ] || exit 1\necho gpu08\nseq 1 100000 | sed s/^/n/\n')
    (fake / "scontrol").chmod(0o755)
    slurm = {"PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "3",
             "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_STEP_NUM_NODES": "2",
             "SLURM_STEP_NODELIST": "gpu[08-09]", "SLURM_NODEID": "1"}
    printed = launch("--master-port", 29511, "train_ddp_basic.py", env=slurm)
    assert printed.returncode == 0, printed.stderr
    line = commands(printed.stdout)[0]
    assert "--nnodes=2" in line and "--rdzv-endpoint=gpu08:29511" in line  # the given port wins


def test_help_and_explain_name_the_troubleshooting_switches():
    for flag in ("--help", "--explain"):
        result = launch(flag)
        assert result.returncode == 0
        for switch in ("NCCL_DEBUG=INFO", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE=1", "GLOO_SOCKET_IFNAME", "firewall"):
            assert switch in result.stdout, (flag, switch)
    assert "--node-rank N" in launch("--help").stdout


@pytest.mark.parametrize("args,message", [
    (["--nnodes", "two", "--master-addr", "h", "train_ddp_basic.py"],
     "--nnodes must be a whole number >= 1, got 'two'"),
    (["--nnodes", "0", "--master-addr", "h", "train_ddp_basic.py"], "--nnodes must be a whole number >= 1, got '0'"),
    (["--nnodes", "100001", "--master-addr", "h", "train_ddp_basic.py"],
     "--nnodes must be 1..100000 (ten times the largest GPU clusters), got '100001'"),
    (["--nnodes", "999999999", "--master-addr", "h", "train_ddp_basic.py"],  # once minutes of lines
     "--nnodes must be 1..100000 (ten times the largest GPU clusters), got '999999999'"),
    (["--nnodes", "1" + "0" * 20, "--master-addr", "h", "train_ddp_basic.py"], "must be 1..100000"),
    (["--nnodes", "2", "--nproc-per-node", "0", "--master-addr", "h", "train_ddp_basic.py"], "--nproc-per-node must"),
    (["--nnodes", "2", "--master-addr", "h", "--node-rank", "2", "--run", "train_ddp_basic.py"],
     "--node-rank must be 0..1 for --nnodes 2, got '2'"),
    (["--nnodes", "2", "--master-addr", "h", "--node-rank", "-1", "train_ddp_basic.py"], "--node-rank must be a whole"),
    (["--nnodes", "2", "--master-addr", "h", "--master-port", "65536", "train_ddp_basic.py"],
     "--master-port must be 1-65535, got '65536'"),
    (["--nnodes", "2", "--master-addr", "h", "--master-port", "0", "train_ddp_basic.py"], "--master-port must be"),
    (["--nnodes", "2", "--master-addr", "h", "no_such_script.py"], "script not found: no_such_script.py"),
    (["--nnodes", "2", "--master-addr", "h"], "no training script given"),
    (["--nnodes", "2", "train_ddp_basic.py"], "--master-addr is required"),
    (["--master-addr", "h", "train_ddp_basic.py"], "--nnodes is required"),
    (["--nnodes", "2", "--master-addr", "h", "--run", "train_ddp_basic.py"], "--run needs --node-rank"),
    (["--nnodes", "2", "--master-addr", "h; rm -rf /", "train_ddp_basic.py"], "--master-addr is not a host name"),
    (["--nnodes", "2", "--master-addr", "h", "--join-timeout", "soon", "train_ddp_basic.py"], "--join-timeout must"),
    (["--nnodes"], "--nnodes needs a value"),
    (["--frobnicate", "train_ddp_basic.py"], "unknown option --frobnicate"),
])
def test_each_bad_input_exits_2_with_one_line(args, message):
    result = launch(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and message in result.stderr and len(result.stderr.splitlines()) == 1


def test_the_largest_nnodes_runs_and_no_torchrun_on_path_is_one_line_for_run_alone(tmp_path):
    """--nnodes 100000, the bound, still runs (the control of the refusals above). Without torchrun
    on PATH, --run says so in one line and exit code 2 (exec said two lines and 127), while
    printing the commands, which needs no torchrun, still works there."""
    top = launch("--nnodes", 100000, "--master-addr", "h", "--node-rank", 99999, "--run",
                 "train_ddp_basic.py", env={"TORCHRUN": "echo torchrun"})
    assert top.returncode == 0 and top.stdout.startswith("torchrun --nnodes=100000 "), top.stderr
    bare = tmp_path / "bin"  # a PATH that holds bash and nothing else
    bare.mkdir()
    (bare / "bash").symlink_to(shutil.which("bash"))
    args = ["--nnodes", 2, "--master-addr", "h", "--node-rank", 0, "train_ddp_basic.py"]
    ran = launch("--run", *args, env={"PATH": str(bare)})
    assert ran.returncode == 2 and ran.stdout == "" and len(ran.stderr.splitlines()) == 1
    assert ran.stderr.startswith("error: torchrun not found on PATH ("), ran.stderr
    printed = launch(*args, env={"PATH": str(bare)})
    assert printed.returncode == 0 and len(commands(printed.stdout)) == 2, printed.stderr


def test_bash_syntax_and_shellcheck():
    assert subprocess.run(["bash", "-n", LAUNCHER]).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed here (.ci/run installs it and runs it too)")
    result = subprocess.run(["shellcheck", LAUNCHER], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_two_nodes_on_one_machine_train_like_one_node_with_two_processes():
    """Chapter 2's shared 2-process run (helpers.classifier_runs' d2) is two nodes of one process
    each on this machine, started with the very commands the launcher prints (helpers.start_two_nodes),
    through the recording probe; one process with twice the batch is its reference."""
    runs = classifier_runs()
    outs, d = runs["d2_nodes"], runs["dir"]
    assert sum("world size 2 |" in out for out in outs) == 1  # rank 0 lives on one of the nodes, and logs
    seen = [json.loads((d / f"rank{r}.json").read_text()) for r in (0, 1)]  # written by RANK 0 and 1
    assert len(seen[0]) == len(seen[1]) == 2 * 256  # 2 epochs of half the 512 samples each
    for epoch in (0, 1):  # DistributedSampler: disjoint shards that cover the data, every epoch
        shard0, shard1 = (set(s[256 * epoch:256 * (epoch + 1)]) for s in seen)
        assert len(shard0) == len(shard1) == 256 and not shard0 & shard1 and shard0 | shard1 == set(range(512))
    assert all(s[:256] != s[256:] for s in seen)  # set_epoch: a new order in epoch 2
    assert not list(d.glob("d2.pt.tmp*"))  # one writer, no temporary file left
    a, b = weights(d / "d2.pt"), weights(d / "s2.pt")  # one process, batch 32
    for key in a:  # the same sums in another order: float32 rounding only
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
