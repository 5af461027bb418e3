"""Atomic checkpoint files and the ring of healthy snapshots.

Writes go to a temp file in the same directory, are fsync'ed, then renamed over the target (and the directory
fsync'ed), so a crash mid-save leaves the previous good file loadable. Loads use ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import tempfile
from collections import deque
from pathlib import Path

import torch


def atomic_save(obj, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def prune_checkpoints(root: str | os.PathLike, filename: str, keep: int) -> None:
    """Remove this rank's ``filename`` from all but the newest ``keep`` ``step_*`` directories (and the directories
    once empty). Each rank prunes its own file, so no rank deletes what another may still be writing."""
    steps = sorted(d for d in Path(root).glob("step_*") if d.is_dir())
    for d in steps[:-keep] if keep > 0 else []:
        (d / filename).unlink(missing_ok=True)
        try:
            d.rmdir()
        except OSError:  # other ranks' files are still there
            pass


def load(path: str | os.PathLike):
    return torch.load(path, map_location="cpu", weights_only=True)


def _step_of(item) -> int:
    return int(item.stem.removeprefix("snapshot_step")) if isinstance(item, Path) else item["step"]


class SnapshotRing:
    """The last ``keep`` healthy snapshots, in host memory or on disk (``where='disk'`` needs ``directory``).

    Every snapshot the ring forgets (pushed out, or abandoned by a rollback) is freed at once: its file is removed,
    and a snapshot that lives elsewhere (an engine's checkpoint tag) goes to ``on_drop``. What the ring offers is
    therefore exactly what is kept; pruning by count or age instead would, after a rollback, count the abandoned
    newer snapshots and remove an older one that the ring still offers."""

    def __init__(self, keep: int = 2, where: str = "memory", directory: str | os.PathLike | None = None, on_drop=None):
        if where == "disk" and directory is None:
            raise ValueError("snapshots kept on disk need a directory")
        self.keep, self.where = keep, where
        self.directory = Path(directory) if directory is not None else None
        self._items: deque = deque()
        self._on_drop = on_drop

    def __len__(self) -> int:
        return len(self._items)

    def push(self, snap: dict) -> None:
        item: Path | dict
        if self.where == "disk":
            assert self.directory is not None  # checked in __init__
            item = atomic_save(snap, self.directory / f"snapshot_step{snap['step']:08d}.pt")
        else:
            item = snap
        self._items.append(item)
        while len(self._items) > self.keep:
            self._drop(self._items.popleft())

    def _drop(self, item) -> None:
        if isinstance(item, Path):
            item.unlink(missing_ok=True)
        elif self._on_drop is not None:
            self._on_drop(item)

    def latest(self, before_step: int | None = None) -> dict | None:
        """The newest snapshot, or the newest one whose step is below ``before_step``."""
        items = [i for i, s in zip(self._items, self.steps()) if before_step is None or s < before_step]
        if not items:
            return None
        return load(items[-1]) if isinstance(items[-1], Path) else items[-1]

    def drop_after(self, step: int) -> None:
        """Forget snapshots newer than ``step`` (after a rollback they belong to an abandoned trajectory)."""
        keep = [(i, s) for i, s in zip(self._items, self.steps()) if s <= step]
        for item in self._items:
            if all(item is not k for k, _ in keep):
                self._drop(item)
        self._items = deque(i for i, _ in keep)

    def steps(self) -> list[int]:
        return [_step_of(i) for i in self._items]

    def state_dict(self) -> dict:
        """Disk snapshots survive a restart (their paths are kept); memory snapshots do not."""
        return {"paths": [str(i) for i in self._items if isinstance(i, Path)]}

    def load_state_dict(self, state: dict) -> None:
        self._items = deque(Path(p) for p in state.get("paths", []) if Path(p).exists())

    def memory_items(self) -> list[dict]:
        """The snapshots held in memory (for a checkpoint that carries them)."""
        return [i for i in self._items if not isinstance(i, Path)]

    def restore_memory(self, items: list[dict]) -> None:
        """Put saved memory snapshots back, oldest first, with any disk snapshots in step order."""
        if items:
            merged = sorted([*self._items, *items], key=_step_of)
            self._items = deque(merged[-self.keep :])
