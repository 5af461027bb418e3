"""One micro-batch -> one ``Partial``: wires the pure probes to the fields a ``TokenBatch`` carries.

The batch is walked in fixed-size chunks (``chunks.py``); each chunk reads every input tensor once and runs all
token probes on it (``token_probes.py``), writing into chunk-sized buffers that every chunk reuses (``scratch.py``),
so extra memory is a fixed set of chunk-sized tensors whatever the batch size. Per-sequence sums
are accumulated in ``[S]`` vectors and reduced after the last chunk. GSPO's sequence-level clipping needs the
whole sequence's log-ratio first, so it takes a second, lighter pass.
"""

from __future__ import annotations

import torch

from . import keys
from .batch import BatchError, TokenBatch
from .chunks import Chunk, chunks
from .constants import DEFAULT_LAG_EDGES
from .constants import EXP_CLAMP
from .kernels import (
    ChunkStats,
    Partial,
    clip_by_lag,
    clip_stats,
    gated,
    kl_finish,
    kl_stats,
    lag_buckets,
    lag_lut,
    nonfinite,
    ratio_stats,
    seq_log_ratio,
    validate_,
    value_stats,
)
from .token_probes import (
    clip_into,
    entropy_into,
    field_values,
    lag_cells_into,
    lag_counts_into,
    lag_finish,
    lag_into,
    ratio_into,
    values_into,
)
from .scratch import Scratch, field, valid_of, zero_filled


@torch.no_grad()
def probe_batch(b: TokenBatch, lag_edges=DEFAULT_LAG_EDGES, chunk_tokens: int | None = None) -> Partial:
    """All token-level sufficient statistics of one micro-batch (device tensors, no host sync)."""
    acc = ChunkStats(b.num_seqs, b.device)
    ws = Scratch(b.device)
    lut = lag_lut(lag_edges, b.device) if b.versions is not None else None
    seq_clip = (b.clipped_loss and b.importance_sampling_level == "sequence" and b.old_logprobs is not None
                and b.prox_logprobs is None)
    token_clip = b.clipped_loss and not seq_clip
    for ch in chunks(b, chunk_tokens):
        ws.start(ch.n)
        _probe_chunk(acc, ws, b, ch, lag_edges, token_clip=token_clip)
    if b.versions is not None:
        lag_finish(acc, lut, len(lag_edges), ratio=b.old_logprobs is not None,
                   clipped=token_clip and b.advantages is not None)
    if b.old_logprobs is not None:
        kl_finish(acc, "kl_old")
        s_lr, s_ok = seq_log_ratio(acc, "kl_old")
        ratio_stats(acc, "seq_ratio", s_lr, s_ok)
        if seq_clip and b.advantages is not None:
            for ch in chunks(b, chunk_tokens):
                _seq_clip_chunk(acc, b, ch, s_lr, lag_edges, lut)
    if b.ref_logprobs is not None:
        kl_finish(acc, "kl_ref")
    lengths = b.lengths if b.lengths is not None else acc.seq("length")
    _sequence_stats(acc, lengths, b.truncated, b.rewards)
    p = acc.partial()
    if not b.allow_empty_mask:
        p.add_sum(keys.TOKENS.empty_microbatches, p.sum[keys.TOKENS.count] == 0)
    p.add_sum(keys.TOKENS.microbatches, torch.ones((), device=b.device))
    return p


def _mask(b: TokenBatch, ch: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's mask (bool) and its gate: 0.0 where a token reaches the loss, -inf where it does not (every
    gated value is then non-finite there, which ``validate_`` turns into NaN).

    Arithmetic on the mask's 0/1 bytes is ~10x cheaper on CPU than ``torch.where``: (m - 1) * big * big is 0 or
    -inf."""
    m = ch.raw(b.mask)
    m = m if m.dtype == torch.bool else m != 0
    return m, m.view(torch.uint8).float().sub_(1.0).mul_(3e38).mul_(3e38)


def _mask_into(ws: Scratch, b: TokenBatch, ch: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's mask as 0/1 floats and its gate, in ``ws``: (m - 1) / m is 0 where a token reaches the loss and
    -1 / 0 = -inf where it does not (see ``_mask``), in two passes."""
    m = ch.raw(b.mask)
    m = m if m.dtype == torch.bool else m != 0
    mf = ws("mask").copy_(m.view(torch.uint8))
    return mf, torch.sub(mf, 1.0, out=ws("gate")).div_(mf)


