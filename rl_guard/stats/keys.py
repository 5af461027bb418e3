"""Every internal statistic key, declared once.

Probes write ``<family>.<field>`` entries into a ``Partial``, ranks merge them, ``summarize`` reads them. Both
sides name keys through this module, so a typo is an ``AttributeError`` (or a ``KeyError`` naming the declared
families) at the first step instead of a metric that silently never appears.
"""

from __future__ import annotations

KL_ESTIMATORS = ("k1", "k2", "k3")


class Family:
    """The keys of one statistics family: ``Family("ratio").count == "ratio.count"``. Its fields are declared once,
    here (not every family carries every field)."""

    name: str
    count: str
    sum: str
    sumsq: str
    min: str
    max: str
    logmin: str
    logmax: str
    hist: str
    zero: str
    truncated: str  # value / ratio
    seqs: str
    tokens: str
    k3: str  # KL: sequence count and per-sequence accumulators
    low: str
    high: str
    clip: str  # clip regions, per-lag clip counts
    microbatches: str
    empty_microbatches: str
    ranks: str
    nonfinite: str  # tokens / loss bookkeeping
    sq: str
    max_abs: str
    preclip_sq: str  # gradients
    base_sq: str
    param_sq: str
    drift_sq: str
    changed: str
    prev_param_sq: str  # update probe (stats/update.py)
    slots: str
    cells: str
    cells_k3: str  # per-lag-slot counts before they are mapped to buckets (stats/lags.py)

    def __init__(self, name: str) -> None:
        self.name = name
        for f in FIELDS:
            setattr(self, f, f"{name}.{f}")

    def estimator(self, k: str, what: str) -> str:
        """KL estimator keys: ``what`` is ``sum`` (over tokens), ``seqsum`` or ``seqmax`` (over sequences)."""
        if k not in KL_ESTIMATORS or what not in ("sum", "seqsum", "seqmax"):
            raise KeyError(f"no KL estimator key {k}.{what}")
        return f"{self.name}.{k}.{what}"


FIELDS = tuple(f for f in Family.__annotations__ if f != "name")


RATIO_FAMILIES = ("ratio", "seq_ratio", "importance_weight", "behave_imp_weight")
KL_FAMILIES = ("kl_old", "kl_ref")
_FAMILIES = {
    n: Family(n)
    for n in (
        *RATIO_FAMILIES,
        *KL_FAMILIES,
        "entropy",
        "clip",
        "adv",
        "length",
        "reward",
        "tokens",
        "lag",
        "loss",
        "grad",
        "update",
        "logp",
    )
}
RATIO, SEQ_RATIO, IMPORTANCE_WEIGHT, BEHAVE_IMP_WEIGHT = (_FAMILIES[n] for n in RATIO_FAMILIES)
KL_OLD, KL_REF = (_FAMILIES[n] for n in KL_FAMILIES)
ENTROPY, CLIP, ADV, LENGTH, REWARD = (_FAMILIES[n] for n in ("entropy", "clip", "adv", "length", "reward"))
TOKENS, LAG, LOSS, GRAD = (_FAMILIES[n] for n in ("tokens", "lag", "loss", "grad"))
UPDATE, LOGP = _FAMILIES["update"], _FAMILIES["logp"]

INPUT_PREFIX, NONFINITE_SUFFIX = "input.", ".nonfinite"
GRAD_GROUP_PREFIX = "grad.group"
UPDATE_GROUP_PREFIX = "update.group"


def of(name: str) -> Family:
    """The declared family ``name``."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"undeclared statistics family {name!r}; declared: {sorted(_FAMILIES)}") from None


def input_nonfinite(field: str) -> str:
    """Masked entries of token-batch field ``field`` that are NaN or inf."""
    return f"{INPUT_PREFIX}{field}{NONFINITE_SUFFIX}"


def grad_group(i: int) -> str:
    """Sum of squared gradients of optimizer parameter group ``i``."""
    return f"{GRAD_GROUP_PREFIX}{i}.sq"


def update_group(i: int, field: str) -> str:
    """Update-probe figure ``field`` (sq, base_sq, param_sq, lr) of optimizer parameter group ``i``."""
    if field not in ("sq", "base_sq", "param_sq", "lr"):
        raise KeyError(f"no update-group field {field!r}")
    return f"{UPDATE_GROUP_PREFIX}{i}.{field}"
