"""Subprocess for test_openrlhf_deepspeed.py: the OpenRLHF gate on a real DeepSpeed ZeRO engine (CPU, gloo).

Usage: python openrlhf_deepspeed_worker.py <stage:dtype,...> <port> <out dir>, e.g. ``1:fp32,2:bf16,3:bf16``;
prints one JSON line: a dict per configuration (one process, so deepspeed is imported once).
The strategy is OpenRLHF 0.11.2's own ``DeepspeedStrategy`` methods (backward / optimizer_step / save_ckpt /
load_ckpt and what they call), cut out of the installed ``openrlhf/utils/deepspeed/deepspeed.py``; its
cuda-sync barrier is a plain barrier on CPU.
"""

from __future__ import annotations

import ast
import gc
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

CONFIGS, PORT, OUT_ROOT = sys.argv[1].split(","), sys.argv[2], Path(sys.argv[3])
STAGE, BF16, OUT = 0, False, OUT_ROOT  # set per configuration in main()
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import deepspeed  # noqa: E402
import torch  # noqa: E402

# DeepSpeed JIT-compiles a CPU shared-memory op at init when a compiler is present; only inference_all_reduce uses
# it (training collectives go through torch.distributed / gloo), so the build (minutes on a loaded CPU) is skipped.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
from torch import distributed as dist  # noqa: E402

from rl_guard import Guard, TokenBatch  # noqa: E402
from rl_guard.adapters.openrlhf import attach_checkpoints, gate_optimizer_step  # noqa: E402
from rl_guard.errors import GuardHalted  # noqa: E402
from rl_guard.versions import SeamError  # noqa: E402

METHODS = (
    "print",
    "is_rank_0",
    "_get_ckpt_metric_path",
    "_write_ckpt_metric",
    "_read_ckpt_metric",
    "backward",
    "optimizer_step",
    "save_ckpt",
    "load_ckpt",
)


class Actor(torch.nn.Module):
    """OpenRLHF's ``Actor`` after ``strategy.prepare``: the DeepSpeed engine is ``.model``."""

    def __init__(self, eng):
        super().__init__()
        self.model = eng


def strategy_class():
    path = Path(importlib.util.find_spec("openrlhf").origin).parent / "utils" / "deepspeed" / "deepspeed.py"
    cls = next(n for n in ast.parse(path.read_text()).body if getattr(n, "name", None) == "DeepspeedStrategy")
    body = [n for n in cls.body if getattr(n, "name", None) in METHODS]
    consts = [n for n in cls.body if isinstance(n, ast.Assign)]  # CKPT_METRIC_FILENAME
    node = ast.ClassDef(name="Strategy", bases=[], keywords=[], body=consts + body, decorator_list=[])
    ns = {
        "deepspeed": deepspeed,
        "torch": torch,
        "dist": dist,
        "os": os,
        "shutil": shutil,
        "json": json,
        "gc": gc,
        "Actor": Actor,
        "torch_dist_barrier_and_cuda_sync": dist.barrier,
        "nn": torch.nn,
        "optim": torch.optim,
    }
    exec(compile(ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[])), str(path), "exec"), ns)
    return ns["Strategy"]


def engine(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": STAGE},
        "bf16": {"enabled": BF16},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10},
        },
    }
    return deepspeed.initialize(model=model, config=cfg)[0]


def window(actor, strategy, guard, seeds, bad=False):
    """gas micro-batches; a bad window's behaviour log-probs sit 3 nats above the current ones (ratio e^-3)."""
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
        out = actor.model(x.bfloat16() if BF16 else x).float()
        loss = ((out - y) ** 2).mean()
        lp = torch.log_softmax(out.detach(), -1)
        guard.observe(
            TokenBatch(lp, torch.ones_like(lp, dtype=torch.bool), old_logprobs=lp + (3.0 if bad else 0.0)),
            loss=loss.detach(),
        )
        strategy.backward(loss, actor, None)
        strategy.optimizer_step(None, actor, None, name="actor")


def weights(eng):
    ps = list(eng.module.parameters())
    with deepspeed.zero.GatheredParameters(ps, enabled=STAGE == 3):
        return [p.detach().clone() for p in ps]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def guarded(name, action, snapshots=""):
    eng, strategy = engine(), strategy_class()()
    actor = Actor(eng)
    rule = f"rules:\n  - {{name: mismatch, metric: rl_guard/ratio/min, op: '<', threshold: 0.5, action: {action}}}\n"
    guard = Guard.from_yaml(f"version: 1\nsinks: [jsonl]\n{snapshots}{rule}", run_dir=OUT / name)
    attach_checkpoints(guard, strategy, actor, eng.optimizer, eng.lr_scheduler, str(OUT / name / "ckpt"))
    gate_optimizer_step(strategy, actor, guard)
    return eng, strategy, actor, guard


