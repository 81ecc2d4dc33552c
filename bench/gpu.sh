#!/usr/bin/env bash
# GPU benchmarks (issues 5, 6, 24 and 43): the set-up, then on one H100/H200 within GPU_SH_BUDGET seconds (default
# 480) of the script's start (of the set-up's end after `make setup`), with a report even when a step fails:
#   1. bench/plan_gpu.py      planner peak memory vs torch.cuda.max_memory_allocated (ZeRO 0/1, in-process; stopped
#                             after PLAN_GPU_TIMEOUT seconds, default 180)
#   2. bench/gpu_finetune.py  `dstk train` (toolkit.train through launch.sh, one run per case) on a ~1B model of
#                             llama-3.2-1b's shape saved with save_pretrained (bf16) first, seq 2048: full
#                             fine-tune (sdpa; flash_attention_2 when flash_attn is installed), LoRA, QLoRA,
#                             packed chat data; tokens/s, MFU, peak memory vs `dstk plan`, the loss
#   3. bench/report.py        BENCHMARKS.md, with the GPU named in the table's title
# The set-up, by what it finds:
#   wheels/ holds wheels       offline, no registry needed (the lent GPU machine): `make wheelhouse` on a machine
#   (WHEELS=DIR: another)      with a registry writes them; bench/install_wheels.sh installs them with `pip install
#                              --no-index --no-deps --target` into a fresh temp folder put on PYTHONPATH, on top of
#                              ${PY:-python3} and its own torch, transformers, ... (about 15 s; counted in the budget)
#   no wheels, PY unset        `make setup` (the README's set-up into .venv/; needs a registry)
#   no wheels, PY=python       that Python as it is
# On the lent machine (Python 3.12, torch 2.11+cu130, transformers 5.17, no deepspeed/datasets, no registry), from a
# tree carrying wheels/:   bash bench/gpu.sh --quick          (under 9 minutes in all)
# Where it cannot run (the install fails; torch, deepspeed or transformers not importable; no usable CUDA device) it
# says why in one line and exits 1. A step that fails is reported on stdout and in gpu.json, the next steps still
# run, and the script exits 1. Arguments go to gpu_finetune.py:
#   bench/gpu.sh [--quick] [--gpus N] [--gpu h100-sxm] [--fused-adam] [--cases pp1-zero1 pp1-lora ...]
# Cases by GPU count (torch.cuda.device_count(), or --gpus N: the first N GPUs): 1 GPU runs the pp 1 cases
# (pp2, pp2-lora and pp2-dp2 are reported as skipped: NCCL refuses two ranks on one GPU); 2 GPUs add pp 2;
# 4 GPUs add pp 2 x dp 2. Pick GPUs with --gpus, not CUDA_VISIBLE_DEVICES: DeepSpeed's launcher, given
# --num_gpus, ignores it and renumbers from GPU 0. The cases share what is left of the budget after step 1; a
# case that cannot start in time is reported as skipped, the one running at the deadline is stopped, and
# gpu_finetune.py itself is stopped 45 s past it (gpu.json keeps every case finished by then).
# No op is JIT-built: torch's AdamW (not FusedAdam, unless --fused-adam); TORCH_EXTENSIONS_DIR is a fresh
# folder, and whatever DeepSpeed built there anyway is named at the end.
# Check the script on a CPU first: .venv/bin/python bench/gpu_finetune.py --dry-run
set -uo pipefail
cd "$(dirname "$0")/.."
steps=()
wheels=${WHEELS:-wheels}
budget_total=${GPU_SH_BUDGET:-480}
start=$SECONDS
if compgen -G "$wheels/*.whl" >/dev/null; then  # offline: the wheels on top of the Python's own packages
    PY=${PY:-python3}
    echo "== offline install: $wheels/ onto $PY"
    site=$(mktemp -d -t dstk-site-XXXXXX)
    trap 'rm -rf "$site"' EXIT
    installed=$(bash bench/install_wheels.sh "$PY" "$wheels" "$site") \
        || { printf '%s\n' "$installed"; echo "gpu.sh: cannot run: the offline install from $wheels/ failed" \
             "($(printf '%s\n' "$installed" | tail -n 1))"; exit 1; }
    printf '%s\n' "$installed"
    export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"  # this tree's code first, then the wheels
    detail="$(compgen -G "$wheels/*.whl" | wc -l) wheels in $((SECONDS - start)) s"
    unmet=$(printf '%s\n' "$installed" | grep -c '^install_wheels: unmet:')
    [ "$unmet" -eq 0 ] || detail+=", $unmet unmet requirement(s): see the output"
    steps+=(--step "offline install=ok: $detail")
elif [ -z "${PY:-}" ]; then  # the README's set-up (nothing to do when .venv/ is up to date); PY=... skips it
    echo "== make setup"
    make setup || { rc=$?; echo "gpu.sh: cannot run: make setup failed (exit code $rc; its output is above)"; exit 1; }
    echo "gpu.sh: set-up took $((SECONDS - start)) s (target: 240 s on a fresh machine)"
    steps+=(--step "make setup=ok: $((SECONDS - start)) s")
    PY=.venv/bin/python
    start=$SECONDS  # the budget is the benchmark's: a fresh machine's set-up is not in it
fi

why=$("$PY" - 2>&1 <<'EOF'
import sys

def need(name):
    try:
        return __import__(name)
    except Exception as exc:
        sys.exit(f"{name} not importable: {type(exc).__name__}: {exc}")


torch = need("torch")
if not torch.cuda.is_available():
    sys.exit(f"torch.cuda.is_available() is False (no CUDA device or driver; torch {torch.__version__}, "
             f"built for CUDA {torch.version.cuda})")
need("deepspeed")
need("transformers")
EOF
) || { echo "gpu.sh: cannot run: $(printf '%s\n' "$why" | tail -n 1)"; exit 1; }

export DS_ACCELERATOR=cuda TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
TORCH_EXTENSIONS_DIR=$(mktemp -d -t dstk-gpu-ops-XXXXXX)
export TORCH_EXTENSIONS_DIR
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import importlib.util as u, torch, deepspeed, transformers as t; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'deepspeed', deepspeed.__version__, 'transformers', t.__version__, 'GPUs', torch.cuda.device_count(), \
'flash_attn', bool(u.find_spec('flash_attn')), 'bitsandbytes', bool(u.find_spec('bitsandbytes')))"

failed=()
step() {  # step NAME COMMAND...: run it, say how it went, remember it for gpu.json
    local name=$1 rc
    shift
    echo "== $name"
    "$@"
    rc=$?
    local why="exit code $rc"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why="stopped by timeout, exit code $rc"
    if [ "$rc" -eq 0 ]; then
        steps+=(--step "$name=ok")
    else
        echo "gpu.sh: step $name FAILED ($why)"
        failed+=("$name ($why)")
        steps+=(--step "$name=failed: $why")
    fi
    return "$rc"
}

step plan_gpu.py timeout -k 10 "${PLAN_GPU_TIMEOUT:-240}" "$PY" bench/plan_gpu.py
budget=$(( budget_total - (SECONDS - start) - 15 ))  # 15 s: report.py and the end
# gpu_finetune.py stops the case running at its deadline (SIGTERM, SIGKILL 30 s later); timeout is the backstop
step gpu_finetune.py timeout -k 10 $(( budget > 0 ? budget + 45 : 45 )) "$PY" bench/gpu_finetune.py "${steps[@]}" \
    --budget "$budget" "$@"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then  # stopped before it could say so in gpu.json
    "$PY" bench/gpu_finetune.py --record-only "${steps[@]: -2}" "$@" || echo "gpu.sh: could not record the timeout in gpu.json"
fi
step report.py "$PY" bench/report.py || "$PY" bench/gpu_finetune.py --record-only "${steps[@]: -2}" "$@" \
    || echo "gpu.sh: could not record report.py's failure in gpu.json"
# torch's JIT builds go to TORCH_EXTENSIONS_DIR/py<ver>_<cuda>/<op name>
built=$(find "$TORCH_EXTENSIONS_DIR" -mindepth 2 -maxdepth 2 -type d -printf '%f\n' 2>/dev/null | paste -sd ' ' -)
echo "gpu.sh: ops JIT-built during the run: ${built:-none}"
rm -rf "$TORCH_EXTENSIONS_DIR"
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu.sh: FAILED in $((SECONDS - start)) s: ${failed[*]}"
    exit 1
fi
echo "gpu.sh: done in $((SECONDS - start)) s"
