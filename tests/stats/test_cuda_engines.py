"""The statistics on a CUDA device, where the code takes paths a CPU never does: cell counts by ``index_add_``
(``bincount`` would sync), the gradients' extremes by the fused multi-tensor inf-norm, GPU chunk sizes, and the
compiled engine's GPU kernels. Each against the float64 numpy reference and against the same batch on CPU: counts,
histogram cells and extremes bit for bit, float sums (another summation order) to float32 accuracy. And a whole
guard on CUDA against the same guard on CPU, through a step whose gradient turns NaN.
"""

from __future__ import annotations

import pytest
import torch
from engine_calls import compiled_calls
from reference_stats import (
    FLOAT_SUMS,
    assert_engines_agree,
    check,
    make_padded,
    np_dict,
    packed_from,
    reference,
    with_per_sequence_fields,
)
from stats_probes import probe_batch

from rl_guard import Guard
from rl_guard.glossary import comparable
from rl_guard.stats import eager, families
from rl_guard.stats.accumulate import StepAccumulator
from rl_guard.stats.batch import TokenBatch
from rl_guard.stats.engines import Engine
from rl_guard.stats.summarize import summarize

pytestmark = pytest.mark.gpu

CV = 12
ALL_FIELDS = ("old", "ref", "entropy", "adv", "versions")


def _finished(d: dict, engine: str = "eager", device: str = "cpu", chunk=None, seqs_on_host=False, **kw) -> dict:
    """The CPU side of each comparison runs the eager engine, not the host path small CPU batches go to.
    ``seqs_on_host``: a packed batch's ``cu_seqlens`` stays in host memory, as some trainers keep it."""
    on = {k: v if seqs_on_host and k == "cu_seqlens" else v.to(device) for k, v in d.items()}
    b = TokenBatch(**on, current_version=CV if "versions" in d else None, **kw)
    acc = StepAccumulator()
    before = compiled_calls()
    used = Engine("compiled", host_max_tokens=0) if engine == "compiled" else Engine("eager", host_max_tokens=0)
    acc.add(probe_batch(b, chunk_tokens=chunk, engine=used))
    if engine == "compiled" and device == "cuda":  # it compiled and ran: no fallback hides behind the comparison
        assert getattr(used, "failure", None) is None and getattr(used, "whole_failure", None) is None
        assert compiled_calls() > before
    return acc.finish()


def _cuda_against_cpu_and_reference(
    d: dict, engine: str, chunk=None, padded: dict | None = None, seqs_on_host=False, **kw
) -> None:
    """``padded``: the reference's input when ``d`` is packed (the reference reads padded arrays)."""
    got = _finished(d, engine, "cuda", chunk, seqs_on_host, **kw)
    assert_engines_agree(got, _finished(d, "eager", "cpu", chunk, **kw), FLOAT_SUMS, atol=1e-6)
    level = kw.get("importance_sampling_level", "token")
    check(summarize(got)[0], reference(np_dict(padded or d), cv=CV if "versions" in d else None, level=level))


@pytest.mark.parametrize("engine", ["eager", "compiled"])
@pytest.mark.parametrize("fields", [ALL_FIELDS, ("old", "prox", "adv", "entropy"), ("ref", "entropy")])
def test_cuda_statistics_match_cpu_and_the_float64_reference(engine, fields):
    for seed in range(2):
        _cuda_against_cpu_and_reference(make_padded(seed, fields=fields), engine)


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_cuda_chunks_packed_rows_sequence_level_and_nonfinite_inputs(engine):
    d = make_padded(3, B=6, T=40, fields=ALL_FIELDS)
    _cuda_against_cpu_and_reference(d, engine, chunk=17)  # rows longer than a chunk: one row per chunk
    _cuda_against_cpu_and_reference(packed_from(d), engine, chunk=50, padded=d)
    _cuda_against_cpu_and_reference(with_per_sequence_fields(4), engine)
    g = make_padded(7, B=8, T=30, spread=0.6, fields=ALL_FIELDS)
    _cuda_against_cpu_and_reference(g, engine, importance_sampling_level="sequence")
    bad = make_padded(5, fields=ALL_FIELDS)
    bad["logprobs"][0, 1], bad["old_logprobs"][1, 2] = float("nan"), float("inf")
    bad["entropy"][2, 3], bad["advantages"][3, 0] = float("-inf"), float("nan")
    _cuda_against_cpu_and_reference(bad, engine)


