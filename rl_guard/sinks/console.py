"""Console sink: a compact health table every `every` steps (incidents are printed by the guard itself).

Uses `rich` when importable (and `rich=True`), else plain text. Only metrics present in the
record are shown, so the table shrinks to what the trainer actually provides.
"""

from __future__ import annotations

import math
import pathlib
import sys
from typing import IO, Any

from ..control.announce import write_lines
from .base import Histograms, Sink, whole_steps

# (row label, [(column label, metric name), ...]) in display order.
KEY_METRICS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("ratio", (("p50", "rl_guard/ratio/p50"), ("p99", "rl_guard/ratio/p99"), ("max", "rl_guard/ratio/max"))),
    ("kl k3", (("old", "rl_guard/kl_old/k3_mean"), ("ref", "rl_guard/kl_ref/k3_mean"))),
    ("entropy", (("mean", "rl_guard/entropy/mean"),)),
    ("clip", (("region_frac", "rl_guard/clip/region_frac"),)),
    ("grad", (("norm", "rl_guard/grad/norm"),)),
    ("lag", (("max", "rl_guard/lag/max"),)),
    (
        "reward",
        (
            ("mean", "rl_guard/reward/mean"),
            ("std", "rl_guard/reward/std"),
            ("nonfinite", "rl_guard/input/rewards/nonfinite"),
        ),
    ),
    (
        "groups",
        (
            ("mixed", "rl_guard/group/mixed_frac"),
            ("zero_std", "rl_guard/group/zero_std_frac"),
            ("unique", "rl_guard/group/unique_frac"),
        ),
    ),
    (
        "funnel",
        (
            ("sampled", "rl_guard/funnel/sampled/count"),
            ("completed", "rl_guard/funnel/completed/keep_frac"),
            ("truncated", "rl_guard/funnel/truncated/keep_frac"),
        ),
    ),
    ("guard", (("skipped", "rl_guard/guard/skipped_steps"), ("rollbacks", "rl_guard/guard/rollbacks"))),
)


def _fmt(v: Any) -> str:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    return str(x) if not math.isfinite(x) else f"{x:.4g}"


def health_rows(values: dict[str, float]) -> list[tuple[str, str]]:
    """[(label, "p50=1 p99=1.3 ...")] for the key metrics present in `values`."""
    rows = []
    for label, cols in KEY_METRICS:
        parts = [f"{col}={_fmt(values[name])}" for col, name in cols if name in values]
        if parts:
            rows.append((label, "  ".join(parts)))
    return rows


class ConsoleSink(Sink):
    """Options: `every` (print the table when step % every == 0), `rich` (False forces plain
    text), `file` (stream; default the current `sys.stdout`)."""

    name = "console"

    def __init__(self, every: int = 10, rich: bool = True, file: IO[str] | None = None) -> None:
        super().__init__()
        self.every = whole_steps("every", every)
        self.use_rich = rich
        self.file = file
        self._console = None

    def _out(self) -> IO[str]:
        # Resolved at write time so redirected/captured stdout is honoured.
        return self.file if self.file is not None else sys.stdout

    def start(self, run_dir: pathlib.Path, resume_step: int | None = None) -> None:
        super().start(run_dir, resume_step)
        if self.use_rich:
            try:
                from rich.console import Console  # lazy: optional backend
            except ImportError:
                self.use_rich = False
            else:
                self._console = Console(file=self.file, highlight=False)

    def log(self, values: dict[str, float], step: int, histograms: Histograms | None = None) -> None:
        if int(step) % self.every:
            return
        rows = health_rows(values)
        if not rows:
            return
        title = f"rl_guard step {int(step)}"
        if self._console is not None:
            from rich.table import Table

            table = Table(title=title, show_header=False, box=None, title_justify="left")
            table.add_column(style="bold")
            table.add_column()
            for label, text in rows:
                table.add_row(label, text)
            with self._console.capture() as captured:
                self._console.print(table)
            text = captured.get().rstrip("\n")
        else:
            width = max(len(label) for label, _ in rows)
            text = "\n".join([title] + [f"  {label:<{width}}  {text}" for label, text in rows])
        write_lines(text, self._out())  # whole lines, never glued to a trainer's progress bar

    def incident(self, record: dict) -> None:
        """Nothing: the guard itself prints every action (and each warning's first firing) on the console, whatever
        the sinks (``rl_guard/control/announce.py``); a second copy here would only repeat it."""

    def finish(self) -> None:
        if self._console is not None:
            self._console.file.flush()
