"""The tests' ways into the statistics engine: a micro-batch or per-sequence fields through a named engine, a
``Partial`` read back by name, and a step accumulator's packed vectors."""

from __future__ import annotations

from rl_guard.stats import accumulate
from rl_guard.stats.constants import DEFAULT_LAG_EDGES
from rl_guard.stats.engines import Engine


def probe_batch(b, lag_edges=DEFAULT_LAG_EDGES, chunk_tokens=None, engine="eager"):
    """``Engine.probe`` of micro-batch ``b``; ``engine``: an engine object or a ``stats_engine`` name (a fresh one)."""
    return (Engine(engine) if isinstance(engine, str) else engine).probe(b, lag_edges, chunk_tokens)


def sequence_stats(lengths=None, truncated=None, rewards=None, engine="eager"):
    """``Engine.sequences`` of the given per-sequence tensors."""
    return (Engine(engine) if isinstance(engine, str) else engine).sequences(lengths, truncated, rewards)


def entries(partial) -> tuple[dict, dict]:
    """``(sums, maxima)`` of a ``Partial`` by name, views of its vectors (minima un-negated, under their own names)."""
    out: tuple[dict, dict] = ({}, {})
    for layout, vec, named in zip(partial.layout, (partial.sums, partial.maxes), out):
        for (name, _), part in zip(layout, vec.split([k for _, k in layout])):
            if name.startswith("-"):
                name, part = name[1:], -part
            named[name] = part
    return out


def packed(acc):
    """A ``StepAccumulator``'s segments in their canonical order and its sum and max vectors, still on the device
    (the layout checksum pair left out)."""
    layouts, buf = acc._packed()
    n_sum = accumulate._plan(tuple(layouts))[0]
    return layouts, buf[:n_sum], buf[n_sum:-2]
