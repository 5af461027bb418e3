"""ConsoleSink: captured output in rich and plain-text modes."""

import io

import pytest

from rl_guard.sinks import ConsoleSink
from rl_guard.sinks.console import health_rows

VALUES = {
    "rl_guard/ratio/p50": 1.0004,
    "rl_guard/ratio/p99": 1.3127,
    "rl_guard/ratio/max": 7.25,
    "rl_guard/kl_ref/k3_mean": 0.0312,
    "rl_guard/entropy/mean": 0.8123,
    "rl_guard/clip/region_frac": 0.125,
    "rl_guard/grad/norm": float("nan"),
    "rl_guard/adv/mean": 0.5,  # not a key metric: must not be shown
}
MESSAGE = "[rule kl_spike] rl_guard/kl_ref/k3_mean = 0.31 > 0.2 at step 812 (rank 0) -> checkpoint_and_halt"


def test_health_rows_only_present_metrics():
    rows = dict(health_rows(VALUES))
    assert list(rows) == ["ratio", "kl k3", "entropy", "clip", "grad"]  # no lag row: lag absent
    assert rows["ratio"] == "p50=1  p99=1.313  max=7.25"
    assert rows["kl k3"] == "ref=0.0312"  # kl_old absent
    assert rows["grad"] == "norm=nan"
    assert health_rows({"rl_guard/adv/mean": 1.0}) == []


@pytest.mark.parametrize("use_rich", [True, False])
def test_table_every_n_steps_and_no_incident_copy(tmp_path, capsys, use_rich):
    sink = ConsoleSink(every=5, rich=use_rich)
    sink.start(tmp_path)
    for step in range(1, 11):
        sink.log({**VALUES, "rl_guard/lag/max": float(step)}, step)
    sink.incident({"step": 10, "rule": "kl_spike", "message": MESSAGE})
    sink.finish()
    out = capsys.readouterr().out
    assert out.count("rl_guard step") == 2
    assert "rl_guard step 5" in out and "rl_guard step 10" in out and "rl_guard step 1\n" not in out
    assert "p99=1.313" in out and "region_frac=0.125" in out and "max=10" in out
    assert "adv" not in out
    # The guard prints each action itself (control/announce.py, whatever the sinks): the sink adds no second copy.
    assert MESSAGE not in out and "kl_spike" not in out


def test_explicit_stream_and_bad_every(tmp_path):
    buf = io.StringIO()
    sink = ConsoleSink(every=1, rich=False, file=buf)
    sink.start(tmp_path)
    sink.log({"rl_guard/entropy/mean": 2.0}, 3)
    assert buf.getvalue() == "rl_guard step 3\n  entropy  mean=2\n"
    with pytest.raises(ValueError):
        ConsoleSink(every=0)
