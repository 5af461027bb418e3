"""Zero-dependency default sink: `metrics.jsonl` and `incidents.jsonl` in the run dir.

Format: one JSON object per line, append-only. Metrics lines are `{"step": s, name: value...}`.
Non-finite floats are written as the JSON strings "nan", "inf" and "-inf" (plain JSON has
no NaN/Infinity); `read_jsonl` turns exactly those strings back into floats.
Metrics lines are buffered in the process and written every `flush_every` steps (default 10), at once
on a step that fired a rule (`rl_guard/guard/fired` > 0) or recorded an incident (the lines before it
and the line after it), on `finish()`, when the sink is dropped and at interpreter exit, so the step
itself pays for encoding one line, not for a system call. A crash of the process (even SIGKILL) loses at
most the last `flush_every - 1` steps' lines; the files are readable at any time, a partial last line
from a crash mid-write included. Incidents are written and flushed at once.
`flush_every=1` writes every line as it comes; `fsync=True` additionally forces every write to disk (a disk
round trip per write).
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import pathlib
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

from .base import Histograms, Sink, whole_steps

METRICS_FILE = "metrics.jsonl"
INCIDENTS_FILE = "incidents.jsonl"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _encode_float(x: float) -> float | str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def to_jsonable(obj: Any) -> Any:
    """Recursively convert numpy/torch scalars and arrays to builtins, non-finite floats to strings."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, (float, np.floating)):
        return _encode_float(float(obj))
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, pathlib.PurePath):
        return str(obj)
    # np.bool_, 0-d tensors: records hold host values (metrics come from the step's one transfer), so no sync
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return to_jsonable(obj.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(obj)  # never fail a training step over an odd type in a record


def _metric_value(v: Any) -> Any:
    if type(v) is float:  # the common case, without the generic conversion
        return v if math.isfinite(v) else _encode_float(v)
    return to_jsonable(v)


_ENCODE = json.JSONEncoder(allow_nan=False, ensure_ascii=False).encode  # what ``json.dumps`` builds per call


def metrics_line(values: dict[str, Any], step: int) -> str:
    """The metrics line ``{"step": step, name: value...}\\n`` of one step (a ``step`` entry in ``values`` is
    ignored)."""
    if "step" not in values:
        try:  # the common case, plain finite floats: encoded as they are, without a converted copy
            return _ENCODE({"step": step, **values}) + "\n"
        except (ValueError, TypeError):  # a non-finite float or a non-JSON type: converted below
            pass
    record = {"step": step}
    record.update((str(k), _metric_value(v)) for k, v in values.items() if k != "step")
    return _ENCODE(record) + "\n"


def dumps(obj: Any) -> str:
    """One JSON line (no trailing newline); strictly valid JSON."""
    return json.dumps(to_jsonable(obj), allow_nan=False, ensure_ascii=False)


def _decode(obj: Any) -> Any:
    if isinstance(obj, str):
        return _NONFINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a jsonl file written by this sink; "nan"/"inf"/"-inf" strings become floats.

    A truncated last line (crash mid-write) is ignored.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # partial line from a crash
            if line.strip():
                out.append(_decode(json.loads(line)))
    return out


def _repair(path: pathlib.Path, max_step: int | None) -> set[int]:
    """Drop a partial last line and (if `max_step` given) lines with step > max_step.

    Streams through a temp file + atomic rename, so a crash here never loses the file.
    Returns the steps kept (empty set if nothing had to be scanned).
    """
    if not path.exists() or path.stat().st_size == 0:
        return set()
    if max_step is None:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) == b"\n":
                return set()  # complete file, nothing to filter
    tmp = path.with_name(path.name + ".tmp")
    steps, dropped = set(), 0
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for line in src:
            if not line.endswith(b"\n"):
                dropped += 1  # partial line from a crash mid-write
                continue
            try:
                step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                step = None  # not ours to judge: keep unparsable complete lines
            if max_step is not None and isinstance(step, int) and step > max_step:
                dropped += 1
                continue
            dst.write(line)
            if isinstance(step, int):
                steps.add(step)
        dst.flush()
        os.fsync(dst.fileno())
    if dropped:
        os.replace(tmp, path)
    else:
        tmp.unlink()
    return steps


