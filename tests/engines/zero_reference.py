"""What the engine workers compare: sha256 digests of weights, and float64 references over DeepSpeed ZeRO's fp32
master partitions."""

from __future__ import annotations

import hashlib

import torch
from torch import distributed as dist


def digest(tensors) -> str:
    """sha256 of the tensors' fp32 bytes (bf16 -> fp32 is exact, and so is fp32 -> fp64 -> fp32 for ``masters``)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def masters(eng) -> list[torch.Tensor]:
    """A float64 copy of this rank's fp32 master partitions (ZeRO 3 or ZeRO 1/2)."""
    opt = eng.optimizer
    return [
        m.detach().double().clone()
        for m in (getattr(opt, "fp32_partitioned_groups_flat", None) or opt.single_partition_of_fp32_groups)
    ]


def exact_update(before: list[torch.Tensor], after: list[torch.Tensor]) -> tuple[float, float]:
    """(||theta||, ||dtheta|| / ||theta||) over every rank's master partition (one all-reduce)."""
    sq = torch.stack([sum((b * b).sum() for b in before), sum(((a - b) ** 2).sum() for a, b in zip(after, before))])
    dist.all_reduce(sq)
    return float(sq[0].sqrt()), float((sq[1] / sq[0]).sqrt())
