"""Every token family's per-chunk sufficient statistics, defined once: ``chunk_stats``, a pure function of one
chunk's inputs returning named outputs, written in an array namespace (``xp.py``) so that every engine runs this
same code (``stats/__init__.py``). ``probe_chunk`` adds its outputs to a ``ChunkStats`` by name, in one order, so
any way a micro-batch ran it has the same statistics layout (ranks and micro-batches of every engine merge).

A token is valid for a row when its mask is 1 and every input the row is made of is finite: the mask's gate (0 or
-inf) is added to the log-probs and every log-ratio is a difference with them, so a row is non-finite exactly where
its token is invalid. The families and their outputs:

- tokens: ``tokens`` (mask count); ``lengths`` (per-sequence mask counts, when the batch gives no lengths).
- rows, in ``token_rows.ROW_ORDER``: ``adv``, ``logp``, ``entropy``, ``importance_weight`` (log pi/pi_prox),
  ``behave_imp_weight`` (log pi_prox/pi_old, invalid where either of the other two log-ratios is), ``ratio``
  (log pi/pi_old), ``kl_ref`` (log pi_ref/pi): ``counts`` (valid tokens per row), ``sums`` (logp, entropy),
  ``maxes`` / ``mins`` (every row but kl_ref), ``nonfinite`` (per input field, the tokens valid before the field is
  taken into account and not after: ``token_rows.NONFINITE``).
- adv: ``adv_sum``, ``adv_sumsq`` (float64: std = sqrt(E[x^2] - mean^2) would cancel in float32), ``adv_zero``.
- sketches (``sketch.py``): ``hist_cells``, the cell index of every entropy and log-ratio token (each row's cells
  after the previous row's; invalid tokens counted as 0) and ``hist_invalid``, the zero fills to take back out of
  each row's zero cell.
- ratio families: ``ratio_sums``, sum r = sum (log r + k3) + count (r - 1 = log r + k3: no cancellation at r ~ 1).
- KL (kl_old on the ratio row, kl_ref): ``kl_count`` (kl_old's), ``kl_seq``, the per-sequence sums ``[4, rows, S]``
  of (valid tokens, log r, (log r)^2, k3) from which ``sequences.kl_finish`` takes k1 = -log r,
  k2 = (log r)^2 / 2 and k3 = (r - 1) - log r per token and per sequence.
- clip (PPO, token level): ``clip_count``, ``clip_low``, ``clip_high``. With s = sign(A) both regions are one
  comparison, s * (log r - b) > a, where a -+ b are the two log thresholds (a > |b|: a zero-filled log-ratio or
  A = 0 never clips); the split follows from sum(s * clipped) = high - low.
- lag: ``lag_sum``, ``lag_max`` of current_version - round(versions), and per token a slot (the lag clamped into the
  buckets' range, or the last slot when invalid): ``lag_slots`` without a log-ratio, else ``lag_cells`` (the ratio
  row's cell plus bins x (slot + slots x region), region 0 valid, 1 valid and clipped, 2 invalid ratio),
  ``lag_regions`` and ``lag_k3``, mapped to buckets by ``lags.lag_finish``.

Written for the compiler, which also suits the eager run: per field on ``[r, T]`` tensors (per-sequence fields
``[r, 1]`` broadcast), finiteness as ``t - t == 0`` under torch (``xp.py``), and k3 from its series below |log r| =
0.5 (the compiler turns ``expm1`` into ``exp(x) - 1``, which cancels in float32, and ``expm1(x) - x`` cancels in any
library). Under the compiler (C++ loops on CPU, Triton on CUDA) it becomes a few fused loops that read each input
once or twice; a compile costs ~10-30 s, once per process and combination of fields and dtypes (shapes are dynamic).
"""

from __future__ import annotations

import functools
import itertools
import math
import types
from typing import NamedTuple

import torch

from . import keys, xp
from .constants import EXP_CLAMP
from .lags import by_bucket, lag_slot_offset, lag_slots
from .sketch import LOG_RATIO, cell_index_with, count_cells
from .token_rows import RowPlan

INF = math.inf


class Static(NamedTuple):
    """Everything ``chunk_stats`` branches on (constants to the compiler): the row plan and the batch's settings."""

    plan: RowPlan
    clip_row: int  # -1: no clipping
    clip_a: float
    clip_b: float
    lag: str  # "", "counts" or "cells"
    lag_lo: int
    lag_hi: int
    lengths: bool  # per-sequence mask counts wanted (the batch gives no lengths)
    zero_ratio: int  # the ratio row's index when it is known to be +0 wherever valid (``same_old``), else -1


