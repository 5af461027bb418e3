"""The compiled statistics engine (``stats_engine: compiled``: rl_guard/stats/families.py under torch.compile,
engines.py), really compiled here.

Against the eager engine: the same statistics layout (so micro-batches and ranks of either engine merge), the same
counts, histogram cells, extremes and non-finite counts bit for bit, the float sums to float32 accuracy; and
against the float64 numpy reference (reference_stats.py) on its own. Also: a compiler that cannot run turns the
engine off with one warning and the statistics come from the eager engine; a bad ``stats_engine`` is a located
config error. Each combination of fields compiles once (~10-20 s), hence ``slow``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
from rl_guard.control.config import load_config
from rl_guard.errors import ConfigError
from rl_guard.glossary import comparable
from rl_guard.stats import eager, families
from rl_guard.stats.accumulate import StepAccumulator
from rl_guard.stats.batch import BatchError, TokenBatch
from rl_guard.stats.engines import Engine
from rl_guard.stats.summarize import summarize

pytestmark = pytest.mark.slow


CV = 12


def small_compiled() -> Engine:
    """The test batches are small; on CPU those normally go to the host path (``host_max_tokens``) or stay eager
    (``cpu_min_tokens``): this engine compiles them all."""
    return Engine("compiled", host_max_tokens=0, cpu_min_tokens=1)


ENGINES = {"compiled": small_compiled(), "eager": Engine("eager", host_max_tokens=0)}


def _run(d: dict, engine, chunk=None, **kw):
    kw.setdefault("current_version", CV if "versions" in d else None)
    b = TokenBatch(**d, **kw)
    p = probe_batch(b, chunk_tokens=chunk, engine=ENGINES.get(engine, engine) if isinstance(engine, str) else engine)
    layout = p.layout
    acc = StepAccumulator()
    acc.add(p)
    return layout, acc.finish()


def _compare(d: dict, chunk=None, **kw) -> dict:
    """Compiled vs eager on one micro-batch; returns the compiled engine's metrics."""
    engine = small_compiled()
    calls = compiled_calls()
    lay_c, c = _run(d, engine, chunk, **kw)
    assert engine.failure is None and engine.whole_failure is None  # no fallback hides behind it
    assert compiled_calls() > calls  # it compiled and ran
    lay_e, e = _run(d, "eager", chunk, **kw)
    assert lay_c == lay_e
    assert_engines_agree(c, e, FLOAT_SUMS, atol=1e-6)
    return summarize(c)[0]


@pytest.mark.parametrize(
    "fields", [("old", "ref", "entropy", "adv", "versions"), ("old", "prox", "adv", "entropy"), ("ref", "entropy")]
)
def test_compiled_equals_eager_and_the_float64_reference(fields):
    for seed in range(2):
        d = make_padded(seed, fields=fields)
        check(_compare(d), reference(np_dict(d), cv=CV))


def test_every_chunk_shape_padded_rows_one_long_row_and_packed():
    d = make_padded(3, B=6, T=40, fields=("old", "ref", "entropy", "adv", "versions"))
    want = reference(np_dict(d), cv=CV)
    check(_compare(d, chunk=80), want)  # two whole rows per chunk
    check(_compare(d, chunk=17), want)  # rows longer than a chunk: one row per chunk
    p = packed_from(d)
    check(_compare(p, chunk=50), want)


def test_per_sequence_advantages_versions_and_given_lengths():
    d = with_per_sequence_fields(4)
    check(_compare(d), reference(np_dict(d), cv=CV))


