"""Guard configuration: YAML schema, validation with key paths and line numbers, and every default.

All problems are collected and raised together as one ``ConfigError``. See ``configs/*.yaml`` for annotated presets.
Every default lives here (``DEFAULTS``, ``RULE_DEFAULTS``, ``SPIKE_DEFAULTS``, ``SEVERITY_BY_ACTION``); the rules
and actions read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import glossary
from ..errors import ConfigError
from ..stats.constants import DEFAULT_LAG_EDGES, STATS_ENGINES
from .action_names import ACTIONS, Action  # the action names, in precedence order
from .yaml_nodes import load_with_lines, read_source

OPS = (">", ">=", "<", "<=", "outside", "nonfinite")
SEVERITIES = ("info", "warning", "error", "critical")
SPIKE_METHODS = ("mad", "ema_z", "early_max")
DIRECTIONS = ("up", "down", "both")
FAIL_MODES = ("open", "closed")
# shadow: every action is only recorded (incidents say what it "would" have done); the run is never touched.
MODES = ("enforce", "shadow")
BUILTINS = ("nonfinite_loss", "nonfinite_grad", "nonfinite_logprobs")
TOP_KEYS = (
    "version",
    "run_dir",
    "lag_buckets",
    "builtin_rules",
    "snapshots",
    "rollback",
    "checkpoint",
    "sinks",
    "rules",
    "fail_mode",
    "max_internal_failures",
    "sharded_grads",
    "log_every",
    "mode",
    "max_consecutive_skips",
    "stats_engine",
    "quarantine",
)
RULE_KEYS = (
    "name",
    "metric",
    "op",
    "threshold",
    "band",
    "spike",
    "all",
    "any",
    "action",
    "warmup_steps",
    "patience",
    "cooldown_steps",
    "severity",
    "description",
)
COND_KEYS = ("metric", "op", "threshold", "band", "spike")
SPIKE_KEYS = ("method", "window", "threshold", "factor", "direction", "min_history")
SECTION_KEYS: dict[str, dict[str, tuple[Any, int | None]]] = {  # key -> (type or allowed values, minimum)
    "snapshots": {"healthy_steps": (int, 1), "every": (int, 1), "keep": (int, 1), "where": (("memory", "disk"), None)},
    "rollback": {"max_rollbacks": (int, 0), "lr_scale": (float, 0), "confirm_steps": (int, 1)},
    "checkpoint": {"dir": (str, None), "keep": (int, 1)},
    "quarantine": {"enabled": (bool, None), "max_share": (float, 0), "culprits": (int, 1)},
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "snapshots": {"healthy_steps": 3, "every": 10, "keep": 2, "where": "memory"},
    "rollback": {"max_rollbacks": 3, "lr_scale": 1.0, "confirm_steps": 1},
    "checkpoint": {"dir": "checkpoints", "keep": 3},
    # off by default: excluding data changes what the run trains on, which a user should choose
    "quarantine": {"enabled": False, "max_share": 0.1, "culprits": 4},
}
TOP_DEFAULTS: dict[str, Any] = {
    "mode": "enforce",
    "fail_mode": "open",
    "max_internal_failures": 3,
    "max_consecutive_skips": 0,
    "sharded_grads": None,
    "log_every": 1,
    "stats_engine": "auto",
    "sinks": ["jsonl"],
    "lag_buckets": list(DEFAULT_LAG_EDGES),
    "rules": [],
    "builtin_rules": {},
}
RULE_DEFAULTS = {"warmup_steps": 0, "patience": 1, "cooldown_steps": 0, "severity": None}
# Megatron flags grad-norm spikes at 10x the early max; a 6-sigma robust z is rare by chance (~1e-9 if normal).
SPIKE_DEFAULTS = {"window": 100, "factor": 10.0, "min_history": 8, "threshold": 6.0, "direction": "up"}
SEVERITY_BY_ACTION: dict[Action, str] = {
    "warn": "warning",
    "skip_step": "error",
    "rollback": "error",
    "early_stop": "critical",
    "checkpoint_and_halt": "critical",
}


@dataclass
class GuardConfig:
    rules: list[dict]
    builtin_rules: dict[str, dict | None]
    snapshots: dict = field(default_factory=lambda: dict(DEFAULTS["snapshots"]))
    rollback: dict = field(default_factory=lambda: dict(DEFAULTS["rollback"]))
    checkpoint: dict = field(default_factory=lambda: dict(DEFAULTS["checkpoint"]))
    quarantine: dict = field(default_factory=lambda: dict(DEFAULTS["quarantine"]))
    lag_buckets: tuple[int, ...] = DEFAULT_LAG_EDGES
    sinks: list = field(default_factory=lambda: list(TOP_DEFAULTS["sinks"]))
    run_dir: str | None = None
    fail_mode: str = TOP_DEFAULTS["fail_mode"]
    max_internal_failures: int = TOP_DEFAULTS["max_internal_failures"]
    sharded_grads: bool | None = TOP_DEFAULTS["sharded_grads"]  # None: detected from the gradients
    log_every: int = TOP_DEFAULTS["log_every"]
    mode: str = TOP_DEFAULTS["mode"]
    # 0: off; else the N-th consecutive dropped update escalates to checkpoint_and_halt
    max_consecutive_skips: int = TOP_DEFAULTS["max_consecutive_skips"]
    # auto: compiled on CUDA with Triton, else eager; eager: no compiler; compiled: torch.compile (stats/engines.py)
    stats_engine: str = TOP_DEFAULTS["stats_engine"]
    source_text: str = ""


class _Checker:
    def __init__(self, lines: dict[tuple, int]):
        self.lines = lines
        self.errors: list[tuple[tuple, int | None, str]] = []

    def err(self, path: tuple, msg: str) -> None:
        # A missing key has no line of its own: point at the mapping that lacks it.
        line = self.lines.get(path) or (self.lines.get(path[:-1]) if path else None)
        self.errors.append((path, line, msg))

    def keys(self, d: Any, allowed, path: tuple) -> bool:
        if not isinstance(d, dict):
            self.err(path, f"expected a mapping, got {type(d).__name__}")
            return False
        for k in d:
            if k not in allowed:
                self.err(path + (k,), f"unknown key {k!r}; allowed: {', '.join(allowed)}")
        return True

    def typed(self, d: dict, key: str, kind, path: tuple, minimum=None):
        if key not in d:
            return None
        v, p = d[key], path + (key,)
        if isinstance(kind, tuple):
            if v not in kind:
                self.err(p, f"{v!r} is not allowed; allowed values: {', '.join(map(str, kind))}")
            return v
        if kind is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        else:
            ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
        if not ok:
            self.err(p, f"expected {kind.__name__}, got {type(v).__name__} {v!r}")
        elif minimum is not None and v < minimum:
            self.err(p, f"must be >= {minimum}, got {v!r}")
        return v

    def metric(self, d: dict, path: tuple) -> None:
        name = d.get("metric")
        if not isinstance(name, str):
            self.err(path + ("metric",), "a metric name (string) is required, e.g. rl_guard/kl_ref/k3_mean")
        elif glossary.log_only(name):
            self.err(
                path + ("metric",),
                f"{name!r} is logged, not checked: it differs between ranks, and every rank "
                "must take the same decision; rules can watch every other rl_guard/guard/... metric",
            )
        elif not glossary.is_known(name):
            hint = glossary.closest(name)
            self.err(
                path + ("metric",),
                f"unknown metric {name!r}"
                + (f"; did you mean {hint!r}?" if hint else "")
                + " (all names: see the glossary, rl_guard.glossary.GLOSSARY)",
            )

    def condition(self, d: dict, path: tuple) -> None:
        self.metric(d, path)
        has_op, has_spike = "op" in d, "spike" in d
        if has_op == has_spike:
            self.err(path, "give exactly one of 'op' (with threshold/band) or 'spike'")
        if has_op:
            op = self.typed(d, "op", OPS, path)
            if op == "outside":
                band = d.get("band")
                if not (isinstance(band, list) and len(band) == 2 and all(isinstance(x, (int, float)) for x in band)):
                    self.err(path + ("band",), "op 'outside' needs band: [low, high] (two numbers)")
                elif band[0] >= band[1]:
                    self.err(path + ("band",), f"band low must be < high, got {band}")
                if "threshold" in d:
                    self.err(path + ("threshold",), "op 'outside' uses band: [low, high], not threshold")
            elif op in (">", ">=", "<", "<="):
                if "threshold" not in d:
                    self.err(path + ("threshold",), f"op {op!r} needs a numeric 'threshold'")
                self.typed(d, "threshold", float, path)
                if "band" in d:
                    self.err(path + ("band",), f"band is only for op 'outside', not {op!r}")
        if has_spike:
            self.spike(d["spike"], path + ("spike",))

    def spike(self, s: Any, path: tuple) -> None:
        if not self.keys(s, SPIKE_KEYS, path):
            return
        method = self.typed(s, "method", SPIKE_METHODS, path)
        if method is None:
            self.err(path, f"spike needs 'method'; allowed values: {', '.join(SPIKE_METHODS)}")
        self.typed(s, "window", int, path, minimum=2)
        self.typed(s, "threshold", float, path, minimum=0)
        self.typed(s, "factor", float, path, minimum=1)
        self.typed(s, "min_history", int, path, minimum=1)
        self.typed(s, "direction", DIRECTIONS, path)
        if method == "early_max" and "threshold" in s:
            self.err(path + ("threshold",), "early_max uses 'factor' (x times the early max), not 'threshold'")
        if method in ("mad", "ema_z") and "factor" in s:
            self.err(path + ("factor",), f"{method} uses 'threshold' (a z-score), not 'factor' (early_max only)")

    def rule(self, r: Any, path: tuple, names: set) -> None:
        if not self.keys(r, RULE_KEYS, path):
            return
        name = r.get("name")
        if not isinstance(name, str) or not name:
            self.err(path + ("name",), "every rule needs a unique 'name' (string)")
        elif name in names:
            self.err(path + ("name",), f"duplicate rule name {name!r}")
        elif name in BUILTINS:
            self.err(path + ("name",), f"{name!r} is a built-in rule name; configure it under builtin_rules")
        names.add(name)
        if "action" not in r:
            self.err(path + ("action",), f"rule needs an 'action'; allowed values: {', '.join(ACTIONS)}")
        self.typed(r, "action", ACTIONS, path)
        self.typed(r, "severity", SEVERITIES, path)
        for k in ("warmup_steps", "cooldown_steps"):
            self.typed(r, k, int, path, minimum=0)
        self.typed(r, "patience", int, path, minimum=1)
        groups = [k for k in ("all", "any") if k in r]
        if groups:
            if len(groups) > 1 or any(k in r for k in COND_KEYS):
                self.err(
                    path, "a composite rule has either 'all' or 'any' (a list of conditions) and no metric of its own"
                )
            subs = r[groups[0]]
            if not isinstance(subs, list) or len(subs) < 2:
                self.err(path + (groups[0],), "needs a list of at least two conditions")
                return
            for i, sub in enumerate(subs):
                if self.keys(sub, COND_KEYS, path + (groups[0], i)):
                    self.condition(sub, path + (groups[0], i))
        else:
            self.condition(r, path)


def load_config(source) -> GuardConfig:
    """Parse and validate a YAML file path or YAML text; raise ``ConfigError`` listing every problem."""
    text, origin = read_source(source)
    data, lines, duplicates = load_with_lines(text, origin)
    if data is None:  # an empty or comment-only file is a mistake (a wrong path, a truncated write)
        raise ConfigError(
            [((), None, f"{origin or 'the config'} is empty; a config of defaults says at least 'version: 1'")]
        )
    c = _Checker(lines)
    for path, line in duplicates:
        c.errors.append((path, line, f"duplicate key {path[-1]!r} (YAML would silently keep only the last one)"))
    if not c.keys(data, TOP_KEYS, ()):
        raise ConfigError(c.errors)
    version = c.typed(data, "version", int, ())
    if isinstance(version, int) and not isinstance(version, bool) and version != 1:
        c.err(("version",), f"unsupported version {data['version']!r}; this rl_guard reads version 1")
    c.typed(data, "run_dir", str, ())
    c.typed(data, "fail_mode", FAIL_MODES, ())
    c.typed(data, "sharded_grads", bool, ())
    c.typed(data, "log_every", int, (), minimum=1)
    c.typed(data, "mode", MODES, ())
    c.typed(data, "max_internal_failures", int, (), minimum=1)
    c.typed(data, "max_consecutive_skips", int, (), minimum=0)
    c.typed(data, "stats_engine", STATS_ENGINES, ())
    sections = {}
    for sec, spec in SECTION_KEYS.items():
        given = data.get(sec) or {}
        if c.keys(given, tuple(spec), (sec,)):
            for k, (kind, minimum) in spec.items():
                c.typed(given, k, kind, (sec,), minimum=minimum)
        sections[sec] = {**DEFAULTS[sec], **(given if isinstance(given, dict) else {})}
    top = {**TOP_DEFAULTS, **{k: v for k, v in data.items() if k in TOP_DEFAULTS}}
    buckets = top["lag_buckets"]
    if not (
        isinstance(buckets, list)
        and buckets
        and all(isinstance(b, int) and not isinstance(b, bool) for b in buckets)
        and buckets[0] == 0
        and all(a < b for a, b in zip(buckets, buckets[1:]))
    ):
        c.err(
            ("lag_buckets",),
            f"lag_buckets must be increasing integers starting at 0 (lower bucket edges), got {buckets!r}",
        )
    builtins = _builtins(top["builtin_rules"], c)
    rules = top["rules"]
    if not isinstance(rules, list):
        c.err(("rules",), "rules must be a list of rule mappings")
        rules = []
    names: set = set()
    for i, r in enumerate(rules):
        c.rule(r, ("rules", i), names)
    if sections["rollback"]["lr_scale"] == 0:
        c.err(("rollback", "lr_scale"), "must be > 0 (a zero learning rate would freeze training after a rollback)")
    if isinstance(sections["quarantine"]["max_share"], (int, float)) and sections["quarantine"]["max_share"] > 1:
        c.err(("quarantine", "max_share"), "a share of the prompts: must be <= 1")
    _check_sinks(top["sinks"], c)
    if c.errors:
        raise ConfigError(c.errors)
    return GuardConfig(
        rules=rules,
        builtin_rules=builtins,
        lag_buckets=tuple(buckets),
        sinks=top["sinks"],
        run_dir=data.get("run_dir"),
        fail_mode=top["fail_mode"],
        max_internal_failures=top["max_internal_failures"],
        sharded_grads=top["sharded_grads"],
        log_every=top["log_every"],
        mode=top["mode"],
        max_consecutive_skips=top["max_consecutive_skips"],
        stats_engine=top["stats_engine"],
        source_text=text,
        **sections,
    )


def _check_sinks(sinks: Any, c: _Checker) -> None:
    """A list of sink names or one-key mappings {name: {options}}. Options are checked here, against the sink's own
    constructor, so a typo is a located error at load instead of a sink that silently never starts."""
    from ..sinks import SINK_NAMES, sink_options_error

    if not isinstance(sinks, list):
        c.err(("sinks",), f"sinks must be a list, e.g. [{', '.join(SINK_NAMES)}]")
        return
    for i, item in enumerate(sinks):
        name = next(iter(item)) if isinstance(item, dict) and len(item) == 1 else item
        if not isinstance(name, str) or name not in SINK_NAMES:
            c.err(
                ("sinks", i),
                f"{item!r} is not a sink; allowed values: {', '.join(SINK_NAMES)} "
                "(a name or a one-key mapping {name: {options}})",
            )
        elif isinstance(item, dict):
            options = item[name]
            if options is not None and not isinstance(options, dict):
                c.err(("sinks", i, name), f"options for sink {name!r} must be a mapping, got {options!r}")
            elif options:
                for key, msg in sink_options_error(name, options):
                    c.err(("sinks", i, name) + ((key,) if key else ()), msg)


def _builtins(given: Any, c: _Checker) -> dict[str, dict | None]:
    """Built-in non-finite rules: on (action skip_step) unless set to false; an action name or {action: ...}
    changes the action."""
    out: dict[str, dict | None] = {name: {"action": "skip_step"} for name in BUILTINS}
    if not c.keys(given, BUILTINS, ("builtin_rules",)):
        return out
    for name, value in given.items():
        path = ("builtin_rules", name)
        if value is False:
            out[name] = None
        elif isinstance(value, str):
            if c.typed(given, name, ACTIONS, ("builtin_rules",)) in ACTIONS:
                out[name] = {"action": value}
        elif isinstance(value, dict):
            if c.keys(value, ("action",), path):
                c.typed(value, "action", ACTIONS, path)
                out[name] = {"action": value.get("action", "skip_step")}
        elif value is not True:
            c.err(path, f"expected false (disable), true, an action or {{action: ...}}; got {value!r}")
    return out
