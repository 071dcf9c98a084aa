"""Multi-process runtime: pipeline and data parallel workers give the single-process engine's
tokens; layouts are checked before anything starts; a dead or failing worker is named quickly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchinfer.engine.config import ParallelConfig
from batchinfer.engine.kernels import load_native_kernels
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.model.arch import arch_from_dict
from batchinfer.engine.request import SamplingParams
from batchinfer.engine.runtime.layout import (ParallelLayout, compute_balanced_split,
                                              even_layer_split)
from batchinfer.engine.runtime.pool import EVENTS_KEEP, WorkerError, WorkerPool

PROMPTS = ["Hi", "The capital of France is", "Write a haiku about the sea. " * 6,
           "List three prime numbers:", "Explain photosynthesis in one paragraph, for a child "
           "who has never heard of plants making food from light. " * 3, "1, 2, 3,"]
SMALL = {"cache": {"kv_cache_memory": "64MiB"}, "model": {"max_model_len": 512}}


def _arch(**over):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 1000, "max_position_embeddings": 512, **over}
    return arch_from_dict(cfg, "test")


# --- layout ----------------------------------------------------------------------------------------
def test_even_split_and_rank_mapping():
    assert even_layer_split(30, 2) == [15, 15] and even_layer_split(5, 3) == [2, 2, 1]
    layout = ParallelLayout.resolve(ParallelConfig(tp=2, pp=2, dp=2, pp_balance="layers"),
                                    _arch(num_hidden_layers=6))
    assert layout.world_size == 8 and layout.stage_range(1) == (3, 6)
    info = layout.info(6)
    assert (info.replica, info.stage, info.tp_rank) == (1, 1, 0)
    assert layout.prev_rank(6) == 4 and layout.next_rank(6) is None and layout.next_rank(4) == 6
    assert layout.tp_groups()[1] == [2, 3] and layout.sampling_rank(1) == 6
    assert info.partition.layer_start == 3 and info.partition.tp_size == 2


def test_default_split_balances_compute_with_the_lm_head_on_the_last_stage():
    smollm2 = _arch(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
    assert ParallelLayout.resolve(ParallelConfig(pp=2), smollm2).layers_per_stage == (17, 13)
    assert compute_balanced_split(smollm2, 3) == [12, 11, 7]
    # decode-only, short contexts: the head weighs its GEMM FLOPs alone (~8 layers)
    assert compute_balanced_split(smollm2, 2, prompt_per_output=0, mean_context=0) == [19, 11]
    tiny_head = _arch(num_hidden_layers=8, vocab_size=16)
    assert compute_balanced_split(tiny_head, 2) == [4, 4]


def test_impossible_layouts_name_the_key():
    with pytest.raises(ConfigError, match=r"parallel.pp: pp=6 .* only 5 layers"):
        ParallelLayout.resolve(ParallelConfig(pp=6), _arch())
    with pytest.raises(ConfigError, match=r"parallel.pp_layers: \[2, 2\] must list 2 positive"):
        ParallelLayout.resolve(ParallelConfig(pp=2, pp_layers=[2, 2]), _arch())
    with pytest.raises(ConfigError, match=r"parallel.tp: .*heads"):
        ParallelLayout.resolve(ParallelConfig(tp=3), _arch())
    assert ParallelLayout.resolve(ParallelConfig(pp=2, pp_layers=[1, 4]), _arch()).stage_range(1) == (1, 5)


# --- parity with the single-process engine ---------------------------------------------------------
@pytest.fixture(scope="module")
def reference(make_engine):
    engine = make_engine(**SMALL)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
                            repetition_penalty=1.2, ignore_eos=True)
    params = [greedy] * len(PROMPTS) + [seeded]
    prompts = PROMPTS + ["Once upon a time"]
    outs = engine.generate(prompts, params)
    return prompts, params, [o.output_token_ids for o in outs]


@pytest.mark.parametrize("parallel,scheduler", [
    ({"pp": 2}, {"policy": "hb", "chunk_size": 16, "max_num_batched_tokens": 64}),
    ({"pp": 2, "pp_layers": [20, 10]}, {"policy": "sb"}),
    ({"dp": 2}, {"policy": "hb"}),
    ({"pp": 2, "sequence_cache": False}, {"policy": "sb"}),     # whole tables in every plan
])
@pytest.mark.slow
def test_multiprocess_tokens_equal_single_process(make_engine, reference, parallel, scheduler):
    prompts, params, expected = reference
    with make_engine(**SMALL, parallel=parallel, scheduler=scheduler) as engine:
        outs = engine.generate(prompts, params)
        stats = engine.stats()
        encoders = [rep.executor.tables for rep in engine.replicas]
    assert [o.output_token_ids for o in outs] == expected
    assert all((e is None) == (parallel.get("sequence_cache") is False) for e in encoders)
    assert engine.info["parallel"]["sequence_cache"] is parallel.get("sequence_cache", True)
    ranks = stats["pipeline"]["ranks"]
    assert len(ranks) == 2 and all(r["micro_batches"] > 0 for r in ranks)
    assert all(0.0 <= r["bubble_ratio"] < 1.0 for r in ranks)


DUMMY8 = {"load_format": "dummy", "max_model_len": 512,
          "hf_overrides": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                           "num_hidden_layers": 4}}


@pytest.fixture(scope="module")
def dummy8_tp1_tokens(make_engine):
    """The single process's greedy tokens on DUMMY8, once for every layout below."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with make_engine(model=DUMMY8, cache=SMALL["cache"]) as engine:
        return [o.output_token_ids for o in engine.generate(PROMPTS, params)]


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"tp": 2, "pp": 2}, {"tp": 2, "tp_all_reduce": "gloo"}])
@pytest.mark.slow
def test_tensor_parallel_tokens_equal_tp1_on_the_same_dummy_weights(make_engine, dummy8_tp1_tokens,
                                                                     parallel):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = dummy8_tp1_tokens
    with make_engine(model=DUMMY8, cache=SMALL["cache"], parallel=parallel) as engine:
        got = [o.output_token_ids for o in engine.generate(PROMPTS, params)]
        ranks = engine.stats()["pipeline"]["ranks"]
        mode = engine.info["parallel"]["tp_all_reduce"]
    assert got == expected
    assert len(ranks) == 2 * parallel.get("pp", 1)
    assert mode == parallel.get("tp_all_reduce", "shm" if load_native_kernels() else "gloo")


