"""A small, real GRPO training in plain PyTorch (CleanRL-style, one file) with rl_guard attached.

Task: given a prompt digit d, emit the sequence d, d+1, d+2, d+3 (mod K) and then EOS. The policy is a tiny
autoregressive MLP over (prompt, previous token, position). Each step samples G completions per prompt, scores
them, builds group-relative advantages, and takes ``num_iterations`` clipped policy-gradient updates (so the
importance ratio moves off 1), with a k3 KL penalty to a frozen reference copy.

Run:  python integrations/pytorch_grpo/train.py --config configs/grpo.yaml --steps 60 [--fault lr_blowup]
Faults (for the guard to catch): lr_blowup, inf_grad, nan_reward, policy_mismatch, lr_ramp, reward_scale_ramp.
"""

from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from rl_guard import Guard, TokenBatch

K, T, EOS = 8, 6, 8  # digits 0..K-1, completion length T, EOS token id K
VOCAB = K + 1
FAULTS = ("none", "lr_blowup", "inf_grad", "nan_reward", "policy_mismatch", "lr_ramp", "reward_scale_ramp")


class Policy(nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.prompt = nn.Embedding(K, hidden)
        self.prev = nn.Embedding(VOCAB + 1, hidden)  # +1: a BOS id
        self.pos = nn.Embedding(T, hidden)
        self.mlp = nn.Sequential(nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, VOCAB))

    def logits(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] for every position given the previous tokens (teacher forcing)."""
        bos = torch.full_like(tokens[:, :1], VOCAB)
        prev = torch.cat([bos, tokens[:, :-1]], dim=1)
        h = self.prompt(prompts)[:, None] + self.prev(prev) + self.pos.weight[None, : tokens.shape[1]]
        return self.mlp(h)

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        tokens = torch.zeros(len(prompts), T, dtype=torch.long)
        for t in range(T):
            probs = torch.softmax(self.logits(prompts, tokens[:, : t + 1])[:, t], -1)
            tokens[:, t] = torch.multinomial(probs, 1, generator=gen)[:, 0]
        return tokens


def completion_mask(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask up to and including the first EOS; truncated = no EOS within T."""
    is_eos = tokens == EOS
    after = torch.cumsum(is_eos.long(), 1) - is_eos.long()
    return after == 0, ~is_eos.any(1)


