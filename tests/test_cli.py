"""The ``rl-guard`` command line itself: --version, defaults in every --help, help without torch, replay's default
config, suggest refusing to calibrate from a short history."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

import rl_guard
from rl_guard import cli

ROOT = Path(__file__).resolve().parents[1]


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"rl-guard {rl_guard.__version__}\n"
    assert rl_guard.__version__ == importlib.metadata.version("rl-guard")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_option_with_a_default_names_it_in_help(command):
    sub = _subparsers(cli.build_parser(command))[command]
    text = " ".join(sub.format_help().split())  # argparse wraps lines
    checked = 0
    for action in sub._actions:
        if not action.option_strings or action.default in (None, argparse.SUPPRESS) or action.nargs == 0:
            continue
        helped = " ".join((action.help or "").split())
        assert f"(default: {action.default})" in text or "default" in helped.lower(), (command, action.dest)
        checked += 1
    assert checked or command in ("validate", "replay"), command  # these two have no option with a default value


def test_help_texts_name_the_defaults():
    subs = _subparsers(cli.build_parser())
    text = {name: " ".join(p.format_help().split()) for name, p in subs.items()}
    for want in (
        "fault to inject (default: lr_blowup)",
        "optimizer steps to train (default: 30)",
        "(default: runs/demo)",
        "(default: 12)",
    ):
        assert want in text["demo"], want
    for want in ("(default: grpo)", "(default: 0.99)", "(default: 1.5)", "(default: 50)"):
        assert want in text["suggest"], want
    assert "(default: 110)" in text["report"] and "(default: RUN_DIR/report/)" in text["report"]
    assert "default: the run's own HISTORY/config.yaml" in text["replay"]


HELP_PROBE = """
import runpy, sys
heavy = ("torch", "transformers", "trl", "matplotlib")
for argv in ([], ["validate"], ["demo"], ["report"], ["replay"], ["suggest"]):
    sys.argv = ["rl-guard", *argv, "--help"]
    try:
        runpy.run_module("rl_guard", run_name="__main__")
    except SystemExit as exc:
        assert exc.code == 0, (argv, exc.code)
    loaded = [m for m in heavy if m in sys.modules]
    print(" ".join(argv) or "(top)", "loaded:", ",".join(loaded) or "-", file=sys.stderr)
"""


def test_help_answers_without_importing_torch_or_transformers():
    """Every --help in a fresh interpreter (one for all: a module, once imported, stays in sys.modules)."""
    proc = subprocess.run([sys.executable, "-c", HELP_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"{c} loaded: -" for c in ("(top)", "validate", "demo", "report", "replay", "suggest")
    ]
    assert "usage: rl-guard suggest" in proc.stdout and "--min-steps N" in proc.stdout


RULES = (
    "rules:\n  - {name: lr_high, metric: rl_guard/optim/lr, op: '>', threshold: 0.01, action: warn}\n"
    "  - name: grad_jump\n    metric: rl_guard/grad/norm\n"
    "    spike: {method: mad, window: 50, threshold: 20, min_history: 10}\n    action: warn\n"
)


def _run_dir(path: Path, steps: int, config: str | None = RULES) -> Path:
    path.mkdir(parents=True)
    rows = [
        {"step": s, "rl_guard/optim/lr": 0.5 if s == 7 else 1e-3, "rl_guard/grad/norm": 1.0 + 0.1 * (s % 3)}
        for s in range(steps)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    if config is not None:
        (path / "config.yaml").write_text(config, encoding="utf-8")
    return path


def test_replay_takes_the_runs_own_config_when_none_is_given(tmp_path, capsys):
    run = _run_dir(tmp_path / "run", 12)
    for given in (run, run / "metrics.jsonl"):  # the run directory, or the metrics file in it
        assert cli.main(["replay", str(given)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"config: {run / 'config.yaml'} (the run's own, as --config was not given)\n")
        assert f"with {run / 'config.yaml'}" in out and "  lr_high -> warn: fired 1x at step 7" in out
    # --config still wins.
    other = tmp_path / "other.yaml"
    other.write_text(RULES.replace("0.01", "1.0"), encoding="utf-8")
    assert cli.main(["replay", str(run), "--config", str(other)]) == 0
    out = capsys.readouterr().out
    assert not out.startswith("config:") and "  lr_high -> warn: silent" in out


def test_replay_without_config_anywhere_says_what_to_pass(tmp_path, capsys):
    run = _run_dir(tmp_path / "bare", 12, config=None)
    assert cli.main(["replay", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"no --config given and {run} has no config.yaml" in err and "--config grpo" in err


def test_suggest_says_a_short_history_is_too_short_and_keeps_the_settings(tmp_path, capsys):
    short = _run_dir(tmp_path / "short", 20)
    assert cli.main(["suggest", str(short), "--rules", str(short / "config.yaml")]) == 0
    captured = capsys.readouterr()
    assert "too short to calibrate from: 2 condition(s) have fewer healthy values than --min-steps 50" in captured.err
    out = captured.out
    assert "# 2 condition(s) too short to calibrate from: fewer than 50 healthy values" in out
    assert "# rl_guard/optim/lr: too short to calibrate from (20 healthy steps, fewer than --min-steps 50): kept" in out
    assert "# rl_guard/grad/norm: too short to calibrate from (10 scored healthy steps of 20" in out
    from rl_guard.control.config import load_config

    kept = {r["name"]: r for r in load_config(out).rules}
    assert kept["lr_high"]["threshold"] == 0.01 and kept["grad_jump"]["spike"]["threshold"] == 20


def test_suggest_calibrates_from_a_long_enough_history(tmp_path, capsys):
    from rl_guard.replay.history import MIN_STEPS

    long = _run_dir(tmp_path / "long", MIN_STEPS + 10 + 1)  # min_history 10: MIN_STEPS + 1 scored steps
    assert cli.main(["suggest", str(long), "--rules", str(long / "config.yaml")]) == 0
    captured = capsys.readouterr()
    assert "too short" not in captured.err + captured.out
    from rl_guard.control.config import load_config

    rules = {r["name"]: r for r in load_config(captured.out).rules}
    assert rules["lr_high"]["threshold"] != 0.01 and rules["grad_jump"]["spike"]["threshold"] != 20
    # --min-steps moves the bar: the 20-step history calibrates when asked to.
    short = _run_dir(tmp_path / "short", 20)
    assert cli.main(["suggest", str(short), "--rules", str(short / "config.yaml"), "--min-steps", "5"]) == 0
    assert "too short" not in capsys.readouterr().out
    assert cli.main(["suggest", str(short), "--min-steps", "0"]) == 2
