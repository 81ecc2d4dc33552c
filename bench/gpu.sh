#!/usr/bin/env bash
# GPU benchmarks (issues 5, 6 and 24): `make setup` (the README's set-up; skipped with PY=...), then under
# 8 minutes on one H100/H200:
#   1. bench/plan_gpu.py      planner peak memory vs torch.cuda.max_memory_allocated (ZeRO 0/1, in-process)
#   2. bench/gpu_finetune.py  `dstk train` (toolkit.train through launch.sh, one run per case) on a ~1B model of
#                             llama-3.2-1b's shape saved with save_pretrained (bf16) first, seq 2048: full
#                             fine-tune (sdpa; flash_attention_2 when flash_attn is installed), LoRA, QLoRA,
#                             packed chat data; tokens/s, MFU, peak memory vs `dstk plan`, the loss
#   3. bench/report.py        BENCHMARKS.md, with the GPU named in the table's title
# Where it cannot run (torch, deepspeed or transformers not importable, no usable CUDA device) it says why in
# one line and exits 1. A step that fails is reported on stdout and in gpu.json, the next steps still run,
# and the script exits 1. Arguments go to gpu_finetune.py:
#   bench/gpu.sh [--quick] [--gpus N] [--gpu h100-sxm] [--fused-adam] [--cases pp1-zero1 pp1-lora ...]
# Cases by GPU count (torch.cuda.device_count(), or --gpus N: the first N GPUs): 1 GPU runs the pp 1 cases
# (pp2, pp2-lora and pp2-dp2 are reported as skipped: NCCL refuses two ranks on one GPU); 2 GPUs add pp 2;
# 4 GPUs add pp 2 x dp 2. Pick GPUs with --gpus, not CUDA_VISIBLE_DEVICES: DeepSpeed's launcher, given
# --num_gpus, ignores it and renumbers from GPU 0. The cases share what is left of GPU_SH_BUDGET seconds
# (default 480) after step 1; a case that cannot start in time is reported as skipped.
# No op is JIT-built: torch's AdamW (not FusedAdam, unless --fused-adam); TORCH_EXTENSIONS_DIR is a fresh
# folder, and whatever DeepSpeed built there anyway is named at the end.
# Check the script on a CPU first: .venv/bin/python bench/gpu_finetune.py --dry-run
set -uo pipefail
cd "$(dirname "$0")/.."
steps=()
if [ -z "${PY:-}" ]; then  # the README's set-up (nothing to do when .venv/ is up to date); PY=... skips it
    echo "== make setup"
    setup_start=$SECONDS
    make setup || { rc=$?; echo "gpu.sh: cannot run: make setup failed (exit code $rc; its output is above)"; exit 1; }
    echo "gpu.sh: set-up took $((SECONDS - setup_start)) s (target: 240 s on a fresh machine)"
    steps+=(--step "make setup=ok: $((SECONDS - setup_start)) s")
    PY=.venv/bin/python
fi
start=$SECONDS

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
    if [ "$rc" -eq 0 ]; then
        steps+=(--step "$name=ok")
    else
        echo "gpu.sh: step $name FAILED (exit code $rc)"
        failed+=("$name (exit code $rc)")
        steps+=(--step "$name=failed: exit code $rc")
    fi
    return "$rc"
}

step plan_gpu.py "$PY" bench/plan_gpu.py
budget=$(( ${GPU_SH_BUDGET:-480} - (SECONDS - start) - 15 ))  # 15 s: report.py and the end
step gpu_finetune.py "$PY" bench/gpu_finetune.py "${steps[@]}" --budget "$budget" "$@"
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
