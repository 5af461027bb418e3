"""What the CPU and the GPU statistics benchmarks (``stats.py``, ``stats_cuda.py``) share: the inputs, the three
timed paths (``full``, ``floor``, ``naive``) and the interleaved timing loop. Both import it, and ``stats_cuda.py``
does not import ``stats.py`` (which hands ``--device cuda`` to it): the two do not import each other."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rl_guard.stats.accumulate import StepAccumulator  # noqa: E402
from rl_guard.stats.batch import TokenBatch  # noqa: E402
from rl_guard.stats.constants import DEFAULT_LAG_EDGES  # noqa: E402
from rl_guard.stats.engines import Engine  # noqa: E402
from rl_guard.stats.sketch import QUANTILE_NAMES, QUANTILES  # noqa: E402
from rl_guard.stats.summarize import summarize  # noqa: E402

ROWS = 64
CURRENT_VERSION = 8
SIZES = {"1M": 1 << 20, "4M": 1 << 22, "16M": 1 << 24, "64M": 1 << 26}


def make_inputs(tokens: int, rows: int = ROWS, seed: int = 0, device: str = "cpu") -> dict:
    if device != "cpu":
        return {k: v.to(device) for k, v in make_inputs(tokens, rows, seed).items()}
    g = torch.Generator().manual_seed(seed)
    cols = max(1, tokens // rows)
    shape = (rows, cols)
    lp = -torch.rand(shape, generator=g) * 2
    lengths = torch.randint(cols // 2, cols + 1, (rows,), generator=g)
    return dict(
        logprobs=lp,
        mask=torch.arange(cols)[None, :] < lengths[:, None],
        old_logprobs=lp + 0.05 * torch.randn(shape, generator=g),
        ref_logprobs=lp + 0.1 * torch.randn(shape, generator=g),
        entropy=torch.rand(shape, generator=g) * 3,
        advantages=torch.randn(shape, generator=g),
        versions=torch.randint(0, CURRENT_VERSION + 1, shape, generator=g).float(),
    )


def full_step(d: dict, engine: str = "eager", chunk: int | None = None) -> dict:
    """The measured path: the probes (``stats_engine``; ``chunk``: tokens per chunk, default the engine's own), the
    one transfer, the host formulas."""
    acc = StepAccumulator()
    acc.add(Engine(engine).probe(TokenBatch(**d, current_version=CURRENT_VERSION), chunk_tokens=chunk))
    return summarize(acc.finish())[0]


def floor_pass(d: dict, chunk: int = 1 << 18) -> float:
    """One pass over every input: a masked sum per tensor, in row blocks of ~``chunk`` tokens (so it pays no
    page faults for full-size temporaries: a floor, not a strawman)."""
    mask = d["mask"]
    rows = max(1, chunk // mask.shape[1])
    total = mask.sum()
    for r0 in range(0, mask.shape[0], rows):
        m = mask[r0 : r0 + rows]
        for name, x in d.items():
            if name != "mask":
                total = total + torch.where(m, x[r0 : r0 + rows], 0.0).sum()
    return float(total)


def naive_step(d: dict, eps_low: float = 0.2, eps_high: float = 0.2, edges=DEFAULT_LAG_EDGES) -> dict:
    """The usual trainer code: boolean selection, torch.quantile, one .item() per statistic."""
    out: dict = {}
    m = d["mask"]
    qs = torch.tensor(QUANTILES, device=m.device)

    def family(name, x, quantiles=True):
        out[f"{name}/mean"] = x.mean().item()
        out[f"{name}/min"] = x.min().item()
        out[f"{name}/max"] = x.max().item()
        if quantiles:
            values = torch.quantile(x, qs)
            for i, qn in enumerate(QUANTILE_NAMES):
                out[f"{name}/{qn}"] = values[i].item()

    for name in ("logprobs", "old_logprobs", "ref_logprobs", "entropy", "advantages"):
        out[f"input/{name}/nonfinite"] = (~torch.isfinite(d[name][m])).sum().item()
    lp, old, ref = d["logprobs"][m], d["old_logprobs"][m], d["ref_logprobs"][m]
    ent, adv, ver = d["entropy"][m], d["advantages"][m], d["versions"][m]
    log_r = lp - old
    r = torch.exp(log_r)
    family("ratio", r)
    n_seq = m.sum(1)
    seq_lr = torch.where(m, d["logprobs"] - d["old_logprobs"], 0.0).sum(1) / n_seq.clamp(min=1)
    family("seq_ratio", torch.exp(seq_lr[n_seq > 0]))
    for name, lr_tok, lr_full in (
        ("kl_old", log_r, d["logprobs"] - d["old_logprobs"]),
        ("kl_ref", ref - lp, d["ref_logprobs"] - d["logprobs"]),
    ):
        for k, f in (("k1", lambda x: -x), ("k2", lambda x: 0.5 * x * x), ("k3", lambda x: torch.expm1(x) - x)):
            out[f"{name}/{k}_mean"] = f(lr_tok).mean().item()
            per_seq = torch.where(m, f(lr_full), 0.0).sum(1)[n_seq > 0]
            out[f"{name}/{k}_seq_mean"] = per_seq.mean().item()
            out[f"{name}/{k}_seq_max"] = per_seq.max().item()
    family("entropy", ent)
    low = (r < 1 - eps_low) & (adv < 0)
    high = (r > 1 + eps_high) & (adv > 0)
    out["clip/low_frac"] = low.float().mean().item()
    out["clip/high_frac"] = high.float().mean().item()
    out["clip/region_frac"] = (low | high).float().mean().item()
    family("adv", adv, quantiles=False)
    out["adv/std"] = adv.std().item()
    out["adv/zero_frac"] = (adv == 0).float().mean().item()
    lengths = n_seq.float()
    out["length/mean"], out["length/max"] = lengths.mean().item(), lengths.max().item()
    lag = CURRENT_VERSION - ver
    out["lag/mean"], out["lag/max"] = lag.mean().item(), lag.max().item()
    k3 = torch.expm1(log_r) - log_r
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else math.inf
        sel = (lag >= lo) & (lag < hi)
        out[f"lag/{lo}/token_frac"] = sel.float().mean().item()
        rb = r[sel]
        if rb.numel():
            p50, p99 = torch.quantile(rb, torch.tensor([0.5, 0.99], device=m.device)).tolist()
            out[f"lag/{lo}/ratio_p50"], out[f"lag/{lo}/ratio_p99"] = p50, p99
            out[f"lag/{lo}/clip_frac"] = (low | high)[sel].float().mean().item()
            out[f"lag/{lo}/k3_mean"] = k3[sel].mean().item()
    return out


def _cpu_and_wall(fn) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


def time_interleaved(fns: dict, repeats: int, measure=_cpu_and_wall, clocks=("cpu", "wall")) -> dict:
    """The times (``measure(fn)``: one value per clock) of every function, each warmed up once and then run
    ``repeats`` times in turn (one round runs each function once, so drifts in the machine's load hit all of them
    alike). A function that raises (``torch.quantile`` above 2^24 elements) is dropped and its first error line
    kept."""
    times = {name: {clock: [] for clock in clocks} for name in fns}
    errors: dict = {}
    for r in range(repeats + 1):
        for name, fn in fns.items():
            if name in errors:
                continue
            try:
                values = measure(fn)
            except RuntimeError as exc:  # torch.quantile: "quantile() input tensor is too large"
                errors[name] = str(exc).splitlines()[0]
                continue
            if r:  # round 0 is the warm-up
                for clock, value in zip(clocks, values):
                    times[name][clock].append(value)
    return {"times": times, "errors": errors}
