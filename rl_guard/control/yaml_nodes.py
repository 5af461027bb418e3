"""Safe YAML loading that remembers the line of every key, so errors can point at it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError

PRESETS = Path(__file__).resolve().parents[1] / "presets"


def read_source(source) -> tuple[str, str]:
    """(yaml_text, origin) from a path, a shipped preset name (``grpo``, ``ppo``, ``async``) or YAML text.
    A one-line string naming neither an existing file nor a preset is a path error."""
    one_line = isinstance(source, str) and source.strip() and "\n" not in source and ":" not in source
    if isinstance(source, Path) or one_line:
        path = Path(source)
        if not path.is_file() and (PRESETS / f"{source}.yaml").is_file():
            path = PRESETS / f"{source}.yaml"
        if not path.is_file():
            presets = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
            raise ConfigError([(("",), None, f"config file not found: {source} (shipped presets: {presets})")])
        return path.read_text(encoding="utf-8"), str(path)
    return str(source), "<yaml text>"


def load_with_lines(text: str, origin: str) -> tuple[Any, dict[tuple, int], list[tuple[tuple, int]]]:
    """Parse with ``yaml.SafeLoader`` only (no arbitrary tags such as ``!!python/object``); return
    (data, {key path: 1-based line}, [(path, line) of every repeated key in a mapping])."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None  # None: empty or comments only
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise ConfigError([(("",), line, f"{origin}: not valid YAML: {getattr(exc, 'problem', exc)}")]) from None
    finally:
        loader.dispose()
    lines: dict[tuple, int] = {}
    duplicates: list[tuple[tuple, int]] = []
    if node is not None:
        _walk(node, (), lines, duplicates)
    return data, lines, duplicates


def _walk(node, path: tuple, lines: dict, duplicates: list) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            child = path + (key_node.value,)
            if key_node.value in seen:
                duplicates.append((child, key_node.start_mark.line + 1))
            seen.add(key_node.value)
            lines[child] = key_node.start_mark.line + 1
            _walk(value_node, child, lines, duplicates)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, path + (i,), lines, duplicates)
