"""Checkpoints: the run folder, saving, reading state by HF name, and moving a run to another layout.

    run_folder.py   --out: one run per folder, never mixed, never silently lost
    manifest.py     DeepSpeed's tags, the atomic `latest`, and the run's manifest beside them (dstk/manifest.json:
                    task, model, layout, HF names per pipeline layer, LoRA); stage-layer name -> HF name
    deepspeed_files.py  DeepSpeed's file names, the checkpoint kinds (checkpoint_kind), where a parameter's
                    fp32 state lies in ZeRO-1/2 fragments and ZeRO-3 shares
    state.py        a checkpoint's tensors by HF name (pipeline layers, ZeRO shards, fp32 masters, tp shards)
    stream.py       the same, about one layer at a time (for the streaming export)
    portable.py     the training state by HF name; resuming on another layout (pp, dp, ZeRO 0-3, LoRA)
    reshard.py      `dstk reshard`: a checkpoint made ready for another layout, offline
"""
