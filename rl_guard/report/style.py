"""Drawing primitives shared by every panel: lines with non-finite markers, quantile bands, incident markers.

Artists that tests (and people poking at figures) care about carry a ``gid``: ``incident:<action>`` for the
vertical rule markers (a LineCollection per action), ``nonfinite`` for the red crosses, ``band:<lo>-<hi>`` for
quantile bands.
matplotlib is only touched through the axes passed in, or imported inside functions (optional extra).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .data import RunData

# Mild -> severe; the same order as the controller's precedence, so severe markers are drawn on top.
ACTION_ORDER = ("warn", "skip_step", "early_stop", "checkpoint_and_halt", "rollback")
ACTION_COLORS = {
    "warn": "#e0a800",  # amber: look, nothing was changed
    "skip_step": "#17a589",  # teal: one update dropped
    "early_stop": "#d2691e",  # orange-brown: run ended cleanly
    "checkpoint_and_halt": "#000000",  # black: run ended, state saved
    "rollback": "#8e44ad",  # purple: weights restored
}
OTHER_COLOR = "#7f7f7f"  # an action name this version does not know
NONFINITE_COLOR = "#e41a1c"  # red crosses: kept distinct from every action colour
BAND_COLOR = "#3b6ea8"


def action_rank(action: str) -> int:
    return ACTION_ORDER.index(action) if action in ACTION_ORDER else -1


def action_color(action: str) -> str:
    return ACTION_COLORS.get(action, OTHER_COLOR)


DENSE = 100  # more marked steps than this for one action: full-height lines would paint the panel over


def mark_incidents(ax, run: RunData) -> None:
    """Vertical lines at the steps where rules fired, one collection per action (cheap to draw even with a
    warning on every step). Warnings are thin and dotted: they are often frequent and must not hide the data;
    actions that changed the run are solid and drawn on top; replayed incidents (``rl-guard replay``: nothing
    happened live) are dashed, gid ``incident:<action>:replayed``. An action with more than DENSE marked steps is
    drawn as a rug of short ticks along the top edge instead, so the data under it stays visible."""
    steps_of: dict[tuple[str, bool], set[int]] = defaultdict(set)
    for rec in run.incidents:
        if isinstance(rec.get("step"), (int, float)) and np.isfinite(rec["step"]):
            steps_of[(str(rec.get("action")), bool(rec.get("replayed")))].add(int(rec["step"]))
    for action, replayed in sorted(steps_of, key=lambda k: (action_rank(k[0]), k[1])):
        steps = sorted(steps_of[(action, replayed)])
        mild, dense = action == "warn", len(steps) > DENSE
        style = "--" if replayed and not dense else ("-" if dense or not mild else ":")
        # y in axes coordinates: full height whatever the scale, and the y autoscaling is left alone.
        ax.vlines(
            steps,
            0.96 if dense else 0.0,
            1.0,
            transform=ax.get_xaxis_transform(),
            colors=action_color(action),
            linewidths=1.0 if mild else 1.8,
            linestyles=style,
            alpha=0.6 if mild else 0.9,
            zorder=1.5 + action_rank(action) * 0.1,
            gid=f"incident:{action}" + (":replayed" if replayed else ""),
        )


def mark_nonfinite(ax, steps: np.ndarray, values: np.ndarray) -> int:
    """Red crosses at the top edge for NaN/+inf (bottom edge for -inf); returns how many were drawn."""
    bad = ~np.isfinite(values)
    if not bad.any():
        return 0
    labelled = any(line.get_gid() == "nonfinite" for line in ax.lines)
    ys = np.where(np.isneginf(values[bad]), 0.0, 1.0)
    # x in data coordinates, y in axes coordinates: the marker sits on the edge whatever the y range is.
    ax.plot(
        steps[bad],
        ys,
        ls="none",
        marker="x",
        ms=9,
        mew=2.2,
        color=NONFINITE_COLOR,
        clip_on=False,
        transform=ax.get_xaxis_transform(),
        zorder=6,
        gid="nonfinite",
        label=None if labelled else "non-finite",
    )
    return int(bad.sum())


def line(ax, run: RunData, name: str, floor: float | None = None, **kw) -> bool:
    """Plot a metric where it was reported, plus its non-finite markers.

    Steps without a record are bridged (metrics logged every k-th step, e.g. rewards once per generation round,
    still read as a curve); a non-finite value breaks the line and becomes a red cross instead. With `floor`
    (log axes), finite values below it are drawn on it, so zeros touch the bottom edge instead of vanishing.
    """
    s = run.get(name)
    if not len(s):
        return False
    if len(s) <= 60 and "marker" not in kw and kw.get("ls", kw.get("linestyle")) != "none":
        kw.setdefault("marker", "o")
        kw.setdefault("ms", 2.5)
    y = np.where(s.finite, s.values, np.nan)
    if floor is not None:
        y = np.where(s.finite, np.maximum(y, floor), np.nan)
    ax.plot(s.steps, y, **kw)
    mark_nonfinite(ax, s.steps, s.values)
    return True


def aligned(run: RunData, *names: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """Steps where all `names` were reported, and their columns there (for bands between two metrics)."""
    mask = np.ones(len(run.steps), dtype=bool)
    for n in names:
        mask &= run.present(n)
    return run.steps[mask], [run.column(n)[mask] for n in names]


def dot_size(run: RunData) -> float:
    """Marker size for per-step dots: small once there are too many steps to tell dots apart."""
    return 3.5 if len(run.steps) <= 300 else 1.2


def _pair(run: RunData, family: str, pairs) -> tuple[str, str] | None:
    for lo, hi in pairs:
        if run.has(f"{family}/{lo}") and run.has(f"{family}/{hi}"):
            return lo, hi
    return None


def quantile_bands(ax, run: RunData, family: str, color: str = BAND_COLOR, label: str = "") -> bool:
    """Outer band p01-p99 (p05-p95 if that is all there is), inner band p25-p75, p50 line, max as dots."""
    drawn = False
    for pairs, alpha in ((((("p01", "p99"), ("p05", "p95"))), 0.18), ((("p25", "p75"),), 0.40)):
        pair = _pair(run, family, pairs)
        if pair is None:
            continue
        x, (lo, hi) = aligned(run, f"{family}/{pair[0]}", f"{family}/{pair[1]}")
        ok = np.isfinite(lo) & np.isfinite(hi)
        if ok.sum() == 1:  # a single step has no area: show it as an error bar instead
            i = int(np.nonzero(ok)[0][0])
            ax.vlines(x[i], lo[i], hi[i], color=color, alpha=min(1.0, alpha * 2.5), lw=6)
        ax.fill_between(
            x,
            np.where(ok, lo, np.nan),
            np.where(ok, hi, np.nan),
            where=ok,
            color=color,
            alpha=alpha,
            lw=0,
            label=f"{label}{pair[0]}-{pair[1]}",
            gid=f"band:{pair[0]}-{pair[1]}",
        )
        for q in pair:
            s = run.get(f"{family}/{q}")
            mark_nonfinite(ax, s.steps, s.values)
        drawn = True
    drawn |= line(ax, run, f"{family}/p50", color=color, lw=1.8, label=f"{label}p50")
    drawn |= line(
        ax, run, f"{family}/max", color=color, ls="none", marker="o", ms=dot_size(run), alpha=0.9, label=f"{label}max"
    )
    return drawn


def log_floor(*arrays: np.ndarray, span: float = 30.0, floor: float = 1e-6) -> float | None:
    """Bottom of a log y axis for these values, or None when a linear axis reads better.

    Log is chosen when the positive values span more than `span`x. Values below ``floor * max`` (exact zeros,
    1e-16 round-off of a policy that did not move) must not stretch the axis over a dozen empty decades: the axis
    starts just under the smallest value above that floor, and smaller ones are drawn on its bottom edge.
    """
    vals = np.concatenate([a[np.isfinite(a) & (a > 0)] for a in arrays] or [np.zeros(0)])
    if not len(vals):
        return None
    top = float(vals.max())
    low = float(vals[vals >= top * floor].min())
    return low / 1.5 if top / low > span else None


def set_log_y(ax, bottom: float | None = None) -> None:
    ax.set_yscale("log", nonpositive="clip")
    if bottom is not None:
        ax.set_ylim(bottom=bottom)
    readable_log_ticks(ax)


def readable_log_ticks(ax) -> None:
    """Plain numbers ("0.5", "2", "0.001") on log axes instead of 5e-01 or 2x10^0.

    Extra minor ticks at 1.2 and 1.5 per decade, so a narrow ratio range (0.6 to 1.6) still gets labels above 1.
    Minor labels are shown only when the axis spans few decades (otherwise they would collide).
    """
    from matplotlib.ticker import FuncFormatter, LogLocator

    def decades() -> float:
        lo, hi = ax.get_ylim()
        return float(np.log10(hi / lo)) if lo > 0 and hi > lo else 99.0

    def minor(x, pos=None):
        if x <= 0:
            return ""
        d, mant = decades(), x / 10 ** np.floor(np.log10(x) + 1e-9)
        if d <= 1.2 or (d <= 2.5 and (np.isclose(mant, 2) or np.isclose(mant, 5))):
            return f"{x:g}"
        return ""

    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(1.2, 1.5, 2, 3, 4, 5, 6, 7, 8, 9)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda x, pos=None: f"{x:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def _legend_counts(run: RunData) -> dict[tuple[str, str], int]:
    """(action taken, "live" / "shadow" / "replayed") -> incidents."""
    from .incidents import kind

    counts: dict[tuple[str, str], int] = defaultdict(int)
    for rec in run.incidents:
        counts[(str(rec.get("action")), kind(rec))] += 1
    return counts


LEGEND_PREFIX = {"live": "rule fired", "shadow": "shadow mode, rule fired", "replayed": "replayed"}


def _restores(run: RunData) -> bool:
    return any(
        r.get("restored_to_step") is not None or r.get("would_restore_to_step") is not None for r in run.incidents
    )


def legend_rows(run: RunData, width: float) -> int:
    """Rows the figure legend will need (an upper bound: the non-finite entry is always counted)."""
    entries = max(1, len(_legend_counts(run)) + (1 if run.nonfinite() else 0) + (1 if _restores(run) else 0))
    return -(-entries // legend_cols(width))


def legend_cols(width: float) -> int:
    return max(1, int(width // 2.7))  # the longest entry, "... checkpoint_and_halt (12)", is about 2.6 inches


def action_legend(fig, run: RunData) -> None:
    """Figure-level legend under the panels: one entry per action taken (with its count), and the non-finite marker."""
    from matplotlib.lines import Line2D

    counts = _legend_counts(run)
    handles = [
        Line2D(
            [],
            [],
            color=action_color(a),
            lw=1.0 if a == "warn" else 1.8,
            ls="--" if k == "replayed" else (":" if a == "warn" else "-"),
            label=f"{LEGEND_PREFIX[k]} -> {a} ({counts[a, k]})",
        )
        for a, k in sorted(counts, key=lambda k: (action_rank(k[0]), k[0], k[1]))
    ]
    if any(line.get_gid() == "nonfinite" for ax in fig.axes for line in ax.lines):
        handles.append(
            Line2D(
                [],
                [],
                ls="none",
                marker="x",
                ms=8,
                mew=2,
                color=NONFINITE_COLOR,
                label="non-finite value (drawn at the edge)",
            )
        )
    if _restores(run):  # labels.mark_rollbacks
        handles.append(
            Line2D(
                [],
                [],
                color=action_color("rollback"),
                lw=1.4,
                marker="<",
                ms=6,
                label="arrow: back to the step a rollback restored",
            )
        )
    if not handles:
        handles.append(Line2D([], [], color="none", label="no rule fired"))
    fig.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=min(len(handles), legend_cols(fig.get_figwidth())),
        fontsize=9,
        frameon=False,
    )
