"""Training: the program every rank runs, and what it needs. Imports nothing heavy by itself.

    runner.py      TrainArgs, run(): process group, config check, data, engine, loop, export
    loop.py        the Job (engine + this rank's data) and the step / eval / checkpoint loop
    data.py        local text / JSONL -> fixed-length token rows, sharded per data-parallel rank
    hf.py          HF models, configs and tokenizers: a local directory or a built-in tiny one
    pipe.py        pp > 1: the model as a PipelineModule on dstk's partition; layer -> HF names
    checkpoint.py  DeepSpeed checkpoints: save, the atomic `latest`, the metadata export needs
    export.py      a checkpoint -> a HF directory
    parity.py      a wrapped model against its HF model (`dstk parity`)
    demo.py        the embedded default run (`make demo`)
    __main__.py    `python -m toolkit.train` = `dstk train`
"""
