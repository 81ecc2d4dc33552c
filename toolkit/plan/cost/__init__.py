"""What each pipeline layer costs, and how the layers are split into stages.

    layers.py            per-layer FLOPs, model-state and activation bytes (from dimensions alone)
    partition.py         contiguous splits of layers into stages (exact), and DeepSpeed's own methods
    partition_report.py  `dstk partition`: a split and what each stage costs
    profile.py           measured per-layer times (`--method profile`; imports torch)
    mfu.py               model FLOPs utilisation: FLOPs per token over a preset's peak
"""
