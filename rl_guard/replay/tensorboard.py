"""A TensorBoard event directory, read with TensorBoard's own ``EventAccumulator``.

Scalars written by the guard's TensorBoard sink are already ``rl_guard/...``; a transformers/TRL run's
``train/<key>`` scalars are mapped (``names``). Event files store float32: a replay on them can differ from the live
guard (float64) on values that sit exactly at a threshold.
"""

from __future__ import annotations

from pathlib import Path

from .history import History, HistoryFormatError, ordered
from .names import carry_generation, map_record


def read(path: Path) -> History:
    try:
        from tensorboard.backend.event_processing import event_accumulator as ea
    except ImportError as exc:  # optional: only needed for this format
        raise HistoryFormatError(
            path, "reading TensorBoard files needs the tensorboard package (pip install tensorboard)"
        ) from exc
    directory = path.parent if path.is_file() else path
    dirs = sorted({f.parent for f in directory.rglob("events.out.tfevents.*")})
    if len(dirs) != 1:
        raise HistoryFormatError(
            path, "event files in several directories: pass one of " + ", ".join(str(d) for d in dirs)
        )
    acc = ea.EventAccumulator(str(dirs[0]), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    raw: dict[int, dict] = {}
    for tag in acc.Tags().get("scalars", []):
        for event in acc.Scalars(tag):
            raw.setdefault(int(event.step), {})[tag] = float(event.value)
    rows, origin = {}, {}
    for step, values in raw.items():
        rows[step], where = map_record(values)
        origin.update(where)
    rows = {s: r for s, r in rows.items() if r}
    carry_generation(rows, origin)
    return History(dirs[0], "tensorboard", ordered(rows), origin)
