"""One micro-batch -> one ``Partial``: wires the pure probes to the fields a ``TokenBatch`` carries."""

from __future__ import annotations

import torch

from .batch import TokenBatch
from .probes import (
    DEFAULT_LAG_EDGES,
    EXP_CLAMP,
    Partial,
    clip_stats,
    entropy_stats,
    kl_stats,
    lag_stats,
    nonfinite,
    ratio_stats,
    seq_log_ratio,
    value_stats,
)


@torch.no_grad()
def probe_batch(b: TokenBatch, lag_edges=DEFAULT_LAG_EDGES) -> Partial:
    """All token-level sufficient statistics of one micro-batch (device tensors, no host sync)."""
    p = Partial()
    mask = b.mask.reshape(-1).bool()
    p.add_sum("tokens.count", mask.sum())
    if not b.allow_empty_mask:
        p.add_sum("tokens.empty_microbatches", (~mask.any()).to(torch.int64))
    p.add_sum("tokens.microbatches", torch.ones((), device=b.device))

    logp = b.flat(b.logprobs)
    ok_logp = nonfinite(p, "logprobs", logp, mask) & mask
    flat = {name: b.flat(getattr(b, name)) for name in ("old_logprobs", "prox_logprobs", "ref_logprobs") if getattr(b, name) is not None}
    ok = {name: nonfinite(p, name, x, mask) & ok_logp for name, x in flat.items()}

    log_ratio = ratio_valid = clip_lr = clip_valid = k3 = None
    if "old_logprobs" in flat:
        log_ratio, ratio_valid = logp - flat["old_logprobs"], ok["old_logprobs"]
        ratio_stats(p, "ratio", log_ratio, ratio_valid, hist=b.versions is None)
        kl_stats(p, b, "kl_old", log_ratio, ratio_valid)
        s_lr, s_ok = seq_log_ratio(b, log_ratio, ratio_valid)
        ratio_stats(p, "seq_ratio", s_lr, s_ok)
        clip_lr, clip_valid = log_ratio, ratio_valid
        if b.importance_sampling_level == "sequence":
            clip_lr = b.seq_to_token(s_lr)
        k3 = torch.expm1(log_ratio.clamp(max=EXP_CLAMP)) - log_ratio
    if "prox_logprobs" in flat:
        prox = flat["prox_logprobs"]
        iw_lr, iw_ok = logp - prox, ok["prox_logprobs"]
        ratio_stats(p, "importance_weight", iw_lr, iw_ok)
        clip_lr, clip_valid = iw_lr, iw_ok
        if "old_logprobs" in flat:
            ratio_stats(p, "behave_imp_weight", prox - flat["old_logprobs"], iw_ok & ok["old_logprobs"])
    if "ref_logprobs" in flat:
        kl_stats(p, b, "kl_ref", flat["ref_logprobs"] - logp, ok["ref_logprobs"])

    if b.entropy is not None:
        ent = b.flat(b.entropy)
        entropy_stats(p, ent, nonfinite(p, "entropy", ent, mask) & mask)

    clipped = torch.zeros_like(mask)
    if b.advantages is not None:
        adv = b.flat(b.advantages)
        adv_ok = nonfinite(p, "advantages", adv, mask) & mask
        value_stats(p, "adv", adv, adv_ok, squares=True)
        p.add_sum("adv.zero", (adv_ok & (adv == 0)).sum())
        if clip_lr is not None:
            clipped = clip_stats(p, clip_lr, adv, clip_valid & adv_ok, b.eps_low, b.eps_high)

    if b.versions is not None:
        lag = b.current_version - b.flat(b.versions).round().long()
        lag_stats(p, lag, mask, lag_edges, log_ratio, ratio_valid, clipped, k3)

    _sequence_stats(p, b, mask)
    return p


def _sequence_stats(p: Partial, b: TokenBatch, mask: torch.Tensor) -> None:
    lengths = b.lengths if b.lengths is not None else b.seq_sum(mask.float())
    sequence_stats(p, lengths=lengths, truncated=b.truncated, rewards=b.rewards)


def sequence_stats(p: Partial, lengths=None, truncated=None, rewards=None) -> None:
    """Per-sequence statistics: lengths, truncated (no-EOS) share, scalar rewards (finite values only)."""
    if lengths is not None:
        value_stats(p, "length", lengths.float(), torch.ones_like(lengths, dtype=torch.bool))
    if truncated is not None:
        p.add_sum("length.truncated", truncated.bool().sum())
    if rewards is not None:
        rewards = rewards.float()
        all_seqs = torch.ones_like(rewards, dtype=torch.bool)
        value_stats(p, "reward", rewards, nonfinite(p, "rewards", rewards, all_seqs), squares=True)