def test_nonfinite_bf16_inputs_and_gspo():
    d = make_padded(5, fields=("old", "ref", "entropy", "adv", "versions"))
    d["logprobs"][0, 1] = float("nan")
    d["old_logprobs"][1, 2] = float("inf")
    d["entropy"][2, 3] = float("-inf")
    d["advantages"][3, 0] = float("nan")
    got = _compare(d)
    assert got["rl_guard/input/logprobs/nonfinite"] + got["rl_guard/input/old_logprobs/nonfinite"] >= 1
    check(got, reference(np_dict(d), cv=CV))
    half = {
        k: v.to(torch.bfloat16) if k in ("logprobs", "old_logprobs", "ref_logprobs") else v
        for k, v in make_padded(6, fields=("old", "ref", "entropy", "adv", "versions")).items()
    }
    _compare(half)
    g = make_padded(7, B=8, T=30, spread=0.6, fields=("old", "ref", "entropy", "adv", "versions"))
    check(_compare(g, importance_sampling_level="sequence"), reference(np_dict(g), cv=CV, level="sequence"))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_old_log_probs_that_are_the_log_probs_with_versions_and_packed(level):
    """TRL's default (the old log-probs are the log-probs, ``families.same_old``): the ratio row's k3 and cells are
    known, not computed; compiled, eager and the reference agree, padded and packed."""
    d = make_padded(9, fields=("ref", "entropy", "adv", "versions"))
    d["logprobs"][0, 1] = float("nan")
    d["old_logprobs"] = d["logprobs"]
    got = _compare(d, importance_sampling_level=level)
    assert got["rl_guard/ratio/max"] == 1.0 and got["rl_guard/kl_old/k3_mean"] == 0.0
    check(got, reference(np_dict(d), cv=CV, level=level))
    p = packed_from(d)
    p["old_logprobs"] = p["logprobs"]
    check(_compare(p, chunk=50, importance_sampling_level=level), reference(np_dict(d), cv=CV, level=level))


def test_k3_is_accurate_where_exp_minus_one_cancels():
    """log-ratios ~1e-4: k3 ~ 5e-9 per token, below float32's resolution of exp(x) - 1."""
    d = make_padded(8, fields=("old", "ref"))
    d["old_logprobs"] = d["logprobs"] - 1e-4 * torch.randn(d["logprobs"].shape).sign()
    got = _compare(d)
    assert got["rl_guard/kl_old/k3_mean"] == pytest.approx(0.5e-8, rel=2e-3)


def test_a_guard_with_the_compiled_engine_reports_what_the_eager_one_does(tmp_path):
    def run(engine):
        yaml = tmp_path / f"{engine}.yaml"
        yaml.write_text(f"version: 1\nstats_engine: {engine}\nsinks: []\n")
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = Guard.from_yaml(yaml, run_dir=tmp_path / engine).attach(model, opt)
        if engine == "compiled":
            guard.engine = small_compiled()
        out = []
        for step in range(3):
            d = make_padded(10 + step, fields=("old", "ref", "entropy", "adv", "versions"))
            loss = model(torch.randn(3, 4)).pow(2).mean()
            guard.observe(TokenBatch(**d, current_version=CV), loss=loss.detach())
            loss.backward()
            assert guard.check().apply_step
            opt.step()
            opt.zero_grad()
            guard.step_done()
            out.append(comparable(guard.last_metrics))
        assert guard.internal_failures == 0 and getattr(guard.engine, "failure", None) is None
        guard.close()
        return out

    calls = compiled_calls()
    compiled = run("compiled")
    assert compiled_calls() > calls  # the compiled engine really ran
    for c, e in zip(compiled, run("eager")):
        assert c.keys() == e.keys()
        for key in e:
            assert c[key] == pytest.approx(e[key], rel=2e-5, abs=1e-6, nan_ok=True), key


def test_a_missing_compiler_falls_back_to_eager_with_a_warning_per_path(tmp_path):
    """A real failure: the C++ compiler the compiler is told to use does not exist (fresh compile cache)."""
    script = textwrap.dedent(f"""
        import sys, warnings
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        import numpy as np
        from reference_stats import make_padded
        from rl_guard.stats.batch import BatchError, TokenBatch
        from rl_guard.stats.engines import Engine
        from stats_probes import probe_batch
        engine, other = Engine("compiled", cpu_min_tokens=1), Engine("compiled", cpu_min_tokens=1)
        d = make_padded(0, fields=("old", "ref", "entropy", "adv", "versions"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [probe_batch(TokenBatch(**d, current_version=12), engine=engine) for _ in range(2)]
        want = probe_batch(TokenBatch(**d, current_version=12), engine="eager")
        messages = [str(w.message) for w in caught if "stats_engine 'compiled' cannot compile" in str(w.message)]
        assert len(messages) == 2 and "whole micro-batch" in messages[0], messages  # whole, then chunk by chunk
        assert engine.failure and other.failure is None  # per engine: another guard's engine is not turned off
        for p in got:
            assert p.layout == want.layout
            assert np.array_equal(p.sums.numpy(), want.sums.numpy())
        print("FELL BACK:", messages[0])
    """)
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FELL BACK" in out.stdout


