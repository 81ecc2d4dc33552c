#!/usr/bin/env bash
# GPU benchmarks (issues 5 and 6), one CUDA GPU, under 8 minutes on an H100/H200:
#   1. bench/plan_gpu.py      planner peak memory vs torch.cuda.max_memory_allocated (ZeRO 0/1)
#   2. bench/gpu_finetune.py  tokens/s, MFU and peak memory: dstk vs plain deepspeed.initialize (ZeRO 1/2)
#   3. bench/report.py        BENCHMARKS.md, with the GPU named in the table's title
# Without CUDA it prints "skipped: no CUDA" and exits 0. Arguments go to gpu_finetune.py:
#   bench/gpu.sh [--quick] [--gpu h100-sxm] [--fused-adam]
# Check the script on a CPU first: .venv/bin/python bench/gpu_finetune.py --dry-run
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu.sh: skipped: no CUDA"
    exit 0
fi
export DS_ACCELERATOR=cuda TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, deepspeed, transformers as t; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'deepspeed', deepspeed.__version__, 'transformers', t.__version__)"

start=$SECONDS
echo "== plan_gpu.py"
"$PY" bench/plan_gpu.py
echo "== gpu_finetune.py $*"
"$PY" bench/gpu_finetune.py "$@"
"$PY" bench/report.py
echo "gpu.sh: done in $((SECONDS - start)) s"
