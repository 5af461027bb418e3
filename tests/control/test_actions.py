"""Actions on a real (small) model through ``Guard``: skip, rollback, checkpoint_and_halt, atomic saves."""

import copy
import os

import pytest
import torch
from bitwise import assert_same
from guard_loop import full_state, setup, train_step

from rl_guard.control.checkpoint import atomic_save
from rl_guard.control.state import rng_state
from rl_guard.sinks import read_jsonl

SKIP = """
rules:
  - {name: big_grad, metric: rl_guard/grad/norm, op: ">", threshold: 100, action: skip_step}
"""


@pytest.mark.parametrize(
    "poison, scale, rule",
    [(float("inf"), 1.0, "nonfinite_grad"), (float("nan"), 1.0, "nonfinite_grad"), (None, 1e4, "big_grad")],
)
def test_skip_step_leaves_weights_and_moments_bitwise_unchanged(tmp_path, poison, scale, rule):
    guard, model, opt, sched = setup(tmp_path, SKIP)
    for _ in range(3):  # non-zero Adam moments first
        assert train_step(guard, model, opt, sched).action is None
    before = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    d = train_step(guard, model, opt, sched, scale=scale, poison=poison, always_step=True)
    assert d.action == "skip_step" and rule in [f.rule.name for f in d.firings]
    assert_same(before["model"], model.state_dict(), "model")
    assert_same(before["optimizer"], opt.state_dict(), "optimizer")  # exp_avg, exp_avg_sq and step untouched
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert train_step(guard, model, opt, sched).action is None  # and training goes on
    assert guard.controller.skipped_steps == 1
    guard.close()


ROLLBACK = """
snapshots: {healthy_steps: 2, every: 2, keep: 2, where: %s}
rollback: {max_rollbacks: 2, lr_scale: %s}
rules:
  - {name: big_grad, metric: rl_guard/grad/norm, op: ">", threshold: 100, action: rollback}
"""


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_rollback_restores_model_optimizer_scheduler_and_rng_bitwise(tmp_path, where):
    guard, model, opt, sched = setup(tmp_path, ROLLBACK % (where, 1.0))
    references, seen = {}, []
    for _ in range(7):
        assert train_step(guard, model, opt, sched).action is None
        steps = guard.actions.snapshots.steps()
        if steps and steps[-1] not in references:
            references[steps[-1]] = full_state(model, opt, sched)  # what a restore must give back
        seen.append(steps[-1] if steps else None)
    assert seen == [0, 2, 2, 4, 4, 6, 6] and guard.actions.snapshots.steps() == [4, 6]  # 0: the starting state
    diverged = full_state(model, opt, sched)
    d = train_step(guard, model, opt, sched, scale=1e4)
    assert d.action == "rollback" and d.firings[0].rule.name == "big_grad"
    assert_same(references[6], full_state(model, opt, sched))
    with pytest.raises(AssertionError):  # the check can fail: training really moved on since the snapshot
        assert_same(references[6], diverged)
    # Once more (budget 2): the fault is back before a new healthy snapshot, so one snapshot further back; then the
    # budget is spent and rollback escalates to checkpoint_and_halt.
    assert train_step(guard, model, opt, sched, scale=1e4).action == "rollback"
    assert_same(references[4], full_state(model, opt, sched))
    d = train_step(guard, model, opt, sched, scale=1e4)
    assert d.action == "checkpoint_and_halt" and d.escalated_from == "rollback" and d.stop
    guard.close()
    incidents = read_jsonl(tmp_path / "run" / "incidents.jsonl")
    assert [i["action"] for i in incidents] == ["rollback", "rollback", "checkpoint_and_halt"]


