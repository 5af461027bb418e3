"""Keeps benchmarks/stats.py from rotting: its main path on a tiny batch, JSON keys, and its naive baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from file_modules import load_module

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "stats.py"


@pytest.fixture(scope="module")
def bench():
    return load_module("rl_guard_benchmark_stats", BENCH)


def test_main_on_a_tiny_batch_writes_the_json_keys(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    # The label only names the JSON keys; the batch is 4096 tokens.
    result = bench.main(["--json", str(out)], sizes={"4M": 1 << 12})
    assert torch.get_num_threads() == threads  # --threads is restored afterwards
    data = json.loads(out.read_text())
    for key in (
        "speedup_vs_naive_4M",
        "floor_ratio_4M",
        "max_tokens_ok",
        "transfers_per_step",
        "peak_extra_mem_ratio_4M",
    ):
        assert key in data, key
    assert data["transfers_per_step"] == 1 and data["other_host_reads_per_step"] == 0
    assert data["max_tokens_ok"] == 1 << 12 and data["speedup_vs_naive_4M"] > 0 and data["peak_extra_mem_ratio_4M"] > 0
    # both engines timed; the top level is the first one's
    assert data["engine"] == "compiled" and data["speedup_vs_naive_4M"] == data["speedup_vs_naive_4M_compiled"]
    assert data["speedup_vs_naive_4M_eager"] > 0
    assert set(data["small_batch_ms"]) == {"64", "1K", "8K"}  # small micro-batches: host engine vs eager
    assert all(row["host"] > 0 and row["eager"] > 0 for row in data["small_batch_ms"].values())
    assert result["rows"][0]["tokens"] == 1 << 12
    ops = data["torch_ops_per_microbatch"]  # outside compiled code: a one-chunk micro-batch compiles whole
    for row in ops.values():
        assert row["compiled"] == 0 < row["eager"] and row["generated_kernels"] > 0
    assert ops["every_field"]["eager"] > ops["trl_defaults"]["eager"]
    assert "speedup_vs_naive" in capsys.readouterr().out


def test_naive_baseline_computes_the_same_metrics(bench):
    """The baseline must compute what rl_guard computes, or the speedup means nothing."""
    d = bench.make_inputs(1 << 12)
    naive, ours = bench.naive_step(d), bench.full_step(d)
    for key in (
        "ratio/mean",
        "ratio/max",
        "kl_old/k3_mean",
        "kl_ref/k2_seq_max",
        "entropy/mean",
        "adv/std",
        "clip/region_frac",
        "lag/mean",
        "lag/max",
        "length/mean",
    ):
        assert ours["rl_guard/" + key] == pytest.approx(naive[key], rel=1e-4, abs=1e-7), key
    assert ours["rl_guard/entropy/p50"] == pytest.approx(naive["entropy/p50"], rel=0.02)


def test_peak_live_bytes_sees_allocations(bench):
    x = torch.ones(1 << 18)

    def two_temporaries():
        a = x * 2
        b = a + 1
        del a, b

    two = 2 * 4 * (1 << 18)
    assert two <= bench.peak_live_bytes(two_temporaries) <= two + 1024  # plus the profiler's own scalars
