"""A PPO actor update shaped like OpenRLHF 0.11.2's ``ActorPPOTrainer``, on CPU, with rl_guard attached.

OpenRLHF's own code here: the ``Experience`` dataclass with its replay-buffer helpers
(``split_experience_batch`` / ``make_experience_batch``), ``PolicyLoss`` (with train/rollout IS correction) and
the per-optimizer-step loss normaliser ``iter_grad_accum_global_norm`` (see ``openrlhf_files.py``). A real
OpenRLHF run needs Ray, vLLM and DeepSpeed on GPUs, so the rest is a plain-PyTorch stand-in that keeps
OpenRLHF's interfaces: ``Engine`` makes the ``DeepSpeedEngine`` calls OpenRLHF relies on (backward, ``step()``
that updates only at the accumulation boundary, checkpoints), ``TorchStrategy`` the ``DeepspeedStrategy`` methods,
``TinyActor`` the ``Actor.forward`` contract, ``make_experience`` the experience maker's fields and
``ppo_train`` / ``training_step`` the trainer's order of calls. The rl_guard calls are the ones a real run makes
(``install(trainer, guard)`` does the same on a real ``ActorPPOTrainer``): ``guard_policy_loss`` at the
PolicyLoss call, ``gate_optimizer_step`` on the strategy, ``attach_checkpoints`` for save / rollback.

Task: prompt digit d -> respond d, d+1, d+2, d+3 (mod K); rewards are group-normalised (OpenRLHF group_norm).
Fault: ``rollout_mismatch`` samples from another policy from ``--fault-step`` on (vLLM serving stale or wrong
weights), so rollout log-probs disagree with the trainer's.

Run:  python integrations/openrlhf/train.py --steps 20 [--fault rollout_mismatch --fault-step 10]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import openrlhf_files

from rl_guard import Guard
from rl_guard.adapters.openrlhf import attach_checkpoints, gate_optimizer_step, guard_policy_loss
from rl_guard.errors import GuardHalted

K, R = 8, 4  # digits, response tokens
BOS, V = K, K + 1
T = 2 + R  # [BOS, digit, response...]
A = T - 1  # OpenRLHF: action_mask covers tokens 1..T-1; prompt positions are 0
OR = openrlhf_files.load()

# A guard rule for train/rollout mismatch: OpenRLHF's own ICEPOP band starts at 0.5 (is_correction_threshold).
MISMATCH_RULE = """
version: 1
sinks: [jsonl]
rules:
  - name: train_rollout_mismatch
    metric: rl_guard/behave_imp_weight/min
    op: "<"
    threshold: 0.5
    action: {action}
