"""The verl adapter against verl 0.9.1's own classes: ``install`` on an ``FSDPEngine`` (its methods from the real
class, built without its constructor: a tiny module, a torch optimizer) with ``partial(ppo_loss, config=ActorConfig)``
attaches; each seam renamed or re-signed in a subclass, each ``ActorConfig`` value read removed, and
``TrainingWorker.set_loss_fn`` re-signed fail at attach naming the version and the seam. A skip is verified: an
engine whose ``train_batch`` steps the optimizer after the guard dropped the update escalates to checkpoint-and-halt.
The guard's state in verl's checkpoints is read back with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import pytest
import torch
from verl.workers.config.actor import ActorConfig, PolicyLossConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.losses import ppo_loss

from rl_guard import Guard
from rl_guard.adapters import verl as adapter
from rl_guard.errors import GuardHalted
from rl_guard.versions import SeamError

CONTEXT = "verl 0.9.1, tested with verl >= 0.9, < 0.10"
ALWAYS_SKIP = """
version: 1
sinks: [jsonl]
rules:
  - {name: always, metric: rl_guard/grad/norm, op: ">=", threshold: 0, action: skip_step}
"""


def _config():
    return ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_high=0.28)


def _engine(cls=FSDPEngine):
    engine = object.__new__(cls)
    torch.manual_seed(0)
    engine.module = torch.nn.Linear(3, 2)
    engine.optimizer = torch.optim.SGD(engine.module.parameters(), lr=0.1)
    engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)
    return engine


def _worker(engine=None, loss_fn=None):
    return SimpleNamespace(engine=engine or _engine(), loss_fn=loss_fn or functools.partial(ppo_loss, config=_config()))


def _guard(tmp_path, text="version: 1\nsinks: [jsonl]\n"):
    return Guard.from_yaml(text, run_dir=tmp_path / "run")


def test_the_real_classes_attach_and_the_config_is_read_as_verl_reads_it(tmp_path):
    worker = _worker()
    adapter.install(worker, _guard(tmp_path))
    assert "optimizer_step" in vars(worker.engine) and worker.rl_guard is not None
    assert adapter.clip_settings(_config()) == (0.2, 0.28, "token")
    gspo = ActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.1,
        clip_ratio_low=None,
        clip_ratio_high=0.0,
        policy_loss=PolicyLossConfig(loss_mode="gspo"),
    )
    assert adapter.clip_settings(gspo) == (0.1, 0.0, "sequence")  # None means clip_ratio; 0.0 is 0.0


def _subclass(**body):
    return type("FSDPEngine", (FSDPEngine,), body)


SEAMS = {  # seam -> (worker, what the error must name)
    "optimizer_step renamed": (
        lambda: _worker(_engine(_subclass(optimizer_step=None))),
        "FSDPEngine.optimizer_step is missing",
    ),
    "train_batch renamed": (lambda: _worker(_engine(_subclass(train_batch=None))), "FSDPEngine.train_batch is missing"),
    "save_checkpoint re-signed": (
        lambda: _worker(_engine(_subclass(save_checkpoint=lambda self, path: None))),
        "no longer takes local_path",
    ),
    "load_checkpoint re-signed": (
        lambda: _worker(_engine(_subclass(load_checkpoint=lambda self, path: None))),
        "no longer takes local_path",
    ),
    "loss re-signed": (
        lambda: _worker(loss_fn=functools.partial(lambda config, output, data: None, config=_config())),
        "no longer takes model_output",
    ),
    "clip_ratio_low gone": (
        lambda: _worker(
            loss_fn=functools.partial(
                ppo_loss, config=SimpleNamespace(clip_ratio=0.2, clip_ratio_high=0.2, policy_loss=PolicyLossConfig())
            )
        ),
        "has no clip_ratio_low",
    ),
    "loss_mode gone": (
        lambda: _worker(
            loss_fn=functools.partial(
                ppo_loss,
                config=SimpleNamespace(
                    clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, policy_loss=SimpleNamespace()
                ),
            )
        ),
        "has no loss_mode",
    ),
}


@pytest.mark.parametrize("seam", list(SEAMS))
def test_a_changed_seam_fails_at_attach_naming_it(tmp_path, seam):
    make, named = SEAMS[seam]
    worker = make()
    with pytest.raises(SeamError) as err:
        adapter.install(worker, _guard(tmp_path))
    assert named in str(err.value) and CONTEXT in str(err.value)
    assert "optimizer_step" not in vars(worker.engine)  # nothing was wrapped


@pytest.mark.parametrize("attr", adapter.ENGINE_ATTRS)
def test_a_missing_engine_attribute_fails_at_attach(tmp_path, attr):
    worker = _worker()
    delattr(worker.engine, attr)
    with pytest.raises(SeamError, match=f"FSDPEngine has no {attr}"):
        adapter.install(worker, _guard(tmp_path))


def test_a_loss_without_config_falls_back_and_says_so(tmp_path, capsys):
    def loss(model_output, data, dp_group=None):
        return None

    adapter.install(_worker(loss_fn=loss), _guard(tmp_path))
    assert "carries no ActorConfig: the guard uses clip 0.2 and token-level ratios" in capsys.readouterr().err


def test_register_checks_set_loss_fn(monkeypatch):
    def set_loss_fn(self, fn):
        self.loss_fn = fn

    monkeypatch.setattr(TrainingWorker, "set_loss_fn", set_loss_fn)
    with pytest.raises(SeamError, match="TrainingWorker.set_loss_fn.* no longer takes loss_fn") as err:
        adapter.register()
    assert CONTEXT in str(err.value)


class SteppingAnyway(FSDPEngine):
    """A release whose train_batch steps the optimizer itself after optimizer_step."""

    def train_batch(self, *args, **kwargs):
        self.module(torch.ones(1, 3)).sum().backward()
        self.optimizer_step()
        self.module(torch.ones(1, 3)).sum().backward()
        self.optimizer.step()
        return {"metrics": {}}

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        pass

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        pass


def test_an_optimizer_step_after_a_dropped_update_escalates_to_checkpoint_and_halt(tmp_path):
    worker = _worker(_engine(SteppingAnyway))
    guard = adapter.install(worker, _guard(tmp_path, ALWAYS_SKIP))
    with pytest.raises(GuardHalted, match="verl applied the update of step 0 that the guard dropped"):
        worker.engine.train_batch()
    assert guard.stopped["rule"] == "skip_not_taken"
    last = json.loads((tmp_path / "run" / "incidents.jsonl").read_text().splitlines()[-1])
    assert (last["rule"], last["decision"], last["escalated_from"]) == (
        "skip_not_taken",
        "checkpoint_and_halt",
        "skip_step",
    )


class Bypassing(SteppingAnyway):
    def train_batch(self, *args, **kwargs):
        self.optimizer.step()
        return {"metrics": {}}


def test_a_train_batch_that_bypasses_the_gate_is_an_error(tmp_path):
    worker = _worker(_engine(Bypassing))
    adapter.install(worker, _guard(tmp_path))
    with pytest.raises(SeamError, match="returned without calling optimizer_step"):
        worker.engine.train_batch()


def test_guard_state_in_verl_checkpoints_reads_back_weights_only(tmp_path):
    class Healthy(SteppingAnyway):
        def train_batch(self, *args, **kwargs):
            self.module(torch.ones(1, 3)).sum().backward()
            self.optimizer_step()
            return {"metrics": {}}

        def optimizer_step(self):  # FSDPEngine's needs its optimizer_config (clipping); a plain step here
            self.optimizer.step()
            return 0.0

    worker = _worker(_engine(Healthy))
    guard = adapter.install(worker, _guard(tmp_path))
    for _ in range(2):
        worker.engine.train_batch()
    worker.engine.save_checkpoint(local_path=str(tmp_path / "ckpt"))
    path = adapter.guard_state_path(tmp_path / "ckpt", 0)
    torch.load(path, weights_only=True)
    fresh = _worker(_engine(Healthy))
    resumed = adapter.install(fresh, _guard(tmp_path / "fresh"))
    fresh.engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.step == guard.step == 2
