"""``rl-guard demo``: a real GRPO run on CPU, healthy for a while, then a fault; the guard acts before any NaN.

Everything is built locally (a tiny Llama, a word-level tokenizer, a digit task); nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:  # imports transformers
    from .faults import FaultInjector

PRESET = Path(__file__).resolve().parent.parent / "presets" / "grpo.yaml"


def demo_config(action: str = "rollback", console_every: int | None = 5, preset: Path = PRESET, **sections) -> str:
    """The GRPO preset with its rollback rules set to ``action`` (``rollback`` or ``halt``), plus a console sink
    (none when ``console_every`` is None); ``sections`` replace top-level keys (e.g. ``rollback={...}``)."""
    data = yaml.safe_load(preset.read_text(encoding="utf-8"))
    # The demo samples with the trainer itself (no vLLM), so the sampler-vs-trainer weight never exists.
    data["rules"] = [r for r in data["rules"] if r["name"] != "behaviour_mismatch"]
    if action == "halt":
        for rule in data["rules"]:
            if rule["action"] == "rollback":
                rule["action"] = "checkpoint_and_halt"
    data["sinks"] = ["jsonl"] + ([{"console": {"every": console_every}}] if console_every else [])
    data["snapshots"] = {"healthy_steps": 2, "every": 3, "keep": 2, "where": "memory"}
    # The demo generates every steps_per_generation x num_iterations = 4 steps: a bad update can stay invisible
    # for that long (the next steps train on fresh, on-policy rollouts), so only older snapshots are trusted.
    data["rollback"] = {**data.get("rollback", {}), "confirm_steps": 4}
    data.update(sections)
    return yaml.safe_dump(data, sort_keys=False)


@dataclass
class DemoResult:
    run_dir: Path
    steps: int
    weights_finite: bool
    incidents: list
    trainer: Any  # trl.GRPOTrainer
    injector: FaultInjector


def run_demo(
    fault: str = "lr_blowup",
    action: str = "rollback",
    steps: int = 30,
    fault_step: int = 12,
    run_dir: str | os.PathLike = "runs/demo",
    seed: int = 0,
    guard_yaml: str | None = None,
    quiet: bool = False,
    shadow: bool = False,
    **grpo_overrides,
) -> DemoResult:
    """``shadow``: the guard runs in ``mode: shadow`` (incidents say what it would have done; the run goes on
    exactly as unguarded)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from ..adapters.trl import RLGuardCallback
    from ..sinks.jsonl import read_jsonl
    from .faults import FaultInjector
    from .tiny import build_tiny_model, tiny_trainer

    run_dir = Path(run_dir)
    for name in ("metrics.jsonl", "incidents.jsonl", "quarantine.jsonl"):  # each demo run starts its own record
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "incidents", ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix="rl_guard_demo_"))
    model_path = build_tiny_model(work / "model", seed=seed)
    injector = FaultInjector(fault, at_step=fault_step)
    guard_yaml = guard_yaml or (demo_config(action, mode="shadow") if shadow else demo_config(action))
    guard = RLGuardCallback(guard_yaml, run_dir=str(run_dir))
    settings: dict[str, Any] = {"max_steps": steps, "logging_steps": 5, "disable_tqdm": quiet, **grpo_overrides}
    trainer = tiny_trainer(
        model_path, work / "trainer", injector=injector, callbacks=[guard], prompts=256, seed=seed, **settings
    )
    _quiet_logs(trainer)
    trainer.train()
    finite = all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    incidents_file = run_dir / "incidents.jsonl"
    incidents = read_jsonl(incidents_file) if incidents_file.exists() else []
    return DemoResult(run_dir, trainer.state.global_step, finite, incidents, trainer, injector)


