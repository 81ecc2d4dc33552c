"""Layouts (pp x dp x tp x ZeRO x mbs/gas x offload x checkpointing) of one model on one cluster.

    estimate.py  memory and step time of one layout
    planner.py   every layout, ranked (`dstk plan`)
    report.py    the plan as text, JSON, or a DeepSpeed config
"""
