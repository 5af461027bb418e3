"""Check 2: all-zero advantages give an exactly-zero policy gradient."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ._base import CheckResult, RegressionCheckFailed, max_abs


def _named(params: Iterable) -> list[tuple[str, torch.Tensor]]:
    """Accept ``model.parameters()``, ``model.named_parameters()`` or a dict name -> tensor."""
    items: list[Any] = list(params.items()) if isinstance(params, Mapping) else list(params)
    if not items:
        raise ValueError("params is empty")
    if isinstance(items[0], tuple):
        return [(str(n), p) for n, p in items]
    return [(f"param[{i}]", p) for i, p in enumerate(items)]


def _grad_stats(loss_fn, named, batch) -> tuple[float, str, bool]:
    """Return (max |g| over all params, name of the worst param, any nonfinite)."""
    loss = loss_fn(batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("loss_fn must return a scalar tensor")
    if not loss.requires_grad:
        # No graph at all: every gradient is None, i.e. zero.
        return 0.0, "", False
    tensors = [p for _, p in named]
    grads = torch.autograd.grad(loss.reshape(()), tensors, allow_unused=True)
    worst, worst_name = 0.0, ""
    for (name, _), g in zip(named, grads):
        if g is None or g.numel() == 0:
            continue
        if not torch.isfinite(g).all():
            return max_abs(g) if torch.isnan(g).any() else float("inf"), name, True
        m = max_abs(g)
        if m > worst:
            worst, worst_name = m, name
    return worst, worst_name, False


def check_zero_advantage_zero_grad(
    loss_fn: Callable[[Mapping[str, Any]], torch.Tensor],
    params: Iterable,
    batch: Mapping[str, Any],
    *,
    advantages_key: str = "advantages",
    atol: float = 0.0,
    control: bool = True,
) -> CheckResult:
    """Assert d loss / d params == 0 (or None) for every parameter when all advantages are 0.

    Contract: ``loss_fn(batch) -> scalar tensor`` is the **policy-gradient term only**, e.g.
    ``-mean(min(r * A, clip(r) * A))`` over masked tokens. ``batch`` is a mapping; the check passes
    a shallow copy whose ``batch[advantages_key]`` is replaced by ``zeros_like``. Advantage-independent
    terms (entropy bonus, KL penalty, value loss) legitimately have nonzero gradients, so leave them
    out of ``loss_fn``. ``params``: ``model.parameters()``, ``named_parameters()`` or a dict.

    Measured figure: max |g| over all parameters (NaN/inf fail). With ``control=True`` the loss is
    first differentiated with the batch's own advantages and must give a nonzero gradient;
    otherwise the check would pass vacuously (e.g. a loss that is detached from the parameters).
    Typical culprits: advantages recomputed inside the loss from a non-detached value/baseline,
    per-batch advantage whitening without eps (0/0 -> NaN), a stray advantage-free term.
    """
    if advantages_key not in batch:
        raise ValueError(f"batch has no {advantages_key!r} entry")
    named = _named(params)
    adv = batch[advantages_key]
    if control:
        if not torch.as_tensor(adv).ne(0).any():
            raise ValueError("control run needs a batch with some nonzero advantages (or control=False)")
        g_ctrl, _, _ = _grad_stats(loss_fn, named, batch)
        if g_ctrl == 0.0:
            raise RegressionCheckFailed(
                "[zero_adv_zero_grad] vacuous: the loss gives an all-zero gradient even with the batch's "
                "nonzero advantages; is the loss detached from params, or are the wrong params passed?"
            )
    zeroed = dict(batch)
    zeroed[advantages_key] = torch.zeros_like(torch.as_tensor(adv))
    worst, worst_name, nonfinite = _grad_stats(loss_fn, named, zeroed)
    if nonfinite or not (worst <= atol):
        what = "non-finite gradient" if nonfinite or worst != worst else "nonzero gradient"
        raise RegressionCheckFailed(
            f"[zero_adv_zero_grad] all-zero advantages gave a {what}: max |g| = {worst:.6g} > atol {atol:g} "
            f"(worst parameter {worst_name}). The policy-gradient term must vanish when A = 0; look for "
            f"a non-detached baseline/value inside the loss, 0/0 in advantage normalisation, or an "
            f"advantage-independent term that belongs outside the checked loss."
        )
    return CheckResult(
        name="zero_adv_zero_grad",
        metric="max_abs_grad",
        value=worst,
        tolerance=atol,
        detail=f"max |g| = {worst:.3g} over {len(named)} parameter tensors",
    )
