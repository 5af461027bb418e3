"""quadrant/ and the audit files: hand-worked cells, ids written for audit, bounded files."""

import json
import math
import signal
import subprocess
import sys

import pytest

from rl_guard.diagnostics import RunDiagnostics, SampleBatch

IDS = list("abcdef")
R = [0.9, 0.8, 0.2, 0.1, 0.7, 0.3]
OUTCOME = [1, 0, 1, 0, 0, 1]


def _lines(path, step=None):
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines if step is None else [rec for rec in lines if rec["step"] == step]


def test_quadrant_median_split(diag):
    # sorted r: 0.1 0.2 0.3 0.7 0.8 0.9 -> median (0.3 + 0.7) / 2 = 0.5 > min: high = r >= 0.5 = {a, b, e}.
    # hacking = high and fail = {b, e}; false negative = low and success = {c, f}.
    m = diag(ids=IDS, rewards=R, outcome=OUTCOME)
    assert m["quadrant/hacking_frac"] == pytest.approx(2 / 6)
    assert m["quadrant/false_negative_frac"] == pytest.approx(2 / 6)
    assert m["quadrant/threshold"] == pytest.approx(0.5) and m["quadrant/n"] == 6


def test_quadrant_configured_threshold(diag):
    # high = r >= 0.75 = {a, b}: hacking {b}; low successes {c, f}.
    m = diag(0, RunDiagnostics(quadrant_threshold=0.75), ids=IDS, rewards=R, outcome=OUTCOME)
    assert m["quadrant/hacking_frac"] == pytest.approx(1 / 6)
    assert m["quadrant/false_negative_frac"] == pytest.approx(2 / 6)
    assert m["quadrant/threshold"] == 0.75


def test_quadrant_binary_rewards_either_majority(diag):
    # Mostly 0: median 0 == min, so high = r > 0 = {3, 4}; hacking {4}; false negative {1}.
    m = diag(rewards=[0, 0, 0, 1, 1], outcome=[0, 1, 0, 1, 0])
    assert m["quadrant/hacking_frac"] == 0.2 and m["quadrant/false_negative_frac"] == 0.2
    # Mostly 1: median 1 > min 0, so high = r >= 1 = {0, 1, 2}; hacking {1}; false negative {3}.
    m = diag(rewards=[1, 1, 1, 0, 0], outcome=[1, 0, 1, 1, 0])
    assert m["quadrant/hacking_frac"] == 0.2 and m["quadrant/false_negative_frac"] == 0.2


def test_quadrant_constant_reward_has_no_split_unless_threshold_given(diag):
    m = diag(rewards=[1, 1, 1], outcome=[1, 0, 0])
    assert not any(k.startswith("quadrant/") for k in m)
    m = diag(0, RunDiagnostics(quadrant_threshold=0.5), rewards=[1, 1, 1], outcome=[1, 0, 0])
    assert m["quadrant/hacking_frac"] == pytest.approx(2 / 3)


def test_quadrant_excludes_system_errors_and_nan_outcome(diag):
    m = diag(
        ids=IDS + ["g", "h"],
        rewards=R + [1.0, 1.0],
        outcome=OUTCOME + [math.nan, 0],
        termination=["success"] * 7 + ["verifier_error"],
    )
    # g (NaN outcome) and h (system error) are out; the six others give the numbers of test_quadrant_median_split.
    assert m["quadrant/n"] == 6 and m["quadrant/hacking_frac"] == pytest.approx(2 / 6)


def test_audit_file_contents(tmp_path):
    texts = [f"t{i}" for i in range(8)]
    texts[1] = "x" * 5000
    d = RunDiagnostics(tmp_path, audit_k=2, audit_max_chars=100, seed=7)
    d.update(
        SampleBatch(
            ids=[f"s{i}" for i in range(8)],
            rewards=[0.5, 0.9, 0.1, 0.7, 0.3, 0.9, math.nan, 0.2],
            texts=texts,
            prompts=["p"] * 8,
        ),
        step=12,
    )
    path = tmp_path / "audit" / "steps_12.jsonl"
    assert d.last_audit_file == path
    lines = _lines(path)
    by_kind = {}
    for rec in lines:
        by_kind.setdefault(rec["kind"], []).append(rec)
    # top: 0.9 (index 1) and 0.9 (index 5), ties in batch order; bottom: 0.1 (2) and 0.2 (7); NaN never ranked.
    assert [r["index"] for r in by_kind["top"]] == [1, 5]
    assert [r["index"] for r in by_kind["bottom"]] == [2, 7]
    rand = [r["index"] for r in by_kind["random"]]
    assert len(rand) == 2 and set(rand) <= {0, 3, 4, 6}
    top = by_kind["top"][0]
    assert top["id"] == "s1" and top["reward"] == 0.9 and top["prompt"] == "p"
    assert top["text"] == "x" * 100 and top["text_chars"] == 5000  # capped, full length recorded
    assert all(rec["step"] == 12 for rec in lines)
    assert "quadrant_cell" not in by_kind  # no outcome: no quadrant


