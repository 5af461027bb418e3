"""Config validation: each malformed YAML names the key path, the YAML line and what is wrong or allowed."""

import re
from pathlib import Path

import pytest

from rl_guard import Guard
from rl_guard.control.config import ACTIONS, load_config
from rl_guard.errors import ConfigError, format_path

ROOT = Path(__file__).resolve().parents[2]
OK_RULE = '  - name: ok\n    metric: rl_guard/kl_ref/k3_mean\n    op: ">"\n    threshold: 0.1\n    action: warn\n'


def rules(body: str) -> str:
    """A config whose line 1 is ``rules:`` and whose first rule starts at line 2."""
    return "rules:\n" + body


CASES = [
    # (id, yaml, key path, line, key phrase)
    ("unknown top key", "version: 1\nrulez: []\n", "rulez", 2, "unknown key 'rulez'; allowed: version, run_dir"),
    (
        "unknown rule key",
        rules(
            '  - name: a\n    metric: rl_guard/kl_ref/k3_mean\n    op: ">"\n    thresh: 1\n'
            "    threshold: 1\n    action: warn\n"
        ),
        "rules[0].thresh",
        5,
        "unknown key 'thresh'",
    ),
    (
        "unknown metric",
        rules('  - name: a\n    metric: rl_guard/kl_ref/k3_maen\n    op: ">"\n    threshold: 1\n    action: warn\n'),
        "rules[0].metric",
        3,
        "unknown metric 'rl_guard/kl_ref/k3_maen'; did you mean 'rl_guard/kl_ref/k3_mean'?",
    ),
    (
        "wrong type",
        rules('  - name: a\n    metric: rl_guard/kl_ref/k3_mean\n    op: ">"\n    threshold: high\n    action: warn\n'),
        "rules[0].threshold",
        5,
        "expected float, got str 'high'",
    ),
    (
        "bool is not a number",
        rules('  - name: a\n    metric: rl_guard/kl_ref/k3_mean\n    op: ">"\n    threshold: true\n    action: warn\n'),
        "rules[0].threshold",
        5,
        "expected float, got bool",
    ),
    (
        "bad action enum",
        rules('  - name: a\n    metric: rl_guard/kl_ref/k3_mean\n    op: ">"\n    threshold: 1\n    action: explode\n'),
        "rules[0].action",
        6,
        "'explode' is not allowed; allowed values: " + ", ".join(ACTIONS),
    ),
    (
        "bad op enum",
        rules("  - name: a\n    metric: rl_guard/kl_ref/k3_mean\n    op: '=='\n    threshold: 1\n    action: warn\n"),
        "rules[0].op",
        4,
        "'==' is not allowed; allowed values: >, >=, <, <=, outside, nonfinite",
    ),
    (
        "missing action",
        rules('  - name: a\n    metric: rl_guard/kl_ref/k3_mean\n    op: ">"\n    threshold: 1\n'),
        "rules[0].action",
        2,
        "rule needs an 'action'; allowed values: warn",
    ),
    ("duplicate rule name", rules(OK_RULE + OK_RULE), "rules[1].name", 7, "duplicate rule name 'ok'"),
    (
        "builtin rule name",
        rules(OK_RULE.replace("name: ok", "name: nonfinite_loss")),
        "rules[0].name",
        2,
        "'nonfinite_loss' is a built-in rule name; configure it under builtin_rules",
    ),
    (
        "band low >= high",
        rules(
            "  - name: a\n    metric: rl_guard/ratio/p50\n    op: outside\n    band: [1.05, 0.95]\n    action: warn\n"
        ),
        "rules[0].band",
        5,
        "band low must be < high, got [1.05, 0.95]",
    ),
    (
        "outside without band",
        rules("  - name: a\n    metric: rl_guard/ratio/p50\n    op: outside\n    action: warn\n"),
        "rules[0].band",
        2,
        "op 'outside' needs band: [low, high]",
    ),
    (
        "threshold op without threshold",
        rules('  - name: a\n    metric: rl_guard/ratio/p50\n    op: ">"\n    action: warn\n'),
        "rules[0].threshold",
        2,
        "op '>' needs a numeric 'threshold'",
    ),
    ("patience 0", rules(OK_RULE + "    patience: 0\n"), "rules[0].patience", 7, "must be >= 1, got 0"),
    ("negative warmup", rules(OK_RULE + "    warmup_steps: -2\n"), "rules[0].warmup_steps", 7, "must be >= 0, got -2"),
    (
        "composite with one condition",
        rules("  - name: c\n    all:\n      - {metric: rl_guard/ratio/p50, op: '>', threshold: 2}\n    action: warn\n"),
        "rules[0].all",
        3,
        "needs a list of at least two conditions",
    ),
    (
        "composite with own metric",
        rules(
            "  - name: c\n    metric: rl_guard/ratio/p50\n    any:\n"
            "      - {metric: rl_guard/ratio/p50, op: '>', threshold: 2}\n"
            "      - {metric: rl_guard/ratio/p99, op: '>', threshold: 3}\n"
            "    action: warn\n"
        ),
        "rules[0]",
        2,
        "no metric of its own",
    ),
    (
        "op and spike together",
        rules(
            "  - name: s\n    metric: rl_guard/grad/norm\n    op: '>'\n    threshold: 1\n"
            "    spike: {method: mad}\n    action: warn\n"
        ),
        "rules[0]",
        2,
        "give exactly one of 'op' (with threshold/band) or 'spike'",
    ),
    (
        "spike without method",
        rules("  - name: s\n    metric: rl_guard/grad/norm\n    spike: {window: 10}\n    action: warn\n"),
        "rules[0].spike",
        4,
        "spike needs 'method'; allowed values: mad, ema_z, early_max",
    ),
    (
        "early_max with threshold",
        rules(
            "  - name: s\n    metric: rl_guard/grad/norm\n    spike:\n"
            "      method: early_max\n      threshold: 6\n    action: warn\n"
        ),
        "rules[0].spike.threshold",
        6,
        "early_max uses 'factor'",
    ),
    (
        "mad with factor",
        rules(
            "  - name: s\n    metric: rl_guard/grad/norm\n    spike:\n      method: mad\n"
            "      factor: 10\n    action: warn\n"
        ),
        "rules[0].spike.factor",
        6,
        "mad uses 'threshold' (a z-score), not 'factor'",
    ),
    (
        "spike window 1",
        rules("  - name: s\n    metric: rl_guard/grad/norm\n    spike: {method: mad, window: 1}\n    action: warn\n"),
        "rules[0].spike.window",
        4,
        "must be >= 2, got 1",
    ),
    (
        "lag_buckets not increasing",
        "lag_buckets: [0, 2, 2, 5]\n",
        "lag_buckets",
        1,
        "lag_buckets must be increasing integers starting at 0",
    ),
    (
        "yaml syntax error",
        "version: 1\nrules:\n  - name: a\n    metric: [unclosed\n    op: '>'\n",
        "<top level>",
        5,
        "not valid YAML",
    ),
    (
        "builtin_rules bad value",
        "builtin_rules:\n  nonfinite_loss: 3\n",
        "builtin_rules.nonfinite_loss",
        2,
        "expected false (disable), true, an action or {action: ...}; got 3",
    ),
    (
        "builtin_rules bad action",
        "builtin_rules:\n  nonfinite_grad: explode\n",
        "builtin_rules.nonfinite_grad",
        2,
        "'explode' is not allowed; allowed values: warn",
    ),
    (
        "builtin_rules unknown",
        "builtin_rules:\n  nonfinite_reward: false\n",
        "builtin_rules.nonfinite_reward",
        2,
        "unknown key 'nonfinite_reward'; allowed: nonfinite_loss, nonfinite_grad, nonfinite_logprobs",
    ),
    ("sinks not a list", "version: 1\nsinks: jsonl\n", "sinks", 2, "sinks must be a list"),
    (
        "unknown sink",
        "sinks:\n  - jsonl\n  - prometheus\n",
        "sinks[1]",
        3,
        "'prometheus' is not a sink; allowed values: jsonl, tensorboard, wandb, console",
    ),
    ("snapshots.every 0", "snapshots:\n  healthy_steps: 3\n  every: 0\n", "snapshots.every", 3, "must be >= 1, got 0"),
    ("snapshot where", "snapshots: {where: cloud}\n", "snapshots.where", 1, "allowed values: memory, disk"),
    ("lr_scale 0", "rollback:\n  lr_scale: 0\n", "rollback.lr_scale", 2, "must be > 0"),
    ("unsupported version", "version: 2\n", "version", 1, "unsupported version 2"),
    (
        "duplicate yaml key",
        "log_every: 1\nfail_mode: open\nlog_every: 5\n",
        "log_every",
        3,
        "duplicate key 'log_every'",
    ),
    ("rules not a list", "rules:\n  a: 1\n", "rules", 1, "rules must be a list of rule mappings"),
    ("top level not a mapping", "- a\n- b\n", "<top level>", 1, "expected a mapping, got list"),
]


