"""The few most extreme sequences of a micro-batch per token family, for naming culprits.

Per sequence of a padded ``[B, T]`` batch: the largest |log pi_theta - log pi_old| over its tokens (``logratio``), its
mean k3 KL to the reference (``kl_ref``: ``families.k3`` of d = ref - logprobs), its mean entropy (``entropy``,
lowest first) and its count of non-finite log-probs (``nonfinite_logprobs``); of each, the ``k`` most extreme
(``torch.topk``). Nothing is computed on a healthy step: the guard keeps the step's (detached) batches until its
check, and only when a rule on a token family acts are they reduced here and read on the host (``host_candidates``).
Packed batches (``cu_seqlens``) are not covered.
"""

from __future__ import annotations

import torch

from . import xp
from .families import k3

# family -> the metric prefixes whose rules it explains
FAMILY_METRICS = {
    "logratio": (
        "rl_guard/ratio/",
        "rl_guard/seq_ratio/",
        "rl_guard/kl_old/",
        "rl_guard/clip/",
        "rl_guard/behave_imp_weight/",
    ),
    "kl_ref": ("rl_guard/kl_ref/",),
    "entropy": ("rl_guard/entropy/",),
    "nonfinite_logprobs": ("rl_guard/input/logprobs/",),
}


def family_of(metric: str | None) -> str | None:
    return next((f for f, prefixes in FAMILY_METRICS.items() if metric and metric.startswith(prefixes)), None)


def _top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, rows = torch.topk(x.to(torch.float64), k)
    return values, rows


@torch.no_grad()
def sequence_extremes(batch, k: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """family -> (values, row indices) of the ``k`` most extreme sequences (device tensors, no sync)."""
    logp = batch.logprobs
    if getattr(batch, "cu_seqlens", None) is not None or logp.dim() != 2:
        return {}
    mask = batch.mask.bool() if batch.mask is not None else torch.ones_like(logp, dtype=torch.bool)
    k = min(k, logp.shape[0])
    tokens = mask.sum(1).clamp(min=1)
    finite = torch.isfinite(logp)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {"nonfinite_logprobs": _top(((~finite) & mask).sum(1), k)}
    old = batch.old_logprobs if batch.old_logprobs is not None else batch.prox_logprobs
    if old is not None:
        d = (logp - old).abs().masked_fill(~mask, 0.0).nan_to_num(nan=float("inf"))
        out["logratio"] = _top(d.amax(1), k)
    if batch.ref_logprobs is not None:
        d = (batch.ref_logprobs - logp).masked_fill(~mask, 0.0)
        mean_k3 = k3(xp.TORCH, d).sum(1) / tokens
        out["kl_ref"] = _top(mean_k3.nan_to_num(nan=float("inf")), k)
    if batch.entropy is not None:
        mean = batch.entropy.masked_fill(~mask, 0.0).sum(1) / tokens
        values, rows = _top(-mean.nan_to_num(nan=float("-inf")), k)
        out["entropy"] = (-values, rows)
    return out


def host_candidates(kept: list[tuple[object, object]], family: str, k: int, describe) -> list[dict]:
    """The ``k`` most extreme sequences of ``family`` over the step's micro-batches, computed and read on the host now
    (a rule acted). ``kept``: per micro-batch, (its ``TokenBatch``, the adapter's context); ``describe(context, row)``
    -> dict of what the adapter knows of that sequence (ids, text)."""
    rows = []
    for mb, (batch, context) in enumerate(kept):
        extremes = sequence_extremes(batch, k)
        if family not in extremes:
            continue
        values, index = (t.tolist() for t in extremes[family])
        rows += [(v, mb, i, context) for v, i in zip(values, index)]
    lowest_first = family == "entropy"
    rows.sort(key=lambda r: r[0] if lowest_first else -r[0])
    out = []
    for value, mb, i, context in rows[:k]:
        entry = {
            "family": family,
            "value": value,
            "microbatch": mb,
            "row": i,
            "nonfinite": family == "nonfinite_logprobs" and value > 0,
        }
        if describe is not None and context is not None:
            entry.update(describe(context, i))
        out.append(entry)
    return out
