"""LoRA adapters on HF models, through peft: a model concern that training, the pipeline stages and the export share.

    adapters.py   the settings, the targets they resolve to, peft's config, the adapters built on a whole model
                  (`apply`) or injected per HF module as a pipeline stage reads it (`StageAdapters`)
    experts.py    LoRA on an MoE model's fused experts (peft's target_parameters); PeftModel names <-> HF names
"""
