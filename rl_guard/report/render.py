"""`render_report`: PNG plots and a Markdown incident summary for one run directory.

Figures are built on ``matplotlib.figure.Figure`` with an explicit Agg canvas, so rendering never switches the
global pyplot backend of the calling process (a notebook keeps its inline backend) and no figure is leaked into
pyplot's registry. Every figure has the same x range (all steps and incident steps), so panels line up.
"""

from __future__ import annotations

import math
import pathlib

from . import panels, style
from .data import RunData, load_run
from .summary import write_markdown

EXTRA_HINT = "pip install 'rl-guard[report]'"

# figure name -> panels stacked in it (each drawn only when its metrics exist).
FIGURES: dict[str, tuple[str, ...]] = {
    "ratio": ("ratio", "seq_ratio", "importance_weight", "behave_imp_weight"),
    "entropy": ("entropy",),
    "kl": ("kl_old", "kl_ref"),
    "clip": ("clip",),
    "grad": ("grad",),
    "optim": ("lr", "update"),
    "lag": ("lag",),
    "rollout": ("reward", "length", "truncated"),
}
# Panels constant by design in a run (panels.BY_DESIGN) are left out of the overview; their own figure shows them
# labelled "constant by design in this run (value X)", and report.md says which.
OVERVIEW = ("ratio", "entropy", "kl_old", "kl_ref", "clip", "grad", "lr", "update", "reward", "truncated", "lag")
FIGURE_TITLES = {
    "ratio": "Importance ratios: bands p01-p99 / p25-p75, line p50, dots max/min",
    "entropy": "Token entropy: bands p01-p99 / p25-p75, line p50, dots max/min",
    "kl": "KL divergence (k3 estimator)",
    "clip": "PPO clipping",
    "grad": "Gradient norm",
    "optim": "Learning rate and update size",
    "lag": "Policy lag of training tokens",
    "rollout": "Rollouts: reward, length, truncation",
    "overview": "Overview",
}


class ReportDependencyError(ImportError):
    """The optional plotting dependency is missing; the message says which extra installs it."""


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # optional extra: the guard itself never needs it
        raise ReportDependencyError(
            f"`rl-guard report` needs matplotlib, which is the optional extra rl-guard[report]: {EXTRA_HINT}"
        ) from e
    return Figure, FigureCanvasAgg


# Fixed geometry in inches (a computed layout engine costs more than all the drawing; these margins fit the
# longest tick/legend labels the panels produce): y labels on the left, each panel's legend on its right.
LEFT, LEGEND, TOP, BOTTOM, AXES_H, GAP = 0.85, 2.05, 0.55, 0.6, 2.55, 0.5  # BOTTOM: + figure legend rows


def _x_range(run: RunData) -> tuple[float, float]:
    xs = [int(s) for s in run.steps] + run.incident_steps()
    lo, hi = (min(xs), max(xs)) if xs else (0, 1)
    pad = max(1.0, 0.02 * (hi - lo))
    return lo - pad, hi + pad


