"""Multi-process merging: the guard sees the global batch and every rank takes the same decision.

Collectives per optimizer step, on the process group the trainer already created (none without an initialised
group, or with a group of one process):

1. one MAX all-reduce of a fixed-size vector: a header (both statistics sizes as ``(+n, -n)`` pairs and a
   "this rank failed" flag) followed by the packed maxima (minima travel negated) padded with ``-inf`` to
   ``MAX_SLOTS`` slots. Its size never depends on the data, so ranks that disagree cannot break the collective
   (gloo aborts the process when ranks pass different sizes; with NCCL the result is undefined);
2. one SUM all-reduce of the packed sums (counts, sums, histogram cells), entered only after every rank has
   read the merged header and seen that all sizes agree. Otherwise every rank raises ``RankMismatch`` (or
   ``RankFailed``) and none enters it.

Payload and cost: ``docs/distributed.md`` ("What the merge costs").

A checkpoint save adds one MAX all-reduce of a failure flag (4 bytes), so a rank that fails to save fails all
ranks. On NCCL the header is read on the host between the two collectives: one small extra synchronisation.

Decisions are computed from identical merged metrics by identical controllers, so every rank acts at the same
step without a further collective. A NaN in a maximum is sent as ``+inf``: gloo's MAX keeps or drops a NaN
depending on the order it meets it, and an infinite value fires the same non-finite rules.
"""

from __future__ import annotations

import math

import torch

from .accumulate import RankMismatch  # raised below, and re-exported
from .on_device import device_vector, host_to_device

HEADER = 8  # +n_sums, -n_sums, +n_maxes, -n_maxes, failed, three spare slots (kept 0)
MAX_SLOTS = 512  # room for the maxima of any common layout; a larger one adds one collective


class RankFailed(RuntimeError):
    """Another rank's guard failed internally this step and abstained from merging; every rank takes the
    guard's failure path for this step instead of waiting for statistics that will never come."""


def _dist():
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    return torch.distributed if torch.distributed.get_world_size() > 1 else None


def rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _device(dist, like: torch.Tensor) -> torch.device:
    # NCCL only moves CUDA tensors; a rank that recorded nothing has its (empty) vectors on the CPU.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return like.device


def _header(n_sums: int, n_maxes: int, failed: bool, device) -> torch.Tensor:
    values = [float(n_sums), float(-n_sums), float(n_maxes), float(-n_maxes), 1.0 if failed else 0.0]
    return device_vector(values + [0.0] * (HEADER - len(values)), device)


class StepReducer:
    """The in-place ``(sums, maxes)`` reduction handed to ``StepAccumulator.finish``.

    ``entered`` tells the caller whether this rank has taken part in the step's first collective; a rank that
    fails before that must call ``abstain()`` so the others are not left waiting.
    """

    def __init__(self, dist):
        self.dist = dist
        self.entered = False

    def __call__(self, sums: torch.Tensor, maxes: torch.Tensor) -> None:
        dist = self.dist
        device = _device(dist, maxes)
        n_s, n_m = sums.numel(), maxes.numel()
        head = min(n_m, MAX_SLOTS)
        buf = _first_buffer(device, n_s, n_m, failed=False, maxes=maxes[:head])
        self.entered = True
        _all_reduce(dist, buf, "max")
        _check_header(read_header(buf))
        maxes[:head] = buf[HEADER : HEADER + head].to(maxes.device)
        if n_m > head:  # same n_m on every rank (checked above), so every rank enters this one too
            _merge_into(dist, maxes[head:], device, "max")
        _merge_into(dist, sums, device, "sum")


def _first_buffer(device, n_sums: int, n_maxes: int, failed: bool, maxes=None) -> torch.Tensor:
    """What the step's first collective merges by maximum: the header and up to ``MAX_SLOTS`` maxima (NaN sent as
    +inf), padded with -inf to a size that never depends on the data."""
    buf = torch.full((HEADER + MAX_SLOTS,), -math.inf, dtype=torch.float64, device=device)
    buf[:HEADER] = _header(n_sums, n_maxes, failed, device)
    if maxes is not None:
        buf[HEADER : HEADER + maxes.numel()] = host_to_device(_nan_to_inf(maxes), device)
    return buf


def _nan_to_inf(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(t), math.inf, t)


def _all_reduce(dist, t: torch.Tensor, op: str) -> None:
    """``all_reduce`` of ``t`` in place by ``op``, ``"sum"`` or ``"max"``: every collective of the statistics."""
    dist.all_reduce(t, getattr(dist.ReduceOp, op.upper()))


def _merge_into(dist, t: torch.Tensor, device, op: str) -> None:
    """``_all_reduce`` of ``t`` by ``op`` on the collective's device (maxima: NaN sent as +inf), written back into
    ``t``."""
    merged = _nan_to_inf(t) if op == "max" else t
    if merged.device != device:
        merged = host_to_device(merged, device)
    _all_reduce(dist, merged, op)
    if merged is not t:
        t.copy_(merged)


def read_header(buf: torch.Tensor) -> list[float]:
    """The host read of the merged header between the two collectives (the tests' sync detector recognises the
    syncs made inside this function as this documented one)."""
    return buf[:HEADER].cpu().tolist()


def _check_header(h: list[float]) -> None:
    if h[4] > 0:
        raise RankFailed(
            "the guard failed internally on another rank this step; every rank takes its failure "
            "path (fail_mode) for this step"
        )
    if h[0] != -h[1] or h[2] != -h[3]:
        raise RankMismatch(
            f"ranks fed different statistics layouts this step (sums: {-h[1]:.0f}..{h[0]:.0f} values, maxima: "
            f"{-h[3]:.0f}..{h[2]:.0f} values across ranks; some rank saw fields the others did not, or recorded "
            "nothing); feed the same TokenBatch fields on every rank"
        )


def reducer() -> StepReducer | None:
    """The reduction for ``StepAccumulator.finish``, or None on a single process (nothing extra happens)."""
    dist = _dist()
    return None if dist is None else StepReducer(dist)


def abstain() -> None:
    """Take part in this step's first collective without statistics, after an internal failure on this rank.

    The other ranks then raise ``RankFailed`` from their reduction and none enters the second collective.
    """
    dist = _dist()
    if dist is None:
        return
    _all_reduce(dist, _first_buffer(_device(dist, torch.empty(0)), 0, 0, failed=True), "max")


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (one MAX all-reduce of 4 bytes, then a host read: only
    on the rare paths that need it, a checkpoint save or the guard's failure path, never on the per-step path)."""
    dist = _dist()
    t = torch.tensor([1.0 if flag else 0.0])
    if dist is not None:
        t = t.to(_device(dist, t))
        _all_reduce(dist, t, "max")
    return t.item() > 0  # the documented host read of this rare path


def raise_if_any_rank_failed(error: Exception | None, what: str) -> None:
    failed = any_rank(error is not None)
    if error is not None:
        raise RuntimeError(f"{what} failed on this rank: {error!r}") from error
    if failed:
        raise RuntimeError(f"{what}: another rank failed to save; stopping all ranks")