def static_of(plan: RowPlan, b, token_clip: bool, edges) -> Static:
    args = (b.eps_low, b.eps_high, b.versions is not None, b.lengths is None, tuple(edges), same_old(b))
    return _static(plan, token_clip, *args)


def same_old(b) -> bool:
    """Whether the old log-probs are the log-probs themselves (TRL's default, one pass per rollout batch: it passes
    the detached log-probs): then every valid log-ratio log pi - log pi_old is exactly +0, so its k3 (+0) and sketch
    cells (the zero cell) are known, the same bits the general formulas give, without computing them."""
    old, lp = b.old_logprobs, b.logprobs
    return old is not None and (old.data_ptr(), old.stride(), old.shape, old.dtype) == (
        lp.data_ptr(),
        lp.stride(),
        lp.shape,
        lp.dtype,
    )


@functools.lru_cache(maxsize=64)
def _static(plan, token_clip: bool, eps_low, eps_high, versions: bool, lengths: bool, edges, same: bool) -> Static:
    lo, hi = math.log1p(-eps_low), math.log1p(eps_high)
    lag = "" if not versions else ("cells" if plan.has("ratio") else "counts")
    clip_row = plan.clip_row if token_clip else -1
    zero_ratio = plan.at("ratio") if same else -1
    return Static(plan, clip_row, (hi - lo) / 2, (hi + lo) / 2, lag, edges[0], edges[-1], lengths, zero_ratio)


K3_SERIES = 0.5  # below this |log r| k3 comes from its Taylor series, above from exp


def k3(ops, x):
    """k3 = (r - 1) - log r = exp(x) - 1 - x, accurate in float32 for every x: the compiler computes ``expm1`` as
    ``exp(x) - 1``, which cancels for small x, so small |x| use the series x^2/2! + ... + x^10/10! (truncation
    < 1e-9 relative at |x| = 0.5) and larger ones exp(x) - 1 - x (rounding ~1e-6 relative there)."""
    poly = x * (1.0 / math.factorial(10)) + 1.0 / math.factorial(9)
    for k in range(8, 1, -1):
        poly = poly * x + 1.0 / math.factorial(k)
    big = ops.exp(ops.clamp(x, None, EXP_CLAMP)) - 1.0 - x
    return ops.where(ops.abs(x) < K3_SERIES, poly * x * x, big)


def _seq_sums(ops, x, ids, num_seqs, row_sums=None):
    """Per-sequence sums of a ``[r, T]`` token tensor: its row sums (whole padded rows; ``row_sums`` if already
    taken) or, for packed tokens, float64 sums by sequence ``ids``."""
    if ids is None:
        return x.sum(-1) if row_sums is None else row_sums
    return ops.add_at(ops.zeros((num_seqs,), ops.f64, x.device), ids, x.reshape(-1))


def _gate(ops, mask):
    """(the mask as booleans, 0 where it is set and -inf elsewhere: added to a field, the gate makes the masked-out
    tokens invalid)."""
    m = mask if mask.dtype == ops.bool_ else mask != 0
    return m, ops.where(m, 0.0, -INF)


