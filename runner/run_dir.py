"""The run directory: the only code that writes (or reads back) a job's files.

    outputs.jsonl        one record per finished request, appended and flushed as it completes
    history.jsonl        per finished request: prompt, token counts, finish reason, model (the
                         length predictors' training data; predictors/history.py)
    errors.jsonl         one record per failed request or bad input line (with its line number)
    metrics.jsonl        timeline samples
    report.json / .md    refreshed while the job runs; plots/*.png beside them
    recipe.resolved.yaml the recipe with every default filled in
    run.json             what input, which shard, which sessions

Crash safety: results are appended and flushed one by one, so after kill -9 the files hold every
result written so far plus at most one torn last line, which `open_run_dir` cuts off. Resume then
skips the ids in outputs.jsonl and the lines in errors.jsonl. Reports and plots are replaced
atomically (write a temporary file in the directory, then rename), never half-written. A write
that fails (disk full, file-size limit) is undone and raised as RunDirWriteError (exit 3): the
files stay as they were, and the rerun completes once there is room.
A lock file (flock, released by the kernel when the process dies) keeps two runs out of one directory.
Under Slurm each task owns part-IIIII-of-NNNNN/ inside the run directory.
"""
from __future__ import annotations

import base64
import errno
import fcntl
import json
import logging
import math
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import jsonlines

from batchinfer.engine.errors import BatchInferError, ConfigError
from .id_set import IdSet
from .io.inputs import Shard
from .io.records import record_id
from .jsonl_lines import iter_jsonl_file, repair_torn_tail

log = logging.getLogger(__name__)

OUTPUTS, ERRORS, METRICS, HISTORY = ("outputs.jsonl", "errors.jsonl", "metrics.jsonl",
                                     "history.jsonl")
REPORT_JSON, REPORT_MD, RECIPE, MANIFEST, PLOTS, LOCK = (
    "report.json", "report.md", "recipe.resolved.yaml", "run.json", "plots", ".lock")
_SESSION_FILES = (RECIPE, MANIFEST)   # what a start writes before any request runs
PART_RE = re.compile(r"^part-(\d{5})-of-(\d{5})$")
_UMASK = os.umask(0)
os.umask(_UMASK)


class RunDirError(ConfigError):
    """The run directory cannot be used as asked (locked, other layout, exists with --no-resume,
    not writable)."""


class RunDirWriteError(BatchInferError):
    """A write into the run directory failed (disk full, file-size limit, quota, I/O error).
    The file it was writing is left as it was before that write."""

    def __init__(self, path: Path, exc: OSError):
        cause = _WRITE_FAILURES.get(exc.errno, exc.strerror or str(exc))
        super().__init__(f"could not write {path}: {cause} (errno {exc.errno}); everything "
                         "written before is intact; make room and rerun to resume")
        self.errno = exc.errno


_WRITE_FAILURES = {
    errno.ENOSPC: "the disk is full",
    errno.EFBIG: "the file-size limit was reached (ulimit -f)",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
}


def part_name(shard: Shard) -> str:
    return f"part-{shard.index:05d}-of-{shard.count:05d}"


def list_parts(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and PART_RE.match(p.name))


@dataclass
class PriorState:
    """What earlier sessions left in the directory."""

    done_ids: IdSet = field(default_factory=IdSet)
    done_lines: IdSet = field(default_factory=IdSet)
    num_outputs: int = 0
    num_errors: int = 0
    error_codes: Counter = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    torn_bytes: int = 0


def _json_default(value: Any) -> Any:
    """Dataset metadata can hold numpy scalars, dates, bytes: write something readable. Bytes (a
    parquet or arrow `binary` column) as base64, as Go's encoding/json and protobuf's JSON write
    them, not Python's b'...' repr."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def _finite(value: Any) -> Any:
    """JSON has no NaN or Infinity (jq, JSON.parse, Go refuse Python's): a non-finite float (a
    dataset's or a line's metadata) becomes null, as pandas and Arrow read a missing value."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if hasattr(value, "item") or hasattr(value, "tolist"):     # numpy scalars and arrays
        return _finite(_json_default(value))
    return value


def _dumps(obj: Any) -> str:
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False,
                          default=_json_default)
    except ValueError:  # a NaN or an infinity somewhere
        obj = _finite(obj)
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=_json_default)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates (from JSON "\ud800" escapes): keep them escaped
        text = json.dumps(obj, ensure_ascii=True, separators=(",", ":"), default=_json_default)
    return text


