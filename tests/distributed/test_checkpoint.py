"""Checkpoint-and-halt and rollback with several ranks: per-rank state, one incident record, loud save failures."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from dist_scenarios import FAULT_STEP

from rl_guard.control.checkpoint import load

WORLDS = [2, 3]


def _lines(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _digest(model_state: dict) -> str:
    h = hashlib.sha256()
    for key in ("lin.weight", "lin.bias"):  # TinyPolicy.parameters() order
        h.update(model_state[key].contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("world", WORLDS)
def test_halt_saves_each_rank_and_writes_the_incident_once(launched, world):
    run = launched(world)
    ranks = run.scenario("halt")
    run_dir = run.out / "checkpoint_and_halt_nan_reward"
    step_dir = run_dir / "checkpoints" / f"step_{FAULT_STEP:08d}"
    assert sorted(p.name for p in step_dir.iterdir()) == [f"rank{r}.pt" for r in range(world)]
    for r, rec in enumerate(ranks):
        payload = load(step_dir / f"rank{r}.pt")
        assert payload["step"] == FAULT_STEP and payload["reason"] == "checkpoint_and_halt"
        assert payload["extra"]["cursor"] == {"rank": r, "pos": FAULT_STEP + 1}  # this rank's own state
        assert _digest(payload["model"]) == rec["steps"][FAULT_STEP]["before"]
        assert payload["guard"]["controller"]["step"] == FAULT_STEP
        assert rec["steps"][FAULT_STEP]["checkpoint"] == str(step_dir / f"rank{r}.pt")
    incidents = _lines(run_dir / "incidents.jsonl")
    assert len(incidents) == 1  # one firing -> one record, not one per rank
    assert incidents[0]["rank"] == 0 and incidents[0]["step"] == FAULT_STEP
    assert incidents[0]["rule"] == "nonfinite_rewards" and incidents[0]["checkpoint"] == str(step_dir / "rank0.pt")
    assert len(_lines(run_dir / "metrics.jsonl")) == FAULT_STEP + 1  # one line per step, rank 0 only


@pytest.mark.parametrize("world", WORLDS)
def test_rollback_restores_each_rank_and_writes_the_incident_once(launched, world):
    run = launched(world)
    ranks = run.scenario("rollback")
    incidents = _lines(run.out / "rollback_nan_reward" / "incidents.jsonl")
    assert [(i["step"], i["action"], i["rank"]) for i in incidents] == [(FAULT_STEP, "rollback", 0)]
    for rec in ranks:
        assert rec["steps"][FAULT_STEP]["cursor"] == 2  # restored from this rank's own snapshot
    assert len({rec["steps"][-1]["after"] for rec in ranks}) == 1


@pytest.mark.parametrize("world", WORLDS)
def test_a_failed_save_on_one_rank_fails_every_rank(launched, world):
    run = launched(world)
    assert run.returncodes == [0] * world  # every rank raised, caught it, and exited: none hung
    ranks = run.scenario("save_fail")
    for r, rec in enumerate(ranks):
        assert rec["raised"] is not None, f"rank {r} did not raise"
        if r == world - 1:
            assert "failed on this rank" in rec["raised"] and "IsADirectoryError" in rec["raised"]
        else:
            assert "another rank failed to save" in rec["raised"]
        # the same collectives on every rank: MAX + SUM of the step, then the failure flag
        assert [c[2] for c in rec["calls_at_raise"]][2:] == [1]
        assert len(rec["steps"]) == FAULT_STEP  # no rank went past the failed step
    step_dir = run.out / "save_fail" / "checkpoints" / f"step_{FAULT_STEP:08d}"
    assert (step_dir / f"rank{world - 1}.pt").is_dir()  # the blocked path, untouched; no temp files left
    assert not any(p.name.startswith(".") for p in step_dir.iterdir())
    assert torch.load(step_dir / "rank0.pt", weights_only=True)["step"] == FAULT_STEP
