#!/usr/bin/env bash
# Chapter 4: the torchrun command for every node of a multi-node DDP job, or this node's, run.
#
#   ./launch_multinode_ddp.sh --nnodes 2 --nproc-per-node 8 --master-addr 10.0.0.1 --master-port 29500 \
#       train_ddp_basic.py --epochs 10                  # prints the command for node 0 and for node 1
#   ./launch_multinode_ddp.sh ... --node-rank 1 --run train_ddp_basic.py --epochs 10   # runs node 1's
#   srun --kill-on-bad-exit=1 ./launch_multinode_ddp.sh --nproc-per-node 8 --run train_ddp_basic.py
#                                                       # SLURM: nodes, node rank, head node from SLURM_*
#   ./launch_multinode_ddp.sh --help | --explain
#
# Every bad input gets one line on stderr and exit code 2. TORCHRUN overrides the launcher command
# (default: torchrun), e.g. TORCHRUN="python3 -m torch.distributed.run".
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch_multinode_ddp.sh [options] SCRIPT [SCRIPT ARGS...]

Prints the exact torchrun command for every node of a multi-node DDP job (c10d rendezvous), ready to
paste, or with --run replaces itself (exec) with this node's command, so signals reach torchrun.

  --nnodes N           machines in the job, at most 100000 (SLURM: the step's, else the job's count)
  --nproc-per-node N   processes per machine, one per GPU (default: 1; SLURM: $SLURM_GPUS_ON_NODE)
  --master-addr HOST   node 0's address, reachable from every node (SLURM: first host of the step)
  --master-port PORT   a free TCP port on that host, 1-65535 (default: 29500; SLURM: from the job id)
  --node-rank N        this machine's index, 0 .. nnodes-1, for --run (SLURM: $SLURM_NODEID); only
                       logged: with c10d every node runs the same command and gets its ranks at join
  --rdzv-id ID         the job's name, the same on every node (default: $SLURM_JOB_ID, else ddp-HOST-PORT)
  --join-timeout S     seconds a node waits for all the others to join before it fails (default: 300)
  --max-restarts N     after a worker dies, torchrun restarts the whole group up to N times (default: 0)
  --run                exec this node's command instead of printing every node's
  --explain            print the switches that diagnose multi-node failures, then exit
  -h, --help           this text and those switches
EOF
}

explain() {
  cat <<'EOF'
When a multi-node job hangs or fails, in this order:
  1. Every node must reach MASTER_ADDR:MASTER_PORT over TCP: from each node, `nc -zv HOST PORT` (or
     `python3 -c "import socket; socket.create_connection(('HOST', PORT), 5)"`) while node 0 waits. A
     firewall or a security group that drops the port looks like a hang at start, until --join-timeout.
  2. All nodes must agree: the same --nnodes, --nproc-per-node, --master-addr, --master-port, --rdzv-id.
  3. NCCL_DEBUG=INFO            NCCL prints its setup: the interfaces, transports and peers it uses.
  4. NCCL_SOCKET_IFNAME=eth0    the network interface NCCL must use (see `ip -br addr`); a wrong default
                                (docker0, lo, a VPN) makes ranks wait for peers they cannot reach.
  5. GLOO_SOCKET_IFNAME=eth0    the same for gloo (CPU jobs, and PyTorch's own control messages).
  6. NCCL_IB_DISABLE=1          no InfiniBand: use TCP sockets (clouds without IB, broken IB drivers).
  7. TORCH_DISTRIBUTED_DEBUG=DETAIL   check that all ranks call the same collectives with the same shapes
                                (NCCL jobs; with gloo, DDP crashes under DETAIL in torch 2.13-2.14: use INFO).
  8. benchmark_scaling.py --collectives   as the SCRIPT: all_reduce/broadcast/barrier latency and bus
                                bandwidth between the nodes, to compare with the network's rated speed.
  9. A port already in use (EADDRINUSE) on node 0: pick another --master-port, or find the old job
     (`ss -ltnp | grep PORT`).
Export a switch on every node before the command, e.g. `NCCL_DEBUG=INFO ./launch_multinode_ddp.sh ... --run`.
EOF
}

die() { echo "error: $*" >&2; exit 2; }
MAX_NODES=100000

whole() {  # whole NAME VALUE MIN: VALUE must be an integer >= MIN
  if ! [[ $2 =~ ^[0-9]{1,9}$ ]] || (( 10#$2 < $3 )); then die "$1 must be a whole number >= $3, got '$2'"; fi
}

nnodes="" nproc="" addr="" port="" node_rank="" rdzv_id="" join_timeout=300 max_restarts=0 run=0
while (( $# )); do
  case $1 in
    -h|--help) usage; echo; explain; exit 0 ;;
    --explain) explain; exit 0 ;;
    --run) run=1; shift ;;
    --nnodes|--nproc-per-node|--master-addr|--master-port|--node-rank|--rdzv-id|--join-timeout|--max-restarts)
      (( $# >= 2 )) || die "$1 needs a value"
      case $1 in
        --nnodes) nnodes=$2 ;; --nproc-per-node) nproc=$2 ;; --master-addr) addr=$2 ;;
        --master-port) port=$2 ;; --node-rank) node_rank=$2 ;; --rdzv-id) rdzv_id=$2 ;;
        --join-timeout) join_timeout=$2 ;; --max-restarts) max_restarts=$2 ;;
      esac
      shift 2 ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) break ;;
  esac
