"""Replaying the demo's own metrics.jsonl with its config.yaml reproduces what the guard did live."""

from __future__ import annotations

import json

import pytest
from replay_runs import incidents_key

from rl_guard.cli import main
from rl_guard.control.config import load_config
from rl_guard.replay import load_history, replay
from rl_guard.sinks.jsonl import read_jsonl

pytestmark = pytest.mark.slow  # a real GRPO run (session fixture)


def test_replay_reproduces_live_incidents(fault_demo):
    run = fault_demo.run_dir
    live = read_jsonl(run / "incidents.jsonl")
    result = replay(load_history(run / "metrics.jsonl"), load_config(run / "config.yaml"))
    assert any(i["action"] != "warn" for i in live)  # the guard did act live (not only warn)
    # Rule, step, action (escalation included), the message and the restored snapshot's step: all as live.
    assert incidents_key(result.incidents) == incidents_key(live)
    assert [r["message"] for r in result.incidents] == [r["message"] for r in live]
    assert [r["value"] for r in result.incidents] == [r["value"] for r in live]
    assert all(r["replayed"] and r["would"] == r["action"] for r in result.incidents)
    assert set(live[0]) <= set(result.incidents[0])  # same record format, plus the replay marks
    stops = [i["step"] for i in live if i["decision"] in ("early_stop", "checkpoint_and_halt")]
    assert result.halted_at == (stops[0] if stops else None)  # and where the live run stopped, if it did


def test_cli_prints_per_rule_steps_and_writes_records_and_report(fault_demo, tmp_path, capsys):
    run = fault_demo.run_dir
    live = read_jsonl(run / "incidents.jsonl")
    out, report = tmp_path / "replayed.jsonl", tmp_path / "report"
    assert (
        main(["replay", str(run), "--config", str(run / "config.yaml"), "--json", str(out), "--report", str(report)])
        == 0
    )
    text = capsys.readouterr().out
    first = next(i for i in live if i["action"] != "warn")
    configured = {i.rule: i.action for i in replay(load_history(run), load_config(run / "config.yaml")).inputs}
    assert f"  {first['rule']} -> {configured[first['rule']]}: fired" in text
    assert f"      > {first['message']}" in text  # under its rule
    assert first["message"] in text
    assert "update_too_aggressive -> rollback: silent" in text or "update_too_aggressive -> rollback: fired" in text
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["step"], r["rule"]) for r in records] == [(i["step"], i["rule"]) for i in live]
    assert all(r["replayed"] is True for r in records)
    # The report directory is a run directory of its own: rl-guard report's plots, replayed incidents marked.
    assert (report / "overview.png").stat().st_size > 10_000 and (report / "grad.png").exists()
    assert len(read_jsonl(report / "incidents.jsonl")) == len(live)
    md = (report / "report.md").read_text()
    assert "replayed" in md and first["rule"] in md


def test_report_refuses_the_source_directory(fault_demo, capsys):
    run = fault_demo.run_dir
    before = (run / "metrics.jsonl").read_bytes()
    assert main(["replay", str(run), "--config", str(run / "config.yaml"), "--report", str(run)]) == 2
    assert "pick a new directory" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_bytes() == before


def test_a_stricter_config_fires_earlier_and_escalates_without_snapshots(fault_demo):
    """Calibration is the point: the same history under other settings. The only snapshot is the starting state
    (healthy_steps 1000): every firing rolls back to it (the fault returns before a newer one), and once the
    rollback budget is spent the next one escalates to checkpoint_and_halt, where the run would have stopped."""
    run = fault_demo.run_dir
    strict = (
        "rules:\n"
        "  - {name: kl_tight, metric: rl_guard/kl_old/k3_mean, op: '>', threshold: 0.0, action: rollback}\n"
        "snapshots: {healthy_steps: 1000}\nrollback: {max_rollbacks: 1}\n"
    )
    result = replay(load_history(run), load_config(strict))
    kl = [r["rl_guard/kl_old/k3_mean"] for r in load_history(run).records]
    fired = [r["step"] for r in result.incidents]
    assert fired == [s for s, v in zip(load_history(run).steps, kl) if v > 0]
    assert result.incidents[0]["action"] == "rollback"
    assert result.incidents[0]["restored_to_step"] == load_history(run).steps[0]  # the starting state
    assert result.incidents[1]["action"] == "checkpoint_and_halt"
    assert result.incidents[1]["escalated_from"] == "rollback"
    assert "rollback budget spent: 1 of max_rollbacks=1" in result.incidents[1]["message"]
    assert result.halted_at == fired[1]
    assert all(r["after_halt"] for r in result.incidents[2:])
