"""The per-user cache of one-time setup (CPU kernels, de-quantized GGUF models), safe to kill.

Jobs started from cron or Slurm are killed at any moment, first runs included, and many tasks
share one home directory. So every cache entry is built once and only ever seen whole:
- a builder takes an flock on `<entry>.lock`; the kernel drops it when the holder dies, even by
  kill -9, so a killed build never blocks anyone;
- the entry is built in a staging directory beside its final place (`<entry>.tmp-*`) and renamed
  into place when complete; the next lock holder removes staging directories that killed
  builders left;
- a process that finds the lock held waits, says on stderr whom it waits for, and gives up past
  a bound with SetupTimeout naming the holder and what to do (exit 3).
A cache directory that cannot be written is replaced by a temporary one for this run (and the
processes it spawns) with a warning.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from . import envs
from .errors import BatchInferError

log = logging.getLogger("batchinfer")

CACHE_ENV = "BATCHINFER_CACHE"
# multiplies every setup bound (kernel build, waiting for another process's build or conversion)
TIMEOUT_SCALE_ENV = "BATCHINFER_SETUP_TIMEOUT_SCALE"
FIRST_NOTICE_S = 1.0      # a wait longer than this is announced on stderr
REPEAT_NOTICE_S = 30.0
POLL_S = 0.1
_fallback_root: Optional[Path] = None
_writable_roots: set = set()
_UMASK = os.umask(0)
os.umask(_UMASK)


class SetupTimeout(BatchInferError):
    """One-time setup (or the wait for another process doing it) ran past its bound."""


def timeout_scale() -> float:
    raw = envs.get(TIMEOUT_SCALE_ENV)
    try:
        scale = float(raw)
    except ValueError:
        log.warning("%s=%r is not a number; using 1", TIMEOUT_SCALE_ENV, raw)
        return 1.0
    return scale if scale > 0 else 1.0


def default_cache_root() -> Path:
    base = envs.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "batchinfer")
    return Path(base)


def cache_root() -> Path:
    """The cache directory, created if needed; a temporary one (with a warning) when it cannot be
    written. The fallback goes into the environment so spawned workers share it."""
    global _fallback_root
    root = default_cache_root()
    if root in _writable_roots or (_fallback_root is not None and root == _fallback_root):
        return root
    problem = _unwritable(root)
    if problem is None:
        _writable_roots.add(root)     # probed once per process, not on every call
        return root
    if _fallback_root is None:
        _fallback_root = Path(tempfile.mkdtemp(prefix="batchinfer-cache-"))
        atexit.register(shutil.rmtree, _fallback_root, ignore_errors=True)
        log.warning("the cache directory %s cannot be written (%s); this run builds its one-time "
                    "setup in %s and removes it at exit. Set %s to a writable directory to keep "
                    "it between runs", root, problem, _fallback_root, CACHE_ENV)
    os.environ[CACHE_ENV] = str(_fallback_root)
    return _fallback_root


def _unwritable(root: Path) -> Optional[str]:
    """Why `root` cannot hold cache entries, or None if it can."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def build_once(target: Path, build: Callable[[Path], None], *, what: str, wait_timeout_s: float,
               is_complete: Callable[[Path], bool] = Path.is_dir) -> Path:
    """Returns `target`, calling `build(staging_dir)` first unless another process has built it
    (or is building it: then this waits up to `wait_timeout_s`). `what` names the work in
    messages ("building the CPU kernels")."""
    if is_complete(target):
        return target
    with held_lock(lock_path(target), what, wait_timeout_s):
        if is_complete(target):
            return target
        remove_leftovers(target)
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-", dir=target.parent))
        try:
            os.chmod(staging, 0o777 & ~_UMASK)   # mkdtemp makes 0700; entries are shared
            build(staging)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def discard(target: Path, what: str, wait_timeout_s: float) -> None:
    """Removes a complete entry that turned out broken (e.g. a library that will not load)."""
    with held_lock(lock_path(target), what, wait_timeout_s):
        shutil.rmtree(target, ignore_errors=True)


def lock_path(target: Path) -> Path:
    return target.with_name(target.name + ".lock")


def remove_leftovers(target: Path) -> None:
    """Under the entry's lock: staging dirs of killed builders, and a partial entry."""
    for stale in target.parent.glob(f"{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)


class held_lock:
    """`with held_lock(path, what, timeout_s):` holds an flock on `path`, waiting for the holder
    (announced on stderr) at most `timeout_s`."""

    def __init__(self, path: Path, what: str, timeout_s: float):
        self.path, self.what, self.timeout_s = Path(path), what, timeout_s
        self.fd: Optional[int] = None

    def __enter__(self) -> "held_lock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, writable = _open_lock_file(self.path)
        try:
            if not _try_lock(fd):
                self._wait(fd)
            if writable:     # who holds it, for the messages of those who wait
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)     # drops the flock
            self.fd = None

    def _wait(self, fd: int) -> None:
        start = time.monotonic()
        next_notice = start + FIRST_NOTICE_S
        while not _try_lock(fd):
            now = time.monotonic()
            waited = now - start
            if waited > self.timeout_s:
                raise SetupTimeout(
                    f"gave up after {waited:.0f} s waiting for another process "
                    f"({_holder(fd)}) {self.what} (lock {self.path}); if that process is stuck, "
                    f"stop it and rerun, or set {CACHE_ENV} to another directory")
            if now >= next_notice:
                log.warning("waiting for another process (%s) %s, once for this machine "
                            "(lock %s, %.0f s so far)", _holder(fd), self.what, self.path, waited)
                next_notice = now + REPEAT_NOTICE_S
            time.sleep(POLL_S)


def _open_lock_file(path: Path) -> tuple[int, bool]:
    """-> (fd, whether it is writable). Created 0666 less the umask, as the entries follow it, so
    a group that shares a cache (umask 002) shares its locks. A lock file another user made
    read-only for us (an older batchinfer made them 0644) is still a lock: flock needs no write
    access, only the holder's name is then not written."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666), True
    except PermissionError:
        return os.open(path, os.O_RDONLY), False


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
        raise
    return True


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "pid unknown"
    except OSError:
        return "pid unknown"
