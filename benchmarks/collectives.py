"""Cost of the guard's two per-step all-reduces on gloo, next to the rest of the guard's step.

Each of ``--world`` processes (default 2, one CPU thread each) feeds the guard a GRPO-like micro-batch per step
(``--batch`` x ``--seq`` tokens with old/ref log-probs, entropy, advantages, rewards, truncation flags) and the
gradients of a small MLP, then times, per step:
- ``merge``: the guard's merge (``StepReducer``: MAX of header + maxima, header check, SUM of the packed sums)
  on a real step's packed vectors, the ranks lined up by a barrier (not timed) before every call;
- ``bare``: the same two all-reduces on ready tensors of the same sizes (no padding, no checks);
- ``in_situ``: the merge timed inside ``guard.check()``; it also holds the time a rank waits for a slower one;
- ``rest``: everything else the guard does in the step (probes, packing, host transfer, summary, rules).
The ratio printed is ``merge / rest``.

Run:  python benchmarks/collectives.py [--world 2] [--steps 30] [--batch 16 --seq 512] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rl_guard import Guard, TokenBatch
from rl_guard.stats import ranks as rg_dist

CONFIG = "version: 1\nsinks: []\n"


def _batch(g: torch.Generator, B: int, T: int) -> TokenBatch:
    logp = -3.0 * torch.rand(B, T, generator=g)
    return TokenBatch(
        logp,
        torch.rand(B, T, generator=g) < 0.9,
        old_logprobs=logp + 0.02 * torch.randn(B, T, generator=g),
        ref_logprobs=logp + 0.05 * torch.randn(B, T, generator=g),
        entropy=2.0 * torch.rand(B, T, generator=g),
        advantages=torch.randn(B, generator=g),
        rewards=torch.rand(B, generator=g),
        truncated=torch.rand(B, generator=g) < 0.2,
    )


def _worker(rank: int, args, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=args.world)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters())
    guard = Guard.from_yaml(CONFIG, run_dir=tempfile.mkdtemp()).attach(model, opt)
    timed = {"collectives": [], "sizes": None}
    original = rg_dist.StepReducer.__call__

    def timed_call(self, sums, maxes):
        timed["sizes"] = (sums.numel(), rg_dist.HEADER + rg_dist.MAX_SLOTS)
        timed["packed"] = (sums.clone(), maxes.clone())
        t0 = time.perf_counter()
        original(self, sums, maxes)
        timed["collectives"].append(time.perf_counter() - t0)

    rg_dist.StepReducer.__call__ = timed_call
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 256, generator=g)
    step_times = []
    for _ in range(args.steps + 3):
        batch = _batch(g, args.batch, args.seq)
        model(x).square().mean().backward()
        dist.barrier()
        t0 = time.perf_counter()
        guard.observe(batch, loss=torch.tensor(0.5))
        guard.check()
        guard.step_done()
        step_times.append(time.perf_counter() - t0)
        opt.zero_grad()
    rg_dist.StepReducer.__call__ = original
    merge = []
    for _ in range(args.steps + 3):
        sums, maxes = (t.clone() for t in timed["packed"])
        dist.barrier()
        t0 = time.perf_counter()
        rg_dist.reducer()(sums, maxes)
        merge.append(time.perf_counter() - t0)
    n_sums, n_max = timed["sizes"]
    sums, maxes = torch.rand(n_sums, dtype=torch.float64), torch.rand(n_max, dtype=torch.float64)
    bare = []
    for _ in range(args.steps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        rg_dist.all_reduce(dist, maxes, largest=True)
        rg_dist.all_reduce(dist, sums, largest=False)
        bare.append(time.perf_counter() - t0)
    skip = 3  # warm-up steps
    coll, steps, bare, merge = timed["collectives"][skip:], step_times[skip:], bare[skip:], merge[skip:]
    rest = [s - c for s, c in zip(steps, coll)]
    result = {
        "rank": rank,
        "world": args.world,
        "tokens_per_rank": args.batch * args.seq,
        "steps": args.steps,
        "max_numel": n_max,
        "sum_numel": n_sums,
        "max_bytes": n_max * 8,
        "sum_bytes": n_sums * 8,
        "merge_ms": 1e3 * statistics.median(merge),
        "bare_allreduce_ms": 1e3 * statistics.median(bare),
        "in_situ_ms": 1e3 * statistics.median(coll),
        "rest_ms": 1e3 * statistics.median(rest),
        "step_ms": 1e3 * statistics.median(steps),
    }
    result["ratio"] = result["merge_ms"] / result["rest_ms"]
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--json", default=None, help="write the results (every rank) to this file")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, f"file://{tmp}/pg", tmp), nprocs=args.world, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world)]
    r0 = ranks[0]
    print(
        f"{args.world} gloo processes, {r0['tokens_per_rank']} tokens per rank per step, median of {args.steps} steps"
    )
    print(
        f"payload per step: MAX {r0['max_numel']} float64 = {r0['max_bytes']} B, "
        f"SUM {r0['sum_numel']} float64 = {r0['sum_bytes']} B"
    )
    for r in ranks:
        print(
            f"rank {r['rank']}: merge {r['merge_ms']:.3f} ms (bare all-reduces {r['bare_allreduce_ms']:.3f} ms, "
            f"in situ {r['in_situ_ms']:.3f} ms), rest of the guard step {r['rest_ms']:.3f} ms, "
            f"ratio merge/rest {r['ratio']:.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": ranks, "ratio_max": max(r["ratio"] for r in ranks)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
