"""The OpenRLHF adapter fails at attach when a seam it relies on changed: every method it wraps or calls renamed or
re-signed, every setting it reads removed, the version outside the tested range. The trainer is shaped like
openrlhf 0.11.2's ``ActorPPOTrainer`` (the recipe's actor, engine and strategy, OpenRLHF's real ``PolicyLoss``); the
launcher's checks run on subclasses of stand-in classes with OpenRLHF's signatures."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
from file_modules import load_module

from rl_guard import Guard
from rl_guard.adapters import openrlhf as adapter
from rl_guard.adapters import openrlhf_launch as launch
from rl_guard.versions import SeamError, UnsupportedVersion

pytest.importorskip("openrlhf")
ROOT = Path(__file__).resolve().parents[2]
R = load_module("openrlhf_recipe", ROOT / "integrations" / "openrlhf" / "train.py")
CONTEXT = "OpenRLHF 0.11.2, tested with openrlhf >= 0.11, < 0.12"


class Trainer:
    """``ActorPPOTrainer``'s attributes and the methods ``install`` wraps, with openrlhf 0.11.2's signatures."""

    def __init__(self, tmp_path):
        actor = R.TinyActor()
        actor.model = R.Engine(actor, 1e-2, 1)
        args = SimpleNamespace(ckpt=SimpleNamespace(path=str(tmp_path / "ckpt")))
        self.strategy, self.actor, self.args = R.TorchStrategy(args, accumulated_gradient=1), actor, args
        self.actor_optim, self.actor_scheduler = actor.model.optimizer, actor.model.lr_scheduler
        self.actor_loss_fn = R.OR.PolicyLoss()

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        return {}

    def ppo_train(self, kl_ctl):
        return {}


def _install(trainer, tmp_path):
    return adapter.install(trainer, Guard.from_yaml("version: 1\nsinks: [jsonl]\n", run_dir=tmp_path / "run"))


def test_a_trainer_with_every_seam_attaches(tmp_path):
    trainer = Trainer(tmp_path)
    _install(trainer, tmp_path)
    assert "training_step" in vars(trainer) and "save_ckpt" in vars(trainer.strategy)  # wrapped, instance only


def _renamed(obj, name):
    """``obj`` whose ``name`` no longer resolves (a subclass of its class sets it to None, as a rename leaves it)."""
    obj.__class__ = type(type(obj).__name__, (type(obj),), {name: None})
    return obj


def _resigned(obj, name, fn):
    obj.__class__ = type(type(obj).__name__, (type(obj),), {name: fn})
    return obj


def _no_attr(obj, name):
    delattr(obj, name)
    return obj


SEAMS = {  # seam -> (what to change on a fresh trainer, what the error must name)
    "training_step renamed": (lambda t: _renamed(t, "training_step"), "Trainer.training_step is missing"),
    "training_step re-signed": (
        lambda t: _resigned(t, "training_step", lambda self, batch, kl_ctl, step: {}),
        "no longer takes experience",
    ),
    "ppo_train renamed": (lambda t: _renamed(t, "ppo_train"), "Trainer.ppo_train is missing"),
    "actor_loss_fn gone": (lambda t: _no_attr(t, "actor_loss_fn"), "Trainer has no actor_loss_fn"),
    "actor_optim gone": (lambda t: _no_attr(t, "actor_optim"), "Trainer has no actor_optim"),
    "Actor.forward re-signed": (
        lambda t: _resigned(t.actor, "forward", lambda self, sequences, action_mask: None),
        "no longer takes return_output",
    ),
    "PolicyLoss.forward re-signed": (
        lambda t: _resigned(
            t.actor_loss_fn,
            "forward",
            lambda self, logp, old_log_probs, advantages, action_mask=None, rollout_log_probs=None: None,
        ),
        "no longer takes log_probs",
    ),
    "PolicyLoss.clip_eps_low gone": (
        lambda t: _no_attr(t.actor_loss_fn, "clip_eps_low"),
        "PolicyLoss has no clip_eps_low",
    ),
    "PolicyLoss.policy_loss_type gone": (
        lambda t: _no_attr(t.actor_loss_fn, "policy_loss_type"),
        "PolicyLoss has no policy_loss_type",
    ),
    "save_ckpt re-signed": (
        lambda t: _resigned(
            t.strategy, "save_ckpt", lambda self, model, save_dir, tag=None, max_num=3, max_mem=1000, states=None: None
        ),
        "no longer takes client_state",
    ),
    "load_ckpt renamed": (lambda t: _renamed(t.strategy, "load_ckpt"), "TorchStrategy.load_ckpt is missing"),
    "optimizer_step re-signed": (
        lambda t: _resigned(t.strategy, "optimizer_step", lambda self, optimizer, engine, scheduler, name="m": None),
        "no longer takes model",
    ),
    "args.ckpt.path gone": (lambda t: _no_attr(t.args.ckpt, "path"), "has no path"),
}


@pytest.mark.parametrize("seam", list(SEAMS))
def test_a_changed_seam_fails_at_attach_naming_it(tmp_path, seam):
    change, named = SEAMS[seam]
    trainer = Trainer(tmp_path)
    change(trainer)
    with pytest.raises(SeamError) as err:
        _install(trainer, tmp_path)
    assert named in str(err.value) and CONTEXT in str(err.value)
    assert "training_step" not in vars(trainer)  # nothing was wrapped


def test_a_removed_experience_field_fails_at_attach(tmp_path, monkeypatch):
    fields = [f for f in adapter.EXPERIENCE_FIELDS if f != "rollout_log_probs"]
    changed = dataclasses.make_dataclass("Experience", [(f, object, dataclasses.field(default=None)) for f in fields])
    monkeypatch.setitem(__import__("sys").modules, adapter.EXPERIENCE_MODULE, SimpleNamespace(Experience=changed))
    with pytest.raises(SeamError, match="Experience has no rollout_log_probs") as err:
        _install(Trainer(tmp_path), tmp_path)
    assert CONTEXT in str(err.value)


def test_without_openrlhfs_module_the_first_experience_is_checked(tmp_path, monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, adapter.EXPERIENCE_MODULE, raising=False)
    trainer = Trainer(tmp_path)
    _install(trainer, tmp_path)
    fields = [f for f in adapter.EXPERIENCE_FIELDS if f != "advantages"]
    changed = dataclasses.make_dataclass("Experience", [(f, object, dataclasses.field(default=None)) for f in fields])
    with pytest.raises(SeamError, match="Experience has no advantages"):
        trainer.training_step(changed(), 0.0, 0)


def test_outside_the_tested_range_attach_refuses_unless_allowed(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RL_GUARD_ALLOW_UNTESTED", raising=False)  # as a user has it by default
    monkeypatch.setattr("rl_guard.versions.installed", lambda package: "0.12.0")
    with pytest.raises(UnsupportedVersion, match=r"openrlhf >= 0\.11, < 0\.12; found openrlhf 0\.12\.0"):
        _install(Trainer(tmp_path), tmp_path)
    monkeypatch.setenv("RL_GUARD_ALLOW_UNTESTED", "1")
    _install(Trainer(tmp_path), tmp_path)
    assert "attaching untested" in capsys.readouterr().err


class ActorPPOTrainer:
    def __init__(self, strategy, actor, ema_model, actor_optim, actor_scheduler, **kwargs):
        pass


class DeepspeedStrategy:
    def load_ckpt(self, model, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True):
        return None, {}


def test_launcher_checks_the_methods_it_patches():
    launch.check_classes(ActorPPOTrainer, DeepspeedStrategy)

    class Resigned(ActorPPOTrainer):
        def __init__(self, strategy, policy, ema_model, actor_optim, actor_scheduler):
            pass

    with pytest.raises(SeamError, match=r"Resigned.__init__.* no longer takes actor") as err:
        launch.check_classes(Resigned, DeepspeedStrategy)
    assert CONTEXT in str(err.value)

    class Renamed(DeepspeedStrategy):
        load_ckpt = None

    with pytest.raises(SeamError, match="Renamed.load_ckpt is missing"):
        launch.check_classes(ActorPPOTrainer, Renamed)


def test_the_launcher_reads_strategy_and_actor_by_name(tmp_path, monkeypatch):
    """``ActorPPOTrainer(strategy=..., actor=...)`` by keyword: the hook still finds both."""
    seen = {}
    monkeypatch.setenv(launch.CONFIG_ENV, "version: 1\nsinks: [jsonl]\n")
    monkeypatch.setenv(launch.RUN_DIR_ENV, str(tmp_path / "run"))
    monkeypatch.setattr("rl_guard.adapters.openrlhf.install", lambda trainer, guard: seen.update(guard=guard) or guard)
    trainer = Trainer(tmp_path)

    def init(self, strategy, actor, *args, **kwargs):
        seen["init"] = (strategy, actor)

    launch._install_on_init(init, trainer, strategy=trainer.strategy, actor=trainer.actor)
    assert seen["init"] == (trainer.strategy, trainer.actor) and trainer.rl_guard is seen["guard"]
    assert trainer.rl_guard.step == 0
