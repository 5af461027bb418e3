"""Host copies of the model's and the optimizer's tensors, taken with one multi-tensor copy per capture.

A snapshot used to rebuild ``model.state_dict()`` and clone each tensor one by one: dozens of small ops per
capture, each with its own dispatch cost (and, from a GPU, its own synchronisation). ``HostCopies`` keeps the
layout: which live tensors the model's state dict holds (found once through ``state_dict(keep_vars=True)`` and
re-read from the modules' own parameter and buffer dicts at each capture), checked by identity against weak
references, so a replaced parameter or a rebuilt optimizer state (``load_state_dict``) is noticed (modules or
parameters added to the model after the first capture are not: the model's structure is read once). A capture
allocates fresh host tensors shaped like the live ones and fills them with one ``torch._foreach_copy_``
(non-blocking from a GPU into pinned memory, then one wait on the stream, so the snapshot is complete when
``capture`` returns). The copies belong to the snapshot alone: nothing the guard does later writes into them.

Models whose state dict is not plain parameters and buffers (a state-dict hook, tensor subclasses such as FSDP2's
DTensor, sparse or meta tensors) return None from ``model_tensors`` and are captured by the caller's generic path.
"""

from __future__ import annotations

import weakref

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain(t) -> bool:
    return type(t) in _PLAIN and t.layout is torch.strided and not t.is_meta and not t.is_quantized


def _host_like(t: torch.Tensor) -> torch.Tensor:
    # pinned for a GPU's async copy (empty_like, the cheaper call, cannot pin); torch caches pinned blocks
    if t.is_cuda:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    return torch.empty_like(t, device="cpu", requires_grad=False)


class HostCopies:
    def __init__(self):
        self._model_entries: list | None = None  # [(state-dict name, owner dict, key)]; [] = not plain
        self._refs: list[weakref.ref] = []  # the live tensors of the last capture

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
        """Fresh host copies of ``live``; None if a tensor is not plain."""
        if len(live) != len(self._refs) or any(r() is not t for r, t in zip(self._refs, live)):
            if not all(plain(t) for t in live):
                return None
            self._refs = [weakref.ref(t) for t in live]
        out = [_host_like(t) for t in live]
        cuda = {t.device for t in live if t.is_cuda}
        with torch.no_grad():
            torch._foreach_copy_(out, live, non_blocking=bool(cuda))
        for device in cuda:  # the host reads the snapshot (restore, torch.save) once capture returns
            torch.cuda.current_stream(device).synchronize()
        return out


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