"""


class Engine:
    """The DeepSpeedEngine calls OpenRLHF makes, for one plain torch optimizer."""

    def __init__(self, module: nn.Module, lr: float, gas: int, max_norm: float = 1.0):
        self.module, self.gas, self.max_norm = module, gas, max_norm
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        self.micro_steps = self.global_steps = 0
        self._global_grad_norm = None

    def backward(self, loss):
        (loss / self.gas).backward()  # DeepSpeed scales by 1/gas (OpenRLHF's normalisers pre-compensate)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gas == 0

    def step(self):
        if self.is_gradient_accumulation_boundary():
            self._global_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_norm))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.lr_scheduler.step()
            self.global_steps += 1
        self.micro_steps += 1

    def get_global_grad_norm(self):
        return self._global_grad_norm

    def save_checkpoint(self, save_dir, tag, client_state=None, save_latest=True):
        path = Path(save_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "module": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "global_steps": self.global_steps,
                "client_state": client_state or {},
            },
            path / "state.pt",
        )
        if save_latest:
            (Path(save_dir) / "latest").write_text(tag)

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        latest = Path(load_dir) / "latest"
        tag = tag or (latest.read_text() if latest.exists() else None)
        path = Path(load_dir) / str(tag) / "state.pt"
        if tag is None or not path.exists():
            return None, None
        state = torch.load(path, weights_only=False)
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.global_steps = state["global_steps"]
        return str(path.parent), state["client_state"]


class TorchStrategy:
    """The DeepspeedStrategy methods ActorPPOTrainer and PolicyModelActor call (one rank)."""

    def __init__(self, args, accumulated_gradient: int):
        self.args, self.accumulated_gradient, self.ring_attn_group = args, accumulated_gradient, None

    def backward(self, loss, model, optimizer, **kwargs):
        model.model.backward(loss)

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kwargs):
        model.model.step()

    def get_grad_norm(self, model) -> float:
        return float(model.model.get_global_grad_norm() or 0.0)

    def all_reduce(self, data, op="mean"):
        return data

    def save_ckpt(
        self,
        model,
        save_dir,
        tag=None,
        max_num=3,
        max_mem=1000,
        client_state=None,
        save_latest=True,
        metric_value=None,
        metric_key=None,
    ):
        model.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest)
        tags = sorted((p for p in Path(save_dir).iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime_ns)
        for old in tags[:-max_num]:  # OpenRLHF rotates by max_num (and max_mem) on rank 0
            for f in old.iterdir():
                f.unlink()
            old.rmdir()

    def load_ckpt(self, model, load_dir, tag=None, **kwargs):
        path, states = model.load_checkpoint(load_dir, tag=tag)
        return (path, states) if path is not None else (None, {})


class TinyActor(nn.Module):
    """``Actor.forward``: ``(action_log_probs[:, -A:] * action_mask, output)`` with ``output.entropy`` (B, T-1)."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.tok, self.pos, self.prompt = nn.Embedding(V, hidden), nn.Embedding(T, hidden), nn.Embedding(K, hidden)
        self.mlp = nn.Sequential(nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, V))
        self.model = None  # the engine, as after strategy.prepare()

    def logits(self, seq):
        return self.mlp(self.tok(seq) + self.pos.weight[: seq.shape[1]] + self.prompt(seq[:, 1:2]))

    def forward(self, sequences, action_mask, attention_mask=None, return_output=False, return_entropy=False, **kw):
        logp_all = torch.log_softmax(self.logits(sequences).float(), -1)
        log_probs = logp_all[:, :-1].gather(-1, sequences[:, 1:, None])[..., 0]
        out = SimpleNamespace(entropy=-(logp_all.exp() * logp_all).sum(-1)[:, :-1] if return_entropy else None)
        action_log_probs = log_probs[:, -action_mask.shape[1] :] * action_mask
        return (action_log_probs, out) if return_output else action_log_probs


@torch.no_grad()
def make_experience(actor, ref, sampler, prompts, group, gen):
    """The experience maker's output: vLLM-side sampling + logprobs, the trainer's recompute, reference, rewards."""
    d = torch.randint(0, K, (prompts,), generator=gen).repeat_interleave(group)
    seq = torch.full((len(d), T), BOS, dtype=torch.long)
    seq[:, 1] = d
    for t in range(2, T):
        seq[:, t] = torch.multinomial(torch.softmax(sampler.logits(seq)[:, t - 1].float(), -1), 1, generator=gen)[:, 0]
    mask = torch.ones(len(d), A, dtype=torch.bool)
    mask[:, 0] = False  # token 1 is the prompt digit
    rewards = (seq[:, 2:] == (d[:, None] + torch.arange(R)) % K).float().mean(1)
    g = rewards.view(-1, group)
    adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-9)).reshape(-1)
    return OR.Experience(
        sequences=seq,
        attention_mask=torch.ones_like(seq),
        action_mask=mask,
        action_log_probs=actor(seq, mask),
        base_action_log_probs=ref(seq, mask),
        rollout_log_probs=sampler(seq, mask),
        advantages=adv[:, None] * mask,
        returns=adv[:, None] * mask,
        rewards=rewards,
        response_length=mask.sum(1).float(),
        truncated=torch.zeros(len(d), dtype=torch.bool),
        total_length=torch.full((len(d),), float(T)),
        index=list(range(len(d))),
        info={"reward": rewards},
    )


