"""Which of the guard's metrics a trainer's printed log line carries: the core set by default (every metric still
reaches wandb, tensorboard and the guard's own sinks). One line with all ~135 keys is ~5,000 characters."""

from __future__ import annotations

from collections.abc import Iterable

# What a person scanning the console needs to see a run drift: the update and its learning rate, the gradient,
# the policy's entropy and distance to the old / reference policy, rewards, lengths, and what the guard did.
CORE_METRICS: tuple[str, ...] = (
    "rl_guard/grad/norm",
    "rl_guard/update/rel",
    "rl_guard/optim/lr",
    "rl_guard/entropy/mean",
    "rl_guard/ratio/p99",
    "rl_guard/kl_old/k3_mean",
    "rl_guard/kl_ref/k3_mean",
    "rl_guard/clip/region_frac",
    "rl_guard/reward/mean",
    "rl_guard/length/truncated_frac",
    "rl_guard/guard/fired",
    "rl_guard/guard/skipped_steps",
    "rl_guard/guard/rollbacks",
    "rl_guard/guard/host_ms",
)
PRINTED_CHOICES = ("core", "all", "none")


def printed_keys(spec: str | Iterable[str]) -> frozenset[str] | None:
    """The guard keys a printed line keeps: ``"core"`` (CORE_METRICS), ``"all"`` (None: every key), ``"none"``, or
    an iterable of metric names."""
    if isinstance(spec, str):
        if spec not in PRINTED_CHOICES:
            raise ValueError(f"printed_metrics={spec!r}; allowed: {', '.join(PRINTED_CHOICES)} or a list of names")
        return None if spec == "all" else frozenset(CORE_METRICS if spec == "core" else ())
    return frozenset(spec)


def for_printing(logs: dict, keep: frozenset[str] | None) -> dict:
    """``logs`` without the guard's keys outside ``keep`` (other keys untouched)."""
    if keep is None:
        return logs
    return {k: v for k, v in logs.items() if not k.startswith("rl_guard/") or k in keep}
