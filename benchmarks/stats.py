"""Cost of rl_guard's per-step statistics on CPU, against a floor and against the usual way of computing them.

For each size (tokens in one padded ``[64, T]`` micro-batch with logprobs, old/ref logprobs, entropy, per-token
advantages and versions, and a mask keeping ~75% of the tokens) it times, interleaved in the same run:

* ``full``:  ``Engine.probe`` + ``StepAccumulator.finish`` (the one host transfer) + ``summarize``, once per stats
  engine (``--engine``, default ``compiled,eager``: ``torch.compile``-fused probes, then plain operations; the
  first one's figures are also the JSON's top-level ``<figure>_<size>`` keys, every engine's are
  ``<figure>_<size>_<engine>``; the compiled engine compiles during the warm-up run);
* ``floor``: one pass over the same inputs, a masked sum per tensor (``torch.where(mask, x, 0).sum()`` in
  row blocks of 256K tokens, like the probes' chunks);
* ``naive``: what trainers do today: ``x[mask]`` selections, ``torch.quantile`` per quantile family (ratio,
  sequence ratio, entropy, p50/p99 per lag bucket) and one ``.item()`` per statistic. ``torch.quantile`` refuses
  inputs above 2^24 elements; that is reported as ``fails``.

All three paths are timed the same way: each is run once to warm up, then ``--repeats`` rounds each run every path
once in turn (so drifts in the machine's load hit all of them alike); the figures are the best run of each (the
JSON also has the medians). With one intra-op thread (the default) the clock is process CPU time: on a shared
machine wall time mostly measures the neighbours. With several threads (``--threads 1,2`` runs each in turn) it is
wall time, since CPU time adds up over the threads. Peak extra memory: the largest total size of live tensors
allocated during one full step, replayed from ``torch.profiler`` memory events (every allocation and free of the
CPU allocator, in time order; transient buffers inside one operator are not seen), in units of one fp32 per-token
tensor (4 bytes/token). Host transfers: ``.cpu()`` calls during a 4-micro-batch step (any other host read is
reported separately). ``--device cuda`` runs the GPU path instead (``stats_cuda.py``: CUDA-event timing and the
synchronisations of a whole guard step).

Small micro-batches (``small_batch_ms``: 64, 1K and 8K tokens in TRL's form, per-sequence advantages and no
versions): the probe alone, by the host path (the same functions on numpy, the default for such CPU batches) and
by the eager engine's torch path, 100 calls per timed run. ``torch_ops_per_microbatch`` (with the compiled engine):
the torch operations a micro-batch dispatches outside compiled code (``stats_ops.py``: on a GPU, its launches).

Usage: ``python benchmarks/stats.py [--quick] [--sizes 1M,4M,16M] [--repeats N] [--threads 1,2] [--json [FILE]]
[--device cuda]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from json_output import add_json_argument, emit_json  # noqa: E402
from stats_common import (  # noqa: E402
    CURRENT_VERSION,
    SIZES,
    floor_pass,
    full_step,
    make_inputs,
    naive_step,
    time_interleaved,
)

from rl_guard.stats.accumulate import StepAccumulator  # noqa: E402
from rl_guard.stats.batch import TokenBatch  # noqa: E402
from rl_guard.stats.constants import STATS_ENGINES  # noqa: E402
from rl_guard.stats.engines import Engine  # noqa: E402
from rl_guard.stats.summarize import summarize  # noqa: E402

QUICK_SIZES = ("1M", "4M")
DEFAULT_SIZES = ("1M", "4M", "16M")


SMALL = {"64": (8, 8), "1K": (16, 64), "8K": (64, 128)}  # (rows, columns) of a small padded micro-batch


def small_batches(repeats: int, calls: int = 100) -> dict:
    """ms per probe of small TRL-shaped micro-batches: the eager engine with and without its host path."""
    engines = {True: Engine("eager"), False: Engine("eager", host_max_tokens=0)}

    def probe(b, host: bool):
        engine = engines[host]
        for _ in range(calls):
            engine.probe(b)

    out = {}
    for label, (rows, cols) in SMALL.items():
        d = make_inputs(rows * cols, rows=rows)
        d.pop("versions")
        d["advantages"] = d["advantages"][:, 0].contiguous()
        b = TokenBatch(**d, lengths=d["mask"].sum(1), truncated=d["mask"][:, -1])
        fns = {"host": functools.partial(probe, b, True), "eager": functools.partial(probe, b, False)}
        t = time_interleaved(fns, repeats)["times"]
        ms = {name: 1e3 * min(t[name]["cpu"]) / calls for name in t}
        out[label] = {**ms, "eager_over_host": ms["eager"] / ms["host"]}
    return out


@contextmanager
def count_host_reads():
    """Counts ``.cpu()`` transfers and every other way a tensor value reaches the host (``.item()``,
    ``.tolist()``, ``.numpy()`` of a tensor that was not just transferred, ``bool/float/int(tensor)``, ``.to(cpu)``
    from another device). On CPU nothing is really transferred, but the same calls would sync a GPU."""
    counts = {"transfers": 0, "other": 0}
    transferred: set = set()
    orig = {
        n: getattr(torch.Tensor, n)
        for n in ("cpu", "item", "tolist", "numpy", "__bool__", "__float__", "__int__", "to")
    }

    def cpu(self, *a, **k):
        counts["transfers"] += 1
        out = orig["cpu"](self, *a, **k)
        transferred.add(id(out))
        return out

    def numpy(self, *a, **k):
        if id(self) not in transferred:
            counts["other"] += 1
        return orig["numpy"](self, *a, **k)

    def to(self, *a, **k):
        out = orig["to"](self, *a, **k)
        if self.device.type != "cpu" and out.device.type == "cpu":
            counts["other"] += 1
        return out

    def other(name):
        def wrapped(self, *a, **k):
            counts["other"] += 1
            return orig[name](self, *a, **k)

        return wrapped

    patches = {"cpu": cpu, "numpy": numpy, "to": to}
    patches.update({n: other(n) for n in ("item", "tolist", "__bool__", "__float__", "__int__")})
    try:
        for n, f in patches.items():
            setattr(torch.Tensor, n, f)
        yield counts
    finally:
        for n, f in orig.items():
            setattr(torch.Tensor, n, f)


def transfers_per_step(tokens: int = 1 << 16) -> dict:
    d = make_inputs(tokens, rows=8)
    with count_host_reads() as counts:
        acc = StepAccumulator()
        for r0 in range(0, 8, 2):
            rows = {k: v[r0 : r0 + 2] for k, v in d.items()}
            acc.add(Engine().probe(TokenBatch(**rows, current_version=CURRENT_VERSION)))
        raw = acc.finish()
    summarize(raw)
    return dict(counts)


def peak_live_bytes(fn) -> int:
    """Peak of the live tensor bytes allocated while ``fn`` runs (profiler memory events, replayed in order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = []
    for e in prof.events():  # an operator's allocations are its self memory; frees outside operators are events
        delta = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if delta:
            deltas.append((e.time_range.start, delta))
    live = peak = 0
    for _, delta in sorted(deltas, key=lambda t: t[0]):
        live += delta
        peak = max(peak, live)
    return peak


def _stat(values: list, how) -> float | None:
    return how(values) if values else None


def run(sizes: dict, repeats: int, clock: str = "cpu", memory: bool = True, engines=("compiled", "eager")) -> dict:
    """``clock``: the time the ratios are taken from (``cpu``: process CPU time, right for one thread on a shared
    machine; ``wall``: the only meaningful one with several threads, whose CPU times add up). One row per size
    and engine; the top-level ``<figure>_<size>`` keys are the first engine's, ``<figure>_<size>_<engine>``
    every engine's."""
    rows, result = [], {"engine": engines[0]}
    for label, tokens in sizes.items():
        d = make_inputs(tokens)
        fns = {engine: functools.partial(full_step, d, engine) for engine in engines}
        fns.update(floor=functools.partial(floor_pass, d), naive=functools.partial(naive_step, d))
        timed = time_interleaved(fns, repeats)
        t = timed["times"]
        best = {name: _stat(t[name][clock], min) for name in t}
        median = {name: _stat(t[name][clock], statistics.median) for name in t}
        if "naive" in timed["errors"]:
            result[f"naive_error_{label}"] = timed["errors"]["naive"]
        for engine in engines:
            full, full_median = best[engine], median[engine]
            row = dict(
                size=label,
                engine=engine,
                tokens=tokens,
                clock=clock,
                full_s=full,
                floor_s=best["floor"],
                naive_s=best["naive"],
                full_median_s=full_median,
                naive_median_s=median["naive"],
                speedup_vs_naive=best["naive"] / full if best["naive"] else None,
                speedup_vs_naive_median=median["naive"] / full_median if median["naive"] else None,
                floor_ratio=full / best["floor"],
                floor_median_s=median["floor"],
                floor_ratio_median=full_median / median["floor"],
                full_ns_per_token=full / tokens * 1e9,
                full_wall_s=_stat(t[engine]["wall"], min),
                naive_wall_s=_stat(t["naive"]["wall"], min),
            )
            if memory:
                row["peak_extra_mem_ratio"] = peak_live_bytes(fns[engine]) / (4 * tokens)
            rows.append(row)
            for key in (
                "speedup_vs_naive",
                "speedup_vs_naive_median",
                "floor_ratio",
                "floor_ratio_median",
                "peak_extra_mem_ratio",
                "full_s",
                "naive_s",
                "floor_s",
            ):
                if key in row:
                    result[f"{key}_{label}_{engine}"] = row[key]
                    if engine == engines[0]:
                        result[f"{key}_{label}"] = row[key]
        result["max_tokens_ok"] = tokens
        del d, fns  # the partials hold the inputs too
    result["rows"] = rows
    counts = transfers_per_step()
    result["transfers_per_step"], result["other_host_reads_per_step"] = counts["transfers"], counts["other"]
    result["torch_threads"] = torch.get_num_threads()
    result["repeats"], result["clock"] = repeats, clock
    result["load_average"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    return result


def print_table(result: dict) -> None:
    def f(v, fmt):
        return "fails" if v is None else format(v, fmt)

    load = result.get("load_average")
    print(
        f"{result['torch_threads']} intra-op thread(s), {result['clock']} time, best of {result['repeats']} "
        f"interleaved runs after one warm-up each" + (f"; load average {load[0]:.1f}" if load else "")
    )
    print(
        f"{'tokens':>7} {'engine':>9} {'full ms':>9} {'ns/token':>9} {'floor ms':>9} {'naive ms':>10} "
        f"{'speedup_vs_naive':>17} {'(median)':>9} {'floor_ratio':>12} {'peak_mem_x_fp32':>16}"
    )
    for r in result["rows"]:
        naive = f(r["naive_s"] and r["naive_s"] * 1e3, ".1f")
        mem = format(r["peak_extra_mem_ratio"], ".2f") if "peak_extra_mem_ratio" in r else "-"
        print(
            f"{r['size']:>7} {r['engine']:>9} {r['full_s'] * 1e3:>9.1f} {r['full_ns_per_token']:>9.1f} "
            f"{r['floor_s'] * 1e3:>9.1f} {naive:>10} {f(r['speedup_vs_naive'], '.1f'):>17} "
            f"{f(r['speedup_vs_naive_median'], '.1f'):>9} {r['floor_ratio']:>12.2f} {mem:>16}"
        )
    print(
        f"host transfers per step: {result['transfers_per_step']} (other host reads: "
        f"{result['other_host_reads_per_step']})"
    )


def main(argv=None, sizes: dict | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M and 4M tokens only, fewer repeats (about a minute)")
    ap.add_argument("--sizes", help=f"comma-separated sizes out of {', '.join(SIZES)} (default 1M,4M,16M)")
    add_json_argument(ap)
    ap.add_argument(
        "--threads",
        default="1",
        help="torch intra-op threads; a list (1,2) runs each in turn and "
        "reports the first at the top level (default 1)",
    )
    ap.add_argument("--repeats", type=int, help="timed runs of each path (default 5, quick 3)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU path (benchmarks/stats_cuda.py)")
    ap.add_argument(
        "--engine",
        default="compiled,eager",
        help="stats engines to time, the first one's figures also at "
        "the top level of the JSON (default compiled,eager; compiled needs a C++ compiler on CPU)",
    )
    args = ap.parse_args(argv)
    engines = tuple(args.engine.split(","))
    unknown = [e for e in engines if e not in STATS_ENGINES]
    if unknown:
        ap.error(f"unknown engine {unknown[0]!r}; allowed: {', '.join(STATS_ENGINES)}")
    if args.device != "cpu":
        from stats_cuda import main as cuda_main  # benchmarks/ is on sys.path (top of this file)

        return cuda_main(args)
    if sizes is None:
        names = args.sizes.split(",") if args.sizes else (QUICK_SIZES if args.quick else DEFAULT_SIZES)
        sizes = {k: SIZES[k] for k in names}
    repeats = args.repeats or (3 if args.quick else 5)
    thread_counts = [int(n) for n in str(args.threads).split(",")]
    threads = torch.get_num_threads()
    results = {}
    try:
        for n in thread_counts:
            torch.set_num_threads(n)
            results[n] = run(
                sizes, repeats, clock="cpu" if n == 1 else "wall", memory=n == thread_counts[0], engines=engines
            )
            print_table(results[n])
    finally:
        torch.set_num_threads(threads)
    result = dict(results[thread_counts[0]])
    result["small_batch_ms"] = small_batches(repeats)
    for label, row in result["small_batch_ms"].items():
        print(
            f"{label:>4} tokens, probe only: host path {row['host']:.3f} ms, eager {row['eager']:.3f} ms "
            f"({row['eager_over_host']:.1f}x)"
        )
    if "compiled" in engines:
        from stats_ops import ops_per_microbatch  # benchmarks/ is on sys.path (top of this file)

        result["torch_ops_per_microbatch"] = ops_per_microbatch()
        for setup, row in result["torch_ops_per_microbatch"].items():
            print(f"{setup}: torch operations outside compiled code per micro-batch: {row}")
    if len(thread_counts) > 1:
        result["by_threads"] = {str(n): r for n, r in results.items()}
    emit_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
