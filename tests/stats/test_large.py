"""64M tokens in one micro-batch: no size limit (torch.quantile stops at 2^24), exact counts beyond 2^24.

Data are built so the exact answers are known without sorting 64M values: log-probabilities are multiples of
2^-10, so logp - old is exact in float32 and takes 129 distinct values whose counts give every order statistic.
Runs in ~10-20 s on one CPU core (one intra-op thread) with ~1 GB of inputs (64M fp32 logprobs + old + bool mask).
"""

from __future__ import annotations

import math
import resource

import numpy as np
import pytest
import torch

from rl_guard.stats.accumulate import StepAccumulator
from rl_guard.stats.batch import TokenBatch
from rl_guard.stats.probe_batch import probe_batch
from rl_guard.stats.sketch import LOG_RATIO, QUANTILE_NAMES, QUANTILES
from rl_guard.stats.summarize import summarize

ROWS, COLS = 64, 1 << 20


@pytest.fixture(scope="module")
def one_thread():
    # One intra-op thread: on a shared 2-core machine, spinning worker threads cost far more than they give.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def big(one_thread):
    g = torch.Generator().manual_seed(0)
    k = torch.randint(-64, 65, (ROWS, COLS), generator=g, dtype=torch.int32)  # log-ratio in units of 2^-10
    lp = torch.randint(-4096, 0, (ROWS, COLS), generator=g, dtype=torch.int32).float().mul_(1 / 1024)
    old = lp - k.float().mul_(1 / 1024)
    mask = torch.randint(0, 10, (ROWS, COLS), generator=g, dtype=torch.uint8) > 0  # ~90% of tokens
    counts = torch.bincount(k.add_(64).masked_fill_(~mask, 129).view(-1), minlength=130)[:129].numpy()
    per_row = mask.sum(1).numpy()
    del k
    return lp, old, mask, counts, per_row


def test_64m_tokens_in_one_micro_batch(big):
    lp, old, mask, counts, per_row = big
    acc = StepAccumulator()
    acc.add(probe_batch(TokenBatch(lp, mask, old_logprobs=old)))
    m, hists = summarize(acc.finish())
    n = int(counts.sum())
    assert n > 1 << 25  # well past float32's exact-integer range and torch.quantile's 2^24 limit
    assert m["rl_guard/tokens/count"] == n and m["rl_guard/kl_old/k1_mean"] == pytest.approx(
        -(np.arange(-64, 65) / 1024 * counts).sum() / n, rel=1e-5, abs=1e-9)
    values = np.arange(-64, 65) / 1024.0
    assert m["rl_guard/ratio/mean"] == pytest.approx((np.exp(values) * counts).sum() / n, rel=1e-6)
    assert m["rl_guard/ratio/min"] == math.exp(-64 / 1024) and m["rl_guard/ratio/max"] == math.exp(64 / 1024)
    cum = np.cumsum(counts)
    for qn, q in zip(QUANTILE_NAMES, QUANTILES):
        exact = values[np.searchsorted(cum, math.ceil(round(q * 100) * n / 100))]
        bound = math.expm1(LOG_RATIO.width * 0.502) * (abs(exact) + LOG_RATIO.scale)
        assert abs(math.log(m[f"rl_guard/ratio/{qn}"]) - exact) <= bound, qn
    assert hists["rl_guard/log_ratio"][1].sum() == n
    assert m["rl_guard/length/mean"] == pytest.approx(per_row.mean(), rel=1e-12)
    assert m["rl_guard/length/max"] == per_row.max()
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB, whole test process
    assert peak_gib < 6, peak_gib
