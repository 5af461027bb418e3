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


def test_blind_spots_are_covered_from_the_first_step(tmp_path):
    """Faults before any history, a warm-up to a harmful peak, a sign flip of one element a strided sample skips
    (norm unchanged) and wiped Adam moments: each acted on, abrupt ones within one step, the warm-up well before
    its twin collapses; plus one healthy run at 3x the learning rate with no action."""
    bench = load_module("detection_benchmark", ROOT / "benchmarks" / "detection.py")
    result = bench.main(
        [
            "--faults",
            "early_lr_x1e4",
            "early_adam_v_wiped",
            "warmup_to_100x",
            "element_sign_flip",
            "--configs",
            "trl_defaults",
            "--seeds",
            "1",
            "--healthy-seeds",
            "1",
            "--healthy-steps",
            "30",
            "--variants",
            "lr_x3",
            "--json",
            str(tmp_path / "d.json"),
        ]
    )
    assert result["recall"] == 1.0
    assert result["max_action_delay_abrupt"] <= 1
    assert result["min_lead_gradual"] >= 3
    assert result["false_actions_healthy"] == 0
    rows = {r["fault"]: r for r in result["runs"] if r["fault"] != "healthy"}
    assert rows["element_sign_flip"]["action"] == "weights_corrupted -> rollback"
    assert rows["early_adam_v_wiped"]["action"] == "update_not_adam -> rollback"
    assert rows["warmup_to_100x"]["action"] == "update_rel_limit -> rollback"
    assert all(r["weights_finite"] for r in result["runs"])
