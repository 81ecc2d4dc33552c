"""`python stage_moves.py OUT CASE MODEL [CASE MODEL ...]`, on every rank, for each CASE in turn: build the
pipeline stage `dstk train` builds (toolkit.distributed.pipeline.pipeline_module, bf16), hand it to deepspeed.initialize,
and write OUT/CASE-<i>-rank<R>.json (i: the pair's index):
the parameter bytes the stage held at each move to a device (every `nn.Module.to(device)` on the
PipelineModule, DeepSpeed's own included; on a CPU that move changes nothing, so the bytes it would carry are
counted instead), the bytes the engine trains in the end, and the stage's parameter count as built (before
any tp sharding).

CASE: "tp2" (2 ranks: one stage, the whole model, sharded over a tp group of 2: pipeline_module's code path,
though dstk train gives pp 1 to DeepSpeed's own AutoTP), "lora-pp2" (2 ranks: LoRA adapters on a frozen base),
"pp2tp2" (4 ranks: 2 stages, each sharded over a tp group of 2). MODEL: a built-in name (a live fp32 model, as
dstk train builds it) or a saved directory.
"""

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

CASES = {"tp2": (1, 2, False), "lora-pp2": (2, 1, True), "pp2tp2": (2, 2, False)}  # pp, tp, LoRA
moves = []


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())


def _watch_moves():
    from deepspeed.pipe import PipelineModule

    real = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if isinstance(self, PipelineModule) and device is not None and dtype is None:
            moves.append({"bytes": _param_bytes(self), "device": str(device)})
        return real(self, *args, **kwargs)

    torch.nn.Module.to = to


def main(out: str, *pairs: str):
    from toolkit.distributed import process_group

    process_group.init(cpu=True)
    _watch_moves()
    for i, (case, model) in enumerate(zip(pairs[::2], pairs[1::2])):
        moves.clear()
        report = build(model, case)
        Path(out, f"{case}-{i}-rank{torch.distributed.get_rank()}.json").write_text(json.dumps(report))
    process_group.shutdown()


def build(model: str, case: str) -> dict:
    import deepspeed

    from toolkit.distributed.topology import Topology
    from models.lora.adapters import LoraSettings, apply
    from models.weights import loading
    from toolkit.train import hf
    from toolkit.distributed.pipeline import pipeline_module

    pp, tp, with_lora = CASES[case]
    world = torch.distributed.get_world_size()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 0}, "steps_per_print": 10**6, "pipeline": {"stages": pp},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    topo = Topology(world, pp=pp, tp=tp)
    tokenizer = hf.load_tokenizer(model)
    config = hf.load_config(model, tokenizer, "causal-lm")
    settings = LoraSettings(r=4) if with_lora else None
    source = model if Path(model).is_dir() else loading.build_model(model, config, "causal-lm", 1234)
    if settings is not None and not Path(model).is_dir():
        source = apply(source, settings, "causal-lm", 1234).base_model.model
    module, layout = pipeline_module(source, "causal-lm", topo, {**cfg, "tensor_parallel": {"autotp_size": tp}}
                                     if tp > 1 else cfg, seq_len=32, config=config, lora=settings)
    as_built = sum(_counts(config, layout["parts"], module.stage_id))
    trained = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, model_parameters=trained, config=cfg)
    report = {"moves": list(moves), "final_bytes": _param_bytes(engine.module),
              "final_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
              "stage_params_as_built": as_built}
    engine.destroy()
    return report


def _counts(config, parts: list, stage: int) -> list:
    """Parameters per layer of `stage` as its layers are built, before tp sharding and without adapters: the
    layer list's own counts (models' PipelineSpec.param_counts) over a meta-device copy of the model."""
    import models

    with torch.device("meta"):
        skeleton = models.auto_class("causal-lm", config)._from_config(config)
    counts = models.pipeline_layers(skeleton).param_counts
    return counts[parts[stage]:parts[stage + 1]]


if __name__ == "__main__":
    main(*sys.argv[1:])
