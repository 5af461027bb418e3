"""``rl-guard suggest`` on a real healthy run: the numbers follow the stated recipe, the YAML loads, and the spike
settings it proposes are exactly the ones the live detectors would have stayed silent under.

The demo runs here are 20-30 steps, shorter than the default --min-steps (50, ``history.MIN_STEPS``): the recipe
is checked with ``min_steps=1``; refusing a short history is checked in tests/test_cli.py, and on the real run below."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from rl_guard.cli import main
from rl_guard.control.config import load_config
from rl_guard.replay import load_history, replay
from rl_guard.replay.suggest import round_away, suggest, to_yaml

pytestmark = pytest.mark.slow  # a real GRPO run (session fixture)

RULES = """
version: 1
rules:
  - {name: clip_high, metric: rl_guard/clip/region_frac, op: ">", threshold: 0.4, action: warn}
  - {name: entropy_low, metric: rl_guard/entropy/mean, op: "<", threshold: 0.02, action: warn}
  - {name: ratio_band, metric: rl_guard/ratio/p50, op: outside, band: [0.9, 1.1], action: warn}
  - name: entropy_jump
    metric: rl_guard/entropy/mean
    spike: {method: mad, window: 10, min_history: 5, threshold: 1, direction: both}
    action: warn
  - name: kl_rise
    metric: rl_guard/kl_old/k3_mean
    spike: {method: ema_z, window: 8, min_history: 4, threshold: 0.5}
    action: rollback
  - name: grad_vs_early
    metric: rl_guard/grad/norm
    spike: {method: early_max, window: 5, factor: 1.01}
    action: skip_step
  - {name: lag_never_logged, metric: rl_guard/lag/max, op: ">", threshold: 3, action: warn}
