"""A reward function that fails (NaN) for a few specific prompts only, under TRL's defaults and the shipped preset.

Without quarantine the guard drops the update every time one of those prompts comes back; with ``quarantine:
{enabled: true}`` each is skipped once, quarantined (replaced before generation from then on), and the run completes
its steps with no further action and finite weights. Every acting incident names its culprit sequences and has a
bundle under ``incidents/<step>/``; a reward function broken for many prompts halts instead of being stepped around."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rl_guard.sinks.jsonl import read_jsonl

pytestmark = pytest.mark.slow

STEPS = 48  # 1.5 epochs of 64 prompts at 2 prompts per step: each prompt comes back


def _dataset():
    from rl_guard.demo.tiny import prompt_dataset

    return prompt_dataset(64, seed=0)


def _reward_failing_for(bad: set[str]):
    from rl_guard.demo.tiny import repeat_last_digit_reward

    def reward(prompts, completions, **kwargs):
        good = repeat_last_digit_reward(prompts, completions)
        return [math.nan if p in bad else r for p, r in zip(prompts, good)]

    return reward


def _run(tmp: Path, tiny_model, bad: set[str], quarantine: bool):
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_guard.adapters.trl import RLGuardCallback
    from rl_guard.control.yaml_nodes import PRESETS
    from rl_guard.demo.tiny import TINY_GRPO

    yaml = (PRESETS / "grpo.yaml").read_text() + ("\nquarantine: {enabled: true}\n" if quarantine else "")
    callback = RLGuardCallback(yaml, run_dir=str(tmp / "guard"))
    args = GRPOConfig(
        output_dir=str(tmp / "out"),
        max_steps=STEPS,
        **TINY_GRPO,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        learning_rate=1e-4,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=str(tiny_model),
        args=args,
        train_dataset=_dataset(),
        reward_funcs=[_reward_failing_for(bad)],
        callbacks=[callback],
    )
    trainer.pop_callback(PrinterCallback)
    trainer.train()
    incidents = read_jsonl(tmp / "guard" / "incidents.jsonl")
    return trainer, callback, [i for i in incidents if i["action"] != "warn"]


@pytest.fixture(scope="module")
def bad_prompts():
    prompts = list(dict.fromkeys(_dataset()["prompt"]))
    return {prompts[5], prompts[20], prompts[41]}


def test_quarantine_steps_around_a_few_failing_prompts(tmp_path, tiny_model, bad_prompts):
    trainer, callback, acted = _run(tmp_path / "off", tiny_model, bad_prompts, quarantine=False)
    assert {i["rule"] for i in acted} == {"nonfinite_rewards"}
    skips_without = len(acted)
    culprit_prompts = [{c["prompt"] for c in i["culprits"]} for i in acted]
    assert all(found and found <= bad_prompts for found in culprit_prompts)  # each incident names its culprits
    assert len(acted) > len(bad_prompts)  # the same prompts came back and were dropped again
    assert trainer.state.global_step == STEPS

    trainer, callback, acted = _run(tmp_path / "on", tiny_model, bad_prompts, quarantine=True)
    run_dir = tmp_path / "on" / "guard"
    quarantined = [json.loads(x)["prompt"] for x in (run_dir / "quarantine.jsonl").read_text().splitlines()]
    assert set(quarantined) == bad_prompts and len(quarantined) == len(bad_prompts)
    assert len(acted) == len(bad_prompts) < skips_without  # each failing prompt skipped once, then never seen again
    assert [i["decision"] for i in acted] == ["skip_step"] * len(bad_prompts)
    assert sorted(p for i in acted for p in i["quarantined"]) == sorted(bad_prompts)
    assert trainer.state.global_step == STEPS and callback.stopped is None
    assert callback._gate.replaced > 0  # the prompts came back in the sampler and were replaced before generation
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    for incident in acted:  # the bundle names the failing prompts, with rewards per function and the rules' window
        bundle = json.loads((Path(incident["bundle"]) / "bundle.json").read_text())
        rule = next(r for r in bundle["rules"] if r["rule"] == "nonfinite_rewards")
        assert {c["prompt"] for c in rule["culprits"]} <= bad_prompts and rule["culprits"]
        assert all(c["nonfinite"] and c["completion_ids"] for c in rule["culprits"])
        assert bundle["learning_rates"] and rule["window"]
        assert (Path(incident["bundle"]) / "rng.pt").is_file()
        assert sum(p.stat().st_size for p in Path(incident["bundle"]).iterdir()) < 256 * 1024
    # the quarantine travels in the guard's state
    state = callback.guard.state_dict()["quarantine"]["keys"]
    assert {v["prompt"] for v in state.values()} == bad_prompts


def test_a_reward_broken_for_many_prompts_halts(tmp_path, tiny_model):
    prompts = list(dict.fromkeys(_dataset()["prompt"]))
    trainer, callback, acted = _run(tmp_path, tiny_model, set(prompts[::4]), quarantine=True)  # 25 % of the data
    assert callback.stopped is not None and callback.stopped["decision"] == "checkpoint_and_halt"
    assert "over quarantine.max_share=0.1" in callback.stopped["escalation_reason"]
    assert trainer.state.global_step < STEPS


def test_report_and_replay_show_bundles_and_quarantined_prompts(tmp_path, tiny_model, bad_prompts, capsys):
    pytest.importorskip("matplotlib")
    from rl_guard.cli import main

    _run(tmp_path, tiny_model, bad_prompts, quarantine=True)
    run_dir = tmp_path / "guard"
    assert main(["report", str(run_dir)]) == 0
    report = next(run_dir.rglob("report.md")).read_text()
    assert "## Incident bundles" in report and "## Quarantined prompts" in report
    assert all(p in report for p in bad_prompts)
    capsys.readouterr()
    assert main(["replay", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "live incident bundles (3" in out and "quarantined prompts (3" in out
    assert all(p in out for p in bad_prompts)