def _quiet_logs(trainer) -> None:
    """Keep the progress bar but not the raw log dicts: the guard's console table is the readable view."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    class QuietProgress(ProgressCallback):
        def on_log(self, *args, **kwargs):
            return None

    for cb in (ProgressCallback, PrinterCallback):
        if trainer.pop_callback(cb) is not None and cb is ProgressCallback:
            trainer.add_callback(QuietProgress)


def main(args) -> int:
    res = run_demo(
        fault=args.fault,
        action=args.action,
        steps=args.steps,
        fault_step=args.fault_step,
        run_dir=args.run_dir,
        seed=args.seed,
        shadow=getattr(args, "shadow", False),
    )
    acted = [i for i in res.incidents if i["action"] != "warn"]
    print("\n" + "=" * 78)
    print(f"fault injected: {args.fault} at step {args.fault_step} (at steps {res.injector.injected_at})")
    if getattr(args, "shadow", False):
        _print_shadow(res.incidents)
    elif acted:
        step = acted[0]["step"]
        print(f"guard acted at step {step}, before that step's update reached the weights:")
        for incident in (i for i in acted if i["step"] == step):
            print(f"  {incident['message']}")
        restored = acted[0].get("restored_to_step")
        if restored is not None:
            print(
                f"  rolled back to the healthy state from before step {restored}, undoing the suspect update(s)"
                f" in between, and continued"
            )
        later = sorted({i["step"] for i in acted if i["step"] != step})
        if later:
            print(f"  (and at steps {later}; see incidents.jsonl)")
    else:
        print("guard took no action" + (" (no fault injected)" if args.fault == "none" else ""))
    print(f"steps run: {res.steps}; every weight finite at the end: {res.weights_finite}")
    cost = guard_cost(res.run_dir)
    if cost:
        print(
            f"the guard's own time: {cost[0]:.1f} ms per step, {100 * cost[1]:.0f}% of the step (median; "
            "rl_guard/guard/host_ms and host_frac in the logs)"
        )
    print(f"run directory: {res.run_dir} (metrics.jsonl, incidents.jsonl, config.yaml, checkpoints/)")
    print(f"render the report: rl-guard report {res.run_dir}")
    return 0 if res.weights_finite else 1


def guard_cost(run_dir: Path) -> tuple[float, float] | None:
    """Median ``guard/host_ms`` and ``guard/host_frac`` of a run directory's metrics.jsonl, or None without them."""
    import statistics

    from ..sinks.jsonl import read_jsonl

    path = Path(run_dir) / "metrics.jsonl"
    rows = [r for r in read_jsonl(path) if "rl_guard/guard/host_ms" in r] if path.exists() else []
    if not rows:
        return None
    return (
        statistics.median(r["rl_guard/guard/host_ms"] for r in rows),
        statistics.median(r["rl_guard/guard/host_frac"] for r in rows),
    )


def _print_shadow(incidents: list) -> None:
    would = [i for i in incidents if i.get("would") not in (None, "warn")]
    print("shadow mode: the guard touched nothing; the run went on exactly as an unguarded one")
    if would:
        print(f"it would have acted first at step {would[0]['step']}:")
        for incident in (i for i in would if i["step"] == would[0]["step"]):
            print(f"  {incident['message']}")
        print(f"  ({len(would)} would-be actions in all, at steps {sorted({i['step'] for i in would})})")
    else:
        print("no rule would have acted")


def add_arguments(ap) -> None:
    from . import FAULTS  # not .faults: that module loads torch, and --help should not

    ap.add_argument("--fault", choices=FAULTS, default="lr_blowup", help="fault to inject")
    ap.add_argument(
        "--action",
        choices=("rollback", "halt"),
        default="rollback",
        help="what the guard does on a precursor: roll back and continue, or checkpoint and halt",
    )
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps to train")
    ap.add_argument("--fault-step", type=int, default=12, help="the step at which the fault is injected")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model, the prompts and the sampling")
    ap.add_argument(
        "--run-dir", default="runs/demo", help="where the guard writes metrics.jsonl, incidents.jsonl and config.yaml"
    )
    ap.add_argument(
        "--shadow",
        action="store_true",
        help="mode: shadow: record what the guard would have done, touch nothing (see incidents.jsonl)",
    )