# --- faults ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_killed_worker_is_named_within_seconds(make_engine):
    engine = make_engine(**SMALL, parallel={"pp": 2})
    victim = engine.replicas[0].executor.pool.procs[1]
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(_request(engine, f"r{i}", prompt, params))
    for _ in range(3):
        engine.step()
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(replica 0, stage 1, tp 0\).*SIGKILL"):
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - t0 < 10
    assert not any(p.is_alive() for p in engine.replicas[0].executor.pool.procs)


def _request(engine, rid, prompt, params):
    from batchinfer.engine.request import Request

    return Request(rid, engine.tokenizer.encode(prompt), params, prompt=prompt)


class _Spec:
    def __init__(self, rank):
        self.rank = rank


def test_the_pool_holds_only_the_newest_timeline_events_and_counts_all():
    """A long job's controller must not grow with its age: it holds what the report draws,
    while the per-rank totals count every event; a benchmark can ask to hold more."""
    pool = WorkerPool(["rank 0"], {0: {"replica": 0, "stage": 0, "tp_rank": 0}})

    def forwards(first, n):
        return [{"rank": 0, "replica": 0, "kind": "forward", "mb_id": i,
                 "start": float(i), "end": i + 0.5} for i in range(first, first + n)]

    pool._add_events(forwards(0, EVENTS_KEEP + 10))
    assert len(pool.events) == EVENTS_KEEP and pool.events[0]["mb_id"] == 10
    assert pool.stats.summary()["ranks"][0]["micro_batches"] == EVENTS_KEEP + 10
    pool.keep_events(EVENTS_KEEP * 2)
    pool._add_events(forwards(EVENTS_KEEP + 10, 100))
    assert len(pool.events) == EVENTS_KEEP + 100 and pool.events[0]["mb_id"] == 10


@pytest.mark.slow
def test_worker_exception_is_reported_with_its_rank():
    pool = WorkerPool(["rank 0 (stage 0)", "rank 1 (stage 1)"])
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank \d \(stage \d\) failed: ValueError: weights for layer 7"):
        pool.start(failing_worker_entry, [_Spec(0), _Spec(1)], timeout_s=60)
        for _ in range(10):
            pool.pump(5.0)
    assert pool.closed and not any(p.is_alive() for p in pool.procs)
    assert time.monotonic() - t0 < 30  # the sleeping workers were stopped, not waited for


def failing_worker_entry(spec, conn):
    conn.send(("ready", spec.rank, {}))
    conn.send(("error", spec.rank, "ValueError: weights for layer 7 are missing"))
    time.sleep(30)


