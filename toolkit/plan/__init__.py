"""Planning before any GPU is allocated: model shapes -> costs -> partitions, memory, layouts.

    arch.py              architectures as plain numbers (built-ins, or a HF config.json) and their
                         per-layer parameter counts
    moe.py               mixture-of-experts configs: experts, top-k routing, shared experts, refusals
    lora.py              LoRA adapter counts per layer: which linears `--lora` adapts, what trains
    precision.py         bytes per element by precision and optimizer (the one table)
    costs.py             per-layer FLOPs, model-state and activation bytes
    partition.py         contiguous splits of layers into stages (exact), and DeepSpeed's own methods
    partition_report.py  `dstk partition`: a split and what each stage costs
    profile.py           measured per-layer times (`--method profile`; imports torch)
    memory.py            bytes per rank under ZeRO 0-3 (a frozen base too: LoRA) and 1F1B activations
    gpus.py              GPU presets (datasheet peaks, memory, links), CUDA device names, sizes
    mfu.py               model FLOPs utilisation: FLOPs per token (costs.py) over a preset's peak
    estimate.py          memory and step time of one layout
    planner.py           every layout, ranked (`dstk plan`)
    report.py            the plan as text, JSON, or a DeepSpeed config
    schedule.py          DeepSpeed's 1F1B timeline (`dstk schedule`)
Nothing here imports torch, deepspeed or transformers at import time.
"""
