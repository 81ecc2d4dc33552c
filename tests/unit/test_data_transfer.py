"""Batches on their way to the device (toolkit.data.transfer): the prefetch thread keeps the order and its bound,
carries a failure to the training thread as it was and stops when closed; pinning is asked for exactly where the
device is a CUDA one; every copy is non-blocking, at the training loop's call sites too.

No GPU here: where a test needs CUDA present, torch.cuda.is_available / set_device / current_device are faked and
Tensor.pin_memory and Tensor.to are spies that hand back the host tensor. What that stands in for cannot run on
this machine: real page-locked memory, an asynchronous copy on a CUDA stream and the kernels ordered after it."""

import json
import threading
import time
from itertools import islice
from types import SimpleNamespace

import pytest
import torch

from toolkit import data
from toolkit.data.stream import StreamBatches
from toolkit.data.transfer import pin_wanted, prefetched, to_device
from toolkit.errors import ConfigError
from toolkit.train.hf import byte_tokenizer


def a_batch():
    ids = torch.arange(12).view(2, 6)
    return (ids, torch.ones_like(ids)), ids.clone()


def tensors(batch) -> list:
    (ids, docs), labels = batch
    return [ids, docs, labels]


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'present': {"pin": [(tensor, thread name)], "set_device": [(index, thread name)]} as they happen."""
    seen = {"pin": [], "set_device": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda i: seen["set_device"].append((i, threading.current_thread().name)))

    def pin(self):
        seen["pin"].append((self, threading.current_thread().name))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    return seen


@pytest.fixture
def copies(monkeypatch):
    """[(tensor, args, kwargs)] of every Tensor.to call; a copy to a CUDA device hands back the host tensor."""
    seen, real = [], torch.Tensor.to

    def to(self, *args, **kwargs):
        seen.append((self, args, kwargs))
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
            return self
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return seen


@pytest.mark.parametrize("device, cuda, want", [
    ("cpu", False, False), (torch.device("cpu"), True, False), ("cuda:1", True, True),
    (torch.device("cuda", 0), True, True), ("cuda", False, False)])
def test_pinning_is_wanted_exactly_where_the_device_is_cuda_and_cuda_is_there(monkeypatch, device, cuda, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert pin_wanted(device) is want


def test_to_device_on_the_host_copies_nothing_blocking_and_pins_nothing(copies, monkeypatch):
    pins = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pins.append(self) or self)
    batch = a_batch()
    moved = to_device(batch, torch.device("cpu"))
    assert all(a is b for a, b in zip(tensors(moved), tensors(batch)))  # already there: the tensors themselves
    assert [kw for _, _, kw in copies] == [{"non_blocking": True}] * 3 and pins == []


def test_to_device_pins_each_host_tensor_then_copies_it_non_blocking_for_cuda(fake_cuda, copies):
    batch = a_batch()
    moved = to_device({"batch": batch, "use_cache": False}, "cuda:0")
    assert moved["use_cache"] is False
    assert [id(t) for t, _ in fake_cuda["pin"]] == [id(t) for t in tensors(batch)]  # each pinned, then copied:
    assert [(id(t), args, kw) for t, args, kw in copies] == [(id(t), ("cuda:0",), {"non_blocking": True})
                                                            for t in tensors(batch)]


def test_the_samplers_pin_exactly_for_a_cuda_device_the_stream_on_its_thread(fake_cuda, tmp_path):
    rows = data.TokenData(*(torch.arange(64).view(8, 8),) * 3)
    sharded = data.ShardedBatches(rows, 2, 1, 1, 0, 0)
    next(sharded.micro_batches(0, pin_for="cpu"))
    assert fake_cuda["pin"] == []
    got = next(sharded.micro_batches(0, pin_for="cuda:0"))
    assert [id(t) for t, _ in fake_cuda["pin"]] == [id(t) for t in tensors(got)]  # on the caller's thread
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(50)))
    opts = data.DataOptions(path=str(corpus), seq_len=16, eval_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    fake_cuda["pin"].clear()
    list(islice(StreamBatches(opts, byte_tokenizer(), 2, 1, 1, 0).micro_batches(pin_for="cpu"), 3))
    assert fake_cuda["pin"] == [] and fake_cuda["set_device"] == []
    stream = StreamBatches(opts, byte_tokenizer(), 2, 1, 1, 0).micro_batches(pin_for="cuda")
    got = list(islice(stream, 3))
    stream.close()
    pinned = {t.untyped_storage().data_ptr(): thread for t, thread in fake_cuda["pin"]}  # a packing batch's tensors:
    assert all(pinned.get(t.untyped_storage().data_ptr()) == "dstk-prefetch" for b in got for t in tensors(b))  # views
    assert fake_cuda["set_device"] == [(3, "dstk-prefetch")]  # the training thread's device, set on the thread


def test_prefetch_keeps_the_order_and_runs_ahead_no_further_than_its_bound():
    made = []

    def source():
        for i in range(500):
            made.append(i)
            yield i

    assert list(prefetched(source(), 4)) == list(range(500))
    made.clear()
    items = prefetched(source(), 4)
    assert next(items) == 0
    time.sleep(0.3)  # the thread fills the queue, then waits
    assert len(made) == 1 + 4 + 1  # taken, queued, the one waiting for room
    assert list(islice(items, 10)) == list(range(1, 11))
    items.close()


def test_a_failure_on_the_thread_reaches_the_consumer_after_the_items_before_it_with_its_message():
    def source():
        yield from range(3)
        raise ConfigError("rows.jsonl row 4: 'text' is missing, not a string; fix the row")

    got, items = [], prefetched(source(), 2)
    with pytest.raises(ConfigError) as raised:
        for item in items:
            got.append(item)
    assert got == [0, 1, 2] and str(raised.value) == "rows.jsonl row 4: 'text' is missing, not a string; fix the row"


def test_closing_stops_the_thread_and_closes_its_source():
    closed = []

    def source():
        try:
            yield from range(10**6)
        finally:
            closed.append(True)

    before = set(threading.enumerate())
    items = prefetched(source(), 3)
    assert list(islice(items, 5)) == list(range(5))
    started = [t for t in threading.enumerate() if t not in before]
    assert [t.name for t in started] == ["dstk-prefetch"]
    items.close()
    assert closed == [True] and not started[0].is_alive()


def bad_rows(folder, bad: int, n: int = 2300):
    """n text rows with row bad + 1 (counted from 1) null: a row that fails tokenizing."""
    path = folder / "bad.jsonl"
    rows = [{"text": f"doc {i} " + "ab" * (i % 7)} for i in range(n)]
    rows[bad] = {"text": None}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_row_that_fails_tokenizing_on_the_thread_is_the_same_error_after_the_same_micro_batches(tmp_path):
    """Row 1501 lies in the second packing batch, tokenized on the prefetch thread while the first one's 570
    micro-batches are taken (the count the same stream gave when it tokenized on the training thread)."""
    path = bad_rows(tmp_path, 1500)
    opts = data.DataOptions(path=str(path), seq_len=16, eval_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    taken = 0
    with pytest.raises(ConfigError) as raised:
        for _ in StreamBatches(opts, byte_tokenizer(), 2, 1, 1, 0).micro_batches():
            taken += 1
    assert taken == 570
    assert str(raised.value) == (f"{path} row 1501: 'text' is missing, not a string; fix the row, or point "
                                 "--text-field at the field that holds the text")


class Engine:
    """What forward_loss calls of DeepSpeed's engine at pp = 1 (forward does not move inputs): a real tiny GPT-2."""

    def __init__(self):
        from models.weights import loading
        from toolkit.train import hf

        self.module = loading.build_model("tiny-gpt2", hf.load_config("tiny-gpt2", byte_tokenizer(), "causal-lm"),
                                     "causal-lm", 0)
        self.device, self.got = torch.device("cpu"), None

    def __call__(self, **inputs):
        self.got = inputs
        return self.module(**inputs)


def test_the_loops_copies_to_the_device_are_all_non_blocking(copies):
    """pp = 1 (forward_loss: the batch and the inputs built from it on the host) and a pipeline's micro-batch
    (stage_batch, what DeepSpeed's PipelineEngine pulls): every tensor the engine gets went through a copy with
    non_blocking=True."""
    from toolkit.train import loop

    engine = Engine()
    (ids, docs), labels = a_batch()
    docs[:, 3:] = 2  # two documents a row: position ids and the mask are built from them
    loop.forward_loss(engine, ((ids % 250, docs), labels % 250))
    handed = [v for v in engine.got.values() if isinstance(v, torch.Tensor)]
    assert len(handed) >= 3  # input_ids, labels, position_ids (and a mask)
    non_blocking = {id(t) for t, _, kw in copies if kw.get("non_blocking") is True}
    assert all(id(t) in non_blocking for t in handed)
    copies.clear()
    job = SimpleNamespace(pipeline=True, sp=1, engine=SimpleNamespace(device=torch.device("cpu")))
    staged = loop.stage_batch(job, a_batch())
    assert [kw for _, _, kw in copies] == [{"non_blocking": True}] * 3 and len(tensors(staged)) == 3
