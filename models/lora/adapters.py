"""LoRA adapters through the `peft` library (no hand-written LoRA layers): a model concern, read by training,
the pipeline stages and the export alike.

The base model is frozen; only the adapters train (gradients and optimizer states exist for them
alone). Targets default to every linear layer inside the decoder blocks (attention and MLP), found by
module names per architecture, and the fused experts of an MoE model (transformers 5 holds them as 3-D
parameters, `mlp.experts.gate_up_proj` (E, 2I, H)): PEFT adapts those through `target_parameters` (its
lora.ParamWrapper: a rank-r pair per expert, which takes no dropout: with --lora-dropout > 0 the experts
stay frozen, and the opening block says so; models/lora/experts.py). --lora-targets names linears by their last
name part and expert parameters by a suffix (`gate_up_proj` or `mlp.experts.gate_up_proj`); a target that matches
nothing is refused with what exists.

Every layout builds the same adapters. pp = 1 and a pipeline of a model in memory wrap the model with
`get_peft_model` (`apply`); a pipeline stage reading its layers from a directory injects them per HF module
(`StageAdapters`, with peft's `inject_adapter_in_model`), and a classifier head is trained whole as
PEFT's sequence-classification task does (`modules_to_save`). lora_A is drawn from a generator seeded
by the run's seed and the module's HF name (`init_adapters`), lora_B is zero: an adapter starts the
same whichever stage or rank builds it, so layouts train alike. The run's flags become a LoraSettings in
toolkit.train.lora.
"""

import math
import zlib
from dataclasses import asdict, dataclass

from models import task_named
from models.lora.experts import as_peft_converts, expert_parameters, frozen_experts
from toolkit.errors import ConfigError

HEADS = ("lm_head", "score", "classifier", "cls", "embed_out")  # never adapted by default: outputs, not blocks


@dataclass(frozen=True)
class LoraSettings:
    r: int = 16
    alpha: int | None = None  # None: 2 r
    dropout: float = 0.0
    targets: tuple = ()  # module name suffixes; (): every linear layer in the blocks and the fused experts
    qlora: bool = False  # the base loaded in 4 bits (NF4, bitsandbytes): CUDA only
    parameters: tuple | None = None  # the expert parameters adapted, as a run recorded them; None: from targets

    def to_dict(self) -> dict:
        out = {**asdict(self), "alpha": self.alpha or 2 * self.r, "targets": list(self.targets)}
        if self.parameters is None:  # a run's flags (what a resume compares): as before experts were adapted
            del out["parameters"]
        else:
            out["parameters"] = list(self.parameters)
        return out


def recorded_settings(manifest: dict) -> LoraSettings:
    """The adapters a run's manifest says it trained: "lora_adapters" (manifest_entry: its targets and expert
    parameters as resolved), or in a run from before those were recorded its flags ("lora"), with no expert adapted."""
    entry = manifest.get("lora_adapters") or manifest["lora"]
    return LoraSettings(entry["r"], entry.get("alpha"), entry["dropout"], tuple(entry["targets"]),
                        bool(entry.get("qlora")), tuple(entry.get("parameters") or ()))


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


def resolve_targets(model, settings: LoraSettings) -> tuple[list, list]:
    """(module names, expert parameters) peft adapts: the asked-for ones (each must match), else every block
    linear and (without dropout, which PEFT's ParamWrapper refuses) every fused expert parameter."""
    available, experts = linear_names(model), expert_parameters(model)
    if settings.parameters is not None:  # a run's record (no targets, no parameters: a run's default linears)
        modules = list(settings.targets) if settings.targets or settings.parameters else available
        return modules, list(settings.parameters)
    if not available and not experts:
        raise ConfigError(f"--lora: {type(model).__name__} has no linear layers inside its blocks to adapt")
    if not settings.targets:
        return available, [] if settings.dropout else experts
    named = {t: [e for e in experts if e == t or e.endswith("." + t)] for t in settings.targets}
    missing = [t for t in settings.targets if t not in available and not named[t]]
    if missing:
        raise ConfigError(f"--lora-targets {','.join(missing)} match no linear layer "
                          + ("or fused expert parameter " if experts else "") + f"of {type(model).__name__}; its "
                          f"block linears are: {', '.join(available)}"
                          + (f"; its fused expert parameters: {', '.join(experts)}" if experts else ""))
    parameters = [e for e in experts if any(e in found for found in named.values())]
    if parameters and settings.dropout:
        raise ConfigError(f"--lora-dropout {settings.dropout} with --lora-targets naming fused expert parameters "
                          f"({', '.join(parameters)}): PEFT's LoRA on them (target_parameters) takes no dropout; use "
                          "--lora-dropout 0, or leave them out of --lora-targets")
    return [t for t in settings.targets if t in available], parameters


