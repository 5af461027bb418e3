"""Sample audit files: the few samples worth reading, kept next to the metrics.

Each update appends its lines to ``run_dir/audit/steps_<first>.jsonl`` (one JSON object per line, each with its
``step``; a file holds ``updates_per_file`` consecutive updates and is named by its first step): the ``k``
highest-reward and ``k`` lowest-reward valid samples, ``k`` random others (drawn from a private numpy
Generator so the global RNGs are untouched), and when an outcome is given the two quadrant cells worth reading:
one ``quadrant_cell`` line per cell with its count and sample ids (at most ``MAX_CELL_IDS``), then up to ``k``
samples of it (hacking: highest reward first; false_negative: lowest reward first).

Bounded: texts, prompts and ids are cut to ``max_chars`` characters (``text_chars`` keeps the full length) and at
most ``max_files`` files are kept, the oldest steps deleted first (files of an earlier run in the same directory
count).

Cost: an update's lines are queued and written ``flush_every`` updates at a time (default 10), at once when a
rule fires (``RunDiagnostics.flush``, called by the guard before it acts), before the diagnostics' state is saved,
on ``close`` and at interpreter exit; each write is flushed. A crash of the process (even SIGKILL) loses at most
the last ``flush_every - 1`` updates' lines. Choosing and encoding the samples costs a generation step more than
all the other diagnostics together when its caches are cold (~0.17 ms of ~0.75 ms inside a trainer's step); ten
updates in one go pay that once. The samples are drawn at the flush, in update order, from the same generator, so
the files are the ones an immediate write gives. The file stays open: opening (and atomically renaming) a file
per update cost ~0.5 ms. A resumed run that goes back to an earlier step starts a new file, so each file's steps
increase; the abandoned run's lines for the same steps stay in the older file.
"""

from __future__ import annotations

import atexit
import json
import math
import re
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import numpy as np

from .samples import Prepared, json_value

MAX_CELL_IDS = 256
_FILE = re.compile(r"steps_(\d+)\.jsonl\Z")
_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False)  # json.dumps with these options builds one per call


def _cut(x, max_chars: int):
    if x is None:
        return None
    x = json_value(x)
    return x[:max_chars] if isinstance(x, str) else x


class _Columns:
    """The fields a record reads, as Python lists taken once per update (indexing a numpy array element by element
    costs a numpy scalar per read)."""

    __slots__ = ("ids", "group_ids", "rewards", "floats", "termination", "texts")

    def __init__(self, p: Prepared):
        self.ids, self.group_ids, self.termination = p.ids, p.group_ids, p.termination
        self.floats = [
            (name, arr.tolist())
            for name, arr in (("reward", p.rewards), ("outcome", p.outcome), ("length", p.lengths))
            if arr is not None
        ]
        self.rewards = self.floats[0][1] if p.rewards is not None else None  # the list above, not a second copy
        self.texts = [(name, seq) for name, seq in (("prompt", p.prompts), ("text", p.texts)) if seq is not None]