class RunDir:
    """An open, locked run directory (or one Slurm part of it)."""

    def __init__(self, root: Path, path: Path, shard: Shard, lock_fd: Optional[int],
                 created: tuple[Path, ...] = ()):
        self.root = root
        self.path = path
        self.shard = shard
        self._lock_fd = lock_fd
        self._created = created          # lock file and directories this open made
        self._replaced: dict[str, Optional[bytes]] = {}   # session files as they were before
        self._writers: dict[str, jsonlines.Writer] = {}
        self._files: dict[str, Any] = {}

    # --- opening ----------------------------------------------------------------------------------
    @classmethod
    def open(cls, root: Path, shard: Shard = Shard(), resume: bool = True,
             read_only: bool = False) -> tuple["RunDir", PriorState]:
        root = Path(root)
        _check_layout(root, shard)
        path = root / part_name(shard) if shard.count > 1 else root
        has_results = (path / OUTPUTS).exists() or (path / ERRORS).exists()
        if has_results and not resume:
            raise RunDirError(f"{path} already holds results and --no-resume was given; rerun "
                              "with --resume to continue it, or pick another --output")
        lock_fd = None
        # what this open makes (directories innermost first, the lock file): a refused start
        # removes them again (abandon)
        created = tuple(d for d in (path / LOCK, path, *path.parents) if not d.exists()) \
            if not read_only else ()
        if not read_only:
            try:
                path.mkdir(parents=True, exist_ok=True)
                lock_fd = _lock(path)
                _check_writable(path)
            except OSError as exc:
                if lock_fd is not None:
                    os.close(lock_fd)
                raise RunDirError(f"the run directory {path} cannot be written "
                                  f"({exc.strerror or exc}); pick another --output (or "
                                  "io.output_dir) or fix its permissions") from None
        run_dir = cls(root, path, shard, lock_fd, created)
        try:
            if not read_only:      # again, holding the lock: a run of the other layout that
                _check_layout(root, shard)   # started meanwhile is seen now (and sees this one)
            prior = run_dir._load_prior(repair=not read_only)
        except BaseException as exc:
            if read_only:
                run_dir.close()
            else:
                run_dir.abandon()
            if isinstance(exc, OSError):      # a result file read-only, another user's, ...
                raise RunDirError(
                    f"the run directory {path} cannot be {'read' if read_only else 'resumed'}: "
                    f"{exc.filename or path}: {exc.strerror or exc}; fix its permissions or pick "
                    "another --output (or io.output_dir)") from None
            raise
        return run_dir, prior

    def _load_prior(self, repair: bool) -> PriorState:
        prior = PriorState()
        if repair:
            for name in (OUTPUTS, ERRORS, METRICS, HISTORY):
                dropped = repair_torn_tail(self.path / name)
                if dropped:
                    log.warning("%s: removed a torn last line (%d bytes) left by an interrupted "
                                "run%s", self.path / name, dropped,
                                "; that request runs again" if name in (OUTPUTS, ERRORS) else "")
                    prior.torn_bytes += dropped
        for record in iter_jsonl_file(self.path / OUTPUTS):
            rid = record_id(record)
            if rid is not None:
                prior.done_ids.add(str(rid))
                prior.num_outputs += 1
                usage = (record.get("response") or {}).get("body", {}).get("usage") \
                    if "response" in record else record
                usage = usage or {}
                prior.prompt_tokens += int(usage.get("prompt_tokens") or 0)
                prior.completion_tokens += int(usage.get("completion_tokens") or 0)
        for record in iter_jsonl_file(self.path / ERRORS):
            if record.get("line") is not None:
                prior.done_lines.add(str(record["line"]))
            prior.num_errors += 1
            prior.error_codes[str(record.get("code"))] += 1
        return prior

    # --- results ----------------------------------------------------------------------------------
    def _writer(self, name: str) -> jsonlines.Writer:
        writer = self._writers.get(name)
        if writer is None:
            fh = open(self.path / name, "a", encoding="utf-8")
            self._files[name] = fh
            writer = self._writers[name] = jsonlines.Writer(fh, flush=True, dumps=_dumps)
        return writer

    def write_output(self, record: dict) -> None:
        self._append(OUTPUTS, record)

    def write_error(self, record: dict) -> None:
        self._append(ERRORS, record)

    def write_metrics(self, sample: dict) -> None:
        self._append(METRICS, sample)

    def write_history(self, record: dict) -> None:
        self._append(HISTORY, record)

    def _append(self, name: str, record: dict) -> None:
        """One line, flushed; a failed write is undone (the file cut back to its size before) and
        raised as RunDirWriteError, so no torn or half-counted line stays behind."""
        try:
            writer = self._writer(name)
        except OSError as exc:
            raise RunDirWriteError(self.path / name, exc) from None
        fh = self._files[name]
        size = os.fstat(fh.fileno()).st_size   # flushed after every line: this is the boundary
        try:
            writer.write(record)
        except OSError as exc:
            self._writers.pop(name, None)
            self._files.pop(name, None)
            try:
                fh.close()          # its flush may write part of the line: cut below
            except (OSError, ValueError):
                pass
            try:
                os.truncate(self.path / name, size)
            except OSError:
                pass
            raise RunDirWriteError(self.path / name, exc) from None

    def sync(self) -> None:
        """fsync the result files: flushed lines survive a process crash, synced ones a power cut."""
        for fh in self._files.values():
            try:
                fh.flush()
                os.fsync(fh.fileno())
            except (OSError, ValueError):
                pass

    # --- whole files ------------------------------------------------------------------------------
    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode("utf-8"))

    def write_bytes(self, name: str, data: bytes) -> None:
        """Atomically replaces `name` (relative to this run dir)."""
        target = self.path / name
        if name in _SESSION_FILES and name not in self._replaced:
            try:
                self._replaced[name] = target.read_bytes()
            except FileNotFoundError:
                self._replaced[name] = None
            except OSError:
                pass      # unreadable: the write below reports it
        tmp = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; reports are ordinary files
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, target)
        except BaseException as exc:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            if isinstance(exc, OSError):
                raise RunDirWriteError(target, exc) from None
            raise

    def write_json(self, name: str, obj: Any) -> None:
        self.write_text(name, json.dumps(obj, indent=2, ensure_ascii=False, default=_json_default)
                        + "\n")

    def read_text(self, name: str) -> Optional[str]:
        try:
            return (self.path / name).read_text(encoding="utf-8")
        except OSError:
            return None

    def read_json(self, name: str) -> Optional[Any]:
        return read_json(self.path / name)

    def write_report(self, report: dict, markdown: str, plots: Optional[dict[str, bytes]] = None) -> None:
        """report.json first: on a filling disk the status and counts get in before the plots."""
        self.write_json(REPORT_JSON, report)
        for name, png in (plots or {}).items():
            self.write_bytes(f"{PLOTS}/{name}", png)
        self.write_text(REPORT_MD, markdown)

    def abandon(self) -> None:
        """Undoes a start refused before any request ran (a usage error at setup): the recipe and
        run.json go back to what they were, and directories this open made are removed again, so
        the refused command leaves no run behind. Then closes."""
        replaced, self._replaced = self._replaced, {}
        for name, before in replaced.items():
            try:
                if before is None:
                    (self.path / name).unlink(missing_ok=True)
                else:
                    self.write_bytes(name, before)
            except (OSError, RunDirWriteError) as exc:
                log.warning("could not put %s back as it was: %s", self.path / name, exc)
        self._replaced.clear()
        lock = self.path / LOCK
        try:
            if lock in self._created:
                lock.unlink(missing_ok=True)   # while still held: no start can lock it after
        except OSError:
            pass
        self.close()
        try:
            for made in self._created:
                if made != lock:
                    made.rmdir()               # only while empty: anything else stays
        except OSError:
            pass

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self.sync()
        for fh in self._files.values():
            fh.close()
        self._writers.clear()
        self._files.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def read_json(path: Path) -> Optional[Any]:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _lock(path: Path) -> int:
    while True:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                holder = "?"
            os.close(fd)
            raise RunDirError(f"{path} is in use by another batchinfer run (pid {holder or '?'}); "
                              "wait for it to finish or pick another --output") from None
        try:      # the file locked is still the directory's (not one a refused start removed)
            if os.fstat(fd).st_ino == os.stat(path / LOCK).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _check_writable(path: Path) -> None:
    """Root passes permission checks, so try: a file that can be created and removed."""
    fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
    os.close(fd)
    os.unlink(probe)


