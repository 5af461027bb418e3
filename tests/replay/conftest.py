"""Real recorded runs for the replay tests: guarded demo runs (metrics.jsonl, incidents.jsonl, config.yaml), a tiny
unguarded TRL GRPOTrainer run (trainer_state.json, TensorBoard events and an offline wandb run written by
transformers itself), and a seeded unguarded/guarded pair for the shadow-mode comparison.

Every run is a real ``GRPOTrainer`` on CPU with the demo's tiny Llama (built locally: no downloads).
"""

from __future__ import annotations

import os

import pytest
from replay_runs import quiet_demo_yaml

from rl_guard.demo.tiny import build_tiny_model, tiny_trainer  # light: torch and trl are imported inside them

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def fault_demo(tmp_path_factory):
    """The demo's own lr_blowup run: the guard rolls back live."""
    from rl_guard.demo.run import run_demo

    run_dir = tmp_path_factory.mktemp("demo") / "run"
    return run_demo(
        fault="lr_blowup", steps=20, fault_step=8, run_dir=run_dir, quiet=True, guard_yaml=quiet_demo_yaml()
    )


@pytest.fixture(scope="session")
def healthy_demo(tmp_path_factory):
    """A demo run with no fault: the healthy history for ``suggest``."""
    from rl_guard.demo.run import run_demo

    run_dir = tmp_path_factory.mktemp("healthy") / "run"
    return run_demo(fault="none", steps=30, run_dir=run_dir, quiet=True, guard_yaml=quiet_demo_yaml())


@pytest.fixture(scope="session")
def trl_run(tmp_path_factory):
    """An unguarded tiny GRPO run reporting to TensorBoard and (offline) wandb; its trainer_state.json is written the
    way the Trainer writes it into every checkpoint (``TrainerState.save_to_json``)."""
    from transformers.trainer_callback import PrinterCallback

    root = tmp_path_factory.mktemp("trl")
    model = build_tiny_model(root / "model", seed=0)
    (root / "wandb_home").mkdir()
    trainer = tiny_trainer(
        model,
        root / "out",
        report_to=["tensorboard", "wandb"],  # events: out/runs/<date>/
        logging_steps=1,
        disable_tqdm=True,
        max_steps=6,
    )
    trainer.pop_callback(PrinterCallback)  # keep test output short
    with pytest.MonkeyPatch.context() as env:  # an offline wandb run under root/wandb_home/wandb/offline-run-*/
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_DIR", str(root / "wandb_home"))
        env.setenv("WANDB_PROJECT", "rl_guard_replay")
        trainer.train()
        import wandb

        wandb.finish()  # transformers leaves the run open for later logging; a script ends it like this
    trainer.state.save_to_json(str(root / "trainer_state.json"))
    return root, trainer


@pytest.fixture(scope="session")
def grpo_pair(tmp_path_factory):
    """``grpo_pair(guard_yaml, fault, at_step, steps)``: the same seeded tiny GRPO run twice, unguarded and with an
    ``RLGuardCallback`` built from ``guard_yaml``; returns (plain trainer, guarded trainer, guard)."""
    from transformers.trainer_callback import PrinterCallback

    from rl_guard.adapters.trl import RLGuardCallback
    from rl_guard.demo.faults import FaultInjector

    root = tmp_path_factory.mktemp("pair")
    model = build_tiny_model(root / "model", seed=0)

    def train(name: str, guard_yaml, fault: str, at_step: int, steps: int):
        injector = FaultInjector(fault, at_step=at_step)
        guard = [RLGuardCallback(guard_yaml, run_dir=str(root / name / "guard"))] if guard_yaml else []
        trainer = tiny_trainer(
            model,
            root / name / "out",
            injector=injector,
            callbacks=guard,
            logging_steps=1,
            disable_tqdm=True,
            max_steps=steps,
        )
        trainer.pop_callback(PrinterCallback)
        trainer.train()
        return trainer, (guard[0].guard if guard else None)

    def pair(guard_yaml: str, fault: str = "lr_blowup", at_step: int = 3, steps: int = 8):
        plain, _ = train("plain", None, fault, at_step, steps)
        guarded, guard = train("guarded", guard_yaml, fault, at_step, steps)
        return plain, guarded, guard

    return pair
