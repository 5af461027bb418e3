"""What each rank runs in the multi-process tests; every scenario returns a JSON-able record for the test to read.

Data is generated from (seed, step, rank) alone, so the test process can rebuild every rank's batches and feed
them to a single-process guard as the reference.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from rl_guard import Guard, TokenBatch
from rl_guard.glossary import comparable
from rl_guard.stats import ranks as rg_dist

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)
MERGE_CFG = "version: 1\nsinks: [jsonl]\nbuiltin_rules: {nonfinite_grad: false}\n"
FAULT_STEP = 3


class CollectiveLog:
    """Wraps every ``torch.distributed`` collective and records (name, op, numel, bytes) of each call."""

    def __init__(self):
        self.calls: list = []
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            t = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("tensor")
            op = kwargs.get("op", args[1] if name == "all_reduce" and len(args) > 1 else None)
            numel = t.numel() if isinstance(t, torch.Tensor) else None
            nbytes = numel * t.element_size() if numel is not None else None
            self.calls.append([name, str(op) if op is not None else None, numel, nbytes])
            return fn(*args, **kwargs)

        return wrapper

    def take(self) -> list:
        out, self.calls = self.calls, []
        return out


# -- statistics -----------------------------------------------------------------------------------------------------
def rank_batches(seed: int, step: int, rank: int, ref: bool = True) -> list:
    """(TokenBatch, loss) micro-batches of one rank at one step; sizes and counts differ per rank and step."""
    g = torch.Generator().manual_seed(seed * 100_003 + step * 101 + rank)
    out = []
    for i in range(1 + (rank + step) % 3):
        B, T = 2 + (3 * rank + i + step) % 5, 7 + 4 * rank + i
        logp = -3.0 * torch.rand(B, T, generator=g)
        mask = torch.rand(B, T, generator=g) < 0.8
        mask[:, 0] = True
        tail = 1.0 + 20.0 * (torch.rand(B, T, generator=g) < 0.05)
        old = logp + 0.05 * tail * torch.randn(B, T, generator=g)
        if step == 1 and i == 0:
            old[0, 0] = math.nan  # a masked-in non-finite input: counted per rank, summed across ranks
        fields = dict(
            old_logprobs=old,
            entropy=2.0 * torch.rand(B, T, generator=g),
            advantages=torch.randn(B, generator=g),
            rewards=torch.rand(B, generator=g),
            truncated=torch.rand(B, generator=g) < 0.3,
        )
        if ref:
            fields["ref_logprobs"] = logp + 0.1 * torch.randn(B, T, generator=g)
        if step == 2:
            fields.update(versions=torch.randint(30, 41, (B,), generator=g).float(), current_version=40)
        out.append((TokenBatch(logp, mask, **fields), torch.randn((), generator=g)))
    return out


def hists_json(hists: dict) -> dict:
    return {k: [int(c) for c in counts] for k, (edges, counts) in hists.items()}


def scenario_merge(rank, world, out: Path, log: CollectiveLog, seed: int = 7, steps: int = 3) -> dict:
    guard = Guard.from_yaml(MERGE_CFG, run_dir=out / "merge")
    rec = {"steps": []}
    log.take()
    for step in range(steps):
        for batch, loss in rank_batches(seed, step, rank):
            guard.observe(batch, loss=loss)
        observe_calls = log.take()
        decision = guard.check()
        check_calls = log.take()
        guard.step_done()
        rec["steps"].append(
            {
                "metrics": comparable(guard.last_metrics),
                "hists": hists_json(guard.last_histograms),
                "action": decision.action,
                "observe_calls": observe_calls,
                "check_calls": check_calls,
                "step_done_calls": log.take(),
            }
        )
    guard.close()
    return rec


def scenario_mismatch(rank, world, out: Path, log: CollectiveLog) -> dict:
    """The last rank passes ref_logprobs, the others do not."""
    guard = Guard.from_yaml(MERGE_CFG, run_dir=out / "mismatch")
    for batch, loss in rank_batches(3, 0, rank, ref=rank == world - 1):
        guard.observe(batch, loss=loss)
    log.take()
    try:
        guard.check()
        return {"raised": None, "calls": log.take()}
    except Exception as exc:  # noqa: BLE001 - the test asserts on the type
        return {"raised": type(exc).__name__, "message": str(exc), "calls": log.take()}


def scenario_abstain(rank, world, out: Path, log: CollectiveLog) -> dict:
    """The last rank's guard 'fails' before merging and abstains; the others' guards must not wait for it."""
    guard = Guard.from_yaml(MERGE_CFG, run_dir=out / "abstain")
    for batch, loss in rank_batches(5, 0, rank):
        guard.observe(batch, loss=loss)
    log.take()
    if rank == world - 1:
        try:
            raise RuntimeError("an internal error before the merge")
        except RuntimeError as exc:
            guard._internal_failure("check", exc)  # the guard's own failure path: warn, drop the step's partials
        rg_dist.abstain()
        first = {"action": None, "internal_failures": guard.internal_failures}
    else:
        decision = guard.check()
        first = {"action": decision.action, "internal_failures": guard.internal_failures}
    first["calls"] = log.take()
    guard.step_done()
    for batch, loss in rank_batches(5, 1, rank):  # the next step merges normally on every rank
        guard.observe(batch, loss=loss)
    guard.check()
    guard.step_done()
    return {"first": first, "next_calls": log.take(), "next_tokens": guard.last_metrics["rl_guard/tokens/count"]}


def scenario_many_groups(rank, world, out: Path, log: CollectiveLog, groups: int = 600) -> dict:
    """More maxima than MAX_SLOTS (one per optimizer parameter group): the rest travels in one more MAX
    all-reduce on every rank. Gradients are identical on every rank (as after DDP) except one NaN entry on the
    last rank, in a group whose maximum lies beyond MAX_SLOTS."""
    params = [nn.Parameter(torch.zeros(3)) for _ in range(groups)]
    for i, p in enumerate(params):
        p.grad = torch.full((3,), 0.01 * (i + 1))
    if rank == world - 1:
        params[groups - 50].grad[0] = math.nan
    opt = torch.optim.SGD([{"params": [p]} for p in params], lr=0.1)
    guard = Guard.from_yaml("version: 1\nsinks: [jsonl]\n", run_dir=out / "many_groups")
    guard.attach(nn.ParameterList(params), opt)
    for batch, loss in rank_batches(9, 0, rank):
        guard.observe(batch, loss=loss)
    log.take()
    decision = guard.check()
    m = guard.last_metrics
    return {
        "calls": log.take(),
        "action": decision.action,
        "groups": groups,
        "norms": [m.get(f"rl_guard/grad/group{i}/norm") for i in range(groups)],
        "nonfinite": m["rl_guard/grad/nonfinite"],
    }


# -- decisions on a real (tiny) DDP model ------------------------------------------------------------------------------
class Cursor:
    """A per-rank data cursor: the extra state each rank checkpoints and restores on its own."""

    def __init__(self, rank: int):
        self.rank, self.pos = rank, 0

    def state_dict(self) -> dict:
        return {"rank": self.rank, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.rank, self.pos = state["rank"], state["pos"]


class TinyPolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x):
        return torch.log_softmax(self.lin(x), -1)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def decision_config(action: str, rule: str = "nonfinite_rewards") -> str:
    return f"""version: 1
