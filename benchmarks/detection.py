"""Detection benchmark: real tiny TRL GRPO runs guarded by the unmodified shipped ``grpo.yaml``.

    python benchmarks/detection.py [--quick] [--json [FILE]]

Configurations: TRL's defaults (beta=0, num_iterations=1, steps_per_generation=1, max_grad_norm=1.0, loss dapo);
beta=0.04; num_iterations=2 + steps_per_generation=2; GSPO (importance_sampling_level="sequence");
gradient_accumulation_steps=2. Faults (``FAULTS``): the first six from ``rl_guard/demo/faults.py`` at step K=12
(LR x1e4 once, LR x3 per step, one inf gradient, NaN rewards from K on, reward scale x1e6 from K on, Gaussian
weight noise between generation and training), run in every configuration; then, in TRL's defaults, faults that
strike before any history (LR x1e4 in step 2, an inf gradient in step 1, Adam's second moments wiped before step
3), a linear learning-rate warm-up to a harmful peak (100x the runs' rate, reached over 20 steps: never more
than 4x over 3 steps), one element of a large weight tensor (8192 elements, on a wider model whose tensors are not
all sampled whole) set to 1e30 or sign-flipped between two steps at a random position, and Adam's second moments
wiped at K. Each fault run (3 seeds) sits beside an unguarded twin (same seed, same fault). Healthy runs (5 seeds,
100 steps) count false actions, in every configuration and in variants that learn fast or differently: 3x the
learning rate, loss_type dr_grpo and bnpo with beta=0.04 and num_iterations=2, and the wider model. Steps are the
trainer's global_step (1-based: the step that ends with global_step = n is step n); the fault is injected in step
``K + 1``.

Reported per run: detected (the guard took an action: anything but warn, at or after the fault), the first
action, steps from the fault to that action, the twin's failure and the lead over it: the twin's first non-finite
step, or, where it stays finite, its policy's collapse (the first step from which the policy's mean token entropy
stays below ``COLLAPSE_ENTROPY``, or every gradient stays 0, to the end), else none. JSON: ``recall`` (detected
fault runs / fault runs),
``max_action_delay_abrupt`` (every fault but the gradual ones), ``min_lead_gradual`` (the LR ramp and the warm-up;
the twin's last step + 1 when it never failed), ``false_actions_healthy``, ``healthy_runs``, ``by_fault`` (per fault
class: runs, detected, worst delay, smallest lead, the twins' failures), ``runs`` (every run's row). ``--quick``:
TRL defaults x {LR x1e4, LR x3, NaN rewards}, one seed, one short healthy run (the CI subset,
``tests/benchmarks/test_detection_benchmark.py``).
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
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_output import add_json_argument, emit_json

from rl_guard.demo.tiny import TINY_GRPO

PRESET = Path(__file__).resolve().parents[1] / "rl_guard" / "presets" / "grpo.yaml"
CONFIGS = {
    "trl_defaults": {},
    "beta_0.04": {"beta": 0.04},
    "iter2_spg2": {"num_iterations": 2, "steps_per_generation": 2},
    "gspo": {"importance_sampling_level": "sequence"},
    "grad_accum2": {"gradient_accumulation_steps": 2},
}
# Healthy-only variants: runs that learn faster or with other losses must see no action either.
HEALTHY_VARIANTS = {
    "lr_x3": {"learning_rate": 9e-3},
    "dr_grpo_beta_iter2": {"loss_type": "dr_grpo", "beta": 0.04, "num_iterations": 2},
    "bnpo_beta_iter2": {"loss_type": "bnpo", "beta": 0.04, "num_iterations": 2},
    "wide_model": {},  # trl_defaults on MODELS["wide"]
}
# tiny: the model of every run; wide: tensors of up to 8192 elements, above the update probe's whole-tensor limit
# (4096), for the faults that hit one element a strided sample skips
MODELS = {"tiny": {"hidden": 16, "layers": 1}, "wide": {"hidden": 64, "layers": 1}}


class Fault(NamedTuple):
    kind: str  # a FaultInjector fault, or one of BENCH_KINDS
    factor: float | None
    at: int  # 0-based injection step K: the fault is in step K + 1
    steps: int  # run length
    gradual: bool
    configs: tuple = tuple(CONFIGS)  # where it runs
    args: tuple = ()  # GRPOConfig settings the fault is made of (a warm-up schedule), as (key, value) pairs
    model: str = "tiny"


ABRUPT_AT, RAMP_AT = 12, 3
EARLY = ("trl_defaults",)
FAULTS = {
    "lr_x1e4": Fault("lr_blowup", 1e4, ABRUPT_AT, 24, False),
    "lr_x3_per_step": Fault("lr_ramp", 3.0, RAMP_AT, 40, True),
    "inf_grad": Fault("inf_grad", None, ABRUPT_AT, 24, False),
    "nan_rewards": Fault("nan_rewards", None, ABRUPT_AT, 24, False),
    "reward_x1e6": Fault("reward_scale", 1e6, ABRUPT_AT, 24, False),
    "weight_noise": Fault("weight_noise", 1.0, ABRUPT_AT, 24, False),
    # before any history: the spike rules cannot have armed
    "early_lr_x1e4": Fault("lr_blowup", 1e4, 1, 16, False, EARLY),
    "early_inf_grad": Fault("inf_grad", None, 0, 16, False, EARLY),
    "early_adam_v_wiped": Fault("adam_v", 1e-8, 2, 16, False, EARLY),
    # a linear warm-up from 0 to 100x the runs' rate over 20 steps, the schedule a user set (from step 1)
    "warmup_to_100x": Fault(
        "schedule",
        None,
        0,
        30,
        True,
        EARLY,
        (("learning_rate", 0.3), ("warmup_steps", 20), ("lr_scheduler_type", "constant_with_warmup")),
    ),
    "element_1e30": Fault("element", 1e30, ABRUPT_AT, 24, False, EARLY, model="wide"),
    "element_sign_flip": Fault("element_sign", None, ABRUPT_AT, 24, False, EARLY, model="wide"),
    "adam_v_wiped": Fault("adam_v", 1e-8, ABRUPT_AT, 24, False, EARLY),
}
BENCH_KINDS = ("schedule", "element", "element_sign", "adam_v")
QUICK_FAULTS = ("lr_x1e4", "lr_x3_per_step", "nan_rewards")
COLLAPSE_ENTROPY = 0.05  # nats per token: a policy this sure of every token (ln 14 = 2.6 at uniform) has collapsed
# TRL's defaults except what a CPU run needs: a tiny batch, short completions, and a learning rate that moves a
# tiny model (TRL's 1e-6 would leave it untouched for hundreds of steps).
BASE = dict(
    **TINY_GRPO,
    report_to=[],
    save_strategy="no",
    logging_steps=1,
    disable_tqdm=True,
    learning_rate=3e-3,
)


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


def _bench_faults(fault: Fault, seed: int):
    """The faults ``FaultInjector`` does not make, between two steps (at the start of step K + 1): one element of a
    large weight tensor (over 4096 elements), at a position drawn from the seed, set to ``factor`` or its sign
    flipped; or Adam's second moments multiplied by ``factor`` (a corrupted optimizer state)."""
    import random

    import torch
    from transformers import TrainerCallback

    class BenchFaults(TrainerCallback):
        def __init__(self):
            self.injected_at: list[int] = []

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step != fault.at or fault.kind not in ("element", "element_sign", "adam_v"):
                return
            with torch.no_grad():
                if fault.kind == "adam_v":
                    for st in getattr(optimizer, "optimizer", optimizer).state.values():
                        st["exp_avg_sq"].mul_(fault.factor)
                else:
                    rng = random.Random(1000 + seed)
                    p = rng.choice([p for p in model.parameters() if p.numel() > 4096])
                    flat, i = p.data.view(-1), rng.randrange(p.numel())
                    flat[i] = fault.factor if fault.kind == "element" else -flat[i]
            self.injected_at.append(state.global_step)

    return BenchFaults()


