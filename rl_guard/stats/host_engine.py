"""Small CPU micro-batches on the host: the same statistics as the eager engine, computed with numpy.

On a small micro-batch the eager engine's cost is its ~200 torch operations (a few microseconds each of dispatch,
for a few hundred tokens), not the arithmetic. On CPU the tensors already are host memory, so numpy reads them in
place (no copy, nothing to synchronise) at a fraction of the cost per operation. This path takes padded CPU
batches of float32 fields up to the engine's ``host_max_tokens`` tokens without policy versions; everything else
(GPU batches, packed or versioned batches, other dtypes, larger batches) stays with the chosen engine.
Per-sequence fields (``Guard.observe_sequences``: a generation batch's rewards) take it too. Per-sequence figures
of up to ``PY_MAX_SEQUENCES`` sequences, there and in a micro-batch, are read as Python floats: one loop instead of
~20 numpy calls.

Layout: a micro-batch's ``Partial`` must be laid out exactly as the eager engine lays it out, so that micro-batches
and ranks of either engine merge (a rank whose batches are small and one whose batches are large must agree).
For each combination of fields the eager engine probes a one-token batch with those fields once, and its layout is
kept; every micro-batch is computed here by name and packed into that layout (so a given batch always gets the
same engine, whatever came before it). Counts, histogram cells, extremes and non-finite counts equal the eager
engine's; float sums are taken in float64 here (the eager engine sums some in float32), so they agree to float32
accuracy. Formulas: ``families.py``, ``kernels.py``.
When the old log-probs are the log-probs themselves (TRL's default: one pass per rollout batch, no
``old_per_token_logps``), every valid log-ratio is +0.0 and the KL and sequence-ratio figures follow from the
valid-token counts (``_on_policy_ratio``: the same bits, a third fewer numpy calls).

A failure here is raised; the engine object (``engines.EagerEngine``) warns once, turns this path off for itself
and redoes the micro-batch with torch (input errors cannot reach it: a ``TokenBatch`` is validated when built).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from . import keys
from .constants import EXP_CLAMP
from .partial import Partial
from .sketch import LOG_RATIO, cell_index_numpy
from .token_rows import device_constant

# Per-sequence fields of up to this many values are read as Python floats: a generation batch's rewards are a few
# dozen values, where each of the ~20 numpy calls costs more than one loop over all of them.
PY_MAX_SEQUENCES = 256
F32, F64 = np.float32, np.float64
F64_MAX = float(np.finfo(np.float64).max)
FLOAT_FIELDS = ("logprobs", "entropy", "advantages", "prox_logprobs", "old_logprobs", "ref_logprobs")
LAYOUT_FIELDS = ("mask", *FLOAT_FIELDS, "lengths", "truncated", "rewards")  # the fields the layout depends on
CPU = torch.device("cpu")
_layouts: dict = {}  # signature -> the eager engine's layout and its packing offsets


def takes(b, max_tokens: int) -> bool:
    """Whether this path computes micro-batch ``b`` (see the module docstring)."""
    lp = b.logprobs
    return (
        lp.device.type == "cpu"
        and b.cu_seqlens is None
        and b.versions is None
        and 0 < lp.numel() <= max_tokens
        and all(getattr(b, f) is None or getattr(b, f).dtype == torch.float32 for f in FLOAT_FIELDS)
    )


def signature(b, seq_clip: bool, token_clip: bool) -> tuple:
    """What the eager layout depends on: which fields are given (and their dtypes), and which probes run."""
    fields = tuple(None if getattr(b, f) is None else getattr(b, f).dtype for f in LAYOUT_FIELDS)
    return fields, seq_clip, token_clip, b.allow_empty_mask


def computed(sig: tuple, one_item_eager, compute) -> Partial:
    """``compute(sig)``, this engine's statistics packed in the eager layout kept for ``sig``. The first time a
    ``sig`` is seen, ``one_item_eager()`` (the eager engine's still packed ``Partial`` of a one-item input with the
    same fields) gives that layout."""
    if sig not in _layouts:
        (sums, maxes), _, _ = one_item_eager().packed
        _layouts[sig] = (sums, maxes, _offsets(sums), _offsets(maxes))
    return compute(sig)


def _offsets(layout) -> tuple:
    out, at = [], 0
    for name, size in layout:
        out.append((name, at, at + size))
        at += size
    return tuple(out), at


LOSS_LAYOUT = (((keys.LOSS.count, 1), (keys.LOSS.sum, 1), (keys.LOSS.nonfinite, 1)), ())  # kernels.loss_stats's
_NO_MAXES = torch.zeros(0, dtype=torch.float64)


def loss_partial(loss: torch.Tensor) -> Partial:
    """``kernels.loss_stats`` of a CPU micro-batch loss, read where it is, in the same layout."""
    x = _np(loss).reshape(-1).astype(F64)
    ok = np.isfinite(x)
    sums = np.array([x.size, x.sum(where=ok), x.size - ok.sum()], dtype=F64)
    return Partial.of_packed(LOSS_LAYOUT, torch.from_numpy(sums), _NO_MAXES)


def dot(x: np.ndarray, y: np.ndarray) -> float:
    """``np.dot`` of two 1-D vectors, on the calling thread. numpy's BLAS (OpenBLAS) splits a dot product of more
    than 10,000 elements over threads of its own, which must wait for the cores that a multi-threaded torch has just
    used (its OpenMP workers spin for a while after each parallel operation): right after one, such a ``np.dot`` took
    about 4 ms here instead of 10 us, on every call. ``einsum`` sums in its own loop and never hands off the work."""
    return float(np.einsum("i,i->", x, y))


def _np(t: torch.Tensor | None):
    """The tensor's memory as a numpy array (no copy); bfloat16, which numpy lacks, is converted."""
    if t is None:
        return None
    if t.requires_grad:  # detach only when needed: it builds a new tensor object on every call
        t = t.detach()
    return (t.double() if t.dtype == torch.bfloat16 else t).numpy()