def main() -> None:
    global STAGE, BF16, OUT
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    results = {}
    for config in CONFIGS:
        stage, dtype = config.split(":")
        STAGE, BF16, OUT = int(stage), dtype == "bf16", OUT_ROOT / config.replace(":", "_")
        results[config] = run_config()
    print(json.dumps(results))


def run_config() -> dict:
    out = {}
    eng, st, actor, guard = guarded("skip", "skip_step")
    window(actor, st, guard, [1, 2])
    w1, lr1 = weights(eng), eng.get_lr()[0]
    # the guard's norm over this rank's ZeRO partitions against DeepSpeed's own (pre-clip) global norm
    out.update(grad_norm=guard.last_logged.get("rl_guard/grad/norm"), ds_grad_norm=float(eng.get_global_grad_norm()))
    window(actor, st, guard, [3, 4], bad=True)
    out.update(
        guard_steps=guard.step,
        guard_skipped=guard.controller.skipped_steps,
        ds_skipped=eng.skipped_steps,
        micro_steps=eng.micro_steps,
        unchanged=same(w1, weights(eng)),
        lr_unchanged=eng.get_lr()[0] == lr1,
        overflow_reset=eng.optimizer.overflow is False,
    )
    window(actor, st, guard, [5, 6])
    ref, st_b, actor_b, guard_b = guarded("reference", "skip_step")
    window(actor_b, st_b, guard_b, [1, 2])
    window(actor_b, st_b, guard_b, [5, 6])
    out["no_leak"] = same(weights(eng), weights(ref))  # the skipped window left no gradient or moment behind

    snaps = "snapshots: {healthy_steps: 1, every: 2, keep: 2, where: memory}\n"  # snapshot after step 1 only
    eng, st, actor, guard = guarded("rollback", "rollback", snaps)
    window(actor, st, guard, [1, 2])
    snap = weights(eng)
    window(actor, st, guard, [5, 6])  # healthy, applied, no new snapshot
    moved = not same(snap, weights(eng))
    window(actor, st, guard, [3, 4], bad=True)
    out.update(
        rollbacks=guard.controller.rollbacks,
        moved=moved,
        restored=same(snap, weights(eng)),
        tags=sorted(p.name for p in (OUT / "rollback" / "ckpt").iterdir() if p.is_dir()),
    )
    _, states = st.load_ckpt(eng, str(OUT / "rollback" / "ckpt"), tag="rl_guard_step1")
    out["client_state_has_guard"] = "rl_guard" in states
    out.update(no_overflow_path())
    out.update(renamed_check_overflow())
    return out


def no_overflow_path() -> dict:
    """A release whose ZeRO step ignores the overflow flag: the skipped window's update is applied anyway. The guard
    must notice (``skipped_steps`` did not advance) and escalate: checkpoint, ``skip_not_taken`` incident, halt."""
    eng, st, actor, guard = guarded("no_overflow", "skip_step")
    window(actor, st, guard, [1, 2])
    opt, real_step = eng.optimizer, eng.optimizer.step

    def ignoring_overflow(*args, **kwargs):
        if hasattr(opt, "check_grad_overflow"):  # ZeRO 1/2 re-checks through check_overflow; stage 3 only for fp16
            opt.check_grad_overflow = False
        opt.overflow = False
        return real_step(*args, **kwargs)

    opt.step = ignoring_overflow
    before, skipped = weights(eng), eng.skipped_steps
    try:
        window(actor, st, guard, [3, 4], bad=True)
        halted = ""
    except GuardHalted as exc:
        halted = str(exc)
    records = [json.loads(line) for line in (OUT / "no_overflow" / "incidents.jsonl").read_text().splitlines()]
    last = records[-1]
    return {
        "no_overflow_applied": not same(before, weights(eng)),
        "no_overflow_ds_skipped": eng.skipped_steps - skipped,
        "no_overflow_halted": halted,
        "no_overflow_rule": last["rule"],
        "no_overflow_decision": last["decision"],
        "no_overflow_escalated_from": last["escalated_from"],
        "no_overflow_checkpoint": bool(last["checkpoint"]) and os.path.exists(last["checkpoint"]),
    }


def renamed_check_overflow() -> dict:
    """The real ZeRO optimizer in a subclass without ``check_overflow``: the gate refuses to attach."""
    eng, strategy = engine(), strategy_class()()
    actor, cls = Actor(eng), type(eng.optimizer)
    eng.optimizer.__class__ = type(cls.__name__, (cls,), {"check_overflow": None})
    guard = Guard.from_yaml("version: 1\nsinks: [jsonl]\n", run_dir=OUT / "renamed")
    try:
        gate_optimizer_step(strategy, actor, guard)
        return {"renamed_error": ""}
    except SeamError as exc:
        return {"renamed_error": str(exc)}


if __name__ == "__main__":
    main()
