"""A healthy guarded GRPO run: metric names and values, one host transfer per step and no other synchronising op
of the guard (tests/sync_detector.py), and the importance ratio exactly 1 on-policy but not with a second pass over
the rollouts."""

from __future__ import annotations

import math

import pytest
from sync_detector import SyncDetector

from rl_guard import Guard, glossary
from rl_guard.adapters.trl import RLGuardCallback
from rl_guard.demo.run import demo_config
from rl_guard.stats import families, xp

STEPS = 8
TRANSFER = ["Tensor.cpu", "Tensor.numpy"]  # the step's transfer (rl_guard.stats.accumulate.to_host)


def _phase(event) -> str:
    """ "generation" inside TRL's rollout generation (rewards, sample diagnostics), else "train"."""
    return "generation" if "_generate_and_score_completions" in event.callers else "train"


@pytest.fixture(scope="module")
def healthy(grpo_run, tmp_path_factory):
    from rl_guard.stats.accumulate import StepAccumulator

    finishes = []
    original_finish = StepAccumulator.finish

    def finish(self, *args, **kwargs):
        finishes.append(1)
        return original_finish(self, *args, **kwargs)

    StepAccumulator.finish = finish
    try:
        # The run holds the guard to a GPU's discipline: its small CPU micro-batches would otherwise go to the host
        # engine, which reads them where they already are (host memory: nothing to wait for) and never runs on a GPU.
        with SyncDetector() as detector:
            tmp = tmp_path_factory.mktemp("healthy")
            guard = Guard.from_yaml(
                demo_config("rollback", console_every=None), run_dir=str(tmp / "guard"), open_run_dir=False
            ).use_host_reads(False)
            run = grpo_run(tmp, STEPS, guard=RLGuardCallback(guard))
    finally:
        StepAccumulator.finish = original_finish
    # Syncs whose nearest caller outside torch is the guard (TRL's and the model's own are not the guard's).
    return run, [e for e in detector.events if e.file.startswith("rl_guard/")], len(finishes)


def test_no_action_and_every_step_guarded(healthy):
    run, _, _ = healthy
    acted = [i for i in run.incidents() if i["action"] != "warn"]
    assert acted == []
    assert run.trainer.state.global_step == STEPS and run.guard.step == STEPS + 1  # the next step's number
    assert run.guard.controller.skipped_steps == 0 and run.guard.controller.rollbacks == 0
    assert [m["step"] for m in run.metrics()] == list(range(1, STEPS + 1))  # the trainer's global_step
    assert run.checker.steps_checked == STEPS


def test_metrics_in_trainer_logs_with_documented_names(healthy):
    run, _, _ = healthy
    logs = [h for h in run.trainer.state.log_history if "loss" in h]
    assert len(logs) == STEPS
    by_step = {m["step"]: m for m in run.metrics()}
    required = [
        "ratio/p99",
        "ratio/p50",
        "ratio/min",
        "ratio/max",
        "kl_ref/k3_mean",
        "kl_old/k3_mean",
        "entropy/mean",
        "clip/region_frac",
        "grad/norm",
        "grad/norm_postclip",
        "loss/value",
        "adv/std",
        "length/truncated_frac",
        "guard/skipped_steps",
        "optim/lr",
        "logp/mean",
        "update/param_norm",
    ]
    for log in logs:
        names = [k for k in log if k.startswith("rl_guard/")]
        missing = [n for n in required if "rl_guard/" + n not in log]
        assert not missing, f"step {log['step']}: missing {missing}"
        assert all(glossary.is_known(n) for n in names), [n for n in names if not glossary.is_known(n)]
        # The log of trainer step s (counted after the step) carries the guard's record of step s.
        record = by_step[log["step"]]
        for n in names:
            assert log[n] == record[n] or (math.isnan(log[n]) and math.isnan(record[n])), n
    # The guard's own cost, from the second step (the first has no cycle before it): a share of TRL's step.
    for log in logs[1:]:
        assert log["rl_guard/guard/host_ms"] > 0 and 0 < log["rl_guard/guard/host_frac"] < 1, log["step"]
    assert "rl_guard/guard/host_ms" not in logs[0]


