"""The build-once cache: staging + rename, a lock that dies with its holder, bounded waits."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from batchinfer.engine import setup_cache
from batchinfer.engine.setup_cache import SetupTimeout, build_once, discard, lock_path

HOLD_LOCK = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, f"pid {os.getpid()} on testhost\\n".encode(), 0)
    print("held", flush=True)
    time.sleep(600)
""")


def _hold(lock: Path) -> subprocess.Popen:
    lock.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _writer(calls: list):
    def build(staging: Path) -> None:
        calls.append(staging)
        (staging / "lib.so").write_text("built")
    return build


def test_builds_once_into_place_and_leaves_no_staging(tmp_path):
    calls: list = []
    target = tmp_path / "kernels" / "entry"
    assert build_once(target, _writer(calls), what="building", wait_timeout_s=5) == target
    assert build_once(target, _writer(calls), what="building", wait_timeout_s=5) == target
    assert len(calls) == 1 and calls[0] != target
    assert (target / "lib.so").read_text() == "built"
    assert not list(target.parent.glob("entry.tmp-*"))


def test_a_failed_build_leaves_nothing_and_the_next_one_runs(tmp_path):
    target = tmp_path / "entry"

    def broken(staging: Path) -> None:
        (staging / "half.o").write_text("x")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        build_once(target, broken, what="building", wait_timeout_s=5)
    assert not target.exists() and not list(tmp_path.glob("entry.tmp-*"))
    calls: list = []
    build_once(target, _writer(calls), what="building", wait_timeout_s=5)
    assert len(calls) == 1


def test_leftovers_of_a_killed_builder_are_removed_and_redone(tmp_path):
    target = tmp_path / "entry"
    stale = tmp_path / "entry.tmp-killed"
    stale.mkdir()
    (stale / "half.o").write_text("x")
    target.mkdir()                      # an entry without its library: not complete
    calls: list = []
    build_once(target, _writer(calls), what="building", wait_timeout_s=5,
               is_complete=lambda p: (p / "lib.so").is_file())
    assert len(calls) == 1 and not stale.exists() and (target / "lib.so").is_file()


def test_a_waiter_gives_up_past_its_bound_naming_the_holder(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(setup_cache, "FIRST_NOTICE_S", 0.1)
    target = tmp_path / "entry"
    holder = _hold(lock_path(target))
    try:
        t0 = time.monotonic()
        with pytest.raises(SetupTimeout, match=rf"pid {holder.pid} on testhost.*building the "
                                               r"CPU kernels.*BATCHINFER_CACHE"):
            build_once(target, _writer([]), what="building the CPU kernels", wait_timeout_s=0.6)
        assert 0.6 <= time.monotonic() - t0 < 5
        assert f"waiting for another process (pid {holder.pid}" in caplog.text
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_dies_with_its_holder(tmp_path):
    target = tmp_path / "entry"
    holder = _hold(lock_path(target))
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    calls: list = []
    build_once(target, _writer(calls), what="building", wait_timeout_s=5)
    assert len(calls) == 1


def test_lock_files_follow_the_umask_so_a_group_shares_the_cache(tmp_path):
    old = os.umask(0o002)
    try:
        build_once(tmp_path / "entry", _writer([]), what="building", wait_timeout_s=5)
    finally:
        os.umask(old)
    assert lock_path(tmp_path / "entry").stat().st_mode & 0o777 == 0o664


def test_another_users_read_only_lock_file_still_locks(tmp_path, monkeypatch):
    """A lock file this user may not write (another user's, made 0644 by an older version): the
    build takes the flock through a read-only descriptor instead of falling back, and a second
    process still waits for it."""
    target = tmp_path / "entry"
    lock = lock_path(target)
    lock.write_text("pid 1 on elsewhere\n")
    real_open = os.open

    def as_another_user(path, flags, *args):
        if Path(path) == lock and flags & os.O_RDWR:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(setup_cache.os, "open", as_another_user)
    with setup_cache.held_lock(lock, "building", 5):
        held = subprocess.run(
            [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY)\n"
             "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n"
             "    print('held')", str(lock)], capture_output=True, text=True, timeout=60)
        assert held.stdout.strip() == "held"
    assert lock.read_text() == "pid 1 on elsewhere\n"     # not ours to write
    calls: list = []
    assert build_once(target, _writer(calls), what="building", wait_timeout_s=5) == target
    assert len(calls) == 1


def test_a_waiter_uses_what_the_holder_built(tmp_path):
    target = tmp_path / "entry"
    holder = _hold(lock_path(target))
    try:
        target.mkdir()                  # the holder's rename, as a waiter would see it
        (target / "lib.so").write_text("theirs")
        holder.kill()
        calls: list = []
        build_once(target, _writer(calls), what="building", wait_timeout_s=5,
                   is_complete=lambda p: (p / "lib.so").is_file())
        assert calls == [] and (target / "lib.so").read_text() == "theirs"
    finally:
        holder.kill()
        holder.wait()


