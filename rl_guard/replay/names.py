"""Mapping other trainers' log keys onto rl_guard metric names, and saying what could not be mapped.

TRL's ``GRPOTrainer`` logs (``trainer_state.json``'s ``log_history``; ``train/<key>`` in TensorBoard and wandb) are
averages over ``logging_steps`` of its own statistics. Only keys with the same definition as an rl_guard metric
are mapped (formulas: ``trl/trainer/grpo_trainer.py`` 1.16, ``_compute_loss`` and ``_generate_and_score_completions``):

- ``kl``: masked token mean of TRL's per-token k3 KL to the reference = ``kl_ref/k3_mean`` (only when beta > 0);
- ``entropy``: masked token mean of the policy entropy = ``entropy/mean``;
- ``clip_ratio/{low,high,region}_mean``: token shares with the PPO clip active = ``clip/{low,high,region}_frac``;
- ``completions/clipped_ratio``: share of completions without EOS = ``length/truncated_frac``;
- ``completions/{mean,min,max}_length`` = ``length/{mean,min,max}``;
- ``reward``/``reward_std`` = ``reward/mean``/``std``;
- ``sampling/importance_sampling_ratio/{mean,min,max}``: trainer-vs-vLLM weight = ``behave_imp_weight/...``;
- ``loss`` = ``loss/value``; ``grad_norm``: the Trainer's total norm before clipping = ``grad/norm`` (the guard's
  one meaning of it; the clipped norm the guard measures inside the Trainer is ``grad/norm_postclip``).

TRL computes the completion, reward and sampler statistics once per generation batch and logs them only on the
step that generated it; the steps up to the next generation train on that same batch. ``carry_generation`` repeats
those values over them, as the live guard would see that batch's statistics on each of its steps (a rule with
``patience`` counts steps, not generations).

Keys already named ``rl_guard/...`` (a guarded run merges its metrics into the trainer's logs) are taken as they
are and win over mapped ones. Non-finite ``loss`` / ``grad_norm`` also give ``loss/nonfinite`` / ``grad/nonfinite``
(1 or 0), so the built-in non-finite rules have input.
"""

from __future__ import annotations

import math

PREFIX = "rl_guard/"
TRL_KEYS: dict[str, str] = {
    "kl": "rl_guard/kl_ref/k3_mean",
    "entropy": "rl_guard/entropy/mean",
    "clip_ratio/low_mean": "rl_guard/clip/low_frac",
    "clip_ratio/high_mean": "rl_guard/clip/high_frac",
    "clip_ratio/region_mean": "rl_guard/clip/region_frac",
    "completions/clipped_ratio": "rl_guard/length/truncated_frac",
    "completions/mean_length": "rl_guard/length/mean",
    "completions/min_length": "rl_guard/length/min",
    "completions/max_length": "rl_guard/length/max",
    "reward": "rl_guard/reward/mean",
    "reward_std": "rl_guard/reward/std",
    "sampling/importance_sampling_ratio/mean": "rl_guard/behave_imp_weight/mean",
    "sampling/importance_sampling_ratio/min": "rl_guard/behave_imp_weight/min",
    "sampling/importance_sampling_ratio/max": "rl_guard/behave_imp_weight/max",
    "loss": "rl_guard/loss/value",
    "grad_norm": "rl_guard/grad/norm",
}
GENERATION_KEYS = (
    "completions/clipped_ratio",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "reward",
    "reward_std",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/max",
)
CARRIED = ", repeated over the steps that train on its generation"
NONFINITE_FROM = {"loss": "rl_guard/loss/nonfinite", "grad_norm": "rl_guard/grad/nonfinite"}


def _number(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def map_record(raw: dict) -> tuple[dict[str, float], dict[str, str]]:
    """One log entry -> (rl_guard metrics, {metric: where it came from}). ``train/`` prefixes are dropped."""
    native, mapped, origin = {}, {}, {}
    for key, value in raw.items():
        x = _number(value)
        if x is None:
            continue
        if key.startswith(PREFIX):
            native[key] = x
            continue
        key = key.removeprefix("train/")
        if key in TRL_KEYS:
            mapped[TRL_KEYS[key]] = x
            origin[TRL_KEYS[key]] = key
        if key in NONFINITE_FROM:
            mapped[NONFINITE_FROM[key]] = 0.0 if math.isfinite(x) else 1.0
            origin[NONFINITE_FROM[key]] = f"{key} non-finite"
    origin.update({k: "rl_guard" for k in native})
    return {**mapped, **native}, origin


def carry_generation(rows: dict[int, dict], origin: dict[str, str]) -> None:
    """Fill, in place, the generation-level metrics mapped from TRL keys on the steps between two generations."""
    metrics = [TRL_KEYS[k] for k in GENERATION_KEYS if origin.get(TRL_KEYS[k]) == k]
    last: dict[str, float] = {}
    for step in sorted(rows):
        for m in metrics:
            if m in rows[step]:
                last[m] = rows[step][m]
            elif m in last:
                rows[step][m] = last[m]
    for m in metrics:
        origin[m] += CARRIED
