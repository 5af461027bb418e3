"""Smoke test of ``benchmarks/trl_overhead.py``: one pair of 2-step runs end to end, JSON written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from file_modules import load_module

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "trl_overhead.py"


@pytest.mark.parametrize("setup", ["demo", "trl-defaults", "trl-short"])
def test_overhead_benchmark_runs_and_writes_json(tmp_path, setup):
    bench = load_module("trl_overhead", BENCH)
    out_file = tmp_path / "overhead.json"
    out = bench.main(["--runs", "1", "--steps", "2", "--setup", setup, "--json", str(out_file)])
    written = json.loads(out_file.read_text())
    assert written == json.loads(json.dumps(out))
    assert math.isfinite(written["overhead_ratio"]) and written["overhead_ratio"] > 0
    low, high = written["overhead_ratio_range"]
    assert low <= written["overhead_ratio"] <= high  # one pair here: all three are its ratio
    assert low == high == written["wall_s"]["guarded"][0] / written["wall_s"]["unguarded"][0]
    # two steps: one interval between step ends per arm, shorter than the whole train() call
    assert math.isfinite(written["overhead_ratio_steady"]) and written["overhead_ratio_steady"] > 0
    for arm in ("guarded", "unguarded"):
        assert 0 < written["steady_step_ms"][arm] < 1e3 * written["wall_s"][arm][0]
    assert 0 < written["guard_time_frac"] < 1  # the guard did run, and did not take the whole run
    assert written["runs"] == 1 and written["steps"] == 2 and written["guard_acted"] == 0
    assert written["setup"] == setup
    parts = written["guard_ms_per_step"]
    if setup != "demo":  # TRL generates every step: the sample diagnostics run every step
        assert parts["diagnostics"] > 0
    # trl-defaults is GRPOConfig's own defaults; the others take the demo's 8-token completions
    assert written["model"]["completion"] == (bench._trl_default("max_completion_length") if setup == "trl-defaults"
                                              else 8)
    assert set(parts) == {*bench.PARTS, "total"} and all(v >= 0 for v in parts.values())
    assert parts["statistics"] > 0 and parts["grad_probe"] > 0 and parts["rules"] > 0 and parts["sinks"] > 0
    assert parts["total"] == sum(parts[p] for p in bench.PARTS)
    # The parts account for the guard's whole time: total per step x steps = the measured time inside the guard.
    guarded_wall = written["wall_s"]["guarded"][0]
    assert abs(parts["total"] * 2 / 1e3 - written["guard_time_frac"] * guarded_wall) < 1e-6
    assert len(written["wall_s"]["guarded"]) == len(written["wall_s"]["unguarded"]) == 1
