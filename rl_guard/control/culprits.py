"""Culprits and incident bundles: when a rule acts, which sequences drove it, and a folder a person can debug from.

Adapters report, once per generation batch, the few candidate sequences of each family (``Guard.observe_culprits``):
for rewards, those with a non-finite reward and the most extreme ones, with their prompt, completion and reward per
function. When a rule acts (anything but ``warn``), the candidates of the family its metric belongs to are its
culprits: they go into the incident record, and ``run_dir/incidents/<step>/`` gets ``bundle.json`` (the rules and
their windows, the culprits, the learning rates, the guard's counters) and ``rng.pt`` (the RNG states). The bundle is
bounded (``quarantine.culprits`` sequences per family, texts cut at ``TEXT_LIMIT`` characters) and written only on
the steps a rule acts.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from ..sinks.jsonl import to_jsonable

TEXT_LIMIT = 2000  # characters of a prompt or completion kept in a bundle
IDS_LIMIT = 512  # token ids of a completion kept

# metric prefix -> culprit family; a rule on another metric names no culprits (yet)
FAMILIES = {"rl_guard/input/rewards/": "rewards", "rl_guard/reward/": "rewards"}


def prompt_key(prompt) -> str:
    """A stable key of a prompt as the dataset holds it (text, or a list of chat messages)."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def cut(text) -> str:
    text = text if isinstance(text, str) else json.dumps(text, default=str)
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + f"... [{len(text) - TEXT_LIMIT} more characters]"


def family_of(metric: str | None) -> str | None:
    return next((family for prefix, family in FAMILIES.items() if metric and metric.startswith(prefix)), None)


def culprits_for(metric: str | None, found: list[dict]) -> list[dict]:
    """The candidates behind a firing on ``metric`` (``found``: its family's): for a non-finite metric the non-finite
    sequences, else all."""
    if metric and "nonfinite" in metric:
        return [c for c in found if c.get("nonfinite")]
    return found


def write_bundle(run_dir: Path, step: int, record: dict, rng: dict) -> tuple[Path, int, float]:
    """``run_dir/incidents/<step>/bundle.json`` (+ ``rng.pt``); returns the folder, its bytes and the seconds taken."""
    import torch

    start = time.perf_counter()
    folder = run_dir / "incidents" / f"{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(to_jsonable(record), indent=1, allow_nan=False)
    (folder / "bundle.json").write_text(text + "\n", encoding="utf-8")
    torch.save(rng, folder / "rng.pt")
    size = sum(p.stat().st_size for p in folder.iterdir())
    return folder, size, time.perf_counter() - start
