"""The token-batch contract every adapter fills.

Per-token tensors are either padded ``[B, T]`` (with ``mask``) or packed ``[N]`` (with ``cu_seqlens`` of shape
``[S + 1]``). Per-sequence tensors are ``[B]`` (padded) or ``[S]`` (packed). Validation here is host-side only
(shapes, dtypes) so building a batch never synchronises with the device; the empty-mask check is counted on the
device and raised at the step's single transfer (see ``EmptyMaskError``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from .constants import DEFAULT_CLIP_EPS

TOKEN_FIELDS = ("logprobs", "old_logprobs", "prox_logprobs", "ref_logprobs", "entropy")
SEQUENCE_FIELDS = ("rewards", "lengths", "truncated")


class BatchError(InputError):
    """A token batch that does not satisfy the contract (names the field, shapes and dtypes)."""


class EmptyMaskError(BatchError):
    """A micro-batch whose loss/action mask selects no token: a bug upstream, not 'no data'."""


@dataclass
class TokenBatch:
    """One micro-batch of token-level tensors.

    Required: ``logprobs`` (log pi_theta of the taken tokens, current parameters) and ``mask`` (bool or integer
    0/1: which tokens reach the loss). Optional per token (same shape as ``logprobs``): ``old_logprobs`` (the
    behaviour/rollout policy that sampled the tokens), ``prox_logprobs`` (decoupled PPO proximal policy),
    ``ref_logprobs`` (reference policy), ``entropy`` (per-token entropy of pi_theta, nats), ``advantages``
    (per token, or per sequence and broadcast), ``versions`` (policy version that produced each token or
    sequence; needs ``current_version``). Optional per sequence: ``rewards``, ``lengths``, ``truncated``
    (no-EOS flag); group statistics come from ``SampleBatch.group_ids``. ``eps_low``/``eps_high``: the clip range
    (``clipped_loss=False`` when the loss clips nothing, or not at these edges: no clip metrics then).
    ``importance_sampling_level``: ``"token"`` or ``"sequence"`` (GSPO clips the sequence ratio).
    """

    logprobs: torch.Tensor
    mask: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    prox_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    current_version: int | None = None
    rewards: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    eps_low: float = DEFAULT_CLIP_EPS
    eps_high: float = DEFAULT_CLIP_EPS
    clipped_loss: bool = True  # False: the loss has no PPO clip range (TRL sapo/vespo/cispo): no clip metrics
    importance_sampling_level: str = "token"
    allow_empty_mask: bool = False  # e.g. TRL's mask_truncated_completions can legitimately zero a micro-batch

    def __post_init__(self) -> None:
        lp = self._tensor("logprobs", self.logprobs)
        if self.cu_seqlens is not None:
            if lp.dim() != 1:
                raise BatchError(f"packed batch: logprobs must be [N] with cu_seqlens, got shape {tuple(lp.shape)}")
            if self.cu_seqlens.dim() != 1 or self.cu_seqlens.numel() < 2:
                raise BatchError(f"cu_seqlens must be [S + 1] with S >= 1, got shape {tuple(self.cu_seqlens.shape)}")
            if self.mask is None:
                self.mask = torch.ones_like(lp, dtype=torch.bool)
        elif lp.dim() != 2:
            raise BatchError(
                "logprobs must be padded [B, T] (with mask) or packed [N] (with cu_seqlens), "
                f"got shape {tuple(lp.shape)}"
            )
        elif self.mask is None:
            raise BatchError("mask is required for a padded [B, T] batch (which tokens reach the loss)")
        self._check_mask()
        for name in TOKEN_FIELDS[1:]:
            self._check_token(name)
        self._check_token_or_seq("advantages")
        self._check_token_or_seq("versions")
        if self.versions is not None and self.current_version is None:
            raise BatchError("versions given without current_version: lag = current_version - versions needs both")
        for name in SEQUENCE_FIELDS:
            self._check_seq(name)
        if self.importance_sampling_level not in ("token", "sequence"):
            raise BatchError(
                f"importance_sampling_level must be 'token' or 'sequence', got {self.importance_sampling_level!r}"
            )
        if not (0.0 <= self.eps_low < 1.0 and self.eps_high >= 0.0):
            raise BatchError(
                f"clip range needs 0 <= eps_low < 1 and eps_high >= 0, got ({self.eps_low}, {self.eps_high})"
            )

    # -- shape helpers -------------------------------------------------------------------------------------------
    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1 if self.cu_seqlens is not None else self.logprobs.shape[0]

    @property
    def device(self) -> torch.device:
        return self.logprobs.device

    def _tensor(self, name: str, value) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise BatchError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        return value

    def _check_mask(self) -> None:
        m = self._tensor("mask", self.mask)
        if m.dtype.is_floating_point or m.dtype.is_complex:
            raise BatchError(
                f"mask must be bool or integer 0/1, got dtype {m.dtype}; for weights pass mask=weights > 0"
            )
        if tuple(m.shape) != tuple(self.logprobs.shape):
            raise BatchError(f"mask shape {tuple(m.shape)} does not match logprobs shape {tuple(self.logprobs.shape)}")
        if m.device != self.device:
            raise BatchError(f"mask is on {m.device} but logprobs is on {self.device}")

    def _check_token(self, name: str) -> None:
        t = getattr(self, name)
        if t is None:
            return
        t = self._tensor(name, t)
        if tuple(t.shape) != tuple(self.logprobs.shape):
            raise BatchError(
                f"{name} shape {tuple(t.shape)} does not match logprobs shape {tuple(self.logprobs.shape)}"
            )
        if not t.dtype.is_floating_point:
            raise BatchError(f"{name} must be a floating tensor, got dtype {t.dtype}")

    def _check_token_or_seq(self, name: str) -> None:
        t = getattr(self, name)
        if t is None:
            return
        t = self._tensor(name, t)
        if t.dim() == 2 and t.shape[1] == 1 and not self.packed:
            t = t[:, 0]
            setattr(self, name, t)
        allowed = (tuple(self.logprobs.shape), (self.num_seqs,))
        if tuple(t.shape) not in allowed:
            raise BatchError(
                f"{name} shape {tuple(t.shape)} matches neither per-token {allowed[0]} nor per-sequence {allowed[1]}"
            )

    def _check_seq(self, name: str) -> None:
        t = getattr(self, name)
        if t is None:
            return
        t = self._tensor(name, t)
        if tuple(t.shape) != (self.num_seqs,):
            raise BatchError(f"{name} must be per-sequence shape {(self.num_seqs,)}, got {tuple(t.shape)}")
