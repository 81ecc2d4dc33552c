"""`python -m toolkit.train ...`, what launch.sh, `deepspeed --module` and torchrun start on every
rank: the same options as `dstk train`."""

import sys

from toolkit.cli import main

main(["train", *sys.argv[1:]])
