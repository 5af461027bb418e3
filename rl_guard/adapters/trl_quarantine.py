"""TRL: the culprit sequences of a generation batch, and the gate that keeps quarantined prompts out of training.

Culprits (``rl_guard/control/culprits.py``): from each generation batch's rewards (host copies the diagnostics
already made), this process's sequences whose total reward is non-finite, and the ``k`` farthest from the batch's
median reward, with their prompt, completion, completion ids and reward per function.

Quarantine (``rl_guard/control/quarantine.py``): ``GRPOTrainer._generate_and_score_completions(inputs)`` (trl 1.16)
receives the raw dataset rows of a generation batch, each prompt ``num_generations`` times in a row. The gate
replaces every row of a quarantined prompt by the rows of one replacement prompt (the next dataset row that is not
quarantined, so groups stay whole and the batch keeps its size) before TRL generates. In a multi-process run each
process replaces the prompts it meets; a prompt is quarantined by the process that trained on it.
"""

from __future__ import annotations

import numpy as np

from ..control.culprits import IDS_LIMIT, cut, prompt_key


def reward_culprits(samples, start: int, prompts, completions, completion_ids, k: int) -> list[dict]:
    """Candidates among this process's rows ``start .. start + len(prompts)`` of the (gathered) batch."""
    n = len(prompts)
    rewards = np.asarray(samples.rewards, dtype=np.float64)[start : start + n]
    components = {
        name: np.asarray(v, dtype=np.float64)[start : start + n]
        for name, v in (samples.reward_components or {}).items()
    }
    bad = np.flatnonzero(~np.isfinite(rewards))
    finite = np.flatnonzero(np.isfinite(rewards))
    far = np.zeros(0, dtype=np.int64)
    if finite.size:
        distance = np.abs(rewards[finite] - np.median(rewards[finite]))
        far = finite[np.argsort(-distance, kind="stable")[:k]]
    chosen = [*bad[:k], *far]
    return [
        {
            "index": int(start + i),
            "prompt": cut(prompts[i]),
            "prompt_key": prompt_key(prompts[i]),
            "completion": cut(completions[i]),
            "completion_ids": list(completion_ids[i])[:IDS_LIMIT],
            "reward": float(rewards[i]),
            "rewards": {name: float(v[i]) for name, v in components.items()},
            "nonfinite": bool(not np.isfinite(rewards[i])),
        }
        for i in chosen
    ]


class PromptGate:
    """Replaces the rows of quarantined prompts before generation (see the module docstring)."""

    def __init__(self, trainer, quarantine):
        self.trainer, self.quarantine = trainer, quarantine
        self.dataset = trainer.train_dataset
        self.replaced = 0  # rows replaced so far
        self._cursor = 0
        quarantine.population = len(self.dataset)

    def _replacement(self) -> dict:
        for _ in range(len(self.dataset)):
            row = self.dataset[self._cursor % len(self.dataset)]
            self._cursor += 1
            if prompt_key(row["prompt"]) not in self.quarantine:
                return dict(row)
        raise RuntimeError("every prompt of the dataset is quarantined")

    def filter(self, inputs: list[dict]) -> list[dict]:
        if not len(self.quarantine):
            return inputs
        out: list[dict] = []
        swap: dict[str, dict] = {}
        for row in inputs:
            key = prompt_key(row["prompt"])
            if key in self.quarantine:
                swap.setdefault(key, self._replacement())
                out.append(dict(swap[key]))
                self.replaced += 1
            else:
                out.append(row)
        return out
