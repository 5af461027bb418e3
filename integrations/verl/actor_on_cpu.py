"""verl's real PPO actor on CPU, guarded by the one config line a verl user adds:
``actor_rollout_ref.model.external_lib=rl_guard.adapters.verl``.

    python integrations/verl/actor_on_cpu.py --world 2 --out runs/verl_cpu

Each rank is verl's ``ActorRolloutRefWorker`` (role ``actor``: ``TrainingWorker`` + FSDP2 engine over gloo, a tiny
Llama built locally). Each step is what ``RayPPOTrainer`` sends a worker: old log-probs recomputed by the actor
(``compute_log_prob``), then ``update_actor`` on this rank's share of the batch (two micro-batches, one optimizer
step). Steps: healthy, inf gradient (last rank only), healthy, NaN reward (last rank only), a reward jump that
``guard.yaml`` answers with a rollback, then a reward collapse it answers with checkpoint-and-halt. Around each
update every rank records sha256 digests of its FSDP parameter shards and optimizer state (``--out``/rankN.json);
the launcher prints, per step, the guard's action and whether the weights moved on each rank. Rank 0 logs every
update's metrics through verl's ``Tracking`` (tensorboard, ``--out``/tensorboard) the way ``RayPPOTrainer`` does.
At the end each rank saves and reloads a verl checkpoint (``--out``/checkpoint), which carries the guard's state.

Not verl's: the CPU platform (``cpu_platform.py``, registered through verl's plugin API) and the gloo process group
started here, because verl's ``initialize_global_process_group_ray`` asks for ``cpu:gloo,cpu:nccl`` and a CPU
torch build has no NCCL (under Ray the group is the same call, with the worker's RANK / WORLD_SIZE).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
B, P, R = 4, 3, 5  # sequences per rank, prompt and response length
MICRO = 2  # two micro-batches per rank: gradient accumulation inside one optimizer step
FAULTS = [None, "inf_grad", None, "nan_reward", "rollback", "halt"]
REWARD = {"rollback": 3.0, "halt": -10.0}  # reward levels guard.yaml's rules act on
RANK = WORLD = 0
MODEL = ""


def verl_config():
    import verl
    from omegaconf import OmegaConf

    root = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    a = "actor_rollout_ref"
    over = [
        f"{a}.model.path={MODEL}",
        f"{a}.model.external_lib=rl_guard.adapters.verl",
        f"{a}.model.use_remove_padding=false",
        f"{a}.model.enable_gradient_checkpointing=false",
        f"{a}.model.override_config.attn_implementation=eager",  # no flash-attn on CPU
        f"{a}.actor.strategy=fsdp2",
        f"{a}.actor.fsdp_config.strategy=fsdp2",  # FSDP1 needs a GPU for sync
        f"{a}.actor.fsdp_config.dtype=float32",
        f"{a}.actor.fsdp_config.use_torch_compile=false",
        f"{a}.actor.use_torch_compile=false",
        f"{a}.actor.optim.lr=0.01",
        f"{a}.actor.ppo_mini_batch_size={B * WORLD}",
        f"{a}.actor.ppo_micro_batch_size_per_gpu={MICRO}",
        f"{a}.rollout.log_prob_micro_batch_size_per_gpu={MICRO}",
        f"{a}.actor.calculate_entropy=true",
    ]
    return OmegaConf.merge(root, OmegaConf.from_dotlist(over))[a]


def rollout(step: int, fault: str | None) -> dict:
    """This rank's share of a rollout batch, padded as verl's trainer holds it."""
    g = torch.Generator().manual_seed(1000 * step + RANK)
    prompts, responses = torch.randint(4, 14, (B, P), generator=g), torch.randint(4, 14, (B, R), generator=g)
    response_mask = torch.ones(B, R, dtype=torch.long)
    response_mask[0, -2:] = 0  # a shorter response
    attention_mask = torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], 1)
    scores = torch.zeros(B, R)
    scores[:, 0] = torch.rand(B, generator=g) + REWARD.get(fault, 0.0)
    if fault == "nan_reward" and RANK == WORLD - 1:
        scores[1, 0] = math.nan  # a reward function returned NaN; the advantages below stay finite
    adv = (scores.sum(-1) - 0.5).nan_to_num(0.0)
    return {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "token_level_scores": scores,
        "token_level_rewards": scores.clone(),
        "advantages": adv[:, None].expand(B, R).contiguous() * response_mask,
    }


def to_td(batch: dict, **extra):
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    meta = {"temperature": 1.0, "multi_turn": False}
    td = left_right_2_no_padding(DataProto.from_single_dict(dict(batch), meta_info=meta).to_tensordict())
    tu.assign_non_tensor(td, **extra)
    return td


def digest(worker) -> dict:
    """sha256 of this rank's parameter shards and of the optimizer state (bitwise identity, cheap to compare)."""

    def sha(tensors):
        h = hashlib.sha256()
        for t in tensors:
            t = t.to_local() if hasattr(t, "to_local") else t
            # a copy: a numpy view would make FSDP's storage non-resizable
            h.update(t.detach().reshape(-1).clone().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    engine = worker.actor.engine
    params = list(engine.module.parameters())
    opt = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "params": sha(params),
        "optimizer": sha(opt),
        "finite": all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()) for p in params),
    }