def _stays(log_history: list[dict], key: str, test) -> int | None:
    """The first logged step from which ``test(value of key)`` holds to the end of the run; None if none."""
    first = None
    for e in log_history:
        if key in e and "step" in e:
            ok = math.isfinite(e[key]) and test(e[key])
            first = (e["step"] if first is None else first) if ok else None
    return first


def _collapse(log_history: list[dict]) -> tuple[int | None, str]:
    """The policy's collapse: the first step from which its mean token entropy (TRL's ``entropy``) stays below
    ``COLLAPSE_ENTROPY``, or from which every gradient stays exactly 0 (TRL's ``grad_norm``: a model that can no
    longer learn, e.g. hidden states zeroed by an overflowing norm), to the end of the run."""
    low = _stays(log_history, "entropy", lambda x: x < COLLAPSE_ENTROPY)
    dead = _stays(log_history, "grad_norm", lambda x: x == 0.0)
    found = [(s, kind) for s, kind in ((low, "collapse (entropy)"), (dead, "collapse (zero gradient)")) if s]
    return min(found) if found else (None, "")


def run_once(model_paths: dict, config: str, fault: str, seed: int, steps: int, guarded: bool, work: Path) -> dict:
    """One real GRPO run; returns the first action (guarded), the first non-finite step, the policy's collapse
    and final finiteness."""
    import torch
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_guard.adapters.trl import RLGuardCallback
    from rl_guard.demo.faults import FaultInjector
    from rl_guard.demo.tiny import length_penalty_reward, prompt_dataset, repeat_last_digit_reward
    from rl_guard.sinks.jsonl import read_jsonl

    spec = (
        FAULTS[fault]
        if fault != "healthy"
        else Fault("none", None, 0, steps, False, model="wide" if config == "wide_model" else "tiny")
    )
    injector = FaultInjector(spec.kind if spec.kind not in BENCH_KINDS else "none", at_step=spec.at, factor=spec.factor)
    recorder = _finite_recorder()(stop=not guarded)
    run_dir = work / f"{config}-{fault}-{seed}-{'guarded' if guarded else 'twin'}"
    guard = RLGuardCallback(str(PRESET), run_dir=str(run_dir / "guard")) if guarded else None
    settings = {**BASE, **(CONFIGS[config] if config in CONFIGS else HEALTHY_VARIANTS[config]), **dict(spec.args)}
    args = GRPOConfig(output_dir=str(run_dir / "trainer"), max_steps=steps, seed=seed, **settings)
    torch.manual_seed(seed)
    trainer = GRPOTrainer(
        model=str(model_paths[spec.model]),
        args=args,
        train_dataset=prompt_dataset(256, seed=seed),
        reward_funcs=[injector.faulty_reward(repeat_last_digit_reward), length_penalty_reward],
        callbacks=[injector, _bench_faults(spec, seed)] + ([guard] if guard else []) + [recorder],
    )
    trainer.pop_callback(PrinterCallback)
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    row = {
        "config": config,
        "fault": fault,
        "seed": seed,
        "guarded": guarded,
        "steps_run": trainer.state.global_step,
        "fault_step": spec.at + 1 if fault != "healthy" else None,
        "first_nonfinite": recorder.step,
        "collapse": _collapse(trainer.state.log_history),
        "weights_finite": all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters()),
        "wall_s": round(time.perf_counter() - started, 2),
    }
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


