"""Injected faults in the real plain-PyTorch GRPO recipe (integrations/pytorch_grpo/train.py), guarded by the
shipped preset: the right rule fires, the configured action happens, and no weight is ever non-finite."""

import copy
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from bitwise import assert_same
from file_modules import load_module

from rl_guard import Guard
from rl_guard.sinks import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "grpo.yaml")
recipe = load_module("pytorch_grpo_train", ROOT / "integrations" / "pytorch_grpo" / "train.py")
BUILTINS = {"nonfinite_loss", "nonfinite_grad", "nonfinite_logprobs"}
PRECURSORS = {
    "update_too_far",
    "ratio_extreme",
    "behaviour_mismatch",
    "grad_norm_spike",
    "grad_norm_vs_early_max",
    "update_too_aggressive",
    "lr_jump",
    "update_jump",
    "update_too_large",
    "entropy_spike",
    "reward_scale_jump",
}


def _without(d: dict, *keys) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


class Recorder:
    """``on_step`` callback: checks, at every optimizer step, what the guard's decision did to the real state."""

    def __init__(self, guard: Guard, lr_scale: float):
        self.guard, self.lr_scale = guard, lr_scale
        self.prev, self.refs, self.events = None, {}, []

    def __call__(self, step, it, decision, model, opt, sched):
        now = copy.deepcopy(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()),
            }
        )
        if decision.action in ("skip_step", "early_stop", "checkpoint_and_halt"):  # dropped update: nothing moved
            assert_same(self.prev["model"], now["model"], "model")
            assert_same(self.prev["optimizer"]["state"], now["optimizer"]["state"], "optimizer.state")
            for g_prev, g_now in zip(self.prev["optimizer"]["param_groups"], now["optimizer"]["param_groups"]):
                # the learning rate is the one thing an LR fault itself sets before the step
                assert_same(_without(g_prev, "lr"), _without(g_now, "lr"), "param_group")
            self.events.append((decision.action, step))
        if decision.rollback:
            # the newest snapshot older than the suspect update(s) (rollback.confirm_steps)
            horizon = self.guard.actions.rollback_horizon(decision.step)
            snap = max(s for s in self.guard.actions.snapshots.steps() if s < horizon)
            nth = 1 + sum(e[0] == "rollback" for e in self.events)  # the learning-rate scale compounds
            self._assert_restored(self.refs[snap], now, self.lr_scale**nth)
            self.events.append(("rollback", step, snap))
        steps = self.guard.actions.snapshots.steps()
        if steps and steps[-1] not in self.refs:  # a snapshot was just taken: remember what it must restore
            self.refs[steps[-1]] = now
        self.prev = now

    def _assert_restored(self, ref, now, scale):
        """Bitwise, except the learning rate, which a rollback scales by ``rollback.lr_scale``."""
        assert_same(ref["model"], now["model"], "model")
        assert_same(ref["optimizer"]["state"], now["optimizer"]["state"], "optimizer.state")
        for g_ref, g_now in zip(ref["optimizer"]["param_groups"], now["optimizer"]["param_groups"]):
            assert_same(_without(g_ref, "lr", "initial_lr"), _without(g_now, "lr", "initial_lr"), "param_group")
            assert g_now["lr"] == pytest.approx(scale * g_ref["lr"], rel=1e-12)
        assert_same(
            _without(ref["scheduler"], "base_lrs", "_last_lr"), _without(now["scheduler"], "base_lrs", "_last_lr")
        )
        assert now["scheduler"]["base_lrs"] == pytest.approx([scale * x for x in ref["scheduler"]["base_lrs"]])
        assert_same(ref["rng"], now["rng"], "rng")


def guarded_run(tmp_path, fault, steps, fault_step=10, seed=0):
    guard = Guard.from_yaml(CONFIG, run_dir=tmp_path / fault)
    rec = Recorder(guard, guard.config.rollback["lr_scale"])
    res = recipe.run(None, steps=steps, fault=fault, fault_step=fault_step, seed=seed, guard=guard, on_step=rec)
    assert res.params_finite_every_step  # checked after every optimizer step
    acting = [(s, a, _rules(m)) for s, a, m in res.decisions if a != "warn"]
    return res, rec, acting


def _rules(messages) -> list[str]:
    return [re.match(r"\[rule (\S+)\]", m).group(1) for m in messages]


def test_lr_blowup_rolls_back_to_the_healthy_snapshot(tmp_path):
    res, rec, acting = guarded_run(tmp_path, "lr_blowup", steps=14)
    ((step, action, rules),) = acting  # one rollback, then training goes on
    # The guard's update probe sees the learning rate jump before the update is applied (lr_jump).
    assert (step, action) == (10, "rollback") and "lr_jump" in rules
    assert [e[0] for e in rec.events] == ["rollback"] and rec.events[0][2] in rec.refs  # bitwise restore checked
    assert res.steps_run == 14 and res.guard.controller.rollbacks == 1


