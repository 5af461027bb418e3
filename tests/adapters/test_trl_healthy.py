"""A healthy guarded GRPO run: metric names and values, one host transfer per step, no host reads elsewhere,
and the importance ratio exactly 1 on-policy but not with a second pass over the rollouts."""

from __future__ import annotations

import collections
import math
import os
import sys
from contextlib import contextmanager

import pytest
import torch

import rl_guard
from rl_guard import glossary
from rl_guard.demo.run import demo_config

STEPS = 8
TORCH_DIR = os.path.dirname(torch.__file__)
GUARD_DIR = os.path.dirname(rl_guard.__file__)
# Every way a tensor's value reaches Python (or the host) from a method call.
SYNC_METHODS = ("cpu", "numpy", "item", "tolist", "__bool__", "__float__", "__int__", "__index__")


def _in_generation(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "_generate_and_score_completions":
            return True
        frame = frame.f_back
    return False


@contextmanager
def host_reads_from_guard():
    """Counts calls of ``SYNC_METHODS`` whose nearest caller outside torch is in the rl_guard package, keyed by
    (phase, method, file, function); phase is "generation" inside TRL's rollout generation, else "train"."""
    calls: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def spy(name, original):
        def method(self, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(GUARD_DIR):
                where = os.path.relpath(frame.f_code.co_filename, GUARD_DIR)
                phase = "generation" if _in_generation(frame) else "train"
                calls[(phase, name, where, frame.f_code.co_name)] += 1
            return original(self, *args, **kwargs)

        return method

    for name, original in originals.items():
        setattr(torch.Tensor, name, spy(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.fixture(scope="module")
def healthy(grpo_run, tmp_path_factory):
    from rl_guard.stats.accumulate import StepAccumulator

    finishes = []
    original_finish = StepAccumulator.finish

    def finish(self, *args, **kwargs):
        finishes.append(1)
        return original_finish(self, *args, **kwargs)

    StepAccumulator.finish = finish
    try:
        with host_reads_from_guard() as calls:
            run = grpo_run(tmp_path_factory.mktemp("healthy"), STEPS, guard=demo_config("rollback", console_every=None))
    finally:
        StepAccumulator.finish = original_finish
    return run, dict(calls), len(finishes)


def test_no_action_and_every_step_guarded(healthy):
    run, _, _ = healthy
    acted = [i for i in run.incidents() if i["action"] != "warn"]
    assert acted == []
    assert run.trainer.state.global_step == STEPS and run.guard.step == STEPS
    assert run.guard.controller.skipped_steps == 0 and run.guard.controller.rollbacks == 0
    assert [m["step"] for m in run.metrics()] == list(range(STEPS))
    assert run.checker.steps_checked == STEPS


def test_metrics_in_trainer_logs_with_documented_names(healthy):
    run, _, _ = healthy
    logs = [h for h in run.trainer.state.log_history if "loss" in h]
    assert len(logs) == STEPS
    by_step = {m["step"]: m for m in run.metrics()}
    required = ["ratio/p99", "ratio/p50", "ratio/min", "ratio/max", "kl_ref/k3_mean", "kl_old/k3_mean",
                "entropy/mean", "clip/region_frac", "grad/norm", "grad/norm_preclip", "loss/value", "adv/std",
                "length/truncated_frac", "guard/skipped_steps"]
    for log in logs:
        names = [k for k in log if k.startswith("rl_guard/")]
        missing = [n for n in required if "rl_guard/" + n not in log]
        assert not missing, f"step {log['step']}: missing {missing}"
        assert all(glossary.is_known(n) for n in names), [n for n in names if not glossary.is_known(n)]
        # The log of trainer step s (counted after the step) carries the guard's record of that step (s - 1).
        record = by_step[log["step"] - 1]
        for n in names:
            assert log[n] == record[n] or (math.isnan(log[n]) and math.isnan(record[n])), n


def test_metric_values_agree_with_trl(healthy):
    """Same quantities computed independently by TRL (float32) and by the guard (float64 sums)."""
    run, _, _ = healthy
    logs = [h for h in run.trainer.state.log_history if "loss" in h]
    compared_kl = 0
    for log in logs:
        assert log["rl_guard/grad/norm_preclip"] == pytest.approx(log["grad_norm"], rel=1e-5)
        assert log["rl_guard/grad/norm"] <= run.trainer.args.max_grad_norm * (1 + 1e-5)
        assert log["rl_guard/grad/norm"] == pytest.approx(min(log["grad_norm"], 1.0), rel=1e-4)
        assert log["rl_guard/entropy/mean"] == pytest.approx(log["entropy"], rel=1e-5)
        if abs(log["rl_guard/ratio/min"] - 1) < 1e-5 and abs(log["rl_guard/ratio/max"] - 1) < 1e-5:
            # TRL weights its KL by the ratio (use_bias_correction_kl): plain k3 only where the ratio is ~1.
            assert log["rl_guard/kl_ref/k3_mean"] == pytest.approx(log["kl"], rel=1e-4, abs=1e-7)
            compared_kl += 1
        if "reward" in log:  # generation steps
            assert log["rl_guard/reward/mean"] == pytest.approx(log["reward"], rel=1e-5, abs=1e-7)
    assert sum("reward" in log for log in logs) == STEPS // 4  # one generation every 4 steps here
    assert compared_kl >= STEPS // 4  # at least the first step after each generation


def test_one_host_transfer_per_step_and_no_other_host_reads(healthy):
    _, calls, finishes = healthy
    assert finishes == STEPS
    train = {k[1:]: v for k, v in calls.items() if k[0] == "train"}
    # The whole per-step path (statistics of every micro-batch, gradient probe, rules, actions, logging): one
    # .cpu() of the packed vector per step, then .numpy() of that host copy; no .item(), bool(), float()...
    assert train == {("cpu", "stats/accumulate.py", "finish"): STEPS, ("numpy", "stats/accumulate.py", "finish"): STEPS}, train
    # At generation time (once per rollout batch, where TRL itself reads rewards and texts on the host) the
    # run-level sample diagnostics copy the gathered reward vectors to the host (at most two transfers per
    # generation, in the adapter) and read only those host copies afterwards.
    generation = {k[1:]: v for k, v in calls.items() if k[0] == "generation"}
    generations = STEPS // 4
    assert {where for _, where, _ in generation} <= {"adapters/trl_samples.py", "diagnostics/samples.py"}, generation
    transfers = sum(v for (name, where, _), v in generation.items() if name == "cpu" and where.startswith("adapters"))
    assert transfers <= 2 * generations, generation


def test_ratio_is_not_one_with_two_iterations(healthy):
    run, _, _ = healthy
    records = run.metrics()
    assert any(r["rl_guard/ratio/max"] > 1.0 for r in records)
    assert any(r["rl_guard/ratio/p50"] != 1.0 for r in records)
    assert any(r["rl_guard/kl_old/k3_mean"] > 1e-6 for r in records)


def test_ratio_exactly_one_on_policy(grpo_run, tmp_path):
    run = grpo_run(tmp_path, 4, guard=demo_config("rollback", console_every=None), num_iterations=1,
                   steps_per_generation=1)
    records = run.metrics()
    assert len(records) == 4
    for r in records:
        ratio = {k: v for k, v in r.items() if k.startswith("rl_guard/ratio/")}
        assert len(ratio) == 10  # mean, min, max and seven quantiles
        assert all(v == 1.0 for v in ratio.values()), ratio
        assert r["rl_guard/kl_old/k3_mean"] == 0.0 and r["rl_guard/clip/region_frac"] == 0.0
    assert [i for i in run.incidents() if i["action"] != "warn"] == []
