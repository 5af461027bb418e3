"""OpenRLHF adapter pieces against the real openrlhf 0.11.2 ``Experience`` and ``PolicyLoss`` (loaded by path on CPU,
as OpenRLHF's own tests do). The real ``Actor`` + ``DeepspeedStrategy`` + ``ActorPPOTrainer.ppo_train`` with the
guard installed run in tests/adapters/openrlhf/ (their own environment, with OpenRLHF's pins)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from file_modules import load_module

from rl_guard import Guard
from rl_guard.adapters import openrlhf as adapter
from rl_guard.errors import GuardHalted

pytest.importorskip("openrlhf")
ROOT = Path(__file__).resolve().parents[2]


R = load_module("openrlhf_recipe", ROOT / "integrations" / "openrlhf" / "train.py")  # stand-ins + the real classes
OR = R.OR

SKIP_ON_MISMATCH = R.MISMATCH_RULE


def _yaml(action="skip_step", extra=""):
    return SKIP_ON_MISMATCH.format(action=action) + extra


def _random_experience(B=4, A=6, rollout=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, A, dtype=torch.bool)
    mask[:, 0] = False
    mask[1, 4:] = False
    old = (-torch.rand(B, A, generator=g) * 2) * mask
    exp = OR.Experience(
        sequences=torch.randint(0, 5, (B, A + 1), generator=g),
        attention_mask=torch.ones(B, A + 1, dtype=torch.long),
        action_mask=mask,
        action_log_probs=old,
        base_action_log_probs=(old + 0.3 * torch.randn(B, A, generator=g)) * mask,
        rollout_log_probs=(old + 0.2 * torch.randn(B, A, generator=g)) * mask if rollout else None,
        advantages=torch.randn(B, A, generator=g) * mask,
        rewards=torch.rand(B, generator=g),
        response_length=mask.sum(1).float(),
        truncated=torch.tensor([False, True, False, False]),
        info={"reward": torch.rand(B, generator=g)},
    )
    current = (old + 0.25 * torch.randn(B, A, generator=g)) * mask
    entropy = torch.rand(B, A + 3, generator=g)  # Actor.forward gives (B, T-1); the adapter keeps the last A
    return exp, current, entropy


def _masked_mean(x, mask):
    x, m = np.asarray(x, dtype=np.float64), np.asarray(mask, dtype=bool)
    return float(x[m].mean())


def test_field_list_matches_the_real_experience_dataclass():
    names = tuple(f.name for f in dataclasses.fields(OR.Experience))
    assert names == adapter.EXPERIENCE_FIELDS
    assert set(adapter.FIELDS_READ) <= set(names)
    for name in ("action_mask", "action_log_probs", "rollout_log_probs", "base_action_log_probs", "advantages"):
        assert OR.Experience.is_step_tensor_field(name)
    for name in ("rewards", "response_length", "truncated"):
        assert OR.Experience.is_episode_tensor_field(name)


@pytest.mark.filterwarnings("ignore:rl_guard.*cannot fire:RuntimeWarning")  # no optimizer: no grad/* metrics
def test_token_batch_from_real_experience_matches_policy_loss_and_float64(tmp_path):
    exp, current, entropy = _random_experience()
    loss_fn = OR.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, is_correction_level="token")
    guard = Guard.from_yaml("version: 1\nsinks: [jsonl]\n", run_dir=tmp_path)
    out = adapter.guard_policy_loss(guard, loss_fn, exp, current, entropy=entropy)
    direct = loss_fn(
        current,
        exp.action_log_probs,
        exp.advantages,
        action_mask=exp.action_mask,
        rollout_log_probs=exp.rollout_log_probs,
    )
    for a, b in zip(out, direct):
        assert torch.equal(a, b)  # PolicyLoss's own 5-tuple, unchanged
    guard.check()
    m, mask = guard.last_metrics, exp.action_mask.numpy()
    lp, old, roll = (t.double().numpy() for t in (current, exp.action_log_probs, exp.rollout_log_probs))
    ref = exp.base_action_log_probs.double().numpy()
    assert m["rl_guard/importance_weight/mean"] == pytest.approx(_masked_mean(np.exp(lp - old), mask), rel=1e-6)
    assert m["rl_guard/behave_imp_weight/mean"] == pytest.approx(_masked_mean(np.exp(old - roll), mask), rel=1e-6)
    assert m["rl_guard/ratio/mean"] == pytest.approx(_masked_mean(np.exp(lp - roll), mask), rel=1e-6)
    d = ref - lp
    assert m["rl_guard/kl_ref/k3_mean"] == pytest.approx(_masked_mean(np.exp(d) - d - 1, mask), rel=1e-5)
    assert m["rl_guard/clip/region_frac"] == pytest.approx(float(direct[1]), abs=1e-7)  # PolicyLoss clip_ratio
    assert m["rl_guard/entropy/mean"] == pytest.approx(_masked_mean(entropy[:, -6:].numpy(), mask), rel=1e-6)
    assert m["rl_guard/tokens/count"] == mask.sum()
    assert m["rl_guard/reward/mean"] == pytest.approx(float(exp.rewards.double().mean()), rel=1e-6)
    assert m["rl_guard/length/truncated_frac"] == 0.25


@pytest.mark.filterwarnings("ignore:rl_guard.*cannot fire:RuntimeWarning")  # no optimizer: no grad/* metrics
def test_without_rollout_logprobs_kl_old_k1_is_policy_loss_ppo_kl(tmp_path):
    exp, current, _ = _random_experience(rollout=False)
    loss_fn = OR.PolicyLoss()
    guard = Guard.from_yaml("version: 1\nsinks: [jsonl]\n", run_dir=tmp_path)
    _, clip_ratio, ppo_kl, vllm_kl, _ = adapter.guard_policy_loss(guard, loss_fn, exp, current)
    guard.check()
    assert vllm_kl is None and "rl_guard/behave_imp_weight/mean" not in guard.last_metrics
    assert guard.last_metrics["rl_guard/kl_old/k1_mean"] == pytest.approx(float(ppo_kl), rel=1e-5)
    assert guard.last_metrics["rl_guard/clip/region_frac"] == pytest.approx(float(clip_ratio), abs=1e-7)


def _other_policy():
    """A sampler that is not the trained policy (peaked logits), as vLLM serving the wrong weights would be."""
    other = R.TinyActor()
    with torch.no_grad():
        other.mlp[-1].weight.mul_(20.0)
    return other


def _stand_in(tmp_path, config, gas=2, seed=0):
    """Tiny actor + DeepSpeed-shaped engine/strategy from the recipe, the real PolicyLoss, the adapter's gate."""
    torch.manual_seed(seed)
    actor, other = R.TinyActor(), _other_policy()
    actor.model = R.Engine(actor, 3e-2, gas)
    strategy = R.TorchStrategy(SimpleNamespace(), accumulated_gradient=gas)
    guard = Guard.from_yaml(config, run_dir=tmp_path / "run")
    adapter.attach_checkpoints(
        guard, strategy, actor, actor.model.optimizer, actor.model.lr_scheduler, str(tmp_path / "ckpt")
    )
    adapter.gate_optimizer_step(strategy, actor, guard)
    loss_fn = OR.PolicyLoss(is_correction_level="token")
    return actor, other, strategy, guard, loss_fn


