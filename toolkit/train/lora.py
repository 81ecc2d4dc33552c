"""LoRA adapters through the `peft` library (no hand-written LoRA layers).

    dstk train ... --lora [--lora-r 16] [--lora-alpha 32] [--lora-dropout 0.05] [--lora-targets q_proj,v_proj]

The base model is frozen; only the adapters train (gradients and optimizer states exist for them
alone). Targets default to every linear layer inside the decoder blocks (attention and MLP), found by
module names per architecture; a target that matches nothing is refused with the linear modules that
exist. The export writes OUT/adapter (PEFT's format, for PeftModel.from_pretrained) and OUT/hf with the
adapters merged into full weights. Pipelines (pp > 1) with LoRA are not wired yet: refused clearly.
"""

from dataclasses import asdict, dataclass

from toolkit.errors import ConfigError

HEADS = ("lm_head", "score", "classifier", "cls", "embed_out")  # never adapted by default: outputs, not blocks


@dataclass(frozen=True)
class LoraSettings:
    r: int = 16
    alpha: int | None = None  # None: 2 r
    dropout: float = 0.0
    targets: tuple = ()  # module name suffixes; (): every linear layer in the blocks

    def to_dict(self) -> dict:
        return {**asdict(self), "alpha": self.alpha or 2 * self.r, "targets": list(self.targets)}


def settings_of(args) -> LoraSettings | None:
    """The run's LoRA settings (TrainArgs), or None without --lora."""
    if not args.lora:
        return None
    targets = tuple(t.strip() for t in (args.lora_targets or "").split(",") if t.strip())
    return LoraSettings(args.lora_r, args.lora_alpha, args.lora_dropout, targets)


def linear_names(model) -> list:
    """Short names (the last name part) of the nn.Linear / Conv1D modules inside the decoder blocks."""
    from torch import nn

    found = []
    for name, module in model.named_modules():
        is_linear = isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # GPT-2's Conv1D
        in_block = any(part.isdigit() for part in name.split("."))  # layers.3.mlp.up_proj, h.3.attn.c_attn
        short = name.rsplit(".", 1)[-1]
        if is_linear and in_block and short not in found and short not in HEADS:
            found.append(short)
    return found


def resolve_targets(model, settings: LoraSettings) -> list:
    """The module names peft adapts: the asked-for ones (each must match), else every block linear."""
    available = linear_names(model)
    if not available:
        raise ConfigError(f"--lora: {type(model).__name__} has no linear layers inside its blocks to adapt")
    if not settings.targets:
        return available
    missing = [t for t in settings.targets if t not in available]
    if missing:
        raise ConfigError(f"--lora-targets {','.join(missing)} match no linear layer of {type(model).__name__}; "
                          f"its block linears are: {', '.join(available)}")
    return list(settings.targets)


def apply(model, settings: LoraSettings, task: str):
    """`model` wrapped by peft with LoRA adapters; the base frozen."""
    from peft import LoraConfig, TaskType, get_peft_model

    kind = TaskType.SEQ_CLS if task == "classification" else TaskType.CAUSAL_LM
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha or 2 * settings.r, lora_dropout=settings.dropout,
                        target_modules=resolve_targets(model, settings), task_type=kind,
                        fan_in_fan_out=type(model).__name__.startswith("GPT2"))  # Conv1D stores W transposed
    return get_peft_model(model, config)


def check(settings: LoraSettings | None, pp: int | None) -> None:
    if settings is None:
        return
    if settings.r < 1:
        raise ConfigError(f"--lora-r must be a positive integer, got {settings.r}")
    if pp and pp > 1:
        raise ConfigError(f"--lora with pp {pp}: LoRA through pipeline stages is not wired yet in dstk; train with "
                          "pp = 1 (ZeRO 0-3 shard the rest), or without --lora")
