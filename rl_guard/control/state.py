"""The small state protocol actions work on: model, optimizer, scheduler, RNG states, step, data cursor.

``capture()`` copies everything to host memory (tensors copied, so later training cannot alias them; the model's
and the optimizer's tensors in one multi-tensor copy, ``host_copy.py``); ``restore()`` loads it back bit for bit.
Everything captured is plain tensors / containers, so it can be saved and loaded with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .host_copy import HostCopies

_IMMUTABLE = (int, float, bool, str, type(None))


def _to_host(obj):
    if type(obj) in _IMMUTABLE:  # what deepcopy would return anyway
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)([v if type(v) in _IMMUTABLE else _to_host(v) for v in obj])
    return copy.deepcopy(obj)


def rng_state() -> dict:
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # numpy's global generator is MT19937: its state is the legacy tuple
    state = {
        "python": random.getstate(),
        "numpy": {
            "key": np_state[0],
            "pos": torch.from_numpy(np_state[1].astype(np.int64)),
            "rest": list(np_state[2:]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuples(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state["key"], np_state["pos"].numpy().astype(np.uint32), *np_state["rest"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(obj):
    # torch.save round-trips tuples as tuples, but a JSON/other path may give lists; random.setstate wants tuples.
    return tuple(_as_tuples(x) for x in obj) if isinstance(obj, (list, tuple)) else obj


@dataclass
class TrainState:
    """What the guard may snapshot and restore. ``extra`` holds objects with ``state_dict``/``load_state_dict``
    (a data cursor, a sampler, a reward normaliser...)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    _copies: HostCopies = field(default_factory=HostCopies, init=False, repr=False, compare=False)

    def capture(self, step: int) -> dict:
        model = self._copies.model_tensors(self.model)
        optimizer: dict | None = None
        places: list[tuple[dict, Any]] = []
        opt_live: list[torch.Tensor] = []
        if self.optimizer is not None:
            optimizer, places, opt_live = _optimizer_host(self.optimizer.state_dict())
        copies = self._copies.copy(model[1] + opt_live) if model is not None else None
        if copies is None or model is None:  # not plain tensors (e.g. FSDP2's DTensor): copied one by one
            snap = {"step": step, "model": _to_host(self.model.state_dict()), "rng": rng_state()}
            if self.optimizer is not None:
                snap["optimizer"] = _to_host(self.optimizer.state_dict())
        else:
            snap = {"step": step, "model": dict(zip(model[0], copies)), "rng": rng_state()}
            for (out, k), c in zip(places, copies[len(model[0]) :]):
                out[k] = c
            if optimizer is not None:
                snap["optimizer"] = optimizer
        if self.scheduler is not None:
            snap["scheduler"] = _to_host(self.scheduler.state_dict())
        snap["extra"] = {k: _to_host(v.state_dict()) for k, v in self.extra.items()}
        return snap

    def restore(self, snap: dict, lr_scale: float = 1.0) -> None:
        self.model.load_state_dict(snap["model"])
        if self.optimizer is not None and "optimizer" in snap:
            self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        if self.scheduler is not None and "scheduler" in snap:
            self.scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))
        for k, v in self.extra.items():
            if k in snap["extra"]:
                v.load_state_dict(copy.deepcopy(snap["extra"][k]))
        set_rng_state(snap["rng"])
        if lr_scale != 1.0:
            scale_lr(self.optimizer, self.scheduler, lr_scale)


def _optimizer_host(sd: dict) -> tuple[dict, list[tuple[dict, Any]], list[torch.Tensor]]:
    """``optimizer.state_dict()`` with every non-tensor leaf copied as ``_to_host`` does, the places its state
    tensors go (filled in by the caller with their host copies), and those live tensors."""
    places: list[tuple[dict, Any]] = []
    live: list[torch.Tensor] = []
    state: dict = {}
    for i, per_param in sd["state"].items():
        out = state[i] = {}
        for k, v in per_param.items():
            if isinstance(v, torch.Tensor):
                out[k] = None  # keeps the key order
                places.append((out, k))
                live.append(v)
            else:
                out[k] = copy.deepcopy(v)
    return {key: state if key == "state" else _to_host(v) for key, v in sd.items()}, places, live


def scale_lr(optimizer, scheduler, factor: float) -> None:
    """Scale the learning rate now and in the schedule (schedulers recompute lr from ``base_lrs``)."""
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        if hasattr(scheduler, "_last_lr"):
            scheduler._last_lr = [lr * factor for lr in scheduler._last_lr]
