"""The TRL and transformers seams ``RLGuardCallback`` relies on, verified at attach (read against trl 1.16.0 and
transformers 5.25.0): a release that renames or re-signs one fails at attach with an error naming it, instead of
guarding less in silence. Nothing read from the trainer falls back to a default.
"""

from __future__ import annotations

from ..versions import check_range, describe, installed, require_attr, require_seam

TESTED = {"trl": ("1.16", "1.17"), "transformers": ("5.25", "5.26")}

# Every transformers Trainer: the loss (TokenBatch and loss), the pre-clip norm, the log line the metrics join.
TRAINER_METHODS = {"compute_loss": ("model", "inputs"), "_clip_grad_norm": ("model",), "log": ("logs",)}
# TRL's RL trainers (those with reward functions): log-probs and entropies of the loss, rewards per function.
RL_METHODS = {
    "_get_per_token_logps_and_entropies": (),
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
}
RL_ATTRS = (
    "eos_token_ids",
    "processing_class",
    "epsilon_low",
    "epsilon_high",
    "mask_truncated_completions",
    "reward_weights",
    "_buffered_inputs",
    "num_iterations",
    "beta",
    "use_vllm",
    "reward_funcs",
    "accelerator",
)
# With quarantine on: the raw dataset rows of a generation batch, before generation (trl_quarantine.py).
QUARANTINE_SEAM = "_generate_and_score_completions"
GRPO_ATTRS = ("loss_type", "importance_sampling_level", "vllm_importance_sampling_correction")
# RLOOTrainer (trl 1.16) has no such settings: its loss clips a sequence-level ratio, at the token level of sampling,
# with no vLLM importance-sampling correction. These are its design, not defaults for a missing value.
RLOO_SETTINGS = {
    "loss_type": "rloo",
    "importance_sampling_level": "token",
    "vllm_importance_sampling_correction": False,
}


def check_versions() -> None:
    """The tested range of trl (absent: fine, a plain transformers Trainer needs none) and transformers."""
    check_range("TRL", "trl", *TESTED["trl"], optional=True)
    check_range("TRL", "transformers", *TESTED["transformers"])


def _where() -> str:
    found = ", ".join(f"{p} {installed(p) or 'absent'}" for p in TESTED)
    tested = "; ".join(describe(p, *r) for p, r in TESTED.items())
    return f"{found}; tested: {tested}"


def is_rl_trainer(trainer) -> bool:
    return hasattr(type(trainer), "_calculate_rewards") or hasattr(trainer, "reward_funcs")


def is_rloo(trainer) -> bool:
    return any(c.__name__ == "RLOOTrainer" and c.__module__.startswith("trl.") for c in type(trainer).__mro__)


def check_seams(trainer, quarantine: bool = False) -> dict[str, object]:
    """Every method the callback wraps (with the parameters it reads by name) and every setting it reads; returns the
    methods to wrap. Raises ``SeamError`` naming the first missing or changed one."""
    where = _where()
    methods = dict(TRAINER_METHODS)
    if is_rl_trainer(trainer):
        methods.update(RL_METHODS)
        if quarantine:
            methods[QUARANTINE_SEAM] = ("inputs",)
            require_attr(trainer, ("train_dataset",), where=where)
        require_attr(trainer, RL_ATTRS, where=where)
        if not is_rloo(trainer):
            require_attr(trainer, GRPO_ATTRS, where=where)
    require_attr(trainer, ("callback_handler", "accelerator", "args"), where=where)
    return {name: require_seam(trainer, name, params=params, where=where) for name, params in methods.items()}


def settings(trainer) -> dict:
    """The loss settings the token statistics depend on, read from the trainer (RLOO: its fixed design)."""
    source = RLOO_SETTINGS if is_rloo(trainer) else {k: getattr(trainer, k) for k in GRPO_ATTRS}
    return {
        "loss_type": str(source["loss_type"]),
        "importance_sampling_level": str(source["importance_sampling_level"]),
        "vllm_importance_sampling_correction": bool(source["vllm_importance_sampling_correction"]),
    }
