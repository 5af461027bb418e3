"""The AReaL adapter fails at attach when a seam it relies on changed (the recipe's AReaL-shaped engine, its methods
renamed or re-signed in subclasses; ``grpo_loss_fn``'s settings; the package absent or outside the tested range),
says once what it falls back to, and verifies its skips: an optimizer that steps after the guard dropped the update
escalates to checkpoint-and-halt, a ``train_batch`` that bypasses the gate is an error. The guard's state file for
AReaL's recover checkpoints is plain data (``torch.load(weights_only=True)``)."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from file_modules import load_module

from rl_guard import Guard
from rl_guard.adapters import areal as adapter
from rl_guard.adapters.seams import load_state, save_state
from rl_guard.errors import GuardHalted
from rl_guard.versions import SeamError, UnsupportedVersion

if importlib.util.find_spec("areal") is None:
    pytest.skip("areal not installed (pip install --no-deps areal==1.0.4)", allow_module_level=True)
ROOT = Path(__file__).resolve().parents[2]
R = load_module("areal_async_recipe", ROOT / "integrations" / "areal_async" / "train.py")
CONTEXT = "AReaL 1.0.4, tested with areal >= 1.0, < 1.1"
ALWAYS_SKIP = """
version: 1
sinks: [jsonl]
rules:
  - {name: always, metric: rl_guard/tokens/count, op: ">", threshold: 0, action: skip_step}
