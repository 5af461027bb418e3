"""TRL beyond GRPO's default loss, on real trainers: RLOO's per-sequence old log-probs, loss types without a PPO
clip, and reward functions that return None ("does not apply")."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from file_modules import ROOT, load_module
from transformers import PrinterCallback

from rl_guard.adapters.trl import RLGuardCallback
from rl_guard.demo.tiny import prompt_dataset, repeat_last_digit_reward
from rl_guard.sinks.jsonl import read_jsonl

# the folder's conftest by path: a bare `import conftest` finds whichever folder's conftest was collected first
GRPO_BASE = load_module("tests_adapters_conftest", ROOT / "tests" / "adapters" / "conftest.py").GRPO_BASE
NO_RULES = "version: 1\nrules: []\n"


def train(trainer_cls, config_cls, tiny_model, tmp_path, rewards, guard=NO_RULES, steps=3, **overrides):
    callback = RLGuardCallback(guard, run_dir=str(tmp_path / "guard"))
    args = config_cls(output_dir=str(tmp_path / "trainer"), max_steps=steps, **{**GRPO_BASE, **overrides})
    trainer = trainer_cls(
        model=str(tiny_model),
        args=args,
        train_dataset=prompt_dataset(64, seed=0),
        reward_funcs=rewards,
        callbacks=[callback],
    )
    trainer.pop_callback(PrinterCallback)
    trainer.train()
    return trainer, callback


def test_rloo_reports_no_fabricated_ratio_and_says_why(tiny_model, tmp_path):
    from trl import RLOOConfig, RLOOTrainer

    rloo = {k: v for k, v in GRPO_BASE.items() if k not in ("beta",)}
    train(
        RLOOTrainer, RLOOConfig, tiny_model, tmp_path, [repeat_last_digit_reward], guard="grpo", **{**rloo, "beta": 0.0}
    )
    metrics = read_jsonl(tmp_path / "guard" / "metrics.jsonl")
    assert len(metrics) == 3
    for m in metrics:  # RLOO keeps one old log-prob per sequence: no per-token ratio may be invented
        assert not any(k.startswith(("rl_guard/ratio/", "rl_guard/kl_old/", "rl_guard/clip/")) for k in m)
        assert m["rl_guard/tokens/count"] > 0 and math.isfinite(m["rl_guard/grad/norm"])
    coverage = json.loads((tmp_path / "guard" / "coverage.json").read_text())
    rows = {r["rule"]: r for r in coverage["rules"]}
    assert (
        not rows["ratio_extreme"]["can_fire"] and "RLOOTrainer keeps only per-sequence" in rows["ratio_extreme"]["why"]
    )
    assert rows["entropy_spike"]["can_fire"]


@pytest.mark.parametrize("loss_type", ["sapo", "cispo"])
def test_losses_without_a_ppo_clip_report_no_clip_metrics(tiny_model, tmp_path, loss_type):
    from trl import GRPOConfig, GRPOTrainer

    train(GRPOTrainer, GRPOConfig, tiny_model, tmp_path, [repeat_last_digit_reward], guard="grpo", loss_type=loss_type)
    metrics = read_jsonl(tmp_path / "guard" / "metrics.jsonl")
    assert any("rl_guard/ratio/p50" in m for m in metrics)  # the ratio itself is still measured
    assert not any(k.startswith("rl_guard/clip/") for m in metrics for k in m)
    coverage = {r["rule"]: r for r in json.loads((tmp_path / "guard" / "coverage.json").read_text())["rules"]}
    clip_rules = [r for r in coverage.values() if any("clip/" in m for m in r["absent_metrics"])]
    assert clip_rules and all(f"loss_type={loss_type}" in r["why"] for r in clip_rules if not r["can_fire"])


def sometimes_none_reward(prompts, completions, **kwargs):
    """A task-specific reward: applies only to prompts whose last digit is even."""
    return [len(c.split()) / 8.0 if int_word(p.split()[-1]) % 2 == 0 else None for p, c in zip(prompts, completions)]


def int_word(w: str) -> int:
    return ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"].index(w)


def test_none_rewards_are_not_faults_but_a_returned_nan_is(tiny_model, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    trainer, _ = train(
        GRPOTrainer,
        GRPOConfig,
        tiny_model,
        tmp_path / "none",
        [repeat_last_digit_reward, sometimes_none_reward],
        guard="grpo",
    )
    incidents = (
        read_jsonl(tmp_path / "none" / "guard" / "incidents.jsonl")
        if (tmp_path / "none" / "guard" / "incidents.jsonl").exists()
        else []
    )
    assert not [i for i in incidents if i["rule"] == "nonfinite_rewards"]
    metrics = read_jsonl(tmp_path / "none" / "guard" / "metrics.jsonl")
    assert all(m.get("rl_guard/input/rewards/nonfinite", 0) == 0 for m in metrics)
    # The reward statistic is TRL's own (a None adds nothing): equal to TRL's logged reward mean.
    trl_logged = {h["step"]: h["reward"] for h in trainer.state.log_history if "reward" in h}
    guard_logged = {m["step"]: m["rl_guard/reward/mean"] for m in metrics if "rl_guard/reward/mean" in m}
    assert trl_logged and set(trl_logged) <= set(guard_logged), (sorted(trl_logged), sorted(guard_logged))
    for step, reward in trl_logged.items():
        np.testing.assert_allclose(guard_logged[step], reward, rtol=1e-5, err_msg=f"step {step}")

    def nan_when_applicable(prompts, completions, **kwargs):
        return [math.nan if r is not None else None for r in sometimes_none_reward(prompts, completions)]

    nan_when_applicable.__name__ = "nan_when_applicable"
    train(
        GRPOTrainer,
        GRPOConfig,
        tiny_model,
        tmp_path / "nan",
        [repeat_last_digit_reward, nan_when_applicable],
        guard="grpo",
    )
    incidents = read_jsonl(tmp_path / "nan" / "guard" / "incidents.jsonl")
    assert incidents and all(i["rule"] == "nonfinite_rewards" or i["action"] != "skip_step" for i in incidents)
    assert incidents[0]["rule"] == "nonfinite_rewards" and incidents[0]["decision"] in (
        "skip_step",
        "checkpoint_and_halt",
    )
