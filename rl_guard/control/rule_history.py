"""The run's own past values of the watched metrics, which spike rules and incident windows read."""

from __future__ import annotations

import bisect
import math

import numpy as np


class History:
    """Past finite values per metric (most recent last) and the first values seen (for ``early_max``)."""

    def __init__(self, maxlen: int = 1024, early: int = 1024):
        self.maxlen, self.early = maxlen, early
        self.first: dict[str, list] = {}
        self._rings: dict[str, _Ring] = {}  # the last ``maxlen`` values of each metric
        # metric -> {n: the last n values, sorted}: kept up to date on every push for the windows read so far
        self._sorted: dict[str, dict[int, list[float]]] = {}

    def values(self, metric: str) -> list[float]:
        return self.recent(metric, self.maxlen)

    def recent(self, metric: str, n: int) -> list[float]:
        """The last ``n`` values (fewer if fewer are known), oldest first, as a new list of Python floats: the
        spike statistics run on these every step, where numpy's per-call cost outweighs its speed on a window of
        a few dozen values."""
        ring = self._rings.get(metric)
        return ring.last(n) if ring is not None else []

    def sorted_recent(self, metric: str, n: int) -> list[float]:
        """``sorted(recent(metric, n))``, kept up to date as values are pushed (one insertion and one removal per
        push) rather than sorted again at every read: the robust spike windows read it every step. The caller
        must not change it."""
        n = min(n, self.maxlen)
        windows = self._sorted.get(metric)
        if windows is None:
            windows = self._sorted[metric] = {}
        window = windows.get(n)
        if window is None:
            window = windows[n] = sorted(self.recent(metric, n))
        return window

    def last(self, metric: str, n: int) -> np.ndarray:
        """``recent`` as a read-only float64 array."""
        out = np.array(self.recent(metric, n), dtype=np.float64)
        out.flags.writeable = False
        return out

    def push(self, metrics: dict[str, float]) -> None:
        rings, firsts, early = self._rings, self.first, self.early
        for name, v in metrics.items():
            if not math.isfinite(v):
                continue
            v = float(v)
            ring = rings.get(name)
            if ring is None:
                ring = rings[name] = _Ring(self.maxlen)
            windows = self._sorted.get(name)
            if windows:
                _slide(windows, ring.values, v)
            ring.append(v)
            first = firsts.get(name)
            if first is None:
                first = firsts[name] = []
            if len(first) < early:
                first.append(v)

    def state_dict(self) -> dict:
        # Copies: a state dict must not change when training goes on after it was taken.
        return {
            "recent": {k: self.values(k) for k in self._rings},
            "first": {k: list(v) for k, v in self.first.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.first = {k: list(v) for k, v in state["first"].items()}
        self._rings, self._sorted = {}, {}
        for k, values in state["recent"].items():
            ring = self._rings[k] = _Ring(self.maxlen)
            for v in values[-self.maxlen :]:
                ring.append(float(v))


def _slide(windows: dict[int, list[float]], values: list[float], v: float) -> None:
    """Each sorted window of the last n of ``values`` (before ``v`` is appended) takes in ``v`` and, once full,
    lets go of the value that leaves it (the values are finite, so equal values compare equal)."""
    for n, window in windows.items():
        if len(window) >= n:
            del window[bisect.bisect_left(window, values[-n])]
        bisect.insort(window, v)


class _Ring:
    """The last ``size`` values of one metric: a list trimmed by ``size`` values once it holds ``2 size``, so an
    append is amortised O(1) and the last ``n`` values are one slice."""

    __slots__ = ("values", "size")

    def __init__(self, size: int):
        self.values: list[float] = []
        self.size = size

    def append(self, v: float) -> None:
        values = self.values
        values.append(v)
        if len(values) >= 2 * self.size:
            del values[: len(values) - self.size]

    def last(self, n: int) -> list[float]:
        n = min(n, self.size, len(self.values))
        return self.values[len(self.values) - n :] if n > 0 else []