@pytest.mark.parametrize("text, path, line, phrase", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_yaml_reports_path_line_and_reason(text, path, line, phrase):
    with pytest.raises(ConfigError) as info:
        load_config(text)
    found = [(format_path(p), ln, msg) for p, ln, msg in info.value.errors]
    assert any(p == path and ln == line and phrase in msg for p, ln, msg in found), found
    assert f"{path} (line {line}): " in str(info.value)


def test_several_errors_reported_at_once_in_line_order():
    text = (
        "version: 1\n"
        "sinks: jsonl\n"
        "rules:\n"
        "  - name: a\n"
        "    metric: rl_guard/kl_ref/k3_maen\n"
        "    op: '>'\n"
        "    threshold: 1\n"
        "    action: explode\n"
        "    patience: 0\n"
        "lag_buckets: [0, 3, 1]\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(text)
    errors = [(format_path(p), ln) for p, ln, _ in info.value.errors]
    assert errors == [
        ("sinks", 2),
        ("rules[0].metric", 5),
        ("rules[0].action", 8),
        ("rules[0].patience", 9),
        ("lag_buckets", 10),
    ]
    assert str(info.value).startswith("5 configuration error(s):\n")


def test_unsafe_yaml_tag_is_rejected_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    text = f"version: 1\nrules: !!python/object/apply:os.system ['touch {marker}']\n"
    with pytest.raises(ConfigError) as info:
        load_config(text)
    ((path, line, msg),) = info.value.errors
    assert line == 2 and "not valid YAML" in msg and "python/object" in msg
    assert not marker.exists()


def test_config_loading_uses_safe_loader_only():
    """No module in the package may parse YAML with a loader able to build arbitrary Python objects."""
    unsafe = re.compile(r"yaml\.(load|load_all|unsafe_load|full_load)\(|\b(Unsafe|Full)?Loader\b")
    for path in (ROOT / "rl_guard").rglob("*.py"):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not unsafe.search(line.replace("SafeLoader", "")), f"{path}:{lineno}: {line.strip()}"


def test_preset_and_defaults():
    cfg = load_config(ROOT / "configs" / "grpo.yaml")
    assert (ROOT / "configs" / "grpo.yaml").resolve() == (ROOT / "rl_guard" / "presets" / "grpo.yaml").resolve()
    assert cfg.rules and len({r["name"] for r in cfg.rules}) == len(cfg.rules)
    assert cfg.builtin_rules == {
        n: {"action": "skip_step"} for n in ("nonfinite_loss", "nonfinite_grad", "nonfinite_logprobs")
    }
    empty = load_config("version: 1\n")
    assert empty.rules == [] and empty.snapshots["healthy_steps"] == 3 and empty.rollback["max_rollbacks"] == 3
    assert empty.sinks == ["jsonl"] and empty.fail_mode == "open" and empty.lag_buckets == (0, 1, 2, 3, 5, 9)
    off = load_config("builtin_rules: {nonfinite_loss: false, nonfinite_grad: rollback}\n")
    assert off.builtin_rules["nonfinite_loss"] is None and off.builtin_rules["nonfinite_grad"] == {"action": "rollback"}


def test_every_preset_threshold_cites_a_source():
    """Each line of the GRPO preset that sets a threshold, band or spike carries a comment citing its source."""
    preset = ROOT / "rl_guard" / "presets" / "grpo.yaml"
    for lineno, line in enumerate(preset.read_text(encoding="utf-8").splitlines(), 1):
        if re.search(r"\b(threshold|band|spike|factor):", line):
            assert "#" in line, f"{preset.name}:{lineno} has no cited source: {line.strip()}"


def test_guard_from_yaml_raises_config_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - {name: a, metric: rl_guard/ratio/p50, op: '>', threshold: 1}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"rules\[0\]\.action \(line 2\): rule needs an 'action'"):
        Guard.from_yaml(bad, run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match="config file not found"):
        Guard.from_yaml(tmp_path / "missing.yaml")


def test_shipped_presets_load_by_name_and_unknown_names_list_them():
    from rl_guard.control.config import load_config as load

    assert [len(load(name).rules) > 5 for name in ("grpo", "ppo", "async")] == [True, True, True]
    with pytest.raises(ConfigError, match="shipped presets: async, grpo, ppo"):
        load("grpoo")
