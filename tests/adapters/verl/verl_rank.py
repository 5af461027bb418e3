"""One rank of a real verl actor (``ActorRolloutRefWorker``, role ``actor``, FSDP2 on gloo, tiny Llama) guarded
through ``actor_rollout_ref.model.external_lib=rl_guard.adapters.verl``; writes what it saw as JSON.

Usage: ``verl_rank.py RANK WORLD INIT_FILE OUT_DIR MODEL_DIR``. Each step is what ``RayPPOTrainer`` sends a worker:
old log-probs recomputed by the actor itself (``compute_log_prob``), then ``update_actor`` on this rank's shard.
Steps: healthy, inf gradient (on the last rank only), healthy, NaN reward (last rank only), a reward jump that
the test's rules answer with a rollback, then one they answer with checkpoint-and-halt. Around each update the rank records digests of its FSDP parameter shards and optimizer state.

Not verl's: the CPU platform (``cpu_platform.py``, registered through verl's plugin API) and the gloo process group
started here, because verl's ``initialize_global_process_group_ray`` asks for ``cpu:gloo,cpu:nccl`` and this torch
build has no NCCL (under Ray the group is the same call, with the worker's RANK / WORLD_SIZE).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch

RANK, WORLD, INIT, OUT, MODEL = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5]
os.environ.update(RANK=str(RANK), WORLD_SIZE=str(WORLD), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_platform  # noqa: E402

cpu_platform.use_cpu_platform()

from omegaconf import OmegaConf  # noqa: E402

import verl  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

B, P, R = 4, 3, 5  # sequences per rank, prompt and response length
FAULTS = [None, "inf_grad", None, "nan_reward", "rollback", "halt"]
MICRO = 2  # two micro-batches per rank: gradient accumulation inside one optimizer step


def verl_config():
    root = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    a = "actor_rollout_ref"
    over = [f"{a}.model.path={MODEL}", f"{a}.model.external_lib=rl_guard.adapters.verl",
            f"{a}.model.use_remove_padding=false", f"{a}.model.enable_gradient_checkpointing=false",
            f"{a}.model.override_config.attn_implementation=eager",  # no flash-attn on CPU
            f"{a}.actor.strategy=fsdp2", f"{a}.actor.fsdp_config.strategy=fsdp2",  # FSDP1 needs a GPU for sync
            f"{a}.actor.fsdp_config.dtype=float32", f"{a}.actor.fsdp_config.use_torch_compile=false",
            f"{a}.actor.use_torch_compile=false", f"{a}.actor.optim.lr=0.01",
            f"{a}.actor.ppo_mini_batch_size={B * WORLD}", f"{a}.actor.ppo_micro_batch_size_per_gpu={MICRO}",
            f"{a}.rollout.log_prob_micro_batch_size_per_gpu={MICRO}", f"{a}.actor.calculate_entropy=true"]
    return OmegaConf.merge(root, OmegaConf.from_dotlist(over))[a]


REWARD = {"rollback": 3.0, "halt": -10.0}  # reward levels the test's rules act on (see test_verl_actor.py)


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
    return {"input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "prompts": prompts, "responses": responses,
            "response_mask": response_mask, "token_level_scores": scores, "token_level_rewards": scores.clone(),
            "advantages": adv[:, None].expand(B, R).contiguous() * response_mask}


def to_td(batch: dict, **meta):
    td = left_right_2_no_padding(DataProto.from_single_dict(dict(batch), meta_info={"temperature": 1.0, "multi_turn": False}).to_tensordict())
    tu.assign_non_tensor(td, **meta)
    return td


def digest(worker) -> dict:
    """sha256 of this rank's parameter shards and of the optimizer state (bitwise identity, cheap to compare)."""
    def sha(tensors):
        h = hashlib.sha256()
        for t in tensors:
            t = t.to_local() if hasattr(t, "to_local") else t
            h.update(t.detach().reshape(-1).clone().view(torch.uint8).numpy().tobytes())  # a copy: numpy must not share FSDP storage
        return h.hexdigest()
    engine = worker.actor.engine
    params = list(engine.module.parameters())
    opt = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": sha(params), "optimizer": sha(opt), "finite": all(bool(torch.isfinite(
        p.to_local() if hasattr(p, "to_local") else p).all()) for p in params)}


def inf_grad_hook(worker):
    """An inf gradient on this rank: backward through the embeddings' output multiplies it by inf."""
    def poison(module, inputs, out):
        out.register_hook(lambda g: g * math.inf)  # returns None: the forward output itself is unchanged

    return worker.actor.engine.module.get_input_embeddings().register_forward_hook(poison)


def step(worker, n: int, fault: str | None) -> dict:
    batch = rollout(n, fault)
    old = worker.compute_log_prob(to_td(batch, calculate_entropy=True, compute_loss=False))
    batch["old_log_probs"] = no_padding_2_padding(tu.get(old, "log_probs"), to_td(batch)).float()
    hook = inf_grad_hook(worker) if fault == "inf_grad" and RANK == WORLD - 1 else None
    before = digest(worker)
    record = {"fault": fault, "before": before}
    try:
        out = worker.update_actor(to_td(batch, calculate_entropy=True, distillation_use_topk=False,
                                        distillation_only=False, global_batch_size=B * WORLD,
                                        mini_batch_size=B * WORLD, epochs=1, seed=42,
                                        dataloader_kwargs={"shuffle": False}, compute_loss=True))
        metrics = tu.get(out, "metrics") if out is not None else {}
        record["metrics"] = {k: [float(x) for x in (v if isinstance(v, list) else [v])] for k, v in metrics.items()
                             if k.startswith("rl_guard/") or k in ("grad_norm", "loss")}
    except Exception as exc:  # noqa: BLE001 - a halt is expected to surface here
        record["raised"] = f"{type(exc).__name__}: {exc}"
    finally:
        if hook is not None:
            hook.remove()
    record["after"] = digest(worker)
    return record


def main() -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{INIT}", rank=RANK, world_size=WORLD)
    worker = ActorRolloutRefWorker(verl_config(), role="actor")
    worker.init_model()
    guard = getattr(worker.actor, "rl_guard", None)
    result = {"guarded": guard is not None, "world": WORLD, "steps": []}
    for n, fault in enumerate(FAULTS):
        result["steps"].append(step(worker, n, fault))
    torch.distributed.barrier()
    (OUT / f"rank{RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        (OUT / f"rank{RANK}.json").write_text(json.dumps({"error": traceback.format_exc()}))
        raise
