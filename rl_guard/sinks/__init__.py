"""Metric and incident sinks (jsonl, tensorboard, wandb, console) behind one fault-isolating `SinkSet`.

Typical use::

    sinks = build_sinks(["jsonl", {"tensorboard": {}}, {"console": {"every": 5}}], run_dir,
                        is_main_process=rank == 0)
    sinks.start(resume_step=None)
    sinks.log({"rl_guard/ratio/p50": 1.0}, step=1, histograms={"rl_guard/ratio": (edges, counts)})
    sinks.incident(record)
    sinks.finish()
"""

from __future__ import annotations

import inspect
import pathlib
from collections.abc import Iterable
from typing import Any

from .base import Histograms, Sink, SinkOptionError, SinkSet
from .console import ConsoleSink
from .jsonl import INCIDENTS_FILE, METRICS_FILE, JsonlSink, read_jsonl
from .tensorboard import TensorBoardSink
from .wandb import WandbSink

_REGISTRY: dict[str, type[Sink]] = {
    "jsonl": JsonlSink,
    "tensorboard": TensorBoardSink,
    "wandb": WandbSink,
    "console": ConsoleSink,
}
SINK_NAMES: tuple[str, ...] = tuple(_REGISTRY)

SinkSpec = str | dict | Sink


def make_sink(name: str, options: dict | None = None) -> Sink:
    """Instantiate a sink by registry name; unknown names/options raise ValueError."""
    cls = _REGISTRY.get(str(name).strip().lower())
    if cls is None:
        raise ValueError(f"unknown sink {name!r}; allowed: {', '.join(SINK_NAMES)}")
    try:
        return cls(**(options or {}))
    except TypeError as err:  # bad option names -> a config error, not a crash deep inside
        raise ValueError(f"bad options for sink {name!r}: {err}") from err


def sink_options_error(name: str, options: dict) -> list[tuple[str | None, str]]:
    """``(option, message)`` for every problem of ``options`` for sink ``name`` (empty when they are valid):
    unknown option names (with the allowed ones) and values the sink's constructor refuses."""
    cls = _REGISTRY[name]
    allowed = [k for k in inspect.signature(cls.__init__).parameters if k != "self"]
    unknown = [
        (k, f"unknown option {k!r} for sink {name!r}; allowed: {', '.join(allowed)}")
        for k in options
        if k not in allowed
    ]
    if unknown:
        return unknown
    try:
        cls(**options)
    except SinkOptionError as err:
        return [(err.option, str(err))]
    except (TypeError, ValueError) as err:
        return [(None, f"bad options for sink {name!r}: {err}")]
    return []


def _entries(spec: Any) -> Iterable[Sink]:
    if spec is None:
        return
    if isinstance(spec, (str, Sink, dict)):
        spec = [spec]
    for item in spec:
        if isinstance(item, Sink):
            yield item
        elif isinstance(item, str):  # "jsonl" or "jsonl,console"
            for name in filter(None, (p.strip() for p in item.split(","))):
                yield make_sink(name)
        elif isinstance(item, dict) and len(item) == 1:
            ((name, options),) = item.items()
            if options is not None and not isinstance(options, dict):
                raise ValueError(f"options for sink {name!r} must be a dict, got {options!r}")
            yield make_sink(name, options)
        else:
            raise ValueError(
                f"bad sink spec {item!r}: use a name, a one-key dict {{name: options}} or a Sink; "
                f"allowed names: {', '.join(SINK_NAMES)}"
            )


def build_sinks(
    spec: SinkSpec | Iterable[SinkSpec] | None,
    run_dir: str | pathlib.Path | None = None,
    *,
    is_main_process: bool = True,
    ensure_jsonl: bool = True,
) -> SinkSet:
    """Build a `SinkSet` from names, `{name: options}` dicts and/or Sink instances.

    The jsonl sink is added first when missing (`ensure_jsonl`), because `metrics.jsonl` and
    `incidents.jsonl` are part of the run-directory contract. Call `.start()` on the result.
    """
    sinks = list(_entries(spec))
    if ensure_jsonl and not any(isinstance(s, JsonlSink) for s in sinks):
        sinks.insert(0, JsonlSink())
    return SinkSet(sinks, is_main_process=is_main_process, run_dir=run_dir)


__all__ = [
    "SINK_NAMES",
    "Histograms",
    "Sink",
    "SinkOptionError",
    "SinkSet",
    "build_sinks",
    "make_sink",
    "sink_options_error",
    "JsonlSink",
    "TensorBoardSink",
    "WandbSink",
    "ConsoleSink",
    "read_jsonl",
    "METRICS_FILE",
    "INCIDENTS_FILE",
]
