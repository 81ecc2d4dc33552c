"""Training: the program every rank runs. Imports nothing heavy by itself.

    runner.py     TrainArgs, run(): process group, config check, data, engine, step loop, export
    job.py        the Job (engine + this rank's data), built by prepare: inputs, data, resume, the run's identity
    engine.py     the model built, its parameter groups and DeepSpeed config, deepspeed.initialize and
                  DeepSpeed's own checkpoint load, around its optimizer wrappers
    loop.py       the step / eval / checkpoint loop
    hf.py         the run's HF config and tokenizer, the model's refusals, built-in models (weights: models.weights)
    lora.py       the --lora / --qlora flags, QLoRA's 4-bit base (the adapters: models.lora)
    parity.py     a wrapped model against its HF model (`dstk parity`)
    report/       rank 0's opening block, progress, metrics.jsonl and --report-to trackers; each step's gathered
                  measures (grad norm, peak memory, stage times); model-state bytes an engine holds; the
                  summary, the loss table and loss.png
    demo.py       the embedded default run (`make demo`)
    __main__.py   `python -m toolkit.train` = `dstk train`

The other rooms it uses: toolkit.distributed (process group, topology, pipeline and tp stages),
toolkit.data (rows and batches), toolkit.checkpoint (saving, reading, moving), toolkit.export.
"""
