"""Every operation that would make an accelerator wait for the host, seen on a CPU-only run.

On CPU nothing synchronises, so the detector models what a GPU would do. Two interposers see every call:

* a ``TorchFunctionMode`` for reads made from Python: ``.cpu()``, ``.numpy()``, ``.tolist()``, ``__array__``,
  ``.item()``, ``bool/float/int/complex(t)``, ``__index__`` (``range(t)``, ``lst[t]``), ``format(t)``,
  ``repr/str(t)``, and ``.to("cpu")`` (named by the string: on a CPU run ``torch.device("cpu")`` is the device);
  the other way, ``.to(device)``, ``torch.tensor(..., device=device)`` and ``torch.as_tensor(..., device=device)``
  of host data (a device object is the device; ``non_blocking`` copies are queued, not waited for);
* a ``TorchDispatchMode`` for what reaches the kernels: ``_local_scalar_dense`` (every scalar read, including
  ones made inside torch), ``equal`` / ``is_nonzero``, ops whose output shape depends on the data (``nonzero``,
  ``torch.where(cond)``, ``masked_select``, ``unique*``, ``repeat_interleave`` with tensor repeats and no
  ``output_size``, ``bincount``, indexing with a boolean mask), device->host copies (``_to_copy`` / ``copy_`` /
  ``_foreach_copy_`` from a non-CPU tensor or from a tensor marked device-side into a CPU one), blocking
  host->device copies into a device-side tensor (CUDA synchronises the stream for those too; ``t[i] = 3`` is one
  up to torch 2.14, which copies the number from a host tensor; 2.15 fills it in),
  and collectives (``c10d.*``).

A call counted at the Python level hides the kernels it runs (``.item()`` is one event, not two).

What a CPU run cannot tell: whether ``.to(some_device)`` or ``copy_`` moves data to the host, since every
device is the CPU. ``mark_device(t)`` declares tensors device-side (the mark follows every op's outputs, and
tensors created with a ``device=`` given as a device object, i.e. on the data's device, get it too; ones made with
``device="cpu"``, the string, are host memory), so a ``copy_`` from them into an unmarked CPU tensor is a
transfer; with no marks only explicit host reads count. The CUDA test under
``torch.cuda.set_sync_debug_mode("error")`` covers real transfers.

Documented sites: syncs the package makes on purpose are recognised by the function they happen in (its code
object anywhere on the stack), e.g. ``rl_guard.stats.accumulate.to_host``, the step's one device->host transfer.
Nothing is added to the package for this, so the hot path pays nothing.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import CodeType

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

import rl_guard
from rl_guard.control.state import TrainState
from rl_guard.stats import accumulate, ranks, sketch

aten = torch.ops.aten
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
GUARD_DIR = os.path.dirname(rl_guard.__file__) + os.sep
THIS_FILE = __file__

# The syncs the package documents. "step transfer": StepAccumulator.finish moves the packed statistics to the host
# once per optimizer step. "rank header": with a process group, the merged header of the first collective is read
# on the host before the second one (rl_guard/stats/ranks.py docstring).
# A site is (code object, the op names allowed there or None for any).
STEP_TRANSFER = {"step transfer": (accumulate.to_host.__code__, None)}
RANK_HEADER = {"rank header": (ranks.read_header.__code__, None)}
# bincount sizes its output from the data, a sync on CUDA; count_cells uses it on CPU only, where it is the fastest
# exact counter, and a fixed-size index_add_ elsewhere (that branch runs in the CUDA test).
CPU_ONLY_BINCOUNT = {"cpu-only bincount": (sketch.count_cells.__code__, {"aten.bincount.default"})}
# Healthy snapshots (rollback rules) and checkpoints copy the training state to host memory by design, only on
# the steps they are due (docs/config.md, "Decisions").
STATE_CAPTURE = {
    "state capture": (TrainState.capture.__code__, {"Tensor.to(cpu)", "Tensor.cpu", "aten._foreach_copy_.default"})
}
DEFAULT_SITES = {**STEP_TRANSFER, **CPU_ONLY_BINCOUNT, **STATE_CAPTURE}

# Python-level reads: (kind, name) by the function torch hands to the mode.
_T = torch.Tensor
PY_READS = {
    _T.cpu: ("host_read", "Tensor.cpu"),
    _T.numpy: ("host_read", "Tensor.numpy"),
    _T.tolist: ("host_read", "Tensor.tolist"),
    _T.__array__: ("host_read", "Tensor.__array__"),
    _T.__repr__: ("host_read", "Tensor.__repr__"),
    _T.__str__: ("host_read", "Tensor.__str__"),
    _T.item: ("scalar_read", "Tensor.item"),
    _T.__bool__: ("scalar_read", "Tensor.__bool__"),
    _T.__float__: ("scalar_read", "Tensor.__float__"),
    _T.__int__: ("scalar_read", "Tensor.__int__"),
    _T.__complex__: ("scalar_read", "Tensor.__complex__"),
    _T.__index__: ("scalar_read", "Tensor.__index__"),
    _T.__format__: ("scalar_read", "Tensor.__format__"),
}

SCALAR_OPS = {aten._local_scalar_dense, aten.item, aten.is_nonzero}
COMPARE_OPS = {aten.equal}
SHAPE_OPS = {
    aten.nonzero,
    aten.nonzero_numpy,
    aten.argwhere,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.unique_dim_consecutive,
    aten.bincount,
}
REPEAT_OPS = {aten.repeat_interleave}
INDEX_OPS = {aten.index, aten._unsafe_index}
INDEX_PUT_OPS = {aten.index_put, aten.index_put_, aten._index_put_impl_, aten._unsafe_index_put}
COPY_OPS = {aten._to_copy, aten.copy_, aten.copy, aten._copy_from, aten._copy_from_and_resize, aten._foreach_copy_}


@dataclass(frozen=True)
class Sync:
    kind: str  # scalar_read, host_read, compare, data_dependent_shape, device_to_host, host_to_device, collective
    op: str
    file: str  # the nearest caller outside torch (relative to the package when inside it)
    line: int
    function: str
    site: str | None  # the documented site it happened in, if any
    callers: tuple[str, ...]  # function names up the stack, innermost first

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line} ({self.function})"

    def __str__(self) -> str:
        return f"{self.kind} {self.op} at {self.where}" + (f" [{self.site}]" if self.site else "")


def _is_bool_index(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


def _target_device(args, kwargs):
    """The device ``Tensor.to(*args, **kwargs)`` moves to, and whether it was named by a string (None if kept)."""
    target = kwargs.get("device")
    if target is None:
        for a in args:
            if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
                target = a
                break
            if isinstance(a, torch.Tensor):
                return a.device, False
    if target is None:
        return None, False
    return torch.device(target), isinstance(target, str)


def _non_blocking(args, kwargs) -> bool:
    return bool(kwargs.get("non_blocking")) or any(a is True for a in args)  # to(device, dtype, non_blocking)


class _Functions(TorchFunctionMode):
    def __init__(self, detector: SyncDetector):
        super().__init__()
        self.d = detector

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        d = self.d
        found = PY_READS.get(func)
        if found is None and func is _T.to and args:
            target, named = _target_device(args[1:], kwargs)
            src = args[0]
            # On a CPU run a device object named "cpu" is the stand-in device itself, so only the string "cpu"
            # (or a real non-CPU source) says "to the host".
            if target is not None and target.type == "cpu" and (named or src.device.type != "cpu"):
                found = (
                    "device_to_host" if src.device.type != "cpu" or d.is_device(src) else "host_read",
                    "Tensor.to(cpu)",
                )
            # ... and a device object is the device: a blocking copy of host memory there waits for the stream
            elif (
                target is not None
                and not named
                and d._marked
                and not d.is_device(src)
                and not _non_blocking(args[1:], kwargs)
            ):
                found = ("host_to_device", "Tensor.to(device)")
        elif found is None and func in (torch.tensor, torch.as_tensor) and d._marked:
            device = kwargs.get("device")
            if device is not None and not isinstance(device, str) and not any(map(d.is_device, _tensors(args))):
                found = ("host_to_device", f"torch.{func.__name__}(device=...)")
        if found is None or d._inside:
            out = func(*args, **kwargs)
            device = kwargs.get("device")
            if d._marked and device is not None and not isinstance(device, str) and next(_tensors(args), None) is None:
                d.mark_device(*_tensors(out))  # a buffer made on "the data's device" (a device object) is on the device
            elif d._marked and device == "cpu":  # named host memory (e.g. empty_like(t, device="cpu")) is the host's
                for t in _tensors(out):
                    d._marked.pop(t, None)
            return out
        d._record(*found)
        d._inside += 1  # the kernels this read runs are the same event
        try:
            return func(*args, **kwargs)
        finally:
            d._inside -= 1


class _Kernels(TorchDispatchMode):
    def __init__(self, detector: SyncDetector):
        super().__init__()
        self.d = detector

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        d = self.d
        if not d._inside:
            found = self._classify(func, args, kwargs)
            if found is not None:
                d._record(*found)
        out = func(*args, **kwargs)
        # Placement follows the data, except that a copy lands where its destination already is.
        if (
            d._marked
            and func.overloadpacket not in COPY_OPS - {aten._to_copy}
            and any(d.is_device(t) for t in _tensors((args, kwargs)))
        ):
            d.mark_device(*_tensors(out))
        return out

    def _classify(self, func, args, kwargs):
        d = self.d
        packet = func.overloadpacket
        name = str(func)
        if packet in SCALAR_OPS:
            return "scalar_read", name
        if packet in COMPARE_OPS:
            return "compare", name
        if packet in SHAPE_OPS:
            return "data_dependent_shape", name
        if packet in REPEAT_OPS and kwargs.get("output_size") is None and func is not aten.repeat_interleave.self_int:
            return "data_dependent_shape", name
        if packet in INDEX_OPS and any(_is_bool_index(i) for i in (args[1] if len(args) > 1 else ())):
            return "data_dependent_shape", name + " (boolean mask)"
        if packet in INDEX_PUT_OPS:
            indices, values = args[1], args[2]
            masked_fill = (
                len(indices) == 1
                and _is_bool_index(indices[0])
                and values.numel() == 1
                and values.device.type == "cpu"
                and not d.is_device(values)
            )
            if any(_is_bool_index(i) for i in indices) and not masked_fill:  # masked_fill needs no count
                return "data_dependent_shape", name + " (boolean mask)"
        if packet is aten._to_copy:
            target = kwargs.get("device")
            if target is not None and torch.device(target).type == "cpu" and args[0].device.type != "cpu":
                return "device_to_host", name
            if (
                target is not None
                and torch.device(target).type != "cpu"
                and args[0].device.type == "cpu"
                and (not kwargs.get("non_blocking"))
            ):
                return "host_to_device", name
        elif packet is aten._foreach_copy_:  # one event for the whole list (a GPU waits once, at the end)
            if any(
                dst.device.type == "cpu" and not d.is_device(dst) and d.is_device(src)
                for dst, src in zip(args[0], args[1])
            ):
                return "device_to_host", name
        elif packet in COPY_OPS and len(args) > 1 and isinstance(args[1], torch.Tensor):
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and not d.is_device(dst) and d.is_device(src):
                return "device_to_host", name
            # A blocking copy from host memory waits for the stream too (CUDA's memcpy_and_sync), a 0-dim one as
            # well: a Python number written into a GPU tensor (t[i] = 3) synchronised under torch's sync-debug mode
            # on an H200 (torch 2.11).
            if d.is_device(dst) and src.device.type == "cpu" and not d.is_device(src):
                return "host_to_device", name
        if func.namespace == "c10d":
            return "collective", name
        return None


class SyncDetector:
    """``with SyncDetector() as det: ...`` records every synchronising op into ``det.events``.

    ``documented`` maps a name to ``(code object, op names or None)``: syncs made inside that function (and, if
    given, only those ops) are intended (see ``DEFAULT_SITES``); such events carry the name in ``site``.
    """

    def __init__(self, documented: dict[str, tuple[CodeType, set[str] | None]] | None = None):
        self.documented = dict(DEFAULT_SITES if documented is None else documented)
        self._codes = {code: (name, ops) for name, (code, ops) in self.documented.items()}
        self.events: list[Sync] = []
        self._inside = 0
        self._marked: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._modes = None

    # -- placement --------------------------------------------------------------------------------------------------
    def mark_device(self, *tensors: torch.Tensor) -> None:
        """Declare tensors device-side: a copy from them (or anything computed from them) to the host counts."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._marked[t] = True

    def is_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (t.device.type != "cpu" or (bool(self._marked) and t in self._marked))

    # -- recording --------------------------------------------------------------------------------------------------
    def _record(self, kind: str, op: str) -> None:
        frame = sys._getframe(2)
        caller = None
        site = None
        callers = []
        while frame is not None:
            code = frame.f_code
            if caller is None and not code.co_filename.startswith(TORCH_DIR) and code.co_filename != THIS_FILE:
                caller = frame
            if site is None and code in self._codes:
                name, ops = self._codes[code]
                site = name if ops is None or op in ops else None
            if caller is not None:
                callers.append(code.co_name)
            frame = frame.f_back
        if caller is None:
            file, line, function = "<torch>", 0, "<torch>"
        else:
            file, line, function = caller.f_code.co_filename, caller.f_lineno, caller.f_code.co_name
            if file.startswith(GUARD_DIR):
                file = "rl_guard/" + os.path.relpath(file, GUARD_DIR)
        self.events.append(Sync(kind, op, file, line, function, site, tuple(callers)))

    def __enter__(self) -> SyncDetector:
        self._modes = (_Functions(self), _Kernels(self))
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self._modes = None

    # -- reading ----------------------------------------------------------------------------------------------------
    def take(self) -> list[Sync]:
        out, self.events = self.events, []
        return out