def twin_failure(twin: dict) -> tuple[int | None, str]:
    """The twin's failure: its first non-finite step, else its policy's collapse, else none."""
    if twin["first_nonfinite"] is not None:
        return twin["first_nonfinite"], "non-finite"
    if twin["collapse"][0] is not None:
        return twin["collapse"][0], twin["collapse"][1]
    return None, "none"


def evaluate(pairs: list[tuple[dict, dict]], healthy: list[dict]) -> dict:
    rows, delays, leads, detected = [], [], [], 0
    for guarded, twin in pairs:
        gradual = FAULTS[guarded["fault"]].gradual
        hit = guarded["action_step"] is not None and guarded["action_step"] >= guarded["fault_step"]
        detected += hit
        delay = guarded["action_step"] - guarded["fault_step"] if hit else None
        failed_at, failure = twin_failure(twin)
        lead = failed_at - guarded["action_step"] if hit and failed_at is not None else None
        if gradual:  # a twin that never failed counts its last step + 1
            leads.append(
                None
                if not hit
                else (failed_at if failed_at is not None else twin["steps_run"] + 1) - guarded["action_step"]
            )
        else:
            delays.append(delay)
        rows.append(
            {
                **guarded,
                "detected": hit,
                "delay": delay,
                "twin_first_nonfinite": twin["first_nonfinite"],
                "twin_collapse": twin["collapse"],
                "twin_failure": failure,
                "twin_failed_at": failed_at,
                "lead": lead,
                "gradual": gradual,
            }
        )
    false_actions = sum(len(h["actions"]) for h in healthy)
    by_fault: dict[str, dict] = {}
    for r in rows:
        f = by_fault.setdefault(
            r["fault"],
            {"runs": 0, "detected": 0, "max_delay": None, "min_lead": None, "twin_failures": [], "first_actions": []},
        )
        f["runs"] += 1
        f["detected"] += r["detected"]
        if r["delay"] is not None:
            f["max_delay"] = max(r["delay"], f["max_delay"] if f["max_delay"] is not None else r["delay"])
        if r["lead"] is not None:
            f["min_lead"] = min(r["lead"], f["min_lead"] if f["min_lead"] is not None else r["lead"])
        at = f" at {r['twin_failed_at']}" if r["twin_failed_at"] is not None else ""
        f["twin_failures"].append(r["twin_failure"] + at)
        f["first_actions"].append(r["action"])
    return {
        "recall": detected / len(pairs) if pairs else math.nan,
        "max_action_delay_abrupt": max((d if d is not None else math.inf) for d in delays) if delays else None,
        "min_lead_gradual": min((x if x is not None else -math.inf) for x in leads) if leads else None,
        "false_actions_healthy": false_actions,
        "healthy_runs": len(healthy),
        "healthy_steps": sum(h["steps_run"] for h in healthy),
        "healthy_warnings": sum(h["warnings"] for h in healthy),
        "by_fault": by_fault,
        "runs": rows + [{**h, "detected": None} for h in healthy],
    }


