"""One rank of a real DeepSpeed ZeRO run on CPU (gloo), the guard gating ``engine.step``.

Usage (one process per rank, env RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT): ds_zero_worker.py OUT STAGES
with STAGES like ``2,3,2-offload`` (``-offload``: ZeRO-Offload, the optimizer and its fp32 partition on the CPU,
run by torch's Adam). For every stage, three runs whose ``nonfinite_grad`` action is ``skip_step``,
``checkpoint_and_halt`` or ``rollback`` (snapshots through ``engine.save_checkpoint``); for the first stage also
``rollback_twice``: a snapshot every step, ``confirm_steps: 2``, and a second fault after the first rollback, whose
restore needs the oldest snapshot again (the tags the rollback abandoned must not crowd it out). At a fault step
the last rank alone writes an inf into its own gradient partition after the backward (after DeepSpeed's
reduce-scatter), before ``engine.step``. Writes OUT/rank<r>.json.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import deepspeed
import torch
from rank_launch import finish
from torch import distributed as dist
from zero_reference import digest, exact_update, masters

from rl_guard import Guard
from rl_guard.adapters.deepspeed import EngineCheckpointState, EngineGate, ZeroGradients

# DeepSpeed JIT-compiles a CPU shared-memory op at init when a compiler is present; only inference_all_reduce uses
# it (training collectives go through torch.distributed / gloo), so the build (minutes on a loaded CPU) is skipped.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

GAS = 2
# per run: its nonfinite_grad action, the steps it runs, its fault steps, its snapshot and rollback settings
RUNS = {
    "skip_step": ("skip_step", 4, (1,), ""),
    "checkpoint_and_halt": ("checkpoint_and_halt", 4, (1,), ""),
    "rollback": ("rollback", 4, (2,), "snapshots: {healthy_steps: 1, every: 100, keep: 1, where: memory}\n"),
    # snapshots labelled 1, 2, 3; the fault at 3 restores 1 and abandons 2 and 3; 5 and 6 follow; the fault at 6
    # (horizon 5) restores 1 again
    "rollback_twice": (
        "rollback",
        8,
        (3, 6),
        "snapshots: {healthy_steps: 1, every: 1, keep: 3, where: memory}\nrollback: {confirm_steps: 2}\n",
    ),
}
OUT, STAGES = Path(sys.argv[1]), sys.argv[2].split(",")
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def engine(spec: str):
    stage, offload = int(spec.split("-")[0]), spec.endswith("-offload")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,  # really partitioned
            **({"offload_optimizer": {"device": "cpu"}} if offload else {}),
        },
        "zero_force_ds_cpu_optimizer": False,  # offload with torch's Adam rather than DeepSpeedCPUAdam (native)
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        # torch's Adam: no native DeepSpeed op to build
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    return deepspeed.initialize(model=model, config=cfg)[0]


def weights(eng) -> dict:
    """Digests of this rank's bf16 weights (its ZeRO-3 partitions, or the full module under ZeRO-2), of its fp32
    master partition, and of every rank's bf16 weights through a blocking ``all_gather_object`` (full ZeRO-3
    parameters read through ``GatheredParameters`` gave bytes that differed from run to run here on CPU / gloo)."""
    ps = list(eng.module.parameters())
    local = [(p.ds_tensor if eng.zero_optimization_stage() == 3 else p).detach().clone() for p in ps]
    master = masters(eng)
    every = [None] * WORLD
    dist.all_gather_object(every, digest(local))
    return {
        "local": digest(local),
        "master": digest(master),
        "module": every,
        "finite": all(bool(torch.isfinite(t.float()).all()) for t in local + master),
    }


def run(stage: str, name: str) -> dict:
    action, n_steps, faults, settings = RUNS[name]
    eng = engine(stage)
    guard = Guard.from_yaml(
        f"version: 1\nsinks: [jsonl]\n{settings}builtin_rules: {{nonfinite_grad: {{action: {action}}}}}\n",
        run_dir=OUT / f"zero{stage}_{name}",
    )
    state = EngineCheckpointState(eng, guard)
    guard.attach(eng.module).attach_state(state)
    gate = EngineGate(eng, guard)
    steps = []
    for step in range(n_steps):
        before, master_before = weights(eng), masters(eng)
        for micro in range(GAS):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + RANK)  # each rank its own data
            x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
            loss = ((eng(x.bfloat16()).float() - y) ** 2).mean()
            guard.observe(loss=loss.detach())
            eng.backward(loss)
            if micro == GAS - 1 and step in faults and RANK == WORLD - 1:
                partition = next(t for group in ZeroGradients(eng).grad_groups() for t in group if t.numel())
                partition.view(-1)[0] = math.inf
            eng.step()
        decision = gate.take()
        guard.actions.restore_pending()
        guard.step_done()
        m = guard.last_logged
        param_norm, update_rel = exact_update(master_before, masters(eng))
        steps.append(
            {
                "step": step,
                "action": decision.action,
                "apply": decision.apply_step,
                "stop": decision.stop,
                "grad_nonfinite": m.get("rl_guard/grad/nonfinite"),
                "grad_norm": m.get("rl_guard/grad/norm"),
                "ds_grad_norm": None if not decision.apply_step else float(eng.get_global_grad_norm()),
                "before": before,
                "after": weights(eng),
                "skipped_steps": eng.skipped_steps,
                # the probe reports step t's update with step t+1's statistics
                "probe_param_norm": m.get("rl_guard/update/param_norm"),
                "probe_update_rel": m.get("rl_guard/update/rel"),
                "exact_param_norm": param_norm,
                "exact_update_rel": update_rel,
                "tags": sorted(p.name for p in Path(state.ckpt_dir).glob("rl_guard_step*")),
                "offered": guard.actions.snapshots.steps(),
            }
        )
        if decision.stop:
            break
    gate.remove()
    return {
        "steps": steps,
        "checkpoint": guard.actions.last_checkpoint,
        "fault_step": faults[0],
        "rollbacks": guard.controller.rollbacks,
        "internal_failures": guard.internal_failures,
    }


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    result = {"rank": RANK, "world": dist.get_world_size()}
    for stage in STAGES:
        for name in RUNS if stage == STAGES[0] else list(RUNS)[:3]:
            result[f"zero{stage}_{name}"] = run(stage, name)
    finish(OUT / f"rank{RANK}.json", result)


if __name__ == "__main__":
    main()
