"""docs/config.md documents every key the config loader accepts, with its default and its allowed values.

The keys come from the loader's own structures (``rl_guard/control/config.py`` and the sink registry it checks
sink options against), so a key added there and not documented fails here, by name."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import yaml

from rl_guard.control import config
from rl_guard.sinks import _REGISTRY as SINKS

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def documented_keys() -> dict[str, object]:
    """Every accepted key as it is written in docs/config.md -> its default (``inspect.Parameter.empty`` if none)."""
    none = inspect.Parameter.empty
    keys: dict[str, object] = {k: config.TOP_DEFAULTS.get(k, none) for k in config.TOP_KEYS}
    keys["version"] = 1
    for section, spec in config.SECTION_KEYS.items():
        keys.update({f"{section}.{k}": config.DEFAULTS[section].get(k, none) for k in spec})
    keys.update({f"rules[].{k}": config.RULE_DEFAULTS.get(k, none) for k in config.RULE_KEYS})
    keys.update({f"spike.{k}": config.SPIKE_DEFAULTS.get(k, none) for k in config.SPIKE_KEYS})
    keys.update({f"builtin_rules.{k}": none for k in config.BUILTINS})
    for name, cls in SINKS.items():
        keys[name] = none
        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
            keys[f"{name}.{p.name}"] = p.default
    return keys


def allowed_values() -> list[str]:
    from rl_guard.stats.constants import STATS_ENGINES

    where = config.SECTION_KEYS["snapshots"]["where"][0]
    return [
        *config.ACTIONS,
        *config.OPS,
        *config.SEVERITIES,
        *config.SPIKE_METHODS,
        *config.DIRECTIONS,
        *config.FAIL_MODES,
        *config.MODES,
        *STATS_ENGINES,
        *where,
    ]


def doc_rows() -> dict[str, list[str]]:
    """First cell of every table row (a backticked key) -> the row's other cells."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m[1]] = [c.strip() for c in m[2].split("|")]
    return rows


def as_yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n").removesuffix("\n...")


@pytest.mark.parametrize("key", sorted(documented_keys()))
def test_every_accepted_key_is_documented_with_its_default(key):
    rows = doc_rows()
    if key not in rows:
        pytest.fail(f"config key {key!r} is accepted by the loader but has no row in docs/config.md")
    default = documented_keys()[key]
    if isinstance(default, (bool, int, float, str, list)) or default is None:
        assert f"`{as_yaml(default)}`" in rows[key][0], (
            f"docs/config.md gives {key!r} the default {rows[key][0]!r}; the loader's default is {as_yaml(default)}"
        )


def test_every_allowed_value_is_documented():
    text = DOC.read_text(encoding="utf-8")
    missing = [v for v in allowed_values() if f"`{v}`" not in text]
    assert not missing, f"allowed values missing from docs/config.md: {missing}"


def test_a_condition_takes_only_keys_a_rule_takes():
    # docs/config.md documents the keys of a condition in all: / any: as the rule keys of the same name
    assert set(config.COND_KEYS) <= set(config.RULE_KEYS)
