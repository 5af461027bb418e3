"""Shared pieces of the TRL adapter tests: one tiny model per session, a GRPO runner, a finiteness checker.

Every run is a real ``GRPOTrainer`` on CPU (tiny Llama, word-level tokenizer, built locally: no downloads).
"""

from __future__ import annotations

import importlib.metadata
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from bitwise import assert_same
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from rl_guard.demo.tiny import DEMO_LOSS, TINY_GRPO

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent

# -- the framework suites: tests/adapters/verl, areal and openrlhf ---------------------------------------------------
# Each framework pins transformers apart from the main environment's and from the others': each folder runs in its
# own nox session (nox -s verl | areal | openrlhf), and the main session leaves the three folders out (--ignore).
# Collected anywhere else, each of their test files stands for one module-level skip that says so: a skip outside CI,
# a failing test under CI=true (tests/conftest.py).
FRAMEWORK_SUITES = {  # folder -> (distribution, whether a transformers (major, minor) suits it)
    "verl": ("verl", None),
    "areal": ("areal", lambda v: (5, 0) <= v <= (5, 3)),
    "openrlhf": ("openrlhf", lambda v: v == (5, 15)),
}


def framework_missing(folder: str) -> str | None:
    """Why this environment cannot run the folder's suite, or None when it can."""
    dist, transformers_ok = FRAMEWORK_SUITES[folder]
    elsewhere = f"tests/adapters/{folder} runs in its own environment (nox -s {folder})"
    try:  # installed distributions, not find_spec: the folder tests/adapters/verl itself imports as a package "verl"
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return f"{dist} is not installed: {elsewhere}"
    if transformers_ok is not None:
        version = importlib.metadata.version("transformers")
        try:
            suits = transformers_ok(tuple(int(x) for x in version.split(".")[:2]))
        except ValueError:
            suits = False
        if not suits:
            return f"{dist} pins another transformers than {version}: {elsewhere}"
    return None


class _FrameworkMissing(pytest.Module):
    """A framework suite's test file in an environment without its framework: one module-level skip, not imported."""

    reason = ""

    def collect(self):
        pytest.skip(self.reason)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path, parent):
    parts = Path(module_path).resolve().relative_to(HERE).parts
    if len(parts) > 1 and parts[0] in FRAMEWORK_SUITES:
        reason = framework_missing(parts[0])
        if reason is not None:
            module = _FrameworkMissing.from_parent(parent, path=Path(module_path))
            module.reason = reason
            return module
    return None


# Settings that run on CPU in well under a second per step; beta > 0 so the reference KL exists.
GRPO_BASE = dict(
    **TINY_GRPO,
    **DEMO_LOSS,
    report_to=[],
    save_strategy="no",
    logging_steps=1,
    disable_tqdm=True,
    seed=0,
    learning_rate=3e-3,
)


class FiniteCheck(TrainerCallback):
    """Checks the update the optimizer is about to apply (gradients, after every earlier callback, the guard
    included) and the weights after every step. ``strict``: assert; otherwise record the first non-finite
    step (an unguarded twin) and, with ``stop``, end training there."""

    def __init__(self, strict: bool = True, stop: bool = False):
        self.strict, self.stop = strict, stop
        self.first_nonfinite: tuple[int, str] | None = None
        self.steps_checked = 0

    def _flag(self, step: int, what: str, control) -> None:
        assert not self.strict, f"non-finite {what} at step {step}"
        if self.first_nonfinite is None:
            self.first_nonfinite = (step, what)
        if self.stop:
            control.should_training_stop = True

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads and not bool(torch.isfinite(torch.stack(torch._foreach_norm(grads, 2.0))).all()):
            self._flag(state.global_step, "gradient", control)

    def on_step_end(self, args, state, control, model=None, **kw):
        self.steps_checked += 1
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            self._flag(state.global_step - 1, "weights", control)  # global_step already counts this step


