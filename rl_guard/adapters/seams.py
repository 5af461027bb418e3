"""What the OpenRLHF, AReaL, verl and DeepSpeed adapters share for their attach-time checks (``rl_guard.versions``
does the checking): the framework and version an error names, a fallback said once on the console, a wrapped call's
arguments read by name, and whether the optimizer ran while the guard had dropped the step.
"""

from __future__ import annotations

import inspect

from ..versions import describe, installed


def where(framework: str, package: str, lo: str, hi: str) -> str:
    """``"verl 0.9.1, tested with verl >= 0.9, < 0.10"``: the context every seam error carries."""
    return f"{framework} {installed(package) or '(not installed)'}, tested with {describe(package, lo, hi)}"


def announce(message: str) -> None:
    """A fallback or an unusual attach, said once on the console (adapters call it at attach, or once per run)."""
    from ..control.announce import console_logger

    console_logger().warning(f"rl_guard: {message}")


def arguments(fn, args: tuple, kwargs: dict) -> dict:
    """The arguments of the call ``fn(*args, **kwargs)`` by parameter name, defaults filled in (``TypeError`` when
    the call does not fit ``fn``'s signature). Wrappers call the original first and read its arguments with this
    inside ``guard.protect``, so the framework's call itself never depends on it."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


class StepCounter:
    """Counts ``optimizer.step`` calls through a step pre-hook (torch optimizers), so an adapter can verify that the
    optimizer did not run in a step the guard dropped."""

    def __init__(self, optimizer) -> None:
        self.calls = 0
        self._handle = optimizer.register_step_pre_hook(self._count) if optimizer is not None else None

    def _count(self, optimizer, args, kwargs) -> None:
        self.calls += 1

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()


def halted(guard, decision):
    """The ``GuardHalted`` an adapter raises for a stopping decision: the rules' messages, or the guard's own when
    it escalated a skip the framework did not take (``Guard.skip_not_taken``)."""
    from ..errors import GuardHalted

    stop = guard.stopped
    if decision.escalated_from is not None and stop is not None and stop.get("rule") == "skip_not_taken":
        return GuardHalted("; ".join([*decision.messages, stop["message"]]))
    return GuardHalted.of(decision)


def save_state(state: dict, path) -> None:
    """Write the guard's state for a framework checkpoint, readable with ``torch.load(weights_only=True)``: checked
    before it is written (a value that is not plain data fails the save, not a later resume)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    torch.load(buffer, map_location="cpu", weights_only=True)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())


def load_state(path) -> dict:
    """The guard's state written by ``save_state`` (plain data only: ``weights_only=True``)."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)
