"""Capture once, replay often: the two pieces every CUDA graph of the engine is built from.

A CUDA graph records a fixed sequence of kernel launches with fixed pointers; replaying
it relaunches them all with one call, so the host's cost of launching each kernel from
Python disappears. Fixed pointers mean fixed buffers: a graph's inputs live in static
tensors that the host rewrites before each replay (:class:`StagedBuffers`), and its
outputs are the tensors the capture produced, rewritten in place by every replay.

:class:`CapturedStep` wraps one function captured this way. Without a GPU (or with
``cuda=False``) it calls the function at every replay instead: the same buffers and
bookkeeping, so the plumbing around a graph is testable on a CPU. Users:
:mod:`.spec_graphs` (speculative decoding) and :mod:`.piecewise` (steps with prompt
chunks).
"""
from __future__ import annotations

import torch

from ..runtime import cuda_graph_capture


_CAPTURE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def capture_stream() -> "torch.cuda.Stream":
    """The side stream on which the engine warms up and captures every graph (one per GPU)."""
    index = torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream()
    return _CAPTURE_STREAMS[index]


def capture(fn, pool=None, warmups: int = 2):
    """``(graph, out)``: ``fn()`` called ``warmups`` times, then captured.

    PyTorch's recipe: the warm-up calls run on the stream the capture then uses, so that
    whatever is set up lazily on first use (Triton compiling and loading a kernel,
    autotuning, a library's per-stream workspace) happens there and not inside the
    capture, where it would invalidate the graph; no garbage collection inside it either
    (:func:`gpulab.runtime.cuda_graph_capture`)."""
    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with cuda_graph_capture(graph, pool=pool, stream=stream):
            out = fn()
    return graph, out


def rewrite(old, new) -> None:
    """Copy ``new`` into ``old`` in place: tensors, and tuples or lists of them (or None)."""
    if isinstance(old, torch.Tensor):
        old.copy_(new)
    elif isinstance(old, (tuple, list)):
        for a, b in zip(old, new, strict=True):
            rewrite(a, b)
    elif old is not None or new is not None:
        raise TypeError(f"a captured step returns tensors, tuples or lists of them, or None; got {type(new)}")


class CapturedStep:
    """``fn()`` (it reads and writes only static tensors) captured once, replayed often.

    ``cuda``: two warm-up calls (autotuning and lazy allocations stay outside the graph),
    then a ``torch.cuda.CUDAGraph`` capture (:func:`capture`); ``replay()`` relaunches the
    recorded kernels and returns the same output tensors, rewritten. Without ``cuda``,
    ``replay()`` calls ``fn()`` itself: a stand-in that checks the plumbing on a CPU,
    returning the first call's output tensors rewritten, as a graph's are (a caller that
    keeps an output across replays sees it change there too, as on a GPU)."""

    def __init__(self, fn, cuda: bool, pool=None):
        self.fn, self.graph, self.out = fn, None, None
        if cuda:
            self.graph, self.out = capture(fn, pool)

    @property
    def pool(self):
        """The graph's memory pool, for the next capture to share (None without a graph)."""
        return None if self.graph is None else self.graph.pool()

    def replay(self):
        if self.graph is None:
            with torch.no_grad():
                out = self.fn()
            if self.out is None:
                self.out = out
            else:
                rewrite(self.out, out)
            return self.out
        self.graph.replay()
        return self.out


def tokens_from_device(ids: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``ids`` with row r replaced by ``source[index[r]]`` wherever ``index[r] >= 0``: tokens
    the host has not read yet (sampled last step, drafted this step) taken where they are."""
    return torch.where(index >= 0, source[index.clamp(min=0)], ids)


class StagedBuffers:
    """Named static device tensors with host twins (pinned on CUDA) that the host fills
    through NumPy views; ``send`` copies what the host filled to the device.

    All fields live in one device buffer (and their twins in one host buffer), each at a
    16-byte-aligned offset, so that a step's ``send`` is one copy of the span from the
    first named field to the end of the last one's filled prefix, not one copy per field
    (each copy is about 10 µs of host time: at batch 1 the verify and draft inputs were
    eleven of them a step). The span may include fields or tails not named this time: the
    host twin holds what the device holds there (every host write is sent, and the twins
    start as copies of the given tensors), so copying them changes nothing.

    The copy is asynchronous: until the GPU has made it, the host twins must not change.
    ``np`` (the host's way in) therefore waits for the last send's copy, which has almost
    always happened by then (an event's query); a step may read its results back before
    the copy of another graph's inputs queued after them, as drafting ahead does."""

    def __init__(self, **tensors: torch.Tensor):
        first = next(iter(tensors.values()))
        pin = first.is_cuda
        layout, end = [], 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            layout.append((name, end, nbytes, t))
            end = -(-(end + nbytes) // 16) * 16
        self.device_bytes = torch.empty(max(end, 16), dtype=torch.uint8, device=first.device)
        self.host_bytes = torch.empty(max(end, 16), dtype=torch.uint8, pin_memory=pin)
        self.dev, self.host, self._np, self.where = {}, {}, {}, {}
        self.sent = torch.cuda.Event() if pin else None     # recorded after each send's copy
        self.in_flight = False
        for name, start, nbytes, t in layout:
            d = self.device_bytes[start:start + nbytes].view(t.dtype).view(t.shape)
            h = self.host_bytes[start:start + nbytes].view(t.dtype).view(t.shape)
            d.copy_(t)
            h.copy_(t.cpu())
            self.dev[name], self.host[name] = d, h
            self._np[name] = (h.view(torch.uint8) if h.dtype == torch.bool else h).numpy()
            self.where[name] = (start, nbytes // max(1, t.shape[0]) if t.dim() else nbytes)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.dev[name]

    @property
    def np(self) -> dict:
        """The host twins as NumPy arrays, to fill before a :meth:`send` (once the last
        send's copy has read them: :meth:`settle`)."""
        self.settle()
        return self._np

    def settle(self) -> None:
        """Wait until the last send's copy has read the host twins (then they may change)."""
        if self.in_flight:
            self.sent.synchronize()
            self.in_flight = False

    def send(self, **counts: int) -> None:
        """Host -> device, in one copy, of (at least) the first ``counts[name]`` entries of
        each named buffer. No host sync: the pinned source is rewritten only after the
        step's read-back."""
        if not counts:
            return
        lo = min(self.where[name][0] for name in counts)
        hi = max(self.where[name][0] + n * self.where[name][1] for name, n in counts.items())
        if hi > lo:
            self.device_bytes[lo:hi].copy_(self.host_bytes[lo:hi], non_blocking=True)
            if self.sent is not None:
                self.sent.record()
                self.in_flight = True

    def set(self, name: str, value: torch.Tensor) -> None:
        """Write a whole field on the device and its host twin alike (outside ``send``)."""
        self.settle()
        self.dev[name].copy_(value)
        self.host[name].copy_(value.cpu())
