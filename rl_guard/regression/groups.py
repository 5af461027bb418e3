"""Check 5: tied rewards inside a group give exactly-zero group-relative advantages (never NaN)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._base import CheckResult, RegressionCheckFailed, as_f64

GroupAdvantageFn = Callable[[torch.Tensor, int], torch.Tensor]

# 0.0 and 1.0 tie with std exactly 0 (the 0/0 trap). 0.1, 0.7 and -2.7 in groups of 3 or 7, reduced
# per group as 1-D arrays (numpy, torch slices in a loop), give a float64 std of ~1e-17..1e-16
# instead of 0, so "(r - mean) / std" guarded only against std == 0 returns +-0.8 noise.
_TIE_VALUES = (0.0, 1.0, 0.1, 0.7, -2.7)


def check_group_advantage_zero_on_ties(
    advantage_fn: GroupAdvantageFn,
    *,
    group_sizes: Sequence[int] = (3, 4, 7, 8),
    tie_values: Sequence[float] = _TIE_VALUES,
    atol: float = 1e-6,
    control: bool = True,
) -> CheckResult:
    """Assert every group of identical rewards gets advantage 0 (|A| <= atol, finite).

    Contract: ``advantage_fn(rewards, group_size) -> advantages``, ``rewards`` a float64
    Tensor[B] laid out as B / group_size contiguous groups (GRPO / RLOO / Dr. GRPO style),
    result Tensor[B]. For each group size the check feeds one tied group per value in
    ``tie_values``; with ``control=True`` it appends a group of distinct rewards, whose advantages
    must be finite and strictly increasing with the reward (so a function returning all zeros, or
    with the sign flipped, cannot pass). ``atol`` admits the ~1e-10 left by a correct ``std + eps``.
    Measured figure: max |A| over tied entries.
    """
    worst = 0.0
    for g in group_sizes:
        if g < 2:
            raise ValueError("group sizes must be >= 2")
        ties = torch.tensor(tie_values, dtype=torch.float64).repeat_interleave(g)
        ctrl = torch.linspace(-1.0, 2.0, g, dtype=torch.float64)
        rewards = torch.cat([ties, ctrl]) if control else ties
        adv = as_f64(advantage_fn(rewards.clone(), g))
        if adv.shape != rewards.shape:
            raise RegressionCheckFailed(
                f"[group_adv_zero_on_ties] advantage_fn returned shape {tuple(adv.shape)}, "
                f"expected {tuple(rewards.shape)} (group_size={g})"
            )
        tied = adv[: ties.numel()].reshape(len(tie_values), g)
        bad_rows = (~torch.isfinite(tied)).any(dim=1) | (tied.abs() > atol).any(dim=1)
        if bad_rows.any():
            row = int(torch.nonzero(bad_rows)[0])
            vals = tied[row].tolist()
            nan = not bool(torch.isfinite(tied[row]).all())
            why = (
                "non-finite advantages: std = 0 for a tied group, divide by (std + eps) or skip the division"
                if nan
                else f"nonzero advantages (max |A| {float(tied[row].abs().max()):.6g} > "
                f"atol {atol:g}); a rounding-level std must not be divided into rounding noise"
            )
            raise RegressionCheckFailed(
                f"[group_adv_zero_on_ties] group_size={g}, {g} tied rewards = {tie_values[row]!r} gave "
                f"advantages {vals}: {why}"
            )
        worst = max(worst, float(tied.abs().max()))
        if control:
            c = adv[ties.numel() :]
            if not (torch.isfinite(c).all() and (c[1:] > c[:-1]).all()):
                raise RegressionCheckFailed(
                    f"[group_adv_zero_on_ties] control group of distinct rewards {ctrl.tolist()} "
                    f"(group_size={g}) gave advantages {c.tolist()}; expected finite and strictly "
                    f"increasing with the reward"
                )
    return CheckResult(
        name="group_adv_zero_on_ties",
        metric="max_abs_tied_adv",
        value=worst,
        tolerance=atol,
        detail=f"group sizes {list(group_sizes)}, {len(tie_values)} tie values",
    )
