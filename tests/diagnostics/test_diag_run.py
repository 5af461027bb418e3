"""RunDiagnostics as a whole: state across resume, untouched global RNGs, input forms, names known to rules."""

import json
import math
import random

import numpy as np
import pytest
import torch

from rl_guard import glossary
from rl_guard.control.config import ConfigError, load_config
from rl_guard.diagnostics import RunDiagnostics, SampleBatch


def _batch(step: int) -> SampleBatch:
    rng = np.random.default_rng(step)  # local generator: the test itself leaves the global RNGs alone
    n = 16
    return SampleBatch(
        ids=[f"{step}-{i}" for i in range(n)],
        group_ids=np.repeat(np.arange(4), 4),
        rewards=rng.random(n),
        outcome=rng.integers(0, 2, n),
        lengths=rng.integers(5, 50, n),
        truncated=rng.random(n) < 0.1,
        termination=["success"] * (n - 1) + ["timeout"],
        texts=[f"t{i % 5}" for i in range(n)],
        advantages=rng.normal(size=n),
        values=rng.normal(size=n),
        returns=rng.normal(size=n),
        versions=[step] * n,
        reward_components={"task": rng.random(n), "format": rng.random(n)},
        funnel={"sampled": 20, "accepted": n},
        phase_seconds={"rollout": 1.0},
    )


def test_global_rngs_are_untouched(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    before = (random.getstate(), np.random.get_state(), torch.random.get_rng_state().clone())
    d = RunDiagnostics(tmp_path, audit_k=3, seed=5)
    for step in range(3):
        d.update(_batch(step), step)  # includes random audit picks
    assert random.getstate() == before[0]
    after_np = np.random.get_state()
    assert after_np[0] == before[1][0] and np.array_equal(after_np[1], before[1][1]) and after_np[2:] == before[1][2:]
    assert torch.equal(torch.random.get_rng_state(), before[2])


def test_state_dict_round_trip_continues_budgets_trend_and_audit_sampling(tmp_path):
    a = RunDiagnostics(tmp_path / "a", audit_k=2, window=4)
    for step in range(5):
        a.update(_batch(step), step)
    state = json.loads(json.dumps(a.state_dict()))  # plain JSON survives a checkpoint
    b = RunDiagnostics(tmp_path / "b", audit_k=2, window=4)
    b.load_state_dict(state)
    ma, mb = a.update(_batch(5), 5), b.update(_batch(5), 5)
    assert ma == mb
    assert ma["rl_guard/budget/episodes_total"] == 6 * 16 and ma["rl_guard/budget/seconds_total/rollout"] == 6.0
    assert "rl_guard/trend/reward_slope" in ma  # window carried over: a fresh object would have 1 point
    last = [[line for line in d.last_audit_file.read_text().splitlines() if '"step": 5,' in line] for d in (a, b)]
    assert last[0] and last[0] == last[1]  # same random picks after resume
    fresh = RunDiagnostics(window=4).update(_batch(5), 5)
    assert fresh["rl_guard/budget/episodes_total"] == 16 and "rl_guard/trend/reward_slope" not in fresh
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({**state, "version": 99})


def test_full_batch_metrics_are_finite_and_documented(check):
    m = RunDiagnostics().update(_batch(0), 0)
    check(m)
    families = {k.split("/")[1] for k in m}
    assert families == {"budget", "funnel", "term", "reward", "quadrant", "group", "critic", "length", "trend"}


@pytest.mark.parametrize(
    "fields",
    [
        {},  # empty batch
        {"rewards": [], "group_ids": [], "lengths": [], "outcome": []},  # zero samples
        {"rewards": [math.nan], "group_ids": [0], "outcome": [1], "values": [0.0], "returns": [math.nan]},
        {
            "rewards": [0.0] * 5,
            "group_ids": [0] * 5,
            "outcome": [0] * 5,
            "lengths": [0] * 5,
            "returns": [1.0] * 5,
            "values": [1.0] * 5,
            "texts": [""] * 5,
        },  # all-zero rewards, zero tokens, Var(G) = 0
        {"rewards": [1.0], "termination": ["verifier_error"], "group_ids": [7], "outcome": [1], "lengths": [3]},
    ],
)
def test_edge_batches_give_finite_known_metrics(fields, check):
    m = RunDiagnostics().update(SampleBatch(**fields), 0)
    check(m)
    assert m["rl_guard/budget/optimizer_updates"] == 1


def test_mismatched_lengths_and_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="differ in length"):
        RunDiagnostics().update(SampleBatch(rewards=[1.0, 2.0], lengths=[1]), 0)
    with pytest.raises(ValueError, match="differ in length"):
        RunDiagnostics().update(SampleBatch(rewards=[1.0, 2.0], reward_components={"task": [1.0]}), 0)
    with pytest.raises(ValueError, match="1-D"):
        RunDiagnostics().update(SampleBatch(rewards=[[1.0, 2.0]]), 0)


def test_lists_numpy_and_tensors_agree():
    lists = dict(
        rewards=[0.5, 1.0, 0.0, 0.25],
        lengths=[3, 4, 5, 6],
        truncated=[0, 1, 0, 0],
        group_ids=[0, 0, 1, 1],
        outcome=[1, 1, 0, 1],
        values=[0.1, 0.2, 0.3, 0.4],
        returns=[0.5, 1.0, 0.0, 0.25],
    )
    as_np = {k: np.asarray(v) for k, v in lists.items()}
    as_torch = {k: torch.tensor(v) for k, v in lists.items()}
    ref = RunDiagnostics().update(SampleBatch(**lists), 0)
    assert RunDiagnostics().update(SampleBatch(**as_np), 0) == pytest.approx(ref)
    assert RunDiagnostics().update(SampleBatch(**as_torch), 0) == pytest.approx(ref, rel=1e-6)


def test_rules_may_name_diagnostics_and_typos_are_caught():
    text = """rules:
  - {name: funnel, metric: rl_guard/funnel/accepted/keep_frac, op: "<", threshold: 0.8, action: warn}
  - {name: sys, metric: rl_guard/term/system_error_rate, op: ">", threshold: 0.02, action: warn}
  - {name: comp, metric: rl_guard/reward/component/format/share, op: ">", threshold: 0.5, action: warn}
  - {name: crit, metric: rl_guard/critic/residual/length/q4, op: ">", threshold: 1.0, action: warn}
  - {name: drop, metric: rl_guard/funnel/drop/stale, op: ">", threshold: 10, action: warn}
  - {name: phase, metric: rl_guard/budget/seconds_total/rollout, op: ">", threshold: 3600, action: early_stop}
"""
    assert len(load_config(text).rules) == 6
    with pytest.raises(ConfigError, match="funnel/acceptd/keep_frac"):
        load_config(text.replace("accepted/keep_frac", "acceptd/keep_frac"))
    assert not glossary.is_known("rl_guard/term/crashed_rate")  # the taxonomy is closed
