"""Chunk boundaries: padded chunks are whole rows (a row longer than the chunk size is a chunk of its own), packed
chunks are token ranges, and every token belongs to exactly one chunk."""

import pytest
import torch

from rl_guard.stats.batch import TokenBatch
from rl_guard.stats.chunks import chunks


@pytest.mark.parametrize(("B", "T", "size"), [(6, 40, 80), (6, 40, 17), (5, 7, 1000), (1, 100, 10), (7, 3, 7)])
def test_padded_chunks_are_whole_rows_covering_every_row_once(B, T, size):
    b = TokenBatch(logprobs=torch.zeros(B, T), mask=torch.ones(B, T, dtype=torch.bool))
    got = list(chunks(b, size))
    rows = [c.rows for c in got]
    assert rows[0][0] == 0 and rows[-1][1] == B
    assert all(a[1] == c[0] for a, c in zip(rows, rows[1:]))  # consecutive, no gap, no overlap
    assert all((r1 - r0) * T <= max(size, T) for r0, r1 in rows)  # at most a chunk, or one row
    assert all((c.start, c.stop) == (c.rows[0] * T, c.rows[1] * T) for c in got)
    block = got[-1].block(torch.arange(B * T).view(B, T))
    assert block.shape == (rows[-1][1] - rows[-1][0], T) and int(block[0, 0]) == rows[-1][0] * T


def test_packed_chunks_are_token_ranges_with_their_sequence_ids():
    cu = torch.tensor([0, 3, 10, 11])
    b = TokenBatch(logprobs=torch.zeros(11), cu_seqlens=cu)
    got = list(chunks(b, 4))
    assert [(c.start, c.stop) for c in got] == [(0, 4), (4, 8), (8, 11)]
    assert torch.cat([c.seq_ids() for c in got]).tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2]
    per_seq = torch.tensor([10.0, 20.0, 30.0])
    assert got[2].block(per_seq, per_seq=True).tolist() == [[20.0, 20.0, 30.0]]