TINY_PP_RECIPE = """
model:
  load_format: dummy
  max_model_len: 256
  hf_overrides: {num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128,
                 num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}
sampling: {max_tokens: 32, temperature: 0.8}
strategy: {name: baseline, max_num_seqs: 8}
parallel: {pp: 2}
memory: {kv_cache_memory: 8MiB}
io: {max_in_flight: 16}
report: {refresh_seconds: 0.5, plots: true, progress_interval_seconds: 1}
"""


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _workers_of(pid: int) -> list[int]:
    """The run's worker processes in rank order: its descendants (they fork from its fork
    server) named as workers."""
    from batchinfer.engine.runtime.worker import PROCESS_NAME_PREFIX

    found, todo = [], _children(pid)
    while todo:
        child = todo.pop(0)
        todo.extend(_children(child))
        try:
            name = Path(f"/proc/{child}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith(PROCESS_NAME_PREFIX):
            found.append((int(name[len(PROCESS_NAME_PREFIX):]), child))
    return [child for _, child in sorted(found)]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
@pytest.mark.slow
def test_kill_a_worker_then_resume_exactly_once(tmp_path):
    recipe = tmp_path / "pp.yaml"
    recipe.write_text(TINY_PP_RECIPE)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Count to {i}:"}) + "\n"
                               for i in range(60)))
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", str(recipe), "--input", str(prompts),
           "--output", str(out), "--progress", "lines"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outputs = out / "outputs.jsonl"
    deadline = time.monotonic() + 120
    while (not outputs.exists() or outputs.read_bytes().count(b"\n") < 10) and proc.poll() is None:
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)
    workers = _workers_of(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    t0 = time.monotonic()
    log, _ = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 15
    assert proc.returncode == 3, log
    assert "rank 1" in log and "SIGKILL" in log
    done_before = outputs.read_bytes().count(b"\n")
    assert 10 <= done_before < 60
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    ids = [json.loads(line)["id"] for line in outputs.read_text().splitlines()]
    errors = (out / "errors.jsonl").read_text().splitlines() if (out / "errors.jsonl").exists() else []
    assert sorted(ids) == sorted(f"q{i}" for i in range(60)) and not errors
    report = json.loads((out / "report.json").read_text())
    assert report["session"]["pipeline"]["ranks"][0]["micro_batches"] > 0
    assert (out / "plots" / "pipeline_timeline.png").stat().st_size > 1000


def test_a_step_timeout_names_the_rank_that_is_stopped():
    """The timeout's message gives each rank's process state, the unusual first: a rank stopped
    by SIGSTOP among waiting ones is named before them."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]
    try:
        procs[1].send_signal(signal.SIGSTOP)

        def state(proc) -> str:
            with open(f"/proc/{proc.pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0]

        deadline = time.monotonic() + 20        # rank 0 asleep (past its start), rank 1 stopped
        while (state(procs[0]), state(procs[1])) != ("S", "T") and time.monotonic() < deadline:
            time.sleep(0.05)
        pool = WorkerPool(["rank 0", "rank 1"])
        pool.procs = procs
        assert pool._process_states().startswith(
            f"rank 1 (pid {procs[1].pid}) stopped (SIGSTOP?); rank 0 (pid {procs[0].pid}) ")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_the_fork_server_ignores_sigint_from_its_start():
    """Ctrl-C reaches the whole process group; the fork server must ignore it already while it
    imports torch (it ignores SIGINT itself only after), else it prints its own traceback."""
    probe = ("import multiprocessing.forkserver as fs\n"
             "from batchinfer.engine.runtime.pool import start_fork_server\n"
             "start_fork_server()\n"
             "pid = fs._forkserver._forkserver_pid\n"
             "status = open(f'/proc/{pid}/status').read()\n"
             "ignored = int(status.split('SigIgn:')[1].split()[0], 16)\n"
             "print(bool(ignored & (1 << (2 - 1))))\n")   # SIGINT is signal 2
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


@pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="needs Linux /proc")
def test_helper_processes_are_named_apart_from_the_ranks():
    """ps tells a worker rank (batchinfer-r<rank>) from a helper such as a SiPipe sampler
    (batchinfer-s<replica>.<index>): run_child names each as it is told."""
    probe = ("import os, sys\n"
             "from batchinfer.engine.runtime.worker import run_child\n"
             "run_child(3, None, lambda: print(open('/proc/self/comm').read().strip()), "
             "name=sys.argv[1])\n")
    for name, shown in (("batchinfer-s0.1", "batchinfer-s0.1"), ("", "batchinfer-r3")):
        out = subprocess.run([sys.executable, "-c", probe, name], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == shown, out.stderr
