"""The array operations the statistics are written in, for torch tensors (``TORCH``) and numpy arrays (``NUMPY``).

The token statistics (``families.py``) and the per-sequence ones (``sequences.py``) are written once against one of
these namespaces: arithmetic, comparisons, bit operators, indexing, ``.sum`` and ``.reshape`` are spelled alike in
both libraries, and the few operations spelled differently are here (which engine runs which: ``stats/__init__.py``).

numpy (>= 2: NEP 50) keeps float32 float32 when a Python number joins it; only a result made of Python numbers
alone would be float64, so ``where`` of two numbers gives float32, as torch does.
"""

from __future__ import annotations

import math

import numpy as np
import torch

INF = math.inf


class TorchOps:
    f32, f64, i32, bool_ = torch.float32, torch.float64, torch.int32, torch.bool
    where, stack, cat = staticmethod(torch.where), staticmethod(torch.stack), staticmethod(torch.cat)
    exp, abs, sign, round = (
        staticmethod(torch.exp),
        staticmethod(torch.abs),
        staticmethod(torch.sign),
        staticmethod(torch.round),
    )
    cast = staticmethod(lambda t, dtype: t.to(dtype))
    clamp = staticmethod(lambda t, lo=None, hi=None: torch.clamp(t, lo, hi))
    amax = staticmethod(lambda t, dim: t.amax(dim))
    # every reduction along each row first: under the compiler all of a chunk's reductions fuse into one loop nest
    total = staticmethod(lambda t: t.sum(-1).sum())
    max_where = staticmethod(lambda t, valid: torch.where(valid, t, -INF).amax(-1).amax())
    min_where = staticmethod(lambda t, valid: torch.where(valid, t, INF).amin(-1).amin())
    size = staticmethod(lambda t: t.numel())
    full = staticmethod(lambda shape, value, dtype, device: torch.full(shape, value, dtype=dtype, device=device))
    zeros = staticmethod(lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
    copy = staticmethod(lambda t: t.clone())
    bits = staticmethod(lambda t: t.view(torch.int32))  # a float32 tensor's bits, no copy
    # where t is finite: t - t is 0 there and NaN at NaN and +-inf (one vector comparison, where the compiler turns
    # ``isfinite`` into a scalar loop per vector)
    finite = staticmethod(lambda t: (t - t) == 0)
    add_at = staticmethod(lambda t, index, values: t.index_add_(0, index, values.to(t.dtype)))  # distinct index
    to_torch = staticmethod(lambda t: t)


def _np_where(c, a, b):
    if type(a) is float and type(b) is float:
        a, b = np.float32(a), np.float32(b)
    return np.where(c, a, b)


def _np_add_at(t, index, values):
    t[index] += values
    return t


class NumpyOps:
    f32, f64, i32, bool_ = np.float32, np.float64, np.int32, np.bool_
    where = staticmethod(_np_where)
    stack = staticmethod(np.array)  # of equal shapes: ``np.stack``'s result at a fraction of its Python overhead
    cat = staticmethod(np.concatenate)
    exp, abs, sign, round = staticmethod(np.exp), staticmethod(np.abs), staticmethod(np.sign), staticmethod(np.round)
    cast = staticmethod(lambda t, dtype: np.asarray(t).astype(dtype, copy=False))
    clamp = staticmethod(np.clip)
    amax = staticmethod(lambda t, dim: np.maximum.reduce(t, dim))
    total = staticmethod(lambda t: t.sum())
    # a reduction's ``where=`` is twice as slow as ``np.where`` and a plain reduction (which needs a non-empty t)
    max_where = staticmethod(lambda t, valid: np.maximum.reduce(np.where(valid, t, -INF), None))
    min_where = staticmethod(lambda t, valid: np.minimum.reduce(np.where(valid, t, INF), None))
    size = staticmethod(lambda t: t.size)  # numpy scalars have it too
    full = staticmethod(lambda shape, value, dtype, device: np.full(shape, value, dtype=dtype))
    zeros = staticmethod(lambda shape, dtype, device: np.zeros(shape, dtype=dtype))
    copy = staticmethod(np.array)
    bits = staticmethod(lambda t: t.view(np.int32))
    finite = staticmethod(np.isfinite)
    add_at = staticmethod(_np_add_at)
    to_torch = staticmethod(torch.from_numpy)


TORCH, NUMPY = TorchOps(), NumpyOps()


def of(t) -> TorchOps | NumpyOps:
    """The namespace of an array."""
    return TORCH if isinstance(t, torch.Tensor) else NUMPY
