"""Input files read as a stream: JSONL (plain / chat / OpenAI batch) and local dataset files.

Nothing here holds the file in memory but a JSON array: JSONL is read line by line with a byte
limit per line (a longer line is skipped to its newline and reported, never loaded), parquet,
arrow and CSV files are iterated through `datasets` in streaming mode, and a JSON array is parsed
whole by the standard library (as `datasets` would load it; its values keep their types). Every
record keeps its 1-based line (or row) number, and a shard (Slurm task) takes the records whose
number falls on it.
"""
from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from ..id_set import IdSet
from .columns import MetadataPresence, schema_problem, warn_metadata_fields_unused
from .input_records import (InputError, Parsed, RequestSpec, json_type_name, parse_dataset_row,
                            parse_openai, parse_plain_or_chat)
from ..recipe import IOConfig
from ..shipped_files import missing_file_problem
from batchinfer.engine.request import SamplingParams

DATASET_FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json"}
JSONL_SUFFIXES = {".jsonl", ".ndjson", ".jsonlines"}
SNIFF_LINES = 200


class InputFileError(Exception):
    """The input file as a whole cannot be read (missing, unknown format): exit 2."""


@dataclass(frozen=True)
class Shard:
    """Which records this process takes: those with (number - 1) % count == index."""

    index: int = 0
    count: int = 1

    def takes(self, number: int) -> bool:
        return self.count == 1 or (number - 1) % self.count == self.index

    def as_record(self) -> Optional[dict]:
        """run.json's and report.json's "shard" (None for an unsharded run)."""
        return {"index": self.index, "count": self.count} if self.count > 1 else None


@dataclass
class RawLine:
    number: int
    value: Any = None            # the parsed JSON value, when the line parsed
    error: Optional[InputError] = None


# --- JSONL ------------------------------------------------------------------------------------------
def iter_jsonl(path: Path, max_line_bytes: int, shard: Shard = Shard()) -> Iterator[RawLine]:
    """Non-blank lines of a JSONL file, parsed; undecodable lines come back with an error."""
    with open(path, "rb") as fh:
        for number, raw, size in _raw_lines(fh, max_line_bytes):
            if not shard.takes(number):
                continue
            if size:
                yield RawLine(number, error=InputError(
                    number, "line_too_long", f"the line has {size} bytes; io.max_line_bytes is "
                    f"{max_line_bytes}"))
            elif raw.strip():
                yield _decode_line(raw, number)


def _raw_lines(fh, max_line_bytes: int) -> Iterator[tuple[int, bytes, int]]:
    """(1-based number, the line's bytes (the first line's BOM removed), 0), or for a line longer
    than `max_line_bytes` (number, b"", its size): such a line is skipped to its newline, never
    held. What the reader yields and what the record count counts, read alike."""
    number = 0
    while True:
        raw = fh.readline(max_line_bytes + 1)
        if not raw:
            return
        number += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            yield number, b"", len(raw) + _skip_to_newline(fh)
            continue
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        yield number, raw, 0


def _skip_to_newline(fh) -> int:
    skipped = 0
    while True:
        chunk = fh.readline(1 << 20)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


def _decode_line(raw: bytes, number: int) -> RawLine:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RawLine(number, error=InputError(
            number, "invalid_utf8", f"the line is not valid UTF-8 (byte {exc.start}: "
            f"{raw[exc.start:exc.start + 4]!r})"))
    try:
        return RawLine(number, value=json.loads(text.rstrip("\r\n")))
    except json.JSONDecodeError as exc:
        return RawLine(number, error=InputError(
            number, "invalid_json", f"not valid JSON: {exc.msg} (column {exc.colno})"))
    except RecursionError:
        return RawLine(number, error=InputError(number, "invalid_json", "JSON nested too deeply"))


