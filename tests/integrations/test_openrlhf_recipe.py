"""The OpenRLHF recipe: OpenRLHF's own Experience / PolicyLoss / loss normaliser in a PPO actor update on CPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from file_modules import load_module

pytest.importorskip("openrlhf")
ROOT = Path(__file__).resolve().parents[2]


R = load_module("openrlhf_recipe", ROOT / "integrations" / "openrlhf" / "train.py")
MISMATCH = R.MISMATCH_RULE.format(action="skip_step")


def test_healthy_run_with_the_ppo_preset(tmp_path):
    res = R.run(str(ROOT / "configs" / "ppo.yaml"), steps=8, run_dir=str(tmp_path))
    assert res.steps_run == 8 and res.halted is None and res.incidents == []
    assert res.guard.step == 16  # 16 samples / micro-batch 4 = 4 training steps, gas 2 -> 2 optimizer steps each
    last = res.statuses[-1]
    assert last["is_filter_ratio"] == 0.0 and last["rl_guard/behave_imp_weight/max"] == 1.0  # sampler == trainer
    assert {"policy_loss", "rl_guard/kl_ref/k3_mean", "rl_guard/entropy/mean", "rl_guard/grad/norm"} <= set(last)
    assert all(math.isfinite(v) for k, v in last.items() if k.startswith("rl_guard/"))
    # The preset has rollback rules, so healthy snapshots are taken, as OpenRLHF checkpoints (strategy.save_ckpt).
    snap = tmp_path / "ckpt" / "_actor_rl_guard" / "rl_guard_step5" / "state.pt"
    assert "rl_guard" in torch.load(snap, weights_only=False)["client_state"]


def test_rollout_mismatch_is_skipped_from_the_first_bad_step(tmp_path):
    bad = R.run(MISMATCH, steps=12, fault="rollout_mismatch", fault_step=8, run_dir=str(tmp_path / "bad"))
    healthy = R.run(MISMATCH, steps=8, run_dir=str(tmp_path / "healthy"))
    assert [i["step"] for i in bad.incidents] == list(range(16, 24))  # every optimizer step after the fault
    assert {i["rule"] for i in bad.incidents} == {"train_rollout_mismatch"}
    assert bad.guard.controller.skipped_steps == 8 and all(s["is_filter_ratio"] > 0 for s in bad.statuses[8:])
    # No bad update reached the weights: they equal those of the run that stopped at the fault step.
    for a, b in zip(bad.actor.state_dict().values(), healthy.actor.state_dict().values()):
        assert torch.equal(a, b)
