"""JsonlSink: real files, non-finite round trip, crash and resume semantics."""

import json
import math
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from rl_guard.sinks import INCIDENTS_FILE, METRICS_FILE, JsonlSink, SinkOptionError, read_jsonl
from rl_guard.sinks.jsonl import metrics_line, to_jsonable


def _run(run_dir, steps, resume_step=None, base=1.0, **kw):
    sink = JsonlSink(**kw)
    sink.start(run_dir, resume_step=resume_step)
    for s in steps:
        sink.log({"rl_guard/ratio/p50": base + s / 100.0, "rl_guard/guard/fired": float(s % 2)}, s)
    return sink


def test_one_line_per_step_written_as_it_comes_with_flush_every_1(tmp_path):
    sink = _run(tmp_path, range(1, 4), flush_every=1)
    # No finish(): a crash right now must still leave every completed line on disk.
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert json.loads(lines[1]) == {"step": 2, "rl_guard/ratio/p50": 1.02, "rl_guard/guard/fired": 0.0}
    assert list(json.loads(lines[0]))[0] == "step"
    sink.finish()


def _steps_on_disk(run_dir):
    return [r["step"] for r in read_jsonl(run_dir / METRICS_FILE)] if (run_dir / METRICS_FILE).exists() else []


def test_metrics_buffered_for_flush_every_steps_and_flushed_on_firing_incident_and_finish(tmp_path):
    sink = JsonlSink(flush_every=4)
    sink.start(tmp_path)
    for s in range(3):
        sink.log({"rl_guard/x": 1.0, "rl_guard/guard/fired": 0.0}, s)
    assert _steps_on_disk(tmp_path) == []  # buffered
    sink.log({"rl_guard/x": 1.0, "rl_guard/guard/fired": 0.0}, 3)
    assert _steps_on_disk(tmp_path) == [0, 1, 2, 3]  # the 4th step writes the four lines at once
    sink.log({"rl_guard/x": 1.0, "rl_guard/guard/fired": 0.0}, 4)
    sink.log({"rl_guard/x": 2.0, "rl_guard/guard/fired": 1.0}, 5)  # a rule fired: written at once
    assert _steps_on_disk(tmp_path) == [0, 1, 2, 3, 4, 5]
    sink.log({"rl_guard/x": 1.0, "rl_guard/guard/fired": 0.0}, 6)
    sink.incident({"step": 7, "rule": "r", "message": "m"})  # the steps before an incident go first
    assert _steps_on_disk(tmp_path) == list(range(7))
    assert [i["step"] for i in read_jsonl(tmp_path / INCIDENTS_FILE)] == [7]
    sink.log({"rl_guard/x": 1.0, "rl_guard/guard/fired": 0.0}, 7)  # the incident's step: written at once
    assert _steps_on_disk(tmp_path) == list(range(8))
    sink.log({"rl_guard/x": 1.0, "rl_guard/guard/fired": 0.0}, 8)
    assert _steps_on_disk(tmp_path) == list(range(8))
    sink.finish()
    assert _steps_on_disk(tmp_path) == list(range(9))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_flush_every_must_be_a_whole_number_of_steps(bad):
    with pytest.raises(SinkOptionError, match="flush_every must be a whole number of steps >= 1") as err:
        JsonlSink(flush_every=bad)
    assert err.value.option == "flush_every"  # config errors point at the option's own line
    assert JsonlSink(flush_every=np.int64(3)).flush_every == 3


_CHILD = """
import sys, time
from rl_guard.sinks.jsonl import JsonlSink
sink = JsonlSink(flush_every={n})
sink.start({run_dir!r})
for s in range({steps}):
    sink.log({{"rl_guard/x": float(s), "rl_guard/guard/fired": float(s in {fired})}}, s)
    print(s, flush=True)
{tail}
"""


def _child(tmp_path, n, steps, fired=(), tail="time.sleep(120)"):
    code = _CHILD.format(n=n, run_dir=str(tmp_path), steps=steps, fired=set(fired) or "()", tail=tail)
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2]
    )


@pytest.mark.parametrize("fired", [(), (14,)])
def test_a_killed_process_loses_at_most_the_last_flush_every_steps(tmp_path, fired):
    """SIGKILL gives the process no chance to flush: what is on disk is what the buffering already wrote."""
    n, steps = 10, 23
    child = _child(tmp_path, n, steps, fired)
    try:
        reported = [int(child.stdout.readline()) for _ in range(steps)]  # every step was logged
        assert reported == list(range(steps))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    on_disk = _steps_on_disk(tmp_path)
    assert on_disk == list(range(len(on_disk)))  # a prefix of the run, every line complete
    assert steps - len(on_disk) <= n - 1  # at most the last flush_every - 1 steps lost
    assert on_disk == (list(range(20)) if not fired else list(range(15)))  # flushed at 10, 20 / at 14 (fired)


def test_a_process_that_exits_without_finish_writes_its_buffer(tmp_path):
    child = _child(tmp_path, 10, 3, tail="")
    child.communicate(timeout=60)
    assert child.returncode == 0
    assert _steps_on_disk(tmp_path) == [0, 1, 2]


def test_nonfinite_round_trip_is_valid_json(tmp_path):
    sink = JsonlSink()
    sink.start(tmp_path)
    values = {
        "a": float("nan"),
        "b": float("inf"),
        "c": -math.inf,
        "d": np.float32(0.5),
        "e": np.float64("nan"),
        "f": np.int64(7),
    }
    sink.log(values, 5)
    sink.incident(
        {
            "step": 5,
            "rule": "r",
            "value": float("nan"),
            "message": "m",
            "window": {"rl_guard/x": [1.0, float("inf"), np.float32(2.0)]},
            "checkpoint": None,
        }
    )
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


@pytest.mark.parametrize(
    "values",
    [
        {"rl_guard/a": 0.1, "rl_guard/b": 1e-300, "rl_guard/c": -2.5, "rl_guard/é": 3.0},  # plain floats: the fast path
        {"rl_guard/a": 0.1, "rl_guard/b": float("nan"), "rl_guard/c": -math.inf},
        {"rl_guard/a": np.float32(0.5), "rl_guard/b": np.int64(3), "rl_guard/c": np.float64(0.25), "rl_guard/d": True},
        {"rl_guard/a": 1, "rl_guard/b": None, "rl_guard/c": "text", "rl_guard/d": [1.0, math.nan]},
        {"step": 99, "rl_guard/a": 0.5},  # a step entry in the values never replaces the step
    ],
)
def test_metrics_line_is_the_converted_record(values):
    want = {"step": 7, **{k: to_jsonable(v) for k, v in values.items() if k != "step"}}
    line = metrics_line(values, 7)
    assert line == json.dumps(want, allow_nan=False, ensure_ascii=False) + "\n"
    assert list(json.loads(line)) == ["step", *[k for k in values if k != "step"]]


def test_a_dropped_sink_writes_its_buffer_and_closes_its_files(tmp_path):
    import gc

    sink = JsonlSink(flush_every=10)
    sink.start(tmp_path)
    for s in range(3):
        sink.log({"rl_guard/x": 1.0}, s)
    assert _steps_on_disk(tmp_path) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unclosed file would be a ResourceWarning
        del sink
        gc.collect()
    assert _steps_on_disk(tmp_path) == [0, 1, 2]
