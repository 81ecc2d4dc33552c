"""`python ep_losses.py MODEL_TYPE EP ZERO OUT.json`: a tiny fp32 HF MoE model (tests/moe_models.tiny_moe) trained
3 steps by a plain DeepSpeed engine with DeepSpeed's AutoEP at autoep_size EP (0: no expert_parallel section),
ZeRO stage ZERO, on every rank of the world; the global batch (4 rows of 16 tokens, the same every run) is split
across the ranks. Rank 0 writes {"losses": [...], "replaced": [module names], "experts": {name: shape}}: the
mean loss over the world per step, the modules AutoEP put in place and the local expert weights' shapes."""

import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.moe_models import VOCAB, tiny_moe  # noqa: E402
from models import autoep  # noqa: E402
from toolkit.distributed import process_group  # noqa: E402

ROWS, SEQ, STEPS = 4, 16, 3


def config(world: int, ep: int, zero: int, preset: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": ROWS // world, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": zero}, "steps_per_print": 1000}
    if ep:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": preset}
    return cfg


def main(model_type: str, ep: int, zero: int, out: Path):
    autoep.allow_string_keys()
    process_group.init(cpu=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_moe(model_type, seed=0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(world, ep, zero, model_type))
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    mine = ids.chunk(world)[rank].to(engine.device)
    losses = []
    for _ in range(STEPS):
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    replaced = [n for n, m in engine.module.named_modules() if type(m).__name__ == "AutoEPMoELayer"]
    experts = {n: list(p.shape) for n, p in engine.module.named_parameters() if "experts" in n}
    engine.save_checkpoint(str(out.with_suffix("")), tag="global_step3", client_state={"step": STEPS})
    if rank == 0:
        out.write_text(json.dumps({"losses": losses, "replaced": replaced, "experts": experts}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
