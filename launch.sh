#!/usr/bin/env bash
# Start `toolkit.train` on every rank through DeepSpeed's launcher.
#
#   ./launch.sh --num-gpus 2 --config ds_configs/cpu_pp2.json -- --model tiny-gpt2 --data toolkit/corpus/corpus.txt
#   ./launch.sh --hostfile hosts --launcher pdsh --config ds.json -- --model DIR --data train.jsonl
#   # no ssh (one launcher per node, e.g. inside a cluster job), node 0 and node 1:
#   ./launch.sh --num-nodes 2 --num-gpus 4 --node-rank 0 --master-addr 10.0.0.1 --config ds.json -- ...
#   ./launch.sh --num-nodes 2 --num-gpus 4 --node-rank 1 --master-addr 10.0.0.1 --config ds.json -- ...
#
# Everything after `--` goes to `dstk train` (see `dstk train --help`). --dry-run prints the command.
# On a machine without CUDA, "GPUs" are CPU processes: DS_ACCELERATOR=cpu, gloo, and
# OMP_NUM_THREADS = cores / processes unless set.
set -euo pipefail

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "launch.sh: $*" >&2; exit 2; }

PYTHON=${PYTHON:-python}
num_gpus="" num_nodes="" hostfile="" launcher="" node_rank="" master_addr="" master_port="" config="" dry_run=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --num-gpus) num_gpus=$2; shift 2 ;;
    --num-nodes) num_nodes=$2; shift 2 ;;
    --hostfile) hostfile=$2; shift 2 ;;
    --launcher) launcher=$2; shift 2 ;;
    --node-rank) node_rank=$2; shift 2 ;;
    --master-addr) master_addr=$2; shift 2 ;;
    --master-port) master_port=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) die "unknown option $1 (training arguments go after --)" ;;
  esac
done
train_args=("$@")

[[ -n "$config" ]] || die "--config FILE is required (make one with: dstk generate-config ... -o FILE)"
[[ -f "$config" ]] || die "--config $config does not exist"
case "$launcher" in ""|pdsh|openmpi|slurm|mpich|impi|mvapich) ;; *) die "--launcher must be pdsh, openmpi or slurm" ;; esac
if [[ -n "$node_rank" ]]; then
  [[ -n "$master_addr" ]] || die "--node-rank needs --master-addr (the address of node 0)"
  [[ -n "$hostfile" || ( -n "$num_nodes" && -n "$num_gpus" ) ]] \
    || die "--node-rank needs --hostfile, or --num-nodes and --num-gpus"
fi

cmd=("$PYTHON" -m deepspeed.launcher.runner)
if [[ -n "$node_rank" && -z "$hostfile" ]]; then
  # The launcher learns the world from a hostfile; with --no_ssh the host names are never contacted.
  hostfile=$(mktemp "${TMPDIR:-/tmp}/dstk-hosts.XXXXXX")
  for ((n = 0; n < num_nodes; n++)); do echo "node$n slots=$num_gpus" >> "$hostfile"; done
fi
[[ -n "$hostfile" ]] && cmd+=(--hostfile "$hostfile")
[[ -n "$num_nodes" ]] && cmd+=(--num_nodes "$num_nodes")
[[ -n "$num_gpus" ]] && cmd+=(--num_gpus "$num_gpus")
[[ -n "$launcher" ]] && cmd+=(--launcher "$launcher")
[[ -n "$node_rank" ]] && cmd+=(--no_ssh --node_rank "$node_rank")
[[ -n "$master_addr" ]] && cmd+=(--master_addr "$master_addr")
if [[ -z "$master_port" && -z "$node_rank" && -z "$hostfile" ]]; then
  # one node: a free port, so two runs on one machine do not collide on DeepSpeed's default 29500
  master_port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
[[ -n "$master_port" ]] && cmd+=(--master_port "$master_port")
cmd+=(--module toolkit.train --config "$config" "${train_args[@]}")

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  export DS_ACCELERATOR=cpu
  procs=${num_gpus:-1}
  cores=$(nproc)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / procs > 0 ? cores / procs : 1 ))}
fi

if [[ $dry_run == 1 ]]; then
  echo "DS_ACCELERATOR=${DS_ACCELERATOR:-} OMP_NUM_THREADS=${OMP_NUM_THREADS:-} $(printf '%q ' "${cmd[@]}")"
  exit 0
fi
exec "${cmd[@]}"