def input_file_problem(path: Path) -> Optional[str]:
    """Why `path` cannot be an input file (None: it can)."""
    if path.is_dir():
        return "is a directory; give the file of prompts (JSONL, parquet, arrow, csv or json)"
    return None if path.is_file() else missing_file_problem(path)


def sniff_jsonl(path: Path, max_line_bytes: int) -> str:
    """'openai' if the first parseable object looks like an OpenAI batch line, else 'jsonl'."""
    for i, line in enumerate(iter_jsonl(path, max_line_bytes)):
        if i >= SNIFF_LINES:
            break
        if isinstance(line.value, dict):
            return "openai" if ("custom_id" in line.value or "body" in line.value) else "jsonl"
    return "jsonl"


def detect_format(path: Path, io: IOConfig) -> str:
    """The concrete format of `path`: jsonl, openai, parquet, arrow, csv or json (datasets)."""
    if io.input_format != "auto":
        return io.input_format
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return sniff_jsonl(path, io.max_line_bytes)
    if suffix == ".json":
        # a JSON array is a dataset (iter_json_rows); one object per line is JSONL
        return "json" if _holds_json_array(path) else sniff_jsonl(path, io.max_line_bytes)
    if suffix in DATASET_FORMATS:
        return DATASET_FORMATS[suffix]
    raise InputFileError(
        f"{path}: cannot tell the input format from the extension {suffix or '(none)'}; use "
        f".jsonl, .parquet, .arrow, .csv or .json, or set io.input_format (allowed: jsonl, "
        "openai, parquet, arrow, csv, json)")


# --- datasets ----------------------------------------------------------------------------------------
def _holds_json_array(path: Path) -> bool:
    """Whether the file's first value is a JSON array (a BOM and white space before it allowed)."""
    with open(path, "rb") as fh:
        return fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def iter_json_rows(path: Path, max_line_bytes: int,
                   shard: Shard = Shard()) -> Iterator[tuple[int, Any]]:
    """(1-based element or line number, value) of a JSON file, parsed by the standard library: a
    JSON array's elements, or (io.input_format: json on JSON Lines) each line's value, every value
    as written. `datasets` reads JSON into typed arrow columns, which turns a column whose rows
    differ in type (ids 1 and "b2") into JSON-encoded strings: '"b2"' came back as the id and
    '"hi"' as the prompt. A line that is not JSON comes back as its InputError."""
    if not _holds_json_array(path):
        for line in iter_jsonl(path, max_line_bytes, shard):
            yield line.number, (line.error if line.error else line.value)
        return
    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read().decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputFileError(f"{path}: not a valid JSON array ({exc})") from None
    if not isinstance(data, list):
        raise InputFileError(f"{path}: a JSON file of requests holds an array of objects")
    for number, row in enumerate(data, start=1):
        if shard.takes(number):
            yield number, row


def iter_dataset_rows(path: Path, fmt: str, shard: Shard = Shard()) -> Iterator[tuple[int, dict]]:
    """(1-based row number, row) from a local dataset file, streamed by `datasets`."""
    # its readers log a failure before raising it; the InputFileError below says it once
    logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)
    if fmt == "parquet" and _parquet_rows(path) == 0:
        return    # no rows, as a CSV of a header alone: `datasets` fails ("BatchSize must be > 0")
    try:
        from datasets import load_dataset

        dataset = load_dataset(fmt, data_files=str(path), split="train", streaming=True)
        for number, row in enumerate(dataset, start=1):
            if shard.takes(number):
                yield number, row
    except (ValueError, OSError, ImportError) as exc:
        raise InputFileError(f"{path}: cannot read it as {fmt} ({str(exc).strip()})") from None
    except Exception as exc:  # pyarrow and datasets raise their own error types
        if type(exc).__module__.split(".")[0] in ("pyarrow", "datasets"):
            raise InputFileError(f"{path}: cannot read it as {fmt} ({str(exc).strip()})") from None
        raise


