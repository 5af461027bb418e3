"""Which per-token rows a micro-batch has (``RowPlan``), their statistics' names and constants.

Rows, in this order (absent fields drop out): ``adv``, ``logp`` (the sampled tokens' log-probs), ``entropy``,
``importance_weight`` (log pi/pi_prox), ``behave_imp_weight`` (log pi_prox/pi_behave), ``ratio`` (log pi/pi_old)
and ``kl_ref`` (log pi_ref/pi). The order makes every group a contiguous block: value sums (logp, entropy),
extremes (all but kl_ref), histograms (entropy .. ratio), log-ratios (importance_weight .. kl_ref), KL estimators
(ratio, kl_ref). The formulas are ``families.py``'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from . import keys, xp
from .chunks import row_layout
from .on_device import device_vector, host_to_device
from .sketch import ENTROPY, LOG_RATIO, warmed

ROW_ORDER = ("adv", "logp", "entropy", "importance_weight", "behave_imp_weight", "ratio", "kl_ref")
KL_ROWS = {"ratio": "kl_old", "kl_ref": "kl_ref"}  # the KL family each log-ratio row feeds
# input/<field>/nonfinite: (field, the row valid before the field is taken into account, the row that adds it)
NONFINITE = (
    ("logprobs", "mask", "logp"),
    ("entropy", "mask", "entropy"),
    ("advantages", "mask", "adv"),
    ("prox_logprobs", "logp", "importance_weight"),
    ("old_logprobs", "logp", "ratio"),
    ("ref_logprobs", "logp", "kl_ref"),
)


@dataclass(frozen=True)
class RowPlan:
    """Which rows a batch has and where each group of them sits; one per combination of fields (cached)."""

    rows: tuple[str, ...]
    lag_cells: bool  # with versions the ratio row's histogram comes from the lag cells (its cell index is shared)

    def at(self, name: str) -> int:
        return self.rows.index(name)

    def has(self, name: str) -> bool:
        return name in self.rows

    @functools.cached_property
    def values(self) -> tuple[int, int]:  # logp and entropy: float32 sums
        first = self.at("logp")
        return first, first + 1 + self.has("entropy")

    @functools.cached_property
    def n_extremes(self) -> int:  # every row but kl_ref
        return len(self.rows) - self.has("kl_ref")

    @functools.cached_property
    def log_ratios(self) -> int:  # first log-ratio row
        return next((i for i, r in enumerate(self.rows) if r in ROW_ORDER[3:]), len(self.rows))

    @functools.cached_property
    def ratio_families(self) -> tuple[str, ...]:  # log-ratio rows reported as ratios (count, sum r)
        return tuple(r for r in self.rows[self.log_ratios :] if r != "kl_ref")

    @functools.cached_property
    def cell_rows(self) -> tuple[str, ...]:  # entropy and the log-ratios: rows given a sketch cell index
        return tuple(r for r in self.rows if r == "entropy" or r in self.ratio_families)

    @functools.cached_property
    def hist_rows(self) -> tuple[str, ...]:  # the rows counted here (a prefix of cell_rows: the ratio row is last)
        return tuple(r for r in self.cell_rows if r != "ratio" or not self.lag_cells)

    @functools.cached_property
    def hist_specs(self) -> tuple:
        return tuple(ENTROPY if r == "entropy" else LOG_RATIO for r in self.cell_rows)

    @functools.cached_property
    def hist_starts(self) -> tuple[int, ...]:  # where each histogram row's cells start in the joint count
        return tuple(int(x) for x in np.cumsum([0] + [spec.bins for spec in self.hist_specs])[:-1])

    @functools.cached_property
    def zero_cells(self) -> tuple[int, ...]:  # each cell row's zero cell in the joint count
        return tuple(spec.bins // 2 + start for spec, start in zip(self.hist_specs, self.hist_starts))

    @functools.cached_property
    def cell_consts(self) -> tuple[tuple, ...]:  # per cell row: the sketch constants of ``sketch.cell_index_with``
        return tuple(
            (spec.scale, spec.top, spec.shift, spec.base, zero) for spec, zero in zip(self.hist_specs, self.zero_cells)
        )

    @functools.cached_property
    def kl_first(self) -> int:
        return next((i for i, r in enumerate(self.rows) if r in KL_ROWS), len(self.rows))

    @functools.cached_property
    def clip_row(self) -> int:
        """The row PPO clipping reads (the policy's ratio to the proximal policy when there is one, else to the old
        one; both engines clip on it); -1 without it or without advantages."""
        name = "importance_weight" if self.has("importance_weight") else "ratio"
        return self.at(name) if self.has(name) and self.has("adv") else -1

    @functools.cached_property
    def kl_families(self) -> tuple[str, ...]:
        return tuple(KL_ROWS[r] for r in self.rows[self.kl_first :])

    @functools.cached_property
    def names(self) -> dict:
        """The layouts (``row_layout``) of the row-vector outputs, in row order; ``hist``: the histogram names."""
        fam = {r: keys.of(r) for r in self.rows}
        ext = self.rows[: self.n_extremes]
        log = ("importance_weight", "behave_imp_weight", "ratio")
        kl = [(k, keys.of(f)) for k in keys.KL_ESTIMATORS for f in self.kl_families]
        return {
            "count": row_layout(fam[r].count for r in self.rows),
            "kl_count": row_layout((keys.KL_OLD.count,) if self.has("ratio") else ()),  # kl_ref's: its row's
            "sum": row_layout(fam[r].sum for r in self.rows[slice(*self.values)]),
            "ratio_sum": row_layout(fam[r].sum for r in self.ratio_families),
            "max": row_layout((fam[r].logmax if r in log else fam[r].max) for r in ext),
            "min": row_layout((fam[r].logmin if r in log else fam[r].min) for r in ext),
            "hist": tuple((fam[r].hist, spec.bins) for r, spec in zip(self.hist_rows, self.hist_specs)),  # prefix
            "nonfinite": row_layout(keys.input_nonfinite(f) for f, _, after in NONFINITE if self.has(after)),
            "seqs": row_layout(keys.of(f).seqs for f in self.kl_families),
            "kl_sum": row_layout(fam.estimator(k, "sum") for k, fam in kl),
            "kl_seqsum": row_layout(fam.estimator(k, "seqsum") for k, fam in kl),
            "kl_seqmax": row_layout(fam.estimator(k, "seqmax") for k, fam in kl),
        }

    def nonfinite_matrix(self) -> np.ndarray:
        """``[fields, 1 + rows]``: nonfinite = A @ (mask count, row counts)."""
        cols = ("mask", *self.rows)
        pairs = [(before, after) for _, before, after in NONFINITE if self.has(after)]
        a = np.zeros((len(pairs), len(cols)), dtype=np.float32)
        for i, (before, after) in enumerate(pairs):
            a[i, cols.index(before)] += 1.0
            a[i, cols.index(after)] -= 1.0
        return a


@functools.lru_cache(maxsize=64)
def row_plan(entropy: bool, adv: bool, prox: bool, old: bool, ref: bool, versions: bool) -> RowPlan:
    present = {
        "logp": True,
        "entropy": entropy,
        "adv": adv,
        "importance_weight": prox,
        "behave_imp_weight": prox and old,
        "ratio": old,
        "kl_ref": ref,
    }
    plan = RowPlan(tuple(r for r in ROW_ORDER if present[r]), lag_cells=versions and old)
    return warmed(plan)


class Constants(NamedTuple):
    """A plan's constant tensors, made once per namespace and device (``constants_of``), handed to the probes: a
    compiled micro-batch takes them as inputs instead of building them on every call."""

    nonfinite: object  # ``nonfinite_matrix``
    zero_cells: object  # each histogram row's zero cell in the joint count
    kl_scales: object  # k1 = -sum log r, k2 = sum (log r)^2 / 2, k3 = sum k3: the per-sequence sums' scales
    one: object  # a micro-batch's count


@functools.lru_cache(maxsize=64)
def constants_of(plan: RowPlan, ops, device: torch.device) -> Constants:
    if ops is xp.NUMPY:
        return Constants(
            plan.nonfinite_matrix(),
            np.array(plan.zero_cells, dtype=np.int64),
            np.array([-1.0, 0.5, 1.0]).reshape(3, 1, 1),
            np.float32(1.0),
        )
    return Constants(
        host_to_device(torch.from_numpy(plan.nonfinite_matrix()), device),
        device_vector(list(plan.zero_cells), device, torch.int64),
        device_vector([-1.0, 0.5, 1.0], device).view(3, 1, 1),
        torch.ones((), device=device),
    )
