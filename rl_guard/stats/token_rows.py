"""Stacked token probes: every per-token field of a chunk is one row of a ``[rows, n]`` buffer, so one operation
(one kernel launch, one dispatch) serves all of them.

Rows, in this order (absent fields drop out): ``adv``, ``logp`` (the sampled tokens' log-probs), ``entropy``,
``importance_weight`` (log pi/pi_prox), ``behave_imp_weight`` (log pi_prox/pi_behave), ``ratio`` (log pi/pi_old)
and ``kl_ref`` (log pi_ref/pi). The order makes every group a contiguous block: value sums (logp, entropy),
extremes (all but kl_ref), histograms (entropy .. ratio, one cell index with per-row constants), log-ratios
(importance_weight .. kl_ref), KL estimators (ratio, kl_ref). Each row is non-finite exactly where its token is
invalid (masked out, or an input it is made of is NaN/inf): the mask's gate (0 or -inf) is added to the
log-probs, and every log-ratio is a difference with them.

Why: on a small micro-batch the cost is the number of operations (each one a dispatch and, on a GPU, a launch),
not the arithmetic; stacking makes it independent of how many fields the batch carries (~200 operations for a
whole TRL micro-batch against ~320 field by field). A large chunk makes the same passes over memory as field-by-field
probes, but each operation touches several rows at once; on CPU that larger working set costs cache misses
(``benchmarks/stats.py``: ~15 % slower at 4M tokens than field-by-field probes).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import keys
from .chunks import Chunk, ChunkStats, row_layout
from .constants import EXP_CLAMP
from .on_device import device_vector, host_to_device
from .scratch import Scratch
from .sketch import ENTROPY, LOG_RATIO, cell_index_with, count_cells

F32, F64, I32 = torch.float32, torch.float64, torch.int32
NEG_INF_BITS = int(np.array(-np.inf, dtype=np.float32).view(np.int32))  # 0xFF800000 as a signed int32
ROW_ORDER = ("adv", "logp", "entropy", "importance_weight", "behave_imp_weight", "ratio", "kl_ref")
KL_ROWS = {"ratio": "kl_old", "kl_ref": "kl_ref"}  # the KL family each log-ratio row feeds
# input/<field>/nonfinite: (field, the row valid before the field is taken into account, the row that adds it)
NONFINITE = (("logprobs", "mask", "logp"), ("entropy", "mask", "entropy"), ("advantages", "mask", "adv"),
             ("prox_logprobs", "logp", "importance_weight"), ("old_logprobs", "logp", "ratio"),
             ("ref_logprobs", "logp", "kl_ref"))


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
        return tuple(r for r in self.rows[self.log_ratios:] if r != "kl_ref")

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
        return tuple(KL_ROWS[r] for r in self.rows[self.kl_first:])

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
    present = {"logp": True, "entropy": entropy, "adv": adv, "importance_weight": prox,
               "behave_imp_weight": prox and old, "ratio": old, "kl_ref": ref}
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
    return (col([spec.scale for spec in specs], F32), col([spec.top for spec in specs], F32),
            col([spec.shift for spec in specs], I32), col([spec.base for spec in specs], I32),
            col(middles, I32), device_vector(middles, device, torch.int64))


def gate_into(acc: ChunkStats, ws: Scratch, b, ch: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's mask gate (0.0 where a token reaches the loss, -inf where it does not), written as the bits of
    -inf or 0: three integer passes, where a float division or ``torch.where`` costs several times more on CPU.
    Returns the gate and the chunk's mask count (also added to ``acc``, with the per-sequence lengths when the
    batch does not give them)."""
    m = ch.raw(b.mask)
    mi = ws("mask", I32).copy_(m if m.dtype == torch.bool else m != 0)
    n_mask = mi.sum()
    acc.sum(keys.TOKENS.count, n_mask)
    if b.lengths is None:
        ch.seq_add(acc.seq("length"), mi)
    return mi.sub_(1).bitwise_and_(NEG_INF_BITS).view(F32), n_mask


