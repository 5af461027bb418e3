"""Errors meant for people."""

from __future__ import annotations


def format_path(path: tuple) -> str:
    out = ""
    for part in path:
        if part == "":
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


class InputError(ValueError):
    """Something the caller passed is wrong (a config, a token batch, a sample batch). Always raised: it is a bug
    upstream, not a failure of the guard, so ``fail_mode`` never swallows it."""


class ConfigError(InputError):
    """Every configuration problem, all at once: key path, YAML line and what is allowed."""

    def __init__(self, errors: list[tuple[tuple, int | None, str]]):
        self.errors = sorted(errors, key=lambda e: e[1] or 0)
        super().__init__(self._render())

    def _render(self) -> str:
        lines = [f"{len(self.errors)} configuration error(s):"] if len(self.errors) > 1 else []
        for path, line, msg in self.errors:
            where = format_path(path) + (f" (line {line})" if line else "")
            lines.append(f"{where}: {msg}")
        return "\n".join(lines)


class GuardHalted(RuntimeError):
    """Raised by adapters that must stop a loop they do not own (the guard decided to halt)."""

    @classmethod
    def of(cls, decision) -> GuardHalted:
        return cls("; ".join(decision.messages) or f"rl_guard halted at step {decision.step}")
