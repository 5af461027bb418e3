"""Fixed-size token chunks of a ``TokenBatch`` (the unit the probes work on) and the accumulator of their statistics.

Probing a micro-batch chunk by chunk bounds the temporaries to a few chunk-sized tensors (instead of a dozen
full-size ones) and keeps them cache-resident on CPU. Chunk boundaries come from shapes only (never from device
values), so iterating never synchronises. Padded ``[B, T]`` batches are cut into whole rows (or, for rows longer
than a chunk, column blocks of one row); packed ``[N]`` batches into token ranges, with the sequence id of every
token found from ``cu_seqlens`` on the device.
"""

from __future__ import annotations

import torch

from .batch import TokenBatch
from .partial import Partial

F64 = torch.float64

CPU_CHUNK = 1 << 18  # 256K tokens: ~1 MiB per fp32 temporary, fits the last-level cache
GPU_CHUNK = 1 << 23  # large enough that kernel launches stay negligible, small enough to bound memory
MIN_CHUNK = 1 << 16


def chunk_size(b: TokenBatch, size: int | None = None) -> int:
    """Tokens per chunk: at most ~1/8 of the batch, so the dozen chunk-sized temporaries stay around one per-token
    tensor, and at least 64K tokens so per-operation overhead stays small."""
    if size is not None:
        return max(1, int(size))
    cap = CPU_CHUNK if b.device.type == "cpu" else GPU_CHUNK
    return max(MIN_CHUNK, min(cap, b.logprobs.numel() // 8))


class Chunk:
    """Tokens ``[start, stop)`` of the flattened batch, with per-sequence helpers for that range."""

    def __init__(self, b: TokenBatch, start: int, stop: int, rows: tuple[int, int] | None) -> None:
        self.b, self.start, self.stop, self.rows = b, start, stop, rows
        self.n = stop - start
        self._ids = None

    def token(self, t: torch.Tensor) -> torch.Tensor:
        """This chunk of a per-token tensor (or of a per-sequence one, broadcast) as flat fp32."""
        b = self.b
        if tuple(t.shape) == (b.num_seqs,) and t.shape != b.logprobs.shape:
            return self.seq_gather(t).float()
        return self._slice(t).float()

    def raw(self, t: torch.Tensor) -> torch.Tensor:
        """This chunk of a per-token tensor in its own dtype."""
        return self._slice(t)

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        if self.b.packed:
            return t[self.start : self.stop]
        T = self.b.logprobs.shape[1]
        if self.rows is not None:
            return t[self.rows[0] : self.rows[1]].reshape(-1)
        row = self.start // T
        return t[row, self.start - row * T : self.stop - row * T]

    def seq_ids(self) -> torch.Tensor:
        """Sequence id of every token of the chunk (packed batches)."""
        if self._ids is None:
            b = self.b
            pos = torch.arange(self.start, self.stop, device=b.device)
            ends = b.cu_seqlens[1:].to(b.device, non_blocking=True)
            self._ids = torch.searchsorted(ends, pos, right=True).clamp_(max=b.num_seqs - 1)
        return self._ids

    def seq_gather(self, per_seq: torch.Tensor) -> torch.Tensor:
        """Per-sequence ``[S]`` values broadcast to the chunk's tokens ``[n]``."""
        if self.b.packed:
            return per_seq[self.seq_ids()]
        T = self.b.logprobs.shape[1]
        if self.rows is not None:
            r0, r1 = self.rows
            return per_seq[r0:r1, None].expand(r1 - r0, T).reshape(-1)
        row = self.start // T
        return per_seq[row : row + 1].expand(self.n)

    def seq_add(self, acc: torch.Tensor, values: torch.Tensor) -> None:
        """Adds the per-sequence sums of the chunk's token ``values`` into ``acc`` (``[S]``, float64)."""
        if self.b.packed:
            acc.index_add_(0, self.seq_ids(), values.to(acc.dtype))
        elif self.rows is not None:
            r0, r1 = self.rows
            rows = values.view(r1 - r0, self.b.logprobs.shape[1])
            acc[r0:r1] += rows.sum(1, dtype=torch.int32) if rows.dtype == torch.bool else rows.sum(1)
        else:
            row = self.start // self.b.logprobs.shape[1]
            acc[row : row + 1] += values.count_nonzero() if values.dtype == torch.bool else values.sum()


def chunks(b: TokenBatch, size: int | None = None):
    """Yields the chunks of a batch in order; every token belongs to exactly one chunk (an empty batch: one
    empty chunk, so every statistic still exists)."""
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
    if T <= size:
        step = max(1, size // max(T, 1))
        for r0 in range(0, B, step):
            r1 = min(B, r0 + step)
            yield Chunk(b, r0 * T, r1 * T, (r0, r1))
        return
    for row in range(B):
        for c0 in range(0, T, size):
            yield Chunk(b, row * T + c0, row * T + min(T, c0 + size), None)


class ChunkStats:
    """Chunk contributions of one micro-batch. Scalars are kept in lists and reduced once at the end (one stack
    per statistic instead of one add per chunk); vectors (histograms) are added in place (the caller hands over a
    fresh tensor). ``seq(name)`` is a float64 ``[S]`` accumulator of per-sequence sums."""

    def __init__(self, num_seqs: int, device: torch.device) -> None:
        self.num_seqs, self.device = num_seqs, device
        self._sum: dict = {}
        self._max: dict = {}
        self._min: dict = {}
        self._seq: dict = {}
        self._zero_cell: dict = {}

    def sum(self, name: str, t: torch.Tensor) -> None:
        if t.dim() == 0:
            self._sum.setdefault(name, []).append(t)
        elif name in self._sum:
            self._sum[name].add_(t)
        else:
            self._sum[name] = t

    def pop_sum(self, name: str) -> torch.Tensor:
        """Removes and returns the summed vector ``name`` (a working total that is not itself a statistic)."""
        return self._sum.pop(name)

    def max(self, name: str, t: torch.Tensor) -> None:
        self._max.setdefault(name, []).append(t)

    def min(self, name: str, t: torch.Tensor) -> None:
        self._min.setdefault(name, []).append(t)

    def hist(self, name: str, counts: torch.Tensor, zero_cell: int, n_invalid) -> None:
        """Cell counts of a zero-filled chunk; its ``n_invalid`` zero fills are taken out of ``zero_cell``."""
        self.sum(name, counts)
        self.sum(f"{name}.fill", n_invalid)
        self._zero_cell[name] = zero_cell

    def seq(self, name: str) -> torch.Tensor:
        if name not in self._seq:
            self._seq[name] = torch.zeros(self.num_seqs, dtype=F64, device=self.device)
        return self._seq[name]

    def partial(self):
        """One ``Partial`` (float64 1-D tensors) of everything added.

        Scalars are reduced in groups (one stack per dtype and chunk count, one reduction and one cast) and handed
        over as 1-element views of the group's vector, because on a small micro-batch a few kernels per statistic
        would cost more than the statistics."""
        vectors = {k: v.to(F64) for k, v in self._sum.items() if not isinstance(v, list)}
        scalars = _grouped({k: v for k, v in self._sum.items() if isinstance(v, list)}, "sum")
        for name, cell in self._zero_cell.items():
            vectors[name][cell : cell + 1] -= scalars.pop(f"{name}.fill")
        p = Partial()
        p.sum.update(vectors)
        p.sum.update(scalars)
        p.max.update(_grouped(self._max, "amax"))
        p.max.update({"-" + k: v for k, v in _grouped(self._min, "amin", negate=True).items()})
        return p


def _grouped(lists: dict, op: str, negate: bool = False) -> dict:
    """``{name: [0-d tensors]}`` -> ``{name: float64 1-element view}`` reduced with ``op`` over each list (and
    negated: minima travel as negated maxima)."""
    groups: dict = {}
    for name, values in lists.items():
        groups.setdefault((values[0].dtype, len(values)), []).append(name)
    out = {}
    for (dtype, chunks), names in groups.items():
        if chunks == 1:  # the common case (a micro-batch within one chunk): nothing to reduce
            reduced = torch.stack([lists[n][0] for n in names]).to(F64)
        else:
            table = torch.stack([torch.stack(lists[n]) for n in names])  # [names, chunks]
            reduced = table.sum(1, dtype=F64) if op == "sum" else getattr(table, op)(1).to(F64)
        if negate:
            reduced = -reduced
        out.update(zip(names, reduced.split(1)))
    return out
