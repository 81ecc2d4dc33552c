"""Run by tests/distributed/test_train.py under the deepspeed launcher: each rank builds its job the
way `dstk train` does (toolkit.train.job.prepare), then draws from torch's default generator, which
dropout uses; rank 0 writes every rank's (stage, dp rank, draw) to OUT.json.

    deepspeed --num_gpus N tests/distributed/scripts/dropout_streams.py CONFIG OUT.json
"""

import json
import sys

import torch

from toolkit.distributed import process_group
from toolkit.distributed.topology import Topology
from toolkit.train.job import prepare
from toolkit.train.runner import TrainArgs, read_checked_config

config_path, out_path = sys.argv[-2], sys.argv[-1]
group = process_group.init()
cfg, pp = read_checked_config(config_path, group.get_world_size(), None)
topo = Topology(group.get_world_size(), pp)
stage, dp_rank = topo.coords(group.get_rank())
args = TrainArgs(model="tiny-gpt2", data="toolkit/corpus/corpus.txt", config=config_path, out=out_path + ".run",
                 seq_len=32, progress=False)
job = prepare(args, cfg, topo, dp_rank)
draws = [None] * group.get_world_size()
dist_draw = (stage, dp_rank, torch.rand(4).tolist())
torch.distributed.all_gather_object(draws, dist_draw)
if group.get_rank() == 0:
    with open(out_path, "w") as f:
        json.dump(draws, f)
job.engine.destroy()
process_group.shutdown()