def test_rollback_lr_scale_persists_through_the_schedule(tmp_path):
    guard, model, opt, sched = setup(tmp_path, ROLLBACK % ("memory", 0.5))
    for _ in range(3):
        train_step(guard, model, opt, sched)
    snap_lr = guard.actions.snapshots.latest()["optimizer"]["param_groups"][0]["lr"]
    assert train_step(guard, model, opt, sched, scale=1e4).action == "rollback"
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * snap_lr, rel=1e-12)
    base = list(sched.base_lrs)
    for _ in range(4):  # LambdaLR recomputes lr from base_lrs: the halved rate must stick
        train_step(guard, model, opt, sched)
    assert base == [0.5 * 1e-2] * len(base)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 1e-2 * 0.9 ** (sched.last_epoch // 2), rel=1e-12)
    guard.close()


HALT = """
checkpoint: {keep: 2}
rules:
  - {name: loss_high, metric: rl_guard/loss/value, op: ">", threshold: 50, action: checkpoint_and_halt}
  - {name: loss_watch, metric: rl_guard/loss/value, op: ">", threshold: 1000000, action: warn}
"""


def test_checkpoint_and_halt_writes_a_loadable_checkpoint_and_an_incident(tmp_path):
    guard, model, opt, sched = setup(tmp_path, HALT)
    for _ in range(5):
        assert train_step(guard, model, opt, sched).action is None
    before = full_state(model, opt, sched)
    d = train_step(guard, model, opt, sched, scale=1e4)
    assert d.action == "checkpoint_and_halt" and d.stop and not d.apply_step
    guard.close()
    path = tmp_path / "run" / "checkpoints" / "step_00000005" / "rank0.pt"
    assert guard.actions.last_checkpoint == str(path)
    ckpt = torch.load(path, weights_only=True)
    assert {"model", "optimizer", "scheduler", "rng", "step", "guard", "extra"} <= set(ckpt)
    assert ckpt["step"] == 5 and ckpt["reason"] == "checkpoint_and_halt"
    assert_same(before["model"], ckpt["model"])  # the halting step's update never reached the weights
    assert_same(before["optimizer"], ckpt["optimizer"])
    assert_same(before["scheduler"], ckpt["scheduler"])
    assert_same(rng_state()["torch"], ckpt["rng"]["torch"])
    assert ckpt["guard"]["controller"]["step"] == 5 and ckpt["guard"]["controller"]["rollbacks"] == 0
    # A fresh model loads it strictly.
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    fresh.load_state_dict(ckpt["model"], strict=True)

    (incident,) = read_jsonl(tmp_path / "run" / "incidents.jsonl")
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    losses = [m["rl_guard/loss/value"] for m in metrics]
    assert incident["rule"] == "loss_high" and incident["action"] == "checkpoint_and_halt"
    assert incident["step"] == 5 and incident["checkpoint"] == str(path)
    assert incident["value"] == losses[5] > 50
    assert incident["message"] == (
        f"[rule loss_high] rl_guard/loss/value = {losses[5]:.4g} > 50 at step 5 (rank 0) -> checkpoint_and_halt"
    )
    assert incident["window"] == {"rl_guard/loss/value": losses[:5]}  # values BEFORE the trigger only
    assert {"severity", "metric", "op", "threshold", "time", "rank"} <= set(incident)


def test_checkpoints_beyond_keep_are_pruned(tmp_path):
    guard, model, opt, sched = setup(tmp_path, HALT)
    for _ in range(4):
        train_step(guard, model, opt, sched)
        guard.actions.save_checkpoint(reason="test")
    guard.close()
    kept = sorted(p.parent.name for p in (tmp_path / "run" / "checkpoints").glob("step_*/rank0.pt"))
    assert kept == ["step_00000003", "step_00000004"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == kept


def test_atomic_save_survives_a_crash_mid_write(tmp_path, monkeypatch):
    path = tmp_path / "ckpt" / "rank0.pt"
    good = {"w": torch.arange(1000, dtype=torch.float32), "step": 7}
    atomic_save(good, path)
    real_save = torch.save

    def crash_halfway(obj, f, *args, **kwargs):
        import io

        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])  # half a file reaches the disk...
        f.flush()
        raise OSError("simulated crash mid-save")  # ...then the process dies

    monkeypatch.setattr(torch, "save", crash_halfway)
    with pytest.raises(OSError, match="simulated crash"):
        atomic_save({"w": torch.zeros(1000), "step": 8}, path)
    monkeypatch.undo()
    assert os.listdir(path.parent) == ["rank0.pt"]  # no temp file left behind
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 7 and torch.equal(loaded["w"], good["w"])


def test_failed_checkpoint_save_fails_the_action_loudly(tmp_path, monkeypatch):
    guard, model, opt, sched = setup(tmp_path, HALT)
    train_step(guard, model, opt, sched)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="checkpoint save to .* failed on this rank"):
        guard.actions.save_checkpoint(reason="test")
    ckpt_dir = tmp_path / "run" / "checkpoints" / "step_00000001"
    assert not any(ckpt_dir.iterdir())
    guard.close()


