"""Every emitted metric, documented once: formula, direction, reduction, typical range.

Names are ``rl_guard/<family>/<stat>``. ``<q>`` is one of p01 p05 p25 p50 p75 p95 p99 (rank ``ceil(q n)``,
from the histogram sketch, interpolated within a cell so that it moves continuously with the data; error at most
1.6 % of ``|log r| + 1e-4`` for the ratio families' log-ratios, 0.39 % of ``H + 1e-3`` nats for entropy, typically a
few percent of that; ``rl_guard/stats/sketch.py``). ``<bucket>`` is a policy-lag bucket
(default 0, 1, 2, 3-4, 5-8, 9+), ``<i>`` an optimizer parameter-group index, ``<field>`` a token-batch field.
All token statistics are over tokens with mask = 1 and finite inputs; "seq" statistics first reduce each
sequence, then over sequences. Direction: which way is trouble.
"""

from __future__ import annotations

import difflib
import re

from .diagnostics.docs import DOCS as DIAGNOSTIC_DOCS
from .stats.sketch import QUANTILE_NAMES

_RATIO_STATS = ("mean", "min", "max", *QUANTILE_NAMES)

GLOSSARY: dict[str, str] = {
    "ratio/<stat>": "r = exp(logp - logp_old) per token (old = behaviour/rollout policy); stat in mean/min/max/<q>. "
    "Token-level. ~1 on-policy (exactly 1 before the first update of a synchronous step); trouble: far from 1.",
    "seq_ratio/<stat>": "GSPO sequence ratio exp(mean over the sequence's tokens of logp - logp_old); over "
    "sequences. ~1.",
    "importance_weight/<stat>": "Decoupled PPO pi_theta / pi_prox per token; ~1, exactly 1 with one minibatch.",
    "behave_imp_weight/<stat>": "Decoupled PPO pi_prox / pi_behave per token; ~1; drifts with staleness.",
    "kl_old/<k>_mean": "KL(pi_old || pi_theta) estimated from tokens sampled by pi_old, log r = logp - logp_old: "
    "k1 = -log r, k2 = (log r)^2/2, k3 = (r-1) - log r (unbiased, >= 0; Schulman 2020). Token mean. Up is trouble.",
    "kl_old/<k>_seq_mean": "Mean over sequences of the per-sequence sum of the estimator (sequence-level KL).",
    "kl_old/<k>_seq_max": "Max over sequences of the per-sequence sum: a few prompts drifting far hide in the mean.",
    "kl_ref/<k>_mean": "KL(pi_theta || pi_ref), log r = logp_ref - logp, tokens from the sampling policy (taken as "
    "pi_theta); k1/k2/k3 as for kl_old (k3 is TRL's per-token KL; TRL 1.16 also multiplies it by the ratio when "
    "use_bias_correction_kl, so the two agree where r = 1). Token mean. Up is trouble (target ~0.01-0.1).",
    "kl_ref/<k>_seq_mean": "Mean over sequences of the per-sequence sum of the reference-KL estimator.",
    "kl_ref/<k>_seq_max": "Max over sequences of the per-sequence sum of the reference-KL estimator.",
    "entropy/<stat>": "Per-token entropy of pi_theta in nats; mean/min/max/<q>. Down toward 0 is collapse.",
    "clip/low_frac": "Share of tokens with r < 1 - eps_low and A < 0 (PPO lower clip active). 0-0.3 typical.",
    "clip/high_frac": "Share of tokens with r > 1 + eps_high and A > 0 (upper clip active).",
    "clip/region_frac": "low_frac + high_frac; > 0.4 means updates too aggressive (docs/sources.md#debugging-guide). "
    "The clipped ratio is importance_weight under decoupled PPO and the sequence ratio under GSPO.",
    "adv/<stat>": "Advantages over loss tokens: mean, std (sample), min, max, zero_frac (exactly 0: no signal).",
    "length/<stat>": "Response length per sequence (given, else mask sum): mean/min/max; truncated_frac = no-EOS share "
    "(> 0.05 is trouble: AReaL docs, Diagnosing RL Performance).",
    "reward/<stat>": "Per-sequence scalar reward: mean, std, min, max (finite values).",
    "lag/mean": "Policy lag = current_version - sample version, token mean. 0 on synchronous runs.",
    "lag/max": "Largest policy lag among loss tokens; compare with max_head_offpolicyness.",
    "lag/<bucket>/token_frac": "Share of loss tokens whose lag falls in the bucket.",
    "lag/<bucket>/ratio_p50": "Median of r = exp(logp - logp_old) within the bucket (version distance is not the "
    "ratio).",
    "lag/<bucket>/ratio_p99": "99th percentile of r within the bucket.",
    "lag/<bucket>/clip_frac": "Clip region fraction within the bucket.",
    "lag/<bucket>/k3_mean": "k3 KL(pi_old || pi_theta) token mean within the bucket.",
    "grad/norm": "Total L2 norm of all gradients before clipping (what TRL logs as grad_norm): the trainer's own "
    "pre-clip norm where the guard sees the gradients only after clipping (HF Trainer), else the norm it measures.",
    "grad/norm_postclip": "Total L2 norm of the gradients the optimizer receives, after the trainer clipped them "
    "(only where clipping happens before the guard looks, e.g. HF Trainer with max_grad_norm > 0).",
    "grad/max_abs": "max |g| over all gradient entries.",
    "grad/nonfinite": "Number of parameter tensors whose gradient holds a NaN or inf.",
    "grad/group<i>/norm": "L2 norm of parameter group i (only when the optimizer has several groups).",
    "update/rel": "||dtheta|| / ||theta|| of the last optimizer step (theta before it), measured after "
    "optimizer.step() and reported with the next step's statistics; ||dtheta|| exact for tensors of up to 4096 "
    "elements, estimated from a fixed strided sample of >= 1024 elements of each larger one (stats/update.py gives "
    "the error). 0 after a skipped step. Up is trouble.",
    "update/group<i>/rel": "update/rel of optimizer parameter group i (only with several groups).",
    "update/norm": "Estimated ||dtheta|| of the last optimizer step.",
    "update/rel_per_lr": "update/rel divided by the learning rate the step used: for Adam-style optimizers roughly "
    "constant whatever the schedule, so a jump is an update larger than the rate explains.",
    "update/param_norm": "Exact ||theta|| over all parameters right before this step's optimizer.step().",
    "update/group<i>/param_norm": "Exact ||theta|| of parameter group i (only with several groups).",
    "update/external_rel": "||theta now - theta right after the last optimizer step|| / ||theta||: weights changed "
    "outside the optimizer (a rollback is excluded). Exactly 0 in a healthy run; anything else is a bug or a fault.",
    "update/external_changed": "Parameter tensors (shards on a sharded run, summed over ranks) whose bits changed "
    "between the last optimizer step and this one by anything but the optimizer or a rollback, every element compared: "
    "tensors of up to 4096 elements element by element, larger ones by an exact integer fingerprint of their memory "
    "(stats/update.py), so a single element or a sign flip that keeps the norm counts. Exactly 0 in a healthy run.",
    "update/rms_per_lr": "Root mean square of the last step per parameter element, over the learning rate the step "
    "used: ||dtheta|| / sqrt(n) / lr. An Adam step moves each element by at most lr x (1 - beta1) / sqrt((1 - beta2)"
    " (1 - beta1^2 / beta2)) whatever the gradients (7.3 at the default betas 0.9, 0.999; stats/update.py) and by ~lr "
    "in the common case (Kingma & Ba 2015): far above that, the optimizer's state is broken. Up is trouble.",
    "update/param_norm_change": "| ||theta_t|| - ||theta_(t-1)|| | / ||theta_(t-1)||, the exact parameter norm's "
    "relative change since the last step's (every element; absent right after a rollback). At most update/rel plus "
    "any change from outside the optimizer. Up is trouble.",
    "optim/lr": "Learning rate this step will use (largest over parameter groups; host float).",
    "optim/group<i>/lr": "Learning rate of parameter group i (only with several groups).",
    "optim/lr_vs_max": "Largest ratio, over groups, of this step's learning rate to the largest rate that group "
    "applied before (absent until that is > 0). <= 1 after a warm-up; up is trouble.",
    "optim/lr_growth": "When a group's learning rate exceeds every rate it applied before: its ratio to the smallest "
    "of its last 3 applied rates, else 1 (largest over groups). <= 4 for a linear warm-up after its first 3 steps, "
    "1 for decays and restarts; a jump or a compounding ramp is trouble.",
    "logp/<stat>": "Log-probability of the sampled tokens under the current policy (loss tokens): mean/min/max. A "
    "jump in the mean means the policy moved far from the one that sampled (collapse, blow-up, weight fault).",
    "group/no_signal_steps": "Consecutive optimizer steps whose latest generation batch (observe_samples with "
    "groups) had no group with differing rewards: nothing to learn from; up is trouble.",
    "loss/value": "Sum of the micro-batch losses fed this step, averaged over data-parallel ranks (NaN if any was "
    "non-finite).",
    "loss/nonfinite": "Number of non-finite micro-batch losses this step.",
    "tokens/count": "Loss tokens (mask = 1) seen this step.",
    "tokens/microbatches": "Micro-batches fed this step.",
    "input/<field>/nonfinite": "Masked entries of a token-batch field that are NaN or inf (excluded from statistics).",
    "guard/skipped_steps": "Cumulative optimizer steps skipped by the guard.",
    "guard/rollbacks": "Cumulative rollbacks performed.",
    "guard/fired": "Rules that fired this step.",
    "guard/internal_failures": "Cumulative internal failures of the guard itself (see docs/failure-policy.md).",
    "guard/unguarded": "1 while the guard has failed internally on max_internal_failures consecutive steps (its checks "
    "are not running), else 0. Anything but 0 needs attention.",
    "guard/host_ms": "The guard's own host time over the last step cycle (ms): its observe, check and step_done calls "
    "from the previous check to this one. Logged only: rules cannot read it (timings differ between ranks).",
    "guard/host_frac": "guard/host_ms over the wall time of that cycle: the share of the step the guard's calls took "
    "on this rank. Logged only, like guard/host_ms.",
}

