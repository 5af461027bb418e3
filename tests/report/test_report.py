"""`rl-guard report`: a synthetic run directory written by the real jsonl sink, rendered to real PNG files.

The figures returned with ``keep_figures=True`` are inspected directly: what is drawn, where the incident markers
are, where non-finite values went.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.image import imread  # noqa: E402

from rl_guard.report import ReportDependencyError, add_arguments, main, render_report  # noqa: E402
from rl_guard.sinks.jsonl import JsonlSink  # noqa: E402

N = 40
BUCKETS = ("0", "1", "2", "3-4", "5-8", "9+")
QS = {"p01": 0.80, "p05": 0.85, "p25": 0.95, "p50": 1.0, "p75": 1.05, "p95": 1.15, "p99": 1.25}
CKPT = "checkpoints/step_00000025/rank0.pt"  # relative to the run dir
# (step, rule, metric, value, action)
INCIDENTS = [
    (5, "clip_fraction_high", "rl_guard/clip/region_frac", 0.45, "warn"),
    (6, "clip_fraction_high", "rl_guard/clip/region_frac", 0.46, "warn"),
    (7, "clip_fraction_high", "rl_guard/clip/region_frac", 0.47, "warn"),
    (15, "grad_norm_spike", "rl_guard/grad/norm", 50.0, "skip_step"),
    (20, "ratio_extreme", "rl_guard/ratio/max", math.inf, "rollback"),
    (20, "update_too_far", "rl_guard/kl_old/k3_mean", 0.9, "rollback"),
    (25, "kl_ref_nonfinite", "rl_guard/kl_ref/k3_mean", math.nan, "checkpoint_and_halt"),
    (30, "grad_nonfinite", "rl_guard/grad/norm", math.nan, "skip_step"),
    (39, "entropy_floor", "rl_guard/entropy/mean", 0.01, "early_stop"),
]


def ratio_p50(step: int) -> float:
    return 1.0 + 0.02 * math.sin(step)


def metrics_at(s: int) -> dict[str, float]:
    m = {}
    for fam, scale in (("ratio", 1.0), ("importance_weight", 1.0), ("entropy", 2.0)):
        for q, f in QS.items():
            m[f"rl_guard/{fam}/{q}"] = scale * ratio_p50(s) * f
        m[f"rl_guard/{fam}/max"], m[f"rl_guard/{fam}/min"] = 1.6 * scale, 0.6 * scale
    for fam in ("kl_old", "kl_ref"):
        m[f"rl_guard/{fam}/k3_mean"] = 0.0 if s % 4 == 0 else 1e-3 * (1 + s)
        m[f"rl_guard/{fam}/k3_seq_max"] = 10 * m[f"rl_guard/{fam}/k3_mean"]
    m.update({"rl_guard/clip/low_frac": 0.05, "rl_guard/clip/high_frac": 0.1, "rl_guard/clip/region_frac": 0.15,
              "rl_guard/grad/norm": 50.0 if s == 15 else 1.0, "rl_guard/grad/norm_postclip": 1.5,
              "rl_guard/length/mean": 100.0 + s, "rl_guard/length/max": 200.0,
              "rl_guard/length/truncated_frac": 0.1})
    for i, b in enumerate(BUCKETS):
        m[f"rl_guard/lag/{b}/token_frac"] = 0.5 if i == 0 else 0.1
    if s % 2 == 0:  # rewards only on generation steps: the curve must bridge the other steps
        m.update({"rl_guard/reward/mean": 0.1 * s, "rl_guard/reward/std": 0.5})
    # Non-finite data the report must survive and show.
    m.update({20: {"rl_guard/ratio/max": math.inf}, 21: {"rl_guard/ratio/p50": math.nan},
              25: {"rl_guard/kl_ref/k3_mean": math.nan}, 30: {"rl_guard/grad/norm": math.nan},
              33: {"rl_guard/lag/9+/token_frac": math.nan}}.get(s, {}))
    return m


def write_run(run_dir, steps=range(N), incidents=INCIDENTS, metrics=metrics_at) -> None:
    sink = JsonlSink()
    sink.start(run_dir)
    for s in steps:
        sink.log(metrics(s), s)
    for step, rule, metric, value, action in incidents:
        op = "nonfinite" if not math.isfinite(value) else ">"
        sink.incident({"step": step, "rule": rule, "metric": metric, "value": value, "op": op, "threshold": 0.4,
                       "action": action, "severity": "error", "rank": 0, "window": {metric: [1.0]},
                       "message": f"[rule {rule}] {metric} = {value} {op} 0.4 at step {step} (rank 0) -> {action}",
                       "checkpoint": str(run_dir / CKPT) if action == "checkpoint_and_halt" else None,
                       "time": 1.0e9 + step})
    sink.finish()
    for path in (CKPT, "checkpoints/step_00000010/rank0.pt"):  # the second one no incident refers to
        (run_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / path).write_bytes(b"")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    write_run(run_dir)
    res = render_report(run_dir, keep_figures=True, dpi=72)
    yield res
    res["figures"].clear()


def axes_by_gid(fig) -> dict:
    return {ax.get_gid(): ax for ax in fig.axes if ax.get_visible() and ax.get_gid()}


def marker_x(ax, gid_prefix: str) -> set[float]:
    """x of the markers with this gid: Line2D points, or the (vertical) segments of a LineCollection."""
    xs = {float(x) for ln in ax.lines if (ln.get_gid() or "").startswith(gid_prefix) for x in ln.get_xdata()}
    for c in ax.collections:
        if (c.get_gid() or "").startswith(gid_prefix):
            for seg in c.get_segments():
                assert seg[0][0] == seg[-1][0] and {seg[0][1], seg[-1][1]} == {0.0, 1.0}  # full-height vertical
                xs.add(float(seg[0][0]))
    return xs


def test_files_exist_and_decode(report, tmp_path):
    names = {"ratio", "entropy", "kl", "clip", "grad", "lag", "rollout", "overview"}
    assert set(report["plots"]) == names and report["skipped"] == []
    assert report["out_dir"].endswith("report") and report["steps"] == N and report["incidents"] == len(INCIDENTS)
    for name, path in report["plots"].items():
        img = imread(path)
        assert img.ndim == 3 and img.shape[0] > 250 and img.shape[1] > 600, (name, img.shape)
        assert img[..., :3].std() > 0.05, name  # not a blank canvas


def test_markdown_summary(report):
    md = open(report["markdown"], encoding="utf-8").read()
    for row in ("| warn | 3 | 5-7 |", "| skip_step | 2 | 15, 30 |", "| rollback | 2 | 20 |",
                "| checkpoint_and_halt | 1 | 25 |", "| early_stop | 1 | 39 |",
                "| clip_fraction_high | warn | `rl_guard/clip/region_frac` | 3 | 5 | 7 |"):
        assert row in md, row
    assert "incidents: 9 (first at step 5, last at step 39)" in md
    assert "> [rule clip_fraction_high] rl_guard/clip/region_frac = 0.45 > 0.4 at step 5 (rank 0) -> warn" in md
    assert "step 20 (rank 0) -> rollback" in md  # the first incident that changed the run is quoted too
    run_dir = report["run_dir"]
    assert f"`{run_dir}/{CKPT}` (step 25, rule kl_ref_nonfinite" in md
    assert f"`{run_dir}/checkpoints/step_00000010` (in checkpoints/, not referenced" in md
    assert "step_00000025` (in checkpoints/" not in md
    assert "`rl_guard/grad/norm` at step 30;" in md and "`rl_guard/ratio/max` at step 20;" in md
    for name in report["plots"]:
        assert f"]({name}.png)" in md


def test_every_panel_marks_every_incident_with_its_action(report):
    expected = {a: {float(s) for s, _, _, _, act in INCIDENTS if act == a} for _, _, _, _, a in INCIDENTS}
    n_axes = 0
    for name, fig in report["figures"].items():
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert "rule fired -> rollback (2)" in legend and "rule fired -> warn (3)" in legend, name
        for gid, ax in axes_by_gid(fig).items():
            n_axes += 1
            for action, steps in expected.items():
                assert marker_x(ax, f"incident:{action}") == steps, (name, gid, action)
    assert n_axes == 2 + 1 + 2 + 1 + 1 + 1 + 3 + 9


def test_ratio_bands_log_axis_and_nonfinite(report):
    axes = axes_by_gid(report["figures"]["ratio"])
    assert list(axes) == ["ratio", "importance_weight"]  # no seq_ratio / behave_imp_weight metrics: skipped
    ax = axes["ratio"]
    assert ax.get_yscale() == "log"
    assert {c.get_gid() for c in ax.collections} >= {"band:p01-p99", "band:p25-p75"}
    p50 = next(line for line in ax.lines if line.get_label() == "p50")
    want = np.array([ratio_p50(s) for s in range(N)], dtype=np.float64)
    want[21] = np.nan  # the NaN step breaks the line
    np.testing.assert_array_equal(p50.get_xdata(), np.arange(N))
    np.testing.assert_allclose(p50.get_ydata(), want, rtol=1e-12, equal_nan=True)
    mx = next(line for line in ax.lines if line.get_label() == "max")
    assert np.isnan(mx.get_ydata()[20]) and mx.get_linestyle() == "None"
    assert marker_x(ax, "nonfinite") == {20.0, 21.0}  # inf max and NaN p50, at the top edge (axes coords)
    for line in (ln for ln in ax.lines if ln.get_gid() == "nonfinite"):
        assert set(line.get_ydata()) == {1.0} and line.get_marker() == "x"
    ent = axes_by_gid(report["figures"]["entropy"])["entropy"]
    assert ent.get_yscale() == "linear" and not marker_x(ent, "nonfinite")
    assert {c.get_gid() for c in ent.collections} >= {"band:p01-p99", "band:p25-p75"}


def test_kl_clip_grad_panels(report):
    kl = axes_by_gid(report["figures"]["kl"])
    assert kl["kl_old"].get_yscale() == "log"  # 0.001..0.39 plus exact zeros: log, zeros on the edge
    assert kl["kl_old"].get_ylim()[0] > 1e-4
    assert marker_x(kl["kl_ref"], "nonfinite") == {25.0} and not marker_x(kl["kl_old"], "nonfinite")
    assert len([ln for ln in kl["kl_ref"].lines if ln.get_label().startswith("k3")]) == 2
    clip = axes_by_gid(report["figures"]["clip"])["clip"]
    assert sorted(ln.get_label()[:4] for ln in clip.lines if not ln.get_gid()) == ["high", "low ", "regi"]
    grad = axes_by_gid(report["figures"]["grad"])["grad"]
    assert grad.get_yscale() == "log"  # a 50x spike
    stars = [ln for ln in grad.lines if ln.get_gid() == "grad_spike"]
    assert all(ln.get_marker() == "*" for ln in stars) and marker_x(grad, "grad_spike") == {15.0, 30.0}
    spike = next(ln for ln in stars if list(ln.get_xdata()) == [15])
    assert list(spike.get_ydata()) == [50.0] and spike.get_transform() == grad.transData
    nan_star = next(ln for ln in stars if list(ln.get_xdata()) == [30])
    assert list(nan_star.get_ydata()) == [1.0] and nan_star.get_transform() != grad.transData  # top edge
    assert marker_x(grad, "nonfinite") == {30.0}


def test_lag_stack_and_rollout(report):
    lag = axes_by_gid(report["figures"]["lag"])["lag"]
    assert len([c for c in lag.collections if c.get_gid() == "lag_stack"]) == len(BUCKETS)  # one area per bucket
    assert [t.get_text() for t in lag.get_legend().get_texts()][:6] == [f"lag {b}" for b in BUCKETS]
    assert marker_x(lag, "nonfinite") == {33.0} and lag.get_ylim() == (0.0, 1.0)
    top = [c for c in lag.collections if c.get_gid() == "lag_stack"][-1].get_paths()[0].vertices[:, 1]
    assert np.isclose(top.max(), 1.0)  # shares stack to 1
    axes = axes_by_gid(report["figures"]["rollout"])
    assert list(axes) == ["reward", "length", "truncated"]
    mean = next(ln for ln in axes["reward"].lines if ln.get_label() == "mean")
    np.testing.assert_array_equal(mean.get_xdata(), np.arange(0, N, 2))  # sparse metric, one bridged curve
    np.testing.assert_allclose(mean.get_ydata(), 0.1 * np.arange(0, N, 2))
    assert set(axes_by_gid(report["figures"]["overview"])) == {
        "ratio", "entropy", "kl_old", "kl_ref", "clip", "grad", "reward", "truncated", "lag"}


def test_missing_metrics_are_skipped_and_cli(tmp_path, capsys):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    (out / "ratio.png").write_bytes(b"stale")  # from an earlier report of a different run
    write_run(run_dir, steps=range(5), incidents=INCIDENTS[3:4],
              metrics=lambda s: {"rl_guard/grad/norm": [1.0, math.inf, 2.0, math.nan, 1.5][s]})
    args = add_arguments(argparse.ArgumentParser()).parse_args([str(run_dir), "--out", str(out), "--dpi", "60"])
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert str(out / "report.md") in printed and "grad" in printed
    assert sorted(p.name for p in out.iterdir()) == ["grad.png", "overview.png", "report.md"]
    md = (out / "report.md").read_text()
    assert "| skip_step | 1 | 15 |" in md and "`rl_guard/grad/norm` at steps 1, 3" in md
    assert "step_00000010` (in checkpoints/, not referenced" in md and "ratio.png" not in md


def test_errors(tmp_path, monkeypatch, capsys):
    ns = argparse.Namespace(run_dir=str(tmp_path / "nope"), out_dir=None, dpi=60, quiet=True)
    assert main(ns) == 2 and "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        render_report(tmp_path / "empty")
    # Without the optional extra the message names it (import blocked as if matplotlib were not installed).
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(ReportDependencyError, match=r"rl-guard\[report\]"):
        render_report(tmp_path / "empty")
    assert main(ns) == 1 and "rl-guard[report]" in capsys.readouterr().err


def test_dense_incidents_become_a_rug_and_markers_follow_incidents():
    from matplotlib.figure import Figure

    from rl_guard.report.data import RunData
    from rl_guard.report.style import DENSE, mark_incidents

    warn = [{"step": s, "action": "warn"} for s in range(0, 3 * DENSE, 2)]  # too many for full-height lines
    run = RunData(pathlib.Path("r"), [{"step": 0, "rl_guard/grad/norm": 1.0}],
                  warn + [{"step": 7, "action": "rollback"}, {"step": None, "action": "warn"}])
    ax = Figure().subplots()
    mark_incidents(ax, run)
    segs = {c.get_gid(): c.get_segments() for c in ax.collections}
    assert sorted(float(s[0][0]) for s in segs["incident:warn"]) == [float(r["step"]) for r in warn]
    assert all(s[0][1] > 0.9 and s[-1][1] == 1.0 for s in segs["incident:warn"])  # short ticks at the top
    assert [(s[0][0], s[0][1], s[-1][1]) for s in segs["incident:rollback"]] == [(7.0, 0.0, 1.0)]
