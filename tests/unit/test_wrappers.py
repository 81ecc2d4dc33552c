"""DeepSpeed's FP16 wrappers (bf16/fp16 weights at ZeRO-0: FP16_UnfusedOptimizer over torch's AdamW, and
FP16_Optimizer, FusedAdam's on CUDA, here over torch's AdamW too), built directly in a world of one:
dstk forgets the optimizer step they take on zero gradients when built, a state restored by HF name
reaches their fp32 masters and Adam's state (the next step is a plain fp32 AdamW's step from that state),
and their saved state is read back by parameter name (portable.from_torch_states). No GPU here: fp16
itself is refused on this CPU, so bf16 stands in (the wrappers treat both alike, without loss scaling)."""

from types import SimpleNamespace

import pytest
import torch

from toolkit.checkpoint import portable
from toolkit.distributed import optimizers

LR, DECAY, STEP = 0.1, 0.1, 5


def wrapper(kind: str, seed: int = 0):
    """(wrapper, its bf16 parameters w (3 x 4) and b (3,)) over torch's AdamW."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(3, 4).bfloat16()), torch.nn.Parameter(torch.randn(3).bfloat16())]
    cls = {"FP16_Optimizer": FP16_Optimizer, "FP16_UnfusedOptimizer": FP16_UnfusedOptimizer}[kind]
    built = cls(torch.optim.AdamW(params, lr=LR, weight_decay=DECAY), low_precision_dtype=torch.bfloat16)
    return built, params


def masters(optimizer) -> list:
    if hasattr(optimizer, "fp32_groups_flat"):
        return [t.detach().clone() for t in optimizer.fp32_groups_flat[0].split([12, 3])]
    return [t.detach().clone().flatten() for t in optimizer.fp32_groups[0]]


KINDS = ["FP16_Optimizer", "FP16_UnfusedOptimizer"]


@pytest.mark.parametrize("kind", KINDS)
def test_settle_forgets_the_step_the_wrapper_took_when_built(ds_world1, kind):
    built, params = wrapper(kind)
    assert {int(s["step"]) for s in built.optimizer.state.values()} == {1}  # DeepSpeed's zero-gradient step
    assert not torch.equal(masters(built)[0], params[0].detach().float().flatten())  # and AdamW's decay on it
    optimizers.settle(SimpleNamespace(optimizer=built))
    assert len(built.optimizer.state) == 0
    assert all(torch.equal(m, p.detach().float().flatten()) for m, p in zip(masters(built), params))


def restored_state(seed: int = 1) -> dict:
    """Weights off the bf16 grid, Adam's moments and the gradient a step then sees, for w and b."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in (("w", (3, 4)), ("b", (3,))):
        out[name] = {"weight": torch.randn(shape, generator=g), "exp_avg": torch.randn(shape, generator=g) * 1e-2,
                     "exp_avg_sq": torch.rand(shape, generator=g) * 1e-4,
                     "grad": torch.randn(shape, generator=g).bfloat16()}
    return out


def plain_adamw_step(state: dict) -> list:
    """What fp32 AdamW does from `state` at step STEP: the masters after one more step."""
    params = [torch.nn.Parameter(s["weight"].clone()) for s in state.values()]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=DECAY)
    for p, s in zip(params, state.values()):
        optimizer.state[p] = {"step": torch.tensor(float(STEP)), "exp_avg": s["exp_avg"].clone(),
                              "exp_avg_sq": s["exp_avg_sq"].clone()}
        p.grad = s["grad"].float()
    optimizer.step()
    return [p.detach().flatten() for p in params]


@pytest.mark.parametrize("kind", KINDS)
def test_a_restored_state_reaches_the_masters_and_adams_state(ds_world1, kind):
    built, params = wrapper(kind)
    optimizers.settle(SimpleNamespace(optimizer=built))
    state = restored_state()
    with torch.no_grad():
        for p, s in zip(params, state.values()):
            p.copy_(s["weight"].bfloat16())  # what portable.restore writes into the module
    optimizers.restore_masters(built, {id(p): (s["weight"], {k: s[k] for k in portable.MOMENTS})
                                     for p, s in zip(params, state.values())}, torch.tensor(float(STEP)))
    assert all(torch.equal(m, s["weight"].flatten()) for m, s in zip(masters(built), state.values()))
    for p, s in zip(params, state.values()):
        p.grad = s["grad"]
    built.step()
    want = plain_adamw_step(state)
    for got, expected, p in zip(masters(built), want, params):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)
        assert torch.equal(p.detach().flatten(), expected.bfloat16())  # the module follows its masters
    assert {int(s["step"]) for s in built.optimizer.state.values()} == {STEP + 1}  # each state its own count


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrappers_saved_state_is_read_by_parameter_name(ds_world1, kind, tmp_path):
    """The model states file DeepSpeed writes at ZeRO-0 (the wrapper's state_dict, the base optimizer's inside;
    FP16_Optimizer's moments one flat tensor per group) gives each parameter's moments and the step."""
    built, params = wrapper(kind)
    optimizers.settle(SimpleNamespace(optimizer=built))
    for p in params:
        p.grad = torch.ones_like(p)
    built.step()
    flat = built.optimizer.state[built.optimizer.param_groups[0]["params"][0]]
    torch.save({"module": {"w": params[0].detach(), "b": params[1].detach()}, "optimizer": built.state_dict(),
                "param_names": [["w", "b"]]}, tmp_path / "mp_rank_00_model_states.pt")
    moments, step = portable.from_torch_states(tmp_path, {"pp": 1})
    assert step == 1 and set(moments["exp_avg"]) == {"w", "b"}
    if kind == "FP16_Optimizer":
        assert torch.equal(torch.cat([moments["exp_avg"]["w"], moments["exp_avg"]["b"]]), flat["exp_avg"])
    else:
        assert torch.equal(moments["exp_avg_sq"]["w"], flat["exp_avg_sq"].flatten())