CLASSIFIER_HEADS = ("classifier", "score")  # trained whole under sequence classification, as PEFT does


def peft_config(model, settings: LoraSettings, task: str):
    """peft's LoraConfig for `model` (a HF model, or a meta-device skeleton of it)."""
    from peft import LoraConfig, TaskType

    kind = TaskType.SEQ_CLS if task_named(task) == "sequence-classification" else TaskType.CAUSAL_LM
    modules, parameters = resolve_targets(model, settings)
    # target_modules [] rather than None: None makes peft add its default modules for the model type
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha or 2 * settings.r, lora_dropout=settings.dropout,
                        target_modules=modules, target_parameters=parameters or None, task_type=kind,
                        fan_in_fan_out=type(model).__name__.startswith("GPT2"))  # Conv1D stores W transposed
    return as_peft_converts(config, model)


def manifest_entry(settings: LoraSettings, model, task: str) -> dict:
    """What the run's manifest records of a LoRA run on `model` (the HF model or its meta-device skeleton, before
    peft wraps it): the settings with the targets and expert parameters they resolve to (export rebuilds the same
    adapters from them, recorded_settings), what peft adapts after its conversion, and the opening block's
    sentence on what stays frozen."""
    modules, parameters = resolve_targets(model, settings)
    config = peft_config(model, settings, task)
    entry = {**settings.to_dict(), "targets": modules, "parameters": parameters,
             "adapted": sorted(config.target_modules or ()) + sorted(config.target_parameters or ())}
    note = frozen_experts(model, config, modules)
    if note:
        entry["experts_frozen"] = note
    return entry


def apply(model, settings: LoraSettings, task: str, seed: int = 0):
    """`model` wrapped by peft with LoRA adapters (a PeftModel); the base frozen; adapters from `seed`."""
    wrapped = wrap(model, peft_config(model, settings, task))
    init_adapters(wrapped.base_model.model, seed)
    return wrapped


# peft's warnings that say nothing about dstk's adapters: its rank/alpha patterns are checked against target modules
# only (the 2 r of gate_up_proj, a target parameter, does apply), and a dense block has no expert parameter
PEFT_NOISE = ".*(were set but no (module|parameter) was matched|keys did not match any targeted module)"


def wrap(model, config):
    """peft's get_peft_model, without the FutureWarning transformers 5 gives for the API peft calls."""
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        warnings.filterwarnings("ignore", message=PEFT_NOISE, category=RuntimeWarning)
        return get_peft_model(model, config)


def init_adapters(module, seed: int, prefix: str = "") -> None:
    """lora_A as peft draws it (kaiming-uniform, a = sqrt(5)) from a generator seeded by `seed` and the
    layer's HF name (`prefix` + its name in `module`); lora_B zero. Without parameters on the meta device."""
    import torch

    with torch.no_grad():
        for name, layer in module.named_modules():
            for adapter, down in getattr(layer, "lora_A", {}).items():
                if down.weight.is_meta:
                    continue
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{prefix}{name}".encode()))
                weight = torch.empty(down.weight.shape)
                torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
                down.weight.copy_(weight)
                layer.lora_B[adapter].weight.zero_()


def is_adapter(name: str) -> bool:
    """Whether a parameter's name is one peft trains: a LoRA matrix, or a modules_to_save copy."""
    return ".lora_" in name or ".modules_to_save." in name or name.startswith(("lora_", "modules_to_save."))


class StageAdapters:
    """What a pipeline stage does to each HF module it reads from a directory (models' DirSource
    `adapt` hook): freeze it, inject the run's LoRA layers where its targets are, and wrap a
    classifier head in PEFT's ModulesToSaveWrapper; the same modules and names as `apply` gives."""

    def __init__(self, config, task: str, seed: int):
        self.config, self.task, self.seed = config, task_named(task), seed

    def __call__(self, module, name: str):
        import warnings

        from peft import inject_adapter_in_model
        from peft.utils import ModulesToSaveWrapper

        module.requires_grad_(False)
        if self.task == "sequence-classification" and name.rsplit(".", 1)[-1] in CLASSIFIER_HEADS:
            return ModulesToSaveWrapper(module, "default")  # a trainable copy beside the frozen original
        targets, experts = set(self.config.target_modules or ()), set(self.config.target_parameters or ())
        if any(sub.rsplit(".", 1)[-1] in targets for sub, _ in module.named_modules() if sub) or any(
                leaf == t or leaf.endswith("." + t) for leaf, _ in module.named_parameters() for t in experts):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=PEFT_NOISE, category=RuntimeWarning)
                inject_adapter_in_model(self.config, module)
            init_adapters(module, self.seed, prefix=f"{name}.")
        return module
