"""Framework versions and seams, checked at attach: an adapter that no longer fits its framework says so at once.

Every adapter states the release range it was tested against (``check_range``) and verifies each method or
attribute it relies on (``require_seam``) before it wraps anything. Outside the tested range the adapter refuses
to attach unless ``RL_GUARD_ALLOW_UNTESTED=1``; then it says on the console that the range is untested, and the
seam checks still run. A missing or changed seam is always an error: it names the framework, its version, the range
the adapter was matched against, and what changed.
"""

from __future__ import annotations

import importlib.metadata as md
import inspect
import os
from typing import Any

from packaging.version import InvalidVersion, Version

ALLOW_UNTESTED = "RL_GUARD_ALLOW_UNTESTED"


class UnsupportedVersion(RuntimeError):
    """The installed framework is outside the range the adapter was tested against."""


class SeamError(RuntimeError):
    """A method or attribute the adapter relies on is missing or has changed."""


def _release(version: str) -> tuple[int, ...]:
    """``major.minor.patch`` of a version string; a pre-release or local build counts as its release
    ("1.16.0rc1" and "2.13.0+cpu" are 1.16.0 and 2.13.0)."""
    try:
        return Version(version).release
    except InvalidVersion:
        raise UnsupportedVersion(f"cannot read the version {version!r}") from None


def describe(package: str, lo: str, hi: str) -> str:
    return f"{package} >= {lo}, < {hi}"


def installed(package: str) -> str | None:
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return None


def in_range(version: str, lo: str, hi: str) -> bool:
    return _release(lo) <= _release(version) < _release(hi)


def check_range(adapter: str, package: str, lo: str, hi: str, *, optional: bool = False) -> str | None:
    """The installed version of ``package`` when it lies in ``[lo, hi)``. Absent: None if ``optional`` (a plain
    transformers Trainer needs no trl), else an error. Outside the range: an error, or with
    ``RL_GUARD_ALLOW_UNTESTED=1`` a console warning."""
    version = installed(package)
    want = describe(package, lo, hi)
    if version is None:
        if optional:
            return None
        raise UnsupportedVersion(f"rl_guard's {adapter} adapter needs {want}; {package} is not installed")
    if not in_range(version, lo, hi):
        message = f"rl_guard's {adapter} adapter was tested with {want}; found {package} {version}"
        if os.environ.get(ALLOW_UNTESTED) != "1":
            raise UnsupportedVersion(
                f"{message}. Install a tested release, or set {ALLOW_UNTESTED}=1 to attach "
                "anyway (every seam the adapter uses is still checked)"
            )
        from .control.announce import console_logger

        console_logger().warning(f"{message} ({ALLOW_UNTESTED}=1): attaching untested; the seams were checked")
    return version


def require_seam(owner, name: str, *, params: tuple[str, ...] = (), where: str) -> Any:
    """``getattr(owner, name)``, which must exist and, when callable, accept the parameters ``params`` by name (or
    ``**kwargs``). ``where``: the framework, its version and the tested range, for the error."""
    kind = owner.__name__ if isinstance(owner, type) else type(owner).__name__
    found = getattr(owner, name, None)
    if found is None:
        raise SeamError(f"rl_guard: {kind}.{name} is missing ({where}); the adapter relies on it")
    if params:
        try:
            signature = inspect.signature(found)
        except (TypeError, ValueError):
            return found  # a builtin without a signature: nothing more to check
        accepted = signature.parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        missing = [p for p in params if p not in accepted and not takes_any]
        if missing:
            raise SeamError(
                f"rl_guard: {kind}.{name}{signature} no longer takes {', '.join(missing)} ({where}); "
                "the adapter reads them by name"
            )
    return found


def require_attr(owner, names: tuple[str, ...], *, where: str) -> None:
    """Attributes (configuration values) the adapter reads from the framework: all must be there."""
    kind = type(owner).__name__
    missing = [n for n in names if not hasattr(owner, n)]
    if missing:
        raise SeamError(f"rl_guard: {kind} has no {', '.join(missing)} ({where}); the adapter reads them")


def require(adapter: str, package: str, lo: tuple[int, int], hi: tuple[int, int], optional: bool = False) -> str | None:
    """``check_range`` with ``(major, minor)`` bounds (the adapters' ``SUPPORTED`` tables)."""
    return check_range(adapter, package, ".".join(map(str, lo)), ".".join(map(str, hi)), optional=optional)
