"""The run directory's JSONL files line by line: cutting the torn last line a crash leaves, and
reading the records while skipping (and logging) a corrupt line."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)


def repair_torn_tail(path: Path) -> int:
    """Cuts a last line that lacks its newline (a write cut short by a crash); bytes dropped."""
    if not path.is_file():
        return 0
    with open(path, "r+b") as fh:
        size = fh.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return 0
        pos = size
        keep = 0
        while pos > 0:
            step = min(1 << 16, pos)
            pos -= step
            fh.seek(pos)
            chunk = fh.read(step)
            newline = chunk.rfind(b"\n")
            if newline != -1:
                keep = pos + newline + 1
                break
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())
        return size - keep


def iter_jsonl_file(path: Path) -> Iterator[dict]:
    """Records of a run-dir JSONL file; a corrupt line is logged and skipped."""
    if not path.is_file():
        return
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                log.warning("%s line %d is corrupt; ignoring it", path, number)
                continue
            if isinstance(record, dict):
                yield record