def _put(out: torch.Tensor, t: torch.Tensor, gate: torch.Tensor, b, ch: Chunk) -> None:
    """``out = t + gate`` for a per-token or per-sequence field ``t`` (broadcast, no gather, for whole rows)."""
    if t.dim() == 1 and not b.packed and ch.rows is not None and tuple(t.shape) != tuple(b.logprobs.shape):
        r0, r1 = ch.rows
        torch.add(t[r0:r1, None], gate.view(r1 - r0, -1), out=out.view(r1 - r0, -1))
    else:
        torch.add(ch.token(t), gate, out=out)


def rows_into(acc: ChunkStats, ws: Scratch, b, ch: Chunk, plan: RowPlan, gate: torch.Tensor, n_mask) -> dict:
    """Fill the rows and add every row statistic of the chunk to ``acc``. Returns what later probes of the chunk
    read: ``z`` (rows zero-filled), ``v`` (validity 0/1), ``counts`` and, with a KL row, ``k3``."""
    n, nrows = ch.n, len(plan.rows)
    y = ws.rows("y", nrows)
    lp = y[plan.at("logp")]
    torch.add(ch.raw(b.logprobs), gate, out=lp)
    if plan.has("entropy"):
        torch.add(ch.raw(b.entropy), gate, out=y[plan.at("entropy")])
    if plan.has("adv"):
        _put(y[plan.at("adv")], b.advantages, gate, b, ch)
    if plan.has("importance_weight"):
        torch.sub(lp, ch.raw(b.prox_logprobs), out=y[plan.at("importance_weight")])
    if plan.has("ratio"):
        torch.sub(lp, ch.raw(b.old_logprobs), out=y[plan.at("ratio")])
    if plan.has("behave_imp_weight"):  # invalid wherever pi/pi_prox or pi/pi_old is: x * 0 is NaN there
        bw, t = y[plan.at("behave_imp_weight")], ws("bw.t")
        torch.sub(ch.raw(b.prox_logprobs), ch.raw(b.old_logprobs), out=bw)
        bw.add_(torch.mul(y[plan.at("importance_weight")], 0.0, out=t)).add_(torch.mul(y[plan.at("ratio")], 0.0, out=t))
    if plan.has("kl_ref"):
        torch.sub(ch.raw(b.ref_logprobs), lp, out=y[plan.at("kl_ref")])

    vz = ws.rows("vz", 2 * nrows)  # validity rows, then the zero-filled rows: the KL sums read both at once
    v, z = vz[:nrows], vz[nrows:]
    torch.nan_to_num(y, 0.0, 0.0, 0.0, out=z)
    torch.eq(y, z, out=v)  # y == zero-filled y exactly at the finite entries
    counts = v.sum(1)
    names = plan.names
    acc.sum_rows(names["count"], counts)
    acc.sum_rows(names["sum"], z[slice(*plan.values)].sum(1))
    _extremes(acc, ws, y[: plan.n_extremes], names)
    out: dict[str, Any] = {"z": z, "v": v, "counts": counts}
    if plan.has("adv"):
        # std = sqrt(E[x^2] - mean^2) cancels when |mean| >> std: both sums in float64 keep it accurate
        zd = ws("f64", F64).copy_(z[plan.at("adv")])
        acc.sum(keys.ADV.sum, zd.sum())
        acc.sum(keys.ADV.sumsq, torch.dot(zd, zd))
    cells = _hists(acc, ws, plan, z, counts, n)
    if plan.has("ratio"):  # the ratio row's cells, offset by where they start: the lag probe reuses them
        j = plan.cell_rows.index("ratio")
        assert cells is not None  # the ratio row has a histogram
        out["ratio_cells"] = (cells[j], plan.hist_starts[j])
    r0 = plan.log_ratios
    if r0 < nrows:
        # expm1 keeps r - 1 and k3 = (r - 1) - log r accurate for |log r| ~ 1e-4 where exp(x) - 1 cancels in fp32
        e = torch.clamp(z[r0:], max=EXP_CLAMP, out=ws.rows("e", nrows - r0)).expm1_()
        nr = len(plan.ratio_families)
        if nr:  # sum r = sum (r - 1) + count: no cancellation for r ~ 1
            acc.sum_rows(names["ratio_sum"], e[:nr].sum(1).add_(counts[r0 : r0 + nr]))
        if plan.kl_first < nrows:
            out["k3"] = _kl_rows(acc, ws, ch, plan, vz, e[plan.kl_first - r0 :], counts)
    c = torch.cat([n_mask.reshape(1), counts])
    # a product and a sum, not a matrix-vector product: autocast would run that in half precision
    acc.sum_rows(names["nonfinite"], (device_constant("nonfinite", plan, counts.device) * c).sum(1))
    return out


