"""Run by the deepspeed launcher on every rank: several engine-level scripts in one launch, so their
tests pay for one start-up of the launcher and its processes (~20 s on 2 cores) instead of one each.

    deepspeed --num_gpus 2 tests/distributed/scripts/engines.py preset CONFIG OUT_JSON + \
        memory-accuracy OUT_DIR + parity OUT_DIR [HF_DIR] + pipeline-training OUT_DIR

Each job is the `main` of its script, run in the order given. Put pp 1 jobs first: a pipeline engine
leaves DeepSpeed's global groups (deepspeed.utils.groups) on its grid, and a later pp 1 engine then
asks for an mpu it was not given (see tests/distributed/test_memory_accuracy.py's main).
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def jobs() -> dict:
    """name -> the function that runs it on this rank, given the job's arguments."""
    sys.path.insert(0, str(REPO))
    import pipeline_models_parity
    import preset_engine

    from tests.distributed import test_memory_accuracy, test_pipeline_training

    return {"preset": preset_engine.main, "memory-accuracy": test_memory_accuracy.main,
            "parity": pipeline_models_parity.main,
            "pipeline-training": lambda out: test_pipeline_training.worker(Path(out))}


def split(argv: list) -> list:
    """`a x + b y z` -> [["a", "x"], ["b", "y", "z"]]; the launcher's --local_rank dropped."""
    groups = [[]]
    for arg in (a for a in argv if not a.startswith("--local_rank")):
        if arg == "+":
            groups.append([])
        else:
            groups[-1].append(arg)
    return [g for g in groups if g]


if __name__ == "__main__":
    known = jobs()
    for name, *args in split(sys.argv[1:]):
        known[name](*args)