def test_metric_values_agree_with_trl(healthy):
    """Same quantities computed independently by TRL (float32) and by the guard (float64 sums)."""
    run, _, _ = healthy
    logs = [h for h in run.trainer.state.log_history if "loss" in h]
    compared_kl = 0
    for log in logs:
        assert log["rl_guard/grad/norm"] == pytest.approx(log["grad_norm"], rel=1e-5)  # pre-clip, as TRL's
        assert log["rl_guard/grad/norm_postclip"] <= run.trainer.args.max_grad_norm * (1 + 1e-5)
        assert log["rl_guard/grad/norm_postclip"] == pytest.approx(min(log["grad_norm"], 1.0), rel=1e-4)
        assert log["rl_guard/optim/lr"] == pytest.approx(log["learning_rate"], rel=1e-12)
        assert log["rl_guard/entropy/mean"] == pytest.approx(log["entropy"], rel=1e-5)
        if abs(log["rl_guard/ratio/min"] - 1) < 1e-5 and abs(log["rl_guard/ratio/max"] - 1) < 1e-5:
            # TRL weights its KL by the ratio (use_bias_correction_kl): plain k3 only where the ratio is ~1.
            assert log["rl_guard/kl_ref/k3_mean"] == pytest.approx(log["kl"], rel=1e-4, abs=1e-7)
            compared_kl += 1
        if "reward" in log:  # generation steps
            assert log["rl_guard/reward/mean"] == pytest.approx(log["reward"], rel=1e-5, abs=1e-7)
    assert sum("reward" in log for log in logs) == STEPS // 4  # one generation every 4 steps here
    assert compared_kl >= STEPS // 4  # at least the first step after each generation


def test_one_host_transfer_per_step_and_no_other_host_reads(healthy):
    run, events, finishes = healthy
    assert finishes == STEPS
    train = [e for e in events if _phase(e) == "train"]
    # The whole per-step path (statistics of every micro-batch, gradient probe, rules, actions, logging): one
    # .cpu() of the packed vector per step, then .numpy() of that host copy; no .item(), bool(), nonzero, equal...
    assert [str(e) for e in train if e.site is None] == []
    assert [e.op for e in train if e.site == "step transfer"] == TRANSFER * STEPS
    # Healthy snapshots (rollback rules: after 2 healthy steps, then every 3) copy the state to host memory in one
    # multi-tensor copy (host to host on this CPU run: nothing to wait for, so no event) and the ring holds them.
    assert run.guard.actions.snapshots.steps()
    assert {e.function for e in train if e.site == "state capture"} <= {"copy"}
    # At generation time (once per rollout batch, where TRL itself reads rewards and texts on the host) the
    # run-level sample diagnostics copy the gathered reward vectors to the host (at most two transfers per
    # generation, in the adapter) and read only those host copies afterwards.
    generation = [e for e in events if _phase(e) == "generation"]
    generations = STEPS // 4
    assert {e.file for e in generation} <= {"rl_guard/adapters/trl_samples.py", "rl_guard/diagnostics/samples.py"}, [
        str(e) for e in generation
    ]
    transfers = [
        e for e in generation if e.file.startswith("rl_guard/adapters") and e.op in ("Tensor.cpu", "Tensor.to(cpu)")
    ]
    assert len(transfers) <= 2 * generations, [str(e) for e in generation]


def test_ratio_is_not_one_with_two_iterations(healthy):
    run, _, _ = healthy
    records = run.metrics()
    assert any(r["rl_guard/ratio/max"] > 1.0 for r in records)
    assert any(r["rl_guard/ratio/p50"] != 1.0 for r in records)
    assert any(r["rl_guard/kl_old/k3_mean"] > 1e-6 for r in records)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_ratio_exactly_one_on_policy(grpo_run, tmp_path, monkeypatch, beta):
    """TRL passes the log-probs themselves as the old ones: the ratio reads exactly 1 and the KL to the old policy
    0, with a reference model or without (TRL's default, beta=0); every micro-batch takes the numpy host path."""
    host = []
    real = families.chunk_stats
    monkeypatch.setattr(families, "chunk_stats", lambda *a, **k: host.append(k["ops"] is xp.NUMPY) or real(*a, **k))
    run = grpo_run(
        tmp_path,
        4,
        guard=demo_config("rollback", console_every=None),
        num_iterations=1,
        steps_per_generation=1,
        beta=beta,
    )
    records = run.metrics()
    microbatches = sum(r["rl_guard/tokens/microbatches"] for r in records)
    assert len(records) == 4 and host == [True] * int(microbatches) and microbatches >= 4
    for r in records:
        ratio = {k: v for k, v in r.items() if k.startswith(("rl_guard/ratio/", "rl_guard/seq_ratio/"))}
        assert len(ratio) == 20  # mean, min, max and seven quantiles, per token and per sequence
        assert all(v == 1.0 for v in ratio.values()), ratio
        assert all(r[f"rl_guard/kl_old/k{i}_{red}"] == 0.0 for i in (1, 2, 3) for red in ("mean", "seq_mean"))
        assert r["rl_guard/clip/region_frac"] == 0.0
    assert [i for i in run.incidents() if i["action"] != "warn"] == []
