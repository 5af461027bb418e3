"""Fixed-size token chunks of a ``TokenBatch`` (the unit the probes work on) and the accumulator of their statistics.

Probing a micro-batch chunk by chunk bounds the temporaries to a few chunk-sized tensors (instead of a dozen
full-size ones) and keeps them cache-resident on CPU. Chunk boundaries come from shapes only (never from device
values), so iterating never synchronises. Padded ``[B, T]`` batches are cut into whole rows (at least one per
chunk); packed ``[N]`` batches into token ranges, with the sequence id of every token found from ``cu_seqlens`` on
the device.
"""

from __future__ import annotations

import torch

from . import xp
from .batch import TokenBatch
from .on_device import host_to_device
from .partial import Partial

F64 = torch.float64

CPU_CHUNK = 1 << 18  # 256K tokens: ~1 MiB per fp32 temporary, fits the last-level cache
GPU_CHUNK = 1 << 23  # large enough that kernel launches stay negligible, small enough to bound memory
MIN_CHUNK = 1 << 16


def chunk_size(b: TokenBatch, size: int | None = None) -> int:
    """Tokens per chunk. On CPU at most ~1/8 of the batch, so the chunk-sized temporaries stay around one per-token
    tensor, and at least 64K tokens so per-operation overhead stays small. On a GPU the whole batch up to
    ``GPU_CHUNK``: each chunk costs a fixed number of kernel launches whatever its size (hundreds eagerly; an
    8M-token batch took 23 ms in 1M-token chunks against 10 ms in one, H200), and the temporaries (a dozen 4- or
    8-byte values a token) are small beside the logits of the same tokens."""
    if size is not None:
        return max(1, int(size))
    if b.device.type != "cpu":
        return max(1, min(GPU_CHUNK, b.logprobs.numel()))
    return max(MIN_CHUNK, min(CPU_CHUNK, b.logprobs.numel() // 8))


class Chunk:
    """Tokens ``[start, stop)`` of the flattened batch: whole padded ``rows`` ``(r0, r1)``, or a range of a packed
    batch (``rows`` None), with per-sequence helpers for that range."""

    def __init__(self, b: TokenBatch, start: int, stop: int, rows: tuple[int, int] | None) -> None:
        self.b, self.start, self.stop, self.rows = b, start, stop, rows
        self._ids: torch.Tensor | None = None

    def seq_ids(self) -> torch.Tensor:
        """Sequence id of every token of the chunk (packed batches)."""
        if self._ids is None:
            b = self.b
            assert b.cu_seqlens is not None  # packed
            pos = torch.arange(self.start, self.stop, device=b.device)
            ends = host_to_device(b.cu_seqlens[1:], b.device)
            self._ids = torch.searchsorted(ends, pos, right=True).clamp_(max=b.num_seqs - 1)
        return self._ids

    def add_seq_sums(self, acc: torch.Tensor, sums: torch.Tensor) -> None:
        """Adds this chunk's per-sequence ``sums`` into ``acc``: ``[..., r]`` for its padded rows, ``[..., S]`` for a
        packed batch."""
        if self.rows is None:
            acc.add_(sums)
            return
        r0, r1 = self.rows
        (acc if (r0, r1) == (0, acc.shape[-1]) else acc[..., r0:r1]).add_(sums)

    def block(self, t: torch.Tensor | None, per_seq: bool | None = None) -> torch.Tensor | None:
        """This chunk of a per-token field as 2-D, in its own dtype: ``[r, T]`` for padded rows, ``[1, n]`` for a
        packed range; a per-sequence field as ``[r, 1]`` (to broadcast), or gathered per token ``[1, n]`` in a packed
        batch (``per_seq``: which one ``t`` is, if its shape may not tell)."""
        if t is None:
            return None
        b = self.b
        if per_seq is None:
            per_seq = t.dim() == 1 and tuple(t.shape) != tuple(b.logprobs.shape)
        if self.rows is None:
            return (t[self.seq_ids()] if per_seq else t[self.start : self.stop]).view(1, -1)
        r0, r1 = self.rows
        return t[r0:r1, None] if per_seq else t[r0:r1]


def chunks(b: TokenBatch, size: int | None = None):
    """Yields the chunks of a batch in order; every token belongs to exactly one chunk (an empty batch: one
    empty chunk, so every statistic still exists). A padded chunk is whole rows, at least one: a row longer than
    ``size`` is one chunk (its temporaries, a dozen values a token, stay small beside its logits)."""
    size = chunk_size(b, size)
    if b.logprobs.numel() == 0:
        yield Chunk(b, 0, 0, None if b.packed else (0, 0))
        return
    if b.packed:
        n = b.logprobs.numel()
        for s in range(0, n, size):
            yield Chunk(b, s, min(s + size, n), None)
        return
    B, T = b.logprobs.shape
    step = max(1, size // max(T, 1))
    for r0 in range(0, B, step):
        r1 = min(B, r0 + step)
        yield Chunk(b, r0 * T, r1 * T, (r0, r1))


class ChunkStats:
    """Chunk contributions of one micro-batch, as an ordered list of pieces per reduction (sum, max): each
    piece is a tensor (0-d or 1-D) and the statistic names its elements carry. The chunks of a batch run the same
    probes in the same order, so from the second chunk on (``next_chunk``) the i-th contribution is merged into the
    i-th piece in place: no lookup by name, and a one-chunk micro-batch (the common small case) only appends.
    A minimum is a maximum of the negated values, under its name prefixed ``-`` (as a ``Partial`` carries it).
    Float sums turn float64 when a second chunk arrives (fp32 counts are exact per chunk, not beyond 2^24 in
    total). ``seq(name)`` is a float64 ``[S]`` (or ``[rows, S]``) accumulator of per-sequence sums. The gradient and
    update probes name their figures with one too (one chunk)."""

    def __init__(self, num_seqs: int, device: torch.device, ops=None) -> None:
        # not ``ops=xp.TORCH``: the compiler of torch 2.4-2.6 cannot trace a default it has no source for
        self.num_seqs, self.device, self.ops = num_seqs, device, xp.TORCH if ops is None else ops
        self._pieces: dict[str, list] = {"sum": [], "max": []}
        self._cursor: dict[str, int] | None = None
        self._chunks = 0
        self._seq: dict = {}

    def next_chunk(self) -> None:
        """Called before each chunk's probes; after the last chunk, ``chunks_done``."""
        self._chunks += 1
        if self._chunks > 1:
            self._cursor = {"sum": 0, "max": 0}

    def chunks_done(self) -> None:
        self._cursor = None

    def _add(self, op: str, layout: tuple, t) -> None:
        pieces = self._pieces[op]
        if self._cursor is None:
            pieces.append([layout, t])
            return  # a later chunk (torch only: the numpy host path computes one chunk) merges in place
        i = self._cursor[op]
        self._cursor[op] = i + 1
        piece = pieces[i]
        cur = piece[1]
        if op == "sum":
            if cur.is_floating_point() and cur.dtype != F64:
                cur = piece[1] = cur.to(F64)
            piece[1] = cur.add_(t) if cur.dim() else cur + t  # a 0-d piece may be a view of a row vector
        else:
            piece[1] = torch.maximum(cur, t)

    def sum(self, name, t) -> None:
        """Adds ``t`` under ``name``, or, for a row vector, under ``((name, 1), ...)``: one name per element
        (``row_layout``)."""
        self._add("sum", name if isinstance(name, tuple) else ((name, self.ops.size(t)),), t)

    def max(self, name, t) -> None:
        self._add("max", name if isinstance(name, tuple) else ((name, 1),), t)

    def min(self, name, t) -> None:
        layout = name if isinstance(name, tuple) else ((name, 1),)
        self._add("max", tuple(("-" + n, k) for n, k in layout), -t)

    def pop_sum(self, name: str) -> torch.Tensor:
        """Removes and returns the summed vector ``name`` (a working total that is not itself a statistic)."""
        pieces = self._pieces["sum"]
        for i, (layout, t) in enumerate(pieces):
            if layout[0][0] == name:
                del pieces[i]
                return t
        raise KeyError(name)

    def hist(self, layout, counts: torch.Tensor, zero_cells, n_invalid) -> None:
        """Cell counts of zero-filled values: each histogram's ``n_invalid`` zero fills are taken out of its zero
        cell. ``layout`` is a name, or ``((name, cells), ...)`` for histograms back to back, with ``zero_cells``
        then the index of each one's zero cell (an int64 tensor)."""
        ops = self.ops
        if isinstance(layout, str):
            counts[zero_cells : zero_cells + 1] -= ops.cast(n_invalid, counts.dtype)
            layout = ((layout, ops.size(counts)),)
        else:
            ops.add_at(counts, zero_cells, -ops.cast(n_invalid, counts.dtype))
        self._add("sum", layout, counts)

    def total(self, name: str):
        """The sum so far of the scalar statistic ``name`` (0-d)."""
        return next(t for layout, t in self._pieces["sum"] if layout[0][0] == name).reshape(())

    def seq(self, name: str, rows: int | None = None):
        if name not in self._seq:
            shape = (self.num_seqs,) if rows is None else (rows, self.num_seqs)
            self._seq[name] = self.ops.zeros(shape, self.ops.f64, self.device)
        return self._seq[name]

    def partial(self) -> Partial:
        """One packed ``Partial``: every piece in one float64 vector per reduction (sum, max), whose views are the
        named entries. Pieces are grouped by dtype, vectors first (torch concatenates each group at once, and stacks
        the 0-d pieces, because on a small micro-batch a kernel per statistic would cost more than the statistics);
        numpy joins them the same way, so both layouts agree."""
        (s_lay, s), (m_lay, m) = (self._joined(self._pieces[op]) for op in ("sum", "max"))
        return Partial((s_lay, m_lay), s, m)

    def _joined(self, pieces: list) -> tuple[tuple, torch.Tensor]:
        groups: dict = {}
        for vector_pass in (True, False):  # vectors, then 0-d pieces
            for layout, t in pieces:
                if bool(t.ndim) is vector_pass:
                    groups.setdefault(t.dtype, []).append((layout, t))
        layout = tuple(e for group in groups.values() for lay, _ in group for e in lay)
        ops, vectors = self.ops, []
        for group in groups.values():  # its vectors, then its 0-d pieces stacked; cast once per group
            parts = [t for _, t in group if t.ndim]
            scalars = [t for _, t in group if not t.ndim]
            parts += [ops.stack(scalars)] if scalars else []
            vectors.append(ops.cast(ops.cat(parts) if len(parts) > 1 else ops.copy(parts[0]), ops.f64))
        if not vectors:
            return (), torch.zeros(0, dtype=F64, device=self.device)
        return layout, ops.to_torch(ops.cat(vectors) if len(vectors) > 1 else vectors[0])


def row_layout(names) -> tuple:
    """``((name, 1), ...)``: the layout of a row vector holding one statistic per element."""
    return tuple((n, 1) for n in names)
