"""One definition of the token statistics (rl_guard/stats/families.py): every family's per-chunk outputs come from
``families.chunk_stats`` by name, and each torch engine runs that same function (the eager engine as it is, the
compiled engine a copy of its code under ``torch.compile``, the host path for small CPU batches the function itself
on numpy arrays), so a formula changed there changes every engine; the float64 reference checks all of them
(test_stats_reference.py, test_numpy_path.py)."""

from __future__ import annotations

import functools

import pytest
from reference_stats import make_padded, packed_from

from rl_guard.stats import families, xp
from rl_guard.stats.batch import TokenBatch
from rl_guard.stats.engines import Engine

# family -> the named outputs of ``families.chunk_stats`` that carry its per-chunk sufficient statistics
FAMILIES = {
    "tokens": ("tokens", "lengths"),
    "rows (logp, entropy, adv, log-ratios: counts, value sums, extremes, non-finite inputs)": (
        "counts",
        "sums",
        "maxes",
        "mins",
        "nonfinite",
    ),
    "adv": ("adv_sum", "adv_sumsq", "adv_zero"),
    "sketch cells (entropy, log-ratios)": ("hist_cells", "hist_invalid"),
    "ratio families (sum r)": ("ratio_sums",),
    "kl (k1, k2, k3 per token and per sequence)": ("kl_count", "kl_seq"),
    "clip (by advantage sign)": ("clip_count", "clip_low", "clip_high"),
    "lag (sum, max, cells per bucket)": ("lag_sum", "lag_max", "lag_slots", "lag_cells", "lag_regions", "lag_k3"),
}
CV = 12


def _outputs(d: dict, **kw) -> set[str]:
    """The names ``chunk_stats`` returns for one chunk of these fields, run as it is."""
    seen: set[str] = set()
    real = families.chunk_stats

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.update(out)
        return out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(families, "chunk_stats", spy)
        Engine("eager", host_max_tokens=0).probe(TokenBatch(**d, current_version=CV if "versions" in d else None, **kw))
    return seen


def test_every_family_has_named_outputs_of_the_one_definition():
    every = ("old", "ref", "entropy", "adv", "prox", "versions")
    names = _outputs(make_padded(0, fields=every))  # lag with a ratio: cells per slot and region
    names |= _outputs({k: v for k, v in make_padded(1, fields=("entropy", "adv", "versions")).items()})  # lag slots
    names |= _outputs({k: v for k, v in make_padded(2, fields=("old",)).items()})  # no lengths given: counted
    declared = {name for outs in FAMILIES.values() for name in outs}
    assert names == declared, (names - declared, declared - names)


def test_the_eager_engine_runs_the_definition_itself():
    calls = []
    real = families.chunk_stats
    with pytest.MonkeyPatch.context() as m:
        m.setattr(families, "chunk_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
        d = make_padded(3, B=6, T=40, fields=("old", "ref", "entropy", "adv"))
        Engine("eager", host_max_tokens=0).probe(TokenBatch(**d), chunk_tokens=80)  # three chunks of two rows
        packed = packed_from(d)
        Engine("eager", host_max_tokens=0).probe(TokenBatch(**packed), chunk_tokens=50)
    assert len(calls) == 3 + -(-packed["logprobs"].numel() // 50)


def _static(b: TokenBatch):
    from rl_guard.stats.eager import _clip_modes, _plan_of

    return families.static_of(_plan_of(b), b, _clip_modes(b)[1], (0, 1, 2, 3, 5, 9))


def test_kernel_is_the_function_or_its_compiled_copy():
    b = TokenBatch(**make_padded(5, fields=("old", "adv")))
    s = _static(b)
    plain = families.kernel(s, compiled=False)
    assert isinstance(plain, functools.partial) and plain.func is families.chunk_stats
    assert plain.keywords == {"s": s, "ops": xp.TORCH}
    on_host = families.kernel(s, compiled=False, ops=xp.NUMPY)
    assert on_host.func is families.chunk_stats and on_host.keywords == {"s": s, "ops": xp.NUMPY}


@pytest.mark.slow
def test_the_compiled_engine_compiles_a_copy_of_the_definition():
    """Each combination of fields gets its own code object (the compiler's per-code cache), with the bytecode,
    constants and names of ``chunk_stats``: the same source, nothing else."""
    b = TokenBatch(**make_padded(4, fields=("old", "ref", "entropy", "adv", "versions")), current_version=CV)
    engine = Engine("compiled", host_max_tokens=0, cpu_min_tokens=1)
    engine.probe(b)
    assert engine.failure is None
    compiled = families.kernel(_static(b), compiled=True)  # the one the engine ran (cached)
    fn = compiled._torchdynamo_orig_callable
    code, ref = fn.__code__, families.chunk_stats.__code__
    assert code is not ref and (code.co_code, code.co_consts, code.co_names) == (
        ref.co_code,
        ref.co_consts,
        ref.co_names,
    )


def test_k3_has_one_formula():
    """k3 = exp(x) - 1 - x is ``families.k3`` everywhere (the token rows, the sequence ratio, the culprits): no module
    of the statistics computes it another way (``expm1(x) - x`` cancels where k3 matters, at |x| ~ 1e-4)."""
    import re
    from pathlib import Path

    stats = Path(families.__file__).parent
    calls = re.compile(r"\.expm1_?\(")  # torch.expm1(, np.expm1(, t.expm1_(
    others = [p.name for p in stats.glob("*.py") if calls.search(p.read_text()) and p.name != "sketch.py"]
    assert others == [], others  # sketch.py reads quantiles back on the host with math.expm1 (no k3)
