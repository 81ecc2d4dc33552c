"""`python fp16_stand_in.py ARGS`: `python -m toolkit.train ARGS` where DeepSpeed's CPU accelerator says it
supports fp16. A stand-in for a GPU's fp16 kernels, which do not exist here (DeepSpeed refuses fp16 on this
CPU); torch computes fp16 on the CPU itself, so the training, the loss scaler and the checkpoints are real."""

import runpy
import sys

from deepspeed.accelerator import get_accelerator

type(get_accelerator()).is_fp16_supported = lambda self: True
sys.argv = ["toolkit.train", *sys.argv[1:]]
runpy.run_module("toolkit.train", run_name="__main__", alter_sys=True)
