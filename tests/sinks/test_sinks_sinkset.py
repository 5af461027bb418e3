"""SinkSet fault isolation, rank filtering and build_sinks spec parsing."""

import errno
import warnings

import pytest

from rl_guard.sinks import (
    SINK_NAMES,
    ConsoleSink,
    JsonlSink,
    Sink,
    SinkSet,
    TensorBoardSink,
    WandbSink,
    build_sinks,
    read_jsonl,
)


class MissingBackendSink(Sink):
    """A sink whose backend module is not installed."""

    name = "missing"

    def start(self, run_dir, resume_step=None):
        import rl_guard_no_such_backend  # noqa: F401


class DiskFullSink(Sink):
    """Starts fine, then every write fails like a full disk."""

    name = "diskfull"

    def __init__(self):
        super().__init__()
        self.calls = 0

    def log(self, values, step, histograms=None):
        self.calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")


class Recorder(Sink):
    name = "recorder"
    main_process_only = False

    def __init__(self):
        super().__init__()
        self.steps, self.incidents, self.finished = [], [], False

    def log(self, values, step, histograms=None):
        self.steps.append(step)

    def incident(self, record):
        self.incidents.append(record)

    def finish(self):
        self.finished = True


def _drive(sinks, n=5):
    sinks.start()
    for s in range(1, n + 1):
        sinks.log({"rl_guard/grad/norm": float(s)}, s)
    sinks.incident({"step": n, "rule": "r", "message": "boom"})
    sinks.finish()


def test_failing_start_warns_once_and_jsonl_keeps_recording(tmp_path):
    sinks = build_sinks([MissingBackendSink(), "jsonl"], tmp_path)
    with pytest.warns(RuntimeWarning) as rec:
        _drive(sinks)
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "'missing'" in msg and "ModuleNotFoundError" in msg and "rl_guard_no_such_backend" in msg
    assert sinks.names == ["jsonl"] and "missing" in sinks.disabled
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert [r["message"] for r in read_jsonl(tmp_path / "incidents.jsonl")] == ["boom"]


def test_failing_log_is_not_retried(tmp_path):
    bad = DiskFullSink()
    sinks = build_sinks(["jsonl", bad], tmp_path)
    with pytest.warns(RuntimeWarning) as rec:
        _drive(sinks, n=20)
    assert len(rec) == 1 and "'diskfull'" in str(rec[0].message) and "No space left" in str(rec[0].message)
    assert bad.calls == 1  # disabled after the first failure, never called again
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 20


def test_real_tensorboard_failure_log_dir_is_a_file(tmp_path):
    blocker = tmp_path / "tb_is_a_file"
    blocker.write_text("not a directory")
    sinks = build_sinks([{"tensorboard": {"log_dir": str(blocker)}}], tmp_path)
    assert sinks.names == ["jsonl", "tensorboard"]  # jsonl added automatically
    with pytest.warns(RuntimeWarning) as rec:
        _drive(sinks, n=3)
    assert len(rec) == 1 and "'tensorboard'" in str(rec[0].message)
    assert sinks.names == ["jsonl"]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_non_main_process_skips_main_only_sinks(tmp_path):
    rec = Recorder()
    sinks = build_sinks(["jsonl", rec], tmp_path, is_main_process=False)
    assert sinks.names == ["recorder"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _drive(sinks, n=3)
    assert rec.steps == [1, 2, 3] and rec.incidents[0]["message"] == "boom" and rec.finished
    assert not (tmp_path / "metrics.jsonl").exists()


def test_build_sinks_spec_forms(tmp_path):
    sinks = build_sinks(["jsonl", {"tensorboard": {"log_dir": "tb"}}, {"console": {"every": 5}}, "wandb"], tmp_path)
    kinds = [type(s) for s in sinks]
    assert kinds == [JsonlSink, TensorBoardSink, ConsoleSink, WandbSink]
    assert sinks.get("console").every == 5
    assert sinks.get("tensorboard").log_dir == "tb"
    assert [type(s) for s in build_sinks("console, jsonl", tmp_path)] == [ConsoleSink, JsonlSink]
    assert [type(s) for s in build_sinks(None, tmp_path)] == [JsonlSink]
    assert [type(s) for s in build_sinks(["console"], tmp_path, ensure_jsonl=False)] == [ConsoleSink]
    assert set(SINK_NAMES) == {"jsonl", "tensorboard", "wandb", "console"}


def test_build_sinks_rejects_unknown(tmp_path):
    with pytest.raises(ValueError) as err:
        build_sinks(["jsonl", "mlflow"], tmp_path)
    for name in SINK_NAMES:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="bad options"):
        build_sinks([{"console": {"evry": 5}}], tmp_path)
    with pytest.raises(ValueError):
        build_sinks([{"console": {}, "jsonl": {}}], tmp_path)
    with pytest.raises(ValueError):
        SinkSet([]).start()


def test_tensorboard_relative_log_dir_is_under_run_dir(tmp_path):
    sinks = build_sinks([{"tensorboard": {"log_dir": "tb"}}], tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _drive(sinks, n=1)
    assert any((tmp_path / "tb").glob("events.out.tfevents.*"))