def _flush_if_alive(ref: weakref.ref) -> None:
    sink = ref()
    if sink is not None:
        sink.flush()


class JsonlSink(Sink):
    """Append-only jsonl writer; resume-safe (no duplicated steps); metrics buffered for ``flush_every`` steps."""

    name = "jsonl"

    def __init__(self, fsync: bool = False, keep_lost_incidents: bool = True, flush_every: int = 10) -> None:
        super().__init__()
        self.flush_every = whole_steps("flush_every", flush_every)
        self.fsync = fsync
        # Incidents after the resume step are kept by default: they are the audit trail
        # of why the lost run was rolled back, not data that gets recomputed.
        self.keep_lost_incidents = keep_lost_incidents
        self._metrics: TextIO | None = None
        self._incidents: TextIO | None = None
        self._atexit: Callable[[], None] | None = None
        self._steps: set[int] = set()
        self._pending: list[str] = []
        self._flush_next = False  # an incident was recorded: its step's line is written at once too

    def start(self, run_dir: pathlib.Path, resume_step: int | None = None) -> None:
        super().start(run_dir, resume_step)
        run_dir = pathlib.Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        mpath, ipath = run_dir / METRICS_FILE, run_dir / INCIDENTS_FILE
        steps = _repair(mpath, resume_step)
        _repair(ipath, None if self.keep_lost_incidents else resume_step)
        if resume_step is not None:
            self._steps = steps
        elif mpath.exists() and mpath.stat().st_size > 0:
            # A fresh (non-resumed) run in a used dir: append rather than destroy or skip data.
            warnings.warn(
                f"rl_guard: {mpath} already has data and no resume_step was "
                "given; appending (pass resume_step to de-duplicate)",
                RuntimeWarning,
                stacklevel=2,
            )
        self._metrics = open(mpath, "a", encoding="utf-8")  # noqa: SIM115 - open until finish()
        self._incidents = open(ipath, "a", encoding="utf-8")  # noqa: SIM115
        # A run that ends without finish() (a script that returns, an exception) still writes what it buffered.
        self._atexit = functools.partial(_flush_if_alive, weakref.ref(self))
        atexit.register(self._atexit)

    def _write(self, f, text: str) -> None:
        f.write(text)
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())

    def flush(self) -> None:
        """Write the buffered metrics lines now."""
        if self._pending and self._metrics is not None and not self._metrics.closed:
            lines, self._pending = "".join(self._pending), []
            self._write(self._metrics, lines)

    def log(self, values: dict[str, float], step: int, histograms: Histograms | None = None) -> None:
        step = int(step)
        if step in self._steps:
            return  # already recorded (resumed run replaying a step)
        # Histograms are not stored here: the tensorboard/wandb sinks handle them.
        self._pending.append(metrics_line(values, step))
        self._steps.add(step)
        if len(self._pending) >= self.flush_every or self._flush_next or values.get("rl_guard/guard/fired", 0) > 0:
            self._flush_next = False
            self.flush()

    def incident(self, record: dict) -> None:
        self.flush()  # the steps before an incident are the ones worth reading after a crash
        self._write(self._incidents, dumps(record) + "\n")
        self._flush_next = True

    def finish(self) -> None:
        self.flush()
        for f in (self._metrics, self._incidents):
            if f is not None and not f.closed:
                f.close()
        self._metrics = self._incidents = None
        callback = getattr(self, "_atexit", None)  # getattr: __del__ after a failed __init__
        if callback is not None:
            atexit.unregister(callback)
            self._atexit = None

    def __del__(self) -> None:
        # A sink dropped without finish() (a guard that is never closed) writes what it buffered and closes its files.
        try:
            self.finish()
        except Exception:  # noqa: BLE001 - a finalizer has no one to report to
            pass
