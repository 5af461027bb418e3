"""The eager engine's paths: one micro-batch -> one ``Partial``, wiring the probes to the fields a ``TokenBatch``
carries (the engine objects that choose among these paths are in ``engines.py``).

The batch is walked in fixed-size chunks (``chunks.py``); each chunk reads every input tensor once: the fields
become the rows of one stacked buffer probed together (``token_rows.py``), then clipping and policy lag read those
rows (``token_probes.py``). Every temporary is a chunk-sized buffer that every chunk reuses (``scratch.py``), so
extra memory is a fixed set of chunk-sized tensors whatever the batch size. Per-sequence sums are accumulated in
``[S]`` vectors and reduced after the last chunk. GSPO's sequence-level clipping needs the whole sequence's
log-ratio first, so it takes a second, lighter pass.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import fused, host_engine, keys
from .batch import BatchError, TokenBatch
from .chunks import Chunk, ChunkStats, chunks
from .kernels import (
    clip_by_lag,
    clip_stats,
    gated,
    lag_buckets,
    lag_lut,
    nonfinite,
    ratio_stats,
    validate_,
    value_stats,
)
from .partial import Partial
from .scratch import Scratch
from .token_probes import clip_into, lag_cells_into, lag_counts_into, lag_finish, lag_into
from .token_rows import gate_into, kl_finish, row_plan, rows_into, seq_log_ratio


@torch.no_grad()
def probe_on_host(b: TokenBatch, lag_edges) -> Partial:
    """A small CPU micro-batch computed by numpy (``host_engine.py``) in the eager layout; a failure is raised."""
    seq_clip, token_clip = _clip_modes(b)
    return host_engine.computed(host_engine.signature(b, seq_clip, token_clip),
                                lambda: eager_probe(_one_token_like(b), lag_edges, None),
                                lambda sig: host_engine.probe(b, _plan_of(b), sig, seq_clip, token_clip))


def _one_token_like(b: TokenBatch) -> TokenBatch:
    """A one-token batch with the fields (and dtypes) of ``b``: its statistics layout is ``b``'s."""
    fields: dict[str, Any] = {}
    for name in host_engine.LAYOUT_FIELDS:
        t = getattr(b, name)
        if t is not None:
            fields[name] = torch.ones((1,) if t.dim() == 1 else (1, 1), dtype=t.dtype)
    return TokenBatch(**fields, clipped_loss=b.clipped_loss, importance_sampling_level=b.importance_sampling_level,
                      allow_empty_mask=b.allow_empty_mask)


def _clip_modes(b: TokenBatch) -> tuple[bool, bool]:
    """(GSPO's sequence-level clipping, token-level clipping)."""
    seq_clip = (b.clipped_loss and b.importance_sampling_level == "sequence" and b.old_logprobs is not None
                and b.prox_logprobs is None)
    return seq_clip, b.clipped_loss and not seq_clip


def _plan_of(b: TokenBatch):
    return row_plan(b.entropy is not None, b.advantages is not None, b.prox_logprobs is not None,
                    b.old_logprobs is not None, b.ref_logprobs is not None, b.versions is not None)


@torch.no_grad()
def eager_probe(b: TokenBatch, lag_edges, chunk_tokens, compiled: bool = False) -> Partial:
    """The chunked torch engine; ``compiled``: each chunk through ``fused.py``'s compiled function."""
    acc = ChunkStats(b.num_seqs, b.device)
    ws = None if compiled else Scratch.for_batch(b.device, b.logprobs.numel())
    lut = lag_lut(lag_edges, b.device) if b.versions is not None else None
    seq_clip, token_clip = _clip_modes(b)
    plan = _plan_of(b)
    static = fused.static_of(plan, b, token_clip, lag_edges) if compiled else None
    for ch in chunks(b, chunk_tokens):
        acc.next_chunk()
        if static is not None:  # compiled
            fused.probe_chunk(acc, b, ch, plan, static, lag_edges)
            continue
        assert ws is not None  # made above when not compiled
        ws.start(ch.n)
        _probe_chunk(acc, ws, b, ch, plan, lag_edges, token_clip=token_clip)
    acc.chunks_done()
    if lut is not None:  # versions given
        lag_finish(acc, lut, len(lag_edges), ratio=b.old_logprobs is not None,
                   clipped=token_clip and b.advantages is not None)
    kl_finish(acc, plan)
    if b.old_logprobs is not None:
        s_lr, s_ok = seq_log_ratio(acc, plan)
        ratio_stats(acc, "seq_ratio", s_lr, s_ok)
        if seq_clip and b.advantages is not None:
            for ch in chunks(b, chunk_tokens):
                _seq_clip_chunk(acc, b, ch, s_lr, lag_edges, lut)
    lengths = b.lengths if b.lengths is not None else acc.seq("length")
    _sequence_stats(acc, lengths, b.truncated, b.rewards)
    if not b.allow_empty_mask:
        acc.sum(keys.TOKENS.empty_microbatches, acc.total(keys.TOKENS.count) == 0)
    acc.sum(keys.TOKENS.microbatches, _one(b.device))
    return acc.partial()


