"""`python rank_grad_norms.py ARGS`: `python -m toolkit.train ARGS` where every rank also prints the grad norm its
own engine computed at each step ("rank R grad norm N"), not only the one rank 0 logs."""

import runpy
import sys

import torch.distributed as dist

from toolkit.train.report import step_stats

gather = step_stats.StepStats.gather


def gather_and_print(self):
    out = gather(self)
    print(f"rank {dist.get_rank()} grad norm {float(self.engine.get_global_grad_norm())!r}", flush=True)
    return out


step_stats.StepStats.gather = gather_and_print
sys.argv = ["toolkit.train", *sys.argv[1:]]
runpy.run_module("toolkit.train", run_name="__main__", alter_sys=True)
