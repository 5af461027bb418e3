"""Weights & Biases sink.

Logs into the active `wandb.run` (e.g. the one a trainer started); only when configured with
`init={...}` kwargs and no run is active does it start (and later finish) its own run.
Every record carries `rl_guard/step` and the `rl_guard/*` metrics are plotted against it;
wandb's own `_step` is left alone because a trainer (or a resumed run) advances it its own way.
To continue a wandb run after a restart pass e.g. `init={"id": ..., "resume": "allow"}`.
Incidents become `wandb.alert`s (rate-limited per rule, `alert_every_s`) and are also kept in
the run summary (`rl_guard/incidents` table, count, last message) so they survive offline mode,
where alerts are only recorded locally.
"""

from __future__ import annotations

import math
import os
import pathlib
import time
import warnings
from typing import Any

import numpy as np

from .base import Histograms, Sink

STEP_KEY = "rl_guard/step"
INCIDENT_COLUMNS = (
    "step",
    "rule",
    "metric",
    "value",
    "op",
    "threshold",
    "action",
    "severity",
    "rank",
    "time",
    "message",
)
_LEVELS = {"info": "INFO", "warn": "WARN", "warning": "WARN", "error": "ERROR", "critical": "ERROR", "fatal": "ERROR"}


def alert_level(severity: Any) -> str:
    """Map an incident severity to a wandb alert level (unknown -> WARN)."""
    return _LEVELS.get(str(severity).lower(), "WARN")


def _cell(v: Any) -> Any:
    # Table cells must be scalars/strings; keep numbers, stringify the rest (e.g. None, dicts).
    if isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, np.generic):  # a numpy scalar already on the host
        return v.item()
    return "" if v is None else str(v)


class WandbSink(Sink):
    """Options: `init` (kwargs for `wandb.init` when no run is active), `alert_every_s`
    (min seconds between alerts of one rule), `alerts` (False disables `wandb.alert`),
    `histograms` (log given bins as `wandb.Histogram`), `metrics` (False: incidents and alerts only, for a
    trainer that already logs the metrics to the same run)."""

    name = "wandb"

    def __init__(
        self,
        init: dict | None = None,
        alert_every_s: float = 300.0,
        alerts: bool = True,
        histograms: bool = True,
        metrics: bool = True,
    ) -> None:
        super().__init__()
        self.metrics = metrics
        self.init_kwargs = dict(init) if init is not None else None  # {} = start with defaults
        self.alert_every_s = float(alert_every_s)
        self.alerts = alerts
        self.histograms = histograms
        self._wandb: Any = None  # the wandb module, imported in start()
        self._own_run = None
        self._defined_for = None  # run id for which define_metric was done
        self._warned_no_run = False
        self._last_alert: dict[str, float] = {}
        self._incident_rows: list[list] = []

    def start(self, run_dir: pathlib.Path, resume_step: int | None = None) -> None:
        super().start(run_dir, resume_step)
        import wandb  # lazy: optional backend

        self._wandb = wandb
        if wandb.run is None and self.init_kwargs is not None:
            kwargs = dict(self.init_kwargs)
            # Keep wandb files inside the run dir unless the user chose a location.
            if "dir" not in kwargs and not os.environ.get("WANDB_DIR"):
                kwargs["dir"] = str(run_dir)
                pathlib.Path(run_dir).mkdir(parents=True, exist_ok=True)
            self._own_run = wandb.init(**kwargs)

    def _run(self):
        """The run to log to; None (with one warning) while no run is active."""
        run = self._own_run if self._own_run is not None else self._wandb.run
        if run is None:
            if not self._warned_no_run:
                self._warned_no_run = True
                warnings.warn(
                    "rl_guard: no active wandb run and no `init` options; the wandb "
                    "sink drops records until a run starts",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None
        if self._defined_for != run.id:
            run.define_metric(STEP_KEY)
            run.define_metric("rl_guard/*", step_metric=STEP_KEY)
            self._defined_for = run.id
        return run

    def log(self, values: dict[str, float], step: int, histograms: Histograms | None = None) -> None:
        if not self.metrics:
            return
        run = self._run()
        if run is None:
            return
        data = {k: v for k, v in values.items() if k != "step"}
        data[STEP_KEY] = int(step)
        if self.histograms and histograms:
            for name, (edges, counts) in histograms.items():
                data[name] = self._wandb.Histogram(np_histogram=(np.asarray(counts), np.asarray(edges)))
        # No `step=`: wandb drops rows whose step is below its counter (trainer runs, resumed
        # runs, replayed steps); the x axis is `rl_guard/step` via define_metric instead.
        run.log(data)

    def incident(self, record: dict) -> None:
        run = self._run()
        if run is None:
            return
        wandb = self._wandb
        self._incident_rows.append([_cell(record.get(c)) for c in INCIDENT_COLUMNS])
        # Summary (not history) so it never conflicts with the step counter and is visible offline.
        run.summary["rl_guard/incidents"] = wandb.Table(
            columns=list(INCIDENT_COLUMNS), data=[list(r) for r in self._incident_rows]
        )
        run.summary["rl_guard/incident_count"] = len(self._incident_rows)
        run.summary["rl_guard/last_incident"] = str(record.get("message", ""))
        rule = str(record.get("rule", "incident"))
        now = time.monotonic()
        last = self._last_alert.get(rule)
        if self.alerts and (last is None or now - last >= self.alert_every_s):
            self._last_alert[rule] = now
            run.alert(
                title=f"rl_guard: {rule}"[:63],  # wandb limits titles to < 64 chars
                text=str(record.get("message", rule)),
                level=alert_level(record.get("severity")),
                wait_duration=max(1, math.ceil(self.alert_every_s)),
            )

    def finish(self) -> None:
        # Finish only a run we started; a trainer's run belongs to the trainer.
        if self._own_run is not None:
            self._own_run.finish()
            self._own_run = None