def chunk_stats(
    lp,
    mask,
    ent,
    adv,
    prox,
    old,
    ref,
    versions,
    ids,
    num_seqs: int,
    current_version: int,
    nonfinite_a,
    *,
    s: Static,
    ops,
):
    """The statistics of one chunk (inputs ``[r, T]``: whole padded rows; packed chunks ``[1, n]`` with sequence
    ``ids``), by name (a name is present only when its statistic is computed for these fields: module docstring),
    in the array namespace ``ops`` (``xp.TORCH`` or ``xp.NUMPY``).

    Written field by field on ``[r, T]`` tensors, every reduction first along each row: the compiler then fuses all
    of them into one loop nest that reads each input once, and the per-sequence sums come out of the same loop. A
    stacked ``[fields, ...]`` tensor would instead be rebuilt, one branch per field, inside every loop that reads
    it."""
    p, n = s.plan, ops.size(lp)
    m, gate = _gate(ops, mask)
    lpg = ops.cast(lp, ops.f32) + gate
    y = {"logp": lpg}
    if ent is not None:
        y["entropy"] = ops.cast(ent, ops.f32) + gate
    if adv is not None:
        y["adv"] = ops.cast(adv, ops.f32) + gate
    if prox is not None:
        y["importance_weight"] = lpg - prox
    if old is not None:
        y["ratio"] = lpg - old
    if prox is not None and old is not None:  # invalid wherever pi/pi_prox or pi/pi_old is: x * 0 is NaN there
        y["behave_imp_weight"] = ops.cast(prox - old, ops.f32) + y["importance_weight"] * 0.0 + y["ratio"] * 0.0
    if ref is not None:
        y["kl_ref"] = ref - lpg
    ys = [y[r] for r in p.rows]
    fin = [ops.finite(t) for t in ys]
    z = [ops.where(f, t, 0.0) for f, t in zip(fin, ys)]
    v = [ops.cast(f, ops.f32) for f in fin]
    v_rows = [t.sum(-1) for t in v]
    counts = ops.stack([t.sum() for t in v_rows])
    n_mask = ops.total(m)
    ext = ys[: p.n_extremes]
    out = {
        "tokens": n_mask,
        "counts": counts,
        "sums": ops.stack([ops.total(t) for t in z[slice(*p.values)]]),
        "maxes": ops.stack([ops.max_where(t, f) for f, t in zip(fin, ext)])
        if n
        else ops.full((len(ext),), -INF, ops.f32, lp.device),  # an empty chunk (an empty batch): no extremes
        "mins": ops.stack([ops.min_where(t, f) for f, t in zip(fin, ext)])
        if n
        else ops.full((len(ext),), INF, ops.f32, lp.device),
    }
    if s.lengths:
        out["lengths"] = _seq_sums(ops, ops.cast(m, ops.i32), ids, num_seqs)
    i_adv = p.at("adv") if p.has("adv") else -1
    if i_adv >= 0:
        zd = ops.cast(z[i_adv], ops.f64)
        out["adv_sum"], out["adv_sumsq"] = ops.total(zd), ops.total(zd * zd)
    cells = []
    n_hist = len(p.hist_rows)
    if p.cell_rows:
        h0 = p.at(p.cell_rows[0])
        cells = [
            ops.full(z[h0 + i].shape, p.zero_cells[i], ops.i32, lp.device)  # the zero cell (``same_old``)
            if h0 + i == s.zero_ratio
            else cell_index_with(ops, z[h0 + i], *consts)
            for i, consts in enumerate(p.cell_consts)
        ]
        out["hist_cells"], out["hist_invalid"] = tuple(cells[:n_hist]), n - counts[h0 : h0 + n_hist]
    r0, k0, n_ratio = p.log_ratios, p.kl_first, len(p.ratio_families)
    k3s = [t if r0 + i == s.zero_ratio else k3(ops, t) for i, t in enumerate(z[r0:])]  # r - 1 = log r + k3
    if n_ratio:
        out["ratio_sums"] = (
            ops.stack([ops.total(t + k) for t, k in zip(z[r0 : r0 + n_ratio], k3s)]) + counts[r0 : r0 + n_ratio]
        )
    k3s = k3s[k0 - r0 :]
    if k3s:
        if p.has("ratio"):
            i = p.at("ratio")
            out["kl_count"] = counts[i : i + 1]
        per_seq = [_seq_sums(ops, t, ids, num_seqs, rows) for t, rows in zip(v[k0:], v_rows[k0:])]
        per_seq += [_seq_sums(ops, t, ids, num_seqs) for t in (*z[k0:], *(t * t for t in z[k0:]), *k3s)]
        out["kl_seq"] = ops.stack(per_seq).reshape(4, len(k3s), -1)
    out["nonfinite"] = (nonfinite_a * ops.cat([ops.cast(n_mask.reshape(1), ops.f32), counts])).sum(1)
    clipped = None
    if i_adv >= 0:
        sign = ops.sign(z[i_adv])
        out["adv_zero"] = counts[i_adv] - ops.total(sign * sign)
        if s.clip_row >= 0:
            j = s.clip_row
            clipped = _clip(ops, out, z[j], sign, s)
            out["clip_count"] = ops.total(v[j] * v[i_adv])
    if s.lag:
        zl, fl = _lag(ops, gate, versions, current_version)
        out["lag_sum"], out["lag_max"] = ops.total(zl), ops.max_where(zl, fl)
        slots, slot = _lag_slot(ops, zl, fl, s)
        if s.lag == "counts":
            out["lag_slots"] = ops.cast(slot, ops.i32) + lag_slot_offset((s.lag_lo, s.lag_hi), regions=False)
        else:
            slot = slot + v[p.at("ratio")] * (-2.0 * slots)
            if clipped is not None:
                slot = slot + clipped * float(slots)
            offset = ops.cast(slot, ops.i32)
            base = lag_slot_offset((s.lag_lo, s.lag_hi), regions=True)
            ratio_cell = p.cell_rows.index("ratio")  # with versions its cells are counted as the lag cells
            start = p.hist_starts[ratio_cell]
            out["lag_cells"] = cells[ratio_cell] + (LOG_RATIO.bins * base - start) + offset * LOG_RATIO.bins
            out["lag_regions"], out["lag_k3"] = offset + base, ops.cast(k3s[0], ops.f64)
    return out


