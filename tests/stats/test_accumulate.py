"""StepAccumulator: micro-batches of one layout merge by sum and max, and the Partials it was given stay as they were
(it keeps the first one's vectors without copying them, so it must never write into them)."""

import numpy as np
import torch

from rl_guard.stats.accumulate import StepAccumulator
from rl_guard.stats.partial import Partial

LAYOUT = ((("a.count", 1), ("a.hist", 3)), (("a.max", 1), ("-a.min", 1)))


def _packed(values, maxes) -> Partial:
    return Partial(LAYOUT, torch.tensor(values, dtype=torch.float64), torch.tensor(maxes, dtype=torch.float64))


def test_micro_batches_merge_and_the_given_partials_are_never_written():
    first, second, third = _packed([1, 2, 0, 5], [3, -1]), _packed([4, 0, 1, 1], [7, -2]), _packed([1, 1, 1, 1], [0, 5])
    kept = [p.sums.clone() for p in (first, second, third)] + [p.maxes.clone() for p in (first, second, third)]
    acc = StepAccumulator()
    for p in (first, second, third):
        acc.add(p)
    out = acc.finish()
    assert out["a.count"].tolist() == [6.0] and out["a.hist"].tolist() == [3.0, 2.0, 7.0]
    assert out["a.max"].tolist() == [7.0] and out["a.min"].tolist() == [-5.0]  # minima travel negated
    now = [p.sums for p in (first, second, third)] + [p.maxes for p in (first, second, third)]
    assert all(torch.equal(a, b) for a, b in zip(kept, now))


def test_one_partial_a_step_is_read_as_given_and_the_next_step_starts_afresh():
    acc = StepAccumulator()
    p = _packed([2, 1, 1, 0], [1.5, 0.5])
    acc.add(p)
    first = acc.finish()
    acc.add(_packed([1, 0, 0, 1], [0.25, -0.25]))
    second = acc.finish()
    assert np.array_equal(first["a.hist"], [1.0, 1.0, 0.0]) and first["a.min"].tolist() == [-0.5]
    assert np.array_equal(second["a.hist"], [0.0, 0.0, 1.0]) and second["a.max"].tolist() == [0.25]
    assert p.sums.tolist() == [2.0, 1.0, 1.0, 0.0]  # still the caller's values after both steps