@dataclass
class Run:
    trainer: object
    injector: object
    checker: FiniteCheck
    callback: object | None
    run_dir: Path

    @property
    def guard(self):
        return self.callback.guard

    def incidents(self) -> list[dict]:
        from rl_guard.sinks.jsonl import read_jsonl

        path = self.run_dir / "incidents.jsonl"
        return read_jsonl(path) if path.exists() else []

    def metrics(self) -> list[dict]:
        from rl_guard.sinks.jsonl import read_jsonl

        return read_jsonl(self.run_dir / "metrics.jsonl")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rl_guard.demo.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def grpo_run(tiny_model):
    """``grpo_run(tmp, steps, guard=None, fault="none", at_step=0, factor=None, checker=None, **grpo)``;
    ``guard``: YAML text (an ``RLGuardCallback`` writing to ``tmp/guard``), a ready callback, or None (unguarded)."""
    from trl import GRPOConfig, GRPOTrainer

    from rl_guard.adapters.trl import RLGuardCallback
    from rl_guard.demo.faults import FaultInjector
    from rl_guard.demo.tiny import length_penalty_reward, prompt_dataset, repeat_last_digit_reward

    dataset = prompt_dataset(64, seed=0)

    def run(
        tmp: Path,
        steps: int,
        guard=None,
        fault: str = "none",
        at_step: int = 0,
        factor: float | None = None,
        checker: FiniteCheck | None = None,
        extra_callbacks=(),
        **grpo,
    ) -> Run:
        injector = FaultInjector(fault, at_step=at_step, factor=factor)
        checker = checker or FiniteCheck()
        callback = RLGuardCallback(guard, run_dir=str(Path(tmp) / "guard")) if isinstance(guard, str) else guard
        callbacks = [injector] + ([callback] if callback else []) + [checker, *extra_callbacks]
        args = GRPOConfig(output_dir=str(Path(tmp) / "trainer"), max_steps=steps, **{**GRPO_BASE, **grpo})
        trainer = GRPOTrainer(
            model=str(tiny_model),
            args=args,
            train_dataset=dataset,
            callbacks=callbacks,
            reward_funcs=[injector.faulty_reward(repeat_last_digit_reward), length_penalty_reward],
        )
        trainer.pop_callback(PrinterCallback)  # every log line holds ~150 guard metrics: keep test output short
        trainer.train()
        return Run(trainer, injector, checker, callback, callback.guard.run_dir if callback else None)

    return run


def state_copy(obj):
    """Deep host copy of a (nested) state dict, so later training cannot alias it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: state_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(state_copy(v) for v in obj)
    return obj


class StepStates(TrainerCallback):
    """Host copies of model / optimizer / scheduler state (and RNG) at the start and end of chosen steps (all
    when ``steps`` is None). Put it after the guard: ``end`` then sees the state the guard left (snapshot taken,
    rollback restored); with ``guard`` it also records the guard's snapshot ring at every step end."""

    def __init__(self, steps=None, guard=None):
        self.steps = None if steps is None else set(steps)
        self.guard_callback = guard
        self.begin: dict[int, dict] = {}
        self.end: dict[int, dict] = {}
        self.snapshot_steps: dict[int, list[int]] = {}
        self.latest_snapshot: dict[int, dict] = {}

    @staticmethod
    def capture(model, optimizer, lr_scheduler) -> dict:
        return {
            "model": state_copy(model.state_dict()),
            "optimizer": state_copy(optimizer.state_dict()),
            "scheduler": state_copy(lr_scheduler.state_dict()),
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state()[1].copy(),
                "python": random.getstate(),
            },
        }

    def _wanted(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def on_step_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        if self._wanted(state.global_step):
            self.begin[state.global_step] = self.capture(model, optimizer, lr_scheduler)

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        step = state.global_step - 1  # global_step already counts this step
        if self._wanted(step):
            self.end[step] = self.capture(model, optimizer, lr_scheduler)
        if self.guard_callback is not None:
            ring = self.guard_callback.guard.actions.snapshots
            self.snapshot_steps[step] = ring.steps()
            if len(ring):
                self.latest_snapshot[step] = ring.latest()


@pytest.fixture(scope="session")
def step_states():
    return StepStates


@pytest.fixture(scope="session")
def finite_check():
    return FiniteCheck


@pytest.fixture(scope="session")
def same_state():
    return assert_same
