"""A checkpoint's .pt files load as data (toolkit.checkpoint.safe_load): a pickle naming a class outside
DeepSpeed's is refused without running it; dstk's RNG files hold plain data, and an older dstk's still load."""

import os
import random

import numpy as np
import pytest
import torch

from toolkit.checkpoint import manifest, safe_load
from toolkit.errors import UnusableInput


class Planted:
    """What a tampered checkpoint holds: unpickling it runs `touch MARKER`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(autouse=True)
def untrusted():
    safe_load.trust(False)
    yield
    safe_load.trust(False)


def test_a_planted_reduce_is_refused_by_file_and_class_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"module": {"w": torch.ones(2)}, "x": Planted(marker)}, tmp_path / "mp_rank_00_model_states.pt")
    before = set(map(str, torch.serialization.get_safe_globals()))
    for call in (lambda: safe_load.check_tag(tmp_path), lambda: safe_load.load(tmp_path / "mp_rank_00_model_states.pt")):
        with pytest.raises(UnusableInput, match=r"mp_rank_00_model_states\.pt holds posix\.system.*--trust-checkpoint"):
            call()
    assert not marker.exists()
    assert set(map(str, torch.serialization.get_safe_globals())) == before  # allowed for the load only


def test_trusted_loads_as_a_pickle_and_runs_it(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"x": Planted(marker)}, tmp_path / "layer_01-model_states.pt")
    safe_load.trust(True)
    safe_load.check_tag(tmp_path)
    assert safe_load.load(tmp_path / "layer_01-model_states.pt") == {"x": 0} and marker.exists()


def test_rng_files_hold_plain_data_and_restore_every_generator(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    manifest.save_rng(tmp_path, 0)
    drawn = random.random(), np.random.rand(), torch.rand(1).item()
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(tmp_path / "rng_state_0.pt")) == []
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert manifest.load_rng(tmp_path, 0)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == drawn


def test_an_older_rng_file_with_numpys_pickled_array_still_loads(tmp_path):
    np.random.seed(5)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state(),
                "cuda": None}, tmp_path / "rng_state_0.pt")  # as dstk wrote it before
    drawn = np.random.rand()
    np.random.seed(9)
    safe_load.check_tag(tmp_path)
    assert manifest.load_rng(tmp_path, 0) and np.random.rand() == drawn


def test_numpys_array_is_allowed_in_rng_files_only(tmp_path):
    torch.save({"numpy": np.random.get_state()}, tmp_path / "mp_rank_00_model_states.pt")
    with pytest.raises(UnusableInput, match=r"holds numpy\._core\.multiarray\._reconstruct"):
        safe_load.check_tag(tmp_path)
