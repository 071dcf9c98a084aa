"""Fault injection on real `batchinfer run` processes: kill -9, SIGTERM / SIGINT at random
moments, a file-size limit, then a clean rerun that must complete with every id exactly once.

Used by benchmarks/engine/fault_injection.py (the long run, JSON out) and by
tests/runner/test_fault_injection.py (a short seeded run in CI) and test_crash_resume.py; it lives
here, beside the benchmark, so the benchmark does not depend on the test package. It imports
nothing of batchinfer: the runs are subprocesses. Each run starts in a session of its own,
so a fault reaches its whole process group as Slurm's and a terminal's signals do, and leftovers
(workers, compilers) are found by process group and by a token in their environment.
"""
from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

TINY_MODEL = """
model:
  load_format: dummy
  max_model_len: 256
  hf_overrides: {num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128,
                 num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}
sampling: {max_tokens: 24, temperature: 0.8}
memory: {kv_cache_memory: 16MiB}
io: {max_in_flight: 24}
"""
REPORT = ("report: {refresh_seconds: 0.5, plots: true, plot_refresh_seconds: 1, "
          "progress_interval_seconds: 1}\n")
SINGLE = TINY_MODEL + REPORT + "strategy: {name: baseline, max_num_seqs: 16}\n"
PIPELINE = TINY_MODEL + REPORT + "strategy: {name: baseline, max_num_seqs: 8}\nparallel: {pp: 2}\n"
RUN_BOUND_S = 300.0          # a run (first-run kernel build included) past this is a hang
SIGNAL_BOUND_S = 5.0         # the bound on answering SIGTERM / SIGINT
SIGNAL_CODES = {signal.SIGTERM: (143, -signal.SIGTERM), signal.SIGINT: (130, -signal.SIGINT)}


# a token in the environment of every process a run starts: the compilers it launches leave its
# process group (a session of their own) but inherit it, and no other process on the host has it
RUN_MARKER = "BATCHINFER_FAULT_HARNESS_RUN"


def run_env(cache: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", BATCHINFER_CACHE=str(cache),
               **extra)
    env[RUN_MARKER] = uuid.uuid4().hex
    return env


def write_prompts(path: Path, n: int, rng: random.Random, bad_every: int = 0,
                  logprobs_every: int = 0) -> tuple[set, set]:
    """n requests of random lengths (every `logprobs_every`-th asks for logprobs: long lines)
    plus a malformed line every `bad_every`; -> (ids, bad line numbers)."""
    good, bad_lines, lines = set(), set(), []
    for i in range(n):
        if bad_every and i % bad_every == bad_every - 1:
            lines.append('{"id": "broken-%d", ' % i)
            bad_lines.add(len(lines))
            continue
        prompt = f"Request {i}: " + "tell me more " * rng.randint(1, 30)
        record = {"id": f"req-{i}", "prompt": prompt,
                  "max_tokens": rng.randint(2, 40), "ignore_eos": True}
        if logprobs_every and i % logprobs_every == 0:
            record["logprobs"] = 5
        lines.append(json.dumps(record))
        good.add(record["id"])
    path.write_text("\n".join(lines) + "\n")
    return good, bad_lines


@dataclass
class Run:
    proc: subprocess.Popen
    log_path: Path
    started: float
    marker: str = ""      # run_env's token in its processes' environment

    @property
    def pgid(self) -> int:
        return self.proc.pid   # start_new_session: the run leads its own group

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def start_run(recipe: Path, prompts: Path, out: Path, env: dict, *args: str,
              fsize: Optional[int] = None) -> Run:
    """Starts a run in a session of its own; `fsize`: its RLIMIT_FSIZE in bytes (through
    prlimit where it exists: a preexec_fn is not safe while other threads run trials)."""
    folder = out.parent
    while not folder.is_dir():          # the output may sit under a file (a test of that)
        folder = folder.parent
    log_path = folder / f"{out.name}.log.{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", str(recipe), "--input", str(prompts),
           "--output", str(out), "--progress", "lines", *args]
    preexec = None
    if fsize is not None:
        if shutil.which("prlimit"):
            cmd = ["prlimit", f"--fsize={fsize}", *cmd]     # execs in place: the same pid
        else:
            preexec = file_size_limit(fsize)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=preexec)
    return Run(proc, log_path, time.monotonic(), env.get(RUN_MARKER, ""))


