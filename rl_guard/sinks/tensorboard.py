"""TensorBoard sink: scalars under their `rl_guard/...` names, histograms from precomputed bins.

Histograms arrive as (edges[K+1], counts[K]) and are written with `add_histogram_raw`, so no
second pass over per-token tensors is needed. TensorBoard buckets are described by their
right edges; we prepend an empty bucket ending at edges[0] so the left edge is kept too.
`sum`/`sum_squares` are approximated from bucket centres (the raw values are not available).
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import numpy as np

from .base import Histograms, Sink

TB_SUBDIR = "tensorboard"


def histogram_raw_args(edges: np.ndarray, counts: np.ndarray) -> dict:
    """Keyword arguments for `SummaryWriter.add_histogram_raw` from numpy-style bins."""
    edges = np.asarray(edges, dtype=np.float64).reshape(-1)
    counts = np.asarray(counts, dtype=np.float64).reshape(-1)
    if edges.size != counts.size + 1:
        raise ValueError(f"histogram needs len(edges) == len(counts) + 1, got {edges.size}, {counts.size}")
    centres = 0.5 * (edges[:-1] + edges[1:])
    nonzero = np.flatnonzero(counts)
    if nonzero.size:  # min/max: tightest edges that still enclose every counted value
        lo, hi = float(edges[nonzero[0]]), float(edges[nonzero[-1] + 1])
    else:
        lo, hi = float(edges[0]), float(edges[-1])
    return dict(
        min=lo,
        max=hi,
        num=float(counts.sum()),
        sum=float((centres * counts).sum()),
        sum_squares=float((centres * centres * counts).sum()),
        bucket_limits=[float(edges[0])] + edges[1:].tolist(),
        bucket_counts=[0.0] + counts.tolist(),
    )


class TensorBoardSink(Sink):
    """Writes scalars, histograms and incident texts to TensorBoard event files.

    Options: `log_dir` (default `run_dir/tensorboard`; a relative path is taken relative to
    `run_dir`), `flush_secs` (background flush period), `histograms` (set False to skip them).
    """

    name = "tensorboard"

    def __init__(
        self, log_dir: str | pathlib.Path | None = None, flush_secs: int = 30, histograms: bool = True
    ) -> None:
        super().__init__()
        self.log_dir = log_dir
        self.flush_secs = flush_secs
        self.histograms = histograms
        self.writer: Any = None  # torch.utils.tensorboard.SummaryWriter, made in start()

    def resolved_log_dir(self) -> pathlib.Path:
        path = pathlib.Path(self.log_dir) if self.log_dir is not None else None
        if path is not None and path.is_absolute():
            return path
        if self.run_dir is None:
            raise RuntimeError("the tensorboard sink resolves a relative log_dir after start()")
        return self.run_dir / (TB_SUBDIR if path is None else path)

    def start(self, run_dir: pathlib.Path, resume_step: int | None = None) -> None:
        super().start(run_dir, resume_step)
        from torch.utils.tensorboard import SummaryWriter  # lazy: optional backend

        # purge_step makes TensorBoard hide events at steps > resume_step left by the lost run.
        purge = None if resume_step is None else int(resume_step) + 1
        self.writer = SummaryWriter(log_dir=str(self.resolved_log_dir()), purge_step=purge, flush_secs=self.flush_secs)

    def log(self, values: dict[str, float], step: int, histograms: Histograms | None = None) -> None:
        step = int(step)
        for name, value in values.items():
            if name == "step":
                continue
            try:
                value = float(value)
            except (TypeError, ValueError):
                continue  # non-numeric entries have no scalar plot
            self.writer.add_scalar(name, value, step)
        if self.histograms and histograms:
            for name, (edges, counts) in histograms.items():
                self.writer.add_histogram_raw(name, global_step=step, **histogram_raw_args(edges, counts))

    def incident(self, record: dict) -> None:
        step = record.get("step")
        step = int(step) if isinstance(step, (int, float)) and math.isfinite(step) else None
        self.writer.add_text("rl_guard/incidents", str(record.get("message", record)), step)
        self.writer.flush()  # incidents are rare and usually precede a halt

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
