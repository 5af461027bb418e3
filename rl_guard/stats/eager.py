"""One micro-batch -> one ``Partial``: the path every engine object (``engines.py``) runs, in an array namespace.

The batch is walked in fixed-size chunks (``chunks.py``) and each chunk's statistics come from the one definition
(``families.chunk_stats``), run as it is or compiled. Per-sequence sums are accumulated in ``[S]`` vectors and
reduced after the last chunk (``sequences.kl_finish``, ``lags.lag_finish``). GSPO's sequence-level clipping needs
the whole sequence's log-ratio first, so it takes a second, lighter pass. With ``ops=xp.NUMPY`` (small padded CPU
micro-batches without policy versions: ``takes_on_host``) the same functions run on numpy views of the tensors,
as one chunk: a torch call's dispatch costs more than such a batch's arithmetic. The compiled engine compiles a
one-chunk micro-batch whole (``whole_kernel``: this same path, one graph), a larger one chunk by chunk.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable

import numpy as np
import torch

from . import families, keys, xp
from .batch import BatchError, TokenBatch
from .chunks import Chunk, ChunkStats, chunk_size, chunks
from .lags import lag_finish, lag_lut
from .on_device import host_to_device
from .partial import Partial
from .sequences import kl_finish, loss_stats, ratio_stats, seq_log_ratio, sequence_stats
from .token_rows import constants_of, row_plan

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
def eager_probe(
    b: TokenBatch, lag_edges, chunk_tokens, compiled: bool = False, ops=xp.TORCH, whole: bool | None = None
) -> Partial:
    """Every token statistic of micro-batch ``b``: each chunk's ``families.chunk_stats``, run as it is (in
    ``ops``) or ``compiled``. ``whole``: compile the micro-batch whole, finishing and packing included (None:
    wherever ``whole_compiles``; the engine decides it itself)."""
    seq_clip, token_clip = _clip_modes(b)
    plan = _plan_of(b)
    fixed = {
        "plan": plan,
        "static": families.static_of(plan, b, token_clip, lag_edges),
        "edges": tuple(lag_edges),
        "seq_clip": seq_clip,
        "token_clip": token_clip,
    }
    consts = constants_of(plan, ops, b.device)
    lut = lag_lut(fixed["edges"], b.device) if b.versions is not None else None
    if compiled and (whole_compiles(b, chunk_tokens) if whole is None else whole):
        return whole_kernel(**fixed)(_seqs_on_device(b), consts, lut)
    with np.errstate(all="ignore"):  # numpy: NaN and inf are data here (counted as non-finite), not faults
        return _probe(b, consts, lut, chunk_tokens, compiled, ops, **fixed)


def whole_compiles(b: TokenBatch, chunk_tokens) -> bool:
    """Whether the compiled engine compiles micro-batch ``b`` whole: when it is one chunk (every GPU micro-batch up
    to ``chunks.GPU_CHUNK`` tokens)."""
    return 0 < b.logprobs.numel() <= chunk_size(b, chunk_tokens)


def _seqs_on_device(b: TokenBatch) -> TokenBatch:
    """``b`` with its ``cu_seqlens`` on its device: a copy from host memory stays outside compiled code (queued,
    through pinned memory, as the chunk path's own copy is)."""
    if b.cu_seqlens is None or b.cu_seqlens.device == b.device:
        return b
    moved = copy.copy(b)
    moved.cu_seqlens = host_to_device(b.cu_seqlens, b.device)
    return moved


@functools.lru_cache(maxsize=32)
def whole_kernel(**fixed):
    """``_probe`` compiled for one micro-batch's constants (``families.compiled_copy``): chunk statistics, finishing
    and packing in one graph, whose inputs are the batch, the plan's constant tensors and the lag table."""
    return families.compiled_copy(_probe, **fixed, one_chunk=True)


def _walk(b: TokenBatch, chunk_tokens, ops, one_chunk: bool) -> Iterable:
    """The chunks of ``b``, made afresh for each pass (a chunk holds its packed sequence ids, 8 bytes a token, until it
    is dropped): numpy's one view, the one chunk itself (not the walk's loop, whose bounds would be constants to the
    compiler), or ``chunks``."""
    if ops is xp.NUMPY:
        return [WholeBatch(b)]
    if one_chunk:
        return [Chunk(b, 0, b.logprobs.numel(), (0, b.logprobs.shape[0]))]
    return chunks(b, chunk_tokens)


def _probe(
    b: TokenBatch,
    consts,
    lut=None,
    chunk_tokens=None,
    compiled: bool = False,
    ops=xp.TORCH,
    *,
    plan,
    static,
    edges: tuple,
    seq_clip: bool,
    token_clip: bool,
    one_chunk: bool = False,
) -> Partial:
    acc = ChunkStats(b.num_seqs, b.device, ops)
    for ch in _walk(b, chunk_tokens, ops, one_chunk):
        acc.next_chunk()
        families.probe_chunk(acc, b, ch, plan, static, edges, compiled, consts, ops)
    acc.chunks_done()
    if lut is not None:  # versions given
        lag_finish(
            acc, lut, len(edges), ratio=b.old_logprobs is not None, clipped=token_clip and b.advantages is not None
        )
    kl_finish(acc, ops, plan, consts.kl_scales)
    if b.old_logprobs is not None:
        s_lr, s_ok = seq_log_ratio(acc, ops, plan)
        ratio_stats(acc, ops, "seq_ratio", s_lr, s_ok, zero=static.zero_ratio >= 0)
        if seq_clip and b.advantages is not None:
            for ch in _walk(b, chunk_tokens, ops, one_chunk):
                families.probe_gspo_chunk(acc, b, ch, s_lr, static, lut, len(edges), ops)
    view = WholeBatch(b).block if ops is xp.NUMPY else (lambda t, per_seq=None: t)
    lengths = view(b.lengths, False) if b.lengths is not None else acc.seq("length")
    sequence_stats(acc, ops, lengths, view(b.truncated, False), view(b.rewards, False))
    if not b.allow_empty_mask:
        acc.sum(keys.TOKENS.empty_microbatches, acc.total(keys.TOKENS.count) == 0)
    acc.sum(keys.TOKENS.microbatches, consts.one)
    return acc.partial()


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
