"""What the OpenRLHF, AReaL, verl and DeepSpeed adapters share for their attach-time checks (``rl_guard.versions``
does the checking): the framework and version an error names, a fallback said once on the console, a wrapped call's
arguments read by name, and whether the optimizer ran while the guard had dropped the step.
"""

from __future__ import annotations

import inspect

from ..versions import SeamError, describe, installed


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


class DroppedStepCheck:
    """Per ``train_batch`` of an engine whose skip goes through the framework (AReaL, verl): that the guard's gate ran,
    and that the optimizer did not step (``optimizer.step`` counted by a pre-hook) after the guard dropped the update.
    ``begin`` before the framework's ``train_batch``, ``gated``/``dropped`` in the gate, ``verify`` after it."""

    def __init__(self, engine, guard, framework: str, where) -> None:
        self.engine, self.guard, self.framework, self.where = engine, guard, framework, where
        self.calls = 0
        self._handle = engine.optimizer.register_step_pre_hook(self._count) if engine.optimizer is not None else None
        self.begin()

    def _count(self, optimizer, args, kwargs) -> None:
        self.calls += 1

    def begin(self) -> None:
        self.was_gated = False
        self.skipped_at: int | None = None  # the optimizer's step count when the guard dropped the update
        self.decision = None

    def gated(self) -> None:
        self.was_gated = True

    def dropped(self, decision) -> None:
        self.skipped_at, self.decision = self.calls, decision

    def verify(self) -> None:
        if not self.was_gated:
            raise SeamError(
                f"rl_guard: {type(self.engine).__name__}.train_batch returned without calling optimizer_step "
                f"({self.where()}): the update was applied without the guard's check"
            )
        if self.skipped_at is not None and self.calls != self.skipped_at:
            self.guard.skip_not_taken(
                self.decision,
                self.framework,
                f"its optimizer stepped {self.calls - self.skipped_at} time(s) "
                "in the train_batch whose update the guard dropped",
            )
            raise halted(self.guard, self.decision)

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
