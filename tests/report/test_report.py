"""`rl-guard report`: a synthetic run directory written by the real jsonl sink, rendered to real PNG files.

The figures returned with ``keep_figures=True`` are inspected directly: what is drawn, where the incident markers
are and what their labels say, where non-finite values went, which panels are constant.
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
RESTORED = 15  # the rollbacks at step 20 restored the state from before step 15
LR_JUMP_STEP = 20  # the learning rate logged at step 20 is 100x the schedule's (the guard refused it)


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
    m["rl_guard/optim/lr"] = lr_at(s)
    if s not in (0, LR_JUMP_STEP + 1):  # no update before the first step, nor after the dropped one
        m["rl_guard/update/rel"] = update_at(s)
    m.update(
        {
            "rl_guard/clip/low_frac": 0.05,
            "rl_guard/clip/high_frac": 0.1,
            "rl_guard/clip/region_frac": 0.15,
            "rl_guard/grad/norm": 50.0 if s == 15 else 1.0,
            "rl_guard/grad/norm_postclip": 1.5,
            "rl_guard/length/mean": 100.0 + s,
            "rl_guard/length/max": 200.0,
            "rl_guard/length/truncated_frac": 0.1,
        }
    )
    for i, b in enumerate(BUCKETS):
        m[f"rl_guard/lag/{b}/token_frac"] = 0.5 if i == 0 else 0.1
    if s % 2 == 0:  # rewards only on generation steps: the curve must bridge the other steps
        m.update({"rl_guard/reward/mean": 0.1 * s, "rl_guard/reward/std": 0.5})
    # Non-finite data the report must survive and show.
    m.update(
        {
            20: {"rl_guard/ratio/max": math.inf},
            21: {"rl_guard/ratio/p50": math.nan},
            25: {"rl_guard/kl_ref/k3_mean": math.nan},
            30: {"rl_guard/grad/norm": math.nan},
            33: {"rl_guard/lag/9+/token_frac": math.nan},
        }.get(s, {})
    )
    return m


def lr_at(step: int) -> float:
    return 1e-3 * (1 - step / 100) * (100 if step == LR_JUMP_STEP else 1)


def update_at(step: int) -> float:
    return 2e-2 / (1 + step)


def write_run(run_dir, steps=range(N), incidents=INCIDENTS, metrics=metrics_at, extra=None) -> None:
    """A run directory through the real sink; `extra(step, action) -> dict` adds fields to each incident record."""
    sink = JsonlSink()
    sink.start(run_dir)
    for s in steps:
        sink.log(metrics(s), s)
    for step, rule, metric, value, action in incidents:
        op, threshold = ("is", "non-finite") if not math.isfinite(value) else (">", 0.4)  # as rules.Verdict says
        sink.incident(
            {
                "step": step,
                "rule": rule,
                "metric": metric,
                "value": value,
                "op": op,
                "threshold": threshold,
                "action": action,
                "severity": "error",
                "rank": 0,
                "window": {metric: [1.0]},
                "message": f"[rule {rule}] {metric} = {value} {op} {threshold} at step {step} (rank 0) -> {action}",
                "checkpoint": str(run_dir / CKPT) if action == "checkpoint_and_halt" else None,
                "time": 1.0e9 + step,
                "restored_to_step": RESTORED if action == "rollback" else None,
                **(extra(step, action) if extra else {}),
            }
        )
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
    names = {"ratio", "entropy", "kl", "clip", "grad", "optim", "lag", "rollout", "overview"}
    assert set(report["plots"]) == names and report["skipped"] == []
    assert report["out_dir"].endswith("report") and report["steps"] == N and report["incidents"] == len(INCIDENTS)
    for name, path in report["plots"].items():
        img = imread(path)
        assert img.ndim == 3 and img.shape[0] > 250 and img.shape[1] > 600, (name, img.shape)
        assert img[..., :3].std() > 0.05, name  # not a blank canvas


def test_markdown_summary(report):
    md = pathlib.Path(report["markdown"]).read_text(encoding="utf-8")
    for row in (
        "| warn | 3 | 5-7 |",
        "| skip_step | 2 | 15, 30 |",
        "| rollback | 2 | 20 |",
        "| checkpoint_and_halt | 1 | 25 |",
        "| early_stop | 1 | 39 |",
        "| clip_fraction_high | warn | `rl_guard/clip/region_frac` | 3 | 5 | 7 |",
    ):
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
    assert n_axes == 2 + 1 + 2 + 1 + 1 + 2 + 1 + 3 + 11


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
    assert marker_x(lag, "nonfinite") == {33.0} and lag.get_ylim()[0] == 0.0
    assert lag.get_ylim()[1] > 1.0  # room above the stack for the incident labels
    top = [c for c in lag.collections if c.get_gid() == "lag_stack"][-1].get_paths()[0].vertices[:, 1]
    assert np.isclose(top.max(), 1.0)  # shares stack to 1
    axes = axes_by_gid(report["figures"]["rollout"])
    assert list(axes) == ["reward", "length", "truncated"]
    mean = next(ln for ln in axes["reward"].lines if ln.get_label() == "mean")
    np.testing.assert_array_equal(mean.get_xdata(), np.arange(0, N, 2))  # sparse metric, one bridged curve
    np.testing.assert_allclose(mean.get_ydata(), 0.1 * np.arange(0, N, 2))
    assert set(axes_by_gid(report["figures"]["overview"])) == {
        "ratio",
        "entropy",
        "kl_old",
        "kl_ref",
        "clip",
        "grad",
        "lr",
        "update",
        "reward",
        "truncated",
        "lag",
    }


def test_missing_metrics_are_skipped_and_cli(tmp_path, capsys):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    (out / "ratio.png").write_bytes(b"stale")  # from an earlier report of a different run
    write_run(
        run_dir,
        steps=range(5),
        incidents=INCIDENTS[3:4],
        metrics=lambda s: {"rl_guard/grad/norm": [1.0, math.inf, 2.0, math.nan, 1.5][s]},
    )
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
    run = RunData(
        pathlib.Path("r"),
        [{"step": 0, "rl_guard/grad/norm": 1.0}],
        warn + [{"step": 7, "action": "rollback"}, {"step": None, "action": "warn"}],
    )
    ax = Figure().subplots()
    mark_incidents(ax, run)
    segs = {c.get_gid(): c.get_segments() for c in ax.collections}
    assert sorted(float(s[0][0]) for s in segs["incident:warn"]) == [float(r["step"]) for r in warn]
    assert all(s[0][1] > 0.9 and s[-1][1] == 1.0 for s in segs["incident:warn"])  # short ticks at the top
    assert [(s[0][0], s[0][1], s[-1][1]) for s in segs["incident:rollback"]] == [(7.0, 0.0, 1.0)]


def labels_of(ax) -> list:
    return [t for t in ax.texts if t.get_gid() == "incident_label"]


def test_report_md_has_one_row_per_incident_with_rule_action_and_restored_step(report):
    md = pathlib.Path(report["markdown"]).read_text(encoding="utf-8")
    run_dir = report["run_dir"]
    assert "| step | rule | metric | value | condition | action | restored to / checkpoint |" in md
    for row in (
        "| 5 | clip_fraction_high | `rl_guard/clip/region_frac` | 0.45 | > 0.4 | warn | - |",
        "| 15 | grad_norm_spike | `rl_guard/grad/norm` | 50 | > 0.4 | skip_step | - |",
        "| 20 | ratio_extreme | `rl_guard/ratio/max` | inf | is non-finite | rollback | restored to step 15 |",
        "| 20 | update_too_far | `rl_guard/kl_old/k3_mean` | 0.9 | > 0.4 | rollback | restored to step 15 |",
        f"| 25 | kl_ref_nonfinite | `rl_guard/kl_ref/k3_mean` | nan | is non-finite | checkpoint_and_halt | "
        f"checkpoint `{run_dir}/{CKPT}` |",
        "| 39 | entropy_floor | `rl_guard/entropy/mean` | 0.01 | > 0.4 | early_stop | - |",
    ):
        assert row in md, row
    table = md.split("## Incidents\n")[1].split("\n## ")[0]
    assert len([ln for ln in table.splitlines() if ln.startswith("| ") and ln[2].isdigit()]) == len(INCIDENTS)


def test_learning_rate_and_update_size_panels(report):
    assert report["panels"]["lr"] == ("drawn", None) and report["panels"]["update"] == ("drawn", None)
    axes = axes_by_gid(report["figures"]["optim"])
    assert list(axes) == ["lr", "update"]
    lr = next(ln for ln in axes["lr"].lines if ln.get_label() == "learning rate")
    np.testing.assert_allclose(lr.get_ydata(), [lr_at(s) for s in range(N)])
    assert axes["lr"].get_yscale() == "log"  # the 100x jump at step 20 spans more than 30x
    upd = next(ln for ln in axes["update"].lines if ln.get_label().startswith("||dtheta||"))
    assert 0 not in upd.get_xdata() and LR_JUMP_STEP + 1 not in upd.get_xdata()  # no update there: no point
    np.testing.assert_allclose(upd.get_ydata(), [update_at(s) for s in upd.get_xdata()])
    for ax in axes.values():  # markers and labels like every other panel
        assert marker_x(ax, "incident:rollback") == {20.0}
        assert any("lr" in t.get_text() or "rollback" in t.get_text() for t in labels_of(ax))
    md = pathlib.Path(report["markdown"]).read_text(encoding="utf-8")
    assert "](optim.png)" in md and "`lr`" in md and "`update`" in md


def test_incident_labels_name_rule_action_and_restored_step(report):
    from rl_guard.report.data import load_run
    from rl_guard.report.labels import incident_labels

    run = load_run(report["run_dir"])
    full = {lab.first: lab for lab in incident_labels(run)}
    # Both rules that fired at step 20 share one label, the most severe action first, then where it went back to.
    assert full[20].lines == [
        "step 20:",
        "ratio_extreme -> rollback",
        "update_too_far -> rollback",
        f"restored to step {RESTORED}",
    ]
    assert full[5].last == 7 and full[5].lines == ["steps 5-7: clip_fraction_high -> warn"]  # a streak: one label
    assert full[15].lines == ["step 15: grad_norm_spike -> skip_step", "grad/norm 50 > 0.4"]  # the reason too
    assert full[25].lines[0] == "step 25: kl_ref_nonfinite -> checkpoint_and_halt"
    assert sorted(full) == [5, 15, 20, 25, 30, 39]
    compact = {lab.first: lab for lab in incident_labels(run, compact=True)}
    assert compact[15].lines == ["step 15: grad_norm_spike -> skip_step"]
    assert compact[20].lines[-1] == f"restored to step {RESTORED}"
    for name, fig in report["figures"].items():
        hidden = any(t.get_gid() == "incident_labels_hidden" for t in fig.texts)
        for gid, ax in axes_by_gid(fig).items():
            texts = {t.get_text(): t for t in labels_of(ax)}
            want = compact if name == "overview" else full
            assert full[20].text in texts or compact[20].text in texts, (name, gid)  # the most severe is placed
            assert texts[want[20].text].xy[0] == 20  # next to its marker line
            assert set(texts) <= {lab.text for lab in want.values()}
            assert hidden or len(texts) == len(want), (name, gid)
            arrows = [t for t in ax.texts if t.get_gid() == "rollback_arrow"]
            assert [(a.xyann[0], a.xy[0]) for a in arrows] == [(20, RESTORED)], (name, gid)


def test_labels_that_do_not_fit_are_counted_and_report_md_keeps_every_row(tmp_path):
    run_dir = tmp_path / "crowded"
    crowded = [(s, f"a_rather_long_rule_name_{s}", "rl_guard/grad/norm", 2.0, "skip_step") for s in range(10, 22)]
    write_run(run_dir, incidents=crowded)
    res = render_report(run_dir, keep_figures=True, dpi=60)
    ax = axes_by_gid(res["figures"]["grad"])["grad"]
    assert 1 <= len(labels_of(ax)) < len(crowded)
    assert any(
        t.get_gid() == "incident_labels_hidden" and "report.md" in t.get_text() for t in res["figures"]["grad"].texts
    )
    md = pathlib.Path(res["markdown"]).read_text(encoding="utf-8")
    assert all(f"| {s} | a_rather_long_rule_name_{s} |" in md for s, *_ in crowded)
    res["figures"].clear()


def trl_defaults_metrics(s: int) -> dict[str, float]:
    """TRL's defaults: one update per batch (ratio exactly 1, kl_old exactly 0, nothing clipped), no reference
    model (no kl_ref), a constant gradient-norm (not a design constant), the rest moving."""
    m = {f"rl_guard/ratio/{q}": 1.0 for q in (*QS, "max", "min")}
    m.update(
        {
            "rl_guard/kl_old/k3_mean": 0.0,
            "rl_guard/kl_old/k3_seq_max": -0.0,
            "rl_guard/clip/low_frac": 0.0,
            "rl_guard/clip/high_frac": 0.0,
            "rl_guard/clip/region_frac": 0.0,
            "rl_guard/grad/norm": 1.0,
            "rl_guard/entropy/p50": 2.0 - 0.01 * s,
            "rl_guard/optim/lr": lr_at(s),
            "rl_guard/reward/mean": 0.1 * s,
            "rl_guard/reward/std": 0.5,
        }
    )
    if s:
        m["rl_guard/update/rel"] = update_at(s)
    return m


def test_panels_constant_by_design_are_labelled_and_left_out_of_the_overview(tmp_path):
    run_dir = tmp_path / "trl_defaults"
    write_run(run_dir, incidents=INCIDENTS[3:5], metrics=trl_defaults_metrics)
    res = render_report(run_dir, keep_figures=True, dpi=60)
    panels = res["panels"]
    assert panels["ratio"] == ("constant by design", 1.0) and panels["kl_old"] == ("constant by design", 0.0)
    assert panels["clip"] == ("constant by design", 0.0)
    assert panels["grad"] == ("constant", 1.0)  # constant, but not by design: drawn everywhere, with its value
    assert panels["entropy"] == panels["lr"] == panels["update"] == ("drawn", None)
    assert panels["kl_ref"] == ("no data", None)
    overview = axes_by_gid(res["figures"]["overview"])
    assert set(overview) == {"entropy", "grad", "lr", "update", "reward"}
    title = res["figures"]["overview"]._suptitle.get_text()
    assert "left out, constant by design: ratio = 1, kl_old = 0, clip = 0" in title
    notes = {}
    for name in ("ratio", "kl", "clip", "grad"):  # their own figures still show them, labelled
        for gid, ax in axes_by_gid(res["figures"][name]).items():
            notes[gid] = [t.get_text() for t in ax.texts if t.get_gid() == "constant"]
    assert notes == {
        "ratio": ["constant by design in this run (value 1)"],
        "kl_old": ["constant by design in this run (value 0)"],
        "clip": ["constant by design in this run (value 0)"],
        "grad": ["constant in this run (value 1)"],
    }
    assert [t.get_text() for t in overview["grad"].texts if t.get_gid() == "constant"] == [
        "constant in this run (value 1)"
    ]
    assert not [t for t in overview["lr"].texts if t.get_gid() == "constant"]
    md = pathlib.Path(res["markdown"]).read_text(encoding="utf-8")
    panels_md = md.split("## Panels\n")[1]
    assert "constant by design in this run: left out of overview.png, drawn in their own figure" in panels_md
    for line in ("  - `ratio` = 1: ", "  - `kl_old` = 0: ", "  - `clip` = 0: "):
        assert line in panels_md, line
    assert "- constant in this run (drawn everywhere, labelled with the value): `grad` = 1" in panels_md
    assert "- no data in this run (left out): " in panels_md and "`kl_ref`" in panels_md
    res["figures"].clear()


def test_float32_round_off_is_not_constant():
    from rl_guard.report.data import RunData
    from rl_guard.report.panels import constant_value

    run = RunData(
        pathlib.Path("r"), [{"step": s, "rl_guard/ratio/p50": v} for s, v in enumerate([1.0, 0.99999976])], []
    )
    assert constant_value("ratio", run) is None
    one = RunData(pathlib.Path("r"), [{"step": 0, "rl_guard/ratio/p50": 1.0}], [])
    assert constant_value("ratio", one) is None  # one step says nothing about the run


def test_shadow_mode_incidents_say_what_would_have_happened(tmp_path):
    run_dir = tmp_path / "shadow"

    def shadow(step, action):  # control/actions.py's shadow record: the run only got a warning
        restore = {"restored_to_step": None, "would_restore_to_step": RESTORED} if action == "rollback" else {}
        return {"mode": "shadow", "would": action, "action": "warn", **restore}

    write_run(run_dir, incidents=INCIDENTS[3:6], extra=shadow)
    res = render_report(run_dir, keep_figures=True, dpi=60)
    md = pathlib.Path(res["markdown"]).read_text(encoding="utf-8")
    assert (
        "| 20 | ratio_extreme | `rl_guard/ratio/max` | inf | is non-finite | would rollback (shadow: warned only) "
        f"| would restore to step {RESTORED} |"
    ) in md
    assert "- shadow-mode incidents: 3" in md
    ax = axes_by_gid(res["figures"]["grad"])["grad"]
    texts = [t.get_text() for t in labels_of(ax)]
    assert (
        "shadow, step 20:\nratio_extreme -> would rollback\nupdate_too_far -> would rollback\n"
        f"would restore to step {RESTORED}" in texts
    )
    assert marker_x(ax, "incident:warn") == {15.0, 20.0}  # what actually happened: warnings only
    legend = [t.get_text() for t in res["figures"]["grad"].legends[0].get_texts()]
    assert legend == [
        "shadow mode, rule fired -> warn (3)",
        "non-finite value (drawn at the edge)",
        "arrow: back to the step a rollback restored",
    ]
    res["figures"].clear()


def test_replayed_incidents_are_marked_as_replayed(tmp_path):
    """``rl-guard replay --report``'s real records (``replay.loop.incident``: ``replayed: true``)."""
    from rl_guard.control.config import load_config
    from rl_guard.replay import load_history, replay
    from rl_guard.replay.output import write_report

    run_dir = tmp_path / "recorded"
    write_run(run_dir, incidents=[])
    config = load_config(
        "rules:\n  - {name: lr_high, metric: rl_guard/optim/lr, op: '>', threshold: 0.01, "
        "action: rollback}\nsnapshots: {healthy_steps: 2, every: 2, keep: 2}\n"
    )
    result = replay(load_history(run_dir), config)
    assert [(r["step"], r["rule"], r["replayed"]) for r in result.incidents] == [(LR_JUMP_STEP, "lr_high", True)]
    restored = result.incidents[0]["restored_to_step"]
    assert restored is not None and restored < LR_JUMP_STEP
    out = tmp_path / "replayed"
    write_report(result, out, "cfg.yaml", dpi=60)
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "- rules replayed: `cfg.yaml`" in md and f"`rl-guard replay` of `{run_dir / 'metrics.jsonl'}`" in md
    assert (
        f"| {LR_JUMP_STEP} | lr_high | `rl_guard/optim/lr` | 0.08 | > 0.01 | rollback (replayed) | "
        f"would restore to step {restored} |"
    ) in md
    res = render_report(out, tmp_path / "again", keep_figures=True, dpi=60)
    ax = axes_by_gid(res["figures"]["optim"])["lr"]
    replayed = [c for c in ax.collections if c.get_gid() == "incident:rollback:replayed"]
    assert len(replayed) == 1 and replayed[0].get_linestyle()[0][1] is not None  # dashed: nothing happened live
    assert not [c for c in ax.collections if c.get_gid() == "incident:rollback"]
    heads = [t.get_text().split("\n")[0] for t in labels_of(ax)]
    assert heads == [f"replayed, step {LR_JUMP_STEP}: lr_high -> rollback"]
    legend = [t.get_text() for t in res["figures"]["optim"].legends[0].get_texts()]
    assert legend == ["replayed -> rollback (1)", "arrow: back to the step a rollback restored"]
    res["figures"].clear()
