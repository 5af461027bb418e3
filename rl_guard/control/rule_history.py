"""The run's own past values of the watched metrics, which spike rules and incident windows read."""

from __future__ import annotations

import math

import numpy as np


class History:
    """Past finite values per metric (most recent last) and the first values seen (for ``early_max``)."""

    def __init__(self, maxlen: int = 1024, early: int = 1024):
        self.maxlen, self.early = maxlen, early
        self.first: dict[str, list] = {}
        self._rings: dict[str, _Ring] = {}  # the last ``maxlen`` values, readable as an array without copying

    def values(self, metric: str) -> list[float]:
        return self.last(metric, self.maxlen).tolist()

    def last(self, metric: str, n: int) -> np.ndarray:
        """The last ``n`` values (fewer if fewer are known) as a read-only float64 view, oldest first."""
        ring = self._rings.get(metric)
        return ring.last(n) if ring is not None else _EMPTY

    def push(self, metrics: dict[str, float]) -> None:
        rings, firsts, early = self._rings, self.first, self.early
        for name, v in metrics.items():
            if not math.isfinite(v):
                continue
            v = float(v)
            ring = rings.get(name)
            if ring is None:
                ring = rings[name] = _Ring(self.maxlen)
            ring.append(v)
            first = firsts.get(name)
            if first is None:
                first = firsts[name] = []
            if len(first) < early:
                first.append(v)

    def state_dict(self) -> dict:
        # Copies: a state dict must not change when training goes on after it was taken.
        return {"recent": {k: self.values(k) for k in self._rings},
                "first": {k: list(v) for k, v in self.first.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.first = {k: list(v) for k, v in state["first"].items()}
        self._rings = {}
        for k, values in state["recent"].items():
            ring = self._rings[k] = _Ring(self.maxlen)
            for v in values[-self.maxlen:]:
                ring.append(v)


_EMPTY = np.zeros(0)
_EMPTY.flags.writeable = False


class _Ring:
    """Fixed-size history of one metric in a doubled buffer: every value is written at ``i`` and ``i + size``, so
    the last ``n`` values are always one contiguous slice (rules read windows without building lists)."""

    __slots__ = ("buf", "size", "i", "n")

    def __init__(self, size: int):
        self.buf, self.size, self.i, self.n = np.empty(2 * size), size, 0, 0

    def append(self, v: float) -> None:
        i, size = self.i, self.size
        self.buf[i] = self.buf[i + size] = v
        self.i = i + 1 if i + 1 < size else 0
        if self.n < size:
            self.n += 1

    def last(self, n: int) -> np.ndarray:
        n = min(n, self.n)
        view = self.buf[self.i + self.size - n : self.i + self.size]
        view.flags.writeable = False
        return view
