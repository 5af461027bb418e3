"""Quarantine: prompts whose sequences made the guard act are kept out of further sampling.

With ``quarantine: {enabled: true}``, a ``skip_step`` or ``rollback`` whose rule names culprit sequences
(``culprits.py``) adds their prompts here; the adapter then stops them from being trained on again (TRL: each
quarantined prompt's rows are replaced by another prompt's before generation). Keys travel in the guard's state, so a
resumed run keeps them, and each addition is a line of ``run_dir/quarantine.jsonl``. When the quarantined prompts
exceed ``max_share`` of the data, the step escalates to ``checkpoint_and_halt``: a reward function that fails for
many prompts is broken, and stepping around it would hide that.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..sinks.jsonl import to_jsonable


class Quarantine:
    def __init__(self, max_share: float):
        self.max_share = max_share
        self.keys: dict[str, dict] = {}  # prompt key -> {"prompt", "step", "rule"}
        self.population: int | None = None  # prompts in the data (the adapter knows; else those seen)
        self.seen: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, culprits: list[dict], step: int, rule: str, run_dir: Path | None) -> list[dict]:
        """Quarantine the culprits' prompts; returns the entries that are new."""
        new = []
        for c in culprits:
            key = c.get("prompt_key")
            if key is None or key in self.keys:
                continue
            entry = {"prompt_key": key, "prompt": c.get("prompt"), "step": step, "rule": rule, "time": time.time()}
            self.keys[key] = entry
            new.append(entry)
        if new and run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            with open(run_dir / "quarantine.jsonl", "a", encoding="utf-8") as f:
                f.writelines(json.dumps(to_jsonable(e)) + "\n" for e in new)
        return new

    def share(self) -> float:
        total = self.population or len(self.seen | set(self.keys)) or 1
        return len(self.keys) / total

    def over_limit(self) -> bool:
        return self.share() > self.max_share

    def state_dict(self) -> dict:
        return {"keys": dict(self.keys)}

    def load_state_dict(self, state: dict) -> None:
        self.keys = dict(state.get("keys", {}))
