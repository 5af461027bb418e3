"""Smoke test of ``benchmarks/guard_step.py``: both setups feed what they claim, the timed run is healthy, and the
JSON carries the warm and cold figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from file_modules import load_module

from rl_guard.sinks.jsonl import read_jsonl

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "guard_step.py"


@pytest.fixture(scope="module")
def bench():
    return load_module("rl_guard_benchmark_guard_step", BENCH)


@pytest.mark.parametrize("setup", ["demo", "trl-short", "trl-defaults"])
def test_setups_feed_their_fields_and_run_healthy(bench, tmp_path, setup):
    out = bench.run(setup, steps=8, work=tmp_path)
    run_dir = Path(out["run_dir"])
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(8))
    last = metrics[-1]
    if setup == "demo":  # old and reference log-probs; a generation batch every 4 steps
        assert last["rl_guard/ratio/mean"] != 1.0 and "rl_guard/kl_ref/k3_mean" in last
        assert sum("rl_guard/reward/mean" in m for m in metrics) == 2
    else:  # TRL's loss defaults: no reference model, the ratio is exactly 1, a generation batch every step
        assert last["rl_guard/ratio/mean"] == 1.0 and "rl_guard/kl_ref/k3_mean" not in last
        assert all("rl_guard/reward/mean" in m for m in metrics)
    assert "rl_guard/update/rel" in last and "rl_guard/grad/norm" in last
    assert not (run_dir / "incidents.jsonl").read_text()  # the steady state is timed, not incident handling
    assert set(out["per_call"]) == set(bench.CALLS) and all(v > 0 for v in out["per_call"].values())
    assert out["total"] == pytest.approx(sum(out["per_call"].values()))
    assert 0 < out["host_ms_over_outside"] <= 1 + 1e-9


def test_main_writes_warm_and_cold_figures(bench, tmp_path):
    path = tmp_path / "step.json"
    result = bench.main(["--steps", "8", "--setup", "trl-defaults", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    assert result["guard_ms_per_step_warm"] > 0 and result["guard_ms_per_step_cold"] > 0
    # both sides are rounded figures, so the ratio recomputed from them may differ in the last digit
    ratio = result["guard_ms_per_step_cold"] / result["guard_ms_per_step_warm"]
    assert result["cold_over_warm"] == pytest.approx(ratio, abs=0.011)
    assert set(result["per_call_ms_warm"]) == set(result["per_call_ms_cold"]) == set(bench.CALLS)
    probe = result["machine"]
    assert set(probe) == {
        f"{op}_us_{state}" for op in ("torch_op", "numpy_op", "python_loop") for state in ("warm", "cold")
    }
    assert all(v > 0 for v in probe.values())  # whether cold costs more than warm is the benchmark's to say
    # the guard's own host_ms never exceeds its calls timed from outside: its clock runs inside each of them
    assert set(result["host_ms_over_outside"]) == {"warm", "cold"}
    assert all(0 < r <= 1 for r in result["host_ms_over_outside"].values())