def test_discard_removes_a_broken_entry(tmp_path):
    target = tmp_path / "entry"
    build_once(target, _writer([]), what="building", wait_timeout_s=5)
    discard(target, "building", 5)
    assert not target.exists()


def test_an_unwritable_cache_falls_back_to_a_temporary_one(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("BATCHINFER_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(setup_cache, "_fallback_root", None)
    root = setup_cache.cache_root()
    try:
        assert root.is_dir() and root != blocker / "cache"
        assert os.environ["BATCHINFER_CACHE"] == str(root)   # spawned workers share it
        assert "cannot be written" in caplog.text and "BATCHINFER_CACHE" in caplog.text
        assert setup_cache.cache_root() == root
    finally:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
        monkeypatch.setattr(setup_cache, "_fallback_root", None)


def test_kernel_cache_key_separates_python_environments(monkeypatch):
    from batchinfer.engine import kernels

    sources, flags = kernels._BUILDS["exact"]
    here = kernels.build_name("exact", sources, flags)
    assert here == kernels.build_name("exact", sources, flags)
    monkeypatch.setattr(kernels.sysconfig, "get_paths", lambda: {"include": "/other/env/include"})
    assert kernels.build_name("exact", sources, flags) != here


def test_a_kernel_build_past_its_bound_is_stopped_and_named(tmp_path, monkeypatch):
    from batchinfer.engine import kernels

    monkeypatch.setattr(kernels, "BUILD_TIMEOUT_S", 1.0)
    staging = tmp_path / "staging"
    staging.mkdir()
    sources, flags = kernels._BUILDS["exact"]
    build = kernels.Build(tmp_path / "batchinfer_sampling_bound", sources, flags)
    with pytest.raises(SetupTimeout, match=r"took over 1 s and was stopped.*NATIVE_KERNELS=0"):
        kernels._compile_all([(build, staging)])
    time.sleep(0.5)
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit()
             and str(staging).encode() in _cmdline(p)]
    assert alive == []             # the child and anything it started are gone


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_missing_libraries_build_together_under_their_locks_and_once(tmp_path, monkeypatch):
    """_build_missing stages every missing library inside all their locks and compiles them in
    one call; a library already built is left alone; a second call compiles nothing."""
    from batchinfer.engine import kernels

    calls: list[list[str]] = []

    def compile_all(staged):        # as the real one: nothing staged, nothing compiled
        if not staged:
            return
        for build, staging in staged:
            assert _is_locked(lock_path(build.entry))       # every entry locked while compiling
            (staging / f"{build.entry.name}.so").write_bytes(b"built")
        calls.append([build.entry.name for build, _ in staged])

    monkeypatch.setattr(kernels, "_compile_all", compile_all)
    builds = [kernels.Build(tmp_path / name, [], []) for name in ("lib_a", "lib_b", "lib_c")]
    (tmp_path / "lib_b").mkdir()
    (tmp_path / "lib_b" / "lib_b.so").write_bytes(b"old")       # built earlier
    kernels._build_missing(builds)
    assert calls == [["lib_a", "lib_c"]]
    assert all(b.is_built() for b in builds)
    assert (tmp_path / "lib_b" / "lib_b.so").read_bytes() == b"old"
    kernels._build_missing(builds)
    assert calls == [["lib_a", "lib_c"]]
    assert not list(tmp_path.glob("*.tmp-*"))


def _is_locked(path: Path) -> bool:
    """Another open file description cannot take the flock: someone holds it (closing the
    descriptor drops a lock taken here)."""
    fd = os.open(path, os.O_RDWR)
    try:
        return not setup_cache._try_lock(fd)
    finally:
        os.close(fd)


def test_the_kernel_build_finds_the_installed_ninja_without_an_activated_environment(
        tmp_path, monkeypatch):
    """A job started as `venv/bin/batchinfer` (cron, Slurm) has no venv/bin on PATH: torch's
    builder found no `ninja` there and every run fell back to the torch path. The build child's
    PATH now leads with the directory of the ninja this Python installed."""
    pytest.importorskip("ninja")
    from batchinfer.engine import kernels

    bare = tmp_path / "bin"          # a PATH holding no ninja
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    started = {}

    def popen(cmd, **kwargs):
        started.update(kwargs)
        raise RuntimeError("not started")

    monkeypatch.setattr(kernels.subprocess, "Popen", popen)
    staging = tmp_path / "staging"
    staging.mkdir()
    sources, flags = kernels._BUILDS["exact"]
    with pytest.raises(RuntimeError, match="not started"):
        kernels._start_compile(kernels.Build(tmp_path / "entry", sources, flags), staging)
    child_path = (started.get("env") or os.environ)["PATH"]
    assert shutil.which("ninja", path=child_path) is not None
    assert str(bare) in child_path.split(os.pathsep)       # the user's PATH is kept after it