def test_warn_only_steps_are_healthy_for_snapshots(tmp_path):
    """A noisy warn-level rule must not disable rollback: its steps applied their update, so they are healthy."""
    noisy = (
        ROLLBACK % ("memory", 1.0)
        + '  - {name: noisy, metric: rl_guard/loss/value, op: ">", threshold: 0, action: warn}\n'
    )
    guard, model, opt, sched = setup(tmp_path, noisy)
    for _ in range(3):
        assert train_step(guard, model, opt, sched).action == "warn"
    assert guard.actions.snapshots.steps() == [0, 2]  # the starting state too: a warn-only first check passes
    d = train_step(guard, model, opt, sched, scale=1e4)
    assert d.action == "rollback" and d.escalated_from is None
    guard.close()


ESCALATE = """
snapshots: {healthy_steps: 2, every: 2, keep: 2, where: memory}
rollback: {max_rollbacks: 3, lr_scale: 0.5}
rules:
  - {name: big_grad, metric: rl_guard/grad/norm, op: ">", threshold: 100, action: rollback}
"""


def test_a_fault_in_the_first_steps_rolls_back_to_the_starting_state(tmp_path):
    guard, model, opt, sched = setup(tmp_path, ESCALATE)
    start = full_state(model, opt, sched)
    assert train_step(guard, model, opt, sched).action is None
    assert guard.actions.snapshots.steps() == [0]  # the state before the first update
    d = train_step(guard, model, opt, sched, scale=1e4)
    assert d.action == "rollback" and guard.actions.last_restored == 0
    now = full_state(model, opt, sched)
    assert_same(start["model"], now["model"], "model")
    assert now["optimizer"]["state"] == {}  # Adam's moments as they were before the first step: none
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 1e-2, rel=1e-12)
    guard.close()


def test_a_fault_that_returns_goes_further_back_and_the_rate_scales_cumulatively(tmp_path):
    guard, model, opt, sched = setup(tmp_path, ESCALATE)
    for _ in range(5):
        assert train_step(guard, model, opt, sched).action is None
    assert guard.actions.snapshots.steps() == [2, 4]
    assert train_step(guard, model, opt, sched, scale=1e4).action == "rollback"
    assert guard.actions.last_restored == 4 and opt.param_groups[0]["lr"] == pytest.approx(0.5 * 1e-2 * 0.9**2)
    # back before a new healthy snapshot: one further back, the rate a quarter of the schedule's
    d = train_step(guard, model, opt, sched, scale=1e4)
    assert d.action == "rollback" and guard.actions.last_restored == 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25 * 1e-2 * 0.9**1)
    assert sched.base_lrs == pytest.approx([0.25 * 1e-2] * len(sched.base_lrs))
    # Healthy again: a snapshot taken at factor 0.25 restored by the third rollback gives 0.125, not 0.25 x 0.125.
    for _ in range(3):
        assert train_step(guard, model, opt, sched).action is None
    newest = guard.actions.snapshots.steps()[-1]
    assert guard.actions.snapshots.latest()["lr_factor"] == 0.25
    assert train_step(guard, model, opt, sched, scale=1e4).action == "rollback"
    assert guard.actions.last_restored == newest
    assert sched.base_lrs == pytest.approx([0.125 * 1e-2] * len(sched.base_lrs))
    d = train_step(guard, model, opt, sched, scale=1e4)  # the budget (3) is spent: halt, and say so
    assert d.action == "checkpoint_and_halt" and d.escalated_from == "rollback"
    assert "rollback budget spent: 3 of max_rollbacks=3" in d.firings[0].message
    guard.close()
    incidents = read_jsonl(tmp_path / "run" / "incidents.jsonl")
    assert [i.get("further_back", False) for i in incidents] == [False, True, False, False]


def test_the_guard_state_carries_the_rate_factor(tmp_path):
    guard, model, opt, sched = setup(tmp_path, ESCALATE)
    for _ in range(3):
        train_step(guard, model, opt, sched)
    train_step(guard, model, opt, sched, scale=1e4)
    state = guard.state_dict()
    other, *_ = setup(tmp_path / "b", ESCALATE)
    other.load_state_dict(state)
    assert other.actions.lr_factor == 0.5 and other.actions.last_restored == guard.actions.last_restored
