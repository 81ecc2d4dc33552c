#!/usr/bin/env bash
# Start `toolkit.train` on every rank through DeepSpeed's launcher.
#
#   ./launch.sh --num-gpus 2 -- --recipe ds_configs/recipes/full_finetune.yaml   # flags and config in one file
#   ./launch.sh --num-gpus 2 --config ds_configs/cpu_pp2.json -- --model tiny-gpt2 --data toolkit/corpus/corpus.txt
#   ./launch.sh --hostfile hosts --launcher pdsh --config ds.json -- --model DIR --data train.jsonl
#   # no ssh (one launcher per node, e.g. inside a cluster job), node 0 and node 1:
#   ./launch.sh --num-nodes 2 --num-gpus 4 --node-rank 0 --master-addr 10.0.0.1 --config ds.json -- ...
#   ./launch.sh --num-nodes 2 --num-gpus 4 --node-rank 1 --master-addr 10.0.0.1 --config ds.json -- ...
#   # mpirun (OpenMPI + mpi4py) or srun start every rank; the hostfile's slots are the processes:
#   ./launch.sh --launcher openmpi --hostfile hosts --config ds.json -- --model DIR --data train.jsonl
#   ./launch.sh --launcher slurm --hostfile hosts --launcher-args '--partition gpu' --config ds.json -- ...
#
# Everything after `--` goes to `dstk train` (see `dstk train --help`); --config is needed unless a --recipe
# there gives it (--config here wins over the recipe's). --dry-run prints the command.
# --max-restarts N: when a rank dies (killed, lost, past `--step-timeout`), stop every rank and continue the
# run with --resume from its last whole checkpoint, at most N times (not when the first step fails, nor when
# one step fails twice in a row). `--save-on-signal` after --: SIGUSR1/SIGTERM/Ctrl-C here make the ranks save
# their step and stop (slurm: sbatch --signal=B:USR1@300).
# --launcher-args STR goes to mpirun/srun/pdsh as it is. On a machine without CUDA, "GPUs" are
# CPU processes: DS_ACCELERATOR=cpu, gloo, and OMP_NUM_THREADS = cores / processes unless set.
set -euo pipefail

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "launch.sh: $*" >&2; exit 2; }
usage_error() { die "$* (see ./launch.sh --help)"; }
need_value() { [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || usage_error "$1 needs a value"; }
# A count given on the command line: digits only, so bash arithmetic never sees text or overflows.
count() {  # count FLAG VALUE MIN [MAX]
  local max=${4:-999999}
  [[ "$2" =~ ^[0-9]{1,6}$ ]] && (( 10#$2 >= $3 && 10#$2 <= max )) \
    || usage_error "$1 must be a whole number from $3 to $max, got '$2'"
}

PYTHON=${PYTHON:-python}
# Rank 0's "ready after" line counts from here (it splits the wait: launcher, imports, data, model, engine).
DSTK_LAUNCHED_AT=${DSTK_LAUNCHED_AT:-$(date +%s.%N)}
export DSTK_LAUNCHED_AT
num_gpus="" num_nodes="" hostfile="" launcher="" node_rank="" master_addr="" master_port="" config="" dry_run=0
max_restarts=0
launcher_args=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --num-gpus|--num-nodes|--hostfile|--launcher|--node-rank|--master-addr|--master-port|--config|--max-restarts)
      need_value "$@" ;;
    --launcher-args) [[ $# -ge 2 && -n "$2" ]] || usage_error "$1 needs a value" ;;
  esac
  case "$1" in
    --num-gpus) count "$1" "$2" 1; num_gpus=$((10#$2)); shift 2 ;;
    --num-nodes) count "$1" "$2" 1; num_nodes=$((10#$2)); shift 2 ;;
    --hostfile) hostfile=$2; shift 2 ;;
    --launcher) launcher=$2; shift 2 ;;
    --launcher-args) launcher_args=$2; shift 2 ;;
    --node-rank) count "$1" "$2" 0; node_rank=$((10#$2)); shift 2 ;;
    --master-addr) master_addr=$2; shift 2 ;;
    --master-port) count "$1" "$2" 1 65535; master_port=$((10#$2)); shift 2 ;;
    --config) config=$2; shift 2 ;;
    --max-restarts) count "$1" "$2" 0 1000; max_restarts=$((10#$2)); shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) die "unknown option $1 (training arguments go after --)" ;;
  esac
done
train_args=("$@")

recipe=0
for arg in "${train_args[@]}"; do [[ "$arg" == --recipe || "$arg" == --recipe=* ]] && recipe=1; done
if [[ -z "$config" ]]; then
  (( recipe )) || die "--config FILE is required, or a --recipe FILE after -- (make a config with: dstk generate-config ... -o FILE)"
else
  [[ -f "$config" ]] || die "--config $config does not exist"
fi
# With a --recipe, the config file and --out the ranks will use (the recipe's, under --config here and flags
# after --; an inline config written where every rank writes it). Unreadable: dstk train --check says why.
checked_config=$config recipe_out="" save_on_signal=0
for arg in "${train_args[@]}"; do [[ "$arg" == --save-on-signal ]] && save_on_signal=1; done
if (( recipe )) && view=$("$PYTHON" -c 'import sys; from toolkit.cli.train import launch_view; print(launch_view(sys.argv[1:]))' \
    ${config:+--config "$config"} "${train_args[@]}" 2>/dev/null); then
  { read -r checked_config; read -r recipe_out; read -r save_on_signal; } <<< "$view"
fi
case "$launcher" in ""|pdsh|openmpi|slurm|mpich|impi|mvapich) ;; *) die "--launcher must be pdsh, openmpi or slurm" ;; esac
# mpirun/srun start every rank themselves, from the hostfile's hosts and slots. DeepSpeed would take a
# one-host hostfile (or --node-rank) to mean "start locally" and quietly skip the launcher asked for.
if [[ -n "$launcher" && "$launcher" != pdsh ]]; then
  [[ -n "$hostfile" ]] || die "--launcher $launcher needs --hostfile (lines 'HOST slots=N': the processes to start)"
  [[ -f "$hostfile" ]] || die "--hostfile $hostfile does not exist"
  [[ -z "$node_rank" ]] || die "--node-rank is for one launcher per node; --launcher $launcher starts every node itself"
  if [[ "$launcher" != slurm && -n "$num_gpus$num_nodes" ]]; then
    die "--launcher $launcher starts one process per slot of --hostfile: drop --num-gpus/--num-nodes, edit the slots"
  fi
fi
if [[ -n "$node_rank" ]]; then
  [[ -n "$master_addr" ]] || die "--node-rank needs --master-addr (the address of node 0)"
  [[ -n "$hostfile" || ( -n "$num_nodes" && -n "$num_gpus" ) ]] \
    || die "--node-rank needs --hostfile, or --num-nodes and --num-gpus"
  [[ -z "$num_nodes" ]] || (( node_rank < num_nodes )) \
    || die "--node-rank $node_rank is not below --num-nodes $num_nodes (nodes are numbered from 0)"
fi

# The config's pipeline.stages must divide the processes; say which --num-gpus would.
check_stages() {
  "$PYTHON" - "$checked_config" "$num_gpus" "${num_nodes:-1}" "${config:-the config of --recipe ($checked_config)}" <<'EOF'
import json, math, sys
path, gpus, nodes, named = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    stages = json.load(open(path)).get("pipeline", {}).get("stages")
except Exception:  # not plain JSON: dstk train reads it as DeepSpeed does and checks it on every rank
    sys.exit(0)
if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1 or (gpus * nodes) % stages == 0:
    sys.exit(0)
step = stages // math.gcd(stages, nodes)  # --num-gpus must be a multiple of this
fits = " or ".join(str(g) for g in (gpus // step * step, gpus // step * step + step) if g > 0)
print(f"--num-gpus {gpus} x {nodes} node(s) = {gpus * nodes} processes, but {named} has pipeline.stages {stages}, "
      f"which does not divide {gpus * nodes}; use --num-gpus {fits}, or a config made for this many processes")
sys.exit(1)
EOF
}
if [[ -n "$num_gpus" && -z "$hostfile" && -n "$checked_config" ]]; then  # a hostfile's slots decide the count: dstk train --check then
  message=$(check_stages) || die "$message"
fi
# Every refusal dstk train would make on each rank before training (config for this world, data file,
# run folder), made once here, so a mistake is one message and no rank starts.
world=""
[[ -n "$num_gpus" && -z "$hostfile" ]] && world=$(( num_gpus * ${num_nodes:-1} ))
if [[ $dry_run == 0 ]]; then
  "$PYTHON" -m toolkit.train --check ${world:+--world-size "$world"} ${config:+--config "$config"} "${train_args[@]}" >/dev/null \
    || exit $?
fi

cmd=("$PYTHON" -m deepspeed.launcher.runner)
if [[ -n "$node_rank" && -z "$hostfile" ]]; then
  # The launcher learns the world from a hostfile; with --no_ssh the host names are never contacted.
  hostfile=$(mktemp "${TMPDIR:-/tmp}/dstk-hosts.XXXXXX")
  for ((n = 0; n < num_nodes; n++)); do echo "node$n slots=$num_gpus" >> "$hostfile"; done
fi
[[ -n "$hostfile" ]] && cmd+=(--hostfile "$hostfile")
[[ -n "$launcher" ]] && cmd+=(--launcher "$launcher")
[[ -n "$node_rank" ]] && cmd+=(--no_ssh --node_rank "$node_rank")
if [[ -n "$launcher" && "$launcher" != pdsh ]]; then
  # --force_multi: use that launcher even for one host. --no_ssh_check, and a master address (default:
  # the hostfile's first host), so DeepSpeed does not ssh to the first host (pdsh's concern).
  first_host=$(awk '$1 !~ /^#/ && NF { print $1; exit }' "$hostfile")
  cmd+=(--force_multi --no_ssh_check --master_addr "${master_addr:-$first_host}")
elif [[ -n "$master_addr" ]]; then
  cmd+=(--master_addr "$master_addr")
fi
# One node without --master-port: a port drawn for each attempt (draw_port), so runs on one machine do not collide.
port_drawn=0
if [[ -z "$master_port" && -z "$node_rank" && -z "$hostfile" ]]; then port_drawn=1; else
  [[ -n "$master_port" ]] && cmd+=(--master_port "$master_port")
fi
case "$launcher" in
  openmpi|slurm)
    # Their runners pass no MASTER_* to the ranks: toolkit.distributed.process_group reads these (openmpi: DeepSpeed's MPI
    # discovery finds rank 0's address itself and takes the port; slurm: both, else the first host of
    # the step's node list, which srun chooses: not necessarily the hostfile's first host).
    [[ -n "$master_port" ]] && export MASTER_PORT=$master_port
    [[ "$launcher" == slurm && -n "$master_addr" ]] && export MASTER_ADDR=$master_addr ;;
esac
# Whether ranks run on GPUs is decided here only when they all run on this machine: a login node
# without a GPU must not send DS_ACCELERATOR=cpu to GPU nodes (each rank decides for itself there).
all_local() {
  [[ -z "$hostfile" ]] && return 0
  local here; here=$(hostname); local short=${here%%.*}
  awk -v a="$here" -v b="$short" '$1 !~ /^#/ && NF && $1 != "localhost" && $1 != "127.0.0.1" && $1 != a && $1 != b \
    { remote = 1 } END { exit remote }' "$hostfile"
}
# No GPU driver on this machine (NVIDIA's or ROCm's) means no CUDA, without asking torch (~1.5 s a launch);
# with one, torch says. (DS_ACCELERATOR=cpu already set: not asked either; DS_ACCELERATOR=cuda: kept.)
no_gpu_driver() {
  [[ ! -e /proc/driver/nvidia/version && ! -e /dev/nvidiactl && ! -e /dev/kfd ]] && ! command -v nvidia-smi >/dev/null
}
if all_local && [[ "${DS_ACCELERATOR:-}" != cuda ]] && { [[ "${DS_ACCELERATOR:-}" == cpu ]] || no_gpu_driver ||
    ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }; then
  export DS_ACCELERATOR=cpu
  procs=${num_gpus:-1}
  if [[ -z "$num_gpus" && -n "$hostfile" ]]; then  # the first host's slots=N
    procs=$(awk '$1 !~ /^#/ && NF { for (i = 2; i <= NF; i++) if (sub(/^slots=/, "", $i)) { print $i + 0; exit } }' \
      "$hostfile")
  fi
  cores=$(nproc)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / ${procs:-1} > 0 ? cores / ${procs:-1} : 1 ))}
