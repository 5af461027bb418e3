"""One rank of a real ``torchrun --nproc_per_node 2`` launch of a tiny TRL ``GRPOTrainer`` on CPU with the guard.

At FAULT_STEP the last rank alone gets an inf gradient entry at ``on_pre_optimizer_step``, i.e. after backward
and after DDP's gradient all-reduce (a fault before backward, such as a NaN loss, would reach every rank through
that all-reduce). The guard's built-in ``nonfinite_grad`` rule is set to ``checkpoint_and_halt``.
Usage: torchrun --nproc_per_node 2 trl_ddp_run.py OUT_DIR ; writes OUT_DIR/rank<r>.json
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from rl_guard.adapters.trl import RLGuardCallback
from rl_guard.demo.tiny import build_tiny_model, prompt_dataset, repeat_last_digit_reward

FAULT_STEP, STEPS = 2, 5
GUARD_YAML = """version: 1
sinks: [jsonl]
builtin_rules: {nonfinite_grad: {action: checkpoint_and_halt}}
"""


class InfGradOnOneRank(TrainerCallback):
    def __init__(self, rank: int):
        self.rank = rank

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if state.global_step == FAULT_STEP and torch.distributed.get_rank() == self.rank:
            p = next(p for p in model.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = math.inf


class Recorder(TrainerCallback):
    """After the guard's callback: what it decided at every optimizer step, and the collectives it ran."""

    def __init__(self, guard):
        self.guard, self.decisions, self.calls = guard, [], []
        original, calls = torch.distributed.all_reduce, self.calls
        check = guard.check

        def counting(*a, **k):
            calls[-1].append(a[0].numel())
            return original(*a, **k)

        def checked(*a, **k):
            calls.append([])
            torch.distributed.all_reduce = counting
            try:
                return check(*a, **k)
            finally:
                torch.distributed.all_reduce = original

        guard.check = checked

    def on_pre_optimizer_step(self, args, state, control, **kw):
        d = self.guard.last_decision
        self.decisions.append([state.global_step, d.action if d else None, bool(control.should_training_stop)])


def main() -> int:
    out = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model_path = build_tiny_model(out / f"model_rank{rank}", seed=0)  # same seed: identical start on every rank
    args = GRPOConfig(
        output_dir=str(out / "trainer"),
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
    )  # a rank left waiting in a collective raises instead of hanging
    guard_cb = RLGuardCallback(GUARD_YAML, run_dir=str(out / "guard"))
    recorder = Recorder(guard_cb.guard)
    trainer = GRPOTrainer(
        model=str(model_path),
        reward_funcs=[repeat_last_digit_reward],
        args=args,
        train_dataset=prompt_dataset(64, seed=0),
        callbacks=[InfGradOnOneRank(world - 1), guard_cb, recorder],
    )
    trainer.train()
    h = hashlib.sha256()
    finite = True
    for p in trainer.model.parameters():
        finite &= bool(torch.isfinite(p).all())
        h.update(p.detach().float().contiguous().numpy().tobytes())
    result = {
        "rank": rank,
        "world": world,
        "guard_rank": guard_cb.guard.rank,
        "guard_world": guard_cb.guard.world_size,
        "backend": torch.distributed.get_backend(),
        "global_step": trainer.state.global_step,
        "decisions": recorder.decisions,
        "check_calls": recorder.calls,
        "finite": finite,
        "digest": h.hexdigest(),
        "checkpoint": guard_cb.guard.actions.last_checkpoint,
        "fault_step": FAULT_STEP,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
