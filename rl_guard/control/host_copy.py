"""Host copies of the model's and the optimizer's tensors, taken with one multi-tensor copy per capture.

A snapshot used to rebuild ``model.state_dict()`` and clone each tensor one by one: dozens of small ops per
capture, each with its own dispatch cost (and, from a GPU, its own synchronisation). ``HostCopies`` keeps

- the layout: which live tensors the model's state dict holds (found once through ``state_dict(keep_vars=True)``
  and re-read from the modules' own parameter and buffer dicts at each capture), checked by identity against weak
  references, so a replaced parameter or a rebuilt optimizer state (``load_state_dict``) is noticed (modules or
  parameters added to the model after the first capture are not: the model's structure is read once);
- slots: sets of host tensors shaped like the live ones. A capture copies every live tensor into a free slot with
  one ``torch._foreach_copy_`` (non-blocking from a GPU into pinned memory, then one wait on the stream, so the
  snapshot is complete when ``capture`` returns).

A slot is reused only once nothing refers to it: no Python reference to its tensors outside the slot (the
snapshot holding them was dropped, e.g. evicted from the snapshot ring or saved to disk) and no other tensor
sharing their storage (a view). A snapshot that is still held therefore never changes. Steady state with a ring
of ``keep`` snapshots: ``keep`` slots held by the ring plus the one evicted last, kept for the next capture.

Models whose state dict is not plain parameters and buffers (a state-dict hook, tensor subclasses such as FSDP2's
DTensor, sparse or meta tensors) return None from ``model_tensors`` and are captured by the caller's generic path.
"""

from __future__ import annotations

import sys
import weakref

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain(t) -> bool:
    return type(t) in _PLAIN and t.layout is torch.strided and not t.is_meta and not t.is_quantized


def _refcounts(tensors: list[torch.Tensor]) -> list[int]:
    return [sys.getrefcount(t) for t in tensors]  # the same expression each time: the loop variable counts once


class _Slot:
    def __init__(self, like: list[torch.Tensor]):
        # Host memory, pinned for a GPU's async copy (empty_like, the cheaper call, cannot pin).
        self.tensors = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True) if t.is_cuda
                        else torch.empty_like(t, device="cpu", requires_grad=False) for t in like]
        # The storages are held here (one use each, counted in the baseline) so that counting their other users
        # (views) needs no new storage object per check.
        self._held = [t.untyped_storage() for t in self.tensors]
        self._storages = [s._cdata for s in self._held]
        self._refs, self._uses = _refcounts(self.tensors), self._storage_uses()
        self._first = self._first_refs()

    def _first_refs(self) -> int:
        return sys.getrefcount(self.tensors[0]) if self.tensors else 0

    def _storage_uses(self) -> list[int]:
        return [torch._C._storage_Use_Count(s) for s in self._storages]

    def free(self) -> bool:
        """No reference to the slot's tensors and no view of their storage outside the slot."""
        if self._first_refs() != self._first:  # held by a snapshot: no need to look at the others
            return False
        return _refcounts(self.tensors) == self._refs and self._storage_uses() == self._uses


class HostCopies:
    def __init__(self):
        self._model_entries: list | None = None  # [(state-dict name, owner dict, key)]; [] = not plain
        self._refs: list[weakref.ref] = []       # the live tensors of the last capture
        self._shapes: list[tuple] = []           # what the slots are shaped for
        self._slots: list[_Slot] = []

    # -- which tensors ------------------------------------------------------------------------------------------
    def model_tensors(self, model) -> tuple[list[str], list[torch.Tensor]] | None:
        """The model's state-dict names and live tensors, or None when the state dict is not plain."""
        if self._model_entries == []:  # checked once: a model that is not plain stays so
            return None
        if self._model_entries is not None:
            names, live = [], []
            for name, owner, key in self._model_entries:
                names.append(name)
                live.append(owner.get(key))
            if all(r() is t for r, t in zip(self._refs, live)):  # the model's tensors are listed first
                return names, live
        self._model_entries = _entries(model)
        if not self._model_entries:
            return None
        return [e[0] for e in self._model_entries], [e[1][e[2]] for e in self._model_entries]

    # -- copying ------------------------------------------------------------------------------------------------
    def copy(self, live: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Host copies of ``live``, in a slot no one else refers to; None if a tensor is not plain."""
        if len(live) != len(self._refs) or any(r() is not t for r, t in zip(self._refs, live)):
            if not all(plain(t) for t in live):
                return None
            self._relayout(live)
        free = [s.free() for s in self._slots]
        slot = next((s for s, f in zip(self._slots, free) if f), None)
        # Slots no snapshot holds any more, beyond the one used now, are let go (their memory is freed).
        self._slots = [s for s, f in zip(self._slots, free) if not f or s is slot]
        if slot is None:
            slot = _Slot(live)
            self._slots.append(slot)
        cuda = {t.device for t in live if t.is_cuda}
        with torch.no_grad():
            torch._foreach_copy_(slot.tensors, live, non_blocking=bool(cuda))
        for device in cuda:  # the host reads the snapshot (restore, torch.save) once capture returns
            torch.cuda.current_stream(device).synchronize()
        return list(slot.tensors)

    def _relayout(self, live: list[torch.Tensor]) -> None:
        shapes = [(t.shape, t.dtype, t.is_cuda) for t in live]
        if shapes != self._shapes:
            self._slots, self._shapes = [], shapes  # snapshots that still hold old slots keep them alive
        self._refs = [weakref.ref(t) for t in live]


def _entries(model) -> list:
    """[(name, owner dict, key)] for every state-dict entry when each is a plain tensor held in its module's own
    parameter or buffer dict (no state-dict hook replaced it); [] otherwise."""
    entries = []
    modules = dict(model.named_modules(remove_duplicate=False))  # as state_dict, a shared module under each name
    for name, t in model.state_dict(keep_vars=True).items():
        prefix, _, key = name.rpartition(".")
        module = modules.get(prefix)
        if module is None:
            return []
        owner = next((d for d in (module._parameters, module._buffers) if d.get(key) is t), None)
        if owner is None or not plain(t):
            return []
        entries.append((name, owner, key))
    return entries
