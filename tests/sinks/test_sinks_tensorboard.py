"""TensorBoardSink: read real event files back with TensorBoard's EventAccumulator."""

import math

import numpy as np
import pytest

from rl_guard.sinks import TensorBoardSink
from rl_guard.sinks.tensorboard import histogram_raw_args

ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _load(log_dir):
    acc = ea.EventAccumulator(str(log_dir), size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0, ea.TENSORS: 0})
    acc.Reload()
    return acc


def test_scalars_histograms_and_incidents(tmp_path):
    rng = np.random.default_rng(0)
    sink = TensorBoardSink()
    sink.start(tmp_path)
    hists, medians = {}, []
    for step in (1, 2, 3):
        ratios = np.exp(rng.normal(0.0, 0.1 * step, size=1000))
        counts, edges = np.histogram(ratios, bins=16)
        hists[step] = (edges, counts)
        medians.append(float(np.median(ratios)))
        sink.log(
            {
                "step": step,
                "rl_guard/ratio/p50": medians[-1],
                "rl_guard/grad/nonfinite": float("nan") if step == 2 else 0.0,
            },
            step,
            histograms={"rl_guard/ratio": (edges, counts)},
        )
    sink.incident({"step": 3, "rule": "ratio_tail", "message": "[rule ratio_tail] boom"})
    sink.finish()

    acc = _load(tmp_path / "tensorboard")
    assert "step" not in acc.Tags()["scalars"]
    p50 = acc.Scalars("rl_guard/ratio/p50")
    assert [e.step for e in p50] == [1, 2, 3]
    assert [e.value for e in p50] == pytest.approx(medians, rel=1e-6)  # event files store float32
    nonfinite = acc.Scalars("rl_guard/grad/nonfinite")
    assert math.isnan(nonfinite[1].value) and nonfinite[0].value == 0.0

    events = acc.Histograms("rl_guard/ratio")
    assert [e.step for e in events] == [1, 2, 3]
    for ev in events:
        edges, counts = hists[ev.step]
        h = ev.histogram_value
        assert h.bucket == [0.0] + counts.astype(float).tolist()  # leading empty bucket keeps edges[0]
        assert np.allclose(h.bucket_limit, edges, rtol=1e-12)
        assert h.num == counts.sum() == 1000
        assert h.min == pytest.approx(edges[0]) and h.max == pytest.approx(edges[-1])

    (text,) = acc.Tensors("rl_guard/incidents/text_summary")
    assert text.step == 3 and text.tensor_proto.string_val[0].decode() == "[rule ratio_tail] boom"


def test_histogram_raw_args_reference():
    edges = np.array([-1.0, 0.0, 1.0, 2.0, 3.0])
    counts = np.array([0, 2, 0, 3])
    args = histogram_raw_args(edges, counts)
    centres = np.array([-0.5, 0.5, 1.5, 2.5])
    assert args["min"] == 0.0 and args["max"] == 3.0  # tightest edges around non-empty buckets
    assert args["num"] == 5.0
    assert args["sum"] == pytest.approx(float((centres * counts).sum()))
    assert args["sum_squares"] == pytest.approx(float((centres**2 * counts).sum()))
    assert args["bucket_limits"] == [-1.0, 0.0, 1.0, 2.0, 3.0]
    assert args["bucket_counts"] == [0.0, 0.0, 2.0, 0.0, 3.0]
    with pytest.raises(ValueError):
        histogram_raw_args(edges, counts[:-1][:-1])


def test_resume_purges_lost_steps(tmp_path):
    first = TensorBoardSink()
    first.start(tmp_path)
    for s in range(1, 6):
        first.log({"rl_guard/loss/value": float(s)}, s)
    first.finish()
    second = TensorBoardSink()
    second.start(tmp_path, resume_step=3)
    for s in range(4, 7):
        second.log({"rl_guard/loss/value": 10.0 * s}, s)
    second.finish()
    events = _load(tmp_path / "tensorboard").Scalars("rl_guard/loss/value")
    assert [(e.step, e.value) for e in events] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
