"""One micro-batch -> one ``Partial``: wires the pure probes to the fields a ``TokenBatch`` carries.

The batch is walked in fixed-size chunks (``chunks.py``); each chunk reads every input tensor once and runs all
token probes on it, so extra memory is a few chunk-sized temporaries whatever the batch size. Per-sequence sums
are accumulated in ``[S]`` vectors and reduced after the last chunk. GSPO's sequence-level clipping needs the
whole sequence's log-ratio first, so it takes a second, lighter pass.
"""

from __future__ import annotations

import torch

from .batch import TokenBatch
from .chunks import Chunk, chunks
from .probes import (
    DEFAULT_LAG_EDGES,
    ChunkStats,
    Partial,
    clip_by_lag,
    clip_stats,
    count,
    entropy_stats,
    finite,
    kl_finish,
    kl_stats,
    lag_buckets,
    lag_lut,
    lag_stats,
    log_ratio_terms,
    nonfinite,
    ratio_stats,
    seq_log_ratio,
    value_stats,
)


@torch.no_grad()
def probe_batch(b: TokenBatch, lag_edges=DEFAULT_LAG_EDGES, chunk_tokens: int | None = None) -> Partial:
    """All token-level sufficient statistics of one micro-batch (device tensors, no host sync)."""
    acc = ChunkStats(b.num_seqs, b.device)
    lut = lag_lut(lag_edges, b.device) if b.versions is not None else None
    seq_clip = b.importance_sampling_level == "sequence" and b.old_logprobs is not None and b.prox_logprobs is None
    for ch in chunks(b, chunk_tokens):
        _probe_chunk(acc, b, ch, lag_edges, lut, token_clip=not seq_clip)
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
        p.add_sum("tokens.empty_microbatches", p.sum["tokens.count"] == 0)
    p.add_sum("tokens.microbatches", torch.ones((), device=b.device))
    return p


def _mask(b: TokenBatch, ch: Chunk) -> torch.Tensor:
    m = ch.raw(b.mask)
    return m if m.dtype == torch.bool else m != 0


def _probe_chunk(acc: ChunkStats, b: TokenBatch, ch: Chunk, edges, lut, token_clip: bool) -> None:
    m = _mask(b, ch)
    n_mask = count(m)
    acc.sum("tokens.count", n_mask)
    lp = ch.token(b.logprobs)
    ok = nonfinite(acc, "logprobs", lp, m, n_mask)
    old = log_r = rv = k3 = clip_lr = clip_valid = None
    if b.old_logprobs is not None:
        old = ch.token(b.old_logprobs)
        nonfinite(acc, "old_logprobs", old, m, n_mask)
        log_r = lp - old
        rv = finite(log_r).logical_and_(m)  # finite difference <=> both inputs finite
        lr, e = log_ratio_terms(log_r, rv)
        ratio_stats(acc, "ratio", log_r, rv, lr, e, hist=b.versions is None)
        k3 = kl_stats(acc, ch, "kl_old", lr, e, rv)
        clip_lr, clip_valid = lr, rv
    if b.prox_logprobs is not None:
        prox = ch.token(b.prox_logprobs)
        nonfinite(acc, "prox_logprobs", prox, m, n_mask)
        log_iw = lp - prox
        iv = finite(log_iw).logical_and_(m)
        lr_iw, e_iw = log_ratio_terms(log_iw, iv)
        ratio_stats(acc, "importance_weight", log_iw, iv, lr_iw, e_iw)
        clip_lr, clip_valid = lr_iw, iv
        if old is not None:
            log_bw = prox - old
            ratio_stats(acc, "behave_imp_weight", log_bw, finite(log_bw).logical_and_(ok))
    if b.ref_logprobs is not None:
        ref = ch.token(b.ref_logprobs)
        nonfinite(acc, "ref_logprobs", ref, m, n_mask)
        log_rr = ref - lp
        rr = finite(log_rr).logical_and_(m)
        kl_stats(acc, ch, "kl_ref", *log_ratio_terms(log_rr, rr), rr)
    if b.entropy is not None:
        ent = ch.token(b.entropy)
        entropy_stats(acc, ent, nonfinite(acc, "entropy", ent, m, n_mask))
    clipped = None
    if b.advantages is not None:
        adv = ch.token(b.advantages)
        av = nonfinite(acc, "advantages", adv, m, n_mask)
        advm, n_adv = value_stats(acc, "adv", adv, av, squares=True)
        acc.sum("adv.zero", (advm == 0).sum() - (ch.n - n_adv))  # invalid entries are 0 in advm
        if clip_lr is not None and token_clip:
            clipped = clip_stats(acc, clip_lr, clip_valid & av, advm, b.eps_low, b.eps_high)
    if b.versions is not None:
        lag, bucket = lag_buckets(ch.token(b.versions), b.current_version, edges, lut)
        lag_stats(acc, lag, bucket, m, len(edges), log_r, rv, k3)
        if clipped is not None:
            clip_by_lag(acc, bucket, clipped, len(edges))
    if b.lengths is None:
        ch.seq_add(acc.seq("length"), m)


def _seq_clip_chunk(acc: ChunkStats, b: TokenBatch, ch: Chunk, s_lr, edges, lut) -> None:
    """GSPO: every valid token of a sequence is clipped by the sequence ratio (token advantage sign)."""
    m = _mask(b, ch)
    rv = finite(ch.token(b.logprobs) - ch.token(b.old_logprobs)).logical_and_(m)
    adv = ch.token(b.advantages)
    av = finite(adv).logical_and_(m)
    clip_lr = torch.where(rv, ch.seq_gather(s_lr).float(), 0.0)
    clipped = clip_stats(acc, clip_lr, rv & av, torch.where(av, adv, 0.0), b.eps_low, b.eps_high)
    if b.versions is not None:
        _, bucket = lag_buckets(ch.token(b.versions), b.current_version, edges, lut)
        clip_by_lag(acc, bucket, clipped, len(edges))


def sequence_stats(p: Partial, lengths=None, truncated=None, rewards=None) -> None:
    """Per-sequence statistics into ``p``: lengths, truncated (no-EOS) share, scalar rewards (finite values only)."""
    given = [t for t in (lengths, truncated, rewards) if t is not None]
    if not given:
        return
    acc = ChunkStats(given[0].numel(), given[0].device)
    _sequence_stats(acc, lengths, truncated, rewards)
    q = acc.partial()
    p.sum.update(q.sum)
    p.max.update(q.max)


def _sequence_stats(acc: ChunkStats, lengths, truncated, rewards) -> None:
    if lengths is not None:
        lengths = lengths.reshape(-1).to(torch.float64)
        value_stats(acc, "length", lengths, torch.ones_like(lengths, dtype=torch.bool))
    if truncated is not None:
        acc.sum("length.truncated", truncated.bool().sum())
    if rewards is not None:
        rewards = rewards.reshape(-1).to(torch.float64)
        all_seqs = torch.ones_like(rewards, dtype=torch.bool)
        value_stats(acc, "reward", rewards, nonfinite(acc, "rewards", rewards, all_seqs, rewards.numel()), squares=True)