def inf_grad_hook(worker):
    """An inf gradient on this rank: backward through the embeddings' output multiplies it by inf."""

    def poison(module, inputs, out):
        out.register_hook(lambda g: g * math.inf)  # returns None: the forward output itself is unchanged

    return worker.actor.engine.module.get_input_embeddings().register_forward_hook(poison)


def tracker(out: Path):
    """verl's own ``Tracking`` with its tensorboard backend, as ``RayPPOTrainer.fit`` builds it (rank 0 only)."""
    from verl.utils.tracking import Tracking

    os.environ["TENSORBOARD_DIR"] = str(out / "tensorboard")
    return Tracking(project_name="rl_guard_verl_cpu", experiment_name="actor", default_backend=["tensorboard"])


def log_like_the_trainer(logger, metrics: dict, step: int) -> None:
    """What ``RayPPOTrainer`` does with ``update_actor``'s metrics: ``_update_actor`` prefixes them ``actor/``,
    ``fit`` reduces them (``reduce_metrics``) and hands them to ``Tracking.log``."""
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    logger.log(data=reduce_metrics(rename_dict(dict(metrics), "actor/")), step=step)


def step(worker, n: int, fault: str | None, logger=None) -> dict:
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    batch = rollout(n, fault)
    old = worker.compute_log_prob(to_td(batch, calculate_entropy=True, compute_loss=False))
    batch["old_log_probs"] = no_padding_2_padding(tu.get(old, "log_probs"), to_td(batch)).float()
    hook = inf_grad_hook(worker) if fault == "inf_grad" and RANK == WORLD - 1 else None
    before = digest(worker)
    record = {"fault": fault, "before": before}
    try:
        out = worker.update_actor(
            to_td(
                batch,
                calculate_entropy=True,
                distillation_use_topk=False,
                distillation_only=False,
                global_batch_size=B * WORLD,
                mini_batch_size=B * WORLD,
                epochs=1,
                seed=42,
                dataloader_kwargs={"shuffle": False},
                compute_loss=True,
            )
        )
        metrics = tu.get(out, "metrics") if out is not None else {}
        if logger is not None:
            log_like_the_trainer(logger, metrics, step=n + 1)
        record["metrics"] = {
            k: [float(x) for x in (v if isinstance(v, list) else [v])]
            for k, v in metrics.items()
            if k.startswith("rl_guard/") or k in ("grad_norm", "loss")
        }
    except Exception as exc:  # noqa: BLE001 - a halt is expected to surface here
        record["raised"] = f"{type(exc).__name__}: {exc}"
    finally:
        if hook is not None:
            hook.remove()
    record["after"] = digest(worker)
    return record


