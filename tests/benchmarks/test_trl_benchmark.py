"""``benchmarks/trl_overhead.py`` end to end (one lockstep pair of 2-step runs, JSON written), and the lockstep
runner it is built on: the arms' steps never overlap, they alternate, and each arm samples what it would alone."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from file_modules import load_module

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "trl_overhead.py"


@pytest.mark.parametrize("setup", ["demo", "trl-defaults", "trl-short"])
def test_overhead_benchmark_runs_and_writes_json(tmp_path, setup):
    bench = load_module("trl_overhead", BENCH)
    out_file = tmp_path / "overhead.json"
    out = bench.main(["--runs", "1", "--steps", "2", "--setup", setup, "--json", str(out_file)])
    written = json.loads(out_file.read_text())
    assert written == json.loads(json.dumps(out))
    low, high = written["overhead_ratio_range"]
    assert low == high == written["overhead_ratio_total"]  # one pair: its ratio
    assert written["overhead_ratio_ci95"] == [written["overhead_ratio"]] * 2  # one pair: nothing to resample
    total = written["step_s"]["guarded"][0] / written["step_s"]["unguarded"][0]
    assert written["overhead_ratio_total"] == pytest.approx(total)
    assert math.isfinite(written["overhead_ratio"]) and written["overhead_ratio"] > 0
    assert math.isfinite(written["overhead_ratio_cpu"]) and written["overhead_ratio_cpu"] > 0
    for arm in ("guarded", "unguarded"):  # two steps: the mean step is half the arm's time
        assert written["step_ms"][arm] == pytest.approx(1e3 * written["step_s"][arm][0] / 2)
    assert 0 < written["guard_time_frac"] < 1  # the guard did run, and did not take the whole run
    assert written["guard_reported_ms"] > 0  # the guard's own figure, as the run logged it (the second step's cycle)
    assert written["runs"] == 1 and written["steps"] == 2 and written["guard_acted"] == 0
    assert written["same_rollouts"] is True  # the guard changed nothing: both arms sampled the same rollouts
    assert written["setup"] == setup and written["method"] == "lockstep"
    assert written["pinned_cpu"] == min(os.sched_getaffinity(0))  # one torch thread: both arms on one CPU
    parts = written["guard_ms_per_step"]
    if setup != "demo":  # TRL generates every step: the sample diagnostics run every step
        assert parts["diagnostics"] > 0
    # trl-defaults is GRPOConfig's own defaults; the others take the demo's 8-token completions
    assert written["model"]["completion"] == (
        bench._trl_default("max_completion_length") if setup == "trl-defaults" else 8
    )
    assert set(parts) == {*bench.PARTS, "total"} and all(v >= 0 for v in parts.values())
    assert parts["statistics"] > 0 and parts["grad_probe"] > 0 and parts["rules"] > 0 and parts["sinks"] > 0
    assert parts["total"] == sum(parts[p] for p in bench.PARTS)
    # The parts account for the guard's whole time: total per step x steps = the measured time inside the guard.
    assert abs(parts["total"] * 2 / 1e3 - written["guard_time_frac"] * written["step_s"]["guarded"][0]) < 1e-6


def test_default_run_measures_trl_defaults_first_and_the_demo_beside_it(tmp_path):
    import torch

    bench = load_module("trl_overhead", BENCH)
    threads_before = torch.get_num_threads()
    out_file = tmp_path / "overhead.json"
    out = bench.main(["--runs", "1", "--steps", "2", "--json", str(out_file)])
    assert json.loads(out_file.read_text()) == json.loads(json.dumps(out))
    # the top-level figures (the target's) are TRL's defaults with the shipped preset, as a user runs them
    assert out["setup"] == "trl-defaults" and out["model"]["completion"] == bench._trl_default("max_completion_length")
    assert list(out["other_setups"]) == ["demo"]  # the short rollouts' figures travel with them, never alone
    demo = out["other_setups"]["demo"]
    assert demo["setup"] == "demo" and demo["model"]["completion"] == 8 and "other_setups" not in demo
    assert demo["guard_acted"] == 0 and demo["same_rollouts"] is True and demo["guard_ms_per_step"]["total"] > 0
    assert all(demo["step_ms"][arm] > 0 for arm in ("unguarded", "guarded"))  # which step is shorter: the benchmark's
    assert torch.get_num_threads() == threads_before  # --threads 1 holds for the run only
    assert "other_setups" not in bench.main(["--runs", "1", "--steps", "1", "--setup", "trl-short"])


@pytest.mark.parametrize("first, pinned", [(0, False), (1, True)])
def test_lockstep_arms_alternate_without_overlap_and_sample_alike(tmp_path, first, pinned):
    bench = load_module("trl_overhead", BENCH)
    from lockstep import Lockstep, shared_cpu

    from rl_guard.demo.tiny import build_tiny_model, prompt_dataset

    model = build_tiny_model(tmp_path / "model", seed=0)
    caller = os.sched_getaffinity(0)
    cpu = shared_cpu() if pinned else None
    lockstep, steps, seen = Lockstep(cpu=cpu), 3, {}
    for arm, turns in enumerate(lockstep.callbacks):  # each arm's CPUs, read in its own thread
        turns.on_train_begin = lambda *a, arm=arm, **k: seen.__setitem__(arm, os.sched_getaffinity(0))
    trainers = [
        bench._trainer(
            model,
            prompt_dataset(64, seed=0),
            steps,
            False,
            tmp_path / f"arm{arm}",
            lockstep.callbacks[arm],
            setup="trl-short",
        )
        for arm in (0, 1)
    ]
    lockstep.run(trainers, seed=0, first=first)
    assert seen == ({0: {cpu}, 1: {cpu}} if pinned else {0: caller, 1: caller})  # pinned: both arms on one CPU
    assert os.sched_getaffinity(0) == caller  # the caller's own CPUs are left as they were
    slices = sorted((span, arm) for arm, turns in enumerate(lockstep.callbacks) for span in turns.spans)
    assert [arm for _, arm in slices] == [first, 1 - first] * steps  # one step each, in turn, first arm first
    assert all(a[0][1] <= b[0][0] for a, b in zip(slices, slices[1:]))  # a slice ends before the next starts
    assert all(len(t.cpu) == steps and all(c >= 0 for c in t.cpu) for t in lockstep.callbacks)
    rewards = [[e["reward"] for e in t.state.log_history if "reward" in e] for t in trainers]
    assert len(rewards[0]) == steps and rewards[0] == rewards[1]  # the same random stream: the same rollouts


def _pair(unguarded: list[float], guarded: list[float]) -> dict:
    return {"arms": [{"wall": unguarded}, {"wall": guarded}]}


def test_the_interval_resamples_pairs_and_is_reproducible():
    bench = load_module("trl_overhead", BENCH)
    # Three pairs of two steps whose per-step ratios are 1.0, 1.1 and 1.3 in every step.
    pairs = [_pair([10.0, 20.0], [10.0 * r, 20.0 * r]) for r in (1.0, 1.1, 1.3)]
    assert bench._per_step(pairs, "wall") == pytest.approx(1.1)
    # A resample's median is 1.0 or 1.3 with probability 7/27 each (two or three draws of that pair), else 1.1: the
    # 95 % interval spans the pairs' whole range, while the middle 20 % of the resamples all read 1.1.
    low, high = bench._per_step_interval(pairs, "wall")
    assert low == pytest.approx(1.0) and high == pytest.approx(1.3)
    assert bench._per_step_interval(pairs, "wall") == [low, high]  # seeded: the same run gives the same interval
    assert bench._per_step_interval(pairs, "wall", level=0.2) == [pytest.approx(1.1)] * 2
    same = [_pair([10.0, 20.0], [11.0, 22.0])] * 4  # identical pairs: no spread to resample
    assert bench._per_step_interval(same, "wall") == [pytest.approx(1.1)] * 2


def test_control_pairs_run_both_arms_unguarded(tmp_path):
    bench = load_module("trl_overhead", BENCH)
    from rl_guard.demo.tiny import build_tiny_model, prompt_dataset

    work = tmp_path / "aa"  # an A/A pair: the guard runs in neither arm
    pair = bench._one_pair(
        build_tiny_model(tmp_path / "model", seed=0),
        prompt_dataset(64, seed=0),
        2,
        work,
        first=0,
        control=True,
        setup="trl-short",
    )
    assert pair["guard"] == 0 and not (work / "arm1" / "guard").exists() and pair["same_rollouts"] is True
    assert pair["ratio"] == pytest.approx(sum(pair["arms"][1]["wall"]) / sum(pair["arms"][0]["wall"]))

    out = bench.main(["--runs", "1", "--steps", "2", "--setup", "trl-short", "--control"])
    control = out["control"]
    assert set(control) == {"ratio", "ratio_ci95", "ratio_cpu", "ratio_total", "ratio_range", "same_rollouts"}
    assert control["ratio_ci95"] == [control["ratio"]] * 2
    assert control["same_rollouts"] is True
    assert all(math.isfinite(control[k]) and control[k] > 0 for k in ("ratio", "ratio_cpu", "ratio_total"))
    assert control["ratio_range"] == [control["ratio_total"]] * 2  # one pair: its ratio
    assert "control" not in bench.main(["--runs", "1", "--steps", "1", "--setup", "trl-short"])


def test_floor_pairs_run_the_least_guard_in_the_second_arm(tmp_path):
    bench = load_module("trl_overhead", BENCH)
    from rl_guard.demo.tiny import build_tiny_model, prompt_dataset

    work = tmp_path / "floor"
    pair = bench._one_pair(
        build_tiny_model(tmp_path / "model", seed=0),
        prompt_dataset(64, seed=0),
        3,
        work,
        first=1,
        floor=True,
        setup="trl-short",
    )
    assert pair["floor_reads"] == 3  # one gradient check per optimizer step, in the second arm only
    assert pair["guard"] == 0 and not (work / "arm1" / "guard").exists() and pair["same_rollouts"] is True

    out = bench.main(["--runs", "1", "--steps", "2", "--setup", "trl-short", "--floor"])
    floor = out["floor"]
    assert set(floor) == {"ratio", "ratio_ci95", "ratio_cpu", "ratio_total", "ratio_range", "same_rollouts"}
    assert floor["same_rollouts"] is True and floor["ratio_range"] == [floor["ratio_total"]] * 2
    assert "floor" not in bench.main(["--runs", "1", "--steps", "1", "--setup", "trl-short"])


def test_the_floor_guard_stops_the_run_on_a_non_finite_gradient():
    import torch
    from transformers import TrainerControl

    bench = load_module("trl_overhead", BENCH)
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    floor, control = bench.floor_guard(), TrainerControl()
    floor.on_pre_optimizer_step(None, None, control, model=model)
    assert not control.should_training_stop and floor.reads == 1
    model.weight.grad[0, 0] = float("nan")
    floor.on_pre_optimizer_step(None, None, control, model=model)
    assert control.should_training_stop and floor.reads == 2


def test_sequential_pairs_run_one_whole_arm_after_the_other_in_this_thread(tmp_path):
    import threading

    import torch

    bench = load_module("trl_overhead", BENCH)
    from lockstep import Sequential

    from rl_guard.demo.tiny import build_tiny_model, prompt_dataset

    model, runner, steps = build_tiny_model(tmp_path / "model", seed=0), Sequential(), 3
    threads = []
    runner.callbacks[1].on_train_begin = lambda *a, **k: threads.append(threading.current_thread())
    trainers = [
        bench._trainer(
            model,
            prompt_dataset(64, seed=0),
            steps,
            arm == 1,
            tmp_path / f"arm{arm}",
            runner.callbacks[arm],
            setup="trl-short",
        )
        for arm in (0, 1)
    ]
    runner.run(trainers, seed=0, first=1)
    assert threads == [threading.current_thread()]  # the guarded arm trained in the caller's thread
    spans = [turns.spans for turns in runner.callbacks]
    assert [len(s) for s in spans] == [steps, steps] and spans[1][-1][1] <= spans[0][0][0]  # arm 1 whole, then 0
    rewards = [[e["reward"] for e in t.state.log_history if "reward" in e] for t in trainers]
    assert len(rewards[0]) == steps and rewards[0] == rewards[1]  # each run from the seed: the same rollouts

    threads_before = torch.get_num_threads()
    out = bench.main(["--runs", "1", "--steps", "2", "--setup", "trl-short", "--sequential", "--threads", "0"])
    assert out["method"] == "sequential" and out["threads"] == threads_before == torch.get_num_threads()
    assert out["pinned_cpu"] is None  # a whole run in the caller's thread: nothing pinned
    assert out["same_rollouts"] is True and out["guard_acted"] == 0 and out["guard_ms_per_step"]["total"] > 0