@functools.lru_cache(maxsize=16)
def _one(device: torch.device) -> torch.Tensor:
    return torch.ones((), device=device)


def _probe_chunk(acc: ChunkStats, ws: Scratch, b: TokenBatch, ch: Chunk, plan, edges, token_clip: bool) -> None:
    """All token probes of one chunk: the stacked rows (``token_rows.py``), then clipping and lag, which read the
    rows' zero-filled values and validity."""
    gate, n_mask = gate_into(acc, ws, b, ch)
    rows = rows_into(acc, ws, b, ch, plan, gate, n_mask)
    z, v = rows["z"], rows["v"]
    clipped = None
    if plan.has("adv"):
        i = plan.at("adv")
        sign = torch.sign(z[i], out=ws("adv.sign"))
        acc.sum(keys.ADV.zero, torch.sub(rows["counts"][i], torch.dot(sign, sign)))  # invalid entries are 0 in z
        if token_clip and plan.clip_row >= 0:
            j = plan.clip_row
            clipped = clip_into(acc, ws, z[j], v[j], sign, v[i], b.eps_low, b.eps_high)
    if b.versions is not None:
        assert b.current_version is not None  # TokenBatch checks that it comes with versions
        versions = ch.token(b.versions)
        if not plan.has("ratio"):
            lag_counts_into(acc, lag_into(acc, ws, versions, b.current_version, gate, edges), edges)
        else:  # the slot and region as an offset into the per-slot cells of the log-ratio sketch
            j = plan.at("ratio")
            offset = lag_into(acc, ws, versions, b.current_version, gate, edges, v[j], clipped)
            cells, start = rows["ratio_cells"]
            lag_cells_into(acc, offset, edges, cells, start, ws("f64", torch.float64).copy_(rows["k3"][0]))


def _seq_clip_chunk(acc: ChunkStats, b: TokenBatch, ch: Chunk, s_lr, edges, lut) -> None:
    """GSPO: every valid token of a sequence is clipped by the sequence ratio (token advantage sign)."""
    # the mask is filled in by TokenBatch; the caller checked the others
    assert b.mask is not None and b.old_logprobs is not None and b.advantages is not None
    m = ch.raw(b.mask)
    m = m if m.dtype == torch.bool else m != 0
    gate = m.view(torch.uint8).float().sub_(1.0).mul_(3e38).mul_(3e38)  # 0 where kept, (-1) * big * big = -inf
    lr = ch.token(b.logprobs) + gate - ch.token(b.old_logprobs)
    v = validate_(lr)
    adv, v_adv = gated(ch.token(b.advantages), gate)
    clip_lr = ch.seq_gather(s_lr).float().add_(lr * 0.0)  # NaN where the token (or its sequence) is invalid
    clipped = clip_stats(acc, clip_lr, adv, torch.dot(v, v_adv), b.eps_low, b.eps_high)
    if b.versions is not None:
        assert b.current_version is not None  # TokenBatch checks that it comes with versions
        _, bucket = lag_buckets(ch.token(b.versions), b.current_version, gate, edges, lut)
        clip_by_lag(acc, bucket, clipped, len(edges))


def sequence_fields(lengths=None, truncated=None, rewards=None) -> dict:
    """The given per-sequence tensors by name, checked to be 1-D and of one length (shapes only: no device read)."""
    fields = {k: t for k, t in (("lengths", lengths), ("truncated", truncated), ("rewards", rewards)) if t is not None}
    if not fields:
        return fields
    first = next(iter(fields.values()))
    for name, t in fields.items():
        if t.dim() != 1 or t.shape != first.shape:
            raise BatchError(f"{name} must be one value per sequence, 1-D and as long as the other per-sequence "
                             f"fields; got shape {tuple(t.shape)} (expected {(first.numel(),)})")
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
