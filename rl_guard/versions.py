"""Supported-version checks for the framework adapters (reads installed package metadata only)."""

from __future__ import annotations

import importlib.metadata as md


def require(adapter: str, package: str, lo: tuple[int, int], hi: tuple[int, int], optional: bool = False) -> str | None:
    """Raise unless ``lo <= major.minor of package < hi``; returns the installed version (``None`` when the package
    is absent and ``optional``: an object with the framework's API but without the package is let through)."""
    try:
        version = md.version(package)
    except md.PackageNotFoundError:
        if optional:
            return None
        raise
    parts = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if not lo <= parts < hi:
        raise RuntimeError(f"rl_guard's {adapter} adapter supports {package} >= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]}; "
                           f"found {package} {version}")
    return version