def wait(run: Run, bound_s: float) -> Optional[int]:
    """The exit code, or None if the run did not exit within `bound_s` (then it is killed)."""
    try:
        return run.proc.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        kill_group(run.pgid)
        run.proc.wait()
        return None


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def leftovers(run: Run) -> list[str]:
    """Processes still alive from a run: its process group, or one that left the group (a kernel
    build's compiler) with the run's token in its environment. Other runs on the host (another
    job, another test session) are not the run's, whatever cache they share."""
    token = f"{RUN_MARKER}={run.marker}".encode() if run.marker else None
    found = []
    mine = {os.getpid(), os.getppid()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        state, group = fields[0], int(fields[2])
        if state == "Z":
            continue
        if group == run.pgid or (token is not None and token in _environ(entry)):
            found.append(f"{entry.name}: {cmd[:120]}")
    return found


def _environ(entry: Path) -> bytes:
    try:
        return (entry / "environ").read_bytes()
    except OSError:                     # gone, or another user's
        return b""


def wait_for_leftovers(run: Run, bound_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + bound_s
    while True:
        found = leftovers(run)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def exactly_once_problems(out: Path, good: set, bad_lines: set) -> list[str]:
    """What is wrong with a finished run directory: torn lines, lost or duplicated ids."""
    try:
        outputs = read_records(out / "outputs.jsonl")
        errors = read_records(out / "errors.jsonl")
    except ValueError as exc:
        return [f"a line does not parse: {exc}"]
    problems = []
    ids = [o["id"] for o in outputs]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        problems.append(f"duplicated ids: {sorted(dup)[:5]}")
    if set(ids) != good:
        problems.append(f"lost ids: {sorted(good - set(ids))[:5]}; unknown: "
                        f"{sorted(set(ids) - good)[:5]}")
    lines = [e["line"] for e in errors]
    if len(lines) != len(set(lines)) or set(lines) != bad_lines:
        problems.append(f"error lines {sorted(lines)} != {sorted(bad_lines)}")
    return problems


def file_size_limit(limit_bytes: int) -> Callable[[], None]:
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


@dataclass
class Trial:
    """One fault against one run, then clean reruns until the run directory is complete."""

    kind: str                 # kill9 | sigterm | sigint | sigterm_twice | fsize
    delay_s: float = 0.0      # when the signal is sent after the start
    layout: str = "single"    # single | pipeline
    fsize: int = 0            # RLIMIT_FSIZE for kind fsize
    result: dict = field(default_factory=dict)


def run_trial(trial: Trial, work: Path, cache: Path, rng: random.Random,
              num_requests: int = 40) -> dict:
    """Runs `trial` in `work` (a fresh directory); -> a result dict with `ok` and `problems`."""
    work.mkdir(parents=True, exist_ok=True)
    recipe = work / "recipe.yaml"
    recipe.write_text(PIPELINE if trial.layout == "pipeline" else SINGLE)
    prompts = work / "prompts.jsonl"
    good, bad_lines = write_prompts(prompts, num_requests, rng, bad_every=13)
    out = work / "run"
    env = run_env(cache)
    res: dict = {"kind": trial.kind, "delay_s": round(trial.delay_s, 3), "layout": trial.layout,
                 "problems": []}
    run = start_run(recipe, prompts, out, env,
                    fsize=trial.fsize if trial.kind == "fsize" else None)
    if trial.kind == "fsize":
        code = wait(run, RUN_BOUND_S)
        res["exit"] = code
        if code is None:
            res["problems"].append("hang under the file-size limit")
        elif code not in (0, 3):
            res["problems"].append(f"exit {code} under the file-size limit: {run.log()[-800:]}")
        elif code == 3 and "could not write" not in run.log():
            res["problems"].append(f"exit 3 without naming the write: {run.log()[-800:]}")
        elif code == 3 and not _parses(out):
            res["problems"].append("a torn or corrupt line after the failed write")
    else:
        code = _inject(trial, run, res)
    found = wait_for_leftovers(run)
    if found:
        res["problems"].append(f"processes left behind: {found[:3]}")
    res["finished_before_fault"] = code == 0 and trial.kind != "fsize"
    again = start_run(recipe, prompts, out, env)
    rerun_code = wait(again, RUN_BOUND_S)
    res["rerun_exit"] = rerun_code
    if rerun_code is None:
        res["problems"].append("the rerun hung")
    elif rerun_code != 0:
        res["problems"].append(f"the rerun exited {rerun_code}: {again.log()[-800:]}")
    else:
        res["problems"] += exactly_once_problems(out, good, bad_lines)
    res["ok"] = not res["problems"]
    return res


def _inject(trial: Trial, run: Run, res: dict) -> Optional[int]:
    sig = {"kill9": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigint": signal.SIGINT,
           "sigterm_twice": signal.SIGTERM}[trial.kind]
    try:
        code = run.proc.wait(timeout=trial.delay_s)
        res["exit"] = code          # it finished before the fault
        if code != 0:
            res["problems"].append(f"exit {code} before any fault: {run.log()[-800:]}")
        return code
    except subprocess.TimeoutExpired:
        pass
    sent = time.monotonic()
    kill_group(run.pgid, sig)
    if trial.kind == "sigterm_twice":
        time.sleep(0.2)
        kill_group(run.pgid, sig)
    code = wait(run, RUN_BOUND_S if sig == signal.SIGKILL else 60.0)
    res["exit"] = code
    if sig == signal.SIGKILL:
        return code
    res["answer_s"] = round(time.monotonic() - sent, 3)
    if sig == signal.SIGINT and code == 1 and "init_import_site" in run.log():
        # Ctrl-C while CPython itself starts (its `site` import, before any batchinfer code):
        # CPython reports a fatal error and exits 1; nothing was written, the rerun is checked
        res["during_interpreter_start"] = True
        return code
    if code is None:
        res["problems"].append(f"no exit after {trial.kind}")
    elif code not in SIGNAL_CODES[sig] and code != 0:
        res["problems"].append(f"exit {code} after {trial.kind}: {run.log()[-800:]}")
    elif res["answer_s"] > SIGNAL_BOUND_S:
        res["problems"].append(f"{trial.kind} answered in {res['answer_s']} s")
    return code


def _parses(out: Path) -> bool:
    try:
        read_records(out / "outputs.jsonl")
        read_records(out / "errors.jsonl")
    except ValueError:
        return False
    return True
