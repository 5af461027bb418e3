"""The lines docs/adapters/verl.md tells a verl user to add are valid verl 0.9.1 config:
``integrations/verl/run_grpo.sh`` (which carries them) composes with verl's own Hydra config, and the page's block of
three lines is in it word for word."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import verl
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "integrations" / "verl" / "run_grpo.sh"
DOC = REPO / "docs" / "adapters" / "verl.md"


def doc_lines() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    block = text[text.index("## Three lines to add\n") :].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.strip().rstrip("\\").strip() for line in block.strip().splitlines()]


def script_overrides() -> list[str]:
    src = SCRIPT.read_text(encoding="utf-8")
    cmd = src[src.index("python3 -m verl.trainer.main_ppo") :].split('"$@"')[0].replace("\\\n", " ")
    cmd = re.sub(r"`#[^`]*`", "", cmd)  # inline comments
    for name, value in {"DATA": "/data", "MODEL": "/model", "RUN_DIR": "/runs/guard", "PWD": "/work"}.items():
        cmd = cmd.replace("$" + name, value)
    return shlex.split(cmd)[3:]


def test_doc_lines_are_in_the_recipe_command():
    overrides = script_overrides()
    lines = doc_lines()
    assert len(lines) == 3
    for line in lines:
        key = line.split("=", 1)[0]
        assert any(o.split("=", 1)[0] == key for o in overrides), f"{key} missing from {SCRIPT.name}"
    assert "actor_rollout_ref.model.external_lib=rl_guard.adapters.verl" in lines


def test_recipe_command_composes_with_verls_config():
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=script_overrides())
    assert cfg.actor_rollout_ref.model.external_lib == "rl_guard.adapters.verl"
    assert dict(cfg.ray_kwargs.ray_init.runtime_env.env_vars) == {
        "RL_GUARD_CONFIG": "grpo",
        "RL_GUARD_RUN_DIR": "/runs/guard",
    }
    assert cfg.algorithm.adv_estimator == "grpo" and list(cfg.trainer.logger) == ["console", "wandb"]
