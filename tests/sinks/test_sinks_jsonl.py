"""JsonlSink: real files, non-finite round trip, crash and resume semantics."""

import json
import math
import warnings

import numpy as np
import pytest

from rl_guard.sinks import INCIDENTS_FILE, METRICS_FILE, JsonlSink, read_jsonl


def _run(run_dir, steps, resume_step=None, base=1.0, **kw):
    sink = JsonlSink(**kw)
    sink.start(run_dir, resume_step=resume_step)
    for s in steps:
        sink.log({"rl_guard/ratio/p50": base + s / 100.0, "rl_guard/guard/fired": float(s % 2)}, s)
    return sink


def test_one_line_per_step_and_flushed_before_finish(tmp_path):
    sink = _run(tmp_path, range(1, 4))
    # No finish(): a crash right now must still leave every completed line on disk.
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(l)["step"] for l in lines] == [1, 2, 3]
    assert json.loads(lines[1]) == {"step": 2, "rl_guard/ratio/p50": 1.02, "rl_guard/guard/fired": 0.0}
    assert list(json.loads(lines[0]))[0] == "step"
    sink.finish()


def test_nonfinite_round_trip_is_valid_json(tmp_path):
    sink = JsonlSink()
    sink.start(tmp_path)
    values = {"a": float("nan"), "b": float("inf"), "c": -math.inf, "d": np.float32(0.5),
              "e": np.float64("nan"), "f": np.int64(7)}
    sink.log(values, 5)
    sink.incident({"step": 5, "rule": "r", "value": float("nan"), "message": "m",
                   "window": {"rl_guard/x": [1.0, float("inf"), np.float32(2.0)]}, "checkpoint": None})
    sink.finish()
    raw = (tmp_path / METRICS_FILE).read_text()
    # Strict parser (rejects NaN/Infinity literals) must accept the file.
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert json.loads(raw)["a"] == "nan" and json.loads(raw)["c"] == "-inf"
    (row,) = read_jsonl(tmp_path / METRICS_FILE)
    assert math.isnan(row["a"]) and math.isnan(row["e"])
    assert row["b"] == math.inf and row["c"] == -math.inf
    assert row["d"] == 0.5 and row["f"] == 7 and row["step"] == 5
    (inc,) = read_jsonl(tmp_path / INCIDENTS_FILE)
    assert math.isnan(inc["value"]) and inc["checkpoint"] is None
    assert inc["window"]["rl_guard/x"] == [1.0, math.inf, 2.0]


def test_resume_drops_lost_steps_and_skips_duplicates(tmp_path):
    first = _run(tmp_path, range(1, 11))
    first.incident({"step": 9, "rule": "kl_spike", "message": "lost-run incident"})
    first.finish()
    # Simulate a crash mid-write: a partial line without newline at the end.
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 11, "rl_guard/ra')
    # The resumed run replays from a step-5 checkpoint (steps 4..12; 4 and 5 already exist).
    second = _run(tmp_path, range(4, 13), resume_step=5, base=2.0)
    second.log({"rl_guard/ratio/p50": 99.0}, 12)  # same step again: skipped
    second.finish()
    rows = read_jsonl(tmp_path / METRICS_FILE)
    assert [r["step"] for r in rows] == list(range(1, 13))
    values = [r["rl_guard/ratio/p50"] for r in rows]
    # Steps <= 5 come from the first run, 6..12 from the resumed one (lost 6..10 dropped).
    assert values == pytest.approx([1.0 + s / 100 for s in range(1, 6)] + [2.0 + s / 100 for s in range(6, 13)])
    assert not (tmp_path / (METRICS_FILE + ".tmp")).exists()
    # Incidents of the lost run are kept by default (audit trail of the rollback).
    assert [i["message"] for i in read_jsonl(tmp_path / INCIDENTS_FILE)] == ["lost-run incident"]


def test_resume_can_drop_lost_incidents(tmp_path):
    first = _run(tmp_path, range(1, 4))
    for s in (2, 3):
        first.incident({"step": s, "rule": "r", "message": f"at {s}"})
    first.finish()
    second = _run(tmp_path, [3], resume_step=2, keep_lost_incidents=False)
    second.finish()
    assert [i["step"] for i in read_jsonl(tmp_path / INCIDENTS_FILE)] == [2]
    assert [r["step"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [1, 2, 3]


def test_fresh_start_in_used_dir_appends_and_warns(tmp_path):
    _run(tmp_path, [1, 2]).finish()
    with pytest.warns(RuntimeWarning, match="already has data"):
        sink = _run(tmp_path, [1], fsync=True)
    sink.finish()
    assert [r["step"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [1, 2, 1]


def test_read_jsonl_ignores_truncated_tail(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"step": 1, "v": "inf"}\n{"step": 2, "v"')
    assert read_jsonl(path) == [{"step": 1, "v": math.inf}]


def test_finish_is_idempotent(tmp_path):
    sink = _run(tmp_path, [1])
    sink.finish()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sink.finish()
