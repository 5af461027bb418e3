"""The guard's state inside the trainer's own checkpoints, so ``trainer.train(resume_from_checkpoint=...)`` resumes
a guard exactly as armed as the one that saved: rule histories, counters, step numbering, the update probe's
learning-rate history and weight reference, the console's warned rules, and the snapshot ring where it fits.

transformers 5.x seams (matched against 5.25.0): ``on_save`` runs right after ``Trainer._save_checkpoint`` wrote
``<output_dir>/checkpoint-<global_step>``; ``Trainer._inner_training_loop(..., resume_from_checkpoint=...)`` calls
``on_train_begin`` with the checkpoint it resumes from already resolved (``True`` -> the last one).
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import torch

from ..control.announce import console_logger
from ..control.checkpoint import atomic_save

STATE_FILE = "rl_guard_state_rank{rank}.pt"
HALT_MARK = "rl_guard_stopped.txt"  # in a checkpoint written when the guard stopped the run: it holds the fault
# Memory snapshots travel in the checkpoint up to this size (a tiny or small model); above it a resumed guard takes
# fresh snapshots after its healthy steps, and the first save says so.
SNAPSHOT_BYTES_LIMIT = 1 << 30
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class ResumeSeam:
    """Where the trainer says which checkpoint this run resumes from."""

    def __init__(self, path: str | None, found: bool):
        self.path, self.found = path, found


def resume_from_frames() -> ResumeSeam:
    """The checkpoint ``_inner_training_loop`` was given (None for a fresh run)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "_inner_training_loop" and "resume_from_checkpoint" in frame.f_locals:
            path = frame.f_locals["resume_from_checkpoint"]
            return ResumeSeam(None if path in (None, False) else str(path), True)
        frame = frame.f_back
    return ResumeSeam(None, False)


def resume_checkpoint(args, state) -> str | None:
    """The checkpoint this run resumes from; said on the console when transformers' seam was not where expected."""
    seam = resume_from_frames()
    if seam.found:
        return seam.path
    if not state.global_step:
        return None
    guess = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
    console_logger().warning(
        f"rl_guard: could not find transformers' resume_from_checkpoint (Trainer._inner_training_loop); the run "
        f"starts at global_step {state.global_step}, so the guard's state is read from {guess}"
    )
    return guess


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def save_guard_state(guard, checkpoint_dir: str | Path, told: set) -> Path:
    """Write this rank's guard state beside the trainer's checkpoint files."""
    payload = guard.state_dict()
    payload["stopped"] = guard.stopped
    ring = guard.actions.snapshots
    memory = ring.memory_items()
    size = _tensor_bytes(memory)
    if size <= SNAPSHOT_BYTES_LIMIT:
        payload["memory_snapshots"] = memory
    elif "ring" not in told and guard.rank == 0:
        told.add("ring")
        console_logger().warning(
            f"rl_guard: the healthy snapshots ({size / 2**30:.1f} GiB in memory) are not saved in the trainer's "
            f"checkpoints (limit {SNAPSHOT_BYTES_LIMIT / 2**30:.0f} GiB): after a resume, rollback is armed again once "
            "the guard has taken a snapshot (snapshots.where: disk keeps them across resumes)"
        )
    path = Path(checkpoint_dir) / STATE_FILE.format(rank=guard.rank)
    atomic_save(payload, path)
    if guard.stopped is not None and guard.rank == 0:  # found cheaply when looking for a healthy checkpoint
        (Path(checkpoint_dir) / HALT_MARK).write_text(guard.stopped["message"] + "\n", encoding="utf-8")
    return path


def load_guard_state(guard, checkpoint_dir: str | Path) -> dict | None:
    """This rank's saved guard state, loaded into ``guard``; None when the checkpoint carries none."""
    path = Path(checkpoint_dir) / STATE_FILE.format(rank=guard.rank)
    if not path.is_file():
        return None
    payload = torch.load(path, map_location="cpu", weights_only=True)
    guard.load_state_dict(payload)
    guard.actions.snapshots.restore_memory(payload.get("memory_snapshots", []))
    return payload


def checkpoints_before(output_dir: str | Path, step: int) -> list[Path]:
    """The trainer's checkpoints written before guard step ``step`` (global_step < step), oldest first, without
    those written when the guard stopped a run (they hold its fault)."""
    found = []
    for child in Path(output_dir).glob("checkpoint-*"):
        m = _CHECKPOINT.match(child.name)
        if m and int(m[1]) < step and child.is_dir() and not (child / HALT_MARK).exists():
            found.append((int(m[1]), child))
    return [p for _, p in sorted(found)]