"""


def _engine(cls=None):
    torch.manual_seed(0)
    return (cls or R.Engine)(R.Policy(), lr=1e-2)


def _guard(tmp_path, text="version: 1\nsinks: [jsonl]\n"):
    return Guard.from_yaml(text, run_dir=tmp_path / "run")


def _subclass(**body):
    return type("Engine", (R.Engine,), body)


SEAMS = {  # seam -> (engine class, what the error must name)
    "train_batch renamed": (_subclass(train_batch=None), "Engine.train_batch is missing"),
    "train_batch re-signed": (_subclass(train_batch=lambda self, input_, loss, weight: {}), "no longer takes loss_fn"),
    "optimizer_step renamed": (_subclass(optimizer_step=None), "Engine.optimizer_step is missing"),
    "optimizer_zero_grad renamed": (_subclass(optimizer_zero_grad=None), "Engine.optimizer_zero_grad is missing"),
    "get_version renamed": (_subclass(get_version=None), "Engine.get_version is missing"),
}


def test_an_engine_with_every_seam_attaches(tmp_path):
    engine = _engine()
    adapter.install(engine, _guard(tmp_path))
    assert "train_batch" in vars(engine) and "optimizer_step" in vars(engine)


@pytest.mark.parametrize("seam", list(SEAMS))
def test_a_changed_seam_fails_at_attach_naming_it(tmp_path, seam):
    cls, named = SEAMS[seam]
    engine = _engine(cls)
    with pytest.raises(SeamError) as err:
        adapter.install(engine, _guard(tmp_path))
    assert named in str(err.value) and CONTEXT in str(err.value)
    assert "train_batch" not in vars(engine)  # nothing was wrapped


@pytest.mark.parametrize("attr", adapter.ENGINE_ATTRS)
def test_a_missing_engine_attribute_fails_at_attach(tmp_path, attr):
    engine = _engine()
    delattr(engine, attr)
    with pytest.raises(SeamError, match=f"Engine has no {attr}"):
        adapter.install(engine, _guard(tmp_path))


def test_grpo_loss_fn_without_a_setting_read_fails_at_attach(tmp_path, monkeypatch):
    def grpo_loss_fn(logprobs, entropy, input_data, eps_clip, eps_clip_higher, current_version=None):
        pass  # importance_sampling_level gone

    monkeypatch.setitem(sys.modules, adapter.LOSS_MODULE, SimpleNamespace(grpo_loss_fn=grpo_loss_fn))
    with pytest.raises(SeamError, match="no longer takes importance_sampling_level") as err:
        adapter.install(_engine(), _guard(tmp_path))
    assert CONTEXT in str(err.value)


def test_absent_areal_refuses_unless_allowed_and_then_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RL_GUARD_ALLOW_UNTESTED", raising=False)  # as a user has it by default
    monkeypatch.setattr("rl_guard.adapters.areal.installed", lambda package: None)
    monkeypatch.setattr("rl_guard.versions.installed", lambda package: None)
    with pytest.raises(UnsupportedVersion, match="areal is not installed"):
        adapter.install(_engine(), _guard(tmp_path / "a"))
    monkeypatch.setenv("RL_GUARD_ALLOW_UNTESTED", "1")
    adapter.install(_engine(), _guard(tmp_path / "b"))
    assert "areal is not installed (RL_GUARD_ALLOW_UNTESTED=1)" in capsys.readouterr().err


def test_outside_the_tested_range_attach_refuses(tmp_path, monkeypatch):
    monkeypatch.delenv("RL_GUARD_ALLOW_UNTESTED", raising=False)  # as a user has it by default
    monkeypatch.setattr("rl_guard.versions.installed", lambda package: "1.1.0")
    with pytest.raises(UnsupportedVersion, match=r"areal >= 1\.0, < 1\.1; found areal 1\.1\.0"):
        adapter.install(_engine(), _guard(tmp_path))


def _batch(engine, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = 4
    ids = torch.randint(0, R.K, (b, R.L), generator=g)
    batch = {
        "input_ids": ids,
        "loss_mask": torch.ones(b, R.L, dtype=torch.int32),
        "logprobs": torch.zeros(b, R.L),
        "versions": torch.zeros(b, R.L, dtype=torch.int32),
        "rewards": torch.rand(b, generator=g),
    }
    batch["loss_mask"][:, 0] = 0
    prox = engine.compute_logp(batch)
    batch["logprobs"][:, 1:] = prox[:, :-1]
    batch["prox_logp"] = prox
    return R.compute_advantages(batch, group=2)


def own_loss(logprobs, entropy, input_data, eps_clip=0.3):
    """A loss function with its own clip and no other setting."""
    mask = input_data["loss_mask"].bool()
    return -(torch.exp(logprobs - input_data["prox_logp"]) * input_data["advantages"])[mask].mean()


def _train(engine, loss_fn, seed=0):
    return engine.train_batch(_batch(engine, seed), loss_fn, lambda x: x["loss_mask"].count_nonzero())


@pytest.mark.filterwarnings("ignore:rl_guard.*cannot fire:RuntimeWarning")
def test_loss_settings_come_from_the_call_and_fallbacks_are_said_once(tmp_path, capsys):
    engine = _engine()
    guard = adapter.install(engine, _guard(tmp_path))
    _train(engine, own_loss)
    _train(engine, own_loss, seed=1)
    err = capsys.readouterr().err
    assert err.count("AReaL's loss_fn does not give") == 1  # once, not per call
    for said in ("eps_clip_higher=None", "importance_sampling_level=token", "current_version=the engine's"):
        assert said in err
    assert "eps_clip=" not in err.replace("eps_clip_higher", "")  # the loss function's own eps_clip is read
    assert guard.step == 2 and guard.internal_failures == 0 and guard.skipped_steps == 0
    bound = functools.partial(own_loss, eps_clip=0.1)  # a partial's keywords count too
    _train(engine, bound)
    assert "does not give" not in capsys.readouterr().err


class SteppingAnyway(R.Engine):
    """A release whose train_batch steps the optimizer itself after calling optimizer_step."""

    def train_batch(self, input_, loss_fn, loss_weight_fn):
        stats = super().train_batch(input_, loss_fn, loss_weight_fn)
        self.model(torch.zeros(1, R.L, dtype=torch.long)).float().sum().backward()
        self.optimizer.step()
        return stats


def test_an_optimizer_step_after_a_dropped_update_escalates_to_checkpoint_and_halt(tmp_path):
    engine = _engine(SteppingAnyway)
    guard = adapter.install(engine, _guard(tmp_path, ALWAYS_SKIP))
    with pytest.raises(GuardHalted, match="AReaL applied the update of step 0 that the guard dropped"):
        _train(engine, own_loss)
    assert guard.stopped["rule"] == "skip_not_taken" and guard.stopped["escalated_from"] == "skip_step"
    records = [json.loads(line) for line in (tmp_path / "run" / "incidents.jsonl").read_text().splitlines()]
    assert records[-1]["rule"] == "skip_not_taken" and records[-1]["decision"] == "checkpoint_and_halt"
    assert records[-1]["checkpoint"] and Path(records[-1]["checkpoint"]).exists()


class Bypassing(R.Engine):
    """A release whose train_batch steps without calling optimizer_step."""

    def train_batch(self, input_, loss_fn, loss_weight_fn):
        self.optimizer_zero_grad()
        self.optimizer.step()
        return {}


def test_a_train_batch_that_bypasses_the_gate_is_an_error(tmp_path):
    engine = _engine(Bypassing)
    adapter.install(engine, _guard(tmp_path))
    with pytest.raises(SeamError, match="returned without calling optimizer_step"):
        _train(engine, own_loss)


def test_skipped_steps_leave_the_optimizer_alone(tmp_path):
    engine = _engine()
    guard = adapter.install(engine, _guard(tmp_path, ALWAYS_SKIP))
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    stats = _train(engine, own_loss)
    assert stats["update_successful"] == 0.0 and guard.skipped_steps == 1
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())


def test_guard_state_for_recover_checkpoints_is_plain_data(tmp_path):
    snapshots = "snapshots: {healthy_steps: 1, every: 1, keep: 2, where: memory}\n"
    rule = "rules:\n  - {name: r, metric: rl_guard/tokens/count, op: '<', threshold: 0, action: rollback}\n"
    engine = _engine()
    guard = adapter.install(engine, _guard(tmp_path, "version: 1\nsinks: [jsonl]\n" + snapshots + rule))
    for seed in range(3):
        _train(engine, own_loss, seed)
    save_state(guard.state_dict(), tmp_path / "state.pt")
    fresh = _guard(tmp_path / "fresh")
    fresh.load_state_dict(load_state(tmp_path / "state.pt"))  # torch.load(weights_only=True)
    assert fresh.step == guard.step == 3
    with pytest.raises(Exception):  # noqa: B017 - torch's unpickling error: not plain data, refused at save
        save_state({"path": Path("/x")}, tmp_path / "bad.pt")
    assert not (tmp_path / "bad.pt").exists()