def _check_layout(root: Path, shard: Shard) -> None:
    """A run dir is either one run or N Slurm parts; resuming it with another layout would
    run requests twice, so that is refused."""
    parts = list_parts(root)
    counts = {int(PART_RE.match(p.name).group(2)) for p in parts}
    if shard.count == 1 and parts:
        raise RunDirError(f"{root} holds a Slurm run split into {max(counts)} parts; resume it "
                          f"with srun -n {max(counts)}, or pick another --output")
    if shard.count > 1:
        if (root / OUTPUTS).exists() or (root / ERRORS).exists() or in_use(root):
            raise RunDirError(f"{root} holds a single-process run (or one is starting there); "
                              "resume it without --shard / srun (one task), or pick another "
                              "--output")
        other = counts - {shard.count}
        if other:
            raise RunDirError(f"{root} holds a Slurm run split into {sorted(other)[0]} parts but "
                              f"this step has {shard.count} tasks; rerun with srun -n "
                              f"{sorted(other)[0]}, or pick another --output")


def in_use(path: Path) -> bool:
    """True while a live run holds the directory's lock."""
    lock = Path(path) / LOCK
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise RunDirError(f"{lock} cannot be read ({exc.strerror or exc}) to tell whether a run "
                          "holds the directory; fix its permissions or pick another --output") \
            from None
    try:    # shared: probes (several Slurm parts starting at once) never refuse each other
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we may have taken
    return False


def report_writer(path: Path) -> RunDir:
    """A handle that only (re)writes report files, for `batchinfer report`; takes no lock."""
    path = Path(path)
    return RunDir(path, path, Shard(), None)

