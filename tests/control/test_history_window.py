"""``History.last`` and ``History.sorted_recent``: the window the spike rules read is exactly the last values
pushed, across the ring's wrap and after a state round trip, and a caller cannot change the history through it;
the robust spike statistics equal numpy's."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_guard.control.rules import History, _center_scale


def test_last_is_the_tail_of_the_pushed_values_across_wraps_and_resume():
    h = History(maxlen=5, early=3)
    pushed = []
    for i in range(13):
        v = float(i) if i != 7 else math.nan  # non-finite values never enter the history
        h.push({"m": v})
        pushed += [v] if math.isfinite(v) else []
        for n in (1, 3, 5, 9):
            assert h.last("m", n).tolist() == pushed[-5:][-n:] == h.values("m")[-n:]
    restored = History(maxlen=5, early=3)
    restored.load_state_dict(h.state_dict())
    assert restored.last("m", 4).tolist() == pushed[-4:]
    restored.push({"m": 99.0})
    assert restored.last("m", 5).tolist() == pushed[-4:] + [99.0]
    assert h.last("absent", 4).size == 0


def test_window_is_read_only():
    h = History(maxlen=4)
    h.push({"m": 1.0})
    with pytest.raises(ValueError):
        h.last("m", 1)[0] = 2.0
    assert isinstance(h.last("m", 1), np.ndarray)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(
        st.one_of(st.integers(-3, 3).map(float), st.floats(-1e6, 1e6), st.just(math.inf)), min_size=1, max_size=60
    ),
    n=st.integers(1, 12),
    resume_at=st.integers(0, 60),
)
def test_sorted_window_is_the_sorted_tail_through_slides_ties_and_resume(values, n, resume_at):
    """The sorted windows kept on push equal sorting the window again, for windows read from the start and read
    late, with repeated values, skipped non-finite values and a state round trip in between."""
    h, late = History(maxlen=8), History(maxlen=8)
    pushed = []
    for i, v in enumerate(values):
        if i == resume_at:
            h2 = History(maxlen=8)
            h2.load_state_dict(h.state_dict())
            h = h2
        h.push({"m": v})
        late.push({"m": v})
        pushed += [v] if math.isfinite(v) else []
        tail = pushed[-min(n, 8) :]
        assert h.sorted_recent("m", n) == sorted(tail)
        assert h.sorted_recent("m", 3) == sorted(pushed[-3:])
    assert late.sorted_recent("m", n) == sorted(pushed[-min(n, 8) :])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(-4, 4).map(float), st.floats(-1e9, 1e9)), min_size=1, max_size=80))
def test_robust_center_and_scale_equal_numpy_float64(values):
    """Median and MAD from the sorted window: numpy's median of the values and of their deviations, bit for bit
    (the fallback for a zero MAD as well)."""
    center, scale, label = _center_scale("mad", values, len(values))
    x = np.asarray(values, dtype=np.float64)
    ref_center = float(np.median(x))
    dev = np.abs(x - ref_center)
    mad = float(np.median(dev))
    assert center == ref_center
    assert scale == (1.4826 * mad if mad > 0 else 1.2533 * float(np.mean(dev)))
    assert label == "robust z"