def probe(b, plan, sig: tuple, seq_clip: bool, token_clip: bool) -> Partial:
    """The micro-batch's statistics, packed in the eager layout kept for ``sig``."""
    s: dict = {}
    mx: dict = {}
    mn: dict = {}
    with np.errstate(all="ignore"):  # NaN and inf are data here (counted as non-finite), not faults
        _token_stats(s, mx, mn, b, plan, seq_clip, token_clip)
    return _packed(sig, s, mx, mn)


def takes_sequences(fields: dict, max_tokens: int) -> bool:
    """Whether this path computes the per-sequence statistics of these tensors."""
    return all(t.device.type == "cpu" and 0 < t.numel() <= max_tokens for t in fields.values())


def sequence_probe(fields: dict, sig: tuple) -> Partial:
    """Per-sequence statistics (lengths, truncated, rewards), packed in the eager layout kept for ``sig``."""
    s: dict = {}
    mx: dict = {}
    mn: dict = {}
    lengths = fields.get("lengths")
    with np.errstate(all="ignore"):
        _sequence_fields(
            s,
            mx,
            mn,
            None if lengths is None else _np(lengths).reshape(-1).astype(F64),
            fields.get("truncated"),
            fields.get("rewards"),
        )
    return _packed(sig, s, mx, mn)


def _py_sequence_fields(s, mx, mn, lengths: list | None, truncated, rewards) -> None:
    """``_sequence_fields`` on Python floats: the same counts and extremes; the sums in float64, added in order."""
    if lengths is not None:
        _py_value_stats(s, mx, mn, "length", lengths, finite_only=False)
    if truncated is not None:
        s[keys.LENGTH.truncated] = float(sum(map(bool, truncated.reshape(-1).tolist())))
    if rewards is not None:
        values = rewards.reshape(-1).tolist()
        count = _py_value_stats(s, mx, mn, "reward", values, finite_only=True, squares=True)
        s[keys.input_nonfinite("rewards")] = float(len(values) - count)


