"""Gradient probe, called after backward and before the optimizer applies the update.

Uses fused multi-tensor norms (``torch._foreach_norm``): a handful of kernels for the whole model, no
per-parameter host sync. Metrics: ``grad/norm`` (total L2 norm over all gradients), ``grad/max_abs`` (max |g|),
``grad/nonfinite`` (number of gradient tensors, or shards of them, holding a NaN or inf), ``grad/group<i>/norm``
(L2 norm per optimizer parameter group).

Where gradients live, and how ranks merge them (detected; ``sharded_grads`` in the YAML only overrides):

- plain tensors (single process, DDP): every rank holds the same averaged gradient, so figures merge by max;
- ``DTensor`` gradients (FSDP2 ``fully_shard``, tensor parallel; torch >= 2.4 ``torch.distributed.tensor``): the
  local shard is probed and squared norms and counts merge by sum, each divided by the number of replicas along
  the mesh's ``Replicate`` dimensions (HSDP), so a replicated value is counted once. Plain tensors next to
  DTensors count as replicated over the whole group. Placements ``Partial`` are reduced first;
- a gradient source (``GradientSource`` below): gradients kept outside ``p.grad``, such as DeepSpeed ZeRO's
  per-rank partitions (``rl_guard.adapters.deepspeed``); the source says whether they are partitions.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch

from . import keys
from .partial import Partial
from .ranks import rank_and_world


@runtime_checkable
class GradientSource(Protocol):
    """Gradients held outside ``p.grad`` (engine-owned buffers). ``grad_groups()``: this rank's gradient tensors per
    parameter group; ``sharded``: they are disjoint partitions (merge by sum); ``scale``: multiply by this to get
    the true gradient (1 / loss scale under fp16); ``drop_grads()``: discard them (a skip)."""

    sharded: bool
    scale: float

    def grad_groups(self) -> list[list[torch.Tensor]]: ...

    def drop_grads(self) -> None: ...


def is_gradient_source(obj) -> bool:
    """``isinstance(obj, GradientSource)``, answered at once for optimizers, modules and parameter lists: the
    protocol check inspects every member of the protocol, a cost paid several times per step otherwise."""
    return hasattr(obj, "grad_groups") and isinstance(obj, GradientSource)


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _local(g: torch.Tensor, dtensor) -> tuple[torch.Tensor, float | None]:
    """The tensor this rank holds for ``g`` and, for a DTensor, the number of ranks holding the same values."""
    if dtensor is None or not isinstance(g, dtensor):
        return g, None
    placements = list(g.placements)
    if any(p.is_partial() for p in placements):  # pending sums (rare for gradients): reduce them first
        from torch.distributed.tensor import Replicate

        placements = [Replicate() if p.is_partial() else p for p in placements]
        g = g.redistribute(g.device_mesh, placements)
    replicas = math.prod(g.device_mesh.size(i) for i, p in enumerate(placements) if p.is_replicate())
    return g.to_local(), float(replicas)


def local_shards(groups, sharded: bool | None = None) -> tuple[list[list[tuple[torch.Tensor, float]]], bool]:
    """Per group, ``(this rank's tensor, weight)`` for every non-empty tensor of ``groups`` (gradients or
    parameters), and whether ranks merge their statistics by sum.

    The weight (1 / replicas) makes a sum over ranks count every value once. ``sharded`` overrides detection:
    True = every local tensor is a distinct shard (weight 1, sum), False = every rank holds the same values (max).
    """
    dtensor = _dtensor_class()
    has_dtensor = dtensor is not None and any(isinstance(t, dtensor) for group in groups for t in group)
    merge_sum = has_dtensor if sharded is None else sharded
    if not has_dtensor:  # plain tensors: every one is its own local part, weight 1
        return [[(t, 1.0) for t in group if t.numel()] for group in groups], merge_sum
    world = float(rank_and_world()[1])
    out = []
    for group in groups:
        pairs = []
        for t in group:
            local, replicas = _local(t, dtensor)
            if local.numel() == 0:  # an empty shard (more ranks than rows), a ZeRO-3 parameter partitioned away
                continue
            # Under detection a plain tensor beside DTensors counts as replicated over the whole group.
            weight = 1.0 / (world if replicas is None else replicas) if sharded is None and has_dtensor else 1.0
            pairs.append((local, weight))
        out.append(pairs)
    return out, merge_sum


def local_grads(param_groups, sharded: bool | None = None) -> tuple[list[list[tuple[torch.Tensor, float]]], bool]:
    """Per group, ``(this rank's gradient tensor, merge weight)`` pairs (``local_shards``), and whether ranks merge
    them by sum."""
    if is_gradient_source(param_groups):
        merge_sum = param_groups.sharded if sharded is None else sharded
        groups = param_groups.grad_groups()
        return [[(g, 1.0) for g in group if g is not None and g.numel()] for group in groups], merge_sum
    return local_shards([[p.grad for p in group if p.grad is not None] for group in param_groups], sharded)


def flatten(pairs) -> tuple[list[torch.Tensor], list[float], list[tuple[int, int]]]:
    """Every group's ``(tensor, weight)`` pairs as one tensor list, one weight list and each group's span in them
    (multi-tensor kernels then run once over all groups)."""
    tensors, weights, spans = [], [], []
    for group in pairs:
        start = len(tensors)
        for t, w in group:
            tensors.append(t)
            weights.append(w)
        spans.append((start, len(tensors)))
    return tensors, weights, spans


def weighted_squares(tensors: list[torch.Tensor], weights: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L2 norm, merge weight x squared L2 norm)`` of every tensor, float64 (fp32 squares overflow above ~1e19),
    from one multi-tensor norm; constants are made on the tensors' device (a CPU constant would need a sync)."""
    l2 = torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float64))
    sq = l2 * l2
    if any(w != 1.0 for w in weights):
        sq = sq * _weight_vector(weights, l2.device)
    return l2, sq


