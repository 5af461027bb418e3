"""Gradient probe, called after backward and before ``optimizer.step()``.

Uses fused multi-tensor norms (``torch._foreach_norm``): a handful of kernels for the whole model, no
per-parameter host sync. Metrics: ``grad/norm`` (total L2 norm over all gradients), ``grad/max_abs`` (max |g|),
``grad/nonfinite`` (number of parameter tensors whose gradient holds a NaN or inf), ``grad/group<i>/norm``
(L2 norm per optimizer parameter group).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from . import keys
from .partial import Partial


def _grads(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


@torch.no_grad()
def probe_grads(param_groups: list[list[torch.nn.Parameter]], pre_clip_norm=None, sharded: bool = False) -> Partial:
    """Sufficient statistics of the gradients, grouped as the optimizer groups them.

    Data-parallel replicas hold identical (already averaged) gradients, so by default the figures merge across
    ranks by max; with ``sharded=True`` (FSDP / ZeRO shards) squared norms and counts merge by sum.
    """
    p = Partial()
    add = p.add_sum if sharded else p.add_max
    sq_total, max_abs, bad = [], [], []
    # Constants are created on the gradients' device: a CPU tensor would need a blocking copy (a sync) later.
    device = next((g.device for group in param_groups for g in _grads(group)), None)
    for i, group in enumerate(param_groups):
        grads = _grads(group)
        if not grads:
            add(keys.grad_group(i), torch.zeros((), dtype=torch.float64, device=device))
            continue
        l2 = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64))  # fp32 squares overflow above ~1e19
        linf = torch.stack(torch._foreach_norm(grads, math.inf)).double()
        sq = (l2 * l2).sum()
        add(keys.grad_group(i), sq)
        sq_total.append(sq)
        max_abs.append(linf.max())
        # A tensor with any NaN/inf has a non-finite L2 or inf norm.
        bad.append((~torch.isfinite(l2) | ~torch.isfinite(linf)).sum())
    if sq_total:
        add(keys.GRAD.sq, torch.stack(sq_total).sum())
        p.add_max(keys.GRAD.max_abs, torch.stack(max_abs).max())
        add(keys.GRAD.nonfinite, torch.stack(bad).sum())
    if pre_clip_norm is not None:
        norm = torch.as_tensor(pre_clip_norm, dtype=torch.float64, device=None if torch.is_tensor(pre_clip_norm) else device)
        p.add_max(keys.GRAD.preclip_sq, norm * norm)
    return p


def param_groups_of(optimizer_or_params) -> list[list[torch.nn.Parameter]]:
    """Parameter groups from an optimizer, a module, or an iterable of parameters."""
    if hasattr(optimizer_or_params, "param_groups"):
        return [list(g["params"]) for g in optimizer_or_params.param_groups]
    if isinstance(optimizer_or_params, torch.nn.Module):
        return [list(optimizer_or_params.parameters())]
    return [list(optimizer_or_params)]


@torch.no_grad()
def any_nonfinite_grad(param_groups: list[list[torch.nn.Parameter]]) -> bool:
    """Host-side check used only on the guard's failure path (it synchronises)."""
    grads = [g for group in param_groups for g in _grads(group)]
    norms = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64)) if grads else None
    return norms is not None and not bool(torch.isfinite(norms).all())
