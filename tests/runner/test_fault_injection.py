"""Faults against real `batchinfer run` processes, in every phase: kill -9 and signals at seeded
random moments, a first run on an empty cache killed during the kernel build, runs racing for one
cache and for one run directory, a file-size limit, directories that cannot be written.

The long version (200 random trials) is benchmarks/engine/fault_injection.py; the harness both
drive is benchmarks/engine/fault_harness.py.
"""
from __future__ import annotations

import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from benchmarks.engine.fault_harness import (SIGNAL_BOUND_S, SINGLE, Trial,
                                             exactly_once_problems, kill_group, run_env,
                                             run_trial, start_run, wait, wait_for_leftovers,
                                             write_prompts)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


@pytest.fixture(scope="module")
def warm_cache(default_model_dir) -> Path:
    """The session's cache (kernels built, the default model converted)."""
    return Path(default_model_dir).parents[1]


@pytest.fixture()
def job(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(SINGLE)
    prompts = tmp_path / "prompts.jsonl"
    good, bad = write_prompts(prompts, 30, random.Random(5), bad_every=13)
    return recipe, prompts, good, bad


@pytest.mark.parametrize("seed,kind", [(11, "kill9"), (12, "sigterm"), (13, "sigint")])
@pytest.mark.slow
def test_a_fault_at_a_seeded_random_moment_then_rerun_is_exactly_once(tmp_path, warm_cache, seed,
                                                                        kind):
    rng = random.Random(seed)
    # 0-9 s covers interpreter start, imports, run directory, model and kernel load, generation
    trial = Trial(kind, delay_s=rng.uniform(0.0, 9.0))
    result = run_trial(trial, tmp_path / "trial", warm_cache, rng, num_requests=30)
    assert result["ok"], result
    if kind != "kill9" and not result["finished_before_fault"]:
        assert result["answer_s"] <= SIGNAL_BOUND_S


@pytest.mark.slow
def test_first_run_on_an_empty_cache_killed_in_the_kernel_build(tmp_path, job, warm_cache):
    """SIGTERM, then kill -9, during the first kernel build; then two runs race for the cache:
    one builds, the other waits for it, both complete, nothing is left behind. The `model`
    library comes from the warm cache, so only `exact` builds (~18 s instead of ~37 s alone on
    2 cores). Two libraries building at once (nested locks, two compilers stopped) is
    tests/engine/test_setup_cache.py's and the first run's in CI, on an empty cache."""
    recipe, prompts, good, bad = job
    cache = tmp_path / "cache"
    shutil.copytree(warm_cache / "gguf", cache / "gguf")   # the build, not the conversion, here
    kernels = cache / "kernels"
    from batchinfer.engine.kernels import load_native_kernels

    if not load_native_kernels():     # builds them into the session's cache when missing
        pytest.skip("native CPU kernels unavailable")
    warm_model_builds = [entry for entry in (warm_cache / "kernels").glob("batchinfer_model_*")
                         if entry.is_dir() and ".tmp-" not in entry.name]   # not a killed build's
    assert warm_model_builds, "the session's cache has no built model kernels"
    for entry in warm_model_builds:
        shutil.copytree(entry, kernels / entry.name)

    def start_and_wait_for_the_build(out: Path):
        run = start_run(recipe, prompts, out, run_env(cache))
        deadline = time.monotonic() + 120
        while not list(kernels.glob("*.tmp-*")):
            assert run.proc.poll() is None, run.log()
            assert time.monotonic() < deadline, "the kernel build never started"
            time.sleep(0.05)
        time.sleep(random.Random(3).uniform(0.5, 3.0))
        return run

    run = start_and_wait_for_the_build(tmp_path / "first")
    kill_group(run.pgid, signal.SIGTERM)
    t0 = time.monotonic()
    assert wait(run, 30) == 143, run.log()
    assert time.monotonic() - t0 <= SIGNAL_BOUND_S
    assert "during setup" in run.log()
    assert wait_for_leftovers(run) == []         # no compiler keeps running

    run = start_and_wait_for_the_build(tmp_path / "second")
    kill_group(run.pgid, signal.SIGKILL)
    wait(run, 30)
    assert wait_for_leftovers(run) == []         # the build died with its parent

    racers = [start_run(recipe, prompts, tmp_path / f"race-{i}", run_env(cache)) for i in range(2)]
    for racer in racers:
        assert wait(racer, 400) == 0, racer.log()
    for i in range(2):
        assert exactly_once_problems(tmp_path / f"race-{i}", good, bad) == []
    logs = "".join(r.log() for r in racers)
    assert len(re.findall(r"building the CPU kernels \(exact\)", logs)) == 1, logs
    assert "waiting for another process" in logs
    assert not list(kernels.glob("*.tmp-*"))


@pytest.mark.slow
def test_two_runs_racing_for_one_run_directory(tmp_path, job, warm_cache):
    recipe, prompts, good, bad = job
    out = tmp_path / "run"
    first = start_run(recipe, prompts, out, run_env(warm_cache))
    deadline = time.monotonic() + 60
    while not (out / "run.json").exists():
        assert first.proc.poll() is None and time.monotonic() < deadline, first.log()
        time.sleep(0.05)
    second = start_run(recipe, prompts, out, run_env(warm_cache))
    assert wait(second, 60) == 2, second.log()
    assert f"in use by another batchinfer run (pid {first.proc.pid})" in second.log()
    assert wait(first, 120) == 0, first.log()
    assert exactly_once_problems(out, good, bad) == []


@pytest.mark.slow
def test_disk_full_stops_with_exit_3_and_the_rerun_completes(tmp_path, job, warm_cache):
    recipe, prompts, good, bad = job
    out = tmp_path / "run"
    limited = start_run(recipe, prompts, out, run_env(warm_cache), fsize=6000)
    assert wait(limited, 120) == 3, limited.log()
    log = limited.log()
    assert "could not write" in log and "file-size limit was reached" in log, log
    assert "rerun to resume" in log
    for name in ("outputs.jsonl", "errors.jsonl", "history.jsonl", "metrics.jsonl"):
        path = out / name
        if path.exists():
            assert path.read_bytes().endswith(b"\n"), name          # no torn line left
    rerun = start_run(recipe, prompts, out, run_env(warm_cache))
    assert wait(rerun, 120) == 0, rerun.log()
    assert exactly_once_problems(out, good, bad) == []


def test_an_output_directory_that_cannot_be_written_is_exit_2(tmp_path, job, warm_cache):
    recipe, prompts, _, _ = job
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    run = start_run(recipe, prompts, blocker / "run", run_env(warm_cache))
    assert wait(run, 60) == 2, run.log()
    assert f"{blocker / 'run'} cannot be written" in run.log()


@pytest.mark.slow
def test_a_cache_directory_that_cannot_be_written_falls_back_with_a_warning(tmp_path, job):
    recipe, prompts, good, bad = job
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    env = run_env(blocker / "cache", BATCHINFER_NATIVE_KERNELS="0")  # the fallback, not a build
    run = start_run(recipe, prompts, tmp_path / "run", env)
    assert wait(run, 180) == 0, run.log()
    match = re.search(r"cannot be written .*? in (\S+) and removes it at exit", run.log())
    assert match, run.log()
    assert "BATCHINFER_CACHE" in run.log()
    assert not Path(match.group(1)).exists()
    assert exactly_once_problems(tmp_path / "run", good, bad) == []