def _clip(ops, out: dict, z, sign, s: Static):
    """PPO's clip regions of the zero-filled log-ratio ``z`` against the advantage ``sign`` (0 where invalid) into
    ``out`` (``clip_low``, ``clip_high``); returns the clipped tokens as 0/1 floats (module docstring)."""
    clipped = ops.cast((z - s.clip_b) * sign > s.clip_a, ops.f32)
    n_clipped = ops.total(clipped)
    n_low = (n_clipped - ops.total(clipped * sign)) * 0.5  # sum(sign * clipped) = high - low
    out["clip_low"], out["clip_high"] = n_low, n_clipped - n_low
    return clipped


def _lag(ops, gate, versions, current_version: int):
    """(zero-filled lag, its validity): current_version - round(versions), invalid where masked out."""
    lag = (gate - ops.round(ops.cast(versions, ops.f32))) + current_version
    fl = ops.finite(lag)
    return ops.where(fl, lag, 0.0), fl


def _lag_slot(ops, zl, fl, s: Static):
    """(slots, each token's slot offset ``slot - (slots - 1)`` as a float): ``slot`` is the zero-filled lag ``zl``
    clamped into the buckets' range, minus its start; the last slot (offset 0) where the lag is invalid (``fl``)."""
    slots = s.lag_hi - s.lag_lo + 2
    return slots, (ops.clamp(zl, s.lag_lo, s.lag_hi) - (s.lag_lo + slots - 1)) * ops.cast(fl, ops.f32)


def gspo_clip_stats(lp, mask, old, adv, versions, seq_lr, current_version: int, *, s: Static, ops) -> dict:
    """GSPO's sequence-level clipping (a second pass: it needs each sequence's whole log-ratio ``seq_lr``, given per
    token): every valid token of a sequence is clipped by the sequence's ratio and its own advantage's sign.
    Outputs ``clip_count``, ``clip_low``, ``clip_high`` and, with ``versions``, ``lag_clip_slots`` (each clipped
    token's lag slot, the others in an extra last slot)."""
    _, gate = _gate(ops, mask)
    fin_lr = ops.finite((ops.cast(lp, ops.f32) + gate) - old)
    a = ops.cast(adv, ops.f32) + gate
    fin_a = ops.finite(a)
    out: dict = {"clip_count": ops.total(ops.cast(fin_lr & fin_a, ops.f32))}
    seq = ops.where(fin_lr, ops.cast(seq_lr, ops.f32), 0.0)
    clipped = _clip(ops, out, seq, ops.sign(ops.where(fin_a, a, 0.0)), s)
    if versions is not None:
        zl, fl = _lag(ops, gate, versions, current_version)
        slots, slot = _lag_slot(ops, zl, fl, s)
        out["lag_clip_slots"] = ops.where(clipped > 0, ops.cast(slot, ops.i32) + (slots - 1), slots)
    return out


def probe_gspo_chunk(acc, b, ch, seq_lr, s: Static, lut, nb: int, ops) -> None:
    """``gspo_clip_stats`` of one chunk added to ``acc``; clipped tokens per lag bucket (``lut``: slot -> bucket)."""
    view = ch.block
    out = gspo_clip_stats(
        view(b.logprobs),
        view(b.mask),
        view(b.old_logprobs),
        view(b.advantages),
        view(b.versions),
        view(seq_lr, per_seq=True),
        int(b.current_version or 0),
        s=s,
        ops=ops,
    )
    acc.sum(keys.CLIP.count, out["clip_count"])
    acc.sum(keys.CLIP.low, out["clip_low"])
    acc.sum(keys.CLIP.high, out["clip_high"])
    if "lag_clip_slots" in out:
        per_slot = count_cells(out["lag_clip_slots"].reshape(-1), lut.numel() + 1)[:-1]
        acc.sum(keys.LAG.clip, by_bucket(per_slot, lut, nb, 0)[:nb])


