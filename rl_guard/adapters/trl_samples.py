"""TRL generation batch -> ``SampleBatch`` for the run-level diagnostics (translation only).

``rewards_per_func`` arrives gathered over all processes (TRL gathers it before normalising per group), so the
reward, component and group figures are global and identical on every rank. Texts, lengths and truncation are
only known locally; they are included on a single process, where local is global.
"""

from __future__ import annotations

import numpy as np
import torch

from ..diagnostics import SampleBatch


def samples_from_rewards(
    trainer, per_func: torch.Tensor, total: torch.Tensor, prompts, completions, completion_ids
) -> SampleBatch:
    # Host numpy copies: the diagnostics work on the host, and numpy costs less than torch per op on arrays this
    # small (a batch of samples).
    components, rewards = per_func.detach().float().cpu().numpy(), total.detach().float().cpu().numpy()
    n, g = rewards.shape[0], trainer.num_generations
    names = list(getattr(trainer, "reward_func_names", [f"func{i}" for i in range(components.shape[1])]))
    finite = int(np.count_nonzero(np.isfinite(rewards)))
    batch = dict(
        rewards=rewards,
        group_ids=np.arange(n) // g,
        reward_components={name: components[:, i] for i, name in enumerate(names)},
        funnel={"sampled": n, "reward_available": finite},
        episodes=n,
    )
    if trainer.accelerator.num_processes == 1:
        eos = set(trainer.eos_token_ids)
        truncated = [not ids or ids[-1] not in eos for ids in completion_ids]
        lengths = [len(ids) for ids in completion_ids]
        batch.update(
            lengths=lengths,
            truncated=truncated,
            texts=[_text(c) for c in completions],
            prompts=[_text(p) for p in prompts],
            rollout_tokens=sum(lengths),
            funnel={
                "sampled": n,
                "completed": n - sum(truncated),
                "truncated": sum(truncated),
                "reward_available": finite,
            },
        )
    return SampleBatch(**batch)


def _text(x) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, list) and x and isinstance(x[-1], dict):  # conversational: the last message
        return str(x[-1].get("content", ""))
    return str(x)
