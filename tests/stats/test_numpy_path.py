"""The host path for small CPU micro-batches: the one definition (``families.chunk_stats`` and ``sequences``) run
on numpy views of the tensors (``xp.NUMPY``; the eager engine's choice in engines.py).

Against the same functions run with torch on the same micro-batch: the same statistics layout (micro-batches and
ranks of either path merge), the same counts, histogram cells and non-finite counts, the float sums and the
per-sequence extremes to float32 accuracy (numpy and torch sum in different orders); over random batches
(hypothesis: any subset of fields, per-token or per-sequence advantages, NaN and inf in any field, empty rows and
empty masks, GSPO), and against the float64 reference. Batches it must not take go to the chosen engine, and a
failure inside it costs speed only: one warning, and the torch statistics.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_stats import (
    assert_engines_agree,
    check,
    make_padded,
    np_dict,
    packed_from,
    reference,
    with_per_sequence_fields,
)
from stats_probes import probe_batch

from rl_guard.stats import eager as eager_path
from rl_guard.stats import families, xp
from rl_guard.stats.accumulate import StepAccumulator
from rl_guard.stats.batch import TokenBatch
from rl_guard.stats.engines import HOST_MAX_TOKENS, Engine
from rl_guard.stats.summarize import summarize

FLOAT_SUMS = (".sum", ".sumsq", ".k1.", ".k2.", ".k3", "seq_ratio.")  # summed in another order by numpy
TORCH = Engine("eager", host_max_tokens=0)  # the eager engine without its host path: what a GPU's batches get


def _count_calls(m, module, name: str) -> list:
    """Count the calls of ``module.<name>`` made in the numpy namespace (a silent fallback to torch must not pass
    for a host result)."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        if any(a is xp.NUMPY for a in (*args, *kwargs.values())):
            calls.append(1)
        return real(*args, **kwargs)

    m.setattr(module, name, spy)
    return calls


@pytest.fixture
def host_calls(monkeypatch):
    """How many chunks the numpy path computed."""
    return _count_calls(monkeypatch, families, "chunk_stats")


def _finish(p):
    acc = StepAccumulator()
    acc.add(p)
    return acc.finish()


def _compare(d: dict, host_calls, monkeypatch, **kw) -> dict:
    """Host vs eager on one micro-batch; returns the host engine's metrics."""
    b = TokenBatch(**d, **kw)
    before = len(host_calls)
    engine = Engine("eager")
    host = probe_batch(b, engine=engine)
    assert len(host_calls) == before + 1 and engine.host_failure is None
    eager = probe_batch(b, engine=TORCH)
    assert host.layout == eager.layout
    h = _finish(host)
    assert_engines_agree(h, _finish(eager), FLOAT_SUMS, atol=1e-5)
    return summarize(h)[0]


@pytest.mark.parametrize(
    "fields", [("old", "ref", "entropy", "adv"), ("old", "prox", "adv", "entropy"), ("ref", "entropy"), ("old",), ()]
)
def test_host_equals_eager_and_the_float64_reference(fields, host_calls, monkeypatch):
    for seed in range(2):
        d = make_padded(seed, B=5, T=24, fields=fields)
        check(_compare(d, host_calls, monkeypatch), reference(np_dict(d)))


def test_per_sequence_advantages_given_lengths_and_gspo(host_calls, monkeypatch):
    d = with_per_sequence_fields(0)
    d.pop("versions")
    for level in ("token", "sequence"):
        check(
            _compare(d, host_calls, monkeypatch, importance_sampling_level=level, eps_high=0.28),
            reference(np_dict(d), level=level, eps_high=0.28),
        )


_FIELDS = ("entropy", "advantages", "prox_logprobs", "old_logprobs", "ref_logprobs")


@st.composite
def _batches(draw):
    B, T = draw(st.integers(1, 5)), draw(st.integers(1, 9))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    mask = torch.rand(B, T, generator=g) < draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    lp = -torch.rand(B, T, generator=g) * 2
    d = {"logprobs": lp, "mask": mask if draw(st.booleans()) else mask.long()}
    for name in draw(st.sets(st.sampled_from(_FIELDS))):
        per_seq = name == "advantages" and draw(st.booleans())
        d[name] = torch.randn(B, generator=g) if per_seq else lp + 0.3 * torch.randn(B, T, generator=g)
    for name in ("logprobs", *(f for f in _FIELDS if f in d)):
        for _ in range(draw(st.integers(0, 2))):  # NaN / inf anywhere, masked or not
            t = d[name] = d[name].clone()
            flat = t.view(-1)
            flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    if draw(st.booleans()):
        d["rewards"] = torch.randn(B, generator=g, dtype=draw(st.sampled_from([torch.float32, torch.float64])))
        if draw(st.booleans()):
            d["rewards"][0] = np.nan
    if draw(st.booleans()):
        d["lengths"] = torch.randint(0, T + 1, (B,), generator=g)
    if draw(st.booleans()):
        d["truncated"] = torch.rand(B, generator=g) < 0.5
    kw = dict(
        allow_empty_mask=True,
        clipped_loss=draw(st.booleans()),
        importance_sampling_level=draw(st.sampled_from(["token", "sequence"])),
        eps_low=draw(st.sampled_from([0.1, 0.2])),
        eps_high=draw(st.sampled_from([0.2, 0.28])),
    )
    return d, kw


@settings(max_examples=150, deadline=None)
@given(batch=_batches())
def test_host_equals_eager_on_any_small_batch(batch):
    d, kw = batch
    with pytest.MonkeyPatch.context() as m:
        calls = _count_calls(m, families, "chunk_stats")
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # numpy's invalid-value warnings must not leak
            _compare(d, calls, m, **kw)