# The guard's own timings: they differ between ranks and runs, so they are logged, never given to rules (every rank
# must take the same decision).
LOG_ONLY = ("guard/host_ms", "guard/host_frac")


def log_only(name: str) -> bool:
    return name.removeprefix("rl_guard/") in LOG_ONLY


def comparable(metrics: dict) -> dict:
    """The metrics without the guard's own timings: what two ranks, or two runs on the same data, agree on."""
    return {k: v for k, v in metrics.items() if not log_only(k)}


_PLACEHOLDERS = {
    "<stat>": "(?:" + "|".join(_RATIO_STATS + ("std", "zero_frac", "truncated_frac")) + ")",
    "<k>": "k[123]",
    "<bucket>": r"\d+(?:-\d+|\+)?",
    "<i>": r"\d+",
    "<field>": r"[a-z_]+",
    "<q>": "(?:" + "|".join(QUANTILE_NAMES) + ")",
    "<name>": r"[A-Za-z0-9_.+-]+",  # a user-chosen label (reward component, phase, drop reason, version)
}


def _regex(pattern: str) -> re.Pattern:
    body = re.escape(pattern)
    for ph, rx in _PLACEHOLDERS.items():
        body = body.replace(re.escape(ph), rx)
    return re.compile(body + r"\Z")


