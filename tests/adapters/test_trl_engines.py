"""The statistics engines under a real ``GRPOTrainer`` with the shipped GRPO preset: ``stats_engine: compiled`` and
the host engine for small CPU micro-batches report the same metrics every step as the eager engine and take the
same actions, with each one really running (TRL's padded ``[B, T]`` tensors with integer masks).

The arms: ``host`` is what the tiny model's micro-batches get by default (the eager engine's host path,
``engines.HOST_MAX_TOKENS``); ``compiled`` gives the guard a compiled engine with its CPU threshold lowered and no
host path, so that they compile; ``eager`` an eager engine without the host path."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_calls import compiled_calls

from rl_guard import Guard
from rl_guard.adapters.trl import RLGuardCallback
from rl_guard.demo.run import demo_config
from rl_guard.glossary import comparable
from rl_guard.stats import engines, families, xp
from rl_guard.stats.engines import Engine

pytestmark = pytest.mark.slow
STEPS = 4


class _Arm:
    """One engine arm: the guard's engine, and a count of what really ran."""

    def __init__(self, name: str, monkeypatch):
        self.name, self.monkeypatch, self.host_batches = name, monkeypatch, 0
        real = engines.eager_probe  # the engines' one path; the compiled engine copies chunk_stats' own code

        def counted(*args, **kwargs):
            self.host_batches += kwargs.get("ops") is xp.NUMPY
            return real(*args, **kwargs)

        monkeypatch.setattr(engines, "eager_probe", counted)

    def __enter__(self) -> str:
        self.calls = compiled_calls()
        return "compiled" if self.name == "compiled" else "eager"

    def callback(self, config: str, tmp) -> RLGuardCallback:
        guard = Guard.from_yaml(config, run_dir=str(tmp / "guard"), open_run_dir=False)
        if self.name == "compiled":
            guard.engine = Engine("compiled", host_max_tokens=0, cpu_min_tokens=1)
        elif self.name == "eager":
            guard.engine = Engine("eager", host_max_tokens=0)
        self.engine = guard.engine
        return RLGuardCallback(guard)

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            assert getattr(self.engine, "failure", None) is None and self.engine.host_failure is None
            assert self.engine.whole_failure is None
            compiled = compiled_calls() > self.calls
            assert compiled == (self.name == "compiled")  # no silent fallback passes for the arm's own result
            assert (self.host_batches > 0) == (self.name == "host")


def _runs(grpo_run, tmp_path, monkeypatch, arms, guard=None, **kw):
    out = {}
    for name in arms:
        arm = _Arm(name, monkeypatch)
        with arm as engine:
            config = (
                guard(engine)
                if guard
                else demo_config(kw.get("action", "rollback"), console_every=None, stats_engine=engine)
            )
            out[name] = grpo_run(
                tmp_path / name,
                kw.get("steps", STEPS),
                guard=arm.callback(config, tmp_path / name),
                **kw.get("trainer", {}),
            )
    return out


def _same_metrics(a, b) -> None:
    assert a.guard.internal_failures == 0 and b.guard.internal_failures == 0
    a_steps, b_steps = [comparable(m) for m in a.metrics()], [comparable(m) for m in b.metrics()]
    assert a_steps and len(a_steps) == len(b_steps)
    for x, y in zip(a_steps, b_steps):
        assert x.keys() == y.keys()
        for key in y:
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6, nan_ok=True), (x["step"], key)


@pytest.mark.parametrize("engine", ["compiled", "host"])
def test_engine_reports_what_the_eager_one_does_under_trl(engine, grpo_run, tmp_path, monkeypatch):
    runs = _runs(grpo_run, tmp_path, monkeypatch, (engine, "eager"))
    _same_metrics(runs[engine], runs["eager"])


@pytest.mark.parametrize("engine", ["compiled", "host"])
def test_engine_acts_like_the_eager_one_on_a_ratio_drift(engine, grpo_run, tmp_path, monkeypatch):
    runs = _runs(
        grpo_run,
        tmp_path,
        monkeypatch,
        (engine, "eager"),
        steps=6,
        action="halt",
        trainer=dict(fault="ratio_drift", at_step=3, num_iterations=1, steps_per_generation=2),
    )
    acted = {
        name: sorted((i["step"], i["rule"], i["action"]) for i in run.incidents() if i["action"] != "warn")
        for name, run in runs.items()
    }
    assert acted[engine] and acted[engine] == acted["eager"]


@pytest.mark.parametrize("engine", ["compiled", "host"])
def test_trl_defaults_with_the_shipped_preset_as_is(engine, grpo_run, tmp_path, monkeypatch):
    """TRL's own defaults (beta=0, num_iterations=1, one step per generation, max_grad_norm=1.0) and the shipped
    grpo.yaml unmodified but for the engine: the engines report the same metrics and take the same actions."""
    preset = (Path(families.__file__).parents[1] / "presets" / "grpo.yaml").read_text()
    runs = _runs(
        grpo_run,
        tmp_path,
        monkeypatch,
        (engine, "eager"),
        guard=lambda e: preset + f"\nstats_engine: {e}\n",
        trainer=dict(beta=0.0, num_iterations=1, steps_per_generation=1, max_grad_norm=1.0),
    )
    _same_metrics(runs[engine], runs["eager"])
    assert all(m["rl_guard/ratio/max"] == 1.0 for m in runs[engine].metrics())  # on-policy: the ratio is exactly 1
    assert [(i["step"], i["rule"], i["action"]) for i in runs[engine].incidents()] == [
        (i["step"], i["rule"], i["action"]) for i in runs["eager"].incidents()
    ]
