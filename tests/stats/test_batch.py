"""TokenBatch contract: host-side validation messages, and the empty-mask counter (raised later by the Guard)."""

from __future__ import annotations

import re

import pytest
import torch
from stats_probes import probe_batch

from rl_guard.stats.accumulate import StepAccumulator
from rl_guard.stats.batch import BatchError, TokenBatch
from rl_guard.stats.summarize import summarize

B, T = 3, 5


def lp(*shape):
    return -torch.rand(*(shape or (B, T)))


def mask(*shape):
    return torch.ones(*(shape or (B, T)), dtype=torch.bool)


@pytest.mark.parametrize("field", ["old_logprobs", "prox_logprobs", "ref_logprobs", "entropy"])
def test_token_field_shape_mismatch_names_field_and_both_shapes(field):
    with pytest.raises(BatchError) as e:
        TokenBatch(lp(), mask(), **{field: lp(B, T + 1)})
    msg = str(e.value)
    assert field in msg and "(3, 6)" in msg and "(3, 5)" in msg


def test_mask_shape_mismatch_names_both_shapes():
    with pytest.raises(BatchError, match=re.escape("mask shape (3, 4) does not match logprobs shape (3, 5)")):
        TokenBatch(lp(), mask(B, T - 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_float_mask_names_the_dtype(dtype):
    with pytest.raises(BatchError, match=re.escape(str(dtype))) as e:
        TokenBatch(lp(), torch.ones(B, T, dtype=dtype))
    assert "mask" in str(e.value)


def test_integer_mask_is_accepted_and_means_zero_or_one():
    m = torch.tensor([[1, 1, 0, 0, 0]] * B)
    raw = StepAccumulator()
    raw.add(probe_batch(TokenBatch(lp(), m)))
    assert raw.finish()["tokens.count"][0] == 2 * B


@pytest.mark.parametrize("field", ["rewards", "lengths", "truncated"])
def test_per_sequence_field_with_wrong_shape(field):
    with pytest.raises(BatchError, match=re.escape(f"{field} must be per-sequence shape (3,), got (4,)")):
        TokenBatch(lp(), mask(), **{field: torch.zeros(B + 1)})
    with pytest.raises(BatchError, match=field):
        TokenBatch(lp(), mask(), **{field: torch.zeros(B, T)})


@pytest.mark.parametrize("field", ["advantages", "versions"])
def test_token_or_sequence_field_with_wrong_shape(field):
    with pytest.raises(BatchError) as e:
        TokenBatch(lp(), mask(), **{field: torch.zeros(B + 2)}, current_version=1)
    msg = str(e.value)
    assert field in msg and "(5,)" in msg and "(3, 5)" in msg and "(3,)" in msg
    ok = TokenBatch(lp(), mask(), **{field: torch.zeros(B, 1)}, current_version=1)  # [B, 1] is per sequence
    assert getattr(ok, field).shape == (B,)


def test_versions_without_current_version():
    with pytest.raises(BatchError, match="current_version"):
        TokenBatch(lp(), mask(), versions=torch.zeros(B, T))


def test_packed_batch_checks():
    cu = torch.tensor([0, 2, 5])
    with pytest.raises(
        BatchError, match=re.escape("packed batch: logprobs must be [N] with cu_seqlens, got shape (3, 5)")
    ):
        TokenBatch(lp(), cu_seqlens=cu)
    with pytest.raises(BatchError, match="cu_seqlens must be"):
        TokenBatch(lp(5), cu_seqlens=torch.tensor([0]))
    with pytest.raises(BatchError, match=re.escape("rewards must be per-sequence shape (2,), got (3,)")):
        TokenBatch(lp(5), cu_seqlens=cu, rewards=torch.zeros(3))
    b = TokenBatch(lp(5), cu_seqlens=cu)
    assert b.packed and b.num_seqs == 2 and b.mask.dtype == torch.bool and bool(b.mask.all())


def test_other_contract_errors():
    with pytest.raises(BatchError, match="mask is required"):
        TokenBatch(lp())
    with pytest.raises(BatchError, match=re.escape("got shape (2, 3, 4)")):
        TokenBatch(lp(2, 3, 4), mask(2, 3, 4))
    with pytest.raises(BatchError, match="old_logprobs must be a torch.Tensor, got list"):
        TokenBatch(lp(), mask(), old_logprobs=[0.0])
    with pytest.raises(BatchError, match="entropy must be a floating tensor, got dtype torch.int64"):
        TokenBatch(lp(), mask(), entropy=torch.zeros(B, T, dtype=torch.long))
    with pytest.raises(BatchError, match="importance_sampling_level"):
        TokenBatch(lp(), mask(), importance_sampling_level="sentence")
    with pytest.raises(BatchError, match="clip range"):
        TokenBatch(lp(), mask(), eps_low=1.0)


def test_empty_mask_is_counted_not_raised():
    """probe_batch cannot raise on an empty mask without reading the device; it counts the micro-batch instead."""
    acc = StepAccumulator()
    empty = TokenBatch(lp(), torch.zeros(B, T, dtype=torch.bool), old_logprobs=lp(), entropy=lp().abs())
    acc.add(probe_batch(empty))  # no exception
    acc.add(probe_batch(TokenBatch(lp(), mask())))
    acc.add(probe_batch(TokenBatch(lp(), torch.zeros(B, T, dtype=torch.long))))
    raw = acc.finish()
    assert raw["tokens.empty_microbatches"][0] == 2
    assert raw["tokens.microbatches"][0] == 3 and raw["tokens.count"][0] == B * T
    metrics, _ = summarize(raw)
    assert "rl_guard/entropy/mean" not in metrics  # no token: the statistic is absent, not 0


def test_allowed_empty_mask_is_not_counted():
    acc = StepAccumulator()
    acc.add(probe_batch(TokenBatch(lp(), torch.zeros(B, T, dtype=torch.bool), allow_empty_mask=True)))
    raw = acc.finish()
    assert raw.get("tokens.empty_microbatches", [0])[0] == 0 and raw["tokens.count"][0] == 0


def test_empty_packed_batch_is_counted():
    acc = StepAccumulator()
    acc.add(probe_batch(TokenBatch(torch.zeros(0), cu_seqlens=torch.tensor([0, 0]))))
    assert acc.finish()["tokens.empty_microbatches"][0] == 1
