"""The token-statistics engine of one guard, chosen by ``stats_engine: auto | eager | compiled`` (what each does and
why ``auto`` picks it: ``docs/statistics.md``, "Engines"; ``describe`` says it at attach).

``eager`` runs the one definition (``families.chunk_stats``, ``sequences``) as torch operations (``eager.py``),
``compiled`` the same code under ``torch.compile`` (a one-chunk micro-batch whole, a larger one chunk by chunk);
small CPU micro-batches run it on numpy views of their tensors (``xp.NUMPY``) whatever the name. Each engine keeps
its own failure state: a fault of the host path or of the compiler costs speed, never the statistics (one warning,
then torch eagerly for the rest of that guard's life). A caller's bad batch (``InputError``) is raised as the eager
path raises it and turns nothing off.
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

from ..errors import InputError
from . import xp
from .constants import DEFAULT_LAG_EDGES, STATS_ENGINES
from .eager import eager_loss, eager_probe, eager_sequence_stats, sequence_fields, takes_on_host, whole_compiles
from .partial import Partial

# Measured against the eager path (benchmarks/stats.py small_batch_ms): 2.5x faster at 64 tokens, 3.5x at 8K.
HOST_MAX_TOKENS = 1 << 13
COMPILED_CPU_MIN_TOKENS = 1 << 13  # below this a CPU micro-batch is cheaper eager (measured crossover ~8K tokens)


def _short(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


class Engine:
    """``stats_engine: name``. ``host_max_tokens``: the largest CPU micro-batch computed by numpy (0: none, every
    CPU tensor takes the path a GPU's takes); ``cpu_min_tokens``: the smallest CPU micro-batch ``compiled``
    compiles."""

    def __init__(
        self, name: str = "eager", host_max_tokens: int = HOST_MAX_TOKENS, cpu_min_tokens: int = COMPILED_CPU_MIN_TOKENS
    ) -> None:
        if name not in STATS_ENGINES:
            raise ValueError(f"unknown stats_engine {name!r}; allowed: {', '.join(STATS_ENGINES)}")
        self.name, self.host_max_tokens, self.cpu_min_tokens = name, host_max_tokens, cpu_min_tokens
        self.host_failure: str | None = None  # why the host path is off for this engine (None: usable)
        self.failure: str | None = None  # why the compiled path is off for this engine (None: usable)
        self.whole_failure: str | None = None  # why compiling a micro-batch whole is off (chunk by chunk still on)
        self.triton = importlib.util.find_spec("triton") is not None  # as found when this engine was made

    def compiles_on(self, device) -> bool:
        """Whether this engine compiles the statistics of micro-batches on ``device`` (until a failure)."""
        if self.name == "auto":
            return torch.device(device).type == "cuda" and self.triton
        return self.name == "compiled"

    def probe(self, b, lag_edges=DEFAULT_LAG_EDGES, chunk_tokens: int | None = None) -> Partial:
        """All token-level sufficient statistics of one micro-batch (device tensors, no host sync)."""
        small = chunk_tokens is None and takes_on_host(b, self.host_max_tokens)
        p = self._on_host(small, lambda ops: eager_probe(b, lag_edges, None, ops=ops))
        if p is not None:
            return p
        if self._compiles(b):
            whole = self.whole_failure is None and whole_compiles(b, chunk_tokens)
            try:
                return eager_probe(b, lag_edges, chunk_tokens, compiled=True, whole=whole)
            except InputError:  # the caller's batch is wrong, not the compiler: raised as the eager path would
                raise
            except Exception as e:  # noqa: BLE001 - a compiler problem must cost speed, never the statistics
                # Eagerly first: a batch at fault raises the caller's own error there (inside a compiled graph it
                # surfaces as the compiler's) and turns nothing off.
                p = eager_probe(b, lag_edges, chunk_tokens)
                if whole:  # the chunk-by-chunk compiled path stays on
                    self.whole_failure = _short(e)
                    what = f"cannot compile a whole micro-batch here ({self.whole_failure}); compiling chunk by chunk"
                else:
                    self.failure = _short(e)
                    what = f"cannot compile here ({self.failure}); computing eagerly"
                warnings.warn(
                    f"rl_guard: stats_engine '{self.name}' {what} (same statistics, slower)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return p
        return eager_probe(b, lag_edges, chunk_tokens)

    def _compiles(self, b) -> bool:
        """Not after a failure, and on CPU only from ``cpu_min_tokens`` tokens on (on a GPU every batch: there each
        eager operation is a kernel launch)."""
        n = b.logprobs.numel()
        on_cpu = b.device.type == "cpu"
        return (
            self.failure is None and n > 0 and self.compiles_on(b.device) and (not on_cpu or n >= self.cpu_min_tokens)
        )

    def sequences(self, lengths=None, truncated=None, rewards=None) -> Partial:
        """Per-sequence statistics (lengths, truncated share, rewards); no host sync."""
        fields = sequence_fields(lengths, truncated, rewards)
        if not fields:
            return Partial()
        on_cpu = all(t.device.type == "cpu" for t in fields.values())
        return self._on_host(on_cpu, lambda ops: eager_sequence_stats(fields, ops)) or eager_sequence_stats(fields)

    def loss(self, loss: torch.Tensor) -> Partial:
        """Sum of the finite micro-batch losses and the count of non-finite ones."""
        return self._on_host(loss.device.type == "cpu", lambda ops: eager_loss(loss, ops)) or eager_loss(loss)

    def describe(self, device) -> str:
        """What computes the token statistics on ``device``, and for ``auto`` why, in one sentence."""
        dev = torch.device(device)
        if self.compiles_on(dev):
            where = (
                "Triton kernels"
                if dev.type == "cuda"
                else f"C++ loops, CPU micro-batches from {self.cpu_min_tokens} tokens"
            )
            off = f"; off after a failure: {self.failure}" if self.failure else ""
            what = f"compiled (torch.compile fuses a micro-batch's statistics: {where}; the first step compiles{off})"
        elif dev.type == "cpu" and self._host_on():
            what = f"eager (plain torch operations; micro-batches of up to {self.host_max_tokens} tokens by numpy)"
        else:
            what = "eager (plain torch operations)"
        if self.name != "auto":
            return what
        if dev.type != "cuda":
            why = "on CPU a first compile costs 10-30 s and small micro-batches gain nothing from it"
        elif self.triton:
            why = "each eager operation is a kernel launch, ~300-500 per micro-batch"
        else:
            why = "Triton, which the compiled engine needs on CUDA, is not installed"
        return f"auto -> {what} on {dev.type}: {why}"

    def _host_on(self) -> bool:
        return self.host_max_tokens > 0 and self.host_failure is None

    def _on_host(self, takes: bool, compute) -> Partial | None:
        """``compute(xp.NUMPY)`` where the host path ``takes`` the input and is on, else None (a ``Partial`` is a
        non-empty tuple: ``or`` picks the torch path only for None)."""
        if not (takes and self._host_on()):
            return None
        try:
            return compute(xp.NUMPY)
        except Exception as e:  # noqa: BLE001 - a fault of the host path must cost speed, never the statistics
            self.host_failure = _short(e)
            warnings.warn(
                f"rl_guard: the host path for small CPU micro-batches failed ({self.host_failure}); "
                "computing them with torch (same statistics, slower)",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
