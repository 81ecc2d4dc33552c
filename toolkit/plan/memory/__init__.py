"""What a training rank holds in memory.

    precision.py  bytes per element by precision and optimizer (the one table)
    rank.py       bytes per rank under ZeRO 0-3 (a frozen base too: LoRA) and 1F1B activations
    overhead.py   what lives outside torch's allocator: the CUDA context and NCCL's buffers
"""
