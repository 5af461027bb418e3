"""64M tokens in one micro-batch: no size limit (torch.quantile stops at 2^24), exact counts beyond 2^24.

Data are built so the exact answers are known without sorting 64M values: log-probabilities are multiples of
2^-10, so logp - old is exact in float32 and takes 129 distinct values whose counts give every order statistic.
The step runs in a fresh process (this file run as a script) so that its peak memory is its own, whatever ran
before in the test process: ~1 GB of inputs (64M fp32 logprobs + old + bool mask), ~10-20 s on one CPU core.
"""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path

import numpy as np
import pytest

ROWS, COLS = 64, 1 << 20
pytestmark = pytest.mark.slow


def _memory_kib() -> dict[str, int]:
    with open("/proc/self/status", encoding="ascii") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}


def _reset_peak() -> bool:
    """Linux: make the peak resident size (VmHWM) restart from the current one; False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child() -> dict:
    """Build the inputs, run one guard step on them, return the metrics, the exact reference and the memory."""
    import torch

    from rl_guard.stats.accumulate import StepAccumulator
    from rl_guard.stats.batch import TokenBatch
    from rl_guard.stats.engines import Engine
    from rl_guard.stats.summarize import summarize

    torch.set_num_threads(1)  # on a shared 2-core machine, spinning worker threads cost far more than they give
    g = torch.Generator().manual_seed(0)
    k = torch.randint(-64, 65, (ROWS, COLS), generator=g, dtype=torch.int32)  # log-ratio in units of 2^-10
    lp = torch.randint(-4096, 0, (ROWS, COLS), generator=g, dtype=torch.int32).float().mul_(1 / 1024)
    old = lp - k.float().mul_(1 / 1024)
    mask = torch.randint(0, 10, (ROWS, COLS), generator=g, dtype=torch.uint8) > 0  # ~90% of tokens
    counts = torch.bincount(k.add_(64).masked_fill_(~mask, 129).view(-1), minlength=130)[:129].numpy()
    per_row = mask.sum(1).numpy()
    del k
    input_bytes = sum(t.numel() * t.element_size() for t in (lp, old, mask))
    before = _memory_kib()
    reset = _reset_peak()
    acc = StepAccumulator()
    acc.add(Engine().probe(TokenBatch(lp, mask, old_logprobs=old)))
    m, hists = summarize(acc.finish())
    after = _memory_kib()
    return {
        "metrics": {
            k: v
            for k, v in m.items()
            if k.startswith(("rl_guard/tokens/", "rl_guard/kl_old/", "rl_guard/ratio/", "rl_guard/length/"))
        },
        "log_ratio_hist_total": int(hists["rl_guard/log_ratio"][1].sum()),
        "counts": counts.tolist(),
        "per_row_mean": float(per_row.mean()),
        "per_row_max": int(per_row.max()),
        "input_bytes": input_bytes,
        "rss_before_kib": before["VmRSS"],
        "step_peak_kib": after["VmHWM"] if reset else None,
        "process_peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


@pytest.fixture(scope="module")
def big():
    from rank_launch import run_ranks  # here, not at the top: the child runs this file without tests/ on its path

    return run_ranks(Path(__file__), [], 1, extra_env={"OMP_NUM_THREADS": "1"}, timeout=280)[0]


def test_64m_tokens_in_one_micro_batch(big):
    from rl_guard.stats.sketch import LOG_RATIO, QUANTILE_NAMES, QUANTILES

    m, counts = big["metrics"], np.array(big["counts"], dtype=np.int64)
    n = int(counts.sum())
    assert n > 1 << 25  # well past float32's exact-integer range and torch.quantile's 2^24 limit
    assert m["rl_guard/tokens/count"] == n and m["rl_guard/kl_old/k1_mean"] == pytest.approx(
        -(np.arange(-64, 65) / 1024 * counts).sum() / n, rel=1e-5, abs=1e-9
    )
    values = np.arange(-64, 65) / 1024.0
    assert m["rl_guard/ratio/mean"] == pytest.approx((np.exp(values) * counts).sum() / n, rel=1e-6)
    assert m["rl_guard/ratio/min"] == math.exp(-64 / 1024) and m["rl_guard/ratio/max"] == math.exp(64 / 1024)
    cum = np.cumsum(counts)
    for qn, q in zip(QUANTILE_NAMES, QUANTILES):
        exact = values[np.searchsorted(cum, math.ceil(round(q * 100) * n / 100))]
        bound = math.expm1(LOG_RATIO.width * 1.002) * (abs(exact) + LOG_RATIO.scale)
        assert abs(math.log(m[f"rl_guard/ratio/{qn}"]) - exact) <= bound, qn
    assert big["log_ratio_hist_total"] == n
    assert m["rl_guard/length/mean"] == pytest.approx(big["per_row_mean"], rel=1e-12)
    assert m["rl_guard/length/max"] == big["per_row_max"]


def test_64m_tokens_memory(big):
    # The whole fresh process (torch, the 576 MiB of inputs and their construction, the step: 0.8 GiB measured)
    # stays far below what a float64 copy of even one per-token intermediate would add (512 MiB each).
    assert big["process_peak_kib"] / 2**20 < 2, big
    if big["step_peak_kib"] is not None:  # Linux lets the process restart its peak: the step's own extra memory
        # chunked probes: ~20 MiB measured above the inputs, whatever the micro-batch size
        extra = (big["step_peak_kib"] - big["rss_before_kib"]) * 1024
        assert extra < 0.25 * big["input_bytes"], (extra / 2**20, big["input_bytes"] / 2**20)


if __name__ == "__main__":
    print(json.dumps(child()))
