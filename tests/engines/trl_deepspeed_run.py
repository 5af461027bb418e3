"""One rank of a tiny TRL ``GRPOTrainer`` under accelerate + DeepSpeed ZeRO-2 or ZeRO-3 on CPU (gloo), guarded.

Usage: torchrun --nproc_per_node N trl_deepspeed_run.py OUT ACTION STAGE ; ACTION is the ``nonfinite_grad`` action
(``skip_step`` or ``checkpoint_and_halt``), or ``rollback_twice``. At each fault step the last rank's backward gives
one gradient entry an inf (a tensor hook, before DeepSpeed reduces it). Every optimizer step records the guard's
decision, the snapshot a rollback restores, and digests of this rank's weights (module and fp32 master partition)
before and after. Writes OUT/rank<r>.json.

``rollback_twice``: a snapshot (a DeepSpeed checkpoint tag) after every healthy step, ``confirm_steps: 2``, and a
second fault after the first rollback: both rollbacks must restore the same snapshot through the engine's
``load_checkpoint`` while the trainer keeps counting.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import deepspeed
import torch
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from zero_reference import digest, exact_update, masters

from rl_guard.adapters.trl import RLGuardCallback
from rl_guard.demo.tiny import build_tiny_model, prompt_dataset, repeat_last_digit_reward

# DeepSpeed JIT-compiles a CPU shared-memory op at init when a compiler is present; only inference_all_reduce uses
# it (training collectives go through torch.distributed / gloo), so the build (minutes on a loaded CPU) is skipped.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

OUT, ACTION, STAGE = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
# global_step at the start of each fault step (guard step n ends with global_step n), steps, guard settings
FAULT_STEPS, STEPS, SETTINGS = (
    ((3, 6), 9, "snapshots: {healthy_steps: 1, every: 1, keep: 3, where: memory}\nrollback: {confirm_steps: 2}\n")
    if ACTION == "rollback_twice"
    else ((1,), 3, "")
)
RULE_ACTION = "rollback" if ACTION == "rollback_twice" else ACTION
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": STAGE},
    "bf16": {"enabled": False},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
}  # no "optimizer": the trainer's torch AdamW (no native op to build)


class Probe(TrainerCallback):
    """Weights at every step's start and end, the inf injection, and the guard's decision per step."""

    def __init__(self, guard_cb, rank: int, world: int):
        self.guard_cb, self.rank, self.world, self.steps, self.hook = guard_cb, rank, world, [], None
        self.before = self.decision = self.restores = None

    def weights(self, model):
        # ZeRO-3: this rank's partitions (the module's parameters are empty placeholders between steps)
        module = [p.ds_tensor for p in model.parameters()] if STAGE == 3 else list(model.parameters())
        return {
            "module": digest(module),
            "master": digest(masters(self.guard_cb.trainer.model_wrapped)),
            "finite": all(bool(torch.isfinite(p).all()) for p in module),
        }

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.before = self.weights(model)
        self.master_before = masters(self.guard_cb.trainer.model_wrapped)
        if state.global_step in FAULT_STEPS and self.rank == self.world - 1:
            p = next(p for p in model.parameters() if p.requires_grad)

            def inf_entry(g):
                g = g.clone()
                g.view(-1)[0] = math.inf
                return g

            self.hook = p.register_hook(inf_entry)

    def on_pre_optimizer_step(self, args, state, control, **kw):
        d = self.guard_cb.guard.last_decision  # taken inside engine.step, during this step's backward
        self.decision = (d.step, d.action) if d else None
        pending = self.guard_cb.guard.actions.pending_restore  # the guard restores it at on_step_end
        self.restores = pending["step"] if pending else None

    def on_step_end(self, args, state, control, model=None, **kw):
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        m = self.guard_cb.guard.last_metrics
        param_norm, update_rel = exact_update(self.master_before, masters(self.guard_cb.trainer.model_wrapped))
        self.steps.append(
            {
                "exact_param_norm": param_norm,
                "exact_update_rel": update_rel,
                # the update probe reports step t's update with step t+1's statistics
                "probe_param_norm": m.get("rl_guard/update/param_norm"),
                "probe_update_rel": m.get("rl_guard/update/rel"),
                "step": state.global_step - 1,
                "decision": self.decision,
                "restores": self.restores,
                "tags": snapshot_tags(),
                "offered": self.guard_cb.guard.actions.snapshots.steps(),
                "stop": bool(control.should_training_stop),
                "grad_nonfinite": m.get("rl_guard/grad/nonfinite"),
                "grad_norm": m.get("rl_guard/grad/norm"),
                "before": self.before,
                "after": self.weights(model),
            }
        )


def snapshot_tags() -> list[str]:
    """The DeepSpeed checkpoint tags on disk (every rank writes into the same directory)."""
    root = OUT / "guard" / "deepspeed_snapshots"
    return sorted(p.name for p in root.glob("rl_guard_step*"))


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model_path = build_tiny_model(OUT / f"model_rank{rank}", seed=0)
    # DeepSpeed's own process group before the trainer: ZeRO-3's zero.Init (model creation) reads its world size
    # there, as under DeepSpeed's launcher; accelerate alone starts only torch's on CPU.
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    args = GRPOConfig(
        output_dir=str(OUT / "trainer"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=STEPS,
        use_cpu=True,
        bf16=False,
        report_to=[],
        learning_rate=1e-3,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        logging_steps=1,
        beta=0.0,
        ddp_timeout=60,
        deepspeed=DS_CONFIG,
    )
    guard_cb = RLGuardCallback(
        f"version: 1\nsinks: [jsonl]\n{SETTINGS}builtin_rules: {{nonfinite_grad: {{action: {RULE_ACTION}}}}}\n",
        run_dir=str(OUT / "guard"),
    )
    probe = Probe(guard_cb, rank, world)
    trainer = GRPOTrainer(
        model=str(model_path),
        reward_funcs=[repeat_last_digit_reward],
        args=args,
        train_dataset=prompt_dataset(64, seed=0),
        callbacks=[guard_cb, probe],
    )
    trainer.train()
    result = {
        "rank": rank,
        "world": world,
        "backend": torch.distributed.get_backend(),
        "zero_stage": trainer.model_wrapped.zero_optimization_stage(),
        "steps": probe.steps,
        "global_step": trainer.state.global_step,
        "skipped": trainer.model_wrapped.skipped_steps,
        "checkpoint": guard_cb.guard.actions.last_checkpoint,
    }
    (OUT / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main()
