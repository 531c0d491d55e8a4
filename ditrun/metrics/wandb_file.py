"""What an offline W&B run holds, read back from its ``.wandb`` file, so that a later attempt of a run logs only
the edits no earlier attempt's file holds (``metrics.wandb``).

A ``.wandb`` file is a 7-byte header (``:W&B``, magic 0xBEE1, version), then a log of 32 KiB blocks holding
chunks (4-byte checksum, 2-byte length, 1-byte type: full, first, middle, last) that join into protobuf
records. A file whose writer was killed ends early, anywhere: what is whole before that point is read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    """The whole protobuf records of ``path``, in order; [] for a file that is not a W&B log."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if len(data) < HEADER.size or HEADER.unpack(data[: HEADER.size])[:2] != (b":W&B", 0xBEE1):
        return []
    pos, parts, records = HEADER.size, [], []
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        _checksum, length, kind = CHUNK.unpack(data[pos : pos + CHUNK.size])
        if left < CHUNK.size or (kind == 0 and length == 0):  # the rest of the block is padding
            pos += left
            continue
        if pos + CHUNK.size + length > len(data):
            break  # torn: the writer stopped inside this chunk
        parts.append(data[pos + CHUNK.size : pos + CHUNK.size + length])
        pos += CHUNK.size + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def items(entries) -> dict:
    """A history row's or summary update's items as a dict (nested keys joined with "/")."""
    return {entry.key or "/".join(entry.nested_key): json.loads(entry.value_json) for entry in entries}


def earlier_attempts(wandb_dir: Path, run_id: str) -> tuple[list[dict], bool]:
    """Every history row (``_step`` included) of the offline files of the W&B run ``run_id`` under ``wandb_dir``,
    oldest first, and whether the last of them ended (its exit record was written); each file read once."""
    rows, ended = [], False
    for path in offline_files(wandb_dir, run_id):
        records = read_records(path)
        rows += [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
        ended = any(r.WhichOneof("record_type") == "exit" for r in records)
    return rows, ended


def offline_files(wandb_dir: Path, run_id: str) -> list[Path]:
    """The ``.wandb`` files of every offline attempt of the W&B run ``run_id`` under ``wandb_dir``, oldest first."""
    return sorted(wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