def _py_value_stats(s, mx, mn, name: str, values: list, finite_only: bool, squares: bool = False) -> float:
    """Count, sum (and sum of squares), max and min of ``values``. NaN is left out of the sums and extremes;
    ``finite_only``: +-inf too, and only the values kept are counted (else every value is, and +-inf counts as the
    largest float, as the eager engine's ``nan_to_num`` has it)."""
    key = keys.of(name)
    total = sq = 0.0
    kept = 0
    hi, lo = -math.inf, math.inf
    for x in values:
        x = float(x)
        if x - x != 0.0:  # NaN or +-inf (x - x is NaN for both)
            if x != x or finite_only:
                continue
            x = math.copysign(F64_MAX, x)
        kept += 1
        total += x
        sq += x * x
        hi = x if x > hi else hi
        lo = x if x < lo else lo
    count = float(kept if finite_only else len(values))
    s[key.count], s[key.sum] = count, total
    if squares:
        s[key.sumsq] = sq
    mx[key.max], mn[key.min] = hi, lo
    return count


def _packed(sig: tuple, s: dict, mx: dict, mn: dict) -> Partial:
    sum_layout, max_layout, (sum_at, n_sum), (max_at, n_max) = _layouts[sig]
    sums, maxes = np.empty(n_sum), np.empty(n_max)
    for name, lo, hi in sum_at:
        sums[lo:hi] = s[name]
    for name, lo, hi in max_at:
        maxes[lo:hi] = -mn[name[1:]] if name[0] == "-" else mx[name]
    return Partial.of_packed((sum_layout, max_layout), torch.from_numpy(sums), torch.from_numpy(maxes))


def _rows(names: tuple, s: dict, values) -> None:
    for (name, _), value in zip(names, values):
        s[name] = value


def _token_stats(s, mx, mn, b, plan, seq_clip: bool, token_clip: bool) -> None:
    """Every statistic of the micro-batch into ``s`` (sums), ``mx`` (maxima) and ``mn`` (minima), by name."""
    lp, m, gate, adv, old, ys = _token_rows(b, plan)
    valid = ys - ys == 0  # finite
    z = np.where(valid, ys, F32(0.0))
    v = valid.astype(F32)
    counts = valid.sum((1, 2)).astype(F64)
    n_mask = float(m.sum())
    names = plan.names
    s[keys.TOKENS.count] = n_mask
    _rows(names["count"], s, counts)
    _rows(names["sum"], s, z[slice(*plan.values)].sum((1, 2), dtype=F64))
    ext = plan.n_extremes
    _rows(names["max"], mx, np.where(valid[:ext], ys[:ext], -np.inf).max((1, 2)))
    _rows(names["min"], mn, np.where(valid[:ext], ys[:ext], np.inf).min((1, 2)))
    _hists(s, plan, z, counts, lp.size)
    r0, nrows = plan.log_ratios, len(plan.rows)
    on_policy = _on_policy(b, plan, seq_clip)
    e = np.expm1(np.minimum(z[r0:], F32(EXP_CLAMP))) if r0 < nrows and not on_policy else None
    nr = len(plan.ratio_families)
    if on_policy:
        _on_policy_ratio(s, mx, mn, plan, v, counts)
    elif nr:  # sum r = sum (r - 1) + count: no cancellation for r ~ 1
        assert e is not None  # ratio rows are log-ratio rows
        _rows(names["ratio_sum"], s, e[:nr].sum((1, 2), dtype=F64) + counts[r0 : r0 + nr])
    seq = _kl(s, mx, plan, v, z, e, counts) if plan.kl_first < nrows and not on_policy else None
    nonfinite = device_constant("nonfinite", plan, CPU).numpy()  # float32 entries of 0 and +-1: exact in float64
    _rows(names["nonfinite"], s, nonfinite @ np.concatenate([[n_mask], counts]))
    if plan.has("adv"):
        _advantages(s, b, plan, z, v, counts, token_clip)
    if old is not None and not on_policy:
        assert seq is not None  # old log-probs give the ratio row, a KL row (kl_old)
        tokens = seq[0, 0]
        s_lr = seq[1, 0] / tokens  # 0 / 0 = NaN marks the sequences without a valid token
        _ratio_stats(s, mx, mn, "seq_ratio", s_lr, (tokens > 0).astype(F64))
        if seq_clip and adv is not None:
            _seq_clip(s, b, lp, old, gate, adv, s_lr)
    lengths = _np(b.lengths).astype(F64) if b.lengths is not None else m.sum(1, dtype=F64)
    _sequence_fields(s, mx, mn, lengths, b.truncated, b.rewards)
    s[keys.TOKENS.empty_microbatches] = float(n_mask == 0)
    s[keys.TOKENS.microbatches] = 1.0


