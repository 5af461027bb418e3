"""One rank of a real DeepSpeed ZeRO run on CPU (gloo), the guard gating ``engine.step``.

Usage (one process per rank, env RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT): ds_zero_worker.py OUT STAGES
with STAGES like ``2,3,2-offload`` (``-offload``: ZeRO-Offload, the optimizer and its fp32 partition on the CPU,
run by torch's Adam). For every stage, three runs whose ``nonfinite_grad`` action is ``skip_step``,
``checkpoint_and_halt`` or ``rollback`` (snapshots through ``engine.save_checkpoint``). At the fault step the last
rank alone writes an inf into its own gradient partition after the backward (after DeepSpeed's reduce-scatter),
before ``engine.step``. Writes OUT/rank<r>.json.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import deepspeed
import torch
from torch import distributed as dist

from rl_guard import Guard
from rl_guard.adapters.deepspeed import EngineCheckpointState, EngineGate, ZeroGradients
from rank_launch import finish
from zero_reference import digest, exact_update, masters

# DeepSpeed JIT-compiles a CPU shared-memory op at init when a compiler is present; only inference_all_reduce uses
# it (training collectives go through torch.distributed / gloo), so the build (minutes on a loaded CPU) is skipped.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

STEPS, GAS = 4, 2
FAULT_STEP = {"skip_step": 1, "checkpoint_and_halt": 1, "rollback": 2}  # rollback: a snapshot from step 0
OUT, STAGES = Path(sys.argv[1]), sys.argv[2].split(",")
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def engine(spec: str):
    stage, offload = int(spec.split("-")[0]), spec.endswith("-offload")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,  # really partitioned
                                 **({"offload_optimizer": {"device": "cpu"}} if offload else {})},
           "zero_force_ds_cpu_optimizer": False,  # offload with torch's Adam rather than DeepSpeedCPUAdam (native)
           "bf16": {"enabled": True}, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
           # torch's Adam: no native DeepSpeed op to build
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}
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
    return {"local": digest(local), "master": digest(master), "module": every,
            "finite": all(bool(torch.isfinite(t.float()).all()) for t in local + master)}


def run(stage: str, action: str) -> dict:
    eng = engine(stage)
    snapshots = "snapshots: {healthy_steps: 1, every: 100, keep: 1, where: memory}\n" if action == "rollback" else ""
    guard = Guard.from_yaml(f"version: 1\nsinks: [jsonl]\n{snapshots}"
                            f"builtin_rules: {{nonfinite_grad: {{action: {action}}}}}\n",
                            run_dir=OUT / f"zero{stage}_{action}")
    guard.attach(eng.module).attach_state(EngineCheckpointState(eng, guard))
    gate = EngineGate(eng, guard)
    steps = []
    for step in range(STEPS):
        before, master_before = weights(eng), masters(eng)
        for micro in range(GAS):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + RANK)  # each rank its own data
            x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
            loss = ((eng(x.bfloat16()).float() - y) ** 2).mean()
            guard.observe(loss=loss.detach())
            eng.backward(loss)
            if micro == GAS - 1 and step == FAULT_STEP[action] and RANK == WORLD - 1:
                partition = next(t for group in ZeroGradients(eng).grad_groups() for t in group if t.numel())
                partition.view(-1)[0] = math.inf
            eng.step()
        decision = gate.take()
        guard.actions.restore_pending()
        guard.step_done()
        m = guard.last_logged
        param_norm, update_rel = exact_update(master_before, masters(eng))
        steps.append({"step": step, "action": decision.action, "apply": decision.apply_step, "stop": decision.stop,
                      "grad_nonfinite": m.get("rl_guard/grad/nonfinite"), "grad_norm": m.get("rl_guard/grad/norm"),
                      "ds_grad_norm": None if not decision.apply_step else float(eng.get_global_grad_norm()),
                      "before": before, "after": weights(eng), "skipped_steps": eng.skipped_steps,
                      # the probe reports step t's update with step t+1's statistics
                      "probe_param_norm": m.get("rl_guard/update/param_norm"),
                      "probe_update_rel": m.get("rl_guard/update/rel"),
                      "exact_param_norm": param_norm, "exact_update_rel": update_rel})
        if decision.stop:
            break
    gate.remove()
    return {"steps": steps, "checkpoint": guard.actions.last_checkpoint, "fault_step": FAULT_STEP[action],
            "rollbacks": guard.controller.rollbacks}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    result = {"rank": RANK, "world": dist.get_world_size()}
    for stage in STAGES:
        for action in FAULT_STEP:
            result[f"zero{stage}_{action}"] = run(stage, action)
    finish(OUT / f"rank{RANK}.json", result)


if __name__ == "__main__":
    main()
