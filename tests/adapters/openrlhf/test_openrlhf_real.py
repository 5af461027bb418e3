"""The guard on OpenRLHF's real actor path (openrlhf 0.11.2, deepspeed 0.19.6 ZeRO-2 bf16 on CPU, gloo), attached
by the launcher's Ray worker hook, one and two processes; then a resume from OpenRLHF's own checkpoint.

Runs in the nox session ``openrlhf`` (noxfile.py, constraints/openrlhf.txt: transformers 5.15.0,
deepspeed 0.19.6 and ray 2.55.0 as openrlhf pins; torch 2.13.0 CPU; no flash-attn / vLLM, which are CUDA builds).
Each rank runs the recipe ``integrations/openrlhf/actor_on_cpu.py``; its docstring lists what is OpenRLHF's own
code and the named patches of hard-coded CUDA calls.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rank_launch import run_ranks as launch

# deepspeed + openrlhf imports and engine set-up: about 20 s per process, two phases; slower on a loaded machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from rl_guard.demo.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def run_ranks(model, out: Path, world: int, phase: str) -> list[dict]:
    return launch(ROOT / "integrations" / "openrlhf" / "actor_on_cpu.py", [model, out, phase], world)


@pytest.mark.parametrize("world", [1, 2])
def test_launcher_hook_guards_the_real_actor_and_resumes(model, tmp_path, world):
    ranks = run_ranks(model, tmp_path, world, "train")
    first = ranks[0]
    assert first["backend"] == "gloo" and first["guard_step_at_start"] == 0
    assert first["applied"] == [True, True] and first["moved_after_snapshot"]
    # rollback: strategy.load_ckpt of the snapshot after step 1; the weights are bitwise those after step 1
    assert first["rolled_back"]
    # skip: DeepSpeed's own overflow path, the weights are bitwise unchanged
    assert first["skipped_unchanged"]
    assert (first["steps"], first["skipped"], first["rollbacks"]) == (4, 2, 1)
    # behaviour (vLLM) vs the trainer's recompute: exactly 1, then e^-6 and e^-2; ppo_train's status carries them
    assert first["behave_min"] == pytest.approx([1.0, 2.478752e-3, 0.1353353], rel=1e-5)
    assert "rl_guard/behave_imp_weight/p99" in first["status_has_guard"]
    # update probe over ZeRO's fp32 master partitions, merged by sum across ranks: the parameter norm before
    # step 3 is that of the full fp32 weights, on every rank
    for r in ranks:
        assert r["param_norm"][1] == pytest.approx(r["param_norm"][0], rel=1e-6) and r["update_rel"] > 0
    # where: memory -> the snapshot tags live on /dev/shm; the save-and-halt directory stays on disk
    assert first["snapshot_dir"].startswith("/dev/shm/") and "rl_guard_step1" in first["snapshot_tags"]
    assert all(r["snapshot_tags"] == first["snapshot_tags"] for r in ranks)  # no rank freed it under another
    assert not os.path.exists(first["snapshot_dir"])  # RAM freed once the last rank exited
    assert first["ckpt_dir"].startswith(str(tmp_path))
    keys = ("applied", "rolled_back", "skipped_unchanged", "steps", "skipped", "rollbacks", "behave_min")
    for other in ranks[1:]:
        assert {k: other[k] for k in keys} == {k: first[k] for k in keys}

    # resume (--ckpt.load_enable): OpenRLHF's load_ckpt hands back client_state["rl_guard"] and the guard continues
    resumed = run_ranks(model, tmp_path, world, "resume")
    for r in resumed:
        assert "rl_guard" in r["checkpoint_states"]
        assert (r["guard_step_at_start"], r["skipped_at_start"], r["rollbacks_at_start"]) == (4, 2, 1)
        assert r["applied_after_resume"] and r["steps"] == 5


def test_two_rollbacks_restore_the_same_snapshot_through_strategy_load_ckpt(model, tmp_path):
    """Two ranks, a snapshot after every healthy step, ``confirm_steps: 2``: the second rollback needs the oldest
    snapshot again. Each rollback leaves the weights bitwise as after step 0, and the snapshot directory holds
    exactly the tags the ring offers (the guard frees what it forgets; OpenRLHF's own rotation, ``max_num = keep +
    1``, never reaches one of them)."""
    ranks = run_ranks(model, tmp_path, 2, "rollback_twice")
    first = ranks[0]
    # 0: the starting state, a snapshot from the first check on (pushed out of the ring of 3 at step 3)
    assert first["offered"] == [[0, 1], [0, 1, 2], [1, 2, 3], [1], [1, 5], [1, 5, 6], [1]]
    # the starting state (0) is written beside the run's own checkpoints (ckpt.path), the healthy snapshots after
    # a step into the snapshot directory listed here
    assert first["tags"] == [[f"rl_guard_step{n}" for n in steps if n] for steps in first["offered"]]
    assert [i for i, ok in enumerate(first["restored"]) if ok] == [0, 3, 6]
    assert (first["steps"], first["rollbacks"]) == (7, 2)
    for other in ranks[1:]:
        assert {k: other[k] for k in ("offered", "tags", "restored")} == {
            k: first[k] for k in ("offered", "tags", "restored")
        }
