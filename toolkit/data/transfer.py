"""Batches on their way to the accelerator without stalling the training thread: pinned host memory, copies that
do not wait, and a thread that makes the next batches while the current one trains.

    pin_wanted(device)      True where `device` is a CUDA device and CUDA is there (never on the host)
    pinned(batch)           every host tensor of a batch (nested tuples, lists, dicts) in pinned memory
    to_device(batch, dev)   every tensor copied with non_blocking=True, from pinned memory where pin_wanted
    prefetched(items, n)    the items of an iterator made on a thread of their own, up to n ahead

Why: `t.to("cuda")` from pageable memory stages the bytes through a driver buffer and synchronizes the host
with the stream: once per tensor, per micro-batch, the host waits for every kernel queued before it. From
pinned memory, `non_blocking=True` queues the copy on the current stream and returns; the kernels queued after
it on that stream (the forward that reads the batch) run after it, so the only users must be on that stream.
torch's caching host allocator keeps a pinned block until the copy that reads it has run, so the host tensor
may be dropped at once. Pinning is a host copy (and needs CUDA): on the host it is never asked for.
"""

import queue
import threading
import time

import torch


def pin_wanted(device) -> bool:
    """Whether batches bound for `device` (a torch.device or its name) are worth pinning: a CUDA device, with CUDA."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def pinned(batch):
    """`batch` with each host tensor in page-locked memory (already pinned ones as they are)."""
    return _each(batch, lambda t: t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t)


def to_device(batch, device):
    """`batch` on `device`: each tensor copied with non_blocking=True (from pinned memory when pin_wanted; a tensor
    already there is itself). Its users must run on the current stream (the copy's)."""
    pin = pin_wanted(device)

    def move(t):
        if pin and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    return _each(batch, move)


def _each(batch, fn):
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_each(x, fn) for x in batch)
    if isinstance(batch, dict):
        return {k: _each(v, fn) for k, v in batch.items()}
    return batch


_END = object()  # the producer's last item: its iterator ran out


class _Failed:
    """What the producer raised, carried to the consumer (which raises it, message and type unchanged)."""

    def __init__(self, error: BaseException):
        self.error = error


def prefetched(items, depth: int, pin_for=None):
    """The items of iterator `items`, in order, made on a daemon thread at most `depth` ahead of the consumer (a
    bounded queue). pin_for: the device they will be copied to; where pin_wanted(pin_for), each item is pinned on
    the thread (CUDA's current device set there first, as torch's DataLoader does). An exception in the thread is
    raised here, at the item it replaced. Closing this generator (or dropping it) stops the thread at its next
    item and closes `items` (_drain)."""
    cuda_index = None  # pinning: the device the thread makes current (this thread's, for a bare "cuda")
    if pin_for is not None and pin_wanted(pin_for):
        cuda_index = torch.device(pin_for).index
        cuda_index = torch.cuda.current_device() if cuda_index is None else cuda_index
    ready, stop = queue.Queue(maxsize=max(1, depth)), threading.Event()
    thread = threading.Thread(target=_produce, args=(items, ready, stop, cuda_index), daemon=True, name="dstk-prefetch")
    thread.start()
    drain = _drain  # a local: a generator dropped at interpreter exit is closed after this module's globals are gone
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        drain(ready, thread)


def _drain(ready: queue.Queue, thread: threading.Thread, wait_s: float = 30.0, _clock=time.monotonic,
           _empty=queue.Empty) -> None:
    """Empty the queue until the producer has seen `stop` and ended (it checks at each put), waiting at most
    wait_s for the item it is making (one packing batch tokenized; a resumed stream's skip can take longer): a
    daemon thread still busy then ends with the process, its item never put. (_clock, _empty: bound at definition,
    for the same reason as `drain`.)"""
    deadline = _clock() + wait_s
    while thread.is_alive() and _clock() < deadline:
        try:
            ready.get(timeout=0.05)
        except _empty:
            pass


def _produce(items, ready: queue.Queue, stop: threading.Event, cuda_index) -> None:
    try:
        if cuda_index is not None:
            torch.cuda.set_device(cuda_index)
        for item in items:
            if not _put(ready, pinned(item) if cuda_index is not None else item, stop):
                return
        _put(ready, _END, stop)
    except BaseException as exc:  # the consumer must hear of it, or it waits forever
        _put(ready, _Failed(exc), stop)
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()


def _put(ready: queue.Queue, item, stop: threading.Event) -> bool:
    """Put `item` once there is room; False (not put) once the consumer has stopped."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False
