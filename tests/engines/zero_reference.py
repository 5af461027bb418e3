"""Float64 references over DeepSpeed ZeRO's fp32 master partitions, for the engine workers."""

from __future__ import annotations

import torch
from torch import distributed as dist


def masters(eng) -> list[torch.Tensor]:
    """A float64 copy of this rank's fp32 master partitions (ZeRO 3 or ZeRO 1/2)."""
    opt = eng.optimizer
    return [m.detach().double().clone() for m in
            (getattr(opt, "fp32_partitioned_groups_flat", None) or opt.single_partition_of_fp32_groups)]


def exact_update(before: list[torch.Tensor], after: list[torch.Tensor]) -> tuple[float, float]:
    """(||theta||, ||dtheta|| / ||theta||) over every rank's master partition (one all-reduce)."""
    sq = torch.stack([sum((b * b).sum() for b in before), sum(((a - b) ** 2).sum() for a, b in zip(after, before))])
    dist.all_reduce(sq)
    return float(sq[0].sqrt()), float((sq[1] / sq[0]).sqrt())
