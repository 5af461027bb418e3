"""One micro-batch -> one ``Partial``: the path every engine object (``engines.py``) runs, in an array namespace.

The batch is walked in fixed-size chunks (``chunks.py``) and each chunk's statistics come from the one definition
(``families.chunk_stats``), run as it is or compiled. Per-sequence sums are accumulated in ``[S]`` vectors and
reduced after the last chunk (``sequences.kl_finish``, ``lags.lag_finish``). GSPO's sequence-level clipping needs
the whole sequence's log-ratio first, so it takes a second, lighter pass. With ``ops=xp.NUMPY`` (small padded CPU
micro-batches without policy versions: ``takes_on_host``) the same functions run on numpy views of the tensors,
as one chunk: a torch call's dispatch costs more than such a batch's arithmetic.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import families, keys, xp
from .batch import BatchError, TokenBatch
from .chunks import ChunkStats, chunks
from .lags import lag_finish, lag_lut
from .partial import Partial
from .sequences import kl_finish, loss_stats, ratio_stats, seq_log_ratio, sequence_stats
from .token_rows import row_plan

FLOAT_FIELDS = ("logprobs", "entropy", "advantages", "prox_logprobs", "old_logprobs", "ref_logprobs")


def takes_on_host(b: TokenBatch, max_tokens: int) -> bool:
    """Whether numpy computes micro-batch ``b``: padded float32 CPU fields, no policy versions, at most
    ``max_tokens`` tokens."""
    lp = b.logprobs
    return (
        lp.device.type == "cpu"
        and b.cu_seqlens is None
        and b.versions is None
        and 0 < lp.numel() <= max_tokens
        and all(getattr(b, f) is None or getattr(b, f).dtype == torch.float32 for f in FLOAT_FIELDS)
    )


def _np(t):
    """A CPU tensor's memory as a numpy array (no copy); bfloat16, which numpy lacks, is converted."""
    if t is None:
        return None
    t = t.detach() if t.requires_grad else t
    return (t.double() if t.dtype == torch.bfloat16 else t).numpy()


class WholeBatch:
    """A padded CPU batch as one chunk of numpy views (the ``Chunk`` interface the numpy path needs)."""

    def __init__(self, b: TokenBatch) -> None:
        self.b = b

    def block(self, t, per_seq: bool | None = None):
        if t is None:
            return None
        a = t if isinstance(t, np.ndarray) else _np(t)
        per_seq = a.ndim == 1 if per_seq is None else per_seq
        return a[:, None] if per_seq else a

    def add_seq_sums(self, acc, sums) -> None:
        acc += sums


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
def eager_probe(b: TokenBatch, lag_edges, chunk_tokens, compiled: bool = False, ops=xp.TORCH) -> Partial:
    """Every token statistic of micro-batch ``b``: each chunk's ``families.chunk_stats``, run as it is (in
    ``ops``) or ``compiled``."""
    with np.errstate(all="ignore"):  # numpy: NaN and inf are data here (counted as non-finite), not faults
        return _probe(b, lag_edges, chunk_tokens, compiled, ops)


def _probe(b: TokenBatch, lag_edges, chunk_tokens, compiled: bool, ops) -> Partial:
    acc = ChunkStats(b.num_seqs, b.device, ops)
    # walked afresh for each pass: a chunk holds its packed sequence ids (8 bytes a token) until it is dropped
    walk = (lambda: [WholeBatch(b)]) if ops is xp.NUMPY else (lambda: chunks(b, chunk_tokens))
    lut = lag_lut(lag_edges, b.device) if b.versions is not None else None
    seq_clip, token_clip = _clip_modes(b)
    plan = _plan_of(b)
    static = families.static_of(plan, b, token_clip, lag_edges)
    for ch in walk():
        acc.next_chunk()
        families.probe_chunk(acc, b, ch, plan, static, lag_edges, compiled, ops)
    acc.chunks_done()
    if lut is not None:  # versions given
        lag_finish(
            acc, lut, len(lag_edges), ratio=b.old_logprobs is not None, clipped=token_clip and b.advantages is not None
        )
    kl_finish(acc, ops, plan)
    if b.old_logprobs is not None:
        s_lr, s_ok = seq_log_ratio(acc, ops, plan)
        ratio_stats(acc, ops, "seq_ratio", s_lr, s_ok, zero=static.zero_ratio >= 0)
        if seq_clip and b.advantages is not None:
            for ch in walk():
                families.probe_gspo_chunk(acc, b, ch, s_lr, static, lut, len(lag_edges), ops)
    view = WholeBatch(b).block if ops is xp.NUMPY else (lambda t, per_seq=None: t)
    lengths = view(b.lengths, False) if b.lengths is not None else acc.seq("length")
    sequence_stats(acc, ops, lengths, view(b.truncated, False), view(b.rewards, False))
    if not b.allow_empty_mask:
        acc.sum(keys.TOKENS.empty_microbatches, acc.total(keys.TOKENS.count) == 0)
    acc.sum(keys.TOKENS.microbatches, _one(b.device, ops))
    return acc.partial()


@functools.lru_cache(maxsize=16)
def _one(device: torch.device, ops) -> torch.Tensor:
    return ops.full((), 1.0, ops.f32, device)


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


@torch.no_grad()
def eager_sequence_stats(fields: dict, ops=xp.TORCH) -> Partial:
    """Per-sequence statistics of ``sequence_fields``' tensors (numpy views of them with ``ops=xp.NUMPY``)."""
    first = next(iter(fields.values()))
    acc = ChunkStats(first.numel(), first.device, ops)
    arrays = {k: _np(t) if ops is xp.NUMPY else t for k, t in fields.items()}
    with np.errstate(all="ignore"):
        sequence_stats(acc, ops, arrays.get("lengths"), arrays.get("truncated"), arrays.get("rewards"))
    return acc.partial()


def eager_loss(loss: torch.Tensor, ops=xp.TORCH) -> Partial:
    """The micro-batch loss's statistics (``sequences.loss_stats``)."""
    acc = ChunkStats(1, loss.device, ops)
    loss_stats(acc, ops, _np(loss) if ops is xp.NUMPY else loss.detach())
    return acc.partial()
