"""quadrant/ and the audit files: hand-worked cells, ids written for audit, bounded files."""

import json
import math

import pytest

from rl_guard.diagnostics import RunDiagnostics, SampleBatch

IDS = list("abcdef")
R = [0.9, 0.8, 0.2, 0.1, 0.7, 0.3]
OUTCOME = [1, 0, 1, 0, 0, 1]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


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
    m = diag(ids=IDS + ["g", "h"], rewards=R + [1.0, 1.0], outcome=OUTCOME + [math.nan, 0],
             termination=["success"] * 7 + ["verifier_error"])
    # g (NaN outcome) and h (system error) are out; the six others give the numbers of test_quadrant_median_split.
    assert m["quadrant/n"] == 6 and m["quadrant/hacking_frac"] == pytest.approx(2 / 6)


def test_audit_file_contents(tmp_path):
    texts = [f"t{i}" for i in range(8)]
    texts[1] = "x" * 5000
    d = RunDiagnostics(tmp_path, audit_k=2, audit_max_chars=100, seed=7)
    d.update(SampleBatch(ids=[f"s{i}" for i in range(8)], rewards=[0.5, 0.9, 0.1, 0.7, 0.3, 0.9, math.nan, 0.2],
                         texts=texts, prompts=["p"] * 8), step=12)
    path = tmp_path / "audit" / "step_12.jsonl"
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
    d.update(SampleBatch(ids=IDS, rewards=R, outcome=OUTCOME, texts=[s.upper() for s in IDS]), step=3)
    lines = _lines(d.last_audit_file)
    cells = {r["cell"]: r for r in lines if r["kind"] == "quadrant_cell"}
    assert cells["hacking"]["ids"] == ["b", "e"] and cells["hacking"]["count"] == 2
    assert cells["false_negative"]["ids"] == ["c", "f"]
    # k = 1 detailed sample per cell: the highest-reward hacking candidate, the lowest-reward false negative.
    assert [r["id"] for r in lines if r["kind"] == "hacking"] == ["b"]
    assert [(r["id"], r["text"]) for r in lines if r["kind"] == "false_negative"] == [("c", "C")]


def test_audit_file_count_and_size_are_bounded(tmp_path):
    d = RunDiagnostics(tmp_path, audit_k=3, audit_max_files=3, audit_max_chars=50)
    batch = SampleBatch(ids=["i" * 400] * 40, rewards=[float(i % 5) for i in range(40)], texts=["y" * 10_000] * 40,
                        prompts=["z" * 10_000] * 40, outcome=[i % 2 for i in range(40)])
    for step in (8, 9, 10, 11, 12):
        d.update(batch, step)
    files = sorted(p.name for p in (tmp_path / "audit").iterdir())
    # Oldest steps go first, by number (a string sort would wrongly keep step_8 / step_9 over step_10).
    assert files == ["step_10.jsonl", "step_11.jsonl", "step_12.jsonl"]
    for name in files:
        lines = _lines(tmp_path / "audit" / name)
        # 3 top + 3 bottom + 3 random + per cell (1 summary + 3 samples) x 2 cells = 17 lines.
        assert len(lines) == 17
        # Uncapped this file would hold ~15 x 20 kB of text; capped, a sample line is < 300 bytes and each cell
        # line lists <= 12 ids of 50 chars (hacking: r >= median 2 is 24 samples, 12 failed), < 800 bytes.
        assert (tmp_path / "audit" / name).stat().st_size < 15 * 300 + 2 * 800
        assert all(len(r.get("text", "")) <= 50 and len(str(r.get("id", ""))) <= 50 for r in lines)


def test_audit_bound_counts_files_of_an_earlier_run(tmp_path):
    """A resumed run in the same run_dir keeps the bound over the files already there, oldest steps first."""
    batch = SampleBatch(rewards=[float(i % 5) for i in range(8)], texts=["t"] * 8)
    first = RunDiagnostics(tmp_path, audit_k=1, audit_max_files=3)
    for step in (1, 2, 3):
        first.update(batch, step)
    resumed = RunDiagnostics(tmp_path, audit_k=1, audit_max_files=3)
    for step in (3, 4, 20):  # step 3 rewritten after the resume, then new steps
        resumed.update(batch, step)
    assert sorted(p.name for p in (tmp_path / "audit").iterdir()) == ["step_20.jsonl", "step_3.jsonl", "step_4.jsonl"]


def test_no_run_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = RunDiagnostics()
    d.update(SampleBatch(rewards=[1.0, 0.0], texts=["a", "b"]), 0)
    assert d.last_audit_file is None and list(tmp_path.iterdir()) == []
