"""Merged statistics on 2 and 3 real gloo processes equal a single process fed every rank's batches."""

from __future__ import annotations

import math
import re

import dist_scenarios as sc
import numpy as np
import pytest
import torch
import torch.distributed as dist
from stats_probes import packed

from rl_guard import Guard
from rl_guard.glossary import comparable
from rl_guard.stats import ranks as rg_dist

# Metrics computed from float sums: the merge adds the ranks' partial sums in another order than one process adds
# the micro-batches, so these agree to float64 rounding. Everything else (counts, min/max, quantiles, fractions of
# integer counts, histogram cells) must be bit-identical.
FROM_FLOAT_SUMS = re.compile(r"(/mean|/std|_mean|loss/value)$")


def reference(world: int, tmp_path, seed: int = 7, steps: int = 3) -> list:
    guard = Guard.from_yaml(sc.MERGE_CFG, run_dir=tmp_path / f"single{world}")
    out = []
    for step in range(steps):
        for rank in range(world):
            for batch, loss in sc.rank_batches(seed, step, rank):
                guard.observe(batch, loss=loss)
        _, sums, maxes = packed(guard._acc)
        decision = guard.check()
        guard.step_done()
        out.append(
            {
                "metrics": comparable(guard.last_metrics),
                "hists": sc.hists_json(guard.last_histograms),
                "action": decision.action,
                "n_sums": sums.numel(),
                "n_maxes": maxes.numel() + 2,
            }
        )
    return out


def local_only(rank: int, tmp_path, seed: int = 7) -> dict:
    guard = Guard.from_yaml(sc.MERGE_CFG, run_dir=tmp_path / f"local{rank}")
    for batch, loss in sc.rank_batches(seed, 0, rank):
        guard.observe(batch, loss=loss)
    guard.check()
    return comparable(guard.last_metrics)


@pytest.mark.parametrize("world", [2, 3])
def test_global_metrics_equal_single_process_on_every_rank(launched, world, tmp_path):
    run = launched(world)
    ranks = run.scenario("merge")
    ref = reference(world, tmp_path)
    for step, want in enumerate(ref):
        got0 = ranks[0]["steps"][step]
        assert set(got0["metrics"]) == set(want["metrics"])
        for name, value in want["metrics"].items():
            if name == "rl_guard/loss/value":  # each rank's step loss is its own; the merged figure is their mean
                value = value / world
            if FROM_FLOAT_SUMS.search(name):
                np.testing.assert_allclose(got0["metrics"][name], value, rtol=1e-12, atol=1e-15, err_msg=name)
            else:
                assert got0["metrics"][name] == value or (math.isnan(value) and math.isnan(got0["metrics"][name])), name
        assert got0["hists"] == want["hists"] and got0["hists"]  # exact cell counts, histograms present
        assert got0["action"] == want["action"]
        for r in range(1, world):  # every rank holds bit-identical merged metrics
            assert ranks[r]["steps"][step]["metrics"] == got0["metrics"]
            assert ranks[r]["steps"][step]["hists"] == got0["hists"]
    # The test has teeth: the quantiles of the merged data are not those of any single rank's data.
    p = ["rl_guard/ratio/p05", "rl_guard/ratio/p95", "rl_guard/entropy/p25", "rl_guard/entropy/p75"]
    merged = [ranks[0]["steps"][0]["metrics"][k] for k in p]
    for r in range(world):
        assert [local_only(r, tmp_path)[k] for k in p] != merged
    # Steps 1 and 2 carry non-finite inputs on every rank and lag buckets: counts add up across ranks.
    assert ranks[0]["steps"][1]["metrics"]["rl_guard/input/old_logprobs/nonfinite"] == world
    assert "rl_guard/lag/mean" in ranks[0]["steps"][2]["metrics"]


@pytest.mark.parametrize("world", [2, 3])
def test_exactly_two_collectives_per_step(launched, world, tmp_path):
    ranks = launched(world).scenario("merge")
    ref = reference(world, tmp_path)
    for rec in ranks:
        for step, s in enumerate(rec["steps"]):
            assert s["observe_calls"] == [] and s["step_done_calls"] == []
            names = [(c[0], c[1]) for c in s["check_calls"]]
            assert names == [("all_reduce", "RedOpType.MAX"), ("all_reduce", "RedOpType.SUM")]
            # payloads: the fixed-size header + maxima vector, then exactly the packed sums of the step
            assert s["check_calls"][0][2] == rg_dist.HEADER + rg_dist.MAX_SLOTS
            # (+1: the per-rank loss count that check() adds so the merged loss is a mean over ranks)
            assert s["check_calls"][1][2] == ref[step]["n_sums"] + 1
            assert ref[step]["n_maxes"] <= rg_dist.MAX_SLOTS


def _count_collectives(monkeypatch) -> list:
    calls = []
    for name in sc.COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None:
            monkeypatch.setattr(dist, name, lambda *a, _n=name, _f=fn, **k: (calls.append(_n), _f(*a, **k))[1])
    return calls


def _one_step(run_dir) -> Guard:
    guard = Guard.from_yaml(sc.MERGE_CFG, run_dir=run_dir)
    for batch, loss in sc.rank_batches(1, 0, 0):
        guard.observe(batch, loss=loss)
    guard.check()
    guard.step_done()
    return guard


def test_no_process_group_means_no_collectives(monkeypatch, tmp_path):
    assert not dist.is_initialized()
    calls = _count_collectives(monkeypatch)
    guard = _one_step(tmp_path)
    assert rg_dist.reducer() is None and calls == []
    assert guard.last_metrics["rl_guard/tokens/count"] > 0


def test_group_of_one_process_means_no_collectives(monkeypatch, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        calls = _count_collectives(monkeypatch)
        _one_step(tmp_path / "run")
        assert rg_dist.reducer() is None and calls == []
    finally:
        dist.destroy_process_group()
    assert torch.distributed.is_initialized() is False


@pytest.mark.parametrize("world", [2, 3])
def test_more_maxima_than_slots_take_one_more_collective(launched, world):
    for rec in launched(world).scenario("many_groups"):
        ops = [(c[0], c[1]) for c in rec["calls"]]
        assert ops == [
            ("all_reduce", "RedOpType.MAX"),
            ("all_reduce", "RedOpType.MAX"),
            ("all_reduce", "RedOpType.SUM"),
        ]
        assert rec["calls"][0][2] == rg_dist.HEADER + rg_dist.MAX_SLOTS
        assert rec["calls"][0][2] + rec["calls"][1][2] > rec["groups"]  # the overflow carries the rest
        n, bad = rec["groups"], rec["groups"] - 50
        want = [math.sqrt(3 * np.float32(0.01 * (i + 1)).astype(np.float64) ** 2) for i in range(n)]
        for i in (0, 300, n - 51, n - 1):  # maxima on both sides of the MAX_SLOTS boundary
            np.testing.assert_allclose(rec["norms"][i], want[i], rtol=1e-12)
        assert math.isinf(rec["norms"][bad])  # one rank's NaN, beyond the slots, still reaches every rank
        assert rec["nonfinite"] == 1.0 and rec["action"] == "skip_step"
