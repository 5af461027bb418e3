"""Every history format, from real files: a TRL run's trainer_state.json and TensorBoard events (written by
transformers itself), and the guard's own TensorBoard and wandb sinks fed a real demo run's metrics."""

from __future__ import annotations

import json
import math
import time

import pytest

from rl_guard.cli import main
from rl_guard.control.config import load_config
from rl_guard.replay import HistoryFormatError, load_history, replay
from rl_guard.replay.names import TRL_KEYS

pytestmark = pytest.mark.slow  # real GRPO runs (session fixtures)

# Rules every TRL log can feed, and one it cannot (TRL logs no behaviour-vs-current ratio quantiles).
PROBE = """
rules:
  - {name: entropy_seen, metric: rl_guard/entropy/mean, op: ">", threshold: 0.0, action: warn}
  - {name: kl_seen, metric: rl_guard/kl_ref/k3_mean, op: ">=", threshold: 0.0, action: warn}
  - {name: grad_seen, metric: rl_guard/grad/norm, op: ">", threshold: 0.0, action: warn}
  - {name: ratio_tail, metric: rl_guard/ratio/p99, op: ">", threshold: 2.0, action: rollback}
"""


def _train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def test_trainer_state_maps_trl_keys_and_says_which_rules_have_input(trl_run, capsys):
    root, trainer = trl_run
    logs = _train_logs(trainer)
    history = load_history(root / "trainer_state.json")
    assert history.kind == "trainer_state" and history.steps == [h["step"] for h in logs] == [1, 2, 3, 4, 5, 6]
    for rec, log in zip(history.records, logs):  # the values are TRL's own, under rl_guard names
        assert rec["rl_guard/entropy/mean"] == log["entropy"] and rec["rl_guard/kl_ref/k3_mean"] == log["kl"]
        assert rec["rl_guard/clip/region_frac"] == log["clip_ratio/region_mean"]
        if "completions/clipped_ratio" in log:  # a generation step; the steps after it train on that generation
            generation = log
        assert rec["rl_guard/length/truncated_frac"] == generation["completions/clipped_ratio"]
        assert rec["rl_guard/reward/mean"] == generation["reward"]
        assert rec["rl_guard/grad/norm"] == log["grad_norm"]  # both the total norm before clipping
        assert rec["rl_guard/loss/nonfinite"] == 0.0
    result = replay(history, load_config(PROBE))
    fired = result.steps_by_rule()
    assert fired["entropy_seen"] == fired["kl_seen"] == fired["grad_seen"] == history.steps
    assert fired["ratio_tail"] == []
    has = {i.rule: i.has_input for i in result.inputs}
    assert has == {
        "nonfinite_loss": True,
        "nonfinite_grad": True,
        "nonfinite_logprobs": False,
        "entropy_seen": True,
        "kl_seen": True,
        "grad_seen": True,
        "ratio_tail": False,
    }
    # The shipped preset on the same file: the table says which rules had input and where it came from.
    assert main(["replay", str(root / "trainer_state.json"), "--config", "grpo"]) == 0
    text = capsys.readouterr().out
    assert "update_too_far -> rollback: NO INPUT in this history" in text
    assert "rl_guard/kl_old/k3_mean: 0/6  not in this history" in text
    assert "rl_guard/entropy/mean: 6/6  (from entropy)" in text
    assert "rl_guard/grad/norm: 6/6  (from grad_norm)" in text
    assert 0 < sum("completions/clipped_ratio" in h for h in logs) < 6  # TRL logs them on generation steps only
    assert (
        "rl_guard/length/truncated_frac: 6/6  (from completions/clipped_ratio, repeated over the steps that "
        "train on its generation)"
    ) in text


