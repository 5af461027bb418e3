"""AReaL 1.0.4's real ``FSDPPPOActor`` in SPMD mode on CPU (gloo), guarded (recipe and test worker).

Usage (environment: the nox session areal, .nox/areal):
    python integrations/areal_async/tiny_qwen2.py /tmp/qwen2
    torchrun --nproc-per-node 2 integrations/areal_async/fsdp_actor_on_cpu.py /tmp/qwen2 /tmp/areal_run
    torchrun --nproc-per-node 2 integrations/areal_async/fsdp_actor_on_cpu.py /tmp/qwen2 /tmp/areal_run resume
Prints one JSON line per rank (tests/adapters/areal/ runs it with one and two processes). The engine is
``GuardedFSDPPPOActor`` (the class a single-controller run's workers import by dotted path), built and initialised
the way AReaL's SPMD ``PPOTrainer`` builds it, and trained through ``compute_logp`` -> ``compute_advantages`` ->
``ppo_update``. No AReaL code is patched: AReaL picks its CPU platform itself (gloo) when no accelerator is present.

Steps (one ``ppo_update`` each, one mini-batch = one optimizer step; a snapshot after healthy steps 1, 3, ...):
1-2 healthy (behaviour = proximal: every weight 1); snapshot after step 1 only;
3   behaviour log-probs 6 nats above the proximal ones -> ``behave_imp_weight`` min e^-6 -> rollback to the
    snapshot after step 1 (step 2 had moved the weights), through the engine's own DCP save / load;
4   stale: versions 9 behind, above max_head_offpolicyness=2 -> ``staleness_bound`` warns, update applied;
5   2 nats above -> min e^-2 -> skip: weights bitwise unchanged;
    then a recover checkpoint, saved as AReaL's ``RecoverHandler`` saves one (``engine.save``, DCP, with the
    optimizer). ``resume`` loads it as ``RecoverHandler`` does (``engine.load``) and trains step 6: the guard
    continues from step 5 with its counters.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("AREAL_SPMD_MODE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
MODEL, OUT = sys.argv[1], sys.argv[2]
PHASE = sys.argv[3] if len(sys.argv) > 3 else "train"
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
os.environ["LOCAL_RANK"] = str(RANK)

GUARD = """version: 1
sinks: [jsonl]
lag_buckets: [0, 1, 2, 3, 5, 9]
snapshots: {healthy_steps: 1, every: 2, keep: 2, where: memory}
rules:
  - {name: staleness_bound, metric: rl_guard/lag/max, op: '>', threshold: 2, action: warn}
  - {name: behaviour_far, metric: rl_guard/behave_imp_weight/min, op: '<', threshold: 0.2, action: skip_step}
  - {name: behaviour_broken, metric: rl_guard/behave_imp_weight/min, op: '<', threshold: 0.01, action: rollback}
"""
os.environ["RL_GUARD_CONFIG"] = os.path.join(OUT, "guard.yaml")
os.environ["RL_GUARD_RUN_DIR"] = os.path.join(OUT, "guard")
if RANK == 0:
    os.makedirs(OUT, exist_ok=True)
    with open(os.environ["RL_GUARD_CONFIG"], "w") as f:
        f.write(GUARD)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
from areal.api.alloc_mode import ModelAllocation  # noqa: E402
from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig  # noqa: E402
from areal.api.io_struct import FinetuneSpec, SaveLoadMeta  # noqa: E402
from areal.infra.platforms import current_platform  # noqa: E402

from rl_guard.adapters.areal_engine import GuardedFSDPPPOActor  # noqa: E402

B, L, PROMPT = 4, 10, 3  # sequences per rank, padded length, prompt tokens
CURRENT = 9  # the trainer's version during the test


def full_weights(engine) -> list[torch.Tensor]:
    """Every parameter as the full tensor (FSDP2 shards are DTensors; gathering is collective)."""
    out = []
    for p in engine.model.parameters():
        t = p.detach()
        out.append((t.full_tensor() if hasattr(t, "full_tensor") else t).clone())
    return out


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def batch(step: int, stale: bool = False) -> list[dict]:
    """Per-trajectory dicts (``[1, L]`` each), as AReaL's RLVR workflow hands them to the trainer."""
    g = torch.Generator().manual_seed(100 * step + RANK)
    lag = 9 if stale else 1
    out = []
    for _ in range(B):
        loss_mask = torch.zeros(1, L, dtype=torch.int32)
        loss_mask[:, PROMPT:] = 1
        versions = torch.full((1, L), CURRENT - lag, dtype=torch.int32)
        versions[:, :PROMPT] = -1
        out.append(
            {
                "input_ids": torch.randint(4, 14, (1, L), generator=g),
                "attention_mask": torch.ones(1, L, dtype=torch.int32),
                "loss_mask": loss_mask,
                "versions": versions,
                "logprobs": torch.zeros(1, L),
                "rewards": torch.rand(1, generator=g),
            }
        )
    return out