def _build(
    Figure,
    FigureCanvasAgg,
    run: RunData,
    names,
    title: str,
    ncols: int = 1,
    width: float = 11.0,
    left_out: tuple[str, ...] = (),
):
    names = [n for n in names if panels.available(n, run) and n not in left_out]
    if not names:
        return None
    ncols = min(ncols, len(names))
    nrows = math.ceil(len(names) / ncols)
    bottom = BOTTOM + 0.25 * style.legend_rows(run, width)
    height = TOP + bottom + nrows * AXES_H + (nrows - 1) * GAP
    axes_w = (width - LEFT - ncols * LEGEND - (ncols - 1) * LEFT) / ncols
    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    grid = dict(
        left=LEFT / width,
        right=1 - LEGEND / width,
        top=1 - TOP / height,
        bottom=bottom / height,
        wspace=(LEGEND + LEFT) / axes_w,
        hspace=GAP / AXES_H,
    )
    axes = fig.subplots(nrows, ncols, squeeze=False, gridspec_kw=grid).ravel()
    xlim = _x_range(run)
    drawn = []
    for ax, name in zip(axes, names):
        # The same x range in every panel, so steps line up (cheaper than sharex); set before the incident labels.
        if panels.draw_panel(ax, name, run, xlim, compact=ncols > 1):
            drawn.append(ax)
        else:
            ax.set_visible(False)
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    for ax in drawn:
        # Step numbers only under the lowest panel of each column; the others line up with it.
        ss = ax.get_subplotspec()
        below = [
            a
            for a in drawn
            if a.get_subplotspec().colspan == ss.colspan and a.get_subplotspec().rowspan.start > ss.rowspan.start
        ]
        if below:
            ax.tick_params(labelbottom=False)
        else:
            ax.set_xlabel("step", fontsize=9)
    if left_out:
        title += (
            " (left out, constant by design: "
            + ", ".join(f"{n} = {panels.constant_value(n, run):g}" for n in left_out)
            + ")"
        )
    fig.suptitle(
        f"{title} - {run.run_dir.name or run.run_dir}", fontsize=12, x=0.01, y=1 - 0.08 / height, ha="left", va="top"
    )
    style.action_legend(fig, run)
    if any(getattr(ax, "rl_guard_hidden_labels", 0) for ax in drawn):
        fig.text(
            0.995,
            0.005,
            "some incident labels had no room in a panel; report.md lists every incident",
            ha="right",
            va="bottom",
            fontsize=7,
            color="#555555",
            gid="incident_labels_hidden",
        )
    return fig


def render_report(run_dir, out_dir=None, *, keep_figures: bool = False, dpi: int = 110) -> dict:
    """Write PNG plots and ``report.md`` for `run_dir` (default output: ``run_dir/report/``).

    Returns ``{"run_dir", "out_dir", "plots": {name: path}, "skipped": [figure names without data],
    "panels": {panel: (status, value)} (``panels.status``), "markdown": path, "steps": n_steps,
    "incidents": n_incidents}``, plus ``"figures": {name: Figure}`` when
    `keep_figures` (for inspection/tests; the figures are otherwise released after saving).
    Raises ``ReportDependencyError`` (an ImportError) naming the ``rl-guard[report]`` extra if matplotlib is
    missing, ``FileNotFoundError`` if `run_dir` holds neither metrics.jsonl nor incidents.jsonl.
    """
    Figure, FigureCanvasAgg = _matplotlib()
    run = load_run(run_dir)
    out = pathlib.Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots: dict[str, str] = {}
    figures = {}
    skipped = []
    status = {name: panels.status(name, run) for name in panels.PANELS}
    flat = tuple(n for n in OVERVIEW if status[n][0] == "constant by design")
    specs: list[tuple[str, tuple[str, ...], str, int, float, tuple[str, ...]]] = [
        (name, FIGURES[name], FIGURE_TITLES[name], 1, 11.0, ()) for name in FIGURES
    ]
    specs.append(("overview", OVERVIEW, FIGURE_TITLES["overview"], 2, 16.0, flat))
    for name, panel_names, title, ncols, width, left_out in specs:
        path = out / f"{name}.png"
        fig = _build(Figure, FigureCanvasAgg, run, panel_names, title, ncols, width, left_out)
        if fig is None:
            skipped.append(name)
            path.unlink(missing_ok=True)  # a stale plot from an earlier report would contradict report.md
            continue
        fig.savefig(path, dpi=dpi)
        plots[name] = str(path)
        if keep_figures:
            figures[name] = fig
    md = write_markdown(run, out / "report.md", plots, status)
    result = {
        "run_dir": str(run.run_dir),
        "out_dir": str(out),
        "plots": plots,
        "skipped": skipped,
        "panels": status,
        "markdown": str(md),
        "steps": int(len(run.steps)),
        "incidents": len(run.incidents),
    }
    if keep_figures:
        result["figures"] = figures
    return result