def test_trl_tensorboard_events_replay_like_the_trainer_state(trl_run):
    root, trainer = trl_run
    tb = load_history(root / "out")  # transformers wrote out/runs/<date>/events.out.tfevents.*
    state = load_history(root / "trainer_state.json")
    assert tb.kind == "tensorboard" and tb.steps == state.steps
    for a, b in zip(tb.records, state.records):  # TensorBoard keeps float32
        for key in ("rl_guard/entropy/mean", "rl_guard/kl_ref/k3_mean", "rl_guard/grad/norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6)
    assert replay(tb, load_config(PROBE)).steps_by_rule() == replay(state, load_config(PROBE)).steps_by_rule()


def test_trl_offline_wandb_run_replays_like_the_trainer_state(trl_run):
    root, trainer = trl_run
    state = load_history(root / "trainer_state.json")
    deadline = time.monotonic() + 20  # wandb-core appends the last blocks after the run finished
    while True:
        try:  # transformers' wandb callback: train/<key> at train/global_step
            history = load_history(root / "wandb_home")
        except HistoryFormatError:  # no training row written yet
            history = None
        if history is not None and history.steps == state.steps or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert history.kind == "wandb offline" and history.steps == state.steps
    for a, b in zip(history.records, state.records):
        assert a == pytest.approx(b)
    assert replay(history, load_config(PROBE)).steps_by_rule() == replay(state, load_config(PROBE)).steps_by_rule()


def _through_sink(sink, run_dir, history):
    sink.start(run_dir)
    for rec in history.records:
        sink.log({k: v for k, v in rec.items() if k != "step"}, rec["step"])
    sink.finish()


def _replayed(history, config):
    return [(r["step"], r["rule"], r["action"]) for r in replay(history, config).incidents]


def test_guard_tensorboard_sink_files_replay_like_metrics_jsonl(fault_demo, tmp_path):
    from rl_guard.sinks import TensorBoardSink

    source = load_history(fault_demo.run_dir)
    _through_sink(TensorBoardSink(log_dir="tb", histograms=False), tmp_path, source)
    tb = load_history(tmp_path / "tb")
    config = load_config(fault_demo.run_dir / "config.yaml")
    assert tb.kind == "tensorboard" and tb.steps == source.steps
    assert _replayed(tb, config) == _replayed(source, config) != []


def test_guard_wandb_sink_offline_run_replays_like_metrics_jsonl(fault_demo, tmp_path, monkeypatch):
    from rl_guard.sinks import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    source = load_history(fault_demo.run_dir)
    _through_sink(WandbSink(init={"project": "rl_guard_replay", "mode": "offline"}, alerts=False), tmp_path, source)
    deadline = time.monotonic() + 20  # wandb-core appends the last blocks after finish() returns
    while True:
        try:
            history = load_history(tmp_path / "wandb")
        except HistoryFormatError:
            history = None
        if history is not None and history.steps == source.steps or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert history.kind == "wandb offline" and history.steps == source.steps
    nonfinite = [k for r in source.records for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]
    for a, b in zip(history.records, source.records):
        assert a.keys() == b.keys()
        assert all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in b if k != "step"), nonfinite
    config = load_config(fault_demo.run_dir / "config.yaml")
    assert _replayed(history, config) == _replayed(source, config) != []


def test_unknown_formats_get_a_clear_error(tmp_path, capsys):
    (tmp_path / "table.csv").write_text("step,kl\n1,0.1\n")
    (tmp_path / "other.json").write_text(json.dumps({"global_step": 3}))
    (tmp_path / "empty").mkdir()
    for path, why in [
        (tmp_path / "table.csv", "unknown file type"),
        (tmp_path / "other.json", "without a 'log_history' list"),
        (tmp_path / "empty", "holds no metrics.jsonl, trainer_state.json"),
        (tmp_path / "missing", "no such file"),
    ]:
        with pytest.raises(HistoryFormatError, match=why) as err:
            load_history(path)
        assert "trainer_state.json" in str(err.value) and "wandb" in str(err.value)  # what is accepted
    assert main(["replay", str(tmp_path / "table.csv"), "--config", "grpo"]) == 2
    err = capsys.readouterr().err
    assert "rl-guard replay:" in err and "table.csv: unknown file type" in err


def test_trl_key_map_targets_are_glossary_metrics():
    from rl_guard import glossary

    assert all(glossary.is_known(m) for m in TRL_KEYS.values())