def test_audit_keeps_quadrant_cells(tmp_path):
    d = RunDiagnostics(tmp_path, audit_k=1)
    d.update(SampleBatch(ids=IDS, rewards=R[::-1], texts=IDS), step=2)  # shares the file with step 3
    d.update(SampleBatch(ids=IDS, rewards=R, outcome=OUTCOME, texts=[s.upper() for s in IDS]), step=3)
    lines = _lines(d.last_audit_file, step=3)
    cells = {r["cell"]: r for r in lines if r["kind"] == "quadrant_cell"}
    assert cells["hacking"]["ids"] == ["b", "e"] and cells["hacking"]["count"] == 2
    assert cells["false_negative"]["ids"] == ["c", "f"]
    # k = 1 detailed sample per cell: the highest-reward hacking candidate, the lowest-reward false negative.
    assert [r["id"] for r in lines if r["kind"] == "hacking"] == ["b"]
    assert [(r["id"], r["text"]) for r in lines if r["kind"] == "false_negative"] == [("c", "C")]


def test_audit_file_count_and_size_are_bounded(tmp_path):
    d = RunDiagnostics(tmp_path, audit_k=3, audit_max_files=3, audit_max_chars=50, audit_updates_per_file=2)
    batch = SampleBatch(
        ids=["i" * 400] * 40,
        rewards=[float(i % 5) for i in range(40)],
        texts=["y" * 10_000] * 40,
        prompts=["z" * 10_000] * 40,
        outcome=[i % 2 for i in range(40)],
    )
    for step in range(8, 15):
        d.update(batch, step)
    d.flush()
    files = sorted(p.name for p in (tmp_path / "audit").iterdir())
    # Two updates per file, named by the first; the oldest steps go first, by number (a string sort would wrongly
    # keep steps_8 over steps_10).
    assert files == ["steps_10.jsonl", "steps_12.jsonl", "steps_14.jsonl"]
    assert d.last_audit_file == tmp_path / "audit" / "steps_14.jsonl"
    for name, steps in zip(files, ([10, 11], [12, 13], [14])):
        lines = _lines(tmp_path / "audit" / name)
        assert sorted({rec["step"] for rec in lines}) == steps
        # 3 top + 3 bottom + 3 random + per cell (1 summary + 3 samples) x 2 cells = 17 lines per update.
        assert len(lines) == 17 * len(steps)
        # Uncapped an update would hold ~15 x 20 kB of text; capped, a sample line is < 300 bytes and each cell
        # line lists <= 12 ids of 50 chars (hacking: r >= median 2 is 24 samples, 12 failed), < 800 bytes.
        assert (tmp_path / "audit" / name).stat().st_size < len(steps) * (15 * 300 + 2 * 800)
        assert all(len(r.get("text", "")) <= 50 and len(str(r.get("id", ""))) <= 50 for r in lines)


def test_updates_are_written_flush_every_at_a_time_and_the_file_stays_open(tmp_path, monkeypatch):
    """Updates are queued and written ``flush_every`` at a time, each write flushed (readable by a second handle
    while the writer's stays open, as after a crash), with the lines an immediate write gives. One file is opened
    per ``updates_per_file`` updates, not one per update (that open was the audit's main cost)."""
    import builtins

    opened = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    d = RunDiagnostics(tmp_path / "a", audit_k=1, audit_updates_per_file=20, audit_flush_every=4, seed=3)
    now = RunDiagnostics(tmp_path / "b", audit_k=1, audit_updates_per_file=20, audit_flush_every=1, seed=3)
    batch = SampleBatch(rewards=[float(i % 5) for i in range(8)], texts=[f"t{i}" for i in range(8)])
    for step in range(1, 31):
        d.update(batch, step)
        now.update(batch, step)
        files = (tmp_path / "a" / "audit").glob("*.jsonl")
        written = max((rec["step"] for f in files for rec in _lines(f)), default=0)
        assert written == step - step % 4  # the 4th, 8th, ... update writes the four queued
    assert [p.name for p in map(type(tmp_path), opened)] == [
        "steps_1.jsonl",
        "steps_1.jsonl",
        "steps_21.jsonl",
        "steps_21.jsonl",
    ]  # a's and b's
    d.close()
    now.close()
    for name in ("steps_1.jsonl", "steps_21.jsonl"):  # the random picks too: drawn in update order at the flush
        assert (tmp_path / "a" / "audit" / name).read_text() == (tmp_path / "b" / "audit" / name).read_text()
    assert {rec["step"] for rec in _lines(tmp_path / "a" / "audit" / "steps_1.jsonl")} == set(range(1, 21))