def _parquet_rows(path: Path) -> Optional[int]:
    """The rows a parquet file's footer says it holds (None: it cannot be read as parquet)."""
    try:
        import pyarrow.parquet as pq

        return pq.ParquetFile(str(path)).metadata.num_rows
    except Exception:       # not parquet: `datasets` says why when it reads it
        return None


def count_records(path: Path, fmt: str, shard: Shard = Shard(),
                  max_line_bytes: int = 4 << 20) -> Optional[int]:
    """How many records the shard will see (lines, or rows), or None if that is costly to know
    (`max_line_bytes`: io.max_line_bytes, past which a line is one error record)."""
    if fmt in ("jsonl", "openai"):
        return _count_jsonl_records(path, shard, max_line_bytes)
    lines = _parquet_rows(path) if fmt == "parquet" else None
    if lines is None:
        return None
    return len(range(shard.index, lines, shard.count))


def _count_jsonl_records(path: Path, shard: Shard, max_line_bytes: int) -> int:
    """The lines iter_jsonl yields for the shard: every line but blank ones (a blank line is no
    record, so a finished job has nothing remaining)."""
    with open(path, "rb") as fh:
        return sum(1 for number, raw, size in _raw_lines(fh, max_line_bytes)
                   if shard.takes(number) and (size or raw.strip()))