fi
# Under a scheduler's allocation (CUDA_VISIBLE_DEVICES=4,5) DeepSpeed's runner, given --num_gpus, drops the
# variable and starts the ranks on GPUs 0..N-1, other jobs' GPUs: on one node the visible GPUs are named.
if [[ -n "$num_gpus" && -z "$hostfile" && "${num_nodes:-1}" == 1 && -n "${CUDA_VISIBLE_DEVICES:-}" &&
      "${DS_ACCELERATOR:-}" != cpu ]]; then
  IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
  (( num_gpus <= ${#visible[@]} )) || die "--num-gpus $num_gpus, but CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES shows \
${#visible[@]} GPU(s); use --num-gpus ${#visible[@]} or fewer"
  cmd+=(--include "localhost:$(IFS=,; echo "${visible[*]:0:num_gpus}")")
  num_nodes=""
else
  [[ -n "$num_gpus" ]] && cmd+=(--num_gpus "$num_gpus")
fi
[[ -n "$num_nodes" ]] && cmd+=(--num_nodes "$num_nodes")
# NCCL_* settings (interfaces, IB, debug) for the other nodes: DeepSpeed's runner forwards them only when its
# own accelerator is CUDA, so from a login node without a GPU it forwards none.
nccl_vars=$(compgen -e | { grep '^NCCL_' || true; } | paste -sd ' ' -)
if [[ "$launcher" == openmpi ]]; then
  # mpirun passes only PYTHON*/UCX_* (DeepSpeed's list) to other nodes: add dstk's variables.
  # MASTER_ADDR with --master-addr: toolkit.distributed.process_group then takes the ranks from OpenMPI's variables and this
  # address, where DeepSpeed's MPI discovery would take the first address of `hostname -I` on rank 0.
  [[ -n "$master_addr" ]] && export MASTER_ADDR=$master_addr
  for var in DS_ACCELERATOR OMP_NUM_THREADS MASTER_PORT MASTER_ADDR $nccl_vars; do
    [[ -n "${!var:-}" ]] && launcher_args="-x $var${launcher_args:+ $launcher_args}"
  done
  # mpirun's own TCP traffic: DeepSpeed's runner picks eth0 unless told; the subnet of the master address
  # names the right interface on every node, whatever it is called there.
  if [[ "$launcher_args" != *btl_tcp_if_include* ]]; then
    subnet=$("$PYTHON" -c 'import sys; from toolkit.distributed.process_group import subnet_of; print(subnet_of(sys.argv[1]) or "")' \
      "${master_addr:-$first_host}")
    if [[ -n "$subnet" ]]; then
      launcher_args="--mca btl_tcp_if_include $subnet${launcher_args:+ $launcher_args}"
    else
      echo "launch.sh: mpirun's TCP traffic uses eth0 (DeepSpeed's default; ${master_addr:-$first_host} is on no subnet of \
this machine): name another with --launcher-args '--mca btl_tcp_if_include IFACE-or-CIDR'" >&2
    fi
  fi
  if [[ $(id -u) == 0 ]]; then  # mpirun refuses root unless told twice
    export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1}
    export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
  fi
fi
if [[ -z "$launcher" || "$launcher" == pdsh ]] && [[ -n "$nccl_vars" && -n "$hostfile" && -z "$node_rank" ]]; then
  # pdsh: DeepSpeed's runner exports what its env file lists (DS_ENV_FILE, ~ and . searched; an absolute
  # name is that file): NCCL_* plus the user's own ~/.deepspeed_env and ./.deepspeed_env lines.
  env_file=$(mktemp "${TMPDIR:-/tmp}/dstk-env.XXXXXX")
  for var in $nccl_vars; do printf '%s=%s\n' "$var" "${!var}" >> "$env_file"; done
  for own in ~/"${DS_ENV_FILE:-.deepspeed_env}" "./${DS_ENV_FILE:-.deepspeed_env}"; do
    if [[ -f "$own" ]]; then grep -v '^\s*$' "$own" >> "$env_file" || true; fi
  done
  export DS_ENV_FILE=$env_file
fi
[[ -n "$launcher_args" ]] && cmd+=(--launcher_args "$launcher_args")
# The launcher's INFO lines (and the no-hostfile warning) only with dstk train --verbose; its [ERROR]
# line for a rank's non-zero exit neither (a refusal is said by rank 0; any other failure by the end below).
log_level=critical
for arg in "${train_args[@]}"; do [[ "$arg" == --verbose ]] && log_level=info; done
module=(--log_level "$log_level" --module toolkit.train ${config:+--config "$config"})
# A port nobody listens on, outside the ephemeral range (toolkit.distributed.process_group.free_port); rank 0 names
# it if it is taken before it listens (exit PORT_TAKEN), and the attempt runs again on another.
draw_port() {
  (( port_drawn )) || return 0
  master_port=${DSTK_TEST_FIRST_PORT:-}  # testing: a port the test holds, to be taken
  unset DSTK_TEST_FIRST_PORT
  [[ -n "$master_port" ]] || master_port=$("$PYTHON" -c 'from toolkit.distributed.process_group import free_port
print(free_port())')
  export DSTK_PORT_PICKED=$master_port
}
attempt_cmd() {  # attempt_cmd TRAIN_ARGS...: the launcher's command line for one attempt
  attempt=("${cmd[@]}")
  (( port_drawn )) && attempt+=(--master_port "$master_port")
  attempt+=("${module[@]}" "$@")
}

if [[ $dry_run == 1 ]]; then
  draw_port
  attempt_cmd "${train_args[@]}"
  echo "DS_ACCELERATOR=${DS_ACCELERATOR:-} OMP_NUM_THREADS=${OMP_NUM_THREADS:-}${DS_ENV_FILE:+ DS_ENV_FILE=$DS_ENV_FILE} \
$(printf '%q ' "${attempt[@]}")"
  exit 0
fi

# The launcher runs in a process group of its own (setsid), with every local rank under it. Ctrl-C, or
# SIGINT / SIGTERM to this script, stops all of them within seconds: DeepSpeed's runner gets SIGTERM
# first (under pdsh it then stops the other nodes' ranks), then the whole group, then SIGKILL. A rank
# stopped mid-save leaves that tag without `latest`: the last whole checkpoint is still `latest`.
# With --save-on-signal the first such signal (and SIGUSR1) goes to this machine's ranks instead: they finish
# their step, save and stop; a second one stops them at once.
out_dir=${recipe_out:-runs/dstk}  # dstk train's default --out (tests/commands/test_launch_sh.py checks they agree)
for ((i = 0; i < ${#train_args[@]}; i++)); do
  case "${train_args[i]}" in
    --out) out_dir=${train_args[i + 1]:-} ;;
    --out=*) out_dir=${train_args[i]#--out=} ;;
  esac
done
ckpt="$out_dir/checkpoints"
latest_tag() { [[ -n "$out_dir" && -f "$ckpt/latest" ]] && cat "$ckpt/latest" || true; }
last_checkpoint() {  # one line: what a resume would start from
  local latest partial=""
  [[ -n "$out_dir" && -d "$ckpt" ]] || return 0
  latest=$(latest_tag)
  for tag in "$ckpt"/global_step*; do
    [[ -d "$tag" ]] || continue
    tag=${tag##*/}
    if [[ -z "$latest" ]] || (( ${tag#global_step} > ${latest#global_step} )); then partial+=" $tag"; fi
  done
  if [[ -n "$latest" ]]; then
    echo "launch.sh: the last whole checkpoint is $ckpt/$latest (resume with --resume)" >&2
  else
    echo "launch.sh: no whole checkpoint was written in $ckpt" >&2
  fi
  [[ -z "$partial" ]] || echo "launch.sh: interrupted while saving:$partial (incomplete; a resume ignores it)" >&2
}
metrics_lines() { if [[ -n "$out_dir" && -f "$out_dir/metrics.jsonl" ]]; then wc -l < "$out_dir/metrics.jsonl"; else echo 0; fi; }
last_step_after() {  # last_step_after LINES: the last step rank 0 logged after the first LINES lines of metrics.jsonl
  [[ -n "$out_dir" && -f "$out_dir/metrics.jsonl" ]] || return 0
  tail -n +"$(( $1 + 1 ))" "$out_dir/metrics.jsonl" | sed -n 's/^{"step": \([0-9]*\),.*/\1/p' | tail -n 1
}
stop() {  # stop SIGNAL EXIT_CODE
  trap '' INT TERM USR1
  echo "launch.sh: $1: stopping every rank" >&2
  kill -TERM "$child" 2>/dev/null || true
  for _ in {1..30}; do kill -0 "$child" 2>/dev/null || break; sleep 0.1; done
  kill -TERM -- "-$child" 2>/dev/null || true
  for _ in {1..50}; do kill -0 -- "-$child" 2>/dev/null || break; sleep 0.1; done
  kill -KILL -- "-$child" 2>/dev/null || true
  last_checkpoint
  [[ -z "${env_file:-}" ]] || rm -f "$env_file"
  exit "$2"
}
signalled=""
on_signal() {  # on_signal SIGNAL EXIT_CODE
  if (( save_on_signal )) && [[ -z "$signalled" ]]; then
    signalled=$1
    echo "launch.sh: $1: the ranks finish their step, save a checkpoint and stop (--save-on-signal; $1 again: stop now)" >&2
    # to the ranks only: DeepSpeed's launcher would stop them on it
    "$PYTHON" -c 'import signal, sys, psutil
for p in psutil.Process(int(sys.argv[1])).children(recursive=True):
    try:
        cmd = p.cmdline()
        if any(a == "-m" and b == "toolkit.train" for a, b in zip(cmd, cmd[1:])):
            p.send_signal(signal.SIGUSR1 if sys.argv[2] == "SIGUSR1" else signal.SIGTERM)
    except psutil.Error:
        pass' "$child" "$1" || true
  else
    stop "$1" "$2"
  fi
}
trap 'on_signal SIGINT 130' INT
trap 'on_signal SIGTERM 143' TERM
trap 'on_signal SIGUSR1 138' USR1
run_attempt() {  # run_attempt TRAIN_ARGS...: start the ranks, wait for them; sets rc
  attempt_cmd "$@"
  setsid "${attempt[@]}" &
  child=$!
  while :; do
    rc=0
    wait "$child" || rc=$?
    (( rc > 128 )) && kill -0 "$child" 2>/dev/null && continue  # a signal (trapped above) ended the wait
    break
  done
}
# Exit codes of the ranks (toolkit.distributed.resilience, toolkit.errors.PortTaken); a rank killed by a signal
# exits 256 - signal through DeepSpeed's launcher (SIGKILL: 247, often the out-of-memory killer).
PEER_LOST=75 STEP_TIMEOUT=124 PORT_TAKEN=98
cause() {
  if (( $1 >= 192 )); then
    echo "a rank was killed by signal $((256 - $1))$( ((256 - $1 == 9)) && echo " (SIGKILL: out of memory?)")"
  elif (( $1 == STEP_TIMEOUT )); then
    echo "a rank ran past --step-timeout (the ranks' lines above say where each was)"
  elif (( $1 == PEER_LOST )); then
    echo "a rank lost its peers (the ranks' lines above)"
  else
    echo "a rank failed with exit code $1 (its error is above)"
  fi
}
# The arguments of a restart: the run continues from its last whole checkpoint (--resume), or starts over in the
# same --out when none was written yet (--overwrite: it holds only this run's files).
restart_args() {  # restart_args TAG
  run_args=()
  for arg in "${train_args[@]}"; do
    case "$arg" in
      --resume|--overwrite) ;;
      --resume-with-new-data) [[ -n "$1" ]] && run_args+=("$arg") ;;
      *) run_args+=("$arg") ;;
    esac
  done
  if [[ -n "$1" ]]; then run_args+=(--resume); else run_args+=(--overwrite); fi
}

echo "launch.sh: starting the ranks; rank 0 says what the run is once they are ready" >&2
run_args=("${train_args[@]}")
restarts=0 failed_step="" port_draws=0 DSTK_ATTEMPT=0
resume_from=""
for arg in "${train_args[@]}"; do [[ "$arg" == --resume ]] && resume_from=$(latest_tag); done
while :; do
  draw_port
  logged=$(metrics_lines)
  export DSTK_ATTEMPT=$((DSTK_ATTEMPT + 1))
  (( DSTK_ATTEMPT + port_draws == 1 )) || DSTK_LAUNCHED_AT=$(date +%s.%N)  # "ready after" counts from this attempt
  run_attempt "${run_args[@]}"
  if (( rc == PORT_TAKEN && port_drawn && port_draws < 3 )); then  # rank 0 said so; the same attempt again
    port_draws=$((port_draws + 1)) DSTK_ATTEMPT=$((DSTK_ATTEMPT - 1))
    continue
  fi
  if [[ -n "$signalled" ]]; then
    (( rc == 0 )) && echo "launch.sh: stopped on $signalled" >&2
    last_checkpoint
    [[ -z "${env_file:-}" ]] || rm -f "$env_file"
    exit "$rc"
  fi
  # done, a refusal (rank 0 said why: PORT_TAKEN too) or an error of dstk's (its traceback is above)
  (( rc > 2 && rc != PORT_TAKEN )) || break
  echo "launch.sh: $(cause "$rc")" >&2
  step=$(last_step_after "$logged")
  from=${resume_from#global_step}
  failed=$(( ${step:-${from:-0}} + 1 ))  # the step that was running
  if (( restarts >= max_restarts )); then
    (( max_restarts == 0 )) || echo "launch.sh: not restarted: --max-restarts $max_restarts reached" >&2
    last_checkpoint
    break
  fi
  if (( DSTK_ATTEMPT == 1 )) && [[ -z "$step" ]]; then
    echo "launch.sh: not restarted: the run failed before its first step ended (a restart would fail alike)" >&2
    last_checkpoint
    break
  fi
  if [[ "$failed" == "$failed_step" ]]; then
    echo "launch.sh: not restarted: step $failed failed twice in a row" >&2
    last_checkpoint
    break
  fi
  restarts=$((restarts + 1)) failed_step=$failed
  resume_from=$(latest_tag)
  restart_args "$resume_from"
  if [[ -n "$resume_from" ]]; then
    echo "launch.sh: restart $restarts of $max_restarts after a failure in step $failed: resuming from $ckpt/$resume_from" >&2
  else
    echo "launch.sh: restart $restarts of $max_restarts after a failure in step $failed: from the start (no whole checkpoint yet)" >&2
  fi
done
[[ -z "${env_file:-}" ]] || rm -f "$env_file"
exit "$rc"
