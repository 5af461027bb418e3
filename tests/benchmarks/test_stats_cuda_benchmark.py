"""The GPU statistics benchmark (benchmarks/stats_cuda.py): it says so and stops without CUDA, and its guard cycle
(observe four micro-batches, check, step_done) runs end to end; on a GPU, one synchronisation per cycle."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engine_calls import compiled_calls
from file_modules import load_module

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def _modules():
    # stats.py and stats_cuda.py import their sibling stats_common.py, and stats.main imports stats_cuda (for
    # --device cuda), all from benchmarks/ on sys.path (where stats.py itself puts it when it is run as a script):
    # it stays there, as it would
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return load_module("rl_guard_benchmark_stats", BENCH_DIR / "stats.py"), load_module(
        "rl_guard_benchmark_stats_cuda", BENCH_DIR / "stats_cuda.py"
    )


def test_device_cuda_says_why_it_did_not_run_without_a_gpu(capsys, tmp_path):
    stats, _ = _modules()
    result = stats.main(["--device", "cuda", "--sizes", "1M", "--repeats", "1", "--json", str(tmp_path / "g.json")])
    if torch.cuda.is_available():
        assert result["rows"][0]["full_ms"] > 0 and result["syncs_observe_check"] == 1
        assert result["syncs_observe_check_compiled"] == 1
    else:
        assert result == {"skipped": "CUDA is not available on this machine: the GPU benchmark was not run"}
        assert "CUDA is not available" in capsys.readouterr().out


def test_guard_cycle_runs_every_family_without_internal_failure():
    _, cuda = _modules()
    out = cuda.guard_cycle_syncs(1 << 14, steps=2, device="cpu")  # the same cycle; counting needs CUDA
    assert out["internal_failures"] == 0 and len(out["per_step"]) == 2


@pytest.mark.slow
def test_guard_cycle_with_the_compiled_engine_runs_without_internal_failure():
    _, cuda = _modules()
    calls = compiled_calls()
    out = cuda.guard_cycle_syncs(1 << 15, steps=2, device="cpu", stats_engine="compiled")  # 8K-token micro-batches
    assert out["internal_failures"] == 0 and len(out["per_step"]) == 2
    assert out["engine_failure"] is None and compiled_calls() > calls
