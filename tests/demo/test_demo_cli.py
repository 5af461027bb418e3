"""`rl-guard demo` end to end: a real GRPO run, a learning-rate blow-up, a rollback, readable output, a report."""

import re
import subprocess
import sys

import pytest

from rl_guard.sinks.jsonl import read_jsonl


@pytest.mark.slow  # a 14-step GRPO run in a subprocess: about a minute on a loaded core
@pytest.mark.timeout(660)  # above the subprocess's own 600 s limit, so that one reports first
def test_demo_rolls_back_before_nan_and_the_report_renders(tmp_path):
    run_dir = tmp_path / "demo"
    out = subprocess.run(
        [sys.executable, "-m", "rl_guard", "demo", "--steps", "14", "--fault-step", "7", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "fault injected: lr_blowup at step 7" in text
    assert "-> rollback" in text and "rolled back to the healthy state" in text
    assert "every weight finite at the end: True" in text
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "rl_guard/guard/host_ms" in r]
    assert len(records) >= 10 and all(0 < r["rl_guard/guard/host_frac"] < 1 for r in records)
    assert re.search(r"the guard's own time: [0-9.]+ ms per step, [0-9]+% of the step", text)
    assert "rl_guard step 5" in text and "ratio" in text  # the console health table
    incidents = [i for i in read_jsonl(run_dir / "incidents.jsonl") if i["action"] != "warn"]
    # Caught within one generation cycle of the bad update, and the restored state predates that update.
    assert 8 <= incidents[0]["step"] <= 11 and incidents[0]["restored_to_step"] <= 7
    assert f"guard acted at step {incidents[0]['step']}" in text
    report = subprocess.run(
        [sys.executable, "-m", "rl_guard", "report", str(run_dir)], capture_output=True, text=True, timeout=300
    )
    assert report.returncode == 0, report.stderr[-2000:]
    assert (run_dir / "report" / "overview.png").stat().st_size > 10_000
    assert (run_dir / "report" / "optim.png").stat().st_size > 10_000  # learning rate and update size
    md = (run_dir / "report" / "report.md").read_text()
    first = incidents[0]  # why the run was rolled back, and to where: one row per incident
    assert (f"| {first['step']} | {first['rule']} | `{first['metric']}` | ") in md
    assert f"| rollback | restored to step {first['restored_to_step']} |" in md
