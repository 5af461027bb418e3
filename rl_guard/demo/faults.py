"""Fault injection into a real transformers/TRL training run (for the demo and the tests).

``FaultInjector`` is a ``TrainerCallback``; put it *before* ``RLGuardCallback`` in ``callbacks`` so a gradient fault
is in place when the guard looks. Faults:
- ``lr_blowup``: from ``at_step`` on, the learning rate (and the scheduler's base rates) jumps by ``factor``.
- ``lr_ramp``: from ``at_step`` on, the learning rate grows by ``factor`` every step (a gradual fault).
- ``inf_grad``: one gradient entry becomes +inf at ``at_step``.
- ``nan_reward``: the reward function returns NaN for one completion at ``at_step`` (see ``faulty_reward``).
- ``nan_rewards``: from ``at_step`` on, every reward is NaN (a reward service that broke for good).
- ``reward_scale``: from ``at_step`` on, every reward is multiplied by ``factor`` (a unit bug).
- ``weight_noise``: at ``at_step``, after generation and before the loss (inside the reward call), every weight gets
  Gaussian noise of ``factor`` times its tensor's std (a corrupted weight sync or load).
- ``ratio_drift``: at ``at_step`` every weight gets Gaussian noise of ``factor`` times its tensor's std, between
  generation and training, so the buffered behaviour log-probs come from another policy (needs
  ``steps_per_generation`` or ``num_iterations`` > 1).
"""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback

from ..control.state import scale_lr
from . import FAULTS

# The tiny demo model starts near-uniform, so it takes noise of a few stds to move its log-probs visibly.
DEFAULT_FACTOR = {"lr_blowup": 100.0, "lr_ramp": 2.0, "ratio_drift": 6.0, "reward_scale": 1e6, "weight_noise": 1.0}


class FaultInjector(TrainerCallback):
    def __init__(self, fault: str = "none", at_step: int = 10, factor: float | None = None):
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; allowed: {', '.join(FAULTS)}")
        self.fault, self.at_step = fault, at_step
        self.factor = factor if factor is not None else DEFAULT_FACTOR.get(fault, 1.0)
        self.current_step = 0
        self.injected_at: list[int] = []
        self.model = None

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.model = model

    def on_step_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        self.current_step = state.global_step
        step = state.global_step
        if self.fault == "lr_blowup" and step == self.at_step or self.fault == "lr_ramp" and step >= self.at_step:
            scale_lr(optimizer, lr_scheduler, self.factor)
            self.injected_at.append(step)
        if self.fault == "ratio_drift" and step == self.at_step:
            self._perturb(model)

    def _perturb(self, model) -> None:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1234)
            for p in model.parameters():
                scale = self.factor * p.detach().float().std().clamp(min=1e-3)
                p.add_(torch.randn(p.shape, generator=gen).to(p) * scale)
        self.injected_at.append(self.current_step)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if self.fault == "inf_grad" and state.global_step == self.at_step:
            p = next(p for p in model.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = math.inf
            self.injected_at.append(state.global_step)

    def faulty_reward(self, base):
        """Wrap a reward function so it returns NaN for one completion at ``at_step`` (fault ``nan_reward``)."""

        def reward(prompts, completions, **kwargs):
            out = list(base(prompts, completions, **kwargs))
            step = self.current_step
            if self.fault == "nan_reward" and step == self.at_step and not self.injected_at:
                out[0] = float("nan")
                self.injected_at.append(step)
            if self.fault in ("nan_rewards", "reward_scale") and step >= self.at_step:
                out = [float("nan") if self.fault == "nan_rewards" else r * self.factor for r in out]
                self.injected_at.append(step)
            if self.fault == "weight_noise" and step == self.at_step and step not in self.injected_at:
                self._perturb(self.model)  # rewards are scored after generation and before the loss
            return out

        reward.__name__ = base.__name__
        return reward