def reward_fn(prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    target = (prompts[:, None] + torch.arange(4)) % K
    correct = (tokens[:, :4] == target).float().mean(1)
    return correct + 0.25 * (tokens[:, 4] == EOS).float()


def token_logprobs(model: Policy, prompts, tokens):
    logp_all = torch.log_softmax(model.logits(prompts, tokens), -1)
    logp = logp_all.gather(-1, tokens[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def optimizer_step(guard: Guard | None, opt, sched, res, step: int):
    """The guard's part of an optimizer step: decide before it, step unless refused, then report the step."""
    decision = guard.check() if guard is not None else None  # after backward, before optimizer.step()
    if decision is None or decision.apply_step:
        opt.step()
        sched.step()
    opt.zero_grad(set_to_none=True)
    if guard is not None:
        guard.step_done()
        if decision.firings:
            res.decisions.append((step, decision.action, decision.messages))
    return decision


@dataclass
class RunResult:
    steps_run: int = 0
    decisions: list = field(default_factory=list)  # (step, action, messages)
    first_nonfinite_step: int | None = None  # first step where loss/grad/weights went non-finite
    params_finite_every_step: bool = True
    rewards: list = field(default_factory=list)
    guard: Guard | None = None


def run(
    config: str | None = "configs/grpo.yaml",
    steps: int = 60,
    fault: str = "none",
    fault_step: int = 30,
    seed: int = 0,
    run_dir: str | None = None,
    lr: float = 3e-3,
    guard: Guard | None = None,
    prompts_per_step: int = 16,
    group: int = 4,
    num_iterations: int = 2,
    beta: float = 0.02,
    stop_on_nonfinite: bool = True,
    on_step=None,
) -> RunResult:
    """Train; returns what happened. ``config=None`` runs unguarded (the twin used to find the NaN step).

    ``on_step(step, iteration, decision, model, optimizer, scheduler)``, if given, is called after every optimizer
    step (applied or not; ``decision`` is None when unguarded), e.g. to inspect the state the guard left behind.
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = Policy()
    ref = copy.deepcopy(model).requires_grad_(False)
    other = Policy()  # a different policy, for the behaviour-mismatch fault
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    if guard is None and config is not None:
        guard = Guard.from_yaml(config, run_dir=run_dir)
    if guard is not None:
        guard.attach(model, opt, sched)
    res = RunResult(guard=guard)
    for step in range(steps):
        if fault == "lr_blowup" and step == fault_step:
            for g in opt.param_groups:
                g["lr"] = lr * 1e4
        if fault == "lr_ramp" and step >= fault_step:
            for g in opt.param_groups:
                g["lr"] = lr * 1.5 ** (step - fault_step + 1)
        prompts = torch.randint(0, K, (prompts_per_step,), generator=gen).repeat_interleave(group)
        behaviour = other if fault == "policy_mismatch" and step >= fault_step else model
        tokens = behaviour.sample(prompts, gen)
        mask, truncated = completion_mask(tokens)
        rewards = reward_fn(prompts, tokens)
        if fault == "nan_reward" and step == fault_step:
            rewards[3] = float("nan")
        if fault == "reward_scale_ramp" and step >= fault_step:
            # x100 per step: float32 gradients overflow about 19 steps in (Adam normalises the update until then)
            rewards = rewards * 100.0 ** (step - fault_step + 1)
        grouped = rewards.view(-1, group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
        if fault == "reward_scale_ramp" and step >= fault_step:
            adv = rewards - rewards.mean()  # an un-normalised baseline: the scale reaches the gradient
        with torch.no_grad():
            old_logp, _ = token_logprobs(behaviour, prompts, tokens)
            ref_logp, _ = token_logprobs(ref, prompts, tokens)
        res.rewards.append(float(torch.nanmean(rewards)))
        for it in range(num_iterations):
            logp, entropy = token_logprobs(model, prompts, tokens)
            ratio = torch.exp(logp - old_logp)
            clipped = torch.clamp(ratio, 0.8, 1.2)
            pg = -torch.min(ratio * adv[:, None], clipped * adv[:, None])
            kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
            loss = ((pg + beta * kl) * mask).sum() / mask.sum()
            if guard is not None:
                guard.observe(
                    TokenBatch(
                        logp,
                        mask,
                        old_logprobs=old_logp,
                        ref_logprobs=ref_logp,
                        entropy=entropy,
                        advantages=adv,
                        rewards=rewards,
                        truncated=truncated,
                    ),
                    loss=loss,
                )
            loss.backward()
            if fault == "inf_grad" and step == fault_step and it == 0:
                model.mlp[-1].weight.grad[0, 0] = float("inf")
            grads_finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
            if not (math.isfinite(loss.item()) and grads_finite) and res.first_nonfinite_step is None:
                res.first_nonfinite_step = step
            decision = optimizer_step(guard, opt, sched, res, step)
            if on_step is not None:
                on_step(step, it, decision, model, opt, sched)
            finite = all(torch.isfinite(p).all() for p in model.parameters())
            res.params_finite_every_step &= finite
            if not finite and res.first_nonfinite_step is None:
                res.first_nonfinite_step = step
            if decision is not None and decision.stop:
                res.steps_run = step + 1
                return _finish(res)
            if decision is not None and decision.rollback:
                break  # resample: the rolled-back policy generates fresh rollouts
        res.steps_run = step + 1
        if res.first_nonfinite_step is not None and stop_on_nonfinite and guard is None:
            break
    return _finish(res)


def _finish(res: RunResult) -> RunResult:
    if res.guard is not None:
        res.guard.close()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/grpo.yaml")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fault", choices=FAULTS, default="none")
    ap.add_argument("--fault-step", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", default="runs/pytorch_grpo")
    args = ap.parse_args(argv)
    res = run(args.config, args.steps, args.fault, args.fault_step, args.seed, args.run_dir)
    for _step, _action, messages in res.decisions:
        for m in messages:
            print(m)
    print(
        f"steps run: {res.steps_run}; mean reward first/last 5: {sum(res.rewards[:5]) / 5:.3f} / "
        f"{sum(res.rewards[-5:]) / 5:.3f}; weights finite every step: {res.params_finite_every_step}; "
        f"run dir: {args.run_dir}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
