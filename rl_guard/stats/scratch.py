"""Chunk-sized buffers reused by every chunk of a micro-batch, and the elementwise primitives that write into them.

On CPU a fresh chunk-sized temporary costs more than the arithmetic done in it: the allocator hands freed blocks
back to the system and every new one is page-faulted in again, and an out-of-place result is written to memory
that is not in cache. Every token probe therefore writes into a named buffer of a ``Scratch`` (``out=`` and
in-place operations only); the buffers are allocated at the first chunk and reused by the others, so the extra
memory is a fixed set of chunk-sized tensors whatever the batch size. A value that a later probe of the same chunk
reads (the log-ratio, its validity, k3, the advantage sign) has its own name; the temporaries of one probe family
(``t0``..``t3``, ``z``, ``e``, ``count``, ``extreme``, ``cell*``) are reused by the next family, which keeps the set
small and the buffers warm in cache.

Validity travels inside the values: the mask's gate (0 or -inf) is added to an input, so a value is non-finite
exactly where the token is masked out or the input itself is NaN/inf; its zero-filled copy (needed for the sums
anyway) equals it exactly at the finite entries, so one comparison written as floats gives the 0/1 validity,
several times cheaper per element on CPU than boolean masks. ``rows`` buffers hold several such per-token rows
back to back, so that one operation serves them all (``token_rows.py``).
"""

from __future__ import annotations

import math
import threading

import torch

F32, I32 = torch.float32, torch.int32


class Scratch:
    """Named buffers of ``n`` elements (the current chunk's length); capacity is the first chunk's length, which
    is the largest (``chunks`` yields full chunks first). ``Scratch.for_batch`` keeps one per device for small
    micro-batches, whose buffers would otherwise be allocated anew every call."""

    KEEP_TOKENS = 1 << 16  # micro-batches up to this size reuse one kept set of buffers (< ~10 MiB)
    _kept = threading.local()  # per thread: two guards probing at once in one process never share buffers

    @classmethod
    def for_batch(cls, device: torch.device, tokens: int) -> Scratch:
        if tokens > cls.KEEP_TOKENS:
            return cls(device)
        kept = cls._kept.__dict__.setdefault("by_device", {})
        ws = kept.get(device)
        if ws is None:
            ws = kept[device] = cls(device)
        return ws

    def __init__(self, device: torch.device) -> None:
        self.device, self.n, self.cap = device, 0, 0
        self._bufs: dict = {}
        self._views: dict = {}  # the buffers cut to the current chunk length

    def start(self, n: int) -> None:
        if n > self.cap:  # the first chunk, or a kept Scratch meeting a larger batch (``chunks``: largest first)
            self._bufs.clear()
            self.cap = n
        if n != self.n:
            self._views.clear()
        self.n = n

    def __call__(self, name: str, dtype: torch.dtype = F32) -> torch.Tensor:
        view = self._views.get((name, dtype))
        if view is None:
            buf = self._bufs.get((name, dtype))
            if buf is None:
                buf = self._bufs[(name, dtype)] = torch.empty(self.cap, dtype=dtype, device=self.device)
            view = self._views[(name, dtype)] = buf[: self.n]
        return view

    def rows(self, name: str, r: int, dtype: torch.dtype = F32) -> torch.Tensor:
        """A contiguous ``[r, n]`` buffer: ``r`` per-token rows of the current chunk, so that one operation (and one
        kernel launch) serves every row."""
        key = (name, dtype, r)
        view = self._views.get(key)
        if view is None:
            buf = self._bufs.get(key)
            if buf is None:
                buf = self._bufs[key] = torch.empty(r * self.cap, dtype=dtype, device=self.device)
            view = self._views[key] = buf[: r * self.n].view(r, self.n)
        return view


def valid_of(ws: Scratch, name: str, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """1.0 where ``y`` is finite, 0.0 elsewhere, given ``z = zero_filled(y)``: ``y == z`` holds exactly at the
    finite entries (one comparison written as floats: a single pass instead of three)."""
    return torch.eq(y, z, out=ws(name))


def zero_filled(ws: Scratch, name: str, y: torch.Tensor) -> torch.Tensor:
    """``y`` with every non-finite entry replaced by 0."""
    return torch.nan_to_num(y, 0.0, 0.0, 0.0, out=ws(name))


def finite_max(ws: Scratch, y: torch.Tensor) -> torch.Tensor:
    """Largest finite entry of ``y`` (-inf if none)."""
    if y.numel() == 0:
        return y.new_full((), -math.inf)
    return torch.nan_to_num(y, -math.inf, -math.inf, -math.inf, out=ws("extreme")).amax()
