"""The guard's per-micro-batch statistics, computed on one worker thread while the trainer goes on.

``observe`` is called between a micro-batch's forward and its backward. Probing the batch is a few hundred small
device operations; launched from the training thread they sit on the step's critical path (on CPU they *are*
the work; on a GPU their launch overhead is). Handed to a worker thread, they run while the trainer's backward
runs without the GIL, and ``check`` waits for them (``drain``) before it reads the step's statistics. The worker
only reads the batch's tensors, which the trainer does not modify, and writes the guard's accumulator, which
nothing else touches until ``drain`` returns: ``Guard`` routes every accumulator write outside ``check``
through ``submit``, so they land in call order.

On CUDA the work is issued on the stream that was current when ``observe`` was called (streams are per thread),
so it is ordered after the kernels that produced the batch. Thread-local state does not follow the work: the
probes run without autocast (their float32/float64 arithmetic is meant) and under ``no_grad``. A failure on the
worker is handed back by ``drain`` and goes through the guard's failure policy like any observe failure.

``background_stats: false`` runs every submitted call inline, in the caller's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


def _run(fn: Callable[[], None], stream) -> None:
    with torch.no_grad():
        if stream is None:
            fn()
            return
        with torch.cuda.stream(stream):
            fn()


class Background:
    """One worker thread (started at the first submission) running calls in submission order."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def submit(self, fn: Callable[[], None], device: torch.device | None = None) -> None:
        if not self.enabled:
            fn()
            return
        stream = torch.cuda.current_stream(device) if device is not None and device.type == "cuda" else None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl_guard-stats")
        self._pending.append(self._pool.submit(_run, fn, stream))

    def drain(self) -> list[BaseException]:
        """Wait for everything submitted; returns the exceptions raised, in submission order."""
        pending, self._pending = self._pending, []
        return [exc for exc in (f.exception() for f in pending) if exc is not None]

    def close(self) -> None:
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
