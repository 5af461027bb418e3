"""Multi-process merging: the guard sees the global batch and every rank takes the same decision.

Per step the guard adds exactly two collectives on the process group the trainer already created: one SUM
all-reduce of the packed sums (counts, sums, histogram cells) and one MAX all-reduce of the packed maxima (minima
travel negated). Both run on every rank every step, whatever the rank's data, so no rank can hang waiting for
another. Decisions are then computed from identical merged metrics by identical controllers, so every rank acts
at the same step without a further collective. With no initialised process group nothing extra happens.
A checkpoint save adds one MAX all-reduce of a failure flag, so a rank that fails to save fails all ranks.
"""

from __future__ import annotations

import torch

from .accumulate import RankMismatch  # noqa: F401 - re-exported


def _dist():
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    return torch.distributed if torch.distributed.get_world_size() > 1 else None


def rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def reducer():
    """The in-place (sums, maxes) reduction for ``StepAccumulator.finish``, or None on a single process."""
    dist = _dist()
    if dist is None:
        return None

    def reduce(sums: torch.Tensor, maxes: torch.Tensor) -> None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)

    return reduce


def raise_if_any_rank_failed(error: Exception | None, what: str) -> None:
    dist = _dist()
    failed = torch.tensor([1.0 if error is not None else 0.0])
    if dist is not None:
        if dist.get_backend() == "nccl":
            failed = failed.cuda()
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        raise RuntimeError(f"{what} failed on this rank: {error!r}") from error
    if failed.item() > 0:
        raise RuntimeError(f"{what}: another rank failed to save; stopping all ranks")