def training_step(actor, strategy, guard, policy_loss, experience, loss_batch_info, kl_coef=0.01) -> dict:
    """ActorPPOTrainer.training_step's order: forward, PolicyLoss (observed), k3 KL loss, backward, step."""
    log_probs, output = actor(
        experience.sequences,
        experience.action_mask,
        attention_mask=experience.attention_mask,
        return_output=True,
        return_entropy=True,
    )
    loss, clip_ratio, ppo_kl, vllm_kl, is_filter = guard_policy_loss(
        guard, policy_loss, experience, log_probs, entropy=output.entropy, **loss_batch_info
    )
    log_r = experience.base_action_log_probs - log_probs  # OpenRLHF's k3 estimator against the reference
    kl = ((log_r.exp() - 1 - log_r) * experience.action_mask).sum() / experience.action_mask.sum()
    strategy.backward(loss + kl_coef * kl, actor, actor.model.optimizer)
    strategy.optimizer_step(actor.model.optimizer, actor, actor.model.lr_scheduler, name="actor")
    return {
        "policy_loss": loss.item(),
        "ppo_clip_ratio": clip_ratio.item(),
        "ppo_kl": ppo_kl.item(),
        "vllm_kl": vllm_kl.item(),
        "is_filter_ratio": is_filter.item(),
        "kl": kl.item(),
    }


def ppo_train(actor, strategy, guard, policy_loss, experience, micro_batch: int) -> dict:
    """Replay buffer -> micro-batches -> training steps; returns the status dict the driver logs."""
    items = OR.split_experience_batch(experience)
    mbs = [OR.make_experience_batch(items[i : i + micro_batch]) for i in range(0, len(items), micro_batch)]
    statuses = [
        training_step(actor, strategy, guard, policy_loss, mb, info)
        for mb, info in OR.iter_grad_accum_global_norm(
            mbs, strategy, strategy.accumulated_gradient, lambda e: e.action_mask
        )
    ]
    status = {k: sum(s[k] for s in statuses) / len(statuses) for k in statuses[0]}
    status["actor_grad_norm"] = strategy.get_grad_norm(actor)
    status.update(guard.last_logged)  # what install() merges into ppo_train's status: train/rl_guard/... in wandb
    return status


@dataclass
class RunResult:
    steps_run: int = 0
    statuses: list = field(default_factory=list)
    incidents: list = field(default_factory=list)
    halted: str | None = None
    guard: Guard | None = None
    actor: nn.Module | None = None


def run(
    config="configs/ppo.yaml",
    steps=20,
    fault="none",
    fault_step=10,
    seed=0,
    run_dir="runs/openrlhf",
    lr=3e-3,
    prompts=4,
    group=4,
    micro_batch=4,
    gas=2,
) -> RunResult:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    actor, other = TinyActor(), TinyActor()
    ref = TinyActor()
    ref.load_state_dict(actor.state_dict())
    actor.model = Engine(actor, lr, gas)
    args = SimpleNamespace(ckpt=SimpleNamespace(path=str(Path(run_dir) / "ckpt")))
    strategy = TorchStrategy(args, accumulated_gradient=gas)
    policy_loss = OR.PolicyLoss(
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        is_correction_level="token",
        is_correction_mode="mask",
        is_correction_threshold=(0.5, 5.0),
    )
    guard = Guard.from_yaml(config, run_dir=run_dir)
    attach_checkpoints(
        guard,
        strategy,
        actor,
        actor.model.optimizer,
        actor.model.lr_scheduler,
        str(Path(args.ckpt.path) / "_actor_rl_guard"),
    )
    gate_optimizer_step(strategy, actor, guard)
    res = RunResult(guard=guard, actor=actor)
    try:
        for step in range(steps):
            sampler = other if fault == "rollout_mismatch" and step >= fault_step else actor
            experience = make_experience(actor, ref, sampler, prompts, group, gen)
            res.statuses.append(ppo_train(actor, strategy, guard, policy_loss, experience, micro_batch))
            res.steps_run = step + 1
    except GuardHalted as exc:
        res.halted = str(exc)
    guard.close()
    path = Path(run_dir) / "incidents.jsonl"
    res.incidents = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/ppo.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--fault", choices=("none", "rollout_mismatch"), default="none")
    ap.add_argument("--fault-step", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", default="runs/openrlhf")
    a = ap.parse_args(argv)
    res = run(a.config, a.steps, a.fault, a.fault_step, a.seed, a.run_dir)
    for inc in res.incidents:
        print(inc["message"])
    last = res.statuses[-1] if res.statuses else {}
    print(
        f"ppo_train calls: {res.steps_run}; policy_loss {last.get('policy_loss')}; "
        f"rl_guard/ratio/mean {last.get('rl_guard/ratio/mean')}; halted: {res.halted}; run dir: {a.run_dir}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
