"""Versions and seams: outside the tested trl / transformers range the callback refuses (or, with
RL_GUARD_ALLOW_UNTESTED=1, says so and attaches); a renamed or re-signed TRL seam fails at attach, naming it."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

from rl_guard.adapters.trl import RLGuardCallback
from rl_guard.adapters.trl_seams import RL_ATTRS, RL_METHODS, TESTED, TRAINER_METHODS, check_seams, check_versions
from rl_guard.versions import SeamError, UnsupportedVersion, in_range


def _fake_versions(monkeypatch, **versions):
    real = importlib.metadata.version

    def version(name):
        if name in versions:
            if versions[name] is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return versions[name]
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def test_installed_versions_are_the_tested_ones():
    check_versions()


@pytest.mark.parametrize(
    "pkg,version",
    [("trl", "0.19.1"), ("trl", "1.17.0"), ("trl", "2.0.0"), ("transformers", "4.57.3"), ("transformers", "5.26.0")],
)
def test_untested_version_refuses_with_a_clear_message(monkeypatch, pkg, version):
    monkeypatch.delenv("RL_GUARD_ALLOW_UNTESTED", raising=False)
    _fake_versions(monkeypatch, **{pkg: version})
    lo, hi = TESTED[pkg]
    with pytest.raises(UnsupportedVersion) as err:
        check_versions()
    message = str(err.value)
    assert f"found {pkg} {version}" in message and f"{pkg} >= {lo}, < {hi}" in message
    assert "RL_GUARD_ALLOW_UNTESTED=1" in message
    with pytest.raises(UnsupportedVersion, match=f"found {pkg} {version}"):
        RLGuardCallback("rules: []\n")  # the callback checks before doing anything else


def test_untested_version_attaches_when_allowed_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv("RL_GUARD_ALLOW_UNTESTED", "1")
    _fake_versions(monkeypatch, trl="1.17.0")
    from rl_guard.control.announce import console_logger

    console_logger().addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="rl_guard"):
            check_versions()
    finally:
        console_logger().removeHandler(caplog.handler)
    assert "found trl 1.17.0" in caplog.text and "attaching untested" in caplog.text


@pytest.mark.parametrize(
    "version,ok",
    [
        ("1.16.0", True),
        ("1.16.3", True),
        ("1.16.0rc1", True),
        ("1.16.1.dev0", True),
        ("1.15.9", False),
        ("1.17.0rc1", False),
        ("1.0rc1", False),
    ],
)
def test_pre_releases_and_patches_count_as_their_release(version, ok):
    assert in_range(version, *TESTED["trl"]) is ok


def test_plain_transformers_without_trl_is_fine(monkeypatch):
    _fake_versions(monkeypatch, trl=None)
    check_versions()


def test_missing_transformers_is_reported(monkeypatch):
    _fake_versions(monkeypatch, transformers=None)
    with pytest.raises(
        UnsupportedVersion, match=r"needs transformers >= 5\.25, < 5\.26; transformers is not installed"
    ):
        check_versions()


# -- seams, on a real GRPOTrainer ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grpo_trainer(tiny_model, tmp_path_factory):
    from trl import GRPOConfig, GRPOTrainer

    from rl_guard.demo.tiny import TINY_GRPO, prompt_dataset, repeat_last_digit_reward

    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("seams")),
        max_steps=1,
        **TINY_GRPO,
        report_to=[],
    )
    return GRPOTrainer(
        model=str(tiny_model),
        args=args,
        train_dataset=prompt_dataset(16, seed=0),
        reward_funcs=[repeat_last_digit_reward],
    )


def test_the_real_trainer_has_every_seam(grpo_trainer):
    assert set(check_seams(grpo_trainer)) == set(TRAINER_METHODS) | set(RL_METHODS)


@pytest.mark.parametrize("name", [*TRAINER_METHODS, *RL_METHODS])
def test_a_renamed_method_fails_at_attach(grpo_trainer, monkeypatch, name):
    monkeypatch.setattr(type(grpo_trainer), name, None)  # as if a release renamed it
    with pytest.raises(
        SeamError,
        match=rf"GRPOTrainer\.{name} is missing \(trl 1\.16\.\d+, transformers 5\.25\.\d+; "
        r"tested: trl >= 1\.16, < 1\.17",
    ):
        check_seams(grpo_trainer)


@pytest.mark.parametrize("name,params", [(n, p) for n, p in {**TRAINER_METHODS, **RL_METHODS}.items() if p])
def test_a_re_signed_method_fails_at_attach(grpo_trainer, monkeypatch, name, params):
    def changed(self, renamed_argument):
        raise AssertionError("never called")

    monkeypatch.setattr(type(grpo_trainer), name, changed)
    with pytest.raises(SeamError, match=rf"GRPOTrainer\.{name}\(renamed_argument\) no longer takes {params[0]}"):
        check_seams(grpo_trainer)


@pytest.mark.parametrize(
    "attr", [a for a in RL_ATTRS if a != "accelerator"] + ["loss_type", "importance_sampling_level"]
)
def test_a_missing_setting_fails_at_attach(grpo_trainer, monkeypatch, attr):
    monkeypatch.delattr(grpo_trainer, attr)
    with pytest.raises(SeamError, match=rf"GRPOTrainer has no {attr} \("):
        check_seams(grpo_trainer)


def test_the_callback_fails_at_train_begin_before_touching_the_trainer(grpo_trainer, monkeypatch, tmp_path):
    monkeypatch.setattr(type(grpo_trainer), "_calculate_rewards", None)
    callback = RLGuardCallback("grpo", run_dir=str(tmp_path / "guard"))
    grpo_trainer.add_callback(callback)
    try:
        with pytest.raises(SeamError, match="_calculate_rewards is missing"):
            grpo_trainer.train()
    finally:
        grpo_trainer.remove_callback(callback)
    assert "compute_loss" not in grpo_trainer.__dict__  # nothing was wrapped
    assert not (tmp_path / "guard" / "metrics.jsonl").exists()
