"""Shared fixtures. CPU-only: DeepSpeed's CPU accelerator, gloo, no JIT-built ops."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gc
import sys
import warnings

import pytest

from toolkit.distributed.process_group import free_port  # noqa: F401  (the tests' children get ports the same way)


def _freeze_what_lives_on():
    """Move every object alive now (imported modules, collected tests) out of the cyclic collector's sight:
    a full collection then walks only what the tests make afterwards. A run in this process (toolkit.train's
    runner at its end, DeepSpeed's BF16_Optimizer six times as it starts) walked ~500K objects, 0.3-0.4 s each."""
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    _freeze_what_lives_on()


def pytest_runtest_setup(item):
    """One intra-op thread for torch in this process, as every rank has (tests/ranks.py): the in-process runs
    are tiny models, and with two OpenMP threads on two cores any other process running meanwhile (another
    test's child, another job on the machine) leaves the threads spinning at every op's barrier. Measured:
    test_lora's resume test 9 s with one thread, 143-178 s with two beside a load of ~2.5."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ds_world1():
    """A real gloo process group of one rank in this process, started by toolkit.distributed.process_group like every
    dstk process group (idempotent: a group some other test started is reused)."""
    from toolkit.distributed import process_group

    group = process_group.init(cpu=True, alone=True)
    # what a run imports on first use, for good (deepspeed.initialize: ZeRO's optimizer list imports Muon,
    # torch._dynamo and torch._inductor; their import-time deprecation notes are no test's), before the
    # session's objects are frozen again
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
        import toolkit.train.runner  # noqa: F401

    _freeze_what_lives_on()
    return group


@pytest.fixture(autouse=True)
def _transformers_interfaces_as_shipped():
    """Every test starts and ends with transformers' attention and mask interfaces as transformers ships them: dstk
    installs attention and mask functions process-wide in a rank (Ulysses' core, no mask under sp, additive sdpa
    masks at pp 1: toolkit.train.engine.start_engine), so an in-process engine built by one test would otherwise
    change the masks every later test of this process sees. Nothing to do before transformers is imported."""
    import sys

    def reset():
        for name, attr in (("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS"),
                           ("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS")):
            module = sys.modules.get(name)
            if module is not None:
                getattr(module, attr)._local_mapping = {}  # the registered overrides; the shipped ones are global
    reset()
    yield
    reset()


@pytest.fixture
def interfaces():
    """transformers' attention interface (ALL_ATTENTION_FUNCTIONS), for a test to install its own functions in; it and
    the mask interface are as shipped again after the test (the autouse fixture above)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


HEAVY = ("torch", "deepspeed", "transformers")


def run_cli_fresh(argv: list, env: dict | None = None) -> tuple:
    """Run `dstk ARGV` in a fresh interpreter (`env` over this process's environment); (completed process,
    heavy packages it imported)."""
    import subprocess
    import sys

    code = ("import sys; from toolkit.cli import main\ncode = 0\n"
            f"try: main({list(argv)!r})\nexcept SystemExit as e: code = e.code\n"
            f"print('HEAVY', *sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
            "sys.exit(code)")  # the command's exit status
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **(env or {})})
    heavy_line = [line for line in result.stderr.splitlines() if line.startswith("HEAVY")]
    if not heavy_line:
        raise AssertionError(f"dstk {argv} did not finish:\n{result.stderr[-2000:]}")
    return result, heavy_line[-1].split()[1:]


DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra) -> dict:
    """os.environ for a child process that starts its own process group: without the variables this
    process's world of one (ds_world1, or toolkit.train run in-process) set, whose port it still holds."""
    return {**{k: v for k, v in os.environ.items() if k not in DIST_ENV}, **extra}


# Runs several test folders read (tests/distributed, tests/launchers), each made once per session.
from tests.runs import bf16_runs, engine_runs, moe_dirs, saved_models, train_runs  # noqa: E402, F401


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a fresh tmpfs of `size` bytes under tmp_path, unmounted after the test: a disk that really
    fills (tests of a full disk). Skipped where mounting is not allowed (not root, a container without the right)."""
    import subprocess

    mounted = []

    def mount(size: int):
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or 'mount failed'})")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)