def run_rank(rank: int, world: int, out: Path) -> None:
    global RANK, WORLD, MODEL
    RANK, WORLD, MODEL = rank, world, str(out / "model")
    # what Ray sets for a verl worker (verl's Worker reads them; the group itself starts from a file below)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    import cpu_platform

    cpu_platform.use_cpu_platform()
    from verl.workers.engine_workers import ActorRolloutRefWorker

    torch.distributed.init_process_group("gloo", init_method=f"file://{out / 'pg_init'}", rank=rank, world_size=world)
    worker = ActorRolloutRefWorker(verl_config(), role="actor")
    worker.init_model()  # verl imports external_lib here; the guard installs itself when the PPO loss is set
    result = {"guarded": getattr(worker.actor, "rl_guard", None) is not None, "world": world, "steps": []}
    logger = tracker(out) if rank == 0 else None
    for n, fault in enumerate(FAULTS):
        result["steps"].append(step(worker, n, fault, logger))
    if logger is not None:
        logger.finish()
    # verl's checkpoint path carries the guard's state: save, disturb the guard, load it back
    guard = worker.actor.rl_guard
    saved = {"step": guard.step, "skipped_steps": guard.skipped_steps}
    worker.save_checkpoint(str(out / "checkpoint" / "actor"), global_step=len(FAULTS))
    guard.controller.step, guard.controller.skipped_steps = 0, 0  # disturbed on purpose: the load must restore them
    worker.load_checkpoint(str(out / "checkpoint" / "actor"))
    result["resume"] = {"saved": saved, "loaded": {"step": guard.step, "skipped_steps": guard.skipped_steps}}
    torch.distributed.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def launch(world: int, out: Path, timeout: float = 600) -> list[int]:
    """Build the tiny model, start ``world`` ranks of this script, wait; returns their exit codes."""
    sys.path.insert(0, str(HERE.parents[1]))
    from rl_guard.demo.tiny import build_tiny_model

    out.mkdir(parents=True, exist_ok=True)
    build_tiny_model(out / "model")
    (out / "pg_init").unlink(missing_ok=True)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parents[1]), os.environ.get("PYTHONPATH")])),
    )
    env.setdefault("RL_GUARD_CONFIG", str(HERE / "guard.yaml"))
    env.setdefault("RL_GUARD_RUN_DIR", str(out / "run"))
    procs = []
    for r in range(world):
        with open(out / f"rank{r}.log", "w") as log:  # the rank writes to its own copy of the descriptor
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--rank", str(r), "--world", str(world), "--out", str(out)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            codes.append(-9)
    return codes


def summary(world: int, out: Path, run_dir: Path) -> str:
    """Per step: the fault, the guard's incidents (rule -> action), and whether each rank's weights moved."""
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    path = run_dir / "incidents.jsonl"
    acted: dict[int, list[str]] = {}
    for i in map(json.loads, path.read_text().splitlines() if path.exists() else []):
        acted.setdefault(i["step"], []).append(f"{i['rule']} -> {i['action']}")
    lines = [f"{'step':>4}  {'fault':<11} {'guard':<42} " + "  ".join(f"rank{r} weights" for r in range(world))]
    for n, fault in enumerate(FAULTS):
        moved = [
            "moved" if res["steps"][n]["before"] != res["steps"][n]["after"] else "unchanged (bitwise)"
            for res in results
        ]
        guard = "; ".join(acted.get(n, ["update applied"]))
        lines.append(f"{n:>4}  {fault or 'healthy':<11} {guard:<42} " + "  ".join(f"{m:<20}" for m in moved))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("runs/verl_cpu"))
    ap.add_argument("--rank", type=int, default=None, help="internal: run one rank")
    args = ap.parse_args()
    out = args.out.resolve()
    if args.rank is not None:
        try:
            run_rank(args.rank, args.world, out)
        except Exception:  # the launcher reads the error from the rank's file
            (out / f"rank{args.rank}.json").write_text(json.dumps({"error": traceback.format_exc()}))
            raise
        return
    codes = launch(args.world, out)
    if any(codes):
        sys.exit(f"ranks exited with {codes}; see {out}/rank*.log")
    run_dir = Path(os.environ.get("RL_GUARD_RUN_DIR", out / "run"))
    print(summary(args.world, out, run_dir))
    print(f"metrics and incidents: {run_dir}/")


if __name__ == "__main__":
    main()