def _probe_chunk(acc: ChunkStats, ws: Scratch, b: TokenBatch, ch: Chunk, edges, token_clip: bool) -> None:
    """All token probes of one chunk, each writing into the chunk buffers of ``ws``."""
    mf, gate = _mask_into(ws, b, ch)
    n_mask = mf.sum()
    acc.sum(keys.TOKENS.count, n_mask)
    if b.lengths is None:
        ch.seq_add(acc.seq("length"), mf)
    lp = field(ws, "logp", ch.token(b.logprobs), gate)
    z, _, n_lp = field_values(ws, "count", lp)
    values_into(acc, ws, "logp", lp, n_lp, z)  # sampled-token log-probs: a jump means the policy moved
    nonfinite(acc, "logprobs", n_mask, n_lp)
    # (log r zero-filled, validity, count, k3): a zero log-ratio never counts as clipped, so clipping needs no mask
    ratio = _old_family(acc, ws, b, ch, lp, n_lp) if b.old_logprobs is not None else None
    clip = ratio[:3] if ratio is not None else None
    if b.prox_logprobs is not None:
        z_iw, v_iw = _prox_family(acc, ws, b, ch, lp, n_lp, ratio)
        clip = (z_iw, v_iw, v_iw.sum())
    if b.ref_logprobs is not None:
        _ref_family(acc, ws, ch, b, lp, n_lp)
    if b.entropy is not None:
        ent = field(ws, "t0", ch.token(b.entropy), gate)
        z, _, n_ent = field_values(ws, "count", ent)
        entropy_into(acc, ws, ent, n_ent, z)
        nonfinite(acc, "entropy", n_mask, n_ent)
    clipped = None
    if b.advantages is not None:
        clipped = _adv_family(acc, ws, b, ch, gate, n_mask, clip if token_clip else None)
    if b.versions is not None:
        if ratio is None:
            lag_counts_into(acc, lag_into(acc, ws, ch.token(b.versions), b.current_version, gate, edges), edges)
        else:  # the slot and region as an offset into the per-slot cells of the log-ratio sketch
            offset = lag_into(acc, ws, ch.token(b.versions), b.current_version, gate, edges, ratio[1], clipped)
            lag_cells_into(acc, ws, offset, edges, ratio[0], ratio[3])


def _old_family(acc, ws: Scratch, b: TokenBatch, ch: Chunk, lp, n_lp):
    lr = torch.sub(lp, ch.token(b.old_logprobs), out=ws("t0"))  # non-finite wherever logprobs is invalid
    z, v, e, n = ratio_into(acc, ws, "ratio", lr, hist=b.versions is None)  # with versions: from the lag cells
    nonfinite(acc, "old_logprobs", n_lp, n)
    return z, v, n, kl_stats(acc, ch, ws, "kl_old", z, e, v, n)


