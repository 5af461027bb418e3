"""Check 3: a constant, action-independent baseline leaves the expected policy gradient unchanged.

Verified by exact enumeration over a small tabular softmax policy (S states x K actions), in
float64, never by comparing two sampled minibatches (sampling noise would hide small biases).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._base import CheckResult, RegressionCheckFailed, as_f64

AdvantageFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Defaults for the advantage_fn helper: S == K so a per-state baseline broadcast along the
# action axis (``rewards - b`` instead of ``rewards - b[:, None]``) runs silently and is caught.
_DEFAULT_LOGITS = ((0.3, -1.2, 0.9), (1.5, 0.1, -0.4), (-0.7, 0.6, 0.2))
_DEFAULT_REWARDS = ((1.0, 0.0, 2.5), (-1.0, 3.0, 0.5), (0.25, -2.0, 1.0))
_DEFAULT_BASELINE = (0.8, -1.7, 2.9)


def _as_table(policy_logits) -> torch.Tensor:
    logits = as_f64(policy_logits)
    if logits.ndim == 1:
        logits = logits.unsqueeze(0)
    if logits.ndim != 2 or logits.shape[1] < 2:
        raise ValueError("policy_logits must be [K] or [S, K] with K >= 2")
    return logits


def _reward_table(reward_fn_or_table, shape) -> torch.Tensor:
    s, k = shape
    if callable(reward_fn_or_table):
        # reward_fn(state_index, action_index) -> float
        return torch.tensor(
            [[float(reward_fn_or_table(i, a)) for a in range(k)] for i in range(s)], dtype=torch.float64
        )
    r = as_f64(reward_fn_or_table)
    return r.reshape(s, k) if r.numel() == s * k else r.expand(s, k).clone()


def _baseline_table(baseline, shape) -> torch.Tensor:
    """Scalar -> [1, 1]; [S] -> [S, 1] (per-state); S*K entries -> [S, K] (action-dependent)."""
    s, k = shape
    b = as_f64(baseline)
    if b.ndim == 0:
        return b.reshape(1, 1)
    if b.ndim == 1 and b.numel() == s:
        return b.reshape(s, 1)
    if b.numel() == s * k:
        return b.reshape(s, k)
    raise ValueError(f"baseline must be a scalar, [S]={s} or [S, K]={s}x{k} entries; got {tuple(b.shape)}")


def expected_policy_gradient(policy_logits, advantages) -> torch.Tensor:
    """Exact g = sum_s E_{a~pi(.|s)}[A(s,a) * d log pi(a|s) / d logits], float64, shape [S, K].

    Computed as autograd of sum_{s,a} pi(a|s) * A(s,a) * log pi(a|s) with pi and A held constant,
    which is the score-function gradient summed over every action instead of sampled.
    """
    theta = _as_table(policy_logits).clone().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=-1)
    adv = as_f64(advantages).expand_as(logp)
    objective = (logp.exp().detach() * adv * logp).sum()
    (g,) = torch.autograd.grad(objective, theta)
    return g


def _compare(name, logits, adv0, advb, rtol) -> CheckResult:
    g0 = expected_policy_gradient(logits, adv0)
    gb = expected_policy_gradient(logits, advb)
    # Rounding in the K-term sums scales with |A| (|d log pi / d logit| <= 1 for a softmax),
    # so the relative error is taken against the largest of |g|, |A(b=0)|, |A(b)|.
    scale = max(float(g0.abs().max()), float(adv0.abs().max()), float(advb.abs().max()), 1e-300)
    err = float((gb - g0).abs().max())
    rel = err / scale
    if not (rel <= rtol):
        diff = torch.nan_to_num((gb - g0).abs(), nan=float("inf"))
        idx = divmod(int(diff.argmax()), diff.shape[1])
        raise RegressionCheckFailed(
            f"[{name}] baseline changed the exact expected policy gradient: max |g_b - g_0| = {err:.6g} "
            f"(relative {rel:.3g} > rtol {rtol:g}) at (state, action) {idx}: g_0 = {float(g0[idx]):.6g}, "
            f"g_b = {float(gb[idx]):.6g}. The subtracted baseline must not depend on the action "
            f"(check broadcasting of per-state baselines, advantage clipping, per-action terms)."
        )
    return CheckResult(
        name=name,
        metric="rel_grad_diff",
        value=rel,
        tolerance=rtol,
        detail=f"relative |g_b - g_0| = {rel:.3g} over {tuple(g0.shape)} logits",
    )


def check_baseline_invariance(
    policy_logits,
    reward_fn_or_table: Callable[[int, int], float] | torch.Tensor | float,
    baseline,
    *,
    rtol: float = 1e-12,
) -> CheckResult:
    """Assert E_{a~pi}[(R(a) - b) grad log pi(a)] == E_{a~pi}[R(a) grad log pi(a)] exactly.

    ``policy_logits``: [K] or [S, K] tabular softmax logits (the parameters differentiated).
    ``reward_fn_or_table``: ``reward_fn(state, action) -> float`` or a table broadcastable to [S, K].
    ``baseline``: scalar, [S] (per-state; still action-independent) or [S, K] (action-dependent,
    which biases the gradient and fails). Measured figure: max |g_b - g_0| / scale, float64.
    """
    logits = _as_table(policy_logits)
    rewards = _reward_table(reward_fn_or_table, logits.shape)
    b = _baseline_table(baseline, logits.shape)
    return _compare("baseline_invariance", logits, rewards, rewards - b, rtol)


def check_advantage_fn_baseline_invariance(
    advantage_fn: AdvantageFn,
    policy_logits=None,
    rewards=None,
    baseline=None,
    *,
    rtol: float = 1e-12,
) -> CheckResult:
    """Same exact-enumeration check, with the user's ``advantage_fn(rewards, baseline) -> advantages``.

    Contract: ``rewards`` is a float64 Tensor[S, K] (reward of action a in state s), ``baseline`` a
    float64 tensor, scalar or [S] (one value per state, i.e. per row); the result must be [S, K].
    The gradient with ``baseline`` is compared to the one with ``zeros_like(baseline)``.
    Defaults use S == K == 3 with distinct per-state baselines, so broadcasting a per-state
    baseline along the action axis is caught instead of raising a shape error.
    """
    logits = _as_table(_DEFAULT_LOGITS if policy_logits is None else policy_logits)
    table = _reward_table(_DEFAULT_REWARDS if rewards is None else rewards, logits.shape)
    b = as_f64(_DEFAULT_BASELINE if baseline is None else baseline)
    adv0 = as_f64(advantage_fn(table.clone(), torch.zeros_like(b)))
    advb = as_f64(advantage_fn(table.clone(), b.clone()))
    for adv in (adv0, advb):
        if adv.shape != table.shape:
            raise RegressionCheckFailed(
                f"[advantage_fn_baseline_invariance] advantage_fn returned shape {tuple(adv.shape)}, "
                f"expected {tuple(table.shape)}"
            )
    return _compare("advantage_fn_baseline_invariance", logits, adv0, advb, rtol)