def _extremes(acc: ChunkStats, ws: Scratch, y: torch.Tensor, names: dict) -> None:
    """Largest and smallest finite entry of every row (-inf / +inf where a row has none)."""
    if y.shape[1] == 0:
        acc.max_rows(names["max"], y.new_full((y.shape[0],), -math.inf))
        acc.min_rows(names["min"], y.new_full((y.shape[0],), math.inf))
        return
    ext = ws.rows("extreme", y.shape[0])
    acc.max_rows(names["max"], torch.nan_to_num(y, -math.inf, -math.inf, -math.inf, out=ext).amax(1))
    acc.min_rows(names["min"], torch.nan_to_num(y, math.inf, math.inf, math.inf, out=ext).amin(1))


def _hists(acc: ChunkStats, ws: Scratch, plan: RowPlan, z, counts, n: int) -> torch.Tensor | None:
    """Histograms of the entropy and log-ratio rows (``sketch.cell_index`` with each row's own constants): one
    cell index over the block and one count, each row's cells after the previous row's (the ratio row is not
    counted here when the lag cells count it). Returns the cell indices (``[rows, n]`` int32, each row offset by
    its start)."""
    rows = plan.cell_rows
    if not rows:
        return None
    h0, h = plan.at(rows[0]), len(rows)
    scale, top, shift, base, middle, zero_cells = device_constant("hists", plan, z.device)
    idx = cell_index_with(z[h0 : h0 + h], scale, top, shift, base, middle,
                          out=(ws.rows("cell.a", h), ws.rows("cell", h, I32), ws.rows("cell.sign", h, I32)))
    k = len(plan.hist_rows)
    if k:
        cells = count_cells(idx[:k].view(-1), sum(spec.bins for spec in plan.hist_specs[:k]))
        acc.hist(plan.names["hist"], cells, zero_cells[:k], torch.rsub(counts[h0 : h0 + k], n))
    return idx


def _kl_rows(acc: ChunkStats, ws: Scratch, ch: Chunk, plan: RowPlan, vz, e, counts) -> torch.Tensor:
    """KL estimators of the ratio and reference rows: k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r.
    Per-sequence sums of (valid tokens, log r, (log r)^2, k3) go into one ``[4, rows, S]`` accumulator, from which
    ``kl_finish`` takes the token sums and the mean and max over sequences. Returns k3 (0 where invalid)."""
    nrows, k0 = len(plan.rows), plan.kl_first
    nk = nrows - k0
    if plan.has("ratio"):  # the ratio row's count is kl_old's too
        i = plan.at("ratio")
        acc.sum_rows(plan.names["kl_count"], counts[i : i + 1].clone())
    vz_kl = vz.view(2, nrows, -1)[:, k0:]  # (valid tokens, log r) of the KL rows
    zk = vz_kl[1]
    sq_k3 = ws.rows("sq_k3", 2 * nk).view(2, nk, -1)
    torch.mul(zk, zk, out=sq_k3[0])
    k3 = torch.sub(e, zk, out=sq_k3[1])
    seq = acc.seq("kl", 4 * nk).view(4, nk, -1)
    ch.seq_add(seq[:2], vz_kl)
    ch.seq_add(seq[2:], sq_k3)
    return k3


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