def _on_policy(b, plan, seq_clip: bool) -> bool:
    """Whether the old log-probs are the log-probs themselves (TRL without ``old_per_token_logps``: one pass per
    rollout batch, its default), the only log-ratio row: pi / pi_old is exactly 1 on every valid token."""
    old, lp = b.old_logprobs, b.logprobs
    return (
        old is not None
        and not seq_clip
        and plan.rows[plan.log_ratios :] == ("ratio",)
        and old.data_ptr() == lp.data_ptr()
        and old.stride() == lp.stride()
        and old.shape == lp.shape
        and old.dtype == lp.dtype
    )


def _on_policy_ratio(s, mx, mn, plan, v, counts) -> None:
    """The ratio sum, ``_kl`` and the sequence ratio's ``_ratio_stats`` when every valid log-ratio is +0.0
    (``_on_policy``): the same values, signed zeros included (a sum reduction of -0.0 gives +0.0, a max keeps
    -0.0), from the valid tokens per sequence alone, without their ~30 numpy calls."""
    k0, names = plan.kl_first, plan.names  # the ratio row, the only log-ratio row
    _rows(names["ratio_sum"], s, counts[k0 : k0 + 1])  # sum r = count
    s[keys.KL_OLD.count] = counts[k0]
    tokens = v[k0].sum(1, dtype=F64)  # valid tokens per sequence
    n_seqs = float(np.count_nonzero(tokens))
    _rows(names["seqs"], s, (n_seqs,))
    _rows(names["kl_sum"], s, (0.0, 0.0, 0.0))  # k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r
    _rows(names["kl_seqsum"], s, (0.0, 0.0, 0.0))
    _rows(names["kl_seqmax"], mx, (-0.0, 0.0, 0.0) if n_seqs else (-np.inf,) * 3)  # k1's max: of -0.0 values
    key = keys.of("seq_ratio")
    s[key.count], s[key.sum] = n_seqs, n_seqs
    mx[key.logmax], mn[key.logmin] = (0.0, 0.0) if n_seqs else (-np.inf, np.inf)
    cells = np.zeros(LOG_RATIO.bins)
    cells[LOG_RATIO.bins // 2] = n_seqs  # every sequence's log-ratio is 0 (or invalid: taken out of the zero cell)
    s[key.hist] = cells


def _token_rows(b, plan):
    """The fields' numpy views and the plan's rows stacked ``[rows, B, T]`` (float32; non-finite wherever the
    token is masked out or an input it is made of is non-finite: the mask's gate, 0 or -inf, is added to the
    log-probs and every log-ratio is a difference with them)."""
    lp = _np(b.logprobs)
    m = _np(b.mask)
    m = m if m.dtype == np.bool_ else m != 0
    gate = np.where(m, F32(0.0), F32(-np.inf))
    lpg = lp + gate
    adv = _np(b.advantages)
    if adv is not None and adv.ndim == 1:
        adv = adv[:, None]
    y = {"logp": lpg}
    if b.entropy is not None:
        y["entropy"] = _np(b.entropy) + gate
    if adv is not None:
        y["adv"] = adv + gate
    prox, old = _np(b.prox_logprobs), _np(b.old_logprobs)
    if prox is not None:
        y["importance_weight"] = lpg - prox
    if old is not None:
        y["ratio"] = lpg - old
    if prox is not None and old is not None:  # invalid wherever pi/pi_prox or pi/pi_old is: x * 0 is NaN there
        y["behave_imp_weight"] = (prox - old) + y["importance_weight"] * F32(0.0) + y["ratio"] * F32(0.0)
    if b.ref_logprobs is not None:
        y["kl_ref"] = _np(b.ref_logprobs) - lpg
    return lp, m, gate, adv, old, np.stack([y[r] for r in plan.rows])


def _advantages(s, b, plan, z, v, counts, token_clip: bool) -> None:
    """Advantage sums in float64, the zero advantages, and PPO's clip regions: with s = sign(A) both are one
    comparison, s * (lr - b) > a, a -+ b being the two log thresholds (``families._clip``)."""
    i = plan.at("adv")
    zd = z[i].astype(F64).ravel()
    s[keys.ADV.sum], s[keys.ADV.sumsq] = zd.sum(), float(np.dot(zd, zd))
    sign = np.sign(z[i])
    s[keys.ADV.zero] = counts[i] - float((sign * sign).sum(dtype=F64))
    if not token_clip or plan.clip_row < 0:
        return
    j = plan.clip_row
    _clip(s, b, z[j], sign, float((v[j] * v[i]).sum(dtype=F64)))


def _clip(s, b, z, sign, n_valid: float) -> None:
    """``families._clip`` in numpy: ``z`` the zero-filled log-ratio, ``sign`` the advantage's (0 where invalid)."""
    lo, hi = math.log1p(-b.eps_low), math.log1p(b.eps_high)
    clipped = ((z - F32((hi + lo) / 2)) * sign > F32((hi - lo) / 2)).astype(F32)
    n_clipped = float(clipped.sum(dtype=F64))
    n_low = (n_clipped - float((clipped * sign).sum(dtype=F64))) * 0.5
    s[keys.CLIP.count] = n_valid
    s[keys.CLIP.low], s[keys.CLIP.high] = n_low, n_clipped - n_low


def _sequence_fields(s, mx, mn, lengths, truncated, rewards) -> None:
    """Lengths (float64 numpy, or None), the truncated count, rewards (finite values only; tensors). Up to
    ``PY_MAX_SEQUENCES`` sequences are read as Python floats, more with numpy."""
    given = [x for x in (lengths, truncated, rewards) if x is not None]
    if given and given[0].shape[0] <= PY_MAX_SEQUENCES:
        _py_sequence_fields(s, mx, mn, None if lengths is None else lengths.tolist(), truncated, rewards)
        return
    if lengths is not None:
        lengths = np.clip(lengths, -F64_MAX, F64_MAX)  # +-inf as the eager engine's nan_to_num has it (NaN stays)
        _value_stats(s, mx, mn, "length", lengths, np.ones_like(lengths))
    if truncated is not None:
        s[keys.LENGTH.truncated] = float(_np(truncated).astype(bool).sum())
    if rewards is not None:
        rewards = _np(rewards).reshape(-1).astype(F64)
        rewards = rewards + rewards * 0.0  # NaN where non-finite
        count = _value_stats(s, mx, mn, "reward", rewards, (rewards == rewards).astype(F64), squares=True)
        s[keys.input_nonfinite("rewards")] = rewards.size - count


@functools.lru_cache(maxsize=64)
def _hist_constants(plan) -> tuple:
    """``token_rows.device_constant("hists")`` on the CPU as numpy, the columns shaped ``[rows, 1, 1]`` for
    ``[rows, B, T]`` values: the sketch constants of ``cell_index_numpy``, the zero cells, and the joint count's
    size."""
    *columns, zero_cells = device_constant("hists", plan, CPU)
    return (*(c.numpy()[:, :, None] for c in columns), zero_cells.numpy(), sum(spec.bins for spec in plan.hist_specs))


def _hists(s, plan, z, counts, n: int) -> None:
    """Entropy and log-ratio histograms: one joint count, each row's cells after the previous row's, the zero fills
    of invalid tokens taken out of each row's zero cell."""
    rows = plan.hist_rows
    if not rows:
        return
    h0, h = plan.at(rows[0]), len(rows)
    scale, top, shift, base, middle, zero_cells, total = _hist_constants(plan)
    joint = np.bincount(cell_index_numpy(z[h0 : h0 + h], scale, top, shift, base, middle).ravel(), minlength=total)
    joint = joint.astype(F64)
    joint[zero_cells] -= n - counts[h0 : h0 + h]
    at = 0
    for name, size in plan.names["hist"]:
        s[name] = joint[at : at + size]
        at += size


def _kl(s, mx, plan, v, z, e, counts) -> np.ndarray:
    """KL estimators k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r of the ratio and reference rows: token
    sums, the sequence count, the max over sequences of the per-sequence sums. Returns the per-sequence sums
    ``[4, rows, S]`` of (valid tokens, log r, (log r)^2, k3)."""
    k0, names = plan.kl_first, plan.names
    if plan.has("ratio"):
        s[keys.KL_OLD.count] = counts[plan.at("ratio")]
    zk = z[k0:]
    k3 = e[k0 - plan.log_ratios :] - zk
    seq = np.stack([v[k0:].sum(2, dtype=F64), zk.sum(2, dtype=F64), (zk * zk).sum(2, dtype=F64), k3.sum(2, dtype=F64)])
    valid = seq[0] > 0
    _rows(names["seqs"], s, valid.sum(1).astype(F64))
    est = seq[1:] * np.array([-1.0, 0.5, 1.0])[:, None, None]
    total = est.sum(2).reshape(-1)
    _rows(names["kl_sum"], s, total)
    _rows(names["kl_seqsum"], s, total)
    _rows(names["kl_seqmax"], mx, np.where(valid, est, -np.inf).max(2).reshape(-1))
    return seq


# Per-sequence values here are finite or NaN (never +-inf), so NaN-ignoring reductions and a NaN -> 0 fill are what
# the eager engine's ``nan_to_num`` calls compute (numpy's ``nan_to_num`` costs ~10x a reduction on short vectors).
def _nan_max(y):
    return np.fmax.reduce(y, initial=-np.inf)


def _nan_min(y):
    return np.fmin.reduce(y, initial=np.inf)


def _zero_filled(y):
    return np.where(y == y, y, 0.0)


def _value_stats(s, mx, mn, name: str, y, v, squares: bool = False) -> float:
    key = keys.of(name)
    z = _zero_filled(y)
    count = float(v.sum())
    s[key.count] = count
    s[key.sum] = z.sum()
    if squares:
        s[key.sumsq] = float(np.dot(z, z))
    mx[key.max], mn[key.min] = _nan_max(y), _nan_min(y)
    return count


def _ratio_stats(s, mx, mn, name: str, lr, v) -> None:
    key = keys.of(name)
    z = _zero_filled(lr)
    e = np.expm1(np.minimum(z, EXP_CLAMP))
    count = float(v.sum())
    s[key.count], s[key.sum] = count, e.sum() + count
    mx[key.logmax], mn[key.logmin] = _nan_max(lr), _nan_min(lr)
    spec = LOG_RATIO
    index = cell_index_numpy(z.astype(F32), F32(spec.scale), F32(spec.top), spec.shift, spec.base, spec.bins // 2)
    cells = np.bincount(index, minlength=spec.bins).astype(F64)
    cells[LOG_RATIO.bins // 2] -= z.size - count
    s[key.hist] = cells


def _seq_clip(s, b, lp, old, gate, adv, s_lr) -> None:
    """GSPO: every valid token of a sequence is clipped by the sequence ratio (token advantage sign)."""
    lr = (lp + gate) - old
    lr = lr + lr * F32(0.0)
    v = (lr == lr).astype(F32)
    a = adv + gate
    a = a + a * F32(0.0)
    v_adv = (a == a).astype(F32)
    clip_lr = s_lr.astype(F32)[:, None] + lr * F32(0.0)
    _clip(
        s,
        b,
        np.where(clip_lr == clip_lr, clip_lr, F32(0.0)),
        np.sign(np.where(a == a, a, F32(0.0))),
        float((v * v_adv).sum(dtype=F64)),
    )
