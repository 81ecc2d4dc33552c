"""GPU tier: the CUDA branches that the CPU suite can only reach through stand-ins (skipped without CUDA; CI has
none). Written without a GPU to run them on: the first session lent one runs this file before anything else.

- Ulysses' core on CUDA (toolkit.distributed.document_flex): the compiled flex_attention with one document
  BlockMask per micro-batch gives the per-document sdpa loop's output AND gradients (the CPU tests check the
  forward only: torch 2.13 has no flex backward on CPU), in fp32 and bf16.
- Adam's state restored onto another layout (toolkit.checkpoint.portable) under the fused CUDA AdamW the
  generated GPU configs use: the step lies on the device, and a step after the restore equals one after torch's
  own load (the CPU suite puts meta tensors in the GPU's place).
- Batches to the device (toolkit.data.transfer): pinned host memory and non-blocking copies give the same values.
"""

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROWS = ((0, 300, 520, 1024), (0, 1024))  # a packed row of 3 documents (crossing 128-token blocks) and a whole one


def _qkv(dtype, kv_heads=2):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(2, n, 1024, 64, generator=g, device="cuda", dtype=dtype, requires_grad=True)
            for n in (4, kv_heads, kv_heads)]


def _attend(monkeypatch, flex: bool, q, k, v, window):
    import torch.nn as nn

    from models.attention import Documents
    from toolkit.distributed import sequence_parallel

    module = nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = True, q.shape[1] // k.shape[1], True
    with monkeypatch.context() as m:
        m.setattr(sequence_parallel, "_use_flex", lambda query: flex)
        out, _ = sequence_parallel.document_sdpa(module, q, k, v, None, documents=Documents(ROWS), dropout=0.0,
                                                 scaling=64 ** -0.5, sliding_window=window)
    return out


@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_gives_the_document_loops_output_and_gradients(monkeypatch, dtype, window):
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    q, k, v = _qkv(dtype)
    want = _attend(monkeypatch, False, q, k, v, window)
    grads_want = torch.autograd.grad(want.float().square().sum(), (q, k, v))
    got = _attend(monkeypatch, True, q, k, v, window)
    grads_got = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    assert (got.float() - want.float()).abs().max() <= tol
    for a, b in zip(grads_got, grads_want):
        assert (a.float() - b.float()).abs().max() <= tol * max(1.0, b.float().abs().max().item())


def test_a_restored_fused_adamw_steps_on_the_device_as_a_loaded_one():
    from tests.unit.test_restore_placement import loaded, placement, restored

    (a, opt_a), (b, opt_b) = restored("cuda", {"fused": True}), loaded("cuda", {"fused": True})
    assert placement(a, opt_a) == placement(b, opt_b)
    assert {s["step"].device.type for s in opt_a.state.values()} == {"cuda"}
    for p, q in zip(a.parameters(), b.parameters()):
        p.grad = q.grad = torch.ones_like(p)
    opt_a.step()
    opt_b.step()
    torch.cuda.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_batches_reach_the_device_pinned_and_without_blocking_as_they_are():
    from toolkit.data.transfer import pin_wanted, pinned, to_device

    batch = ((torch.arange(64).reshape(2, 32), torch.ones(2, 32, dtype=torch.long)), torch.arange(64).reshape(2, 32))
    assert pin_wanted("cuda") and not pin_wanted("cpu")
    assert all(t.is_pinned() for t in (*pinned(batch)[0], pinned(batch)[1]))
    (ids, docs), labels = to_device(batch, torch.device("cuda"))
    torch.cuda.synchronize()
    assert ids.is_cuda and torch.equal(ids.cpu(), batch[0][0]) and torch.equal(labels.cpu(), batch[1])