def _micro_step(actor, strategy, guard, loss_fn, sampler, gen):
    exp = R.make_experience(actor, actor, sampler, 2, 2, gen)
    info = OR.get_loss_batch_info(strategy, exp.action_mask)
    return R.training_step(actor, strategy, guard, loss_fn, exp, info)


def _weights(actor):
    return {k: v.clone() for k, v in actor.state_dict().items()}


def test_gate_decides_only_at_the_boundary_and_a_bad_rollout_batch_is_skipped(tmp_path):
    actor, other, strategy, guard, loss_fn = _stand_in(tmp_path, _yaml("skip_step"))
    gen = torch.Generator().manual_seed(0)
    before = _weights(actor)
    _micro_step(actor, strategy, guard, loss_fn, actor, gen)  # accumulating: no decision yet
    assert guard.step == 0 and actor.model.micro_steps == 1
    _micro_step(actor, strategy, guard, loss_fn, actor, gen)  # boundary: healthy, applied
    assert guard.step == 1 and actor.model.global_steps == 1
    assert any(not torch.equal(before[k], v) for k, v in actor.state_dict().items())
    applied = _weights(actor)
    _micro_step(actor, strategy, guard, loss_fn, other, gen)  # rollout log-probs of another policy
    _micro_step(actor, strategy, guard, loss_fn, other, gen)
    assert guard.step == 2 and actor.model.micro_steps == 4  # the engine's window still closed
    assert guard.controller.skipped_steps == 1 and guard.last_logged["rl_guard/guard/fired"] == 1.0
    assert guard.last_logged["rl_guard/behave_imp_weight/min"] < 0.5
    assert all(torch.equal(applied[k], v) for k, v in actor.state_dict().items())
    incidents = (tmp_path / "run" / "incidents.jsonl").read_text()
    assert '"rule": "train_rollout_mismatch"' in incidents and '"action": "skip_step"' in incidents


def test_rollback_restores_through_strategy_load_ckpt(tmp_path):
    config = _yaml("rollback", "snapshots: {healthy_steps: 1, every: 100, keep: 2, where: memory}\n")  # one, at 1
    actor, other, strategy, guard, loss_fn = _stand_in(tmp_path, config, gas=1)
    gen = torch.Generator().manual_seed(1)
    _micro_step(actor, strategy, guard, loss_fn, actor, gen)
    saved = tmp_path / "ckpt" / "rl_guard_step1" / "state.pt"
    assert saved.exists()  # the healthy snapshot is an OpenRLHF checkpoint (save_ckpt), guard state inside
    assert "rl_guard" in torch.load(saved, weights_only=False)["client_state"]
    snapshot = _weights(actor)
    _micro_step(actor, strategy, guard, loss_fn, actor, gen)  # healthy: applied, weights move
    assert any(not torch.equal(snapshot[k], v) for k, v in actor.state_dict().items())
    _micro_step(actor, strategy, guard, loss_fn, other, gen)  # bad batch: rollback via load_ckpt
    assert guard.controller.rollbacks == 1
    assert all(torch.equal(snapshot[k], v) for k, v in actor.state_dict().items())
    # the starting state (0) and the healthy snapshot restored (1): the tags the guard still offers
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir()) == ["rl_guard_step0", "rl_guard_step1"]


def test_halt_saves_through_save_ckpt_and_raises(tmp_path):
    actor, other, strategy, guard, loss_fn = _stand_in(tmp_path, _yaml("checkpoint_and_halt"), gas=1)
    gen = torch.Generator().manual_seed(2)
    with pytest.raises(GuardHalted, match="train_rollout_mismatch"):
        _micro_step(actor, strategy, guard, loss_fn, other, gen)
    state = torch.load(tmp_path / "ckpt" / "rl_guard_step0" / "state.pt", weights_only=False)
    fresh = Guard.from_yaml(_yaml("checkpoint_and_halt"), run_dir=tmp_path / "resumed")
    assert adapter.load_guard_state(fresh, state["client_state"])