def test_an_input_error_is_raised_and_does_not_turn_the_engine_off(monkeypatch):
    """Only the compiler's own failures switch to eager; a bad batch is the caller's error, raised as is."""

    def bad_batch(*args, **kwargs):
        raise BatchError("logprobs must be ...")

    monkeypatch.setattr(families, "probe_chunk", bad_batch)
    d = make_padded(0, fields=("old", "adv"))
    engine = small_compiled()
    with pytest.raises(BatchError):
        probe_batch(TokenBatch(**d), engine=engine)
    assert engine.failure is None


def test_small_cpu_micro_batches_stay_eager():
    engine = Engine("compiled", host_max_tokens=0)
    small = make_padded(0, fields=("old", "ref", "entropy", "adv", "versions"))  # 240 tokens
    calls = compiled_calls()
    _run(small, engine)
    assert compiled_calls() == calls
    big = {k: v.repeat(1, 40) if v.dim() == 2 else v for k, v in small.items()}  # 9,600 tokens
    _run(big, engine)
    assert compiled_calls() > calls


def test_a_bad_stats_engine_names_the_key_line_and_allowed_values(tmp_path):
    yaml = tmp_path / "g.yaml"
    yaml.write_text("version: 1\nsinks: []\nstats_engine: fused\n")
    with pytest.raises(ConfigError) as err:
        load_config(yaml)
    text = str(err.value)
    assert "stats_engine" in text and "line 3" in text and "auto, eager, compiled" in text


@pytest.mark.parametrize("packed", [False, True])
def test_a_one_chunk_micro_batch_compiles_whole_and_a_larger_one_chunk_by_chunk(packed):
    """One chunk: one compiled graph for the whole micro-batch (chunk statistics, finishing, packing), the same
    layout and values as eager and the float64 reference, policy versions included (their current version changes
    from step to step without a new compile); several chunks: chunk by chunk."""
    padded = make_padded(6, fields=("old", "ref", "entropy", "adv", "versions"))
    d = packed_from(padded) if packed else padded
    whole, chunked = eager.whole_kernel.cache_info(), families._compiled.cache_info()
    for cv in (CV, CV + 1, CV + 5):
        check(_compare(d, current_version=cv), reference(np_dict(padded), cv=cv))
    now = eager.whole_kernel.cache_info()
    assert now.hits + now.misses >= whole.hits + whole.misses + 3
    assert families._compiled.cache_info() == chunked  # the chunk kernel did not run
    assert eager.whole_compiles(TokenBatch(**d, current_version=CV), None)
    assert not eager.whole_compiles(TokenBatch(**d, current_version=CV), 17)  # several chunks
    chunks_before = families._compiled.cache_info()
    check(_compare(d, chunk=17, current_version=CV), reference(np_dict(padded), cv=CV))
    assert families._compiled.cache_info().hits + families._compiled.cache_info().misses > (
        chunks_before.hits + chunks_before.misses
    )


def test_a_host_cu_seqlens_goes_to_the_batch_device_in_a_copy_of_the_batch():
    """Before a packed micro-batch is compiled whole, its ``cu_seqlens`` joins its tensors' device (``meta`` stands in
    for a GPU here) in a shallow copy: the caller's batch keeps its own."""
    d = packed_from(make_padded(6, fields=("old", "adv")))
    on_meta = {k: v if k == "cu_seqlens" else v.to("meta") for k, v in d.items()}
    b = TokenBatch(**on_meta)
    moved = eager._seqs_on_device(b)
    assert moved.cu_seqlens.device.type == "meta" and b.cu_seqlens.device.type == "cpu"
    assert moved.logprobs is b.logprobs and moved.num_seqs == b.num_seqs
    cpu = TokenBatch(**d)
    assert eager._seqs_on_device(cpu) is cpu  # already on its device: the batch itself