sinks: [jsonl]
snapshots: {{healthy_steps: 2, every: 2, keep: 2, where: memory}}
rollback: {{max_rollbacks: 3, lr_scale: 0.5}}
builtin_rules: {{nonfinite_grad: {{action: {action if rule == "grad" else "skip_step"}}}}}
rules:
  - name: nonfinite_rewards
    metric: rl_guard/input/rewards/nonfinite
    op: ">"
    threshold: 0
    action: {action}
"""


def train_tiny(
    rank,
    world,
    out: Path,
    log: CollectiveLog,
    action: str,
    fault: str = "nan_reward",
    name: str | None = None,
    steps: int = 6,
    broken_save: bool = False,
) -> dict:
    """A few DDP steps; at FAULT_STEP the last rank alone gets a NaN reward (not in the loss: gradients stay
    finite, only the merged statistics show it) or a NaN gradient entry after backward (after DDP's all-reduce)."""
    name = name or f"{action}_{fault}"
    run_dir = out / name
    torch.manual_seed(0)
    policy = TinyPolicy()
    model = nn.parallel.DistributedDataParallel(policy)
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    cursor = Cursor(rank)
    guard = Guard.from_yaml(decision_config(action, "grad" if fault == "nan_grad" else "rewards"), run_dir=run_dir)
    guard.attach(policy, opt, cursor=cursor)
    if broken_save and rank == world - 1:
        # A real I/O failure on this rank only: its checkpoint path is taken by a directory.
        (run_dir / "checkpoints" / f"step_{FAULT_STEP:08d}" / f"rank{rank}.pt").mkdir(parents=True)
    rec = {"steps": [], "raised": None, "digest_start": digest(policy)}
    log.take()
    try:
        for step in range(steps):
            cursor.pos += 1
            g = torch.Generator().manual_seed(1000 * rank + step)
            B, T = 3 + rank, 4
            x, tokens = torch.randn(B, T, 6, generator=g), torch.randint(0, 5, (B, T), generator=g)
            logp = model(x).gather(-1, tokens[..., None])[..., 0]
            mask = torch.ones(B, T, dtype=torch.bool)
            rewards, adv = torch.rand(B, generator=g), torch.randn(B, generator=g)
            if fault == "nan_reward" and step == FAULT_STEP and rank == world - 1:
                rewards[0] = math.nan
            loss = -(logp * adv[:, None]).mean()
            old = logp.detach() + 0.01 * torch.randn(B, T, generator=g)
            guard.observe(
                TokenBatch(logp.detach(), mask, old_logprobs=old, advantages=adv, rewards=rewards), loss=loss.detach()
            )
            loss.backward()
            if fault == "nan_grad" and step == FAULT_STEP and rank == world - 1:
                policy.lin.weight.grad[0, 0] = math.nan
            before = digest(policy)
            observe_calls = log.take()
            decision = guard.check()
            if decision.apply_step:
                opt.step()
            opt.zero_grad()
            check_calls = log.take()
            guard.step_done()
            rec["steps"].append(
                {
                    "step": step,
                    "action": decision.action,
                    "before": before,
                    "after": digest(policy),
                    "cursor": cursor.pos,
                    "lr": opt.param_groups[0]["lr"],
                    "grad_norm": guard.last_metrics.get("rl_guard/grad/norm"),
                    "grad_nonfinite": guard.last_metrics.get("rl_guard/grad/nonfinite"),
                    "reward_nonfinite": guard.last_metrics.get("rl_guard/input/rewards/nonfinite"),
                    "calls": observe_calls + check_calls + log.take(),
                    "checkpoint": guard.actions.last_checkpoint,
                }
            )
            if decision.stop:
                break
    except RuntimeError as exc:
        rec["raised"] = str(exc)
        rec["calls_at_raise"] = log.take()
    rec["snapshot_steps"] = guard.actions.snapshots.steps()
    guard.close()
    return rec


def scenario_recipe(rank, world, out: Path, log: CollectiveLog) -> dict:
    """The DDP variant of the plain-PyTorch GRPO recipe, healthy, with the GRPO preset."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integrations" / "pytorch_grpo"))
    from train_ddp import run_ddp

    from rl_guard.demo.run import PRESET

    res = run_ddp(str(PRESET), steps=RECIPE_STEPS, run_dir=str(out / "recipe"), prompts_per_step=16)
    metrics = res.guard.last_logged
    return {
        "decisions": res.decisions,
        "records": res.records,
        "rewards": res.rewards,
        "finite": res.params_finite_every_step,
        "steps_run": res.steps_run,
        "last_metrics": metrics,
    }


RECIPE_STEPS = 12


# -- the worker's scenarios kept apart (test_scenario_isolation.py) ---------------------------------------------------
def scenario_fails_on_last_rank(rank, world, out: Path, log: CollectiveLog) -> dict:
    """The last rank raises where the others enter a collective: they wait for it until the collective timeout."""
    if rank == world - 1:
        raise RuntimeError("this scenario fails on the last rank")
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"sum": float(t)}


def scenario_sum_of_ranks(rank, world, out: Path, log: CollectiveLog) -> dict:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"sum": float(t)}
