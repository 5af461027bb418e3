"""Device-side accumulation across micro-batches and the single device->host transfer per step.

Partials with the same layout (names and sizes) are packed into one flat vector per reduction (sum, max) and
added in place, so a micro-batch costs two small kernels here. At the end of the step every segment is
concatenated, optionally reduced across ranks (one SUM and one MAX collective), and moved to the host in one
``.cpu()`` call. Minima travel negated inside the max vector.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable

import numpy as np
import torch

from .partial import Layout, Partial

class RankMismatch(RuntimeError):
    """Ranks fed different statistics layouts (e.g. one rank passed ref_logprobs, another did not)."""


def _layout(p: Partial) -> Layout:
    return (tuple((k, v.numel()) for k, v in p.sum.items()), tuple((k, v.numel()) for k, v in p.max.items()))


def _cat(tensors, device) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0, dtype=torch.float64, device=device)
    if all(t.dtype == torch.float64 and t.device == device for t in tensors):  # Partial entries already are
        return torch.cat(tensors)
    return torch.cat([t.to(device=device, dtype=torch.float64) for t in tensors])


@functools.lru_cache(maxsize=64)
def _checksum(layouts: tuple) -> float:
    return float(zlib.crc32(repr(layouts).encode()))


@functools.lru_cache(maxsize=64)
def _plan(layouts: tuple) -> tuple[tuple[tuple[str, int, int, bool], ...], tuple[str, ...]]:
    """Where each name's values sit in the transferred vector: ``(name, start, stop, is_max)`` in segment order,
    and the names stored negated (minima). A step's layouts rarely change, so this is computed once per layout."""
    n_sum = sum(size for lay in layouts for _, size in lay[0])
    offsets, spans = [0, n_sum], []
    for lay in layouts:
        for part in (0, 1):
            for name, size in lay[part]:
                spans.append((name, offsets[part], offsets[part] + size, part == 1))
                offsets[part] += size
    negated = tuple(dict.fromkeys(name for name, *_ in spans if name.startswith("-")))
    return tuple(spans), negated


class StepAccumulator:
    """Adds ``Partial`` statistics on the device until ``finish()`` is called once per optimizer step."""

    def __init__(self) -> None:
        self._segments: dict[Layout, list[torch.Tensor]] = {}
        self.device: torch.device | None = None

    def add(self, partial: Partial) -> None:
        packed = partial.packed
        if packed is not None:
            layout, s, m = packed
            if not s.numel() and not m.numel():
                return
            device = s.device
        else:
            if not partial.sum and not partial.max:
                return
            device = next(iter(partial.sum.values() or partial.max.values())).device
            layout = _layout(partial)
            s = _cat(list(partial.sum.values()), self.device or device)
            m = _cat(list(partial.max.values()), self.device or device)
        if self.device is None:
            self.device = device
        seg = self._segments.get(layout)
        if seg is None:  # a packed Partial's entries are views of s and m: the running total must not alias them
            self._segments[layout] = [s.clone(), m.clone()] if packed is not None else [s, m]
        else:
            seg[0].add_(s)
            torch.maximum(seg[1], m, out=seg[1])

    def pack(self) -> tuple[list[Layout], torch.Tensor, torch.Tensor]:
        """Segments in a canonical order plus the concatenated sum and max vectors (still on the device)."""
        layouts = sorted(self._segments)
        device = self.device if self.device is not None else torch.device("cpu")
        sums = _cat([self._segments[k][0] for k in layouts], device)
        maxes = _cat([self._segments[k][1] for k in layouts], device)
        return layouts, sums, maxes

    def finish(self, reduce: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> dict[str, np.ndarray]:
        """Reduce (optional), transfer once, reset; returns name -> float64 array with minima un-negated."""
        layouts, sums, maxes = self.pack()
        # A checksum of the layout (names and sizes) rides in the max vector as (+n, -n): after a MAX across ranks
        # they disagree iff the ranks' layouts differ. It costs nothing extra: it travels in the same transfer.
        n = _checksum(tuple(layouts))
        check = torch.full((2,), n, dtype=torch.float64, device=maxes.device)  # filled on the device: no copy
        check[1] = -n
        maxes = torch.cat([maxes, check])
        if reduce is not None:
            reduce(sums, maxes)
        host = to_host(torch.cat([sums, maxes]))
        self._segments.clear()
        if host[-2] != -host[-1]:
            raise RankMismatch("ranks fed different statistics layouts this step (some rank saw fields the others "
                               "did not); feed the same TokenBatch fields on every rank")
        return unpack(layouts, host[:-2])


def to_host(packed: torch.Tensor) -> np.ndarray:
    """The step's one device->host transfer. Kept in its own function so that the tests' sync detector can tell
    it from any other host read (it recognises the syncs made inside this function)."""
    return packed.cpu().numpy()


def unpack(layouts: list[Layout], host: np.ndarray) -> dict[str, np.ndarray]:
    """Split the transferred vector back into named arrays, merging names that appear in several segments. The
    arrays are read-only views of ``host`` (float64) where a name appears once."""
    host = np.asarray(host, dtype=np.float64)
    host.flags.writeable = False
    spans, negated = _plan(tuple(layouts))
    out: dict[str, np.ndarray] = {}
    for name, start, stop, is_max in spans:
        chunk = host[start:stop]
        if name in out:
            out[name] = (np.maximum if is_max else np.add)(out[name], chunk)
        else:
            out[name] = chunk
    for name in negated:
        out[name[1:]] = -out.pop(name)
    return out
