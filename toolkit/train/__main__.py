"""`python -m toolkit.train ...`, what launch.sh, `deepspeed --module` and torchrun start on every
rank: the same options as `dstk train`."""

import sys

from toolkit.cli import main

# A rank's stdout is a pipe under some launchers (mpirun without a pty, srun): line-buffer it so
# progress arrives as it happens and nothing is left in a buffer when MPI finalizes at exit.
sys.stdout.reconfigure(line_buffering=True)
main(["train", *sys.argv[1:]])
