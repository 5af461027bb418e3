"""One rank of a real FSDP2 (``fully_shard``) run on CPU with gloo, guarded in a plain training loop.

Usage (env RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT): fsdp2_worker.py OUT. Parameters and gradients are
``DTensor`` shards; the guard detects them (no ``sharded_grads``), merges the shards' squared norms by sum and
drops the update with ``p.grad = None``. For each ``nonfinite_grad`` action (``skip_step``,
``checkpoint_and_halt``, ``rollback``) the last rank alone writes an inf into its own gradient shard after the
backward (after FSDP's reduce-scatter) at the fault step. A reference: the full-gradient norm gathered from every
shard. Writes OUT/rank<r>.json.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from rank_launch import finish
from torch import distributed as dist
from torch.distributed.fsdp import fully_shard
from zero_reference import digest

from rl_guard import Guard

STEPS = 4
FAULT_STEP = {"skip_step": 1, "checkpoint_and_halt": 1, "rollback": 2}  # rollback: a snapshot from step 0
OUT = Path(sys.argv[1])


def weights(model) -> dict:
    local = [p.to_local() for p in model.parameters()]
    full = [p.full_tensor() for p in model.parameters()]  # collective: every rank calls it in the same order
    return {"local": digest(local), "full": digest(full), "finite": all(bool(torch.isfinite(t).all()) for t in full)}


def run(action: str, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    snapshots = "snapshots: {healthy_steps: 1, every: 100, keep: 1, where: memory}\n" if action == "rollback" else ""
    guard = Guard.from_yaml(
        f"version: 1\nsinks: [jsonl]\n{snapshots}builtin_rules: {{nonfinite_grad: {{action: {action}}}}}\n",
        run_dir=OUT / action,
    )
    guard.attach(model, opt)
    steps = []
    for step in range(STEPS):
        before = weights(model)
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        guard.observe(loss=loss.detach())
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        assert all(type(gr).__name__ == "DTensor" for gr in grads)
        reference = math.sqrt(sum(float(gr.full_tensor().double().pow(2).sum()) for gr in grads))
        param_reference = math.sqrt(sum(float(q.full_tensor().double().pow(2).sum()) for q in model.parameters()))
        if step == FAULT_STEP[action] and rank == world - 1:
            shard = next(gr.to_local() for gr in grads if gr.to_local().numel())
            shard.view(-1)[0] = math.inf
        decision = guard.check()
        if decision.apply_step:
            opt.step()
        opt.zero_grad()
        guard.step_done()  # (a rollback was restored inside check: defer_restore is off)
        m = guard.last_logged
        steps.append(
            {
                "step": step,
                "action": decision.action,
                "stop": decision.stop,
                "reference_norm": reference,
                "grad_norm": m.get("rl_guard/grad/norm"),
                "grad_nonfinite": m.get("rl_guard/grad/nonfinite"),
                "param_norm": m.get("rl_guard/update/param_norm"),
                "reference_param_norm": param_reference,
                "before": before,
                "after": weights(model),
                "failures": guard.internal_failures,
            }
        )
        if decision.stop:
            break
    return {
        "steps": steps,
        "checkpoint": guard.actions.last_checkpoint,
        "fault_step": FAULT_STEP[action],
        "rollbacks": guard.controller.rollbacks,
    }


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "world": world}
    for action in FAULT_STEP:
        result[action] = run(action, rank, world)
    finish(OUT / f"rank{rank}.json", result)


if __name__ == "__main__":
    main()