done
(( $# )) || die "no training script given (see --help)"
script=$1; shift
[[ -f $script ]] || die "script not found: $script"

# Inside a SLURM allocation, what was not given comes from SLURM, read on each node (srun runs this
# script once per node, so SLURM_NODEID is that node's own index). An `srun -N k` step may use part of
# the allocation: its own node count and list (SLURM_STEP_*) come before the job's.
if [[ -n ${SLURM_JOB_ID:-} ]]; then
  nnodes=${nnodes:-${SLURM_STEP_NUM_NODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}}}
  node_rank=${node_rank:-${SLURM_NODEID:-}}
  nproc=${nproc:-${SLURM_GPUS_ON_NODE:-}}
  rdzv_id=${rdzv_id:-slurm-$SLURM_JOB_ID}
  if [[ $SLURM_JOB_ID =~ ^[0-9]+$ ]]; then  # two jobs sharing a head node get two ports
    port=${port:-$(( 20000 + 10#$SLURM_JOB_ID % 10000 ))}
  fi
  if [[ -z $addr ]]; then
    command -v scontrol >/dev/null || die "SLURM_JOB_ID is set but scontrol is not on PATH: give --master-addr"
    nodelist=${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-}}
    [[ -n $nodelist ]] || die "neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set: give --master-addr"
    hosts=$(scontrol show hostnames "$nodelist") || die "scontrol show hostnames '$nodelist' failed"
    addr=${hosts%%$'\n'*}  # the first host (no `| head -n 1`: under pipefail it can kill scontrol)
  fi
fi
port=${port:-29500}

[[ -n $nnodes ]] || die "--nnodes is required (or run inside a SLURM allocation)"
# torchrun sets no upper bound, and SLURM none beyond the cluster's size; the largest GPU clusters
# have about 10,000 nodes. Ten times that prints in a second or two: more is a typo, not a job.
if [[ $nnodes =~ ^[0-9]+$ ]] && (( ${#nnodes} > 9 || 10#$nnodes > MAX_NODES )); then
  die "--nnodes must be 1..$MAX_NODES (ten times the largest GPU clusters), got '$nnodes'"
fi
whole --nnodes "$nnodes" 1
nproc=${nproc:-1}
whole --nproc-per-node "$nproc" 1
[[ -n $addr ]] || die "--master-addr is required: the address of node 0 that every node can reach"
[[ $addr =~ ^[A-Za-z0-9._:-]+$ ]] || die "--master-addr is not a host name or address: '$addr'"
whole --master-port "$port" 1
(( 10#$port <= 65535 )) || die "--master-port must be 1-65535, got '$port'"
whole --join-timeout "$join_timeout" 1
whole --max-restarts "$max_restarts" 0
if [[ -n $node_rank ]]; then
  whole --node-rank "$node_rank" 0
  (( 10#$node_rank < 10#$nnodes )) || die "--node-rank must be 0..$((nnodes - 1)) for --nnodes $nnodes, got '$node_rank'"
fi
rdzv_id=${rdzv_id:-ddp-$addr-$port}
[[ $rdzv_id =~ ^[A-Za-z0-9._:-]+$ ]] || die "--rdzv-id may hold letters, digits and . _ : - only, got '$rdzv_id'"

read -r -a launcher <<< "${TORCHRUN:-torchrun}"
# With the c10d rendezvous every node runs the SAME command: the nodes meet at the endpoint and are given
# their ranks there (global rank 0 may live on any node), so no per-node rank can be typed wrong.
node_command() {  # node_command SCRIPT_ARGS...: the command, as the array cmd
  cmd=("${launcher[@]}" "--nnodes=$nnodes" "--nproc-per-node=$nproc"
       "--rdzv-backend=c10d" "--rdzv-endpoint=$addr:$port" "--rdzv-id=$rdzv_id"
       "--rdzv-conf=join_timeout=$join_timeout" "--max-restarts=$max_restarts" "$script" "$@")
}

# torch 2.x shares the rendezvous store with the workers; after a restart they can then read the previous
# attempt's addresses and fail to connect (pytorch/pytorch#135712, seen here 3 times in 5). With restarts
# on, give the workers a store of their own (on node 0, on a free port that the other nodes must reach).
if (( 10#$max_restarts > 0 )); then export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; fi

if (( run )); then
  [[ -n $node_rank ]] || die "--run needs --node-rank (or SLURM_NODEID inside a SLURM allocation)"
  # Checked here, not by exec, whose "not found" is two lines and exit code 127 (printing needs none)
  command -v "${launcher[0]:-}" >/dev/null || die "${launcher[0]:-torchrun} not found on PATH" \
    "(activate the environment with PyTorch, or set TORCHRUN='python3 -m torch.distributed.run')"
  node_command "$@"
  echo "node $node_rank of $nnodes: waiting up to ${join_timeout}s for all $nnodes nodes at $addr:$port" >&2
  exec "${cmd[@]}"
fi

node_command "$@"
if (( 10#$max_restarts > 0 )); then cmd=(env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "${cmd[@]}"); fi
echo "# $nnodes node(s) x $nproc process(es); start every node's command within ${join_timeout}s of the first"
line=$(printf '%q ' "${cmd[@]}")  # quoted once: up to MAX_NODES nodes print the same line
for (( r = 0; r < nnodes; r++ )); do
  if (( r == 0 )); then echo "# node 0 (on $addr, which every node must reach on port $port):"; else echo "# node $r:"; fi
  echo "${line% }"
done
