"""AReaL adapter against the real areal 1.0.4 sources: ``ppo_actor_loss_fn`` (utils/functional/functional.py)
and ``stats_tracker`` loaded by path on CPU. Their two imports from the heavy package (``RejectionSamplingConfig``,
``KLEstimator``; ``flat2d``) are the real class / function bodies cut out of the installed files; only the
logging and platform helpers are stand-ins."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import itertools
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from file_modules import load_module

from rl_guard import Guard, load_config
from rl_guard.adapters import areal as adapter

spec = importlib.util.find_spec("areal")
if spec is None:
    pytest.skip("areal not installed (pip install --no-deps areal==1.0.4)", allow_module_level=True)
AREAL = Path(spec.origin).parent
ROOT = Path(__file__).resolve().parents[2]


def _cut(path: Path, name: str, namespace: dict):
    """Execute one top-level class / function of a source file (the real code, without its module's imports)."""
    node = next(n for n in ast.parse(path.read_text()).body if getattr(n, "name", None) == name)
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


def _areal_modules():
    """functional.py and stats_tracker.py with their areal imports answered, registered only while loading."""
    if "_rlg_areal_functional" in sys.modules:
        return sys.modules["_rlg_areal_functional"], sys.modules["_rlg_areal_stats_tracker"]
    rs = _cut(
        AREAL / "api" / "cli_args.py",
        "RejectionSamplingConfig",
        {"dataclass": dataclasses.dataclass, "field": dataclasses.field},
    )
    kl = _cut(AREAL / "utils" / "data.py", "KLEstimator", {"torch": torch})
    flat2d = _cut(AREAL / "utils" / "seqpack.py", "flat2d", {"itertools": itertools, "Any": object})
    fake = {
        "areal": types.ModuleType("areal"),
        "areal.api": types.ModuleType("areal.api"),
        "areal.utils": types.ModuleType("areal.utils"),
        "areal.infra": types.ModuleType("areal.infra"),
        "areal.api.cli_args": SimpleNamespace(RejectionSamplingConfig=rs),
        "areal.utils.data": SimpleNamespace(KLEstimator=kl),
        "areal.utils.seqpack": SimpleNamespace(flat2d=flat2d),
        "areal.utils.logging": SimpleNamespace(getLogger=logging.getLogger),
        "areal.infra.platforms": SimpleNamespace(current_platform=SimpleNamespace(is_initialized=lambda: False)),
    }
    for name in ("areal", "areal.api", "areal.utils", "areal.infra"):
        fake[name].__path__ = []
    fake["areal.utils"].logging = fake["areal.utils.logging"]
    saved = {k: sys.modules.get(k) for k in fake}
    sys.modules.update(fake)
    try:
        F = load_module("_rlg_areal_functional", AREAL / "utils" / "functional" / "functional.py")
        ST = load_module("_rlg_areal_stats_tracker", AREAL / "utils" / "stats_tracker.py")
    finally:
        for k, v in saved.items():
            sys.modules.pop(k) if v is None else sys.modules.__setitem__(k, v)
    return F, ST


F, ST = _areal_modules()
R = load_module("areal_async_recipe", ROOT / "integrations" / "areal_async" / "train.py")  # AReaL-shaped engine


def areal_grpo_loss(
    logprobs,
    entropy,
    input_data,
    eps_clip,
    eps_clip_higher=None,
    current_version=None,
    rejection_sampling=None,
    record=None,
):
    """The part of AReaL's grpo_loss_fn that feeds ppo_actor_loss_fn (trainer/ppo/actor.py), verbatim in effect."""
    loss, stat = F.ppo_actor_loss_fn(
        logprobs=logprobs,
        proximal_logprobs=input_data["prox_logp"],
        old_logprobs=input_data["logprobs"],
        advantages=input_data["advantages"],
        eps_clip=eps_clip,
        loss_mask=input_data["loss_mask"].bool(),
        eps_clip_higher=eps_clip_higher,
        rejection_sampling=rejection_sampling,
        cu_seqlens=input_data.get("cu_seqlens"),
    )
    if record is not None:
        record.append(
            (loss.detach(), {k: v.detach() if torch.is_tensor(v) else v for k, v in stat.items()}, input_data)
        )
    return loss


VERSIONS = [[7] * R.T, [6] * R.T, [5] * R.T, [3, 3, 4, 4, 4], [1] * R.T, [0, 0, 0, 2, 2]]  # mixed: interrupted


def _batch(engine, noise=0.3, seed=0):
    """A batch in AReaL's workflow layout (rlvr.py), then the trainer's roll (compute_advantages)."""
    g = torch.Generator().manual_seed(seed)
    b = len(VERSIONS)
    ids = torch.randint(0, R.K, (b, R.L), generator=g)
    batch = {
        "input_ids": ids,
        "loss_mask": torch.ones(b, R.L, dtype=torch.int32),
        "logprobs": torch.zeros(b, R.L),
        "versions": torch.tensor([[-1] + v for v in VERSIONS], dtype=torch.int32),
        "rewards": torch.rand(b, generator=g),
    }
    batch["loss_mask"][:, 0] = 0
    prox = engine.compute_logp(batch)
    batch["logprobs"][:, 1:] = prox[:, :-1] + noise * torch.randn(b, R.L - 1, generator=g)  # behaviour (inference)
    batch["prox_logp"] = prox
    return R.compute_advantages(batch, group=2)


def _engine(tmp_path, config="version: 1\nsinks: [jsonl]\n", seed=0):
    torch.manual_seed(seed)
    engine = R.Engine(R.Policy(), lr=3e-2)
    guard = adapter.install(engine, Guard.from_yaml(config, run_dir=tmp_path))
    return engine, guard


def _train(engine, batch, record=None, current_version=7, rs=None):
    loss_fn = functools.partial(
        areal_grpo_loss,
        eps_clip=0.2,
        eps_clip_higher=0.28,
        current_version=current_version,
        rejection_sampling=rs,
        record=record,
    )
    return engine.train_batch(batch, loss_fn, lambda x: x["loss_mask"].count_nonzero())


def test_supported_version_is_installed():
    adapter.check_versions()


def test_metrics_match_real_ppo_actor_loss_fn_stats(tmp_path):
    engine, guard = _engine(tmp_path)
    batch, record = _batch(engine), []
    stats = _train(engine, batch, record, rs=F.RejectionSamplingConfig(upper=1e6))  # no token rejected
    loss, stat, packed = record[0]
    mask = packed["loss_mask"].bool()
    assert packed["cu_seqlens"].numel() == len(VERSIONS) + 1 and stat["importance_weight"].dim() == 1  # packed
    assert stats["rl_guard/importance_weight/mean"] == pytest.approx(
        float(stat["importance_weight"].double().sum() / mask.sum()), rel=1e-6
    )
    assert stats["rl_guard/behave_imp_weight/mean"] == pytest.approx(
        float(stat["behave_imp_weight"].double().sum() / stat["behave_mask"].sum()), rel=1e-6
    )
    assert stats["rl_guard/clip/region_frac"] == pytest.approx(float(stat["clip_mask"].sum() / mask.sum()), abs=1e-7)
    assert stats["rl_guard/loss/value"] == pytest.approx(float(loss), rel=1e-6)
    assert stats["update_successful"] == 1.0 and "grad_norm" in stats and "lr" in stats  # engine stats kept


@pytest.mark.filterwarnings("ignore:rl_guard.*cannot fire:RuntimeWarning")  # a bare guard: no grad/*
def test_lag_uses_versions_rolled_like_the_loss_mask(tmp_path):
    engine, guard = _engine(tmp_path)
    stats = _train(engine, _batch(engine))
    versions = np.array([[-1] + v for v in VERSIONS], dtype=np.float64)
    mask = np.roll(np.array([[0] + [1] * R.T] * len(VERSIONS)), -1, axis=1).astype(bool)  # compute_advantages' roll
    lag = 7 - np.roll(versions, -1, axis=1)[mask]  # the version of the token each loss position scores
    assert stats["rl_guard/lag/max"] == lag.max() == 7 and stats["rl_guard/lag/mean"] == pytest.approx(lag.mean())
    for name, lo, hi in (("0", 0, 0), ("1", 1, 1), ("2", 2, 2), ("3-4", 3, 4), ("5-8", 5, 8)):
        frac = ((lag >= lo) & (lag <= hi)).mean()
        assert stats[f"rl_guard/lag/{name}/token_frac"] == pytest.approx(frac, abs=1e-12)
    # AReaL's own (unrolled) versions put the prompt's -1 under the first generated token: lag current + 1.
    b = _batch(engine)
    raw = adapter.token_batch(b["prox_logp"], b, current_version=7, shift_versions=False)
    g = Guard.from_yaml("version: 1\nsinks: [jsonl]\n", run_dir=tmp_path / "raw")
    g.observe(raw)
    g.check()
    assert g.last_metrics["rl_guard/lag/max"] == 8


def test_merged_metrics_reach_real_stats_tracker_export(tmp_path):
    engine, guard = _engine(tmp_path)
    with ST.scope("ppo_actor"), ST.scope("update"):  # PPOActor.ppo_update's scopes
        for seed in (0, 1):
            train_stat = _train(engine, _batch(engine, seed=seed))
            ST.scalar(**train_stat)  # exactly what _ppo_update does with train_batch's return value
    exported = ST.export_all()
    key = "ppo_actor/update/rl_guard/importance_weight/mean"
    assert key in exported and "ppo_actor/update/update_successful" in exported
    assert exported["ppo_actor/update/rl_guard/lag/max"] == 7.0


SKIP = """
version: 1
sinks: [jsonl]
snapshots: {healthy_steps: 1, every: 100, keep: 2, where: memory}   # one snapshot, after step 0
rules:
  - name: behave_tail
    metric: rl_guard/behave_imp_weight/p99
    op: ">"
    threshold: 3.0
    action: %s
"""


def _params(engine):
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def test_gate_skips_a_stale_batch_and_keeps_weights(tmp_path):
    engine, guard = _engine(tmp_path, SKIP % "skip_step")
    before = _params(engine)
    assert _train(engine, _batch(engine, noise=0.05))["update_successful"] == 1.0
    assert any(not torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    applied = _params(engine)
    stats = _train(engine, _batch(engine, noise=3.0, seed=1))  # behaviour far from proximal: tail > 3
    assert stats["update_successful"] == 0.0 and stats["rl_guard/guard/fired"] == 1.0
    assert stats["rl_guard/behave_imp_weight/p99"] > 3.0 and guard.controller.skipped_steps == 1
    assert all(torch.equal(applied[k], v) for k, v in engine.model.state_dict().items())


def test_rollback_restores_the_guards_snapshot(tmp_path):
    engine, guard = _engine(tmp_path, SKIP % "rollback")
    _train(engine, _batch(engine, noise=0.05))
    snapshot = _params(engine)  # the healthy state the guard snapshots after step 0
    _train(engine, _batch(engine, noise=0.05, seed=2))  # healthy, applied: the weights move on
    assert any(not torch.equal(snapshot[k], v) for k, v in engine.model.state_dict().items())
    _train(engine, _batch(engine, noise=3.0, seed=1))
    assert guard.controller.rollbacks == 1
    assert all(torch.equal(snapshot[k], v) for k, v in engine.model.state_dict().items())


def test_lag_rule_and_async_yaml_map_max_head_offpolicyness(tmp_path):
    text = adapter.async_yaml(3)
    rules = {r["name"]: r for r in load_config(text).rules}
    assert rules["staleness_bound"]["threshold"] == 3 and rules["staleness_bound"]["metric"] == "rl_guard/lag/max"
    preset = yaml.safe_load(adapter.PRESET.read_text())
    assert [r["name"] for r in preset["rules"]] == list(rules)  # every other preset rule kept as is
    config = yaml.safe_dump({"version": 1, "sinks": ["jsonl"], "rules": [adapter.lag_rule(2, action="skip_step")]})
    for version, fires in ((4, True), (5, False)):  # lag = 7 - version on every generated token
        engine, guard = _engine(tmp_path / str(version), config)
        b = _batch(engine)
        b["versions"] = torch.where(b["versions"] >= 0, version, -1).int()
        stats = _train(engine, b)
        assert (stats["rl_guard/guard/fired"] == 1.0) is fires and stats["rl_guard/lag/max"] == 7 - version