class AuditWriter:
    def __init__(
        self,
        run_dir,
        k: int = 3,
        max_files: int = 10,
        max_chars: int = 2000,
        updates_per_file: int = 20,
        flush_every: int = 10,
    ):
        if k < 0 or max_files < 1 or max_chars < 1 or updates_per_file < 1 or flush_every < 1:
            raise ValueError(
                "audit needs k >= 0, max_files >= 1, max_chars >= 1, updates_per_file >= 1 and flush_every >= 1"
            )
        self.dir = Path(run_dir) / "audit"
        self.k, self.max_files, self.max_chars, self.updates_per_file = k, max_files, max_chars, updates_per_file
        self.flush_every = flush_every
        self._pending: list[tuple[int, Prepared, dict, np.random.Generator]] = []  # queued updates, in order
        self._atexit: Callable[[], object] | None = None
        self._files: dict[int, Path] | None = None  # first step -> file on disk (the directory is listed once)
        self._file: TextIO | None = None  # the open file of the current updates
        self._path: Path | None = None
        self._updates = 0  # updates in the open file
        self._last_step: int | None = None

    def _record(self, c: _Columns, i: int, kind: str, step: int) -> dict:
        rec = {"step": step, "kind": kind, "index": i, "id": _cut(c.ids[i], self.max_chars)}
        if c.group_ids is not None:
            rec["group"] = _cut(c.group_ids[i], self.max_chars)
        for name, values in c.floats:
            x = values[i]
            rec[name] = x if math.isfinite(x) else None
        if c.termination is not None:
            rec["termination"] = c.termination[i]
        for name, seq in c.texts:
            if seq[i] is not None:
                full = str(seq[i])
                rec[name] = full[: self.max_chars]
                rec[f"{name}_chars"] = len(full)
        return rec

    def select(self, p: Prepared, rng: np.random.Generator) -> list[tuple[str, int]]:
        chosen: list[tuple[str, int]] = []
        if p.rewards is not None and p.reward_ok.any():
            valid = np.flatnonzero(p.reward_ok)
            # Ties keep batch order in both lists; a sample is never both top and bottom.
            top = valid[np.argsort(-p.rewards[valid], kind="stable")][: self.k].tolist()
            up = valid[np.argsort(p.rewards[valid], kind="stable")].tolist()
            chosen += [("top", i) for i in top] + [("bottom", i) for i in [i for i in up if i not in top][: self.k]]
        taken = {i for _, i in chosen}
        others = [i for i in range(p.n) if i not in taken]
        if others and self.k:
            # the first k of a random permutation: a uniform draw without replacement (Generator.choice with
            # replace=False costs several times more on a batch this small)
            pick = rng.permutation(len(others))[: self.k].tolist()
            chosen += [("random", others[j]) for j in sorted(pick)]
        return chosen

    def write(self, step: int, p: Prepared, cells: dict[str, list[int]], rng: np.random.Generator) -> None:
        """Queue this update (``p`` and ``cells`` are the update's own: ``Prepared`` copies its inputs); written with
        the ``flush_every``-th queued update or the next ``flush``."""
        self._pending.append((int(step), p, cells, rng))
        if self._atexit is None:  # a run that ends without close() (an exception, a script that returns) still writes
            ref = weakref.ref(self)
            self._atexit = lambda: (lambda writer: writer and writer.flush())(ref())
            atexit.register(self._atexit)
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> Path | None:
        """Write the queued updates now; returns the file of the latest one (None before any)."""
        pending, self._pending = self._pending, []
        for step, p, cells, rng in pending:
            text = self._text(step, p, cells, rng)  # a value JSON cannot hold fails before this update's write
            file = self._file
            if (
                file is None
                or self._updates >= self.updates_per_file
                or (self._last_step is not None and step <= self._last_step)
            ):
                file = self._open(step)
            file.write(text)
            self._updates, self._last_step = self._updates + 1, step
        if pending and self._file is not None:
            self._file.flush()
        return self._path

    def _text(self, step: int, p: Prepared, cells: dict[str, list[int]], rng: np.random.Generator) -> str:
        c = _Columns(p)
        lines = [self._record(c, i, kind, step) for kind, i in self.select(p, rng)]
        for cell, idx in cells.items():
            lines.append(
                {
                    "step": step,
                    "kind": "quadrant_cell",
                    "cell": cell,
                    "count": len(idx),
                    "ids": [_cut(c.ids[i], self.max_chars) for i in idx[:MAX_CELL_IDS]],
                }
            )
            sign = -1.0 if cell == "hacking" else 1.0
            rewards = c.rewards
            assert rewards is not None  # quadrant cells exist only with rewards
            ordered = sorted(idx, key=lambda i: (sign * rewards[i], i))
            lines += [self._record(c, i, cell, step) for i in ordered[: self.k]]
        return "".join(_JSON.encode(rec) + "\n" for rec in lines)

    def _open(self, step: int) -> TextIO:
        """Start the file of the updates from ``step`` on and keep the newest ``max_files``. The directory is
        listed once (files of an earlier run of the same run_dir count); later files are tracked in memory."""
        if self._file is not None:
            self._file.close()
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._files is None:
            self._files = {int(m.group(1)): f for f in self.dir.iterdir() if (m := _FILE.match(f.name))}
        self._path = self.dir / f"steps_{step}.jsonl"
        self._file = file = open(self._path, "w", encoding="utf-8")  # noqa: SIM115 - kept open across updates
        self._updates = 0
        self._files[step] = self._path
        if len(self._files) > self.max_files:
            for old in sorted(self._files)[: len(self._files) - self.max_files]:
                self._files.pop(old).unlink(missing_ok=True)
        return file

    def close(self) -> None:
        """Write what is queued and close the file."""
        if getattr(self, "_pending", None):  # getattr: __del__ after a failed __init__
            self.flush()
        f, self._file = getattr(self, "_file", None), None
        if f is not None:
            f.close()
        callback = getattr(self, "_atexit", None)
        if callback is not None:
            atexit.unregister(callback)
            self._atexit = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer has no one to report to
            pass
