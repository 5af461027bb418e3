"""verl's real actor (``ActorRolloutRefWorker`` on FSDP2 over gloo, a tiny Llama) guarded through the config line
``actor_rollout_ref.model.external_lib=rl_guard.adapters.verl``, on one and on two processes, run through the
recipe ``integrations/verl/actor_on_cpu.py`` with its ``guard.yaml``.

Faults are injected on the last rank only; every rank must drop the update: its parameter shards and optimizer
state are bitwise what they were before ``update_actor`` (sha256 digests taken by each rank). The guard's metrics
must reach verl's own ``Tracking`` logger as ``actor/rl_guard/...``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "integrations" / "verl"))

import actor_on_cpu  # noqa: E402


def results(world: int, out: Path) -> list[dict]:
    codes = actor_on_cpu.launch(world, out, timeout=280)
    found = []
    for r in range(world):
        log = (out / f"rank{r}.log").read_text()[-6000:]
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} (exit {codes[r]}) wrote no result:\n{log}"
        res = json.loads(path.read_text())
        assert "error" not in res, f"rank {r} failed:\n{res['error']}\n{log}"
        found.append(res)
    assert codes == [0] * world, codes
    return found


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_verl_actor_drops_faulty_updates_on_every_rank(world, tmp_path, monkeypatch):
    monkeypatch.delenv("RL_GUARD_CONFIG", raising=False)  # the recipe's guard.yaml
    monkeypatch.delenv("RL_GUARD_RUN_DIR", raising=False)
    ranks = results(world, tmp_path)
    for rank, res in enumerate(ranks):
        assert res["guarded"], f"rank {rank}: the external_lib seam did not install the guard"
        steps = res["steps"]
        assert [s["fault"] for s in steps] == actor_on_cpu.FAULTS
        for s in steps:
            assert s["after"]["finite"], f"rank {rank}: non-finite weights after {s['fault']}"
            if s["fault"] is None:  # healthy updates go through: the weights move, no rule fired
                assert s["before"]["params"] != s["after"]["params"], f"rank {rank}: a healthy update was dropped"
                assert s["metrics"]["rl_guard/guard/fired"] == [0.0] * world
            else:  # dropped bitwise on every rank, also where nothing was wrong
                assert s["before"] == s["after"], f"rank {rank}: the {s['fault']} update reached the weights"
        check_translation(steps[0]["metrics"], world)
        # verl's save_checkpoint / load_checkpoint carry the guard's state (the worker disturbed it in between)
        assert res["resume"]["loaded"] == res["resume"]["saved"] == {"step": len(steps), "skipped_steps": 4}
        assert (tmp_path / "checkpoint" / "actor" / "rl_guard" / f"rank{rank}.pt").exists()
        by_fault = {s["fault"]: s for s in steps}
        assert "GuardHalted" in by_fault["halt"]["raised"], by_fault["halt"]
        for fault in ("inf_grad", "nan_reward", "rollback"):
            assert "raised" not in by_fault[fault], by_fault[fault]
            assert by_fault[fault]["metrics"]["rl_guard/guard/fired"] == [1.0] * world, by_fault[fault]["metrics"]
        # verl's metrics path carries the guard's figures: one entry per data-parallel rank, equal on all
        assert by_fault["inf_grad"]["metrics"]["rl_guard/grad/nonfinite"] == [float(world)] * world
        assert by_fault["nan_reward"]["metrics"]["rl_guard/input/rewards/nonfinite"] == [1.0] * world
    lines = (tmp_path / "run" / "incidents.jsonl").read_text().splitlines()
    fired = [(i["step"], i["rule"], i["action"]) for i in map(json.loads, lines)]
    assert fired == [
        (1, "nonfinite_grad", "skip_step"),
        (3, "nonfinite_rewards", "skip_step"),
        (4, "reward_jump", "rollback"),
        (5, "reward_collapse", "checkpoint_and_halt"),
    ], fired
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*/rank*.pt"))
    assert saved == [f"rank{r}.pt" for r in range(world)], saved
    # verl's own Tracking (tensorboard backend), fed as RayPPOTrainer feeds it, holds the guard's figures
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["actor/rl_guard/guard/fired"] == [(1, 0.0), (2, 1.0), (3, 0.0), (4, 1.0), (5, 1.0)]
    assert scalars["actor/rl_guard/grad/nonfinite"][1] == (2, float(world))
    assert scalars["actor/rl_guard/input/rewards/nonfinite"][3] == (4, 1.0)


def check_translation(metrics: dict, world: int) -> None:
    """The first step's statistics against float64 references built from the same rollout batches: verl's response
    mask, per-sequence rewards (``token_level_scores`` summed over the response) and lengths reach the guard, and the
    ratio is 1 because the old log-probs were recomputed by the same weights."""
    scores, lengths = [], []
    for r in range(world):
        actor_on_cpu.RANK, actor_on_cpu.WORLD = r, world
        batch = actor_on_cpu.rollout(0, None)
        mask = batch["response_mask"].numpy().astype(np.float64)
        scores.append((batch["token_level_scores"].numpy().astype(np.float64) * mask).sum(-1))
        lengths.append(mask.sum(-1))
    scores, lengths = np.concatenate(scores), np.concatenate(lengths)
    assert metrics["rl_guard/tokens/count"] == [lengths.sum()] * world
    assert np.allclose(metrics["rl_guard/reward/mean"], scores.mean(), rtol=1e-6, atol=0)
    assert np.allclose(metrics["rl_guard/length/mean"], lengths.mean(), rtol=1e-12, atol=0)
    assert np.allclose(metrics["rl_guard/ratio/mean"], 1.0, rtol=0, atol=1e-6)
    assert np.allclose(metrics["rl_guard/kl_old/k3_mean"], 0.0, rtol=0, atol=1e-9)


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
