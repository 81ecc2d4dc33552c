"""`python -m toolkit.train ARGS` on every rank, where another run takes --out's lock after this run's checks passed
and before its rank 0 takes it: what two runs started into one folder at once meet. The lock is written as process
HOLDER_PID of this host holds it.

    python out_taken_meanwhile.py HOLDER_PID --config ds.json --out OUT ...
"""

import json
import os
import runpy
import sys
from pathlib import Path

from toolkit.checkpoint import lock
from toolkit.distributed import process_group

holder, args = int(sys.argv[1]), sys.argv[2:]
start_group = process_group.init


def then_taken(*a, **kw):
    group = start_group(*a, **kw)  # every rank passed its checks
    if os.environ["RANK"] == "0":
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        held = {**lock.me("dstk train"), "pid": holder, "process_start": lock.process_started(holder)[0]}
        (out / lock.LOCK).write_text(json.dumps(held))
    return group


process_group.init = then_taken
sys.argv = ["toolkit.train", *args]
runpy.run_module("toolkit.train", run_name="__main__", alter_sys=True)
