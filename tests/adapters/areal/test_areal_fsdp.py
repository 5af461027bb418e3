"""The guard on AReaL's real ``FSDPPPOActor`` (areal 1.0.4, SPMD mode, CPU, gloo), one and two processes.

Runs in the nox session ``areal`` (noxfile.py, constraints/areal.txt: transformers 5.3.0 as areal
pins; torch 2.13.0 CPU instead of areal's ``torch<2.11``, whose Linux wheels are CUDA builds). Each rank runs
the recipe ``integrations/areal_async/fsdp_actor_on_cpu.py``: ``GuardedFSDPPPOActor`` (the class a
single-controller run's workers import by dotted path) through ``compute_logp`` -> ``compute_advantages`` ->
``ppo_update`` for five steps; see the worker's docstring.

On CPU there is no flash-attention varlen kernel: AReaL packs each micro-batch into one row, so with ``sdpa`` the
packed sequences attend causally across their boundaries. The log-probs differ from a GPU run's; every AReaL and
rl_guard code path is the real one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from rank_launch import run_ranks as launch

# AReaL's imports and FSDP2 set-up: about 20 s per run on one core; slower on a loaded machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "integrations" / "areal_async"))
    from tiny_qwen2 import build

    return build(tmp_path_factory.mktemp("qwen2") / "model")


def run_ranks(model, out: Path, world: int, phase: str = "train") -> list[dict]:
    return launch(
        ROOT / "integrations" / "areal_async" / "fsdp_actor_on_cpu.py",
        [model, out, phase],
        world,
        {"OMP_NUM_THREADS": "1"},
    )


@pytest.mark.parametrize("world", [1, 2])
def test_real_fsdp_ppo_actor_guarded(model, tmp_path, world):
    ranks = run_ranks(model, tmp_path, world)
    first = ranks[0]
    assert first["platform"] == "cpu" and first["backend"] == "gloo"
    # healthy and stale-but-warned updates are applied; AReaL's update is the one that moves the weights
    assert first["applied"] == [True, True, True] and first["moved_after_snapshot"]
    # rollback: the weights after step 3 are bitwise those of the snapshot after step 1 (DCP save / load)
    assert first["rolled_back_to_snapshot"]
    # skip: AReaL's optimizer step never ran, the weights are bitwise unchanged
    assert first["skipped_unchanged"]
    assert (first["steps"], first["rollbacks"]) == (5, 1)
    # lag buckets from AReaL's versions (rolled like loss_mask): lag 1 while healthy, lag 9 on the stale batch
    assert (first["lag_max_healthy"], first["lag_bucket_1"]) == (1.0, 1.0)
    assert (first["lag_max_stale"], first["lag_bucket_9"]) == (9.0, 1.0)
    # behaviour = proximal -> behave_imp_weight exactly 1; 6 and 2 nats apart -> e^-6 and e^-2
    assert first["behave_healthy"] == [1.0, 1.0]
    assert first["behave_broken"] == pytest.approx(2.478752e-3, rel=1e-5)
    assert first["behave_far"] == pytest.approx(0.1353353, rel=1e-5)
    # one mini-batch: the current policy is the proximal one -> importance_weight exactly 1
    assert first["importance_healthy"] == [1.0, 1.0]
    assert [(s, r) for s, r, _ in first["incidents"]] == [
        (2, "behaviour_far"),
        (2, "behaviour_broken"),
        (3, "staleness_bound"),
        (4, "behaviour_far"),
    ]
    assert first["snapshot_dir"].startswith("/dev/shm/")
    assert all(r["snapshot_files"] == ["step1", "step4"] for r in ranks)  # no rank freed it under another
    assert not os.path.exists(first["snapshot_dir"])  # RAM freed once the last rank exited
    # the same decisions and weights-level outcomes on every rank
    keys = (
        "applied",
        "rolled_back_to_snapshot",
        "skipped_unchanged",
        "steps",
        "skipped",
        "rollbacks",
        "lag_max_stale",
        "behave_far",
    )
    for other in ranks[1:]:
        assert {k: other[k] for k in keys} == {k: first[k] for k in keys}

    # recover: AReaL's RecoverHandler meta through engine.save / engine.load carries the guard's state
    for r in run_ranks(model, tmp_path, world, "resume"):
        assert r["guard_at_start"] == [5, first["skipped"], 1]
        assert r["applied_after_resume"] and r["steps"] == 6
