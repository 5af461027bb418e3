"""The array operations the statistics are written in, for torch tensors (``TORCH``) and numpy arrays (``NUMPY``).

The token statistics (``families.py``) and their finishing (``eager.py``) are written once against one of these
namespaces: arithmetic, comparisons, bit operators, indexing and ``.sum``/``.reshape`` are spelled alike in both
libraries, and the few operations spelled differently are here. Run with ``TORCH`` they are the eager engine (and,
under ``torch.compile``, the compiled one); with ``NUMPY`` on CPU tensors read in place, the same statistics for
small CPU micro-batches, where a torch call's dispatch (a few microseconds) costs more than the arithmetic.

numpy keeps float32 float32 when a Python number joins it (NEP 50, numpy >= 2); only a result built from Python
numbers alone would be float64, so ``where`` of two numbers gives float32, as torch does.
"""

from __future__ import annotations

import math

import numpy as np
import torch

INF = math.inf


class TorchOps:
    name = "torch"
    f32, f64, i32, i64, bool_ = torch.float32, torch.float64, torch.int32, torch.int64, torch.bool
    where, stack, cat = staticmethod(torch.where), staticmethod(torch.stack), staticmethod(torch.cat)
    exp, abs, sign, round = (
        staticmethod(torch.exp),
        staticmethod(torch.abs),
        staticmethod(torch.sign),
        staticmethod(torch.round),
    )
    maximum, minimum = staticmethod(torch.maximum), staticmethod(torch.minimum)

    @staticmethod
    def cast(t, dtype):
        return t.to(dtype)

    @staticmethod
    def clamp(t, lo=None, hi=None):
        return torch.clamp(t, lo, hi)

    @staticmethod
    def amax(t, dim=None):
        return t.amax() if dim is None else t.amax(dim)

    @staticmethod
    def amin(t, dim=None):
        return t.amin() if dim is None else t.amin(dim)

    @staticmethod
    def total(t):
        """The sum of every element, along each row first: under the compiler every reduction of a chunk then
        fuses into one loop nest."""
        return t.sum(-1).sum()

    @staticmethod
    def max_where(t, valid):
        """The largest element where ``valid`` (-inf if none), along each row first."""
        return torch.where(valid, t, -INF).amax(-1).amax()

    @staticmethod
    def min_where(t, valid):
        return torch.where(valid, t, INF).amin(-1).amin()

    @staticmethod
    def size(t) -> int:
        return t.numel()

    @staticmethod
    def ndim(t) -> int:
        return t.dim()

    @staticmethod
    def full(shape, value, dtype, device):
        return torch.full(shape, value, dtype=dtype, device=device)

    @staticmethod
    def zeros(shape, dtype, device):
        return torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def copy(t):
        return t.clone()

    @staticmethod
    def bits(t):
        """A float32 tensor's bits as int32 (no copy)."""
        return t.view(torch.int32)

    @staticmethod
    def expand(t, shape):
        return t if t.shape == shape else t.expand(shape)

    @staticmethod
    def add_at(t, index, values):
        """``t[index] += values`` in place (``index``: distinct positions)."""
        return t.index_add_(0, index, values.to(t.dtype))

    @staticmethod
    def to_torch(t):
        return t


def _f32(x):
    return np.float32(x) if isinstance(x, float) else x


class NumpyOps:
    name = "numpy"
    f32, f64, i32, i64, bool_ = np.float32, np.float64, np.int32, np.int64, np.bool_
    cat = staticmethod(np.concatenate)
    exp, abs, sign, round = staticmethod(np.exp), staticmethod(np.abs), staticmethod(np.sign), staticmethod(np.round)
    maximum, minimum = staticmethod(np.maximum), staticmethod(np.minimum)

    @staticmethod
    def where(c, a, b):
        return np.where(c, _f32(a), _f32(b)) if type(a) is float is type(b) else np.where(c, a, b)

    @staticmethod
    def stack(arrays):
        return np.array(arrays)  # of equal shapes: ``np.stack``'s result at a fraction of its Python overhead

    @staticmethod
    def cast(t, dtype):
        return np.asarray(t).astype(dtype, copy=False)

    @staticmethod
    def clamp(t, lo=None, hi=None):
        return np.clip(t, lo, hi)

    @staticmethod
    def amax(t, dim=None):
        return np.maximum.reduce(t, dim)

    @staticmethod
    def amin(t, dim=None):
        return np.minimum.reduce(t, dim)

    @staticmethod
    def total(t):
        return t.sum()

    @staticmethod
    def max_where(t, valid):
        return np.maximum.reduce(t, None, where=valid, initial=-INF)

    @staticmethod
    def min_where(t, valid):
        return np.minimum.reduce(t, None, where=valid, initial=INF)

    @staticmethod
    def size(t) -> int:
        return t.size  # numpy scalars have it too

    @staticmethod
    def ndim(t) -> int:
        return t.ndim

    @staticmethod
    def full(shape, value, dtype, device):
        return np.full(shape, value, dtype=dtype)

    @staticmethod
    def zeros(shape, dtype, device):
        return np.zeros(shape, dtype=dtype)

    @staticmethod
    def copy(t):
        return np.array(t)

    @staticmethod
    def bits(t):
        return t.view(np.int32)

    @staticmethod
    def expand(t, shape):
        return t if t.shape == shape else np.broadcast_to(t, shape)

    @staticmethod
    def add_at(t, index, values):
        t[index] += values
        return t

    @staticmethod
    def to_torch(t):
        return torch.from_numpy(np.asarray(t))


TORCH, NUMPY = TorchOps(), NumpyOps()


def of(t) -> TorchOps | NumpyOps:
    """The namespace of an array."""
    return TORCH if isinstance(t, torch.Tensor) else NUMPY
