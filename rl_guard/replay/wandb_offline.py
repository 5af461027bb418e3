"""An offline wandb run directory: the ``run-*.wandb`` transaction log, decoded record by record.

The file is a leveldb-style log (32 KiB blocks of 7-byte-headed chunks) of wandb's ``Record`` protobufs; the
protobuf classes come from the installed wandb package. History rows are keyed by ``rl_guard/step`` (the guard's
wandb sink), else ``train/global_step`` (transformers' wandb callback), else wandb's ``_step``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from .history import History, HistoryFormatError, ordered
from .names import carry_generation, map_record

BLOCK = 32768
STEP_KEYS = ("rl_guard/step", "train/global_step", "_step")


def records(path: Path):
    """Yield the protobuf ``Record``s of a .wandb file (a torn last record, from a crash, is dropped)."""
    try:
        from wandb.proto import wandb_internal_pb2 as pb
    except ImportError as exc:
        raise HistoryFormatError(path, "reading wandb files needs the wandb package (pip install wandb)") from exc
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise HistoryFormatError(path, "not a wandb transaction log (no ':W&B' header)")
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # a torn last record (a crash, or a write still under way): dropped
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:  # zero padding up to the block end
            pos += left - 7 - length
            continue
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start a record, MIDDLE/LAST extend it
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def _value(text: str):
    try:
        return json.loads(text)  # wandb writes NaN / Infinity as JSON extensions, which json.loads accepts
    except ValueError:
        return None


def read(path: Path) -> History:
    files = [path] if path.is_file() else sorted(path.rglob("run-*.wandb"))
    if len(files) != 1:
        raise HistoryFormatError(
            path,
            "not exactly one wandb run: pass one run directory or .wandb file (found "
            + (", ".join(str(f) for f in files) or "none")
            + ")",
        )
    rows: dict[int, dict] = {}
    origin: dict[str, str] = {}
    for rec in records(files[0]):
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {"/".join(i.nested_key) if i.nested_key else i.key: _value(i.value_json) for i in rec.history.item}
        step = next((row[k] for k in STEP_KEYS if isinstance(row.get(k), (int, float))), None)
        if step is None:
            continue
        metrics, where = map_record({k: v for k, v in row.items() if k not in STEP_KEYS})
        if metrics:
            rows.setdefault(int(step), {}).update(metrics)
            origin.update(where)
    carry_generation(rows, origin)
    return History(files[0], "wandb offline", ordered(rows), origin)