def table(result: dict) -> str:
    out = [
        "| fault class | runs | detected | fault -> action (worst) | lead (smallest) | twins' failure | "
        "first actions |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, f in result["by_fault"].items():
        actions = ", ".join(sorted({a for a in f["first_actions"] if a}))
        out.append(
            f"| {name} | {f['runs']} | {f['detected']} | {f['max_delay']} | {f['min_lead']} | "
            f"{', '.join(f['twin_failures'])} | {actions} |"
        )
    by_config: dict[str, list] = {}
    for r in result["runs"]:
        by_config.setdefault(r["config"], []).append(r)
    for config, rows in by_config.items():
        out += [
            f"\n### {config}",
            "",
            "| fault | seed | detected | action | fault -> action (steps) | lead over twin "
            "| twin's failure | weights finite |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r["fault"] == "healthy":
                acts = ", ".join(f"{s}:{rule}->{a}" for s, rule, a in r["actions"]) or "none"
                out.append(
                    f"| healthy ({r['steps_run']} steps) | {r['seed']} | actions: {acts} | "
                    f"{r['warnings']} warnings | | | | {r['weights_finite']} |"
                )
                continue
            failure = r["twin_failure"] + (f" at {r['twin_failed_at']}" if r["twin_failed_at"] is not None else "")
            out.append(
                f"| {r['fault']} | {r['seed']} | {'yes' if r['detected'] else 'NO'} | {r['action']} | "
                f"{r['delay']} | {r['lead']} | {failure} | {r['weights_finite']} |"
            )
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="TRL defaults x LR/NaN faults, one seed (the CI subset)")
    add_json_argument(ap)
    ap.add_argument("--seeds", type=int, default=None, help="fault-run seeds (default 3; quick 1)")
    ap.add_argument("--healthy-seeds", type=int, default=None, help="healthy-run seeds (default 5; quick 1)")
    ap.add_argument("--healthy-steps", type=int, default=None, help="healthy-run length (default 100; quick 30)")
    ap.add_argument("--configs", nargs="*", default=None, choices=list(CONFIGS))
    ap.add_argument("--faults", nargs="*", default=None, choices=list(FAULTS))
    ap.add_argument(
        "--variants",
        nargs="*",
        default=None,
        choices=list(HEALTHY_VARIANTS),
        help="healthy-only variants (default all; quick none)",
    )
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from rl_guard.demo.tiny import build_tiny_model

    configs = a.configs if a.configs is not None else (["trl_defaults"] if a.quick else list(CONFIGS))
    faults = a.faults if a.faults is not None else (list(QUICK_FAULTS) if a.quick else list(FAULTS))
    variants = a.variants if a.variants is not None else ([] if a.quick else list(HEALTHY_VARIANTS))
    seeds = range(a.seeds or (1 if a.quick else 3))
    healthy_seeds = range(a.healthy_seeds if a.healthy_seeds is not None else (1 if a.quick else 5))
    healthy_steps = a.healthy_steps or (30 if a.quick else 100)
    work = Path(tempfile.mkdtemp(prefix="rl_guard_detection_"))
    models = {name: build_tiny_model(work / f"model_{name}", seed=0, **dims) for name, dims in MODELS.items()}
    pairs, healthy = [], []
    for config in configs + variants:
        for fault in faults if config in CONFIGS else []:
            spec = FAULTS[fault]
            if config not in spec.configs:
                continue
            for seed in seeds:
                g = run_once(models, config, fault, seed, spec.steps, True, work)
                t = run_once(models, config, fault, seed, spec.steps, False, work)
                pairs.append((g, t))
                failed_at, failure = twin_failure(t)
                print(
                    f"{config:>12} {fault:>18} seed {seed}: action {g['action']} at {g['action_step']} "
                    f"(fault {g['fault_step']}); twin: {failure} at {failed_at}",
                    file=sys.stderr,
                )
        for seed in healthy_seeds:
            h = run_once(models, config, "healthy", seed, healthy_steps, True, work)
            healthy.append(h)
            print(
                f"{config:>12} {'healthy':>18} seed {seed}: actions {h['actions']}, {h['warnings']} warnings",
                file=sys.stderr,
            )
    result = evaluate(pairs, healthy)
    print(table(result))
    summary = {
        k: result[k]
        for k in (
            "recall",
            "max_action_delay_abrupt",
            "min_lead_gradual",
            "false_actions_healthy",
            "healthy_runs",
            "healthy_steps",
            "healthy_warnings",
        )
    }
    print(json.dumps(summary))
    emit_json(a.json, result, indent=1)
    return result


if __name__ == "__main__":
    main()
