"""Training: the program every rank runs, and what it needs. Imports nothing heavy by itself.

    runner.py      TrainArgs, run(): process group, config check, data, engine, loop, export
    loop.py        the Job (engine + this rank's data) and the step / eval / checkpoint loop
    report.py      rank 0's progress and metrics.jsonl, per-rank memory, the loss table and loss.png
    data.py        --data -> tokenized, split, packed rows (HF datasets, cached once per node); DataOptions
    data_source.py local files / save_to_disk folders -> a datasets.Dataset; hub names refused
    data_formats.py text, prompt-completion, chat (template, assistant-only loss), alpaca, sharegpt
    data_pack.py   documents -> fixed-length rows (packed with document ids, or padded)
    data_batches.py  this rank's micro-batches: order, resume, whole-split eval
    hf.py          HF models, configs and tokenizers: a local directory or a built-in tiny one
    pipe.py        pp > 1: the model as a PipelineModule on dstk's partition; layer -> HF names
    lora.py        LoRA / QLoRA through peft, at pp = 1 and per pipeline stage
    checkpoint.py  DeepSpeed checkpoints: save, the atomic `latest`, the metadata export needs
    checkpoint_state.py  a checkpoint's tensors by HF name (pipeline layers, ZeRO shards, fp32 masters, tp shards)
    checkpoint_stream.py the same, about one layer at a time (for the streaming export)
    portable.py    a checkpoint's training state by HF name; resuming on another layout (pp, dp, ZeRO 0-3, LoRA)
    reshard.py     `dstk reshard`: a checkpoint made ready for another layout, offline
    export.py      a checkpoint -> a HF directory (export_stream.py: sharded safetensors, streamed)
    held.py        model-state bytes an engine holds (the run summary)
    parity.py      a wrapped model against its HF model (`dstk parity`)
    demo.py        the embedded default run (`make demo`)
    __main__.py    `python -m toolkit.train` = `dstk train`
"""
