"""Run by the deepspeed launcher on every rank: train a tiny model under a dstk config for a few steps.

    deepspeed --num_gpus 2 tests/distributed/scripts/preset_engine.py CONFIG OUT_JSON

pp > 1 in the config's pipeline section: a PipelineModule of Linear layers and train_batch();
otherwise a plain module under deepspeed.initialize. Rank 0 (or the last stage) writes the losses.
"""

import json
import sys

import deepspeed
import torch

from toolkit.distributed import process_group


def layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)]


def batches(mbs):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(mbs, 8, generator=g)
    while True:
        yield x, x.sum(dim=1, keepdim=True).tanh()


def main(config_path, out_path):
    process_group.init()
    cfg = json.load(open(config_path))
    pp = cfg.get("pipeline", {}).get("stages", 1)
    if pp > 1:
        model = deepspeed.pipe.PipelineModule(layers(), num_stages=pp, loss_fn=torch.nn.functional.mse_loss,
                                              partition_method="uniform")
    else:
        model = torch.nn.Sequential(*layers())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    data = batches(engine.train_micro_batch_size_per_gpu())
    losses = []
    for _ in range(5):
        if pp > 1:
            losses.append(engine.train_batch(data).item())
        else:
            x, y = next(data)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    is_reporter = engine.is_last_stage() if pp > 1 else torch.distributed.get_rank() == 0
    if is_reporter:
        info = {"losses": losses, "world": torch.distributed.get_world_size(), "pp": pp,
                "dp": engine.dp_world_size if hasattr(engine, "dp_world_size") else None}
        with open(out_path, "w") as f:
            json.dump(info, f)


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])  # the launcher adds --local_rank
