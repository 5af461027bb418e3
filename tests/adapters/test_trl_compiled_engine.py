"""``stats_engine: compiled`` under a real ``GRPOTrainer`` with the shipped GRPO preset: the same metrics every step
as the eager engine, and the same actions on a ratio drift, with the compiled kernel really running (TRL's padded
``[B, T]`` tensors with integer masks; the tiny model's micro-batches are far below the CPU threshold, which is
lowered here so that they compile)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_guard.demo.run import demo_config
from rl_guard.stats import fused

pytestmark = pytest.mark.slow
STEPS = 4


@pytest.fixture(autouse=True)
def _compile_small_batches(monkeypatch):
    monkeypatch.setattr(fused, "CPU_MIN_TOKENS", 1)


def _run(grpo_run, tmp_path, engine: str, **kw):
    return grpo_run(tmp_path / engine, kw.pop("steps", STEPS), guard=demo_config(
        kw.pop("action", "rollback"), console_every=None, stats_engine=engine), **kw)


def test_compiled_engine_reports_what_the_eager_one_does_under_trl(grpo_run, tmp_path):
    calls = fused._kernel.cache_info()
    compiled = _run(grpo_run, tmp_path, "compiled")
    assert not fused._failure
    assert fused._kernel.cache_info().hits > calls.hits  # every micro-batch went through the compiled kernel
    eager = _run(grpo_run, tmp_path, "eager")
    assert compiled.guard.internal_failures == 0 and eager.guard.internal_failures == 0
    c_steps, e_steps = compiled.metrics(), eager.metrics()
    assert len(c_steps) == len(e_steps) == STEPS
    for c, e in zip(c_steps, e_steps):
        assert c.keys() == e.keys()
        for key in e:
            assert c[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6, nan_ok=True), (c["step"], key)


def test_compiled_engine_acts_like_the_eager_one_on_a_ratio_drift(grpo_run, tmp_path):
    runs = {engine: _run(grpo_run, tmp_path, engine, steps=6, action="halt", fault="ratio_drift", at_step=3,
                         num_iterations=1, steps_per_generation=2) for engine in ("compiled", "eager")}
    assert not fused._failure
    acted = {engine: sorted((i["step"], i["rule"], i["action"]) for i in run.incidents() if i["action"] != "warn")
             for engine, run in runs.items()}
    assert acted["compiled"] and acted["compiled"] == acted["eager"]


def test_trl_defaults_with_the_shipped_preset_as_is(grpo_run, tmp_path):
    """TRL's own defaults (beta=0, num_iterations=1, one step per generation, max_grad_norm=1.0) and the shipped
    grpo.yaml unmodified but for the engine: both engines report the same metrics and take the same actions."""
    preset = (Path(fused.__file__).parents[1] / "presets" / "grpo.yaml").read_text()
    runs, calls = {}, fused._kernel.cache_info()
    for engine in ("compiled", "eager"):
        runs[engine] = grpo_run(tmp_path / engine, STEPS, guard=preset + f"\nstats_engine: {engine}\n", beta=0.0,
                                num_iterations=1, steps_per_generation=1, max_grad_norm=1.0)
    assert not fused._failure and fused._kernel.cache_info().hits > calls.hits
    c, e = (runs[k] for k in ("compiled", "eager"))
    assert c.guard.internal_failures == 0 and e.guard.internal_failures == 0
    for cm, em in zip(c.metrics(), e.metrics()):
        assert cm.keys() == em.keys()
        assert cm["rl_guard/ratio/max"] == 1.0  # on-policy: the ratio is exactly 1 in both
        for key in em:
            assert cm[key] == pytest.approx(em[key], rel=1e-4, abs=1e-6, nan_ok=True), (cm["step"], key)
    assert [(i["step"], i["rule"], i["action"]) for i in c.incidents()] == [
        (i["step"], i["rule"], i["action"]) for i in e.incidents()]
