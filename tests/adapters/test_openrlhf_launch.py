"""The OpenRLHF launcher's command line: the guard's options are taken out, everything else reaches
``openrlhf.cli.train_ppo_ray`` unchanged and in order, and Ray's worker hook names an importable function."""

from __future__ import annotations

import importlib
import os

import pytest

from rl_guard.adapters import openrlhf_launch as launch


def test_guard_options_are_removed_and_the_rest_forwarded_in_order():
    settings, rest = launch.split_args(
        [
            "--actor.model_name_or_path",
            "m",
            "--rl_guard.config",
            "g.yaml",
            "--train.batch_size",
            "8",
            "--rl_guard.run_dir=runs/x",
            "--ds.zero_stage",
            "2",
        ]
    )
    assert rest == ["--actor.model_name_or_path", "m", "--train.batch_size", "8", "--ds.zero_stage", "2"]
    assert settings == {launch.CONFIG_ENV: os.path.abspath("g.yaml"), launch.RUN_DIR_ENV: os.path.abspath("runs/x")}


def test_a_guard_config_is_required():
    with pytest.raises(SystemExit, match="--rl_guard.config"):
        launch.split_args(["--actor.model_name_or_path", "m"])


def test_runtime_env_keeps_openrlhfs_variables_and_adds_the_hook(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # set by the user: kept
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)  # unset: OpenRLHF's default
    env = launch.runtime_env({launch.CONFIG_ENV: "/abs/g.yaml"})
    assert env["env_vars"]["NCCL_DEBUG"] == "INFO" and env["env_vars"]["TOKENIZERS_PARALLELISM"] == "true"
    assert env["env_vars"][launch.CONFIG_ENV] == "/abs/g.yaml"
    module, _, name = env["worker_process_setup_hook"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is launch.setup_worker
