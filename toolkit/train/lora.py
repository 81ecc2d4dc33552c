"""The run's LoRA flags, and QLoRA's 4-bit base (the adapters themselves: models.lora.adapters).

    dstk train ... --lora [--lora-r 16] [--lora-alpha 32] [--lora-dropout 0.05] [--lora-targets q_proj,v_proj]
    dstk train ... --qlora ...   # the same adapters on a 4-bit NF4 base (bitsandbytes; CUDA, pp 1)

The flags become a LoraSettings (`settings_of`), checked against the layout (`check`) and, for --qlora, against
the machine the ranks run on (`check_qlora_here`). The export writes OUT/adapter (PEFT's format, for
PeftModel.from_pretrained) and OUT/hf with the adapters merged into full weights.
"""

from models.lora.adapters import LoraSettings
from toolkit.errors import ConfigError


def settings_of(args) -> LoraSettings | None:
    """The run's LoRA settings (TrainArgs), or None without --lora / --qlora."""
    if not (args.lora or args.qlora):
        return None
    targets = tuple(t.strip() for t in (args.lora_targets or "").split(",") if t.strip())
    return LoraSettings(args.lora_r, args.lora_alpha, args.lora_dropout, targets, args.qlora)


def check(settings: LoraSettings | None, pp: int = 1, zero: int = 0, tp: int = 1) -> None:
    """The flags against the layout (a pipeline's ZeRO stage is the config rules' to refuse)."""
    if settings is None:
        return
    if tp > 1:
        raise ConfigError(f"--lora with tensor_parallel.autotp_size {tp}: LoRA on AutoTP's sharded layers is not "
                          "supported by dstk yet; train LoRA with dp (and pp), or tp without --lora")
    if settings.r < 1:
        raise ConfigError(f"--lora-r must be a positive integer, got {settings.r}")
    if settings.qlora and pp > 1:
        raise ConfigError(f"--qlora with pp {pp}: a pipeline stage reads its tensors itself and does not quantize "
                          "them; train QLoRA with pp 1 (ZeRO 0-2 over the GPUs), or use --lora with pp > 1")
    if settings.qlora and zero == 3:
        raise ConfigError("--qlora with zero_optimization.stage 3: ZeRO-3 cannot partition bitsandbytes' 4-bit "
                          "weights; use stage 0-2 (the 4-bit base is a quarter of the bf16 bytes already)")


def check_qlora_here(model: str) -> None:
    """--qlora where the ranks run: a CUDA GPU, bitsandbytes, and a local directory to quantize."""
    import importlib.util
    import os
    from pathlib import Path

    import torch

    if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
        raise ConfigError("--qlora: the 4-bit base needs a CUDA GPU (bitsandbytes' NF4 kernels) and this machine "
                          "has none; train with --lora here (the base in full precision), or run --qlora on GPUs")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("--qlora needs the bitsandbytes package: pip install bitsandbytes (or use --lora)")
    if not Path(model).is_dir():
        raise ConfigError(f"--qlora quantizes pretrained weights as they load: --model must be a local HF "
                          f"directory, not {model!r} (use --lora for a built-in model)")


def quantized_model(path: str, config, task: str, compute_dtype: str, checkpointing: bool):
    """The model at `path` with its linear weights in 4 bits (NF4, double quantization) on this rank's
    GPU, the rest in fp32, prepared by peft for k-bit training (inputs that need grad, checkpointing)."""
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    import models

    dtype = getattr(torch, compute_dtype)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype)
    model = models.auto_class(task).from_pretrained(
        path, config=config, quantization_config=quant, dtype=torch.float32, device_map={"": torch.cuda.current_device()},
        attn_implementation=config._attn_implementation)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing,
                                           gradient_checkpointing_kwargs={"use_reentrant": False})
