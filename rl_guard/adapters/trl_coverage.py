"""Which rules can fire in this trainer configuration, decided once when the TRL adapter attaches.

A rule watching a metric the configuration never produces, or produces as a constant, is silent for reasons that
have nothing to do with the run's health. The adapter says so at step 0 (one console block, ``coverage.json`` and
``coverage.txt`` in the run directory) instead of a missing-metric warning 20 steps later.

TRL 1.16 facts used (``GRPOTrainer._generate_and_score_completions`` / ``_compute_loss``):
- ``old_per_token_logps`` is computed only when ``gradient_accumulation_steps % (steps_per_generation x
  num_iterations) != 0`` or with vLLM importance-sampling correction; otherwise the loss uses the detached current
  log-probs, so the ratio is exactly 1, ``kl_old`` exactly 0 and nothing is ever clipped;
- ``ref_per_token_logps`` exists only when ``beta != 0`` (no reference model otherwise);
- ``sampling_per_token_logps`` (sampler vs trainer) only with vLLM;
- the trainer clips gradients only when ``max_grad_norm > 0`` (else there is no post-clip norm).
"""

from __future__ import annotations

import json
from pathlib import Path

PREFIX = "rl_guard/"
ON_POLICY_FAMILIES = ("ratio/", "seq_ratio/", "kl_old/", "clip/")
PPO_CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # clip r to [1 - eps_low, 1 + eps_high] (TRL 1.16)


def trainer_configuration(trainer) -> dict:
    """The settings that decide which statistics exist (a plain transformers Trainer has no GRPO settings)."""
    args = trainer.args
    grpo = hasattr(trainer, "num_iterations") and hasattr(args, "steps_per_generation")
    name = type(trainer).__name__
    # RLOOTrainer keeps one old log-prob per sequence (old_logps), never per token.
    cfg = {
        "trainer": name,
        "grpo": grpo,
        "sequence_old_logps": name == "RLOOTrainer",
        "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
        "max_grad_norm": float(args.max_grad_norm or 0.0),
    }
    if grpo:
        from .trl_seams import settings  # verified at attach (check_seams): no default stands in for a value

        cfg.update(
            num_iterations=int(trainer.num_iterations),
            steps_per_generation=int(args.steps_per_generation),
            beta=float(trainer.beta),
            use_vllm=bool(trainer.use_vllm),
            **settings(trainer),
        )
    return cfg


def _keeps_old_logps(cfg: dict) -> bool:
    every = cfg["steps_per_generation"] * cfg["num_iterations"]
    return cfg["gradient_accumulation_steps"] % every != 0 or (
        cfg["use_vllm"] and cfg["vllm_importance_sampling_correction"]
    )


def metric_status(metric: str, cfg: dict) -> tuple[str, str]:
    """``(status, why)``: status is ``produced``, ``constant`` (reported, but fixed by the configuration: only a
    non-finite value can fire) or ``absent`` (never reported in this configuration)."""
    name = metric.removeprefix(PREFIX)
    if name.startswith("grad/norm_postclip") and cfg["max_grad_norm"] <= 0:
        return "absent", "max_grad_norm=0: the trainer does not clip, so there is no post-clip norm"
    if name.startswith("lag/"):
        return "absent", "TRL does not tag tokens with a policy version"
    if not cfg["grpo"]:
        if name.split("/")[0] in ("grad", "loss", "update", "optim", "guard"):
            return "produced", ""
        return "absent", f"{cfg['trainer']} is not a GRPOTrainer: no token batch, rewards or samples reach the guard"
    if name.startswith(("behave_imp_weight/", "importance_weight/")) and not cfg["use_vllm"]:
        return "absent", "no vLLM sampler: TRL has no sampling log-probs separate from the trainer's"
    if name.startswith("kl_ref/") and cfg["beta"] == 0:
        return "absent", "beta=0: TRL loads no reference model, so there is no reference KL"
    if name.startswith(ON_POLICY_FAMILIES) and cfg.get("sequence_old_logps"):
        return "absent", (
            "RLOOTrainer keeps only per-sequence old log-probs (old_logps): no per-token ratio, "
            "kl_old or clip statistics"
        )
    if name.startswith("clip/") and cfg["loss_type"] not in PPO_CLIP_LOSSES:
        return "absent", (
            f"loss_type={cfg['loss_type']} does not clip the ratio to [1 - epsilon_low, 1 + "
            "epsilon_high]: the clip metrics are not computed (TRL logs its own for cispo)"
        )
    if name.startswith("seq_ratio/") and cfg["importance_sampling_level"] == "sequence" and _keeps_old_logps(cfg):
        return "produced", ""
    if name.startswith(ON_POLICY_FAMILIES) and not _keeps_old_logps(cfg):
        return "constant", (
            f"fully on-policy (gradient_accumulation_steps={cfg['gradient_accumulation_steps']} is a "
            f"multiple of steps_per_generation x num_iterations = {cfg['steps_per_generation']} x "
            f"{cfg['num_iterations']}): the ratio is exactly 1, kl_old exactly 0, nothing is clipped"
        )
    return "produced", ""


def rule_coverage(rules, cfg: dict) -> list[dict]:
    """Per rule: can it fire here, and if not, why (composites: ``all`` needs every metric, ``any`` one)."""
    out = []
    for rule in rules:
        statuses = [(m, *metric_status(m, cfg)) for m in rule.metrics]
        live = [s for s in statuses if s[1] == "produced"]
        can = len(live) == len(statuses) if rule.mode == "all" else bool(live)
        dead = [s for s in statuses if s[1] != "produced"]
        why = "; ".join(
            f"{m.removeprefix(PREFIX)} {'is never reported' if st == 'absent' else 'is constant'}: {w}"
            for m, st, w in dead
        )
        nonfinite_only = not can and any(st == "constant" for _, st, _ in dead)
        out.append(
            {
                "rule": rule.name,
                "action": rule.action,
                "can_fire": can,
                "only_on_nonfinite": nonfinite_only,
                "why": why if not can else "",
                "absent_metrics": [m for m, st, _ in statuses if st == "absent"],
            }
        )
    return out


def render(cfg: dict, coverage: list[dict]) -> str:
    shown = {k: v for k, v in cfg.items() if k != "grpo"}
    if not shown.get("use_vllm"):
        shown.pop("vllm_importance_sampling_correction", None)
    lines = ["rl_guard coverage for " + ", ".join(f"{k}={v}" for k, v in shown.items())]
    for row in coverage:
        if row["can_fire"]:
            lines.append(f"  can fire     {row['rule']} ({row['action']})")
    for row in coverage:
        if not row["can_fire"]:
            label = "non-finite only" if row["only_on_nonfinite"] else "cannot fire"
            lines.append(f"  {label:<12} {row['rule']} ({row['action']}): {row['why']}")
    return "\n".join(lines)


def write_coverage(run_dir: Path, cfg: dict, coverage: list[dict]) -> str:
    text = render(cfg, coverage)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "coverage.json").write_text(
        json.dumps({"configuration": cfg, "rules": coverage}, indent=1) + "\n", encoding="utf-8"
    )
    (run_dir / "coverage.txt").write_text(text + "\n", encoding="utf-8")
    return text