@pytest.mark.parametrize("fault, rule", [("inf_grad", "nonfinite_grad"), ("nan_reward", "nonfinite_rewards")])
def test_nonfinite_inputs_skip_the_step_bitwise(tmp_path, fault, rule):
    res, rec, acting = guarded_run(tmp_path, fault, steps=12)
    assert acting and all(s == 10 and a == "skip_step" for s, a, _ in acting)
    assert all(rule in rules for _, _, rules in acting)
    assert rec.events and all(e == ("skip_step", 10) for e in rec.events)  # weights and Adam moments untouched
    assert res.steps_run == 12 and res.guard.controller.skipped_steps == len(acting)


def test_behaviour_policy_mismatch_rolls_back_then_checkpoints_and_halts(tmp_path):
    res, rec, acting = guarded_run(tmp_path, "policy_mismatch", steps=16)
    assert [(s, a) for s, a, _ in acting] == [
        (10, "rollback"),
        (11, "rollback"),
        (12, "rollback"),
        (13, "checkpoint_and_halt"),
    ]
    assert all({"update_too_far", "ratio_extreme"} <= set(r) for _, _, r in acting[:3])
    assert "ratio_extreme" in acting[3][2]
    assert res.steps_run == 14 and res.guard.controller.rollbacks == 3  # max_rollbacks spent -> escalation
    # the fault came back before a new healthy snapshot: the second rollback went one snapshot further back
    assert rec.events[1][2] < rec.events[0][2]

    run_dir = tmp_path / "policy_mismatch"
    incidents = read_jsonl(run_dir / "incidents.jsonl")
    # Each record keeps its rule's own action; ``decision`` is what the guard did that step (after precedence).
    assert [i["decision"] for i in incidents if i["rule"] == "ratio_extreme"] == [
        "rollback",
        "rollback",
        "rollback",
        "checkpoint_and_halt",
    ]
    halt = [i for i in incidents if i["decision"] == "checkpoint_and_halt" and i["rule"] == "ratio_extreme"]
    metrics = {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl")}
    first = halt[0]
    assert first["rule"] == "ratio_extreme" and first["escalated_from"] == "rollback"
    assert first["message"].startswith(
        f"[rule ratio_extreme] rl_guard/ratio/p99 = {first['value']:.4g} > 2 "
        f"at step {first['step']} (rank 0) -> checkpoint_and_halt"
    )
    assert "rollback budget spent: 3 of max_rollbacks=3" in first["message"]
    before = [metrics[s]["rl_guard/ratio/p99"] for s in sorted(metrics) if s < first["step"]]
    assert first["window"]["rl_guard/ratio/p99"] == before[-32:]  # the values BEFORE the trigger
    assert first["value"] == metrics[first["step"]]["rl_guard/ratio/p99"] not in first["window"]
    ckpt_path = Path(first["checkpoint"])
    assert ckpt_path == run_dir / "checkpoints" / f"step_{first['step']:08d}" / "rank0.pt"
    ckpt = torch.load(ckpt_path, weights_only=True)
    assert {"model", "optimizer", "scheduler", "rng", "step", "guard"} <= set(ckpt)
    assert ckpt["step"] == first["step"] and ckpt["guard"]["controller"]["rollbacks"] == 3
    assert_same(rec.prev["model"], ckpt["model"])  # exactly the weights the run stopped with
    assert_same(rec.prev["optimizer"], ckpt["optimizer"])


@pytest.mark.parametrize("fault", ["lr_ramp", "reward_scale_ramp"])
def test_gradual_fault_is_caught_by_a_precursor_before_the_first_nonfinite(tmp_path, fault, capsys):
    twin = recipe.run(None, steps=40, fault=fault, fault_step=10, seed=0)  # unguarded, same seed
    S = twin.first_nonfinite_step
    assert S is not None and S < 40, "the ramp must reach a non-finite value within 40 steps"
    res, rec, acting = guarded_run(tmp_path, fault, steps=S)
    step, action, rules = acting[0]
    assert step < S
    assert not BUILTINS & set(rules) and set(rules) & PRECURSORS  # a precursor, not a non-finite check
    assert res.rewards[:step] == twin.rewards[:step]  # the twin really is the same run up to the action
    incident = next(i for i in read_jsonl(tmp_path / fault / "incidents.jsonl") if i["action"] != "warn")
    m = next(m for m in read_jsonl(tmp_path / fault / "metrics.jsonl") if m["step"] == incident["step"])
    assert m["rl_guard/loss/nonfinite"] == 0 and m["rl_guard/grad/nonfinite"] == 0
    assert math.isfinite(m["rl_guard/loss/value"]) and math.isfinite(m["rl_guard/grad/norm"])
    assert res.first_nonfinite_step is None or res.first_nonfinite_step > step  # weights finite too
    with capsys.disabled():
        print(
            f"\n[lead] {fault}: first non-finite (unguarded) at step {S}; guard acted at step {step} "
            f"({action} by {', '.join(sorted(set(rules) & PRECURSORS))}); lead = {S - step} steps"
        )


@pytest.mark.parametrize("seed", range(5))
def test_healthy_runs_take_no_action(tmp_path, seed):
    res, rec, acting = guarded_run(tmp_path, "none", steps=30, seed=seed)
    assert acting == [] and rec.events == []  # warnings allowed, nothing else
    assert res.steps_run == 30 and res.guard.controller.skipped_steps == 0 and res.guard.controller.rollbacks == 0
    assert sum(res.rewards[-5:]) > sum(res.rewards[:5])  # and it is really learning
