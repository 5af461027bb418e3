"""The engines' paths below the engine objects (``engines.py``): one micro-batch -> one ``Partial``.

The batch is walked in fixed-size chunks (``chunks.py``) and each chunk's statistics come from the one definition
(``families.chunk_stats``), run as it is or compiled. Per-sequence sums are accumulated in ``[S]`` vectors and
reduced after the last chunk (``token_rows.kl_finish``, ``token_probes.lag_finish``). GSPO's sequence-level clipping
needs the whole sequence's log-ratio first, so it takes a second, lighter pass. Small CPU micro-batches can be
computed by numpy instead (``probe_on_host``, ``host_engine.py``), packed in this path's layout.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import families, host_engine, keys
from .batch import BatchError, TokenBatch
from .chunks import ChunkStats, chunks
from .kernels import (
    gated,
    lag_lut,
    nonfinite,
    ratio_stats,
    value_stats,
)
from .partial import Partial
from .token_probes import lag_finish
from .token_rows import kl_finish, row_plan, seq_log_ratio


@torch.no_grad()
def probe_on_host(b: TokenBatch, lag_edges) -> Partial:
    """A small CPU micro-batch computed by numpy (``host_engine.py``) in the eager layout; a failure is raised."""
    seq_clip, token_clip = _clip_modes(b)
    return host_engine.computed(
        host_engine.signature(b, seq_clip, token_clip),
        lambda: eager_probe(_one_token_like(b), lag_edges, None),
        lambda sig: host_engine.probe(b, _plan_of(b), sig, seq_clip, token_clip),
    )


def _one_token_like(b: TokenBatch) -> TokenBatch:
    """A one-token batch with the fields (and dtypes) of ``b``: its statistics layout is ``b``'s."""
    fields: dict[str, Any] = {}
    for name in host_engine.LAYOUT_FIELDS:
        t = getattr(b, name)
        if t is not None:
            fields[name] = torch.ones((1,) if t.dim() == 1 else (1, 1), dtype=t.dtype)
    return TokenBatch(
        **fields,
        clipped_loss=b.clipped_loss,
        importance_sampling_level=b.importance_sampling_level,
        allow_empty_mask=b.allow_empty_mask,
    )


def _clip_modes(b: TokenBatch) -> tuple[bool, bool]:
    """(GSPO's sequence-level clipping, token-level clipping)."""
    seq_clip = (
        b.clipped_loss
        and b.importance_sampling_level == "sequence"
        and b.old_logprobs is not None
        and b.prox_logprobs is None
    )
    return seq_clip, b.clipped_loss and not seq_clip


def _plan_of(b: TokenBatch):
    return row_plan(
        b.entropy is not None,
        b.advantages is not None,
        b.prox_logprobs is not None,
        b.old_logprobs is not None,
        b.ref_logprobs is not None,
        b.versions is not None,
    )


@torch.no_grad()
def eager_probe(b: TokenBatch, lag_edges, chunk_tokens, compiled: bool = False) -> Partial:
    """The chunked torch path: each chunk's ``families.chunk_stats``, run as it is or ``compiled``."""
    acc = ChunkStats(b.num_seqs, b.device)
    lut = lag_lut(lag_edges, b.device) if b.versions is not None else None
    seq_clip, token_clip = _clip_modes(b)
    plan = _plan_of(b)
    static = families.static_of(plan, b, token_clip, lag_edges)
    for ch in chunks(b, chunk_tokens):
        acc.next_chunk()
        families.probe_chunk(acc, b, ch, plan, static, lag_edges, compiled)
    acc.chunks_done()
    if lut is not None:  # versions given
        lag_finish(
            acc, lut, len(lag_edges), ratio=b.old_logprobs is not None, clipped=token_clip and b.advantages is not None
        )
    kl_finish(acc, plan)
    if b.old_logprobs is not None:
        s_lr, s_ok = seq_log_ratio(acc, plan)
        ratio_stats(acc, "seq_ratio", s_lr, s_ok)
        if seq_clip and b.advantages is not None:
            for ch in chunks(b, chunk_tokens):
                families.probe_gspo_chunk(acc, b, ch, s_lr, static, lut, len(lag_edges))
    lengths = b.lengths if b.lengths is not None else acc.seq("length")
    _sequence_stats(acc, lengths, b.truncated, b.rewards)
    if not b.allow_empty_mask:
        acc.sum(keys.TOKENS.empty_microbatches, acc.total(keys.TOKENS.count) == 0)
    acc.sum(keys.TOKENS.microbatches, _one(b.device))
    return acc.partial()


@functools.lru_cache(maxsize=16)
def _one(device: torch.device) -> torch.Tensor:
    return torch.ones((), device=device)


def sequence_fields(lengths=None, truncated=None, rewards=None) -> dict:
    """The given per-sequence tensors by name, checked to be 1-D and of one length (shapes only: no device read)."""
    fields = {k: t for k, t in (("lengths", lengths), ("truncated", truncated), ("rewards", rewards)) if t is not None}
    if not fields:
        return fields
    first = next(iter(fields.values()))
    for name, t in fields.items():
        if t.dim() != 1 or t.shape != first.shape:
            raise BatchError(
                f"{name} must be one value per sequence, 1-D and as long as the other per-sequence "
                f"fields; got shape {tuple(t.shape)} (expected {(first.numel(),)})"
            )
    return fields


def sequence_layout_sample(fields: dict) -> dict:
    """One-value stand-ins of the same dtypes: their eager statistics have the layout of ``fields``'."""
    return {k: torch.ones(1, dtype=t.dtype) for k, t in fields.items()}


@torch.no_grad()
def eager_sequence_stats(fields: dict) -> Partial:
    first = next(iter(fields.values()))
    acc = ChunkStats(first.numel(), first.device)
    _sequence_stats(acc, fields.get("lengths"), fields.get("truncated"), fields.get("rewards"))
    return acc.partial()


def _sequence_stats(acc: ChunkStats, lengths, truncated, rewards) -> None:
    if lengths is not None:
        lengths = lengths.reshape(-1).to(torch.float64)
        value_stats(acc, "length", lengths, torch.ones_like(lengths))
    if truncated is not None:
        acc.sum(keys.LENGTH.truncated, truncated.bool().sum())
    if rewards is not None:
        rewards, v = gated(rewards.reshape(-1).to(torch.float64), None)
        _, n = value_stats(acc, "reward", rewards, v, squares=True)
        nonfinite(acc, "rewards", rewards.numel(), n)
