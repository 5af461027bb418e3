"""One function per panel: ``draw(ax, run) -> bool`` (False: nothing to draw, the panel is skipped).

Every panel gets the incident markers and a per-axes legend of its series; figure assembly is in ``render``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import style
from .data import RunData, full_name

QUANTS = ("p01", "p05", "p25", "p50", "p75", "p95", "p99", "max")
RATIO_FAMILIES = {
    "ratio": "token ratio  r = exp(logp - old_logp)",
    "seq_ratio": "sequence ratio (GSPO)  exp(mean token log-ratio)",
    "importance_weight": "importance weight  pi / pi_prox",
    "behave_imp_weight": "behaviour weight  pi_prox / pi_behave",
}
KL_COLORS = {"kl_old": "#dd8452", "kl_ref": "#55a868"}


def _quantile_panel(family: str, log: bool) -> Callable:
    def draw(ax, run: RunData) -> bool:
        if not style.quantile_bands(ax, run, family):
            return False
        style.line(ax, run, f"{family}/min", color=style.BAND_COLOR, ls="none", marker="o", ms=style.dot_size(run),
                   mfc="none", alpha=0.8, label="min")
        if log:
            ax.axhline(1.0, color="#444444", lw=0.8, ls="--", zorder=1)
            style.set_log_y(ax)
        return True

    return draw


def _kl(family: str) -> Callable:
    def draw(ax, run: RunData) -> bool:
        c, mean, worst = KL_COLORS[family], f"{family}/k3_mean", f"{family}/k3_seq_max"
        bottom = style.log_floor(run.column(mean), run.column(worst))
        got = style.line(ax, run, mean, floor=bottom, color=c, lw=1.8, label="k3 mean (per token)")
        got |= style.line(ax, run, worst, floor=bottom, color=c, lw=1.2, ls="--", alpha=0.85,
                          label="k3 seq_max (worst sequence)")
        if got and bottom is not None:
            style.set_log_y(ax, bottom)
        return got

    return draw


def draw_clip(ax, run: RunData) -> bool:
    got = False
    for stat, color, label in (("low_frac", "#4c72b0", "low (r < 1-eps, A < 0)"),
                               ("high_frac", "#c44e52", "high (r > 1+eps, A > 0)"),
                               ("region_frac", "#333333", "region (either)")):
        got |= style.line(ax, run, f"clip/{stat}", color=color, lw=1.6 if stat == "region_frac" else 1.2,
                          label=label)
    if got:
        ax.set_ylim(bottom=0)
    return got


def grad_spikes(run: RunData) -> list[tuple[int, str, str]]:
    """(step, action, metric) of incidents whose metric is a gradient statistic."""
    out = []
    for rec in run.incidents:
        metric = full_name(str(rec.get("metric") or ""))
        step = rec.get("step")
        if metric.startswith("rl_guard/grad/") and isinstance(step, (int, float)) and np.isfinite(step):
            out.append((int(step), str(rec.get("action")), metric))
    return out


def draw_grad(ax, run: RunData) -> bool:
    bottom = style.log_floor(run.column("grad/norm"), run.column("grad/norm_postclip"))
    got = style.line(ax, run, "grad/norm", floor=bottom, color="#4c72b0", lw=1.6, label="grad norm (before clipping)")
    got |= style.line(ax, run, "grad/norm_postclip", floor=bottom, color="#8172b3", lw=1.2, ls="--",
                      label="grad norm after clipping")
    if not got:
        return False
    if bottom is not None:
        style.set_log_y(ax, bottom)
    spikes = grad_spikes(run)
    pts: dict[tuple[str, bool], list[tuple[int, float]]] = {}
    for step, action, metric in spikes:
        shown = metric if metric in ("rl_guard/grad/norm", "rl_guard/grad/norm_postclip") else "rl_guard/grad/norm"
        y = run.value_at(shown, step)
        onedge = y is None or not np.isfinite(y)
        pts.setdefault((action, onedge), []).append((step, 1.0 if onedge else y))
    ms = 15 if len(spikes) <= 30 else 7
    for (action, onedge), xy in sorted(pts.items(), key=lambda kv: (style.action_rank(kv[0][0]), kv[0][1])):
        x, y = zip(*xy)
        # A spike whose value is not plottable still gets its star, on the top edge like other non-finite data.
        ax.plot(x, y, ls="none", marker="*", ms=ms, mec="black", mew=0.8, color=style.action_color(action),
                zorder=7, clip_on=False, gid="grad_spike",
                transform=ax.get_xaxis_transform() if onedge else ax.transData,
                label=None if onedge and (action, False) in pts else f"grad rule -> {action}")
    return True


def _bucket_key(name: str) -> tuple[int, str]:
    m = re.match(r"(\d+)", name)
    return (int(m.group(1)) if m else 10**9, name)


def lag_buckets(run: RunData) -> list[str]:
    """Bucket labels ("0", "1", "3-4", "9+") ordered by their lower edge."""
    names = [n[len("rl_guard/lag/"):-len("/token_frac")] for n in run.with_prefix("lag/")
             if n.endswith("/token_frac") and n.count("/") == 3]
    return sorted(names, key=_bucket_key)


def draw_lag(ax, run: RunData) -> bool:
    from matplotlib import colormaps

    buckets = lag_buckets(run)
    if not buckets:
        return False
    cols = [run.column(f"lag/{b}/token_frac") for b in buckets]
    # Stacking needs numbers: absent/non-finite shares count as 0 here and get their own markers.
    stacked = [np.where(np.isfinite(c), c, 0.0) for c in cols]
    cmap = colormaps["viridis"]
    colors = [cmap(i / max(1, len(buckets) - 1)) for i in range(len(buckets))]
    ax.stackplot(run.steps, *stacked, labels=[f"lag {b}" for b in buckets], colors=colors, alpha=0.85,
                 gid="lag_stack")
    for b in buckets:
        s = run.get(f"lag/{b}/token_frac")
        style.mark_nonfinite(ax, s.steps, s.values)
    ax.set_ylim(0, 1.0)
    return True


def draw_reward(ax, run: RunData) -> bool:
    if not run.has("reward/mean"):
        return False
    x, (mean, std) = style.aligned(run, "reward/mean", "reward/std")
    ok = np.isfinite(mean) & np.isfinite(std)
    if ok.any():
        ax.fill_between(x, mean - std, mean + std, where=ok, color="#55a868", alpha=0.25, lw=0,
                        label="mean +- std")
    style.line(ax, run, "reward/mean", color="#2d7a3e", lw=1.8, label="mean")
    style.line(ax, run, "reward/max", color="#2d7a3e", lw=0.8, ls=":", marker="", label="max / min")
    style.line(ax, run, "reward/min", color="#2d7a3e", lw=0.8, ls=":", marker="")
    return True


def draw_length(ax, run: RunData) -> bool:
    got = style.line(ax, run, "length/mean", color="#8c564b", lw=1.8, label="mean length")
    got |= style.line(ax, run, "length/max", color="#8c564b", lw=0.8, ls=":", marker="", label="max / min")
    style.line(ax, run, "length/min", color="#8c564b", lw=0.8, ls=":", marker="")
    if got:
        ax.set_ylim(bottom=0)
    return got


def draw_truncated(ax, run: RunData) -> bool:
    got = style.line(ax, run, "length/truncated_frac", color="#c44e52", lw=1.6, label="truncated (no EOS)")
    if got:
        ax.set_ylim(-0.02, 1.02)
    return got


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    draw: Callable
    needs: tuple[str, ...]  # any of these present -> the panel can be drawn


def _ratio_panel(family: str) -> Panel:
    return Panel(RATIO_FAMILIES[family], "ratio (log)", _quantile_panel(family, log=True),
                 tuple(f"{family}/{q}" for q in QUANTS))


PANELS: dict[str, Panel] = {
    **{f: _ratio_panel(f) for f in RATIO_FAMILIES},
    "entropy": Panel("token entropy (nats)", "entropy", _quantile_panel("entropy", log=False),
                     tuple(f"entropy/{q}" for q in QUANTS)),
    "kl_old": Panel("KL to the rollout policy (k3): how far this update moved", "KL", _kl("kl_old"),
                    ("kl_old/k3_mean", "kl_old/k3_seq_max")),
    "kl_ref": Panel("KL to the reference policy (k3)", "KL", _kl("kl_ref"), ("kl_ref/k3_mean", "kl_ref/k3_seq_max")),
    "clip": Panel("clipped token fractions", "fraction of tokens", draw_clip,
                  ("clip/low_frac", "clip/high_frac", "clip/region_frac")),
    "grad": Panel("gradient norm (stars: gradient rules fired)", "norm", draw_grad, ("grad/norm", "grad/norm_postclip")),
    "lag": Panel("token share per policy lag (versions behind)", "token share", draw_lag, ()),
    "reward": Panel("reward", "reward", draw_reward, ("reward/mean",)),
    "length": Panel("response length (tokens)", "tokens", draw_length, ("length/mean", "length/max")),
    "truncated": Panel("truncated fraction (no EOS)", "fraction", draw_truncated, ("length/truncated_frac",)),
}


def available(name: str, run: RunData) -> bool:
    if name == "lag":
        return bool(lag_buckets(run))
    return run.has_any(*PANELS[name].needs)


def draw_panel(ax, name: str, run: RunData) -> bool:
    """Draw one panel on `ax` with title, labels, incident markers and legend; False if it had no data."""
    from matplotlib.ticker import MaxNLocator

    panel = PANELS[name]
    ax.set_gid(name)
    if not panel.draw(ax, run):
        return False
    style.mark_incidents(ax, run)
    ax.set_title(panel.title, fontsize=10, loc="left")
    ax.set_ylabel(panel.ylabel, fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, which="major", alpha=0.25)
    ax.tick_params(labelsize=8)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        # Outside, right of the axes: an inside legend always ends up over some band or spike.
        ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), framealpha=0.8,
                  borderaxespad=0.0)
    return True
