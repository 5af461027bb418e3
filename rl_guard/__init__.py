"""rl_guard: guardrails inside RL training of language models.

Device-side health statistics every optimizer step, YAML guardrail rules, and actions taken before
``optimizer.step()`` (warn, skip the step, stop early, checkpoint and halt, roll back).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Imported on first use, so light entry points (``rl-guard validate``) do not pay for torch.
_EXPORTS = {
    "Guard": ".guard",
    "TokenBatch": ".stats.batch",
    "BatchError": ".stats.batch",
    "EmptyMaskError": ".stats.batch",
    "ConfigError": ".errors",
    "GuardConfig": ".control.config",
    "load_config": ".control.config",
    "Decision": ".control.controller",
    "Action": ".control.action_names",
    "SampleBatch": ".diagnostics",
    # the exceptions a user meets: a wrong input (InputError, SampleError), ranks that disagree, a halted loop
    "InputError": ".errors",
    "SampleError": ".diagnostics",
    "RankMismatch": ".stats.accumulate",
    "GuardHalted": ".errors",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'rl_guard' has no attribute {name!r}")
