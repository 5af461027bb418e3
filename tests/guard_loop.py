"""A small real training loop around ``Guard`` (a two-layer model, AdamW, a LambdaLR schedule) for action and
failure-policy tests."""

import copy
import random

import numpy as np
import torch

from rl_guard import Guard

BUILTINS_NO_LOGPROBS = "builtin_rules: {nonfinite_logprobs: false}\n"  # no token batch is observed here


def full_state(model, opt, sched):
    return copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(),
        }
    )


def setup(tmp_path, yaml_text, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** (s // 2))  # recomputes lr from base_lrs
    guard = Guard.from_yaml(BUILTINS_NO_LOGPROBS + yaml_text, run_dir=tmp_path / "run").attach(model, opt, sched)
    return guard, model, opt, sched


def train_step(guard, model, opt, sched, scale=1.0, poison=None, always_step=False):
    """One step (``scale`` multiplies the loss, hence every gradient). Draws from all three global RNGs, as data
    loaders and dropout do."""
    x = torch.randn(16, 6)
    _ = random.random(), np.random.rand()
    loss = model(x).pow(2).mean() * scale
    guard.observe(loss=loss)
    loss.backward()
    if poison is not None:
        model[0].weight.grad[0, 0] = poison
    d = guard.check()
    if d.apply_step:
        opt.step()
        sched.step()
    elif always_step:  # a loop that cannot skip (the optimizer steps anyway): dropped grads make it a no-op
        opt.step()
    opt.zero_grad(set_to_none=True)
    guard.step_done()
    return d
