"""`python no_prelaunch_rows_check.py ARGS`: `python -m toolkit.train ARGS` without the refusal that train --check
makes of a --streaming file with fewer documents than dp (as where no launcher announces the world size before
the process group starts): the ranks then meet it in their own data set-up, where only the ranks past the
file's documents have none to read."""

import runpy
import sys

from toolkit.data import stream

if hasattr(stream, "check_rows_for_dp"):  # dstk before it had the check: nothing to skip
    stream.check_rows_for_dp = lambda opts, dp: None
sys.argv = ["toolkit.train", *sys.argv[1:]]
runpy.run_module("toolkit.train", run_name="__main__", alter_sys=True)
