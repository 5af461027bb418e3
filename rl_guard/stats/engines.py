"""The token-statistics engines as objects, chosen by ``stats_engine: auto | eager | compiled``.

- ``eager``: the one definition (``families.chunk_stats``) run chunk by chunk as plain torch operations
  (``eager.py``). Small CPU micro-batches (up to ``HOST_MAX_TOKENS`` tokens, float32 fields, padded, no policy
  versions) run the same functions on numpy views of their tensors (``xp.NUMPY``): the same statistics in the same
  layout, without ~200 torch calls' dispatch cost.
- ``compiled``: the same function under ``torch.compile`` (C++ loops on CPU, Triton on CUDA). CPU
  micro-batches under ``COMPILED_CPU_MIN_TOKENS`` tokens stay eager (a compiled call's fixed cost exceeds its gain).
- ``auto``: ``compiled`` on a CUDA device where Triton is importable (there every eager operation is a kernel
  launch, ~300-500 per micro-batch, whatever its size), ``eager`` elsewhere (on CPU a first compile costs 10-30 s
  and needs a C++ compiler, and a typical CPU run's micro-batches are small enough to stay eager or on the host
  anyway). ``describe`` says which, and why; the guard says it once when it is attached.

Every engine instance keeps its own failure state: a fault of the host path or of the compiler costs speed, never
the statistics. The engine warns once, computes that micro-batch eagerly and keeps the faulty path off for the rest
of its life (one guard); another guard's engine is not touched. A caller's bad batch (``InputError``) is raised as
the eager engine would raise it and turns nothing off.
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

from ..errors import InputError
from . import xp
from .constants import DEFAULT_LAG_EDGES, STATS_ENGINES
from .eager import eager_loss, eager_probe, eager_sequence_stats, sequence_fields, takes_on_host
from .partial import Partial

# Measured against the eager engine (benchmarks/stats.py small_batch_ms): 3.0x faster at 64 tokens, 1.5x at 8K;
# above this the per-element work dominates and the chunked torch engine takes the batch.
HOST_MAX_TOKENS = 1 << 13
COMPILED_CPU_MIN_TOKENS = 1 << 13  # below this a CPU micro-batch is cheaper eager (measured crossover ~8K tokens)


def _short(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


class EagerEngine:
    """``stats_engine: eager``. ``host_max_tokens``: the largest CPU micro-batch computed by numpy (0: none, every
    CPU tensor takes the path a GPU's takes)."""

    name = "eager"

    def __init__(self, host_max_tokens: int = HOST_MAX_TOKENS) -> None:
        self.host_max_tokens = host_max_tokens
        self.host_failure: str | None = None  # why the host path is off for this engine (None: usable)

    def probe(self, b, lag_edges=DEFAULT_LAG_EDGES, chunk_tokens: int | None = None) -> Partial:
        """All token-level sufficient statistics of one micro-batch (device tensors, no host sync)."""
        if chunk_tokens is None and self._host_on() and takes_on_host(b, self.host_max_tokens):
            p = self._on_host(lambda: eager_probe(b, lag_edges, None, ops=xp.NUMPY))
            if p is not None:
                return p
        return eager_probe(b, lag_edges, chunk_tokens)

    def sequences(self, lengths=None, truncated=None, rewards=None) -> Partial:
        """Per-sequence statistics (lengths, truncated share, rewards); no host sync."""
        fields = sequence_fields(lengths, truncated, rewards)
        if not fields:
            return Partial()
        if self._host_on() and all(t.device.type == "cpu" for t in fields.values()):
            p = self._on_host(lambda: eager_sequence_stats(fields, xp.NUMPY))
            if p is not None:
                return p
        return eager_sequence_stats(fields)

    def loss(self, loss: torch.Tensor) -> Partial:
        """Sum of the finite micro-batch losses and the count of non-finite ones."""
        if self._host_on() and loss.device.type == "cpu":
            p = self._on_host(lambda: eager_loss(loss, xp.NUMPY))
            if p is not None:
                return p
        return eager_loss(loss)

    def describe(self, device) -> str:
        """What computes the token statistics on ``device``, in one sentence."""
        if torch.device(device).type == "cpu" and self._host_on():
            return (
                f"eager (plain torch operations; micro-batches of up to {self.host_max_tokens} tokens computed "
                "by numpy)"
            )
        return "eager (plain torch operations)"

    def _host_on(self) -> bool:
        return self.host_max_tokens > 0 and self.host_failure is None

    def _on_host(self, compute) -> Partial | None:
        try:
            return compute()
        except Exception as e:  # noqa: BLE001 - a fault of the host path must cost speed, never the statistics
            self.host_failure = _short(e)
            warnings.warn(
                f"rl_guard: the host path for small CPU micro-batches failed ({self.host_failure}); "
                "computing them with torch (same statistics, slower)",
                RuntimeWarning,
                stacklevel=3,
            )
            return None


class CompiledEngine(EagerEngine):
    """``stats_engine: compiled``: the eager engine's paths, but each chunk's ``families.chunk_stats`` compiled;
    CPU micro-batches under ``cpu_min_tokens`` tokens and everything after a compiler failure stay eager."""

    name = "compiled"

    def __init__(self, host_max_tokens: int = HOST_MAX_TOKENS, cpu_min_tokens: int = COMPILED_CPU_MIN_TOKENS) -> None:
        super().__init__(host_max_tokens)
        self.cpu_min_tokens = cpu_min_tokens
        self.failure: str | None = None  # why the compiled path is off for this engine (None: usable)

    def takes(self, b) -> bool:
        """Whether a compiled call computes micro-batch ``b``: not after a failure, and on CPU only from
        ``cpu_min_tokens`` tokens on (on a GPU every batch: there each eager operation is a kernel launch)."""
        n = b.logprobs.numel()
        return self.failure is None and n > 0 and (b.device.type != "cpu" or n >= self.cpu_min_tokens)

    def probe(self, b, lag_edges=DEFAULT_LAG_EDGES, chunk_tokens: int | None = None) -> Partial:
        if chunk_tokens is None and self._host_on() and takes_on_host(b, self.host_max_tokens):
            return super().probe(b, lag_edges, chunk_tokens)
        if self.takes(b):
            try:
                return eager_probe(b, lag_edges, chunk_tokens, compiled=True)
            except InputError:  # the caller's batch is wrong, not the compiler: raised as the eager engine would
                raise
            except Exception as e:  # noqa: BLE001 - a compiler problem must cost speed, never the statistics
                self.failure = _short(e)
                warnings.warn(
                    f"rl_guard: stats_engine 'compiled' is unavailable here ({self.failure}); using the "
                    "eager engine (same statistics, slower)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return super().probe(b, lag_edges, chunk_tokens)

    def describe(self, device) -> str:
        dev = torch.device(device)
        where = (
            "Triton kernels"
            if dev.type == "cuda"
            else f"C++ loops, CPU micro-batches from {self.cpu_min_tokens} tokens"
        )
        off = f"; off after a failure: {self.failure}" if self.failure else ""
        return f"compiled (torch.compile fuses each chunk's probes: {where}; the first step compiles{off})"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


class AutoEngine:
    """``stats_engine: auto``: per micro-batch device, compiled on CUDA with Triton, eager elsewhere; both engines
    are this guard's own (a compiler failure falls back within it)."""

    name = "auto"

    def __init__(self, host_max_tokens: int = HOST_MAX_TOKENS) -> None:
        self.eager = EagerEngine(host_max_tokens)
        self.compiled = CompiledEngine(host_max_tokens)
        self._triton = triton_available()

    def pick(self, device) -> EagerEngine:
        return self.compiled if torch.device(device).type == "cuda" and self._triton else self.eager

    def probe(self, b, lag_edges=DEFAULT_LAG_EDGES, chunk_tokens: int | None = None) -> Partial:
        return self.pick(b.device).probe(b, lag_edges, chunk_tokens)

    def sequences(self, lengths=None, truncated=None, rewards=None) -> Partial:
        return self.eager.sequences(lengths, truncated, rewards)

    def loss(self, loss: torch.Tensor) -> Partial:
        return self.eager.loss(loss)

    def describe(self, device) -> str:
        dev = torch.device(device)
        if dev.type == "cuda":
            why = (
                "each eager operation is a kernel launch, ~300-500 per micro-batch"
                if self._triton
                else "Triton, which the compiled engine needs on CUDA, is not installed"
            )
        else:
            why = "on CPU a first compile costs 10-30 s and small micro-batches gain nothing from it"
        return f"auto -> {self.pick(dev).describe(dev)} on {dev.type}: {why}"


Engine = EagerEngine | AutoEngine


def make_engine(name: str, host_max_tokens: int = HOST_MAX_TOKENS) -> Engine:
    """The engine ``stats_engine: name`` selects (one per guard: it keeps its own failure state)."""
    if name == "auto":
        return AutoEngine(host_max_tokens)
    if name == "compiled":
        return CompiledEngine(host_max_tokens)
    if name == "eager":
        return EagerEngine(host_max_tokens)
    raise ValueError(f"unknown stats_engine {name!r}; allowed: {', '.join(STATS_ENGINES)}")