"""


def _config(rules: list[dict]):
    return load_config(yaml.safe_dump({"version": 1, "rules": rules}, sort_keys=False))


def _fired(history, rules) -> dict[str, list[int]]:
    return replay(history, _config(rules)).steps_by_rule()


def test_thresholds_follow_the_quantile_and_margin(healthy_demo):
    history = load_history(healthy_demo.run_dir)
    got = {s.rule["name"]: s for s in suggest(load_config(RULES), [history], quantile=0.99, margin=1.5, min_steps=1)}
    col = lambda m: np.array([r[m] for r in history.records if m in r], dtype=np.float64)  # noqa: E731
    clip, ent, p50 = col("rl_guard/clip/region_frac"), col("rl_guard/entropy/mean"), col("rl_guard/ratio/p50")
    assert got["clip_high"].rule["threshold"] == round_away(float(np.quantile(clip, 0.99)) * 1.5, True)
    assert got["entropy_low"].rule["threshold"] == round_away(float(np.quantile(ent, 0.01)) / 1.5, False)
    lo, hi = np.quantile(p50, 0.01), np.quantile(p50, 0.99)
    pad = 0.5 * ((hi - lo) or abs(hi))
    assert got["ratio_band"].rule["band"] == [round_away(lo - pad, False), round_away(hi + pad, True)]
    assert "p99" in got["clip_high"].evidence[0] and "healthy steps beyond" in got["clip_high"].evidence[0]
    assert got["lag_never_logged"].rule["threshold"] == 3  # no input: kept, and said so
    assert got["lag_never_logged"].evidence == ["rl_guard/lag/max: not in these histories: kept"]


def test_spike_suggestions_are_the_live_detectors_edge_of_silence(healthy_demo):
    """margin 1: the suggested z is the largest the live detector reached, rounded up. Replaying with it is silent;
    just below every value the evidence's maximum can stand for (it prints 3 significant digits) the same live
    detector fires (so the z-scores are the live ones)."""
    history = load_history(healthy_demo.run_dir)
    config = load_config(RULES)
    assert _fired(history, [r for r in config.rules if r["name"] in ("entropy_jump", "kl_rise", "grad_vs_early")]) != {
        "entropy_jump": [],
        "kl_rise": [],
        "grad_vs_early": [],
    }  # the tight settings do fire on this run
    suggested = {s.rule["name"]: s for s in suggest(config, [history], quantile=1.0, margin=1.0, min_steps=1)}
    for name, key in (("entropy_jump", "threshold"), ("kl_rise", "threshold"), ("grad_vs_early", "factor")):
        rule = suggested[name].rule
        fired = _fired(history, [rule])
        assert fired[name] == [], (name, suggested[name].evidence)
        worst = float(suggested[name].evidence[0].split(" max " if key == "threshold" else "early max ")[1].split()[0])
        lowest = (worst - 0.5 * 10 ** (math.floor(math.log10(worst)) - 2)) * 0.999  # "1.64" is [1.635, 1.645)
        if key == "factor" and lowest < 1:  # never reached the early max again: the smallest factor allowed
            assert rule["spike"]["factor"] == 1.0
            continue
        below = copy.deepcopy(rule)
        below["spike"][key] = lowest
        assert _fired(history, [below])[name] != [], (name, worst)


def test_quantile_one_is_silent_on_the_healthy_run_and_the_yaml_loads(healthy_demo, capsys):
    run = healthy_demo.run_dir
    assert (
        main(
            [
                "suggest",
                str(run),
                "--rules",
                str(run / "config.yaml"),
                "--quantile",
                "1",
                "--margin",
                "1.2",
                "--min-steps",
                "1",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert text.startswith("# rl-guard suggest: thresholds from 1 healthy history (quantile 1, margin 1.2")
    config = load_config(text)  # a valid guard YAML as printed, comments and all
    result = replay(load_history(run), config)
    assert [r for r in result.incidents if not r["rule"].startswith("nonfinite")] == []
    names = [r["name"] for r in load_config(run / "config.yaml").rules]
    assert [r["name"] for r in config.rules] == names  # every rule kept, in order
    assert "# rl_guard/entropy/mean: 30 healthy steps, range [" in text


def test_a_history_the_guard_acted_on_is_flagged(fault_demo, healthy_demo, capsys):
    assert main(["suggest", str(healthy_demo.run_dir), str(fault_demo.run_dir)]) == 0
    err = capsys.readouterr().err
    assert f"{fault_demo.run_dir / 'metrics.jsonl'} is not a healthy run" in err
    assert str(healthy_demo.run_dir) not in err


def test_several_histories_pool_their_steps(healthy_demo, fault_demo):
    a, b = load_history(healthy_demo.run_dir), load_history(fault_demo.run_dir)
    one = suggest(load_config(RULES), [a], quantile=1.0, margin=1.0, min_steps=1)
    both = suggest(load_config(RULES), [a, b], quantile=1.0, margin=1.0, min_steps=1)
    clip = max(r["rl_guard/clip/region_frac"] for r in a.records + b.records)
    assert both[0].rule["threshold"] == round_away(clip, True) >= one[0].rule["threshold"]
    text = to_yaml(both, [a, b], SimpleNamespace(quantile=1.0, margin=1.0, rules="RULES"))
    assert "from 2 healthy histories" in text and str(a.path) in text and str(b.path) in text


def test_the_30_step_demo_run_is_too_short_for_the_presets_defaults(healthy_demo, capsys):
    """With the default --min-steps every calibratable condition of the preset keeps its setting and says why,
    instead of limits far tighter than the preset's."""
    run = healthy_demo.run_dir
    assert main(["suggest", str(run), "--rules", str(run / "config.yaml")]) == 0
    captured = capsys.readouterr()
    assert "rl-guard suggest: warning: too short to calibrate from" in captured.err
    preset = {r["name"]: r for r in load_config(run / "config.yaml").rules}
    assert {r["name"]: r for r in load_config(captured.out).rules} == preset
    assert "# rl_guard/update/rel: too short to calibrate from (" in captured.out
