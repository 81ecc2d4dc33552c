"""GPU tier: `dstk partition --method profile` times the layers on the GPU in the run's precision."""

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_profile_times_layers_on_the_gpu_in_bf16(monkeypatch):
    from toolkit.plan.cost.profile import profile_model

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    times = profile_model("tiny-llama", 64, reps=1, precision="bf16")
    assert times.device.startswith(f"cuda:{torch.cuda.current_device()} (") and times.dtype == "bf16"
    assert all(t > 0 for t in times)
