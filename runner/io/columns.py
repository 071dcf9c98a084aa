"""The recipe's io.*_field settings against the columns an input file has.

A file with a schema (parquet, arrow, CSV) has its columns known from its first row, so a
setting that names a column it lacks is refused before a model loads (exit 2): a misspelled
io.metadata_fields column would otherwise put null into every output. Rows without a schema (a
JSON array, or JSON Lines read as rows) may leave a column out of some rows, so a metadata column
missing from the first rows is a warning, once, and the job goes on. JSONL requests carry their
own "metadata" object: io.metadata_fields does not apply to them, which is said once too.
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional

from ..recipe import IOConfig
from ..recipe_errors import quoted_with_hints

log = logging.getLogger("batchinfer")
# rows a JSON file's metadata columns are looked for in before a missing one is warned of
PRESENCE_ROWS = 200
_warned: set = set()     # (file, warning): a job reads its input more than once (auto settings)


def _warn_once(key: tuple, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def _columns_text(columns: list[str]) -> str:
    return ", ".join(map(str, columns)) or "(none)"


def schema_problem(io: IOConfig, columns: Iterable) -> Optional[str]:
    """What is wrong with the recipe's columns for a file whose rows have `columns` (None:
    nothing); the message goes after the file's path."""
    columns = [str(c) for c in columns]
    if not {io.prompt_field, io.messages_field} & set(columns):
        return (f"no '{io.prompt_field}' or '{io.messages_field}' column (columns: "
                f"{_columns_text(columns)}); set io.prompt_field or io.messages_field")
    missing = [name for name in io.metadata_fields if name not in columns]
    if not missing:
        return None
    return (f"io.metadata_fields names {'columns' if len(missing) > 1 else 'a column'} the file "
            f"does not have: {quoted_with_hints(missing, columns)} (columns: "
            f"{_columns_text(columns)}); list only the file's columns")


def warn_metadata_fields_unused(io: IOConfig, path, fmt: str) -> None:
    """JSONL requests (plain, chat, OpenAI) carry their own metadata object."""
    if io.metadata_fields and fmt in ("jsonl", "openai"):
        _warn_once((str(path), "unused", tuple(io.metadata_fields)),
                   "%s: io.metadata_fields (%s) applies to dataset files and JSON read as rows "
                   "(io.input_format: json), not to %s lines: each line's own 'metadata' "
                   "object is what its output carries", path, ", ".join(io.metadata_fields),
                   "OpenAI batch" if fmt == "openai" else "JSONL")


class MetadataPresence:
    """For rows without a schema: which io.metadata_fields columns the first PRESENCE_ROWS rows
    hold. A column none of them holds is warned of once (then or at the end of a shorter file),
    naming it; its rows keep null, as a sparse column's do."""

    def __init__(self, io: IOConfig, path):
        self.path = path
        self.missing = set(io.metadata_fields)
        self.rows = 0
        self.seen_keys: set = set()
        self.done = not self.missing

    def row(self, row) -> None:
        if self.done or not isinstance(row, dict):
            return
        self.rows += 1
        self.missing.difference_update(row)
        if len(self.seen_keys) < 100:
            self.seen_keys.update(map(str, row))
        if not self.missing or self.rows >= PRESENCE_ROWS:
            self.finish()

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        if not self.missing or not self.rows:
            return
        names = quoted_with_hints(sorted(self.missing), self.seen_keys)
        rows = (f"the first {self.rows} rows" if self.rows >= PRESENCE_ROWS else
                f"the {self.rows} row{'s' if self.rows > 1 else ''} read")
        one = len(self.missing) == 1
        _warn_once((str(self.path), "missing", tuple(sorted(self.missing))),
                   "%s: io.metadata_fields %s %s in none of %s (keys: %s); metadata holds null "
                   "for %s", self.path, names, "is" if one else "are", rows,
                   _columns_text(sorted(self.seen_keys)), "it" if one else "them")