def train_step(engine, step: int, behaviour_shift: float = 0.0, stale: bool = False) -> dict:
    """One global step as ``PPOTrainer.train`` runs it (rl_trainer.py): recompute, advantages, update."""
    data = batch(step, stale)
    prox = engine.compute_logp(data)  # position t holds log p(token t+1)
    for traj, lp in zip(data, prox):
        # The inference engine's log-probs sit at the token they score (the workflow's layout), so behaviour =
        # proximal (+ shift) one position later; compute_advantages rolls them back by one.
        traj["logprobs"][:, 1:] = lp[:, :-1] + behaviour_shift
        traj["prox_logp"] = lp
    data = engine.compute_advantages(data)
    before = full_weights(engine)
    engine.ppo_update(data)
    engine.lr_scheduler_step()
    after = full_weights(engine)
    return {"changed": not same(before, after), "after": after, "metrics": dict(engine.rl_guard.last_logged)}


def main() -> None:
    engine_config = PPOActorConfig(
        experiment_name="rl_guard_areal",
        trial_name="cpu",
        path=MODEL,
        init_from_scratch=False,
        dtype="float32",
        optimizer_dtype="float32",
        grad_reduce_dtype="float32",
        optimizer=OptimizerConfig(type="adam", lr=1e-2, warmup_steps_proportion=0.0, gradient_clipping=1.0),
        mb_spec=MicroBatchSpec(n_mbs=1),
        ppo_n_minibatches=1,
        use_decoupled_loss=True,
        recompute_logprob=True,
        eps_clip=0.2,
        attn_impl="sdpa",
        backend=f"fsdp:d{WORLD}",
        adv_norm=None,
        reward_norm=None,
        kl_ctl=0.0,
    )
    engine = GuardedFSDPPPOActor(engine_config)
    engine.create_process_group(parallel_strategy=ModelAllocation.from_str(f"fsdp:d{WORLD}").parallel)
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=B * WORLD))
    engine.set_version(CURRENT)
    guard = engine.rl_guard

    out = {"rank": RANK, "platform": current_platform.device_type, "backend": dist.get_backend()}
    recover = SaveLoadMeta(
        path=os.path.join(OUT, "recover"),
        weight_format="dcp",
        with_optim=True,
        tokenizer=None,
        processor=None,
        base_model_path=None,
    )  # RecoverHandler's meta
    if PHASE == "resume":
        engine.load(recover)
        out.update(guard_at_start=[guard.step, guard.skipped_steps, guard.rollbacks])
        s6 = train_step(engine, 6)
        out.update(applied_after_resume=s6["changed"], steps=guard.step)
        print(json.dumps(out), flush=True)
        engine.destroy()
        return
    s1 = train_step(engine, 1)
    s2 = train_step(engine, 2)
    s3 = train_step(engine, 3, behaviour_shift=6.0)
    s4 = train_step(engine, 4, stale=True)
    s5 = train_step(engine, 5, behaviour_shift=2.0)
    incidents = []
    path = os.path.join(os.environ["RL_GUARD_RUN_DIR"], "incidents.jsonl")
    if RANK == 0 and os.path.exists(path):
        with open(path) as f:
            incidents = [json.loads(line) for line in f if line.strip()]
    m1, m4 = s1["metrics"], s4["metrics"]
    out.update(
        applied=[s1["changed"], s2["changed"], s4["changed"]],
        moved_after_snapshot=not same(s2["after"], s1["after"]),
        rolled_back_to_snapshot=same(s3["after"], s1["after"]),
        skipped_unchanged=not s5["changed"],
        steps=guard.step,
        skipped=guard.skipped_steps,
        rollbacks=guard.rollbacks,
        lag_max_healthy=m1.get("rl_guard/lag/max"),
        lag_max_stale=m4.get("rl_guard/lag/max"),
        lag_bucket_1=m1.get("rl_guard/lag/1/token_frac"),
        lag_bucket_9=m4.get("rl_guard/lag/9+/token_frac"),
        behave_healthy=[m1.get("rl_guard/behave_imp_weight/min"), m1.get("rl_guard/behave_imp_weight/max")],
        behave_broken=s3["metrics"].get("rl_guard/behave_imp_weight/min"),
        behave_far=s5["metrics"].get("rl_guard/behave_imp_weight/min"),
        importance_healthy=[m1.get("rl_guard/importance_weight/min"), m1.get("rl_guard/importance_weight/max")],
        incidents=[(i.get("step"), i.get("rule"), i.get("action")) for i in incidents],
        snapshot_dir=str(guard.state.snapshot_dir),
        snapshot_files=sorted(os.listdir(guard.state.snapshot_dir)),
    )
    engine.save(recover)
    print(json.dumps(out), flush=True)
    engine.destroy()


if __name__ == "__main__":
    main()
