"""Sink interface and the fault-isolating `SinkSet`.

A sink receives one flat metric record per step (`{name: float}` plus the step),
optional histograms (`name -> (edges[K+1], counts[K])`) and incident records.
Backends (wandb, tensorboard, rich) are imported lazily in `start`, so a missing
package only disables that sink.
"""

from __future__ import annotations

import pathlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

Histograms = dict[str, tuple[np.ndarray, np.ndarray]]


class SinkOptionError(ValueError):
    """A sink option whose value the sink cannot use; ``option`` names it, so a config error points at its line."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def whole_steps(option: str, value: Any) -> int:
    """``value`` as a number of steps >= 1 (an int, not a bool), else ``SinkOptionError``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise SinkOptionError(option, f"{option} must be a whole number of steps >= 1, got {value!r}")
    return int(value)


class Sink:
    """Base class: every method is a no-op so subclasses override only what they need."""

    name: str = "sink"
    # Most sinks write shared files / runs, so only global rank 0 should drive them.
    main_process_only: bool = True

    def __init__(self) -> None:
        self.run_dir: pathlib.Path | None = None

    def start(self, run_dir: pathlib.Path, resume_step: int | None = None) -> None:
        """Open files / runs. `resume_step` is the last step kept when resuming."""
        self.run_dir = pathlib.Path(run_dir)

    def log(self, values: dict[str, float], step: int, histograms: Histograms | None = None) -> None:
        """Record one step's metrics (names `rl_guard/<family>/<stat>`)."""

    def incident(self, record: dict) -> None:
        """Record one incident (keys as in the incident record format, incl. `message`)."""

    def finish(self) -> None:
        """Flush and close; must be safe to call once after `start`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class SinkSet:
    """Forwards calls to several sinks; a sink that raises is disabled, never retried.

    Logging must never stop or slow training: on the first exception from a sink
    (missing backend, disk full, network down) we emit exactly one `RuntimeWarning`
    naming the sink and the error, drop the sink for the rest of the run and carry on
    with the others (the jsonl sink in particular keeps recording).
    """

    def __init__(
        self, sinks: Iterable[Sink] = (), is_main_process: bool = True, run_dir: pathlib.Path | str | None = None
    ) -> None:
        self.sinks: list[Sink] = list(sinks)
        self.is_main_process = bool(is_main_process)
        self.run_dir = pathlib.Path(run_dir) if run_dir is not None else None
        self.active: list[Sink] = [s for s in self.sinks if self.is_main_process or not s.main_process_only]
        self.disabled: dict[str, BaseException] = {}

    # -- forwarding ---------------------------------------------------------
    def start(self, run_dir: pathlib.Path | str | None = None, resume_step: int | None = None) -> None:
        """Start every active sink; `run_dir` defaults to the one given at construction."""
        run_dir = run_dir if run_dir is not None else self.run_dir
        if run_dir is None:
            raise ValueError("SinkSet.start needs a run_dir")
        self.run_dir = pathlib.Path(run_dir)
        self._forward("start", self.run_dir, resume_step)

    def add(self, sink: Sink) -> None:
        """Add and start a sink after ``start()`` (e.g. an adapter that finds a wandb run at train begin)."""
        self.sinks.append(sink)
        if self.is_main_process or not sink.main_process_only:
            self.active.append(sink)
            try:
                if self.run_dir is None:
                    raise ValueError("SinkSet.add before start(): no run_dir to start the sink in")
                sink.start(self.run_dir)
            except Exception as err:  # noqa: BLE001
                self._disable(sink, "start", err)

    def log(self, values: dict[str, float], step: int, histograms: Histograms | None = None) -> None:
        self._forward("log", values, step, histograms)

    def incident(self, record: dict) -> None:
        self._forward("incident", record)

    def finish(self) -> None:
        self._forward("finish")

    def _forward(self, method: str, *args: Any) -> None:
        # Iterate over a copy: a failing sink is removed from `active` mid-loop.
        for sink in list(self.active):
            try:
                getattr(sink, method)(*args)
            except Exception as err:  # noqa: BLE001 - isolation is the whole point
                self._disable(sink, method, err)

    def _disable(self, sink: Sink, method: str, err: Exception) -> None:
        if sink in self.active:
            self.active.remove(sink)
        self.disabled[sink.name] = err
        warnings.warn(
            f"rl_guard: sink {sink.name!r} disabled for the rest of the run: "
            f"{method}() raised {type(err).__name__}: {err}",
            RuntimeWarning,
            stacklevel=3,
        )

    # -- conveniences -------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Names of the sinks still active on this process."""
        return [s.name for s in self.active]

    def get(self, name: str) -> Sink | None:
        """The sink called `name` (active or not), or None."""
        return next((s for s in self.sinks if s.name == name), None)

    def __iter__(self) -> Iterator[Sink]:
        return iter(self.active)

    def __len__(self) -> int:
        return len(self.active)

    def __enter__(self) -> SinkSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def __repr__(self) -> str:
        return f"SinkSet(active={self.names}, disabled={sorted(self.disabled)})"
