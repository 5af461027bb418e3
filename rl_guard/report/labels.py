"""Text next to the incident markers: which rule fired, what the guard did, and where a rollback went back to.

All incidents of one step share one label (a rollback step often has several rules firing); consecutive steps
whose incidents read the same (a warning repeated over a streak) share one label too ("steps 5-7"). Labels are
placed at the top of the axes next to their marker line, most severe first; one that would overlap a placed label
moves down a row, and one with no room left is dropped (the axes then say how many, and report.md lists all).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import incidents as inc
from .data import RunData
from .style import action_color, action_rank

FONT = 7
MAX_RULES = 4  # rules listed per label (2 in compact labels); more read as "+ N more rules"
LOWEST = 0.55  # labels stay in the top part of the axes (axes fraction of a label's lower edge; 0.65 if compact)
GID = "incident_label"


@dataclass
class Label:
    first: int
    last: int
    lines: list[str]
    action: str  # the most severe action taken (in shadow mode: that would have been taken) at these steps
    rank: int
    dashed: bool = False  # nothing happened live (shadow mode, replay): the box edge is dashed

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _entry(rec: dict) -> str:
    return f"{rec.get('rule')} -> {inc.short_action(rec)}"


def incident_labels(run: RunData, compact: bool = False) -> list[Label]:
    """One label per step with incidents (per streak of steps that read the same). Full: the rule, action and, for
    a lone incident, the value against the threshold; `compact` (the overview's small panels): rule and action.
    Both end with the step a rollback restored."""
    by_step: dict[int, list[dict]] = {}
    for rec in run.incidents:
        s = inc.step_of(rec)
        if s is not None:
            by_step.setdefault(s, []).append(rec)
    groups: list[tuple[int, int, tuple, list[dict]]] = []
    for step in sorted(by_step):
        recs = sorted(by_step[step], key=lambda r: (-action_rank(inc.effective_action(r)), str(r.get("rule"))))
        entries = tuple(dict.fromkeys(_entry(r) for r in recs))  # one line per rule and action, in severity order
        extra = tuple(dict.fromkeys(x for x in (inc.restored(r) for r in recs) if x))
        key = (entries, extra, tuple(sorted({inc.kind(r) for r in recs})))
        if groups and groups[-1][2] == key and groups[-1][1] == step - 1 and not extra:
            first, _, _, prev = groups.pop()
            groups.append((first, step, key, prev + recs))
        else:
            groups.append((step, step, key, recs))
    out = []
    for first, last, (entries, extra, kinds), recs in groups:
        head = f"step {first}" if first == last else f"steps {first}-{last}"
        if kinds == ("replayed",):
            head = f"replayed, {head}"
        elif kinds == ("shadow",):
            head = f"shadow, {head}"
        most = 2 if compact else MAX_RULES
        shown = list(entries[:most])
        if len(entries) > most:
            shown.append(f"+ {len(entries) - most} more rules")
        lines = [f"{head}: {shown[0]}"] if len(shown) == 1 else [f"{head}:"] + shown
        if not compact and first == last and len(entries) == 1:  # the reason: the value against the threshold
            r = recs[0]
            lines.append(f"{inc.short_metric(r.get('metric'))} {inc.number(r.get('value'))} {inc.condition(r)}")
        lines += list(extra)
        worst = max((inc.effective_action(r) for r in recs), key=action_rank)
        out.append(Label(first, last, lines, worst, action_rank(worst), dashed="live" not in kinds))
    return out


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def draw_labels(ax, labels: list[Label], lowest_allowed: float = LOWEST) -> tuple[float, int]:
    """Place the labels (call after the x limits are final). Returns the axes fraction of the lowest label's lower
    edge (1.0 if none was placed), so the caller can leave that much room above the data, and how many labels had
    no room."""
    if not labels:
        return 1.0, 0
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    pad = 2.0  # display pixels kept between labels
    placed: list = []  # display-space Bboxes of the labels placed so far
    hidden = 0
    lowest = 1.0
    xlo, xhi = sorted(ax.get_xlim())
    for lab in sorted(labels, key=lambda lb: (-lb.rank, lb.first)):
        if not xlo <= lab.first <= xhi:
            continue
        y = 0.985
        text = None
        while text is None:
            hits = []
            for right in (True, False):  # right of the marker line, else left of it, else a row further down
                cand = ax.annotate(
                    lab.text,
                    xy=(lab.first, y),
                    xycoords=ax.get_xaxis_transform(),
                    xytext=(3 if right else -3, 0),
                    textcoords="offset points",
                    ha="left" if right else "right",
                    va="top",
                    multialignment="left",
                    fontsize=FONT,
                    color="#222222",
                    linespacing=1.15,
                    zorder=5,
                    gid=GID,
                    annotation_clip=False,
                    bbox=dict(
                        boxstyle="round,pad=0.25",
                        fc="white",
                        ec=action_color(lab.action),
                        lw=1.0,
                        ls="--" if lab.dashed else "-",
                        alpha=0.88,
                    ),
                )
                ext = cand.get_window_extent(renderer)
                hit = [p for p in placed if _overlaps(ext.padded(pad), p)]
                inside = box.x0 <= ext.x0 and ext.x1 <= box.x1
                # Wider than the room on either side: the right side, running into the legend's margin.
                if not hit and (inside or (right and ext.x0 - box.x0 < ext.width and box.x1 - ext.x0 < ext.width)):
                    text = cand
                    break
                cand.remove()
                hits += hit
            if text is None:
                if not hits:  # wider than the axes on both sides: nothing to move below
                    break
                y = ax.transAxes.inverted().transform((0, min(p.y0 for p in hits) - 2 * pad))[1]
                if y - ext.height / box.height < lowest_allowed:
                    break
        if text is None:
            hidden += 1
            continue
        placed.append(ext)
        lowest = min(lowest, ax.transAxes.inverted().transform((0, ext.y0))[1])
    return lowest, hidden


def mark_rollbacks(ax, run: RunData) -> None:
    """An arrow along the bottom of the axes from each rollback step back to the step whose state it restored
    (dashed for a shadow-mode or replayed would-be rollback)."""
    seen = set()
    for rec in run.incidents:
        step = inc.step_of(rec)
        target = rec.get("restored_to_step")
        if target is None:
            target = rec.get("would_restore_to_step")
        if step is None or not isinstance(target, (int, float)) or (step, target) in seen:
            continue
        seen.add((step, target))
        ax.annotate(
            "",
            xy=(target, 0.035),
            xytext=(step, 0.035),
            xycoords=ax.get_xaxis_transform(),
            textcoords=ax.get_xaxis_transform(),
            annotation_clip=False,
            zorder=5,
            gid="rollback_arrow",
            arrowprops=dict(
                arrowstyle="-|>",
                color=action_color("rollback"),
                lw=1.4,
                shrinkA=0,
                shrinkB=0,
                ls="-" if inc.kind(rec) == "live" else "--",
            ),
        )


def make_headroom(ax, lowest: float) -> None:
    """Extend the y axis upwards so the data sits below the labels (which cover the top 1 - `lowest` of the axes)."""
    import numpy as np

    if lowest >= 0.999:
        return
    frac = max(0.5, lowest - 0.03)  # the data keeps at least half of the axes height
    lo, hi = ax.get_ylim()
    if ax.get_yscale() == "log" and lo > 0 and hi > 0:
        llo, lhi = np.log10(lo), np.log10(hi)
        ax.set_ylim(lo, 10 ** (llo + (lhi - llo) / frac))
    else:
        ax.set_ylim(lo, lo + (hi - lo) / frac)