def test_batches_it_does_not_take_go_to_the_chosen_engine(host_calls):
    d = make_padded(0, B=4, T=16, fields=("old", "adv", "versions"))
    small = TokenBatch(**{k: v for k, v in d.items() if k != "versions"})
    assert eager_path.takes_on_host(small, HOST_MAX_TOKENS)
    versioned = TokenBatch(**d, current_version=12)
    packed = TokenBatch(**{k: v for k, v in packed_from(d).items() if k != "versions"})
    bf16 = TokenBatch(**{**{k: v for k, v in d.items() if k != "versions"}, "logprobs": d["logprobs"].bfloat16()})
    large = make_padded(0, B=64, T=200, fields=("old",))
    on_device = TokenBatch(
        logprobs=torch.zeros(2, 3, device="meta"), mask=torch.ones(2, 3, dtype=torch.bool, device="meta")
    )
    for b in (versioned, packed, bf16, TokenBatch(**large), on_device):
        assert not eager_path.takes_on_host(b, HOST_MAX_TOKENS)
    for b in (versioned, packed, bf16, TokenBatch(**large)):
        probe_batch(b)
        probe_batch(b)
    assert not host_calls


def test_a_failure_inside_turns_it_off_with_one_warning_and_the_eager_statistics(host_calls, monkeypatch):
    d = make_padded(1, B=4, T=16, fields=("old", "ref", "entropy", "adv"))
    b = TokenBatch(**d)
    want = _finish(probe_batch(b, engine=TORCH))

    def broken(*args, **kwargs):
        raise FloatingPointError("injected")

    monkeypatch.setattr(xp.NumpyOps, "where", staticmethod(broken))
    engine, other = Engine("eager"), Engine("eager")
    with pytest.warns(RuntimeWarning, match="host path .* failed .*injected") as caught:
        got = _finish(probe_batch(b, engine=engine))
        again = _finish(probe_batch(b, engine=engine))
    assert len(caught) == 1 and engine.host_failure and other.host_failure is None  # per engine: one guard's
    for out in (got, again):
        assert out.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(out[key], want[key], err_msg=key)


@st.composite
def _sequences(draw):
    """Per-sequence fields as the adapters pass them to ``Guard.observe_sequences``: any non-empty subset, rewards in
    any float dtype a reward function may return."""
    n = draw(st.one_of(st.integers(1, 40), st.integers(200, 400)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    fields = {}
    if draw(st.booleans()):
        fields["lengths"] = torch.randint(0, 50, (n,), generator=g).to(
            draw(st.sampled_from([torch.int64, torch.float32]))
        )
        # counted; NaN is left out of the sums and extremes, inf is not (a length is never negative: +inf next to
        # -inf would make the sum the order of addition's, in either engine)
        if fields["lengths"].is_floating_point():
            for _ in range(draw(st.integers(0, 2))):
                fields["lengths"][draw(st.integers(0, n - 1))] = draw(st.sampled_from([np.nan, np.inf]))
    if draw(st.booleans()):
        fields["truncated"] = torch.rand(n, generator=g) < 0.5
    if draw(st.booleans()) or not fields:
        dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
        rewards = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
        for _ in range(draw(st.integers(0, 3))):
            rewards[draw(st.integers(0, n - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        fields["rewards"] = rewards
    return fields


@settings(max_examples=100, deadline=None)
@given(fields=_sequences())
def test_sequence_statistics_on_the_host_equal_eager(fields):
    """``Guard.observe_sequences`` (rewards at generation time) takes the host path for small CPU tensors: the same
    layout and statistics as the eager one, whatever the fields, dtypes and non-finite rewards."""
    from stats_probes import sequence_stats

    with pytest.MonkeyPatch.context() as m:
        calls = _count_calls(m, eager_path, "sequence_stats")
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            engine = Engine("eager")
            host = sequence_stats(**fields, engine=engine)
        assert calls == [1] and engine.host_failure is None
        eager = sequence_stats(**fields, engine=TORCH)
    assert calls == [1] and host.layout == eager.layout
    assert_engines_agree(_finish(host), _finish(eager), (".sum", ".sumsq"), atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(batch=_batches())
def test_old_log_probs_that_are_the_log_probs_give_the_bits_of_a_copy(batch):
    """TRL's default passes the log-probs themselves as the old ones (the ratio is exactly 1): the same bits as a
    copy of them (signed zeros included), and the torch path's statistics."""
    d, kw = batch
    for name in ("old_logprobs", "prox_logprobs", "ref_logprobs"):
        d.pop(name, None)
    lp = d["logprobs"].clone().requires_grad_()  # as TRL's: the loss's log-probs, detached for the old ones
    shared = TokenBatch(**{**d, "logprobs": lp, "old_logprobs": lp.detach()}, **kw)
    copied = TokenBatch(**{**d, "logprobs": lp, "old_logprobs": lp.detach().clone()}, **kw)
    engine = Engine("eager")
    fast, general = probe_batch(shared, engine=engine), probe_batch(copied, engine=engine)
    assert engine.host_failure is None
    (layout, sums, maxes), (layout2, sums2, maxes2) = tuple(fast), tuple(general)
    assert layout == layout2
    for a, b in ((sums, sums2), (maxes, maxes2)):
        assert np.array_equal(a.numpy().view(np.int64), b.numpy().view(np.int64))  # bit for bit, NaN and -0.0 too
    eager = probe_batch(shared, engine=TORCH)
    assert_engines_agree(_finish(fast), _finish(eager), FLOAT_SUMS, atol=1e-5)
