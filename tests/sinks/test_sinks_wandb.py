"""WandbSink against real offline runs; the binary .wandb log is read back record by record."""

import json
import math
import time
import warnings

import numpy as np
import pytest

wandb = pytest.importorskip("wandb")

from rl_guard.replay.wandb_offline import records as read_records  # noqa: E402  (the reader replay uses)
from rl_guard.sinks import WandbSink  # noqa: E402


def _key(item):
    return "/".join(item.nested_key) if item.nested_key else item.key


def _complete_records(root, timeout_s=15.0):
    """Records of the single run under `root`, once the writer has appended the exit record.

    wandb-core writes the .wandb file asynchronously and `run.finish()` can return before the
    last blocks hit the disk, so poll briefly instead of reading a half-written file.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        paths = list(root.rglob("run-*.wandb"))
        records = list(read_records(paths[0])) if len(paths) == 1 else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            assert len(paths) == 1, paths
            return paths[0], records
        time.sleep(0.05)


def load_run(root):
    path, records = _complete_records(root)
    history, summary, alerts, metrics = [], {}, [], {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            summary.update({_key(i): json.loads(i.value_json) for i in rec.summary.update})
        elif kind == "alert":
            alerts.append(rec.alert)
        elif kind == "metric":
            metrics[rec.metric.glob_name or rec.metric.name] = rec.metric.step_metric
    summary["__metrics__"] = metrics
    return path.parent, history, summary, alerts


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        path = tmp_path / "wandb_home" / var.lower()
        path.mkdir(parents=True)  # wandb silently falls back to the cwd if WANDB_DIR is missing
        monkeypatch.setenv(var, str(path))
    yield tmp_path
    if wandb.run is not None:
        wandb.run.finish()


def _incident(step, rule, severity="error"):
    return {
        "step": step,
        "rule": rule,
        "metric": "rl_guard/kl_ref/k3_mean",
        "value": 0.31,
        "op": ">",
        "threshold": 0.2,
        "action": "warn",
        "severity": severity,
        "rank": 0,
        "checkpoint": None,
        "window": {"rl_guard/kl_ref/k3_mean": [0.1, 0.31]},
        "time": 1.0,
        "message": f"[rule {rule}] rl_guard/kl_ref/k3_mean = 0.31 > 0.2 at step {step} (rank 0) -> warn",
    }


def test_own_offline_run(offline, monkeypatch):
    monkeypatch.delenv("WANDB_DIR")  # no user choice -> files go under the run dir
    run_dir = offline / "run"
    sink = WandbSink(init={"project": "rl_guard_test", "mode": "offline"})
    sink.start(run_dir)
    assert wandb.run is not None
    edges, counts = np.linspace(0.0, 2.0, 5), np.array([1, 5, 3, 1])
    for step in (1, 2, 3):
        sink.log(
            {"rl_guard/ratio/p50": 1.0 + step / 10, "rl_guard/loss/nonfinite": float("nan")},
            step,
            histograms={"rl_guard/ratio": (edges, counts)},
        )
    sink.incident(_incident(3, "kl_spike"))
    sink.incident(_incident(3, "kl_spike"))  # same rule within alert_every_s: no second alert
    sink.incident(_incident(3, "ratio_tail", severity="warn"))
    sink.finish()
    assert wandb.run is None  # we started it, so we finished it

    files_dir, history, summary, alerts = load_run(run_dir / "wandb")
    rows = [h for h in history if "rl_guard/step" in h]
    assert [h["rl_guard/step"] for h in rows] == [1, 2, 3]
    assert summary["__metrics__"]["rl_guard/*"] == "rl_guard/step"  # x axis for our metrics
    assert [h["rl_guard/ratio/p50"] for h in rows] == pytest.approx([1.1, 1.2, 1.3])
    assert all(math.isnan(h["rl_guard/loss/nonfinite"]) for h in rows)
    assert rows[0]["rl_guard/ratio/_type"] == "histogram" and rows[0]["rl_guard/ratio/values"] == [1, 5, 3, 1]
    assert [(a.title, a.level) for a in alerts] == [("rl_guard: kl_spike", "ERROR"), ("rl_guard: ratio_tail", "WARN")]
    assert alerts[0].text.startswith("[rule kl_spike]") and alerts[0].wait_duration == 300_000
    assert summary["rl_guard/incident_count"] == 3
    assert summary["rl_guard/last_incident"].startswith("[rule ratio_tail]")
    assert summary["rl_guard/incidents"]["nrows"] == 3
    tables = sorted(files_dir.rglob("incidents_summary_*.table.json"), key=lambda p: p.stat().st_mtime)
    table = json.loads(tables[-1].read_text())
    col = table["columns"].index("rule")
    assert [r[col] for r in table["data"]] == ["kl_spike", "kl_spike", "ratio_tail"]


def test_logs_into_active_run_without_owning_it(offline):
    run = wandb.init(project="trainer_run", mode="offline", dir=str(offline / "trainer"))
    run.log({"train/loss": 1.0})  # the trainer advances wandb's own step counter
    run.log({"train/loss": 0.5})
    sink = WandbSink(alerts=False)
    sink.start(offline / "run")
    sink.log({"rl_guard/grad/norm": 2.5}, 7)
    sink.incident(_incident(7, "kl_spike"))
    sink.finish()
    assert wandb.run is run  # the trainer's run stays open
    run.finish()
    _, history, summary, alerts = load_run(offline / "trainer")
    (row,) = [h for h in history if "rl_guard/grad/norm" in h]
    assert row["rl_guard/step"] == 7 and row["rl_guard/grad/norm"] == 2.5
    assert summary["rl_guard/incident_count"] == 1 and alerts == []


def test_no_run_and_no_init_warns_once_and_drops(offline):
    sink = WandbSink()
    sink.start(offline / "run")
    with pytest.warns(RuntimeWarning, match="no active wandb run") as rec:
        sink.log({"rl_guard/grad/norm": 1.0}, 1)
        sink.log({"rl_guard/grad/norm": 1.0}, 2)
        sink.incident(_incident(2, "r"))
    assert len(rec) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sink.finish()
    assert not list(offline.rglob("*.wandb"))


def test_a_file_cut_inside_a_record_reads_up_to_the_last_whole_record(offline, tmp_path):
    """A .wandb file read while wandb-core is still appending (or left by a crash) may end inside a record: the
    reader yields every whole record and drops the torn one, as it does for a torn header."""
    run = wandb.init(project="cut", mode="offline", dir=str(offline / "trainer"))
    for i in range(50):
        run.log({"rl_guard/grad/norm": float(i), "pad": "x" * 200})
    run.finish()
    path, whole = _complete_records(offline / "trainer")
    data = path.read_bytes()
    kinds = [r.WhichOneof("record_type") for r in whole]
    for cut in range(len(data) // 3, len(data), max(1, len(data) // 17)):
        torn = tmp_path / f"cut{cut}.wandb"
        torn.write_bytes(data[:cut])
        got = [r.WhichOneof("record_type") for r in read_records(torn)]
        assert got == kinds[: len(got)] and len(got) < len(kinds)  # a prefix of the whole file's records
