"""Putting host values on the statistics' device without making the host wait.

A plain copy from pageable host memory to a GPU waits for every kernel queued before it (torch's sync-debug mode
flags it), and so does assigning a Python number into a GPU tensor (``t[i] = x``). Small vectors of Python numbers
are therefore built on the device from ``full`` calls, and host tensors go through pinned memory, whose copy is
queued on the stream like a kernel (torch's pinned-memory allocator keeps the block until the copy has run).
"""

from __future__ import annotations

import torch


def device_vector(values: list, device, dtype=torch.float64) -> torch.Tensor:
    """``values`` as a tensor on ``device``, built from one ``full`` per run of equal values: no host-to-device
    copy."""
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            runs.append(torch.full((i - start,), values[start], dtype=dtype, device=device))
            start = i
    return torch.cat(runs) if runs else torch.zeros(0, dtype=dtype, device=device)


def host_to_device(t: torch.Tensor, device, dtype=None) -> torch.Tensor:
    """``t`` on ``device`` (converted there to ``dtype``, if given); from host memory to a GPU through pinned
    memory and a non-blocking copy."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        t = t.pin_memory().to(device, non_blocking=True)
    elif t.device != device:
        t = t.to(device)
    return t if dtype is None else t.to(dtype)
