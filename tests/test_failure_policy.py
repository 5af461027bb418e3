"""The failure policy (docs/failure-policy.md): caller errors raise, internal errors follow
``fail_mode``, persistent internal failures are announced and, in closed mode, halt the run."""

import pytest
import torch
from bitwise import assert_same
from guard_loop import full_state, setup, train_step

import rl_guard.guard as guard_module
from rl_guard import ConfigError, Guard, SampleBatch, TokenBatch
from rl_guard.diagnostics import SampleError
from rl_guard.errors import InputError
from rl_guard.sinks import read_jsonl
from rl_guard.stats.batch import BatchError


def broken_grad_probe(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("gradient probe exploded")

    monkeypatch.setattr(guard_module, "probe_grads", boom)


def test_every_caller_error_is_an_input_error():
    assert all(issubclass(e, InputError) for e in (ConfigError, BatchError, SampleError))


@pytest.mark.parametrize(
    "text, where, expected",
    [
        (
            "version: 1\nsinks:\n  - jsonl\n  - tensorboard: {logdir: tb}\n",
            "sinks[1].tensorboard.logdir (line 4)",
            "unknown option 'logdir' for sink 'tensorboard'; allowed: log_dir",
        ),
        (
            "version: 1\nsinks: [{console: {every: 0}}]\n",
            "sinks[0].console.every (line 2)",
            "every must be a whole number of steps >= 1, got 0",
        ),
        (
            "version: 1\nsinks:\n  - jsonl:\n      flush_every: 2.5\n",
            "sinks[0].jsonl.flush_every (line 4)",
            "flush_every must be a whole number of steps >= 1, got 2.5",
        ),
        ("", "<top level>", "is empty; a config of defaults says at least 'version: 1'"),
        ("# all commented out\n# rules: []\n", "<top level>", "is empty"),
    ],
)
def test_bad_sink_options_and_empty_configs_fail_at_load(text, where, expected):
    with pytest.raises(ConfigError) as err:
        Guard.from_yaml(text)
    assert where in str(err.value) and expected in str(err.value)


def test_caller_errors_raise_from_every_entry_point(tmp_path):
    guard, *_ = setup(tmp_path, "version: 1\n")
    with pytest.raises(BatchError, match="rewards"):
        guard.observe_sequences(rewards=torch.zeros(3, 2))
    with pytest.raises(SampleError, match="differ in length"):
        guard.observe_samples(SampleBatch(rewards=[1.0, 0.0], lengths=[3]))
    with pytest.raises(BatchError, match="mask"):
        guard.observe(TokenBatch(torch.zeros(2, 3), torch.ones(2, 4)))
    assert guard.internal_failures == 0


def test_internal_value_error_is_not_mistaken_for_a_caller_error(tmp_path, monkeypatch):
    guard, *_ = setup(tmp_path, "version: 1\n")

    def internal(*a, **k):
        raise ValueError("a bug inside the diagnostics")

    monkeypatch.setattr(guard.diagnostics, "update", internal)
    with pytest.warns(RuntimeWarning, match="internal failure in observe_samples"):
        guard.observe_samples(SampleBatch(rewards=[1.0, 0.0]))
    assert guard.internal_failures == 1


def test_failing_snapshot_and_log_do_not_stop_training(tmp_path, monkeypatch):
    guard, model, opt, sched = setup(
        tmp_path,
        "version: 1\nsnapshots: {healthy_steps: 1, every: 1}\nrules:\n"
        "  - {name: r, metric: rl_guard/grad/norm, op: '>', threshold: 1.0e+9, action: rollback}\n",
    )
    monkeypatch.setattr(guard.state, "capture", lambda step: 1 / 0)
    with pytest.warns(RuntimeWarning, match="internal failure in snapshot"):
        for _ in range(2):
            assert train_step(guard, model, opt, sched).apply_step
    assert guard.step == 2 and guard.internal_failures == 3  # the starting state's snapshot and two more


def test_a_failing_update_probe_keeps_the_steps_statistics_and_their_rules(tmp_path, monkeypatch):
    guard, model, opt, sched = setup(
        tmp_path,
        "version: 1\nrules:\n"
        "  - {name: big_loss, metric: rl_guard/loss/value, op: '>', threshold: 1.0e+3, "
        "action: skip_step}\n",
    )
    monkeypatch.setattr(guard.update_probe, "pre_step", lambda *a: 1 / 0)
    with pytest.warns(RuntimeWarning, match="internal failure in update probe"):
        d = train_step(guard, model, opt, sched, scale=1e6)
    # the loss observed before the probe failed still reaches the rules
    assert d.action == "skip_step" and guard.last_metrics["rl_guard/loss/value"] > 1e3


def test_open_mode_announces_an_unguarded_run_once_and_recovery(tmp_path, monkeypatch, capsys):
    guard, model, opt, sched = setup(tmp_path, "version: 1\nmax_internal_failures: 3\n")
    with monkeypatch.context() as m:
        broken_grad_probe(m)
        with pytest.warns(RuntimeWarning, match="gradient probe exploded"):
            for _ in range(5):
                before = full_state(model, opt, sched)["model"]
                assert train_step(guard, model, opt, sched).apply_step  # open: the update still goes through
                assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())
                assert guard.last_logged["rl_guard/guard/unguarded"] == float(guard.failing_steps >= 3)
    train_step(guard, model, opt, sched)
    assert guard.last_logged["rl_guard/guard/unguarded"] == 0.0
    err = capsys.readouterr().err
    assert err.count("UNGUARDED at step 2") == 1 and "internal failure on 3 consecutive steps" in err
    assert err.count("guarded again at step 5") == 1
    incidents = read_jsonl(tmp_path / "run" / "incidents.jsonl")
    assert [(i["rule"], i["step"]) for i in incidents] == [("guard_unguarded", 2), ("guard_recovered", 5)]
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["rl_guard/guard/unguarded"] for m in metrics] == [0, 0, 1, 1, 1, 0]


def test_open_mode_still_drops_a_nonfinite_gradient_when_the_check_fails(tmp_path, monkeypatch):
    guard, model, opt, sched = setup(tmp_path, "version: 1\n")
    train_step(guard, model, opt, sched)
    broken_grad_probe(monkeypatch)
    before = full_state(model, opt, sched)
    with pytest.warns(RuntimeWarning):
        d = train_step(guard, model, opt, sched, poison=float("nan"), always_step=True)
    assert d.action == "skip_step"
    assert_same(before["model"], model.state_dict())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_closed_mode_never_applies_an_unchecked_update_and_halts_at_the_limit(tmp_path, monkeypatch, capsys):
    guard, model, opt, sched = setup(tmp_path, "version: 1\nfail_mode: closed\nmax_internal_failures: 2\n")
    train_step(guard, model, opt, sched)
    broken_grad_probe(monkeypatch)
    before = full_state(model, opt, sched)
    with pytest.warns(RuntimeWarning):
        first = train_step(guard, model, opt, sched, always_step=True)
        second = train_step(guard, model, opt, sched, always_step=True)
    assert first.action == "skip_step" and not first.stop
    assert second.action == "checkpoint_and_halt" and second.stop
    assert_same(before["model"], model.state_dict())
    assert_same(before["optimizer"], opt.state_dict())
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "step_00000002" / "rank0.pt", weights_only=True)
    assert_same(before["model"], ckpt["model"])
    assert "checkpointed and halted" in capsys.readouterr().err
    assert read_jsonl(tmp_path / "run" / "incidents.jsonl")[-1]["rule"] == "guard_unguarded"
