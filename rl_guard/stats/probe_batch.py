"""The statistics of one micro-batch (``probe_batch``) and of per-sequence fields (``sequence_stats``), by the
engine given: an engine object of ``engines.py`` (it keeps its own failure state: a guard's) or a ``stats_engine``
name, for which a fresh engine is made."""

from __future__ import annotations

from .batch import TokenBatch
from .constants import DEFAULT_LAG_EDGES
from .engines import Engine
from .partial import Partial


def probe_batch(b: TokenBatch, lag_edges=DEFAULT_LAG_EDGES, chunk_tokens: int | None = None, engine="eager") -> Partial:
    """All token-level sufficient statistics of one micro-batch (device tensors, no host sync). ``engine``: an
    engine object (``engines.py``: it keeps its failure state) or a ``stats_engine`` name, for which a fresh engine
    is made."""
    return (Engine(engine) if isinstance(engine, str) else engine).probe(b, lag_edges, chunk_tokens)


def sequence_stats(lengths=None, truncated=None, rewards=None, engine="eager") -> Partial:
    """Per-sequence statistics: lengths, truncated (no-EOS) share, scalar rewards (finite values only); no host
    sync. ``engine`` as for ``probe_batch``."""
    return (Engine(engine) if isinstance(engine, str) else engine).sequences(lengths, truncated, rewards)