def test_a_killed_process_loses_at_most_flush_every_minus_one_updates(tmp_path):
    """SIGKILL after 7 updates with flush_every=3: the first 6 are on disk, complete lines."""
    script = f"""
import os, signal
from rl_guard.diagnostics import RunDiagnostics, SampleBatch
d = RunDiagnostics({str(tmp_path)!r}, audit_k=1, audit_flush_every=3)
for step in range(1, 8):
    d.update(SampleBatch(rewards=[0.0, 1.0, 0.5], texts=["a", "b", "c"]), step)
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert sorted({rec["step"] for rec in _lines(tmp_path / "audit" / "steps_1.jsonl")}) == [1, 2, 3, 4, 5, 6]


def test_queued_updates_are_written_at_exit_and_when_a_rule_fires(tmp_path):
    """A script that ends without close() still writes what was queued; a guard flushes the audit before it acts
    on a firing rule."""
    script = f"""
from rl_guard.diagnostics import RunDiagnostics, SampleBatch
d = RunDiagnostics({str(tmp_path)!r}, audit_k=1)
for step in range(1, 4):
    d.update(SampleBatch(rewards=[0.0, 1.0], texts=["a", "b"]), step)
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert {rec["step"] for rec in _lines(tmp_path / "audit" / "steps_1.jsonl")} == {1, 2, 3}

    from rl_guard.guard import Guard

    yaml = "rules:\n  - {name: lost_reward, metric: rl_guard/reward/n_valid, op: '<', threshold: 2, action: warn}\n"
    guard = Guard.from_yaml(yaml, run_dir=tmp_path / "run")
    for step, reward in enumerate((1.0, 1.0, math.nan)):
        guard.observe_samples(SampleBatch(rewards=[reward, reward], texts=["a", "b"]))
        fired = guard.check().firings
        guard.step_done()
        audit = tmp_path / "run" / "audit" / "steps_0.jsonl"
        assert bool(fired) == (step == 2) and audit.exists() == (step == 2)
    assert {rec["step"] for rec in _lines(audit)} == {0, 1, 2}
    guard.close()


def test_audit_bound_counts_files_of_an_earlier_run(tmp_path):
    """A resumed run in the same run_dir keeps the bound over the files already there, oldest steps first; going
    back to an earlier step starts a new file, so each file's steps increase."""
    batch = SampleBatch(rewards=[float(i % 5) for i in range(8)], texts=["t"] * 8)
    first = RunDiagnostics(tmp_path, audit_k=1, audit_max_files=3, audit_updates_per_file=2)
    for step in (1, 2, 3):
        first.update(batch, step)
    first.close()
    resumed = RunDiagnostics(tmp_path, audit_k=1, audit_max_files=3, audit_updates_per_file=2)
    for step in (3, 4, 20):  # step 3 written again after the resume, then new steps
        resumed.update(batch, step)
    resumed.flush()
    names = sorted((p.name for p in (tmp_path / "audit").iterdir()), key=lambda n: int(n[6:-6]))
    assert names == ["steps_1.jsonl", "steps_3.jsonl", "steps_20.jsonl"]
    assert {rec["step"] for rec in _lines(tmp_path / "audit" / "steps_3.jsonl")} == {3, 4}  # rewritten, not appended
    resumed.update(batch, 21)
    resumed.update(batch, 22)  # a fourth file: the oldest (the first run's steps 1-2) goes
    resumed.flush()
    names = sorted((p.name for p in (tmp_path / "audit").iterdir()), key=lambda n: int(n[6:-6]))
    assert names == ["steps_3.jsonl", "steps_20.jsonl", "steps_22.jsonl"]


def test_no_run_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = RunDiagnostics()
    d.update(SampleBatch(rewards=[1.0, 0.0], texts=["a", "b"]), 0)
    assert d.last_audit_file is None and list(tmp_path.iterdir()) == []


def test_a_failed_audit_write_does_not_fail_saving_the_state(tmp_path, monkeypatch):
    """The state goes into checkpoints: an audit file that cannot be written (a full disk) is a warning there."""
    d = RunDiagnostics(tmp_path, audit_k=1)
    d.update(SampleBatch(rewards=[0.0, 1.0], texts=["a", "b"]), 1)
    monkeypatch.setattr(d.audit, "_open", lambda step: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.warns(RuntimeWarning, match="queued audit samples could not be written.*No space left"):
        state = d.state_dict()
    assert state["version"] == 1 and state["budget"]
