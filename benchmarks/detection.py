"""Detection benchmark: real tiny TRL GRPO runs guarded by the unmodified shipped ``grpo.yaml``.

    python benchmarks/detection.py [--quick] [--json [FILE]]

Configurations: TRL's defaults (beta=0, num_iterations=1, steps_per_generation=1, max_grad_norm=1.0, loss dapo);
beta=0.04; num_iterations=2 + steps_per_generation=2; GSPO (importance_sampling_level="sequence");
gradient_accumulation_steps=2. Faults (``rl_guard/demo/faults.py``): LR x1e4 once, LR x3 per step, one inf
gradient, NaN rewards from step K on, reward scale x1e6 from K on, Gaussian weight noise between generation and
training. Each fault run (3 seeds) sits beside an unguarded twin (same seed, same fault); healthy runs (5 seeds,
80 steps) count false actions. Steps are the trainer's global_step (1-based: the step that ends with
global_step = n is step n); the fault is injected in step ``K + 1``.

Reported per run: detected (the guard took an action: anything but warn), the first action, steps from the
fault to that action, lead = the twin's first non-finite step minus the action step, weights finite at the end.
JSON: ``recall`` (detected fault runs / fault runs), ``max_action_delay_abrupt`` (every fault but the ramp),
``min_lead_gradual`` (the ramp; the twin's last step + 1 when it stayed finite), ``false_actions_healthy``,
``runs`` (every run's row). ``--quick``: TRL defaults x {LR x1e4, LR x3, NaN rewards}, one seed, one short
healthy run (the CI subset, ``tests/benchmarks/test_detection_benchmark.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_output import add_json_argument, emit_json

PRESET = Path(__file__).resolve().parents[1] / "rl_guard" / "presets" / "grpo.yaml"
CONFIGS = {
    "trl_defaults": {},
    "beta_0.04": {"beta": 0.04},
    "iter2_spg2": {"num_iterations": 2, "steps_per_generation": 2},
    "gspo": {"importance_sampling_level": "sequence"},
    "grad_accum2": {"gradient_accumulation_steps": 2},
}
# name -> (FaultInjector fault, factor, 0-based injection step K, run length, gradual)
ABRUPT_AT, RAMP_AT = 12, 3
FAULTS = {
    "lr_x1e4": ("lr_blowup", 1e4, ABRUPT_AT, 24, False),
    "lr_x3_per_step": ("lr_ramp", 3.0, RAMP_AT, 40, True),
    "inf_grad": ("inf_grad", None, ABRUPT_AT, 24, False),
    "nan_rewards": ("nan_rewards", None, ABRUPT_AT, 24, False),
    "reward_x1e6": ("reward_scale", 1e6, ABRUPT_AT, 24, False),
    "weight_noise": ("weight_noise", 1.0, ABRUPT_AT, 24, False),
}
QUICK_FAULTS = ("lr_x1e4", "lr_x3_per_step", "nan_rewards")
# TRL's defaults except what a CPU run needs: a tiny batch, short completions, and a learning rate that moves a
# tiny model (TRL's 1e-6 would leave it untouched for hundreds of steps).
BASE = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, use_cpu=True, bf16=False,
            report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, learning_rate=3e-3)


def _finite_recorder():
    import torch
    from transformers import TrainerCallback

    class FirstNonFinite(TrainerCallback):
        """The first 1-based step whose applied gradient or resulting weights hold a NaN/inf; stops a twin there."""

        def __init__(self, stop: bool):
            self.stop, self.step = stop, None

        def _flag(self, step, control):
            self.step = step if self.step is None else self.step
            if self.stop:
                control.should_training_stop = True

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if grads and not bool(torch.isfinite(torch.stack(torch._foreach_norm(grads, 2.0))).all()):
                self._flag(state.global_step + 1, control)

        def on_step_end(self, args, state, control, model=None, **kw):
            if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
                self._flag(state.global_step, control)

    return FirstNonFinite


def run_once(model_path, config: str, fault: str, seed: int, steps: int, guarded: bool, work: Path) -> dict:
    """One real GRPO run; returns the first action (guarded), the first non-finite step and final finiteness."""
    import torch
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_guard.adapters.trl import RLGuardCallback
    from rl_guard.demo.faults import FaultInjector
    from rl_guard.demo.tiny import length_penalty_reward, prompt_dataset, repeat_last_digit_reward
    from rl_guard.sinks.jsonl import read_jsonl

    kind, factor, at, _, _ = FAULTS[fault] if fault != "healthy" else ("none", None, 0, steps, False)
    injector = FaultInjector(kind, at_step=at, factor=factor)
    recorder = _finite_recorder()(stop=not guarded)
    run_dir = work / f"{config}-{fault}-{seed}-{'guarded' if guarded else 'twin'}"
    guard = RLGuardCallback(str(PRESET), run_dir=str(run_dir / "guard")) if guarded else None
    args = GRPOConfig(output_dir=str(run_dir / "trainer"), max_steps=steps, seed=seed, **{**BASE, **CONFIGS[config]})
    torch.manual_seed(seed)
    trainer = GRPOTrainer(model=str(model_path), args=args, train_dataset=prompt_dataset(256, seed=seed),
                          reward_funcs=[injector.faulty_reward(repeat_last_digit_reward), length_penalty_reward],
                          callbacks=[injector] + ([guard] if guard else []) + [recorder])
    trainer.pop_callback(PrinterCallback)
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    row = {"config": config, "fault": fault, "seed": seed, "guarded": guarded, "steps_run": trainer.state.global_step,
           "fault_step": at + 1 if fault != "healthy" else None, "first_nonfinite": recorder.step,
           "weights_finite": all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters()),
           "wall_s": round(time.perf_counter() - started, 2)}
    if guarded:
        path = run_dir / "guard" / "incidents.jsonl"
        incidents = read_jsonl(path) if path.exists() else []
        acted = [i for i in incidents if i["action"] != "warn"]
        row["actions"] = [(i["step"], i["rule"], i["action"]) for i in acted]
        row["warnings"] = sum(i["action"] == "warn" for i in incidents)
        first = acted[0] if acted else None
        row["action_step"] = first["step"] if first else None
        row["action"] = f"{first['rule']} -> {first['action']}" if first else None
        row["final_action"] = acted[-1]["action"] if acted else None
    return row


def evaluate(pairs: list[tuple[dict, dict]], healthy: list[dict]) -> dict:
    rows, delays, leads, detected = [], [], [], 0
    for guarded, twin in pairs:
        gradual = FAULTS[guarded["fault"]][4]
        hit = guarded["action_step"] is not None and guarded["action_step"] >= guarded["fault_step"]
        detected += hit
        delay = guarded["action_step"] - guarded["fault_step"] if hit else None
        twin_bad = twin["first_nonfinite"] if twin["first_nonfinite"] is not None else twin["steps_run"] + 1
        lead = twin_bad - guarded["action_step"] if hit else None
        (leads if gradual else delays).append(lead if gradual else delay)
        rows.append({**guarded, "detected": hit, "delay": delay, "twin_first_nonfinite": twin["first_nonfinite"],
                     "lead": lead, "gradual": gradual})
    false_actions = sum(len(h["actions"]) for h in healthy)
    return {
        "recall": detected / len(pairs) if pairs else math.nan,
        "max_action_delay_abrupt": max((d if d is not None else math.inf) for d in delays) if delays else None,
        "min_lead_gradual": min((x if x is not None else -math.inf) for x in leads) if leads else None,
        "false_actions_healthy": false_actions,
        "healthy_warnings": sum(h["warnings"] for h in healthy),
        "runs": rows + [{**h, "detected": None} for h in healthy],
    }


def table(result: dict) -> str:
    out = []
    by_config: dict[str, list] = {}
    for r in result["runs"]:
        by_config.setdefault(r["config"], []).append(r)
    for config, rows in by_config.items():
        out += [f"\n### {config}", "", "| fault | seed | detected | action | fault -> action (steps) | lead over twin "
                "| twin first non-finite | weights finite |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["fault"] == "healthy":
                acts = ", ".join(f"{s}:{rule}->{a}" for s, rule, a in r["actions"]) or "none"
                out.append(f"| healthy ({r['steps_run']} steps) | {r['seed']} | actions: {acts} | "
                           f"{r['warnings']} warnings | | | | {r['weights_finite']} |")
                continue
            lead = r["lead"] if r["gradual"] else ""
            out.append(f"| {r['fault']} | {r['seed']} | {'yes' if r['detected'] else 'NO'} | {r['action']} | "
                       f"{r['delay']} | {lead} | {r['twin_first_nonfinite']} | {r['weights_finite']} |")
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="TRL defaults x LR/NaN faults, one seed (the CI subset)")
    add_json_argument(ap)
    ap.add_argument("--seeds", type=int, default=None, help="fault-run seeds (default 3; quick 1)")
    ap.add_argument("--healthy-seeds", type=int, default=None, help="healthy-run seeds (default 5; quick 1)")
    ap.add_argument("--healthy-steps", type=int, default=None, help="healthy-run length (default 80; quick 30)")
    ap.add_argument("--configs", nargs="*", default=None, choices=list(CONFIGS))
    ap.add_argument("--faults", nargs="*", default=None, choices=list(FAULTS))
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from rl_guard.demo.tiny import build_tiny_model

    configs = a.configs or (["trl_defaults"] if a.quick else list(CONFIGS))
    faults = a.faults or (list(QUICK_FAULTS) if a.quick else list(FAULTS))
    seeds = range(a.seeds or (1 if a.quick else 3))
    healthy_seeds = range(a.healthy_seeds or (1 if a.quick else 5))
    healthy_steps = a.healthy_steps or (30 if a.quick else 80)
    work = Path(tempfile.mkdtemp(prefix="rl_guard_detection_"))
    model = build_tiny_model(work / "model", seed=0, hidden=16, layers=1)
    pairs, healthy = [], []
    for config in configs:
        for fault in faults:
            steps = FAULTS[fault][3]
            for seed in seeds:
                g = run_once(model, config, fault, seed, steps, True, work)
                t = run_once(model, config, fault, seed, steps, False, work)
                pairs.append((g, t))
                print(f"{config:>12} {fault:>15} seed {seed}: action {g['action']} at {g['action_step']} "
                      f"(fault {g['fault_step']}); twin non-finite at {t['first_nonfinite']}", file=sys.stderr)
        for seed in healthy_seeds:
            h = run_once(model, config, "healthy", seed, healthy_steps, True, work)
            healthy.append(h)
            print(f"{config:>12} {'healthy':>15} seed {seed}: actions {h['actions']}, {h['warnings']} warnings",
                  file=sys.stderr)
    result = evaluate(pairs, healthy)
    print(table(result))
    summary = {k: result[k] for k in ("recall", "max_action_delay_abrupt", "min_lead_gradual",
                                      "false_actions_healthy", "healthy_warnings")}
    print(json.dumps(summary))
    emit_json(a.json, result, indent=1)
    return result


if __name__ == "__main__":
    main()
