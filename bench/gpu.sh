#!/usr/bin/env bash
# GPU benchmarks (issues 5 and 6), under 8 minutes on one H100/H200:
#   1. bench/plan_gpu.py      planner peak memory vs torch.cuda.max_memory_allocated (ZeRO 0/1, in-process)
#   2. bench/gpu_finetune.py  `dstk train` (toolkit.train through launch.sh, one run per case) on llama-3.2-1b's
#                             shape, bf16, sdpa, seq 2048: tokens/s, MFU, peak memory vs `dstk plan`, the loss
#   3. bench/report.py        BENCHMARKS.md, with the GPU named in the table's title
# Without CUDA it prints "skipped: no CUDA" and exits 0. Arguments go to gpu_finetune.py:
#   bench/gpu.sh [--quick] [--gpus N] [--gpu h100-sxm] [--fused-adam] [--cases pp1-zero1 pp2 ...]
# Cases by GPU count (torch.cuda.device_count(), or --gpus N: the first N GPUs): 1 GPU runs pp 1 with
# ZeRO 1 and ZeRO 3 (one rank each; pp2 and pp2-dp2 are reported as skipped); 2 GPUs add pp 2; 4 GPUs add
# pp 2 x dp 2. On a 2- or 4-GPU machine just run `bench/gpu.sh` (add --quick to stay near 8 minutes with
# 4 GPUs). Pick GPUs with --gpus, not CUDA_VISIBLE_DEVICES: DeepSpeed's launcher, given --num_gpus,
# ignores it and renumbers from GPU 0. A failed case is reported (gpu.json: its log's tail), report.py
# still runs, and the script exits 1.
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
'deepspeed', deepspeed.__version__, 'transformers', t.__version__, 'GPUs', torch.cuda.device_count())"

start=$SECONDS
echo "== plan_gpu.py"
"$PY" bench/plan_gpu.py
echo "== gpu_finetune.py $*"
status=0
"$PY" bench/gpu_finetune.py "$@" || status=$?
"$PY" bench/report.py
echo "gpu.sh: done in $((SECONDS - start)) s"
exit "$status"
