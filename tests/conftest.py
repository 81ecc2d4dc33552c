"""Shared fixtures. CPU-only: DeepSpeed's CPU accelerator, gloo, no JIT-built ops."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
