"""Adam's state restored by HF name (toolkit.checkpoint.portable.restore, a move to another layout or `dstk reshard`)
lies where torch's own Optimizer.load_state_dict puts it: moments in the parameter's dtype on its device, the step a
host tensor, or float32 on the parameter's device where the group is fused or capturable (the fused CUDA AdamW of
the generated GPU configs reads its state_steps there: a host step is an illegal memory access at the first step).

No GPU here: parameters on the meta device stand in for a device that is not the host (meta tensors hold no
values, so only devices and dtypes are compared there); on the host, the real fused CPU AdamW then steps from the
restored state as from the loaded one. The engine is a plain namespace around a torch optimizer: what
DeepSpeed's engine is at ZeRO-0 fp32 (Keeper.TORCH); the other keepers call the same placed_as_loaded on their base
optimizer, and their moves run on real engines in tests/distributed/test_resume_layouts.py."""

from types import SimpleNamespace

import pytest
import torch

from toolkit.checkpoint import portable

STEP = 5


def model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(device)


def saved_state(module) -> portable.PortableState:
    """A checkpoint's state by name (flat fp32 tensors, as portable.read gives them) for `module`'s parameters."""
    g = torch.Generator().manual_seed(1)
    shapes = {n: p.shape for n, p in module.named_parameters()}
    weights = {n: torch.randn(s, generator=g).flatten() for n, s in shapes.items()}
    moments = {k: {n: torch.rand(s, generator=g).flatten() * 1e-2 for n, s in shapes.items()} for k in portable.MOMENTS}
    return portable.PortableState(weights, moments, STEP)


def restored(device: str, flags: dict):
    """(module, its optimizer) after portable.restore of saved_state into an engine of one torch AdamW."""
    module = model(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, **flags)
    engine = SimpleNamespace(zero_optimization_stage=lambda: 0, optimizer=optimizer, lr_scheduler=None)
    state = saved_state(model("cpu"))
    portable.restore(engine, state, {p: n for n, p in module.named_parameters()})
    return module, optimizer


def loaded(device: str, flags: dict):
    """(module, its optimizer) given the same state through torch's own load_state_dict: the reference."""
    module = model(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, **flags)
    state = saved_state(model("cpu"))
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(state.weights[n].reshape(p.shape))
    saved = optimizer.state_dict()
    order = [n for n, _ in module.named_parameters()]  # one group: state i is the i-th parameter
    saved["state"] = {i: {"step": torch.tensor(float(STEP)),
                          **{k: state.moments[k][n].reshape(dict(module.named_parameters())[n].shape)
                             for k in portable.MOMENTS}} for i, n in enumerate(order)}
    optimizer.load_state_dict(saved)
    return module, optimizer


def placement(module, optimizer) -> dict:
    """{(parameter name, state key): (device, dtype)} of every state tensor."""
    names = {p: n for n, p in module.named_parameters()}
    return {(names[p], k): (v.device, v.dtype) for p, s in optimizer.state.items() for k, v in s.items()}


@pytest.mark.parametrize("flags", [{"fused": True}, {"capturable": True}, {}], ids=["fused", "capturable", "plain"])
def test_restored_state_lies_where_torchs_own_load_puts_it_on_a_device(flags):
    """Parameters on a device (meta, for a GPU): a fused or capturable group's step goes there, a plain one's stays
    on the host, every moment is on the parameter's device; the same as load_state_dict, key for key."""
    want = placement(*loaded("meta", flags))
    got = placement(*restored("meta", flags))
    assert got == want
    steps = {where for (_, key), where in got.items() if key == "step"}
    assert steps == {(torch.device("meta" if flags else "cpu"), torch.float32)}


def test_the_fused_cpu_adamw_steps_from_the_restored_state_as_from_the_loaded_one():
    """On the host, the real fused kernel: the same state tensors (values, devices, dtypes), and one more step gives
    the same weights."""
    (a, opt_a), (b, opt_b) = restored("cpu", {"fused": True}), loaded("cpu", {"fused": True})
    assert placement(a, opt_a) == placement(b, opt_b)
    for p, q in zip(a.parameters(), b.parameters()):
        assert all(torch.equal(opt_a.state[p][k], opt_b.state[q][k]) for k in ("step", *portable.MOMENTS))
        p.grad = q.grad = torch.ones_like(p)
    opt_a.step()
    opt_b.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert {float(s["step"]) for s in opt_a.state.values()} == {STEP + 1}