def group_sums(values: torch.Tensor | None, spans, device) -> list[torch.Tensor]:
    """Per group, the sum of its span of ``values`` (a float64 zero for an empty group)."""
    return [values[a:b].sum() if b > a else torch.zeros((), dtype=torch.float64, device=device) for a, b in spans]


@torch.no_grad()
def probe_grads(param_groups, pre_clip_norm=None, sharded: bool | None = None) -> Partial:
    """Sufficient statistics of the gradients, grouped as the optimizer groups them.

    ``param_groups``: lists of parameters (``param_groups_of``) or a ``GradientSource``. ``sharded``: None to
    detect (see the module docstring), True / False to force sum / max merging across ranks.
    """
    pairs, merge_sum = local_grads(param_groups, sharded)
    scale = float(getattr(param_groups, "scale", 1.0))
    p = Partial()
    add = p.add_sum if merge_sum else p.add_max
    tensors, weights, spans = flatten(pairs)
    device = tensors[0].device if tensors else None
    sq = None
    if tensors:
        l2, sq = weighted_squares(tensors, weights)
        linf = abs_max(tensors).double()
        bad = (l2 + linf).isfinite().logical_not_().double()  # any NaN/inf makes the L2 or the inf norm non-finite
        if any(w != 1.0 for w in weights):
            bad = bad * _weight_vector(weights, device)
        if scale != 1.0:
            sq, linf = sq * (scale * scale), linf * scale
    for i, group_sq in enumerate(group_sums(sq, spans, device)):
        add(keys.grad_group(i), group_sq)
    if tensors:
        add(keys.GRAD.sq, sq.sum())
        p.add_max(keys.GRAD.max_abs, linf.max())
        add(keys.GRAD.nonfinite, bad.sum())
    if pre_clip_norm is not None:
        on = None if torch.is_tensor(pre_clip_norm) else device
        norm = torch.as_tensor(pre_clip_norm, dtype=torch.float64, device=on)
        p.add_max(keys.GRAD.preclip_sq, norm * norm)
    return p


def abs_max(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The largest |value| of every tensor, stacked (NaN where a tensor holds one). On CUDA the fused multi-tensor
    inf-norm; on CPU one min/max pass per tensor, because torch's CPU inf-norm kernel is an order of magnitude
    slower (6.7 ms against 0.5 ms for a 2.4M-parameter model on one thread)."""
    if tensors[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(tensors, math.inf))
    lows, highs = zip(*(torch.aminmax(t) if t.numel() else (t.new_zeros(()), t.new_zeros(())) for t in tensors))
    return torch.maximum(torch.stack(highs), torch.stack(lows).neg_())


def _weight_vector(weights: list[float], device) -> torch.Tensor:
    """Per-tensor merge weights on ``device``, built from one ``full`` per run of equal weights (no host copy)."""
    runs, start = [], 0
    for i in range(1, len(weights) + 1):
        if i == len(weights) or weights[i] != weights[start]:
            runs.append(torch.full((i - start,), weights[start], dtype=torch.float64, device=device))
            start = i
    return torch.cat(runs)


def param_groups_of(optimizer_or_params):
    """Parameter groups from an optimizer, a module, or an iterable of parameters; a ``GradientSource`` as is."""
    if is_gradient_source(optimizer_or_params):
        return optimizer_or_params
    if hasattr(optimizer_or_params, "param_groups"):
        return [list(g["params"]) for g in optimizer_or_params.param_groups]
    if isinstance(optimizer_or_params, torch.nn.Module):
        return [list(optimizer_or_params.parameters())]
    return [list(optimizer_or_params)]


@torch.no_grad()
def any_nonfinite_grad(param_groups) -> bool:
    """Host-side check of this rank's gradients, used only on the guard's failure path (it synchronises)."""
    pairs, _ = local_grads(param_groups, sharded=True)
    grads = flatten(pairs)[0]
    norms = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64)) if grads else None
    return norms is not None and not bool(torch.isfinite(norms).all())


def drop_grads(params) -> None:
    """Discard the gradients so the optimizer step changes no weight and no moment (torch optimizers skip a
    parameter without a gradient; a ``GradientSource`` drops its own buffers)."""
    groups = param_groups_of(params)
    if is_gradient_source(groups):
        groups.drop_grads()
        return
    for group in groups:
        for p in group:
            p.grad = None
