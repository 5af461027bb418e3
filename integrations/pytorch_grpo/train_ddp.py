"""Data-parallel variant of the plain-PyTorch GRPO recipe (``train.py``): DDP on gloo, prompts sharded by rank.

Every rank draws the same global prompts (a shared seed) and keeps every ``world``-th prompt group, so groups stay
whole (advantages are group-relative); completions are sampled with a per-rank generator. Each rank's loss is its
own token mean and DDP averages the gradients, so the weights stay identical on every rank. The guard merges the
statistics of all ranks (two collectives per step, see ``rl_guard/stats/ranks.py``) and every rank takes the same
decision at the same step.

Run:  torchrun --nproc_per_node 2 integrations/pytorch_grpo/train_ddp.py --steps 30 [--fault inf_grad --fault-rank 1]
``inf_grad`` is injected after backward, i.e. after DDP's gradient all-reduce, so only ``--fault-rank`` holds it
(a fault before backward, such as ``nan_reward``, reaches every rank's gradients through that all-reduce).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import FAULTS, K, Policy, RunResult, completion_mask, optimizer_step, reward_fn

from rl_guard import Guard, TokenBatch


class Forward(nn.Module):
    """Routes the policy's teacher-forced logits through ``forward`` so DDP's gradient hooks see the call."""

    def __init__(self, policy: Policy):
        super().__init__()
        self.policy = policy

    def forward(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.policy.logits(prompts, tokens)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(-1, tokens[..., None])[..., 0], -(logp_all.exp() * logp_all).sum(-1)


def weights_digest(model: nn.Module) -> str:
    """sha256 of every parameter's bytes: equal digests on two ranks mean bit-identical weights."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass
class DDPRunResult(RunResult):
    records: list = field(default_factory=list)  # per optimizer step: action, local tokens, weights digest, metrics


def run_ddp(
    config: str | None = "configs/grpo.yaml",
    steps: int = 30,
    fault: str = "none",
    fault_step: int = 15,
    fault_rank: int = 1,
    seed: int = 0,
    run_dir: str | None = None,
    lr: float = 3e-3,
    prompts_per_step: int = 16,
    group: int = 4,
    num_iterations: int = 2,
    beta: float = 0.02,
) -> DDPRunResult:
    """Train on the already initialised process group; ``prompts_per_step`` is the global count."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)  # same initial weights everywhere (DDP also broadcasts rank 0's at wrap time)
    shared = torch.Generator().manual_seed(seed)
    local = torch.Generator().manual_seed(seed + 1 + rank)
    policy = Policy()
    ref = copy.deepcopy(policy).requires_grad_(False)
    model = DDP(Forward(policy))
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    guard = Guard.from_yaml(config, run_dir=run_dir).attach(policy, opt, sched) if config is not None else None
    res = DDPRunResult(guard=guard)
    for step in range(steps):
        if fault == "lr_blowup" and step == fault_step:
            for g in opt.param_groups:
                g["lr"] = lr * 1e4
        ids = torch.randint(0, K, (prompts_per_step,), generator=shared)
        prompts = ids[rank::world].repeat_interleave(group)
        tokens = policy.sample(prompts, local)
        mask, truncated = completion_mask(tokens)
        rewards = reward_fn(prompts, tokens)
        if fault == "nan_reward" and step == fault_step and rank == fault_rank:
            rewards[3] = float("nan")
        grouped = rewards.view(-1, group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
        with torch.no_grad():
            old_logp, _ = logprobs_of(policy.logits(prompts, tokens), tokens)
            ref_logp, _ = logprobs_of(ref.logits(prompts, tokens), tokens)
        res.rewards.append(float(torch.nanmean(rewards)))
        for it in range(num_iterations):
            logp, entropy = logprobs_of(model(prompts, tokens), tokens)
            ratio = torch.exp(logp - old_logp)
            pg = -torch.min(ratio * adv[:, None], torch.clamp(ratio, 0.8, 1.2) * adv[:, None])
            kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
            loss = ((pg + beta * kl) * mask).sum() / mask.sum()
            if guard is not None:
                guard.observe(
                    TokenBatch(
                        logp.detach(),
                        mask,
                        old_logprobs=old_logp,
                        ref_logprobs=ref_logp,
                        entropy=entropy.detach(),
                        advantages=adv,
                        rewards=rewards,
                        truncated=truncated,
                    ),
                    loss=loss.detach(),
                )
            loss.backward()  # DDP all-reduces (averages) the gradients here
            if fault == "inf_grad" and step == fault_step and it == 0 and rank == fault_rank:
                policy.mlp[-1].weight.grad[0, 0] = float("inf")
            if not math.isfinite(loss.item()) and res.first_nonfinite_step is None:
                res.first_nonfinite_step = step
            decision = optimizer_step(guard, opt, sched, res, step)
            finite = all(bool(torch.isfinite(p).all()) for p in policy.parameters())
            res.params_finite_every_step &= finite
            res.records.append(
                {
                    "step": step,
                    "it": it,
                    "action": decision.action if decision else None,
                    "local_tokens": int(mask.sum()),
                    "digest": weights_digest(policy),
                    "metrics": dict(guard.last_logged) if guard is not None else {},
                }
            )
            if decision is not None and (decision.stop or decision.rollback):
                break
        res.steps_run = step + 1
        if decision is not None and decision.stop:
            break
    if guard is not None:
        guard.close()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/grpo.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fault", choices=FAULTS, default="none")
    ap.add_argument("--fault-step", type=int, default=15)
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", default="runs/pytorch_grpo_ddp")
    ap.add_argument("--init-method", default="env://", help="torch.distributed init method (torchrun sets env://)")
    args = ap.parse_args(argv)
    dist.init_process_group("gloo", init_method=args.init_method)
    try:
        res = run_ddp(args.config, args.steps, args.fault, args.fault_step, args.fault_rank, args.seed, args.run_dir)
        if dist.get_rank() == 0:
            for _, _, messages in res.decisions:
                print("\n".join(messages))
            n = min(5, len(res.rewards))
            print(
                f"steps run: {res.steps_run}; mean reward (rank 0 shard) first/last {n}: "
                f"{sum(res.rewards[:n]) / n:.3f} / {sum(res.rewards[-n:]) / n:.3f}; weights finite every step: "
                f"{res.params_finite_every_step}; run dir: {args.run_dir}"
            )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
