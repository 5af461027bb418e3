"""The engine objects (rl_guard/stats/engines.py): what ``stats_engine: auto`` picks on CPU and CUDA and says at
attach, and a failure that stays with the engine (one guard) that met it."""

from __future__ import annotations

import warnings

import pytest
import torch
from reference_stats import make_padded

from rl_guard import Guard
from rl_guard.stats import eager, families
from rl_guard.stats.batch import TokenBatch
from rl_guard.stats.engines import Engine


@pytest.mark.parametrize("triton", [True, False])
def test_auto_picks_compiled_on_cuda_with_triton_and_eager_elsewhere(triton):
    auto = Engine("auto")
    auto.triton = triton  # this engine's view of the installation, as it found it when made
    assert not auto.compiles_on("cpu")
    assert auto.compiles_on("cuda") is triton
    said = auto.describe("cuda")
    assert said.startswith("auto -> compiled" if triton else "auto -> eager") and "cuda" in said
    assert ("kernel launch" in said) == triton and ("Triton" in said)
    assert auto.describe("cpu").startswith("auto -> eager") and "first compile" in auto.describe("cpu")


def test_engine_by_name():
    for name in ("eager", "compiled", "auto"):
        engine = Engine(name)
        assert engine.name == name and engine.compiles_on("cpu") is (name == "compiled")
    with pytest.raises(ValueError, match="auto, eager, compiled"):
        Engine("fused")


def test_the_guard_says_its_engine_once_at_attach(tmp_path, capsys):
    yaml = tmp_path / "g.yaml"
    yaml.write_text("version: 1\nsinks: []\n")
    model = torch.nn.Linear(2, 2)
    guard = Guard.from_yaml(yaml, run_dir=tmp_path / "run").attach(model)
    guard.attach(model)
    err = capsys.readouterr().err
    assert err.count("stats_engine auto -> eager") == 1 and "numpy" in err
    assert guard.engine.name == "auto"
    guard.close()


def test_a_compiler_failure_stays_with_its_engine(monkeypatch):
    """One engine's compiled path fails: it warns once and computes eagerly from then on; another engine in the
    same process (another guard's) still compiles."""
    real = families.kernel

    def broken(s, compiled, ops):
        if compiled:
            raise RuntimeError("no compiler here")
        return real(s, compiled, ops)

    def no_whole(**fixed):
        raise RuntimeError("no compiler here")

    b = TokenBatch(**make_padded(0, fields=("old", "adv")))
    want = Engine("eager", host_max_tokens=0).probe(b)
    first, second = (
        Engine("compiled", host_max_tokens=0, cpu_min_tokens=1),
        Engine("compiled", host_max_tokens=0, cpu_min_tokens=1),
    )
    with monkeypatch.context() as m:
        m.setattr(families, "kernel", broken)  # a micro-batch of several chunks compiles chunk by chunk
        m.setattr(eager, "whole_kernel", no_whole)  # one of one chunk, whole
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [first.probe(b) for _ in range(3)]
    said = [str(w.message) for w in caught if "no compiler here" in str(w.message)]
    assert len(said) == 2 and "whole micro-batch" in said[0] and "computing eagerly" in said[1]  # each path once
    assert first.failure and "no compiler here" in first.failure and first.whole_failure
    assert second.failure is None and second.whole_failure is None
    assert not first._compiles(b) and second._compiles(b)
    for p in got:
        assert p.layout == want.layout and torch.equal(p.sums, want.sums)


def test_a_failure_to_compile_a_whole_micro_batch_keeps_compiling_chunk_by_chunk(monkeypatch):
    """Only the whole-micro-batch path fails: one warning, and the engine goes on compiling chunk by chunk."""

    def no_whole(**fixed):
        raise RuntimeError("graph too large")

    b = TokenBatch(**make_padded(1, fields=("old", "adv", "entropy")))
    want = Engine("eager", host_max_tokens=0).probe(b)
    engine = Engine("compiled", host_max_tokens=0, cpu_min_tokens=1)
    monkeypatch.setattr(eager, "whole_kernel", no_whole)
    chunked = families._compiled.cache_info()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [engine.probe(b) for _ in range(3)]
    said = [str(w.message) for w in caught if "graph too large" in str(w.message)]
    assert len(said) == 1 and "compiling chunk by chunk" in said[0]
    assert engine.whole_failure and engine.failure is None and engine._compiles(b)
    now = families._compiled.cache_info()
    assert now.hits + now.misses >= chunked.hits + chunked.misses + 2  # the two probes after the failure compiled
    for p in got:
        assert p.layout == want.layout
        torch.testing.assert_close(p.sums, want.sums, rtol=2e-6, atol=1e-6)