# --- records -> specs -----------------------------------------------------------------------------
class InputReader:
    """Streams an input file as RequestSpec / InputError, in input order, duplicates flagged.

    `done_ids` are the ids a previous run wrote to outputs; `done_lines` the line numbers (as
    strings) it wrote to errors. Those records are skipped, but a done id still counts as seen, so a
    later line repeating it is still reported as a duplicate.
    """

    def __init__(self, path: Path, io: IOConfig, defaults: SamplingParams, shard: Shard = Shard(),
                 fmt: Optional[str] = None, limit: Optional[int] = None, embed: bool = False):
        self.path = Path(path)
        self.embed = embed        # an embedding job's records (runner/io/embed_inputs.py)
        problem = input_file_problem(self.path)
        if problem:
            raise InputFileError(f"{self.path}: {problem}")
        self.io = io
        self.defaults = defaults
        self.shard = shard
        self.format = fmt or detect_format(self.path, io)
        if self.format in ("parquet", "arrow", "csv"):
            # an empty, corrupt or (CSV) malformed file fails here, before a model loads: the
            # reader parses its first chunk (a CSV row past it fails the job part way, exit 2)
            with contextlib.closing(iter_dataset_rows(self.path, self.format)) as probe:
                first = next(probe, None)
            problem = schema_problem(io, first[1]) if first is not None else None
            if problem:             # every row would be the same error record, or null
                raise InputFileError(f"{self.path}: {problem}")
        warn_metadata_fields_unused(io, self.path, self.format)
        self.limit = limit
        self._presence: Optional[MetadataPresence] = None
        self.seen = IdSet()
        self.records_read = 0
        self.skipped_done = 0
        self._warned_body_keys: set = set()  # an embedding job's ignored OpenAI body keys

    def total(self, limited: bool = True) -> Optional[int]:
        """Records of this shard, up to --limit unless `limited` is false (None where they are
        not known without reading every record)."""
        total = count_records(self.path, self.format, self.shard, self.io.max_line_bytes)
        if total is not None and self.limit is not None and limited:
            total = min(total, self.limit)
        return total

    def _parsed(self) -> Iterator[Parsed]:
        if self.format in ("jsonl", "openai"):
            parse = parse_openai if self.format == "openai" else parse_plain_or_chat
            if self.embed:
                from .embed_inputs import parse_embed_openai, parse_embed_plain

                if self.format == "openai":     # ignored body keys: one warning per job
                    parse = lambda value, number, _: parse_embed_openai(  # noqa: E731
                        value, number, self._warned_body_keys)
                else:
                    parse = lambda value, number, _: parse_embed_plain(value, number)  # noqa: E731
            hint = self._columns_hint()
            for line in iter_jsonl(self.path, self.io.max_line_bytes, self.shard):
                item = line.error if line.error else parse(line.value, line.number, self.defaults)
                if isinstance(item, InputError) and item.code == "unsupported_url" and \
                        not self.embed and "/v1/embeddings" in item.message:
                    item.message += "; for embeddings set model.task: embed"
                if hint and isinstance(item, InputError) and item.code in ("unknown_key",
                                                                           "missing_prompt"):
                    item.message += hint
                yield item
        else:
            io = self.io
            rows = (iter_json_rows(self.path, io.max_line_bytes, self.shard)
                    if self.format == "json" else
                    iter_dataset_rows(self.path, self.format, self.shard))
            # JSON rows have no schema: a metadata column may be missing from some of them
            presence = self._presence = (MetadataPresence(io, self.path)
                                         if self.format == "json" else None)
            for number, row in rows:
                if presence is not None:
                    presence.row(row)
                if isinstance(row, InputError):
                    yield row
                elif not isinstance(row, dict):
                    yield InputError(number, "not_an_object", "a request must be a JSON object, "
                                     f"not {json_type_name(row)}")
                elif self.embed:
                    from .embed_inputs import parse_embed_row

                    yield parse_embed_row(row, number, io.prompt_field, io.messages_field,
                                          io.id_field, io.metadata_fields,
                                          blank_is_null=self.format == "csv")
                else:
                    yield parse_dataset_row(row, number, self.defaults, io.prompt_field,
                                            io.messages_field, io.id_field, io.metadata_fields,
                                            blank_is_null=self.format == "csv",
                                            lora_field=io.lora_field)
            if presence is not None:
                presence.finish()

    def _columns_hint(self) -> str:
        """For a JSONL line the recipe's io.*_field settings do not apply (its keys are the
        request's own); said where a line fails and the recipe names other columns."""
        io = self.io
        named = [f"io.{key}: {getattr(io, key)}"
                 for key, plain in (("prompt_field", "prompt"), ("messages_field", "messages"),
                                    ("id_field", "id")) if getattr(io, key) != plain]
        if self.format != "jsonl" or not named:
            return ""
        return (f" (the recipe's {', '.join(named)} apply to dataset files; to read JSON Lines "
                "by those columns set io.input_format: json and run into a new --output, where "
                "each line is a row: those columns alone are read)")

    def _id_key(self) -> str:
        """What this format calls a request's id, as messages name it."""
        if self.format == "openai":
            return "custom_id"
        if self.format == "jsonl":
            return "id"
        return f"{self.io.id_field} (io.id_field)"

    def __iter__(self) -> Iterator[Parsed]:
        return self.records()

    def records(self, done_ids: Optional[IdSet] = None,
                done_lines: Optional[IdSet] = None) -> Iterator[Parsed]:
        for item in self._parsed():
            if self.limit is not None and self.records_read >= self.limit:
                if self._presence is not None:
                    self._presence.finish()        # the rows read are all there will be
                return
            self.records_read += 1
            already_reported = bool(done_lines) and str(item.line) in done_lines
            if isinstance(item, RequestSpec):
                if not self.seen.add(item.request_id):
                    key = self._id_key()
                    item = InputError(item.line, "duplicate_id",
                                      f"{key} {item.request_id!r} appears on an earlier line; "
                                      f"each request's {key} must be unique",
                                      request_id=item.request_id,
                                      custom_id=item.custom_id, metadata=item.metadata,
                                      openai_url=item.openai_url)
                elif done_ids is not None and item.request_id in done_ids:
                    self.skipped_done += 1
                    continue
            elif item.request_id is not None:
                self.seen.add(item.request_id)    # a line takes its id, valid or not: a later
                #                                   line repeating it is a duplicate
            if already_reported:
                self.skipped_done += 1
                continue
            yield item
