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

from .on_device import device_vector, host_to_device
from .partial import Layout, Partial


class RankMismatch(RuntimeError):
    """Ranks fed different statistics layouts (e.g. one rank passed ref_logprobs, another did not)."""


@functools.lru_cache(maxsize=64)
def _plan(layouts: tuple):
    """How the transferred vector splits into named arrays, computed once per layout (a step's layouts rarely
    change): ``(n_sums, negated, single, merged)`` where ``negated`` indexes the minima (stored negated),
    ``single`` lists ``(name, start, stop)`` of names that appear once and ``merged`` ``(name, [(start, stop)],
    is_max)`` of names that several segments carry."""
    n_sum = sum(size for lay in layouts for _, size in lay[0])
    offsets = [0, n_sum]
    spans: dict[tuple[str, bool], list[tuple[int, int]]] = {}  # (name, is_max) -> spans
    negated: list[int] = []
    for lay in layouts:
        for part in (0, 1):
            for name, size in lay[part]:
                start = offsets[part]
                offsets[part] += size
                if name.startswith("-"):
                    negated.extend(range(start, start + size))
                    name = name[1:]
                spans.setdefault((name, part == 1), []).append((start, start + size))
    single = tuple((name, *where[0]) for (name, _), where in spans.items() if len(where) == 1)
    merged = tuple((name, tuple(where), is_max) for (name, is_max), where in spans.items() if len(where) > 1)
    return n_sum, np.asarray(negated, dtype=np.int64), single, merged


class StepAccumulator:
    """Adds ``Partial`` statistics on the device until ``finish()`` is called once per optimizer step."""

    def __init__(self) -> None:
        # layout -> [running sums, running maxima, whether they are still the first Partial's own vectors]
        self._segments: dict[Layout, list] = {}
        self.device: torch.device | None = None

    def add(self, partial: Partial) -> None:
        layout, s, m = partial
        if not s.numel() and not m.numel():
            return
        if self.device is None:
            self.device = s.device
        seg = self._segments.get(layout)
        if seg is None:  # kept as given (most layouts come once a step): never written, so never the caller's
            self._segments[layout] = [s, m, True]
        elif seg[2]:  # the first vectors are the caller's
            seg[:] = [seg[0] + s, torch.maximum(seg[1], m), False]
        else:
            seg[0].add_(s)
            torch.maximum(seg[1], m, out=seg[1])

    def _packed(self) -> tuple[list[Layout], torch.Tensor]:
        """The canonical layout order and one vector: the sums, the maxima, then the layout checksum as (+n, -n)
        (after a MAX across ranks the two disagree iff the ranks' layouts differ; it costs nothing extra: it
        travels in the same transfer)."""
        layouts = sorted(self._segments)
        device = self.device if self.device is not None else torch.device("cpu")
        parts = [self._segments[k][0] for k in layouts] + [self._segments[k][1] for k in layouts]
        parts.append(_check_pair(tuple(layouts), device))
        if not all(t.dtype == torch.float64 and t.device == device for t in parts):  # a Partial's vectors already are
            parts = [host_to_device(t, device, torch.float64) for t in parts]
        return layouts, torch.cat(parts)

    def finish(self, reduce: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> dict[str, np.ndarray]:
        """Reduce (optional), transfer once, reset; returns name -> float64 array with minima un-negated."""
        layouts, buf = self._packed()
        if reduce is not None:
            n_sum = _plan(tuple(layouts))[0]
            reduce(buf[:n_sum], buf[n_sum:])  # in place, the checksum pair with the maxima
        host = to_host(buf)
        self._segments.clear()
        if host[-2] != -host[-1]:
            raise RankMismatch(
                "ranks fed different statistics layouts this step (some rank saw fields the others "
                "did not); feed the same TokenBatch fields on every rank"
            )
        return unpack(layouts, host[:-2])


@functools.lru_cache(maxsize=16)
def _check_pair(layouts: tuple, device: torch.device) -> torch.Tensor:
    """The layouts' checksum n as the pair (+n, -n), built on the device once per layout (the concatenation copies
    it)."""
    n = float(zlib.crc32(repr(layouts).encode()))
    return device_vector([n, -n], device)


def to_host(packed: torch.Tensor) -> np.ndarray:
    """The step's one device->host transfer. Kept in its own function so that the tests' sync detector can tell
    it from any other host read (it recognises the syncs made inside this function)."""
    return packed.cpu().numpy()


def unpack(layouts: list[Layout], host: np.ndarray) -> dict[str, np.ndarray]:
    """Split the transferred vector back into named arrays, merging names that appear in several segments. The
    arrays are read-only views of ``host`` (float64; the minima are un-negated in place) where a name appears
    once."""
    _, negated, single, merged = _plan(tuple(layouts))
    host = np.asarray(host, dtype=np.float64)
    host[negated] *= -1.0  # minima travel negated
    host.flags.writeable = False
    out = {name: host[start:stop] for name, start, stop in single}
    for name, where, is_max in merged:
        out[name] = functools.reduce(np.maximum if is_max else np.add, (host[a:b] for a, b in where))
    return out
