"""The DeepSpeed gate's attach-time checks (``check_engine``) on an engine with ``DeepSpeedEngine``'s methods whose
optimizer is a subclass of DeepSpeed's own ZeRO optimizer class, built without a process group: every seam renamed
or removed fails at attach, naming the version and the tested range; an optimizer the guard cannot skip through
(no overflow path, not a torch optimizer) is refused. The overflow path disabled on a real engine is in
tests/adapters/test_openrlhf_deepspeed.py."""

from __future__ import annotations

import pytest
import torch

from rl_guard import Guard
from rl_guard.adapters import deepspeed as ds
from rl_guard.versions import SeamError, UnsupportedVersion, installed

deepspeed = pytest.importorskip("deepspeed")
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer  # noqa: E402

CONTEXT = f"DeepSpeed {installed('deepspeed')}, tested with deepspeed >= 0.19.6, < 0.19.7"


def _zero_optimizer(cls=DeepSpeedZeroOptimizer):
    """An instance of the class without its constructor (which needs a process group), with the attributes the
    constructor sets and the gate reads."""
    opt = object.__new__(cls)
    opt.overflow, opt.cpu_offload, opt.averaged_gradients = False, False, {}
    opt.single_partition_of_fp32_groups = [torch.zeros(4)]
    return opt


class Engine:
    """``DeepSpeedEngine``'s methods and attributes the gate uses."""

    def __init__(self, optimizer, stage=2):
        self.optimizer, self.stage, self.skipped_steps, self.module = optimizer, stage, 0, torch.nn.Linear(2, 2)

    def step(self, lr_kwargs=None):
        pass

    def is_gradient_accumulation_boundary(self):
        return True

    def zero_optimization_stage(self):
        return self.stage

    def fp16_enabled(self):
        return False


def test_zero_and_stage_0_engines_attach():
    assert ds.check_engine(Engine(_zero_optimizer())) == ds.OVERFLOW
    plain = Engine(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), stage=0)
    assert ds.check_engine(plain) == ds.DROP_GRADS


def _renamed(cls, name):
    return type(cls.__name__, (cls,), {name: None})


@pytest.mark.parametrize("name", ["step", "is_gradient_accumulation_boundary", "fp16_enabled"])
def test_a_renamed_engine_method_fails_at_attach(name):
    engine = Engine(_zero_optimizer())
    engine.__class__ = _renamed(Engine, name)
    with pytest.raises(SeamError, match=f"Engine.{name} is missing") as err:
        ds.check_engine(engine)
    assert CONTEXT in str(err.value)


def test_engine_without_skipped_steps_fails_at_attach():
    engine = Engine(_zero_optimizer())
    del engine.skipped_steps
    with pytest.raises(SeamError, match="Engine has no skipped_steps"):
        ds.check_engine(engine)


def test_zero_optimizer_without_check_overflow_fails_at_attach():
    opt = _zero_optimizer(_renamed(DeepSpeedZeroOptimizer, "check_overflow"))
    with pytest.raises(SeamError, match="no overflow / check_overflow") as err:
        ds.EngineGate(Engine(opt), Guard.from_yaml("version: 1\nsinks: [jsonl]\n", open_run_dir=False))
    assert CONTEXT in str(err.value)


def test_zero_optimizer_without_overflow_fails_at_attach():
    opt = _zero_optimizer()
    del opt.overflow
    with pytest.raises(SeamError, match="no overflow / check_overflow"):
        ds.check_engine(Engine(opt))


@pytest.mark.parametrize("attr", ds.ZERO_ATTRS[1])
def test_zero_optimizer_without_its_gradient_partitions_fails_at_attach(attr):
    opt = _zero_optimizer()
    delattr(opt, attr)
    with pytest.raises(SeamError, match=f"DeepSpeedZeroOptimizer has no {attr}"):
        ds.check_engine(Engine(opt))


def test_an_optimizer_without_a_way_to_skip_is_refused():
    """Stage 0 with a wrapper that is not a torch optimizer and has no overflow path (as ``BF16_Optimizer``): the
    guard's dropped gradients would not stop its update, so attach fails rather than let the update through."""

    class Wrapper:
        param_groups: list = []

        def step(self):
            pass

    with pytest.raises(SeamError, match="Wrapper .ZeRO stage 0. has no overflow / check_overflow"):
        ds.check_engine(Engine(Wrapper(), stage=0))


def test_outside_the_tested_range_attach_refuses(monkeypatch):
    monkeypatch.delenv("RL_GUARD_ALLOW_UNTESTED", raising=False)  # as a user has it by default
    monkeypatch.setattr("rl_guard.versions.installed", lambda package: "0.19.8")  # its skip path changed
    with pytest.raises(UnsupportedVersion, match=r"deepspeed >= 0\.19\.6, < 0\.19\.7; found deepspeed 0\.19\.8"):
        ds.check_engine(Engine(_zero_optimizer()))


def test_checkpoint_seams_are_checked():
    class NoTag(Engine):
        def save_checkpoint(self, save_dir, client_state=None, save_latest=True):
            pass

        def load_checkpoint(self, load_dir, tag=None, load_optimizer_states=True, load_lr_scheduler_states=True):
            return None, None

    engine = NoTag(_zero_optimizer())
    engine.lr_scheduler = None
    guard = Guard.from_yaml("version: 1\nsinks: [jsonl]\n", open_run_dir=False)
    with pytest.raises(SeamError, match="save_checkpoint.* no longer takes tag"):
        ds.EngineCheckpointState(engine, guard)
