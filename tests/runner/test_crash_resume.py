"""Real `batchinfer run` processes, killed and resumed: exactly-once, signals, Slurm shards.

Each run is a subprocess on the tiny dummy-weight model (a few seconds to start).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.engine.fault_harness import (TINY_MODEL, exactly_once_problems, read_records,
                                             write_prompts)

# every test here runs real `batchinfer run` subprocesses, several seconds each
pytestmark = pytest.mark.slow

TINY_RECIPE = (TINY_MODEL + "strategy: {name: baseline, max_num_seqs: 16}\n"
               "report: {refresh_seconds: 0.5, plots: false, progress_interval_seconds: 1}\n")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **extra)
    return env


def _start(recipe: Path, prompts: Path, out: Path, *args, **env) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", str(recipe), "--input", str(prompts),
           "--output", str(out), "--progress", "lines", *args]
    return subprocess.Popen(cmd, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _wait_for_outputs(proc: subprocess.Popen, path: Path, at_least: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _count_lines(path) < at_least and proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no progress after {timeout}s: {proc.communicate()[0]}")
        time.sleep(0.02)


@pytest.fixture()
def recipe(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_RECIPE)
    return path


def _prompts(path: Path, n: int, rng: random.Random, bad_every: int = 0) -> tuple[set, set]:
    return write_prompts(path, n, rng, bad_every=bad_every, logprobs_every=5)


def _check_exactly_once(out: Path, good: set, bad_lines: set) -> None:
    assert exactly_once_problems(out, good, bad_lines) == []


def test_kill_9_at_random_points_then_resume_exactly_once(tmp_path, recipe):
    rng = random.Random(1234)
    prompts = tmp_path / "prompts.jsonl"
    good, bad_lines = _prompts(prompts, 200, rng, bad_every=37)
    out = tmp_path / "run"
    outputs = out / "outputs.jsonl"
    kills = 0
    # first kill lands during start-up (imports, model build), the others mid-generation
    proc = _start(recipe, prompts, out)
    time.sleep(rng.uniform(0.5, 3.0))
    proc.kill()
    proc.wait()
    kills += 1
    for _ in range(3):
        before = _count_lines(outputs)
        proc = _start(recipe, prompts, out)
        _wait_for_outputs(proc, outputs, before + rng.randint(1, 25))
        time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        # between crashes: never an id twice (a torn last line may remain; resume repairs it)
        complete = outputs.read_bytes().rsplit(b"\n", 1)[0] if outputs.exists() else b""
        ids = [json.loads(line)["id"] for line in complete.splitlines() if line]
        assert len(ids) == len(set(ids))
    assert kills >= 3
    final = _start(recipe, prompts, out)
    log = final.communicate(timeout=300)[0]
    assert final.returncode == 0, log
    _check_exactly_once(out, good, bad_lines)
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "completed"
    assert report["totals"]["outputs"] == len(good) and report["totals"]["errors"] == len(bad_lines)
    assert len(report["previous_sessions"]) >= 1


def test_torn_last_line_is_repaired_on_resume(tmp_path, recipe):
    rng = random.Random(7)
    prompts = tmp_path / "prompts.jsonl"
    good, bad_lines = _prompts(prompts, 12, rng)
    out = tmp_path / "run"
    first = _start(recipe, prompts, out, "--limit", "1")       # one complete record
    assert first.wait(timeout=300) == 0
    # what a crash mid-write leaves: half of the next record
    with open(out / "outputs.jsonl", "a") as fh:
        fh.write('{"id": "req-1", "text": "hal')
    proc = _start(recipe, prompts, out)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log
    assert "torn last line" in log
    _check_exactly_once(out, good, bad_lines)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130),
                                      (signal.SIGUSR1, 138)])     # Slurm's --signal=USR1@...
def test_signal_stops_cleanly_and_resumes(tmp_path, recipe, sig, code):
    rng = random.Random(sig)
    prompts = tmp_path / "prompts.jsonl"
    good, bad_lines = _prompts(prompts, 80, rng, bad_every=40)
    out = tmp_path / "run"
    proc = _start(recipe, prompts, out)
    _wait_for_outputs(proc, out / "outputs.jsonl", 10)
    proc.send_signal(sig)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == code, log
    assert "rerun to resume" in log
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "interrupted"
    done = len(read_records(out / "outputs.jsonl"))
    assert 10 <= done < len(good)
    assert report["totals"]["outputs"] == done
    proc = _start(recipe, prompts, out)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log
    _check_exactly_once(out, good, bad_lines)


def test_slurm_tasks_shard_the_input_and_report_merges(tmp_path, recipe):
    rng = random.Random(3)
    prompts = tmp_path / "prompts.jsonl"
    good, bad_lines = _prompts(prompts, 30, rng, bad_every=10)
    out = tmp_path / "run"
    procs = [_start(recipe, prompts, out, SLURM_STEP_ID="0", SLURM_PROCID=str(i),
                    SLURM_NTASKS="2", SLURM_JOB_ID="42") for i in range(2)]
    for proc in procs:
        log = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, log
    parts = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert parts == ["part-00000-of-00002", "part-00001-of-00002"]
    ids, lines = [], []
    for part in parts:
        ids += [o["id"] for o in read_records(out / part / "outputs.jsonl")]
        lines += [e["line"] for e in read_records(out / part / "errors.jsonl")]
    assert sorted(ids) == sorted(good) and sorted(lines) == sorted(bad_lines)
    # each task took every other line of the input
    first = {int(o["id"].split("-")[1]) % 2 for o in read_records(out / parts[0] / "outputs.jsonl")}
    assert first == {0}
    merged = subprocess.run([sys.executable, "-m", "batchinfer.cli", "report", str(out)],
                            env=_env(), capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr
    assert "## Parts" in merged.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "completed"
    assert report["totals"]["outputs"] == len(good) and report["totals"]["errors"] == len(bad_lines)
    assert len(report["parts"]) == 2
    assert report["session"]["throughput"]["output_tokens_per_s"] > 0
