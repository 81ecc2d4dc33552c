"""`python fault_on_rank.py RANK ARGS`: `python -m toolkit.train ARGS` where rank RANK alone fails to read the
tokenizer with an OSError (a stand-in for a node whose disk fails: every rank here reads the same files)."""

import os
import runpy
import sys

from toolkit.train import hf

faulty, sys.argv = int(sys.argv[1]), ["toolkit.train", *sys.argv[2:]]
load_tokenizer = hf.load_tokenizer


def failing(*args, **kwargs):
    if int(os.environ["RANK"]) == faulty:
        raise OSError(5, "Input/output error", "tokenizer.json")
    return load_tokenizer(*args, **kwargs)


hf.load_tokenizer = failing
runpy.run_module("toolkit.train", run_name="__main__", alter_sys=True)
