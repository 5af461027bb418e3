"""Which rewards TRL's reward functions declared "not applicable" (``None``), told apart from genuine NaNs.

TRL 1.16 (``GRPOTrainer._calculate_rewards``) turns a reward function's ``None`` ("this function does not apply to
this sample", e.g. multi-task rewards) into NaN and sums the functions with ``nansum``. After that a ``None`` and a
NaN the function really returned look the same. ``NoneTracker`` wraps the plain (sync or async) reward functions on
the trainer instance, records where each returned ``None``, and returns their output unchanged; model-based reward
functions (``nn.Module``) never return ``None`` and are left alone.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ..stats.on_device import host_to_device


class NoneTracker:
    def __init__(self, trainer):
        self.trainer = trainer
        self.original = list(trainer.reward_funcs)
        self.nones: dict[int, list[bool]] = {}
        trainer.reward_funcs = [
            f if isinstance(f, torch.nn.Module) else self._wrap(i, f) for i, f in enumerate(self.original)
        ]

    def _wrap(self, i: int, func):
        def record(out):
            if out is not None:
                self.nones[i] = [r is None for r in out]
            return out

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def wrapped_async(*args, **kwargs):
                return record(await func(*args, **kwargs))

            return wrapped_async

        @functools.wraps(func)
        def wrapped(*args, **kwargs):
            return record(func(*args, **kwargs))

        return wrapped

    def not_applicable(self, n: int, device) -> torch.Tensor:
        """``[n, functions]`` bool: True where this rank's function returned ``None`` in the last call (reset)."""
        mask = torch.zeros(n, len(self.original), dtype=torch.bool)
        for i, flags in self.nones.items():
            if len(flags) == n:
                mask[:, i] = torch.tensor(flags)
        self.nones = {}
        return host_to_device(mask, device)

    def remove(self) -> None:
        self.trainer.reward_funcs = self.original


def applicable_total(per_func: torch.Tensor, weights: torch.Tensor, not_applicable: torch.Tensor) -> torch.Tensor:
    """The weighted reward sum as TRL computes it (a ``None`` contributes nothing), except that a NaN a function
    really returned stays NaN, so the guard sees it."""
    return torch.where(not_applicable, 0.0, per_func * weights).sum(1)