def all_patterns() -> dict[str, str]:
    return {**GLOSSARY, **DIAGNOSTIC_DOCS}


def is_known(name: str) -> bool:
    short = name.removeprefix("rl_guard/")
    return any(_regex(p).match(short) for p in all_patterns())


def example_names() -> list[str]:
    """Concrete names (placeholders filled with common values) used for 'did you mean' suggestions."""
    fills = {
        "<stat>": _RATIO_STATS + ("std", "zero_frac", "truncated_frac"),
        "<k>": ("k1", "k2", "k3"),
        "<bucket>": ("0", "1", "2", "3-4", "5-8", "9+"),
        "<i>": ("0", "1"),
        "<field>": ("logprobs", "old_logprobs", "ref_logprobs", "entropy", "advantages", "rewards"),
        "<q>": QUANTILE_NAMES,
    }
    names: list[str] = []
    for pattern in all_patterns():
        expanded = [pattern]
        for ph, values in fills.items():
            if any(ph in e for e in expanded):
                expanded = [e.replace(ph, v) for e in expanded for v in values]
        names.extend("rl_guard/" + e for e in expanded)
    return names


def closest(name: str) -> str | None:
    full = name if name.startswith("rl_guard/") else "rl_guard/" + name
    match = difflib.get_close_matches(full, example_names(), n=1, cutoff=0.5)
    return match[0] if match else None


def markdown() -> str:
    """The glossary as Markdown (``docs/glossary.md`` is generated from this; a test keeps them equal)."""
    lines = ["# rl_guard metric glossary", "", __doc__.strip(), "", "| metric | meaning |", "| --- | --- |"]
    for pattern, doc in all_patterns().items():
        cell = doc.replace("|", r"\|")
        lines.append(f"| `rl_guard/{pattern}` | {cell} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m rl_guard.glossary > docs/glossary.md
    print(markdown(), end="")
