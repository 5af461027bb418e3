"""``History.last``: the window the spike rules read is exactly the last values pushed, across the ring's wrap
and after a state round trip, and a caller cannot change the history through it."""

import math

import numpy as np
import pytest

from rl_guard.control.rules import History


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
