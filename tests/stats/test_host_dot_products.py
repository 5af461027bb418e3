"""The host paths' dot products stay on the calling thread.

numpy's BLAS (OpenBLAS) splits a dot product of more than 10,000 elements over threads of its own. Right after a
multi-threaded torch operation those threads wait for cores that torch's OpenMP workers still hold: one such
``np.dot`` took about 4 ms instead of 10 us, on every call, and the guarded demo ran at twice the unguarded step time
with torch's default threads. The update and gradient probes read CPU weights and gradients with numpy (vectors of
the whole model's small tensors), so they must not hand a large dot product to BLAS.
"""

import numpy as np
import pytest
import torch

from rl_guard import Guard
from rl_guard.stats.cpu_squares import dot

BLAS_THREADED_ABOVE = 10_000  # OpenBLAS runs a dot product on one thread up to this many elements
CONFIG = """builtin_rules: {nonfinite_logprobs: false}
rules:
  - {name: big_update, metric: rl_guard/update/rel, op: ">", threshold: 1.0, action: warn}
"""


@pytest.fixture
def blas_sizes(monkeypatch):
    """The largest operand numpy's BLAS entry points receive (``np.dot``, ``np.matmul``, ``np.inner``,
    ``np.vdot``) while the fixture is active."""
    seen = [0]
    for name in ("dot", "matmul", "inner", "vdot"):
        original = getattr(np, name)

        def recording(*args, _original=original, **kwargs):
            seen[0] = max([seen[0], *(np.size(a) for a in args[:2])])
            return _original(*args, **kwargs)

        monkeypatch.setattr(np, name, recording)
    return seen


def test_a_guard_step_on_cpu_hands_no_large_dot_product_to_blas(tmp_path, blas_sizes):
    torch.manual_seed(0)
    # 12 weights of 4096 elements: every tensor is small enough to be read whole, ~50K elements in all
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard.from_yaml(CONFIG, run_dir=tmp_path / "run").attach(model, opt)
    for _ in range(3):
        loss = model(torch.randn(8, 64)).pow(2).mean()
        guard.observe(loss=loss)
        loss.backward()
        assert guard.check(params=opt).apply_step
        opt.step()
        opt.zero_grad()
        guard.step_done()
    metrics = guard.last_metrics
    guard.close()
    # the probes ran on the host path over the whole model: update size and gradient norm are there and finite
    assert np.isfinite(metrics["rl_guard/update/rel"]) and metrics["rl_guard/update/rel"] > 0
    assert np.isfinite(metrics["rl_guard/grad/norm"]) and metrics["rl_guard/grad/norm"] > 0
    assert blas_sizes[0] <= BLAS_THREADED_ABOVE


@pytest.mark.parametrize("n", [0, 1, 7, 10_001, 100_003])
def test_dot_equals_a_float64_reference(n):
    rng = np.random.default_rng(n)
    x, y = rng.standard_normal(n), rng.standard_normal(n)
    reference = float(np.sum(x.astype(np.longdouble) * y.astype(np.longdouble)))
    assert dot(x, y) == pytest.approx(reference, rel=1e-12, abs=1e-12)
    if n:
        x[n // 2] = np.nan
        assert np.isnan(dot(x, y))
        x[n // 2] = np.inf
        assert dot(x, np.abs(y) + 1) == np.inf
