"""The GPU statistics benchmark (benchmarks/stats_cuda.py): it says so and stops without CUDA, and its guard cycle
(observe four micro-batches, check, step_done) runs end to end; on a GPU, one synchronisation per cycle."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from file_modules import load_module

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def _modules():
    added = str(BENCH_DIR) not in sys.path
    if added:
        sys.path.insert(0, str(BENCH_DIR))  # stats_cuda imports its sibling stats.py
    try:
        return load_module("rl_guard_benchmark_stats", BENCH_DIR / "stats.py"), load_module(
            "rl_guard_benchmark_stats_cuda", BENCH_DIR / "stats_cuda.py")
    finally:
        if added and str(BENCH_DIR) in sys.path:
            sys.path.remove(str(BENCH_DIR))


def test_device_cuda_says_why_it_did_not_run_without_a_gpu(capsys, tmp_path):
    stats, _ = _modules()
    result = stats.main(["--device", "cuda", "--sizes", "1M", "--repeats", "1", "--json", str(tmp_path / "g.json")])
    if torch.cuda.is_available():
        assert result["rows"][0]["full_ms"] > 0 and result["syncs_observe_check"] == 1
    else:
        assert result == {"skipped": "CUDA is not available on this machine: the GPU benchmark was not run"}
        assert "CUDA is not available" in capsys.readouterr().out


def test_guard_cycle_runs_every_family_without_internal_failure():
    _, cuda = _modules()
    out = cuda.guard_cycle_syncs(1 << 14, steps=2, device="cpu")  # the same cycle; counting needs CUDA
    assert out["internal_failures"] == 0 and len(out["per_step"]) == 2
