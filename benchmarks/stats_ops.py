"""Torch operations one micro-batch's statistics dispatch outside compiled code, per engine path.

On a GPU each such operation that computes something is a kernel launch, so this is what bounds the host time per
micro-batch there (views and slices are counted too, though they launch nothing). The compiled code itself is
left out: ``torch.compile`` does not run under a dispatch mode, so the compiled function runs with the counting
mode switched off, and its own kernels are reported by the compiler (``generated_kernels``: the fused loops it
generated for that call's first compile). Counted on CPU, where the paths dispatch the same operations as on a
GPU, except that CPU histograms count with ``bincount`` (one operation) where a GPU uses ``index_add_``.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from rl_guard.stats import eager, families
from rl_guard.stats.batch import TokenBatch
from rl_guard.stats.constants import DEFAULT_LAG_EDGES
from rl_guard.stats.eager import eager_probe

# TRL's defaults (the old log-probs are the log-probs themselves, per-sequence advantages) and every field
SETUPS = {"trl_defaults": ("entropy",), "every_field": ("entropy", "ref", "versions")}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _batch(fields: tuple, rows: int = 32, cols: int = 512) -> TokenBatch:
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(rows, cols, generator=g) * 3
    d = {
        "logprobs": lp,
        "mask": torch.rand(rows, cols, generator=g) < 0.9,
        "advantages": torch.randn(rows, generator=g),
    }
    d["old_logprobs"] = lp if "versions" not in fields else lp + 0.01 * torch.randn(rows, cols, generator=g)
    if "entropy" in fields:
        d["entropy"] = torch.rand(rows, cols, generator=g) * 3
    if "ref" in fields:
        d["ref_logprobs"] = lp + 0.01 * torch.randn(rows, cols, generator=g)
    if "versions" in fields:
        d["versions"] = torch.randint(0, 12, (rows,), generator=g)
    return TokenBatch(**d, current_version=12 if "versions" in fields else None)


def ops_per_microbatch() -> dict:
    """``{setup: {"eager": ops, "compiled": ops, "generated_kernels": n}}`` for a 32 x 512-token micro-batch."""
    from torch._inductor import metrics

    real, real_whole = families.kernel, eager.whole_kernel

    def uncounted(fn):
        def call(*args, **kwargs):
            with _disable_current_modes():
                return fn(*args, **kwargs)

        return call

    def kernel(s, compiled, ops=families.xp.TORCH):
        fn = real(s, compiled, ops)
        return uncounted(fn) if compiled else fn

    out = {}
    families.kernel = kernel
    eager.whole_kernel = lambda **fixed: uncounted(real_whole(**fixed))
    try:
        for setup, fields in SETUPS.items():
            b, row = _batch(fields), {}
            for compiled in (False, True):
                metrics.reset()
                eager_probe(b, DEFAULT_LAG_EDGES, None, compiled=compiled)  # compiles, on the compiled path
                generated = metrics.generated_kernel_count
                count = _Count()
                with count:
                    eager_probe(b, DEFAULT_LAG_EDGES, None, compiled=compiled)
                row["compiled" if compiled else "eager"] = sum(count.ops.values())
            row["generated_kernels"] = generated
            out[setup] = row
    finally:
        families.kernel, eager.whole_kernel = real, real_whole
    return out