def _prox_family(acc, ws: Scratch, b: TokenBatch, ch: Chunk, lp, n_lp, ratio):
    """Decoupled PPO: pi/pi_prox (the ratio that is clipped) and pi_prox/pi_behave."""
    prox = ch.token(b.prox_logprobs)
    lr_iw = torch.sub(lp, prox, out=ws("iw.lr"))  # non-finite wherever logprobs or prox is invalid
    z_iw, v_iw, _, n_iw = ratio_into(acc, ws, "importance_weight", lr_iw)
    nonfinite(acc, "prox_logprobs", n_lp, n_iw)
    if ratio is not None:  # invalid where pi/pi_prox is (lr_iw * 0 is NaN there) or pi/pi_behave is (log 0)
        lr_bw = torch.sub(prox, ch.token(b.old_logprobs), out=ws("bw.lr"))
        lr_bw.add_(torch.mul(lr_iw, 0.0, out=ws("bw.t"))).add_(torch.log(ratio[1], out=ws("bw.t")))
        ratio_into(acc, ws, "behave_imp_weight", lr_bw)
    return z_iw, v_iw


def _ref_family(acc, ws: Scratch, ch: Chunk, b: TokenBatch, lp, n_lp) -> None:
    lr = torch.sub(ch.token(b.ref_logprobs), lp, out=ws("t0"))
    z = zero_filled(ws, "t2", lr)
    v = valid_of(ws, "t1", lr, z)
    n = v.sum()
    nonfinite(acc, "ref_logprobs", n_lp, n)
    e = torch.clamp(z, max=EXP_CLAMP, out=ws("e")).expm1_()
    kl_stats(acc, ch, ws, "kl_ref", z, e, v, n)


def _adv_family(acc, ws: Scratch, b: TokenBatch, ch: Chunk, gate, n_mask, clip):
    """Advantage statistics; with ``clip = (zero-filled log-ratio, its validity, its count)`` also the clip
    fractions (returns the clipped tokens as 0/1 floats)."""
    adv = field(ws, "t0", ch.token(b.advantages), gate)
    z, v, n = field_values(ws, "adv.valid", adv)
    values_into(acc, ws, "adv", adv, n, z, squares=True)
    nonfinite(acc, "advantages", n_mask, n)
    sign = torch.sign(z, out=ws("adv.sign"))
    acc.sum(keys.ADV.zero, n - torch.dot(sign, sign))  # invalid entries are 0 in z
    if clip is None:
        return None
    return clip_into(acc, ws, *clip, sign, v, b.eps_low, b.eps_high)


def _seq_clip_chunk(acc: ChunkStats, b: TokenBatch, ch: Chunk, s_lr, edges, lut) -> None:
    """GSPO: every valid token of a sequence is clipped by the sequence ratio (token advantage sign)."""
    m, gate = _mask(b, ch)
    lr = ch.token(b.logprobs) + gate - ch.token(b.old_logprobs)
    v = validate_(lr)
    adv, v_adv = gated(ch.token(b.advantages), gate)
    clip_lr = ch.seq_gather(s_lr).float().add_(lr * 0.0)  # NaN where the token (or its sequence) is invalid
    clipped = clip_stats(acc, clip_lr, adv, torch.dot(v, v_adv), b.eps_low, b.eps_high)
    if b.versions is not None:
        _, bucket = lag_buckets(ch.token(b.versions), b.current_version, gate, edges, lut)
        clip_by_lag(acc, bucket, clipped, len(edges))


def sequence_stats(p: Partial, lengths=None, truncated=None, rewards=None) -> None:
    """Per-sequence statistics into ``p``: lengths, truncated (no-EOS) share, scalar rewards (finite values only)."""
    given = [t for t in (lengths, truncated, rewards) if t is not None]
    if not given:
        return
    fields = {k: t for k, t in (("lengths", lengths), ("truncated", truncated), ("rewards", rewards)) if t is not None}
    for name, t in fields.items():  # shapes only: no device value is read
        if t.dim() != 1 or t.shape != given[0].shape:
            raise BatchError(f"{name} must be one value per sequence, 1-D and as long as the other per-sequence "
                             f"fields; got shape {tuple(t.shape)} (expected {(given[0].numel(),)})")
    acc = ChunkStats(given[0].numel(), given[0].device)
    _sequence_stats(acc, lengths, truncated, rewards)
    q = acc.partial()
    p.sum.update(q.sum)
    p.max.update(q.max)


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