def kernel(s: Static, compiled: bool, ops=xp.TORCH):
    """``chunk_stats`` for one ``Static``: the function itself in the namespace ``ops`` (the eager engine: torch;
    its host path: numpy) or compiled (the compiled engine)."""
    return _compiled(s) if compiled else functools.partial(chunk_stats, s=s, ops=ops)


@functools.lru_cache(maxsize=32)
def _compiled(s: Static):
    return compiled_copy(chunk_stats, s=s, ops=xp.TORCH)  # one per combination of fields: they must not share one


_COPIES = itertools.count()


def compiled_copy(fn, **constants):
    """``fn`` compiled with ``constants`` (constants to the compiler) as its keyword defaults, on its own copy of
    ``fn``'s code object: the compiler keeps a bounded number of versions per code object (8 by default; each
    combination of fields needs 2-4) and, with ``fullgraph``, fails beyond it, which would turn the engine off (a
    ``functools.partial`` would share one code object)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__.lstrip('_')}_{next(_COPIES)}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__)
    copy.__kwdefaults__ = constants
    return torch.compile(copy, dynamic=True, fullgraph=True)


def probe_chunk(acc, b, ch, plan: RowPlan, s: Static, edges, compiled: bool, consts, ops=xp.TORCH) -> None:
    """One chunk's statistics (``chunk_stats``, run as it is or compiled) added to ``acc`` by name, in a fixed
    order: the layout of a micro-batch's ``Partial`` is the same whichever way it ran. ``consts``: the plan's
    constant tensors (``token_rows.Constants``)."""
    view = ch.block
    out = kernel(s, compiled, ops)(
        view(b.logprobs),
        view(b.mask),
        view(b.entropy),
        view(b.advantages),
        view(b.prox_logprobs),
        view(b.old_logprobs),
        view(b.ref_logprobs),
        view(b.versions),
        ch.seq_ids() if b.packed else None,
        b.num_seqs,
        int(b.current_version or 0) if b.versions is not None else 0,
        consts.nonfinite,
    )
    names = plan.names
    acc.sum(keys.TOKENS.count, out["tokens"])
    if "lengths" in out:
        ch.add_seq_sums(acc.seq("length"), out["lengths"])
    acc.sum(names["count"], out["counts"])
    acc.sum(names["sum"], out["sums"])
    acc.max(names["max"], out["maxes"])
    acc.min(names["min"], out["mins"])
    if "adv_sum" in out:
        acc.sum(keys.ADV.sum, out["adv_sum"])
        acc.sum(keys.ADV.sumsq, out["adv_sumsq"])
    if plan.hist_rows:  # whole [r, T] outputs keep the compiled loops fused; flattened here (views, or one copy)
        idx = out["hist_cells"]
        idx = idx[0].reshape(-1) if len(idx) == 1 else ops.cat([t.reshape(-1) for t in idx])
        n_hist = len(plan.hist_rows)
        cells = count_cells(idx, sum(spec.bins for spec in plan.hist_specs[:n_hist]))
        acc.hist(names["hist"], cells, consts.zero_cells[:n_hist], out["hist_invalid"])
    if "ratio_sums" in out:
        acc.sum(names["ratio_sum"], out["ratio_sums"])
    if "kl_count" in out:
        acc.sum(names["kl_count"], out["kl_count"])
    if "kl_seq" in out:
        nk = len(plan.kl_families)
        ch.add_seq_sums(acc.seq("kl", 4 * nk).reshape(4, nk, -1), out["kl_seq"])
    acc.sum(names["nonfinite"], out["nonfinite"])
    if "adv_zero" in out:
        acc.sum(keys.ADV.zero, out["adv_zero"])
    if "clip_count" in out:
        acc.sum(keys.CLIP.count, out["clip_count"])
        acc.sum(keys.CLIP.low, out["clip_low"])
        acc.sum(keys.CLIP.high, out["clip_high"])
    if s.lag:
        acc.sum(keys.LAG.sum, out["lag_sum"])
        acc.max(keys.LAG.max, out["lag_max"])
        slots = lag_slots(edges)
        if "lag_slots" in out:
            acc.sum(keys.LAG.slots, count_cells(out["lag_slots"].reshape(-1), slots))
        else:
            acc.sum(keys.LAG.cells, count_cells(out["lag_cells"].reshape(-1), 3 * slots * LOG_RATIO.bins))
            acc.sum(
                keys.LAG.cells_k3,
                count_cells(out["lag_regions"].reshape(-1), 3 * slots, weights=out["lag_k3"].reshape(-1)),
            )
