"""How ranks work together: the process group, the topology and the modules each rank builds.

    process_group.py    the one place a process group starts (launcher environment, device, backend,
                        ports), and the few collectives dstk runs itself
    topology.py         world = pp x dp x tp, rank <-> coordinates, the one batch arithmetic
    pipeline.py         pp > 1: the HF model as a PipelineModule on dstk's partition; layer -> HF names
    tensor_parallel.py  tp inside pipeline stages (3D), which DeepSpeed 0.19 does not offer
    dualpipev.py        --schedule dualpipev: what DeepSpeed's DualPipeV needs, refused before launch
    sequence_parallel.py  sp > 1: Ulysses at pp = 1 and inside pipeline stages, its core attention
    document_flex.py    that core on CUDA: flex_attention with one document BlockMask per micro-batch
    optimizers.py       DeepSpeed's bf16/fp16 optimizer wrappers: which one an engine holds, the state dstk gives it
    agreement.py        where ranks may part ways: an error only some ranks reach becomes every rank's, one line
Nothing here imports torch at import time, except document_flex (imported where attention runs).
"""
