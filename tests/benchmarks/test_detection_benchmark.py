"""The CI subset of ``benchmarks/detection.py``: TRL's defaults x {LR x1e4 once, LR x3 per step, NaN rewards from
step K on}, the unmodified shipped preset, each beside its unguarded twin, plus one healthy run."""

from __future__ import annotations

import json

import pytest

from file_modules import ROOT, load_module

pytestmark = pytest.mark.slow


def test_quick_detection_benchmark_meets_the_targets(tmp_path):
    bench = load_module("detection_benchmark", ROOT / "benchmarks" / "detection.py")
    out = tmp_path / "detection.json"
    result = bench.main(["--quick", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["recall"] == result["recall"] == 1.0
    assert written["max_action_delay_abrupt"] <= 1
    assert written["min_lead_gradual"] >= 5
    assert written["false_actions_healthy"] == 0
    faults = {r["fault"]: r for r in written["runs"]}
    assert set(faults) == {"lr_x1e4", "lr_x3_per_step", "nan_rewards", "healthy"}
    assert all(r["weights_finite"] for r in written["runs"])
    # A fault that never clears ends the run: NaN rewards skip, then escalate to checkpoint_and_halt.
    assert faults["nan_rewards"]["final_action"] == "checkpoint_and_halt"
    assert faults["nan_rewards"]["steps_run"] < 24
