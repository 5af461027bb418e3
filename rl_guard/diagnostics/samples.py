"""Per-sample input of the run diagnostics (one generation batch) and its validated float64 view.

Every field is optional; each family reports only when the fields it needs are present. Per-sample fields accept
lists, numpy arrays or CPU tensors and must all have the same length n.

Exclusion rule, shared by every family: a sample whose termination is a system error (environment_error,
verifier_error, infrastructure_error) is *not* a policy failure. It is never folded into reward 0: it is left
out of reward, outcome, group and critic statistics and only counted in ``term/`` rates and the budgets, so
system availability never enters the policy-gradient signal. Non-finite rewards are left out the same way and
counted in ``reward/nonfinite_count``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError


class SampleError(InputError):
    """A ``SampleBatch`` (or a budget / funnel figure passed with it) that does not satisfy its contract."""


TERMINATIONS = (
    "success",
    "task_failure",
    "invalid_action",
    "timeout",
    "truncated_budget",
    "environment_error",
    "verifier_error",
    "infrastructure_error",
)
SYSTEM_ERRORS = ("environment_error", "verifier_error", "infrastructure_error")
PER_SAMPLE = (
    "ids",
    "group_ids",
    "rewards",
    "outcome",
    "lengths",
    "truncated",
    "termination",
    "texts",
    "prompts",
    "advantages",
    "values",
    "returns",
    "versions",
)


@dataclass
class SampleBatch:
    """One generation batch, per sample unless noted. ``outcome`` is an independent success signal (>= 0.5 =
    success), e.g. a held-out verifier that is not part of the training reward."""

    ids: Any = None
    group_ids: Any = None  # prompt id (GRPO / RLOO groups)
    rewards: Any = None  # total training reward
    reward_components: dict[str, Any] | None = None
    outcome: Any = None
    lengths: Any = None  # response tokens
    truncated: Any = None  # True = no EOS
    termination: Any = None  # strings from TERMINATIONS
    texts: Any = None
    prompts: Any = None
    advantages: Any = None
    values: Any = None  # critic V(s0)
    returns: Any = None  # realised return G
    versions: Any = None  # policy version that generated the sample
    funnel: dict[str, int] | None = None  # per batch: count per funnel layer
    drop_reasons: dict[str, int] | None = None  # per batch: dropped samples per reason
    episodes: int | None = None
    rollout_tokens: int | None = None
    train_tokens: int | None = None
    phase_seconds: dict[str, float] | None = None


def label(x: Any) -> str:
    """Metric-name-safe label: integral numbers without '.0', other characters outside [A-Za-z0-9_.+-] -> '_'."""
    if isinstance(x, (float, np.floating)) and float(x).is_integer():
        x = int(x)
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", str(x)) or "_"


def json_value(x: Any) -> Any:
    """Python scalar for JSON: numpy scalars unwrapped, non-finite floats -> None."""
    if isinstance(x, np.generic):  # numpy scalars only: diagnostics run on host copies
        x = x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x if isinstance(x, (int, float, str, bool, type(None))) else str(x)


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor; half types have no numpy dtype
        x = x.detach().cpu()
        x = x.float() if str(x.dtype) in ("torch.bfloat16", "torch.float16") else x
        x = x.numpy()
    return np.asarray(x)


def _floats(x: Any, name: str) -> np.ndarray:
    a = _numpy(x)
    if a.ndim != 1:
        raise SampleError(f"SampleBatch.{name} must be one value per sample (1-D), got shape {a.shape}")
    return a.astype(np.float64)


def _objects(x: Any) -> list:
    a = _numpy(x) if hasattr(x, "detach") or isinstance(x, np.ndarray) else x
    if isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype != object:
        return a.tolist()  # python scalars, as .item() gives for each element
    return [v.item() if isinstance(v, np.generic) else v for v in list(a)]  # host numpy values (see _numpy)


def _length(x: Any) -> int:
    """len(_objects(x)) without converting x."""
    if isinstance(x, (list, tuple)):
        return len(x)
    if (hasattr(x, "detach") or isinstance(x, np.ndarray)) and len(x.shape):
        return x.shape[0]
    return len(_objects(x))


class Prepared:
    """Validated view: float64 arrays, python lists, masks. Absent fields are None."""

    def __init__(self, s: SampleBatch):
        lengths = {f: _length(getattr(s, f)) for f in PER_SAMPLE if getattr(s, f) is not None}
        for c, v in (s.reward_components or {}).items():
            lengths[f"reward_components[{c!r}]"] = _length(v)
        if len(set(lengths.values())) > 1:
            raise SampleError(f"SampleBatch per-sample fields differ in length: {lengths}")
        n = self.n = next(iter(lengths.values()), 0)
        self.ids = _objects(s.ids) if s.ids is not None else list(range(n))
        self.rewards = _floats(s.rewards, "rewards") if s.rewards is not None else None
        self.components = {
            label(c): _floats(v, f"reward_components[{c!r}]") for c, v in (s.reward_components or {}).items()
        }
        self.outcome = _floats(s.outcome, "outcome") if s.outcome is not None else None
        self.lengths = _floats(s.lengths, "lengths") if s.lengths is not None else None
        self.truncated = _floats(s.truncated, "truncated") != 0 if s.truncated is not None else None
        self.advantages = _floats(s.advantages, "advantages") if s.advantages is not None else None
        self.values = _floats(s.values, "values") if s.values is not None else None
        self.returns = _floats(s.returns, "returns") if s.returns is not None else None
        self.texts = _objects(s.texts) if s.texts is not None else None
        self.prompts = _objects(s.prompts) if s.prompts is not None else None
        self.versions = [label(v) for v in _objects(s.versions)] if s.versions is not None else None
        self.termination = None
        if s.termination is not None:
            self.termination = [str(t) for t in _objects(s.termination)]
            bad = sorted({t for t in self.termination if t not in TERMINATIONS})
            if bad:
                raise SampleError(f"unknown termination {bad}; allowed: {', '.join(TERMINATIONS)}")
        # Group labels in order of first appearance (ids may be strings or numbers, unsortable together).
        self.group = self.group_ids = None
        if s.group_ids is not None:
            codes: dict = {}
            self.group_ids = _objects(s.group_ids)
            self.group = np.array([codes.setdefault(g, len(codes)) for g in self.group_ids], dtype=np.int64)
        self.system_error = (
            np.array([t in SYSTEM_ERRORS for t in self.termination], dtype=bool)
            if self.termination is not None
            else np.zeros(n, dtype=bool)
        )
        self.ok = ~self.system_error  # samples that may enter reward / outcome / critic statistics
        # Masks are arrays even for an absent field (all False then); readers test the field, not the mask.
        self.reward_ok = self.ok & np.isfinite(self.rewards) if self.rewards is not None else np.zeros(n, dtype=bool)
        self.outcome_ok = self.ok & np.isfinite(self.outcome) if self.outcome is not None else np.zeros(n, dtype=bool)
        self.success = self.outcome >= 0.5 if self.outcome is not None else np.zeros(n, dtype=bool)
