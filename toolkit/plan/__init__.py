"""Planning before any GPU is allocated: model shapes -> costs -> partitions, memory, layouts.

    arch.py       architectures as plain numbers (built-ins, or a HF config.json) and their
                  per-layer parameter counts
    moe.py        mixture-of-experts configs: experts, top-k routing, shared experts, refusals
    mla.py        multi-head latent attention (DeepSeek-V2/V3): its low-rank projections as numbers
    lora.py       LoRA adapter counts per layer: which linears `--lora` adapts, what trains
    tp.py         AutoTP: which architectures it shards, what one rank of a tp group holds
    gpus.py       GPU presets (datasheet peaks, memory, links), CUDA device names, sizes
    schedule.py   DeepSpeed's 1F1B timeline (`dstk schedule`)
    cost/         per-layer costs, partitions into stages, measured profiles, MFU
    memory/       bytes per rank: precision table, ZeRO model states, activations, fixed overhead
    layouts/      one layout's memory and step time; every layout ranked
Nothing here imports torch, deepspeed or transformers at import time.
"""