def test_a_packed_micro_batch_with_host_cu_seqlens_compiles_whole_on_cuda():
    """``cu_seqlens`` in host memory is copied to the device before the graph: one compiled micro-batch, not chunk
    by chunk, with the statistics of the same batch on CPU."""
    d = make_padded(3, B=6, T=40, fields=ALL_FIELDS)
    whole, chunked = eager.whole_kernel.cache_info(), families._compiled.cache_info()
    _cuda_against_cpu_and_reference(packed_from(d), "compiled", padded=d, seqs_on_host=True)
    now = eager.whole_kernel.cache_info()
    assert now.hits + now.misses > whole.hits + whole.misses
    assert families._compiled.cache_info() == chunked  # the chunk kernel did not run


def _guarded_run(tmp_path, device: str, engine: str, nan_step: int) -> tuple[list, list, torch.nn.Module]:
    yaml = tmp_path / f"{device}-{engine}.yaml"
    yaml.write_text(
        f"version: 1\nstats_engine: {engine}\nsinks: []\n"
        "rules:\n  - {name: nan_grad, metric: rl_guard/grad/nonfinite, op: '>', threshold: 0,\n"
        "     action: skip_step}\n"
    )
    torch.manual_seed(0)  # the same weights on both devices: built on CPU, then moved
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard.from_yaml(yaml, run_dir=tmp_path / f"run-{device}-{engine}").attach(model, opt)
    guard.use_host_reads(False)  # the CPU side as a GPU's: no host path
    g = torch.Generator().manual_seed(1)
    actions, metrics = [], []
    for step in range(4):
        for micro in range(2):
            d = make_padded(10 * step + micro, fields=ALL_FIELDS)
            loss = model(torch.randn(5, 8, generator=g).to(device)).pow(2).mean()
            guard.observe(TokenBatch(**{k: v.to(device) for k, v in d.items()}, current_version=CV), loss=loss.detach())
            loss.backward()
        if step == nan_step:
            with torch.no_grad():
                model[0].weight.grad[0, 0] = float("nan")
        decision = guard.check()
        if decision.apply_step:
            opt.step()
        opt.zero_grad()
        guard.step_done()
        actions.append(decision.action)
        metrics.append(comparable(guard.last_metrics))
    assert guard.internal_failures == 0 and getattr(guard.engine, "failure", None) is None
    assert getattr(guard.engine, "whole_failure", None) is None
    guard.close()
    return actions, metrics, model


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_a_guard_on_cuda_reports_and_decides_what_it_does_on_cpu(tmp_path, engine):
    before = compiled_calls()
    cuda_actions, cuda_metrics, cuda_model = _guarded_run(tmp_path, "cuda", engine, nan_step=2)
    assert (compiled_calls() > before) == (engine == "compiled")
    cpu_actions, cpu_metrics, cpu_model = _guarded_run(tmp_path, "cpu", "eager", nan_step=2)
    assert cuda_actions == cpu_actions == [None, None, "skip_step", None]
    for step, (c, e) in enumerate(zip(cuda_metrics, cpu_metrics)):
        assert c.keys() == e.keys(), step
        for key in e:
            assert c[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6, nan_ok=True), (step, key)
    for c, e in zip(cuda_model.parameters(), cpu_model.parameters()):
        assert torch.isfinite(c).all()
        torch.testing.assert_close(c.cpu(), e, rtol=1e-4, atol=1e-5)
