"""``rl-guard validate FILE...``: OK line per valid file, every error per invalid one, non-zero exit on error."""

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from rl_guard import cli
from rl_guard.control.config import load_config

ROOT = Path(__file__).resolve().parents[2]
PRESET_OK = f"OK: configs/grpo.yaml ({len(load_config(ROOT / 'configs' / 'grpo.yaml').rules)} rules)\n"
BAD = (
    "version: 1\nsinks: jsonl\nrules:\n  - name: a\n    metric: rl_guard/kl_ref/k3_maen\n    op: '>'\n"
    "    threshold: 1\n"
)


@pytest.fixture
def bad(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD, encoding="utf-8")
    return path


def test_validate_command_line(bad):
    """The real command line in a fresh interpreter: OK for the preset, every error for the bad file, exit 1."""
    proc = subprocess.run(
        [sys.executable, "-m", "rl_guard.cli", "validate", "configs/grpo.yaml", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == PRESET_OK
    assert f"ERROR: {bad}\n3 configuration error(s):" in proc.stderr
    assert "sinks (line 2): sinks must be a list" in proc.stderr
    assert "rules[0].action (line 4): rule needs an 'action'" in proc.stderr
    assert "rules[0].metric (line 5): unknown metric 'rl_guard/kl_ref/k3_maen'; did you mean" in proc.stderr


def test_python_dash_m_rl_guard(monkeypatch, capsys):
    """``python -m rl_guard`` is the same command (run in-process: a second interpreter start costs seconds)."""
    monkeypatch.setattr(sys, "argv", ["rl_guard", "validate", str(ROOT / "configs" / "grpo.yaml")])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("rl_guard", run_name="__main__")
    assert info.value.code == 0
    assert capsys.readouterr().out.endswith(PRESET_OK.split(" ", 2)[2])


def test_validate_in_process(bad, tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(
        "rules:\n  - {name: a, metric: rl_guard/ratio/p99, op: '>', threshold: 2, action: warn}\n", encoding="utf-8"
    )
    assert cli.main(["validate", str(good)]) == 0
    assert capsys.readouterr().out == f"OK: {good} (1 rules)\n"
    assert cli.main(["validate", str(bad), str(tmp_path / "nope.yaml")]) == 1
    err = capsys.readouterr().err
    assert "3 configuration error(s):" in err and f"config file not found: {tmp_path / 'nope.yaml'}" in err


def test_subcommands_are_a_registry():
    """A new subcommand is one entry of cli.COMMANDS; validate is just the first."""
    assert "validate" in cli.COMMANDS
    help_text, add_arguments, run = cli.COMMANDS["validate"]
    assert callable(add_arguments) and callable(run) and help_text
    with pytest.raises(SystemExit) as info:
        cli.main([])  # a subcommand is required
    assert info.value.code == 2
