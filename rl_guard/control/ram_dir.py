"""A RAM-backed snapshot directory (``snapshots: {where: memory}``) shared by the ranks of one node.

Engines whose optimizer state lives in partitions (DeepSpeed ZeRO, FSDP's DCP) snapshot through their own
checkpoint writers, so "memory" means a directory on the tmpfs ``/dev/shm``. It is RAM, so it must be freed
when the run ends, but only when the *last* process of the run on this node ends: the ranks of a node share
it, and one that exits early must not delete what a slower rank is still listing or loading. Each process
leaves a marker named by its pid; the process that exits and finds no other live marker removes the
directory. Markers of processes that died without cleaning up do not count (their pid is gone).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
from pathlib import Path

SHM = Path("/dev/shm")


def ram_dir(
    run_dir: str | os.PathLike, rank: int, name: str = "", where: str = "memory", root: Path = SHM
) -> Path | None:
    """The snapshot directory for ``run_dir`` under ``root`` (one per run directory), or None when ``where``
    is not ``memory`` or the node has no ``/dev/shm``. Rank 0 clears what an earlier process left there; the
    directory is removed when this node's last live process of the run exits."""
    if where != "memory" or not root.is_dir():
        return None
    key = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    base = root / "rl_guard" / key
    path = base / name if name else base
    alive = root / "rl_guard" / f"{key}.alive"
    if rank == 0:  # an earlier process's snapshots are not this run's (every rank saves after this point)
        shutil.rmtree(path, ignore_errors=True)
    alive.mkdir(parents=True, exist_ok=True)
    (alive / str(os.getpid())).touch()
    atexit.register(release, base, alive)
    return path


def release(base: Path, alive: Path, pid: int | None = None) -> bool:
    """Drop this process's marker; remove ``base`` if no other live process of the run still holds one.
    Returns whether it removed the directory."""
    (alive / str(pid or os.getpid())).unlink(missing_ok=True)
    others = [p for p in alive.glob("*") if p.name.isdigit() and _running(int(p.name))]
    if others:
        return False
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(alive, ignore_errors=True)
    return True


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True
