"""One function per panel: ``draw(ax, run) -> bool`` (False: nothing to draw, the panel is skipped).

Every panel gets the incident markers and a per-axes legend of its series; figure assembly is in ``render``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

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
        style.line(
            ax,
            run,
            f"{family}/min",
            color=style.BAND_COLOR,
            ls="none",
            marker="o",
            ms=style.dot_size(run),
            mfc="none",
            alpha=0.8,
            label="min",
        )
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
        got |= style.line(
            ax, run, worst, floor=bottom, color=c, lw=1.2, ls="--", alpha=0.85, label="k3 seq_max (worst sequence)"
        )
        if got and bottom is not None:
            style.set_log_y(ax, bottom)
        return got

    return draw


def draw_clip(ax, run: RunData) -> bool:
    got = False
    for stat, color, label in (
        ("low_frac", "#4c72b0", "low (r < 1-eps, A < 0)"),
        ("high_frac", "#c44e52", "high (r > 1+eps, A > 0)"),
        ("region_frac", "#333333", "region (either)"),
    ):
        got |= style.line(ax, run, f"clip/{stat}", color=color, lw=1.6 if stat == "region_frac" else 1.2, label=label)
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
    got |= style.line(
        ax, run, "grad/norm_postclip", floor=bottom, color="#8172b3", lw=1.2, ls="--", label="grad norm after clipping"
    )
    if not got:
        return False
    if bottom is not None:
        style.set_log_y(ax, bottom)
    spikes = grad_spikes(run)
    pts: dict[tuple[str, bool], list[tuple[int, float]]] = {}
    for step, action, metric in spikes:
        shown = metric if metric in ("rl_guard/grad/norm", "rl_guard/grad/norm_postclip") else "rl_guard/grad/norm"
        value = run.value_at(shown, step)
        onedge = value is None or not np.isfinite(value)
        pts.setdefault((action, onedge), []).append((step, 1.0 if value is None or onedge else value))
    ms = 15 if len(spikes) <= 30 else 7
    for (action, onedge), xy in sorted(pts.items(), key=lambda kv: (style.action_rank(kv[0][0]), kv[0][1])):
        x, y = zip(*xy)
        # A spike whose value is not plottable still gets its star, on the top edge like other non-finite data.
        ax.plot(
            x,
            y,
            ls="none",
            marker="*",
            ms=ms,
            mec="black",
            mew=0.8,
            color=style.action_color(action),
            zorder=7,
            clip_on=False,
            gid="grad_spike",
            transform=ax.get_xaxis_transform() if onedge else ax.transData,
            label=None if onedge and (action, False) in pts else f"grad rule -> {action}",
        )
    return True


def _bucket_key(name: str) -> tuple[int, str]:
    m = re.match(r"(\d+)", name)
    return (int(m.group(1)) if m else 10**9, name)


def lag_buckets(run: RunData) -> list[str]:
    """Bucket labels ("0", "1", "3-4", "9+") ordered by their lower edge."""
    names = [
        n[len("rl_guard/lag/") : -len("/token_frac")]
        for n in run.with_prefix("lag/")
        if n.endswith("/token_frac") and n.count("/") == 3
    ]
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
    ax.stackplot(run.steps, *stacked, labels=[f"lag {b}" for b in buckets], colors=colors, alpha=0.85, gid="lag_stack")
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
        ax.fill_between(x, mean - std, mean + std, where=ok, color="#55a868", alpha=0.25, lw=0, label="mean +- std")
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


def draw_lr(ax, run: RunData) -> bool:
    """The learning rate each step was to use (largest over parameter groups), per group when they differ.

    Logged before the guard acts, so a step whose rate the guard refused (lr_jump) still shows that rate."""
    groups = sorted((n for n in run.with_prefix("optim/group") if n.endswith("/lr")), key=_group_key)
    cols = [run.column("optim/lr")] + [run.column(g) for g in groups]
    bottom = style.log_floor(*cols)
    got = style.line(ax, run, "optim/lr", floor=bottom, color="#1f77b4", lw=1.8, label="learning rate")
    differ = [g for g in groups if not np.array_equal(run.column(g), cols[0], equal_nan=True)]
    for i, g in enumerate(differ):
        style.line(
            ax,
            run,
            g,
            floor=bottom,
            color=f"C{(i + 1) % 10}",
            lw=0.9,
            ls="--",
            marker="",
            label=g[len("rl_guard/optim/") : -len("/lr")],
        )
    if got and bottom is not None:
        style.set_log_y(ax, bottom)
    return got


def _group_key(name: str) -> tuple[int, str]:
    m = re.search(r"group(\d+)", name)
    return (int(m.group(1)) if m else 10**9, name)


def draw_update(ax, run: RunData) -> bool:
    """||dtheta|| / ||theta|| of each optimizer step; a step the guard dropped has no update (no point)."""
    bottom = style.log_floor(run.column("update/rel"), run.column("update/external_rel"))
    got = style.line(ax, run, "update/rel", floor=bottom, color="#6a3d9a", lw=1.8, label="||dtheta|| / ||theta||")
    ext = run.get("update/external_rel")
    if len(ext) and np.any(ext.values[np.isfinite(ext.values)] != 0):  # exactly 0 when healthy: drawn only if not
        got |= style.line(
            ax,
            run,
            "update/external_rel",
            floor=bottom,
            color="#e31a1c",
            lw=1.2,
            ls="--",
            label="changed outside optimizer.step()",
        )
    if got and bottom is not None:
        style.set_log_y(ax, bottom)
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
    return Panel(
        RATIO_FAMILIES[family], "ratio (log)", _quantile_panel(family, log=True), tuple(f"{family}/{q}" for q in QUANTS)
    )


PANELS: dict[str, Panel] = {
    **{f: _ratio_panel(f) for f in RATIO_FAMILIES},
    "entropy": Panel(
        "token entropy (nats)", "entropy", _quantile_panel("entropy", log=False), tuple(f"entropy/{q}" for q in QUANTS)
    ),
    "kl_old": Panel(
        "KL to the rollout policy (k3): how far this update moved",
        "KL",
        _kl("kl_old"),
        ("kl_old/k3_mean", "kl_old/k3_seq_max"),
    ),
    "kl_ref": Panel("KL to the reference policy (k3)", "KL", _kl("kl_ref"), ("kl_ref/k3_mean", "kl_ref/k3_seq_max")),
    "clip": Panel(
        "clipped token fractions",
        "fraction of tokens",
        draw_clip,
        ("clip/low_frac", "clip/high_frac", "clip/region_frac"),
    ),
    "grad": Panel(
        "gradient norm (stars: gradient rules fired)", "norm", draw_grad, ("grad/norm", "grad/norm_postclip")
    ),
    "lag": Panel("token share per policy lag (versions behind)", "token share", draw_lag, ()),
    "lr": Panel(
        "learning rate (the rate each step was to use, before the guard acted)", "learning rate", draw_lr, ("optim/lr",)
    ),
    "update": Panel(
        "update size of each optimizer step  ||dtheta|| / ||theta||", "relative update", draw_update, ("update/rel",)
    ),
    "reward": Panel("reward", "reward", draw_reward, ("reward/mean",)),
    "length": Panel("response length (tokens)", "tokens", draw_length, ("length/mean", "length/max")),
    "truncated": Panel("truncated fraction (no EOS)", "fraction", draw_truncated, ("length/truncated_frac",)),
}


def available(name: str, run: RunData) -> bool:
    if name == "lag":
        return bool(lag_buckets(run))
    return run.has_any(*PANELS[name].needs)


# Panels that are flat by design when every batch is trained on once, by the policy that sampled it (TRL's default
# num_iterations=1; no reference model with beta=0): panel -> why. A panel constant for any other reason is drawn.
BY_DESIGN = {
    "ratio": "the policy that sampled each batch is the one trained on it (one update per batch, e.g. TRL's default "
    "num_iterations=1), so the old log-probs are the log-probs and every ratio is exactly 1",
    "seq_ratio": "the per-sequence ratio of the same log-probs: exactly 1 on-policy, like the token ratio",
    "importance_weight": "the proximal policy is the current one, so every weight is exactly 1",
    "behave_imp_weight": "the sampler's log-probs are the trainer's own (no separate inference engine), so every "
    "weight is exactly 1",
    "kl_old": "KL between the policy and itself before the update: exactly 0 on-policy",
    "clip": "with every ratio exactly 1 no token reaches the clip range: every fraction is exactly 0",
}
CAVEAT = (
    "If this run reused each batch for several updates (TRL: num_iterations > 1) these panels should move; "
    "flat there, they would mean the guard never saw the old log-probs."
)


def panel_metrics(name: str, run: RunData) -> list[str]:
    """The metrics a panel draws that this run reported."""
    if name == "lag":
        return [f"rl_guard/lag/{b}/token_frac" for b in lag_buckets(run)]
    names = list(PANELS[name].needs)
    if name in RATIO_FAMILIES or name == "entropy":
        names.append(f"{name}/min")
    return [full_name(n) for n in names if run.has(n)]


def constant_value(name: str, run: RunData) -> float | None:
    """The one value every metric of the panel took at every step it was reported (at least 2 steps, no non-finite
    value), or None when the panel moves. Exact up to 1e-12 relative: float32 round-off (0.99999976) is movement."""
    metrics = panel_metrics(name, run)
    if not metrics or name == "lag":  # a stack of shares always adds to 1: its own plot says it
        return None
    values = np.concatenate([run.get(m).values for m in metrics])
    if len(run.get(metrics[0])) < 2 or not np.isfinite(values).all():
        return None
    lo, hi = float(values.min()), float(values.max())
    return lo + 0.0 if hi - lo <= 1e-12 * max(1.0, abs(lo), abs(hi)) else None  # + 0.0: -0.0 reads as 0


def status(name: str, run: RunData) -> tuple[str, float | None]:
    """("no data", None), ("constant by design", value), ("constant", value) or ("drawn", None)."""
    if not available(name, run):
        return "no data", None
    value = constant_value(name, run)
    if value is None:
        return "drawn", None
    return ("constant by design" if name in BY_DESIGN else "constant"), value


def constant_note(name: str, value: float) -> str:
    if name in BY_DESIGN:
        return f"constant by design in this run (value {value:g})"
    return f"constant in this run (value {value:g})"


def draw_panel(ax, name: str, run: RunData, xlim: tuple[float, float] | None = None, compact: bool = False) -> bool:
    """Draw one panel on `ax` with title, labels, incident markers and their labels (`compact`: rule and action
    only), a note when the panel is constant, and the legend; False if it had no data."""
    from matplotlib.ticker import MaxNLocator

    from .labels import draw_labels, incident_labels, make_headroom, mark_rollbacks

    panel = PANELS[name]
    ax.set_gid(name)
    if not panel.draw(ax, run):
        return False
    style.mark_incidents(ax, run)
    if xlim is not None:
        ax.set_xlim(*xlim)
    ax.set_title(panel.title, fontsize=10, loc="left")
    ax.set_ylabel(panel.ylabel, fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, which="major", alpha=0.25)
    ax.tick_params(labelsize=8)
    lowest, hidden = draw_labels(ax, incident_labels(run, compact), 0.65 if compact else 0.55)
    make_headroom(ax, lowest)
    ax.rl_guard_hidden_labels = hidden  # the figure says it once, under the panels (render._build)
    mark_rollbacks(ax, run)
    value = constant_value(name, run)
    if value is not None:
        ax.text(
            0.5,
            0.12,
            constant_note(name, value),
            transform=ax.transAxes,
            ha="center",
            va="bottom",
            fontsize=9,
            color="#333333",
            zorder=5,
            gid="constant",
            bbox=dict(boxstyle="round,pad=0.3", fc="#f2f2f2", ec="#999999", lw=0.8, alpha=0.95),
        )
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        # Outside, right of the axes: an inside legend always ends up over some band or spike.
        ax.legend(
            handles,
            labels,
            fontsize=7,
            loc="upper left",
            bbox_to_anchor=(1.005, 1.0),
            framealpha=0.8,
            borderaxespad=0.0,
        )
    return True
