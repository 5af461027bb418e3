"""verl's real actor (``ActorRolloutRefWorker`` on FSDP2 over gloo, a tiny Llama) guarded through the config line
``actor_rollout_ref.model.external_lib=rl_guard.adapters.verl``, on one and on two processes.

Faults are injected on the last rank only; every rank must drop the update: its parameter shards and optimizer
state are bitwise what they were before ``update_actor`` (sha256 digests taken by ``verl_rank.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
TIMEOUT = 420  # seconds for a whole launch; one rank takes ~20 s to import verl and build the FSDP model

# The run's rules: the preset's non-finite-reward rule (gradients and loss are built in), plus two reward levels the
# worker produces on purpose to exercise rollback and checkpoint-and-halt. Snapshots after every healthy step.
CONFIG = """\
version: 1
sinks: [jsonl]
snapshots: {healthy_steps: 1, every: 1, keep: 2, where: memory}
rules:
  - {name: nonfinite_rewards, metric: rl_guard/input/rewards/nonfinite, op: ">", threshold: 0, action: skip_step}
  - {name: reward_jump, metric: rl_guard/reward/mean, op: ">", threshold: 2, action: rollback}
  - {name: reward_absurd, metric: rl_guard/reward/mean, op: "<", threshold: -5, action: checkpoint_and_halt}
"""


def launch(world: int, tmp: Path) -> list[dict]:
    from rl_guard.demo.tiny import build_tiny_model

    model = build_tiny_model(tmp / "model")
    (tmp / "guard.yaml").write_text(CONFIG)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               RL_GUARD_CONFIG=str(tmp / "guard.yaml"), RL_GUARD_RUN_DIR=str(tmp / "run"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, str(HERE / "verl_rank.py"), str(r), str(world), str(tmp / "pg"),
                               str(tmp), str(model)], env=env, cwd=tmp, stdout=open(tmp / f"rank{r}.log", "w"),
                              stderr=subprocess.STDOUT) for r in range(world)]
    for p in procs:
        try:
            p.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
    results = []
    for r in range(world):
        path = tmp / f"rank{r}.json"
        log = (tmp / f"rank{r}.log").read_text()[-6000:]
        assert path.exists(), f"rank {r} wrote no result:\n{log}"
        res = json.loads(path.read_text())
        assert "error" not in res, f"rank {r} failed:\n{res['error']}\n{log}"
        results.append(res)
    return results


def incidents(tmp: Path) -> list[dict]:
    path = tmp / "run" / "incidents.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_verl_actor_drops_faulty_updates_on_every_rank(world, tmp_path):
    results = launch(world, tmp_path)
    for rank, res in enumerate(results):
        assert res["guarded"], f"rank {rank}: the external_lib seam did not install the guard"
        steps = res["steps"]
        healthy = [s for s in steps if s["fault"] is None]
        for s in healthy:  # the guard lets healthy updates through: the weights move
            assert s["before"]["params"] != s["after"]["params"], f"rank {rank}: a healthy update was dropped"
            assert s["metrics"]["rl_guard/guard/fired"] == [0.0] * world
        for s in steps:
            assert s["after"]["finite"], f"rank {rank}: non-finite weights after {s['fault']}"
            if s["fault"] is None:
                continue
            # The update is dropped bitwise on every rank, including those where nothing was wrong.
            assert s["before"] == s["after"], f"rank {rank}: the {s['fault']} update reached the weights"
        by_fault = {s["fault"]: s for s in steps}
        assert "GuardHalted" in by_fault["halt"]["raised"], by_fault["halt"]
        for fault in ("inf_grad", "nan_reward", "rollback"):
            assert "raised" not in by_fault[fault], by_fault[fault]
            metrics = by_fault[fault]["metrics"]
            assert metrics["rl_guard/guard/fired"][0] >= 1, (fault, metrics)
        # verl's metrics path carries the guard's figures: one value per data-parallel rank, the same everywhere
        inf_metrics = by_fault["inf_grad"]["metrics"]
        assert len(inf_metrics["rl_guard/grad/nonfinite"]) == world and inf_metrics["rl_guard/grad/nonfinite"][0] > 0
        assert by_fault["nan_reward"]["metrics"]["rl_guard/input/rewards/nonfinite"][0] > 0
    rules = [(i["step"], i["rule"], i["action"]) for i in incidents(tmp_path)]
    assert [r[1:] for r in rules] == [("nonfinite_grad", "skip_step"), ("nonfinite_rewards", "skip_step"),
                                      ("reward_jump", "rollback"), ("reward_absurd", "checkpoint_and_halt")], rules
    assert sorted((tmp_path / "run" / "checkpoints").glob("step_*/rank*.pt")), "the halt saved no checkpoint"
