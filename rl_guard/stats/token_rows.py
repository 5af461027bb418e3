"""Which per-token rows a micro-batch has (``RowPlan``), their statistics' names and device constants, and the
per-sequence finishing of the KL family.

Rows, in this order (absent fields drop out): ``adv``, ``logp`` (the sampled tokens' log-probs), ``entropy``,
``importance_weight`` (log pi/pi_prox), ``behave_imp_weight`` (log pi_prox/pi_behave), ``ratio`` (log pi/pi_old)
and ``kl_ref`` (log pi_ref/pi). The order makes every group a contiguous block: value sums (logp, entropy),
extremes (all but kl_ref), histograms (entropy .. ratio, one cell index with per-row constants), log-ratios
(importance_weight .. kl_ref), KL estimators (ratio, kl_ref). The formulas are ``families.py``'s.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from . import keys
from .chunks import ChunkStats, row_layout
from .on_device import device_vector, host_to_device
from .sketch import ENTROPY, LOG_RATIO

F32, F64, I32 = torch.float32, torch.float64, torch.int32
NEG_INF_BITS = int(np.array(-np.inf, dtype=np.float32).view(np.int32))  # 0xFF800000 as a signed int32
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
    return RowPlan(tuple(r for r in ROW_ORDER if present[r]), lag_cells=versions and old)


@functools.lru_cache(maxsize=64)
def device_constant(kind: str, plan: RowPlan | None, device: torch.device):
    """Small constants built once per device: the nonfinite matrix, the KL estimator scales (k1 = -sum log r,
    k2 = sum (log r)^2 / 2, k3 = sum k3), the histogram rows' sketch constants."""
    if kind == "estimators":
        return device_vector([-1.0, 0.5, 1.0], device).view(3, 1, 1)
    assert plan is not None  # the other constants are the plan's
    if kind == "nonfinite":
        return host_to_device(torch.from_numpy(plan.nonfinite_matrix()), device)
    specs, middles = plan.hist_specs, [spec.bins // 2 + start for spec, start in zip(plan.hist_specs, plan.hist_starts)]
    col = lambda values, dtype: device_vector(values, device, dtype).view(-1, 1)  # noqa: E731
    return (
        col([spec.scale for spec in specs], F32),
        col([spec.top for spec in specs], F32),
        col([spec.shift for spec in specs], I32),
        col([spec.base for spec in specs], I32),
        col(middles, I32),
        device_vector(middles, device, torch.int64),
    )


def kl_finish(acc: ChunkStats, plan: RowPlan) -> None:
    """Per KL family: token sums of k1, k2, k3 (equal to the sums over sequences), the sequence count, and the max
    over sequences of the per-sequence sums (float64: each sequence's sum was added chunk by chunk)."""
    fams = plan.kl_families
    if not fams:
        return
    nk = len(fams)
    seq = acc.seq("kl", 4 * nk).view(4, nk, -1)
    valid = seq[0] > 0
    names = plan.names
    acc.sum_rows(names["seqs"], valid.sum(1))
    est = seq[1:] * device_constant("estimators", None, seq.device)  # [3, families, S]
    total = est.sum(2).reshape(-1)
    acc.sum_rows(names["kl_sum"], total)
    acc.sum_rows(names["kl_seqsum"], total.clone())
    if est.shape[2] == 0:
        top = total.new_full((total.numel(),), -math.inf)
    else:
        top = est.masked_fill_(~valid, -math.inf).amax(2).reshape(-1)
    acc.max_rows(names["kl_seqmax"], top)


def seq_log_ratio(acc: ChunkStats, plan: RowPlan):
    """GSPO sequence log-ratio: mean token log-ratio per sequence, NaN for sequences without a valid token;
    returns (values [S], validity [S] as 0/1). The ratio row is the first KL row."""
    seq = acc.seq("kl", 4 * len(plan.kl_families)).view(4, len(plan.kl_families), -1)
    tokens = seq[0, 0]
    return seq[1, 0] / tokens, (tokens > 0).to(F64)  # 0 / 0 = NaN marks the empty sequences
