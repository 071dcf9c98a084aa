"""Prefix grouping, deduplication and prefix caching in the job runner (runner/read_ahead.py):
outputs with all three on equal outputs with all three off; unseeded sampling is never
deduplicated; a leader the engine refuses takes its followers with it."""
from __future__ import annotations

import json
from pathlib import Path

from batchinfer.runner.job import EXIT_OK, JobSpec, run_job
from batchinfer.runner.read_ahead import Deduplicator, GroupingStats, PrefixWindow, dedup_key
from batchinfer.runner.recipe import Recipe
from batchinfer.engine.request import Request, RequestOutput, FinishReason, SamplingParams

TINY_MODEL = {"load_format": "dummy", "max_model_len": 512, "hf_overrides": {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}}
SYSTEM = "You answer questions about numbers briefly and precisely, without lists. " * 4


def _recipe(on: bool, sampling: SamplingParams, **io) -> Recipe:
    return Recipe(model=TINY_MODEL,
                  memory={"kv_cache_memory": "16MiB", "enable_prefix_caching": on},
                  io={"group_prefixes": on, "dedup": on, "max_in_flight": 64, **io},
                  sampling=sampling, strategy={"name": "baseline", "max_num_seqs": 8},
                  report={"plots": False})


def _workload(path: Path) -> Path:
    """40 requests: a shared system prompt (two variants), distinct questions, 30% duplicates,
    interleaved so that grouping has something to do."""
    rows = []
    for i in range(28):
        system = SYSTEM if i % 2 else SYSTEM.upper()
        rows.append({"id": f"r{i}", "prompt": system + f"What is {i} times {i + 3}?",
                     "metadata": {"i": i}})
    for j in range(12):                                # exact duplicates of earlier prompts
        rows.append({"id": f"dup{j}", "prompt": rows[j * 2]["prompt"], "metadata": {"dup": j}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(tmp_path: Path, name: str, on: bool, sampling: SamplingParams,
         **io) -> tuple[dict, dict]:
    out = tmp_path / name
    spec = JobSpec(recipe=_recipe(on, sampling, **io), input_path=_workload(tmp_path / "in.jsonl"),
                   output_dir=out, progress="off")
    assert run_job(spec).exit_code == EXIT_OK
    records = {}
    for line in (out / "outputs.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["id"]] = record
    return records, json.loads((out / "report.json").read_text())


def test_grouping_dedup_and_caching_change_no_output(tmp_path):
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain, _ = _run(tmp_path, "off", False, greedy)
    fast, report = _run(tmp_path, "on", True, greedy)
    assert len(plain) == len(fast) == 40
    for rid, record in plain.items():
        assert fast[rid]["text"] == record["text"]
        assert fast[rid]["completion_tokens"] == record["completion_tokens"]
        assert fast[rid]["metadata"] == record["metadata"]     # each keeps its own metadata
    dedup = report["session"]["dedup"]
    assert dedup["requests"] == 12 and dedup["output_tokens_saved"] == 12 * 8
    assert report["engine"]["prefix_cache"]["hit_tokens"] > 0
    # what the engine ran with reaches the report (docs/recipe.md promises preemption_mode)
    assert report["engine"]["preemption_mode"] == "recompute"
    assert report["engine"]["num_threads"] >= 1 and "async_scheduling" in report["engine"]
    grouping = report["session"]["grouping"]
    # the two system prompts alternate in the input: grouping makes each request's neighbour
    # share its system prompt
    assert grouping["shared_tokens_sent_order"] > grouping["shared_tokens_read_order"]
    assert grouping["prefill_tokens_saved"] > 0
    markdown = (tmp_path / "on" / "report.md").read_text()
    assert "## Duplicates" in markdown and "## Prefix grouping" in markdown


def test_a_small_window_in_input_order_streams_everything_in_order(tmp_path):
    """The window refills as the engine finishes; results held back for input order never stop
    the window from feeding the engine (the requests they wait for may still be in it)."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain, _ = _run(tmp_path, "off", False, greedy)
    out = tmp_path / "small"
    spec = JobSpec(recipe=_recipe(True, greedy, max_in_flight=3, group_window=5,
                                  output_order="input"),
                   input_path=tmp_path / "in.jsonl", output_dir=out, progress="off")
    assert run_job(spec).exit_code == EXIT_OK
    records = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    expected = [f"r{i}" for i in range(28)] + [f"dup{j}" for j in range(12)]
    assert [r["id"] for r in records] == expected
    assert all(r["text"] == plain[r["id"]]["text"] for r in records)
    report = json.loads((out / "report.json").read_text())
    assert report["session"]["grouping"]["prefill_tokens_saved"] > 0


def test_unseeded_sampling_is_never_deduplicated(tmp_path):
    _, report = _run(tmp_path, "unseeded", True, SamplingParams(max_tokens=4, temperature=0.8))
    assert report["session"]["dedup"]["requests"] == 0


def _request(rid: str, tokens: list[int], **sampling) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, **sampling))


def test_seeded_duplicates_follow_and_a_refused_leader_takes_its_followers():
    dedup = Deduplicator()
    leader = _request("a", [1, 2, 3], temperature=0.9, seed=7)
    assert dedup_key(_request("x", [1, 2, 3], temperature=0.9)) is None
    assert not dedup.follow(leader)
    dedup.lead(leader)
    assert dedup.follow(_request("b", [1, 2, 3], temperature=0.9, seed=7))
    assert not dedup.follow(_request("c", [1, 2, 3], temperature=0.9, seed=8))
    assert [f.request_id for f in dedup.abandon(leader)] == ["b"]
    assert not dedup.follow(_request("d", [1, 2, 3], temperature=0.9, seed=7))

    dedup.lead(leader)
    dedup.follow(_request("e", [1, 2, 3], temperature=0.9, seed=7))
    out = RequestOutput("a", [1, 2, 3], [5, 6], "xy", FinishReason.LENGTH)
    copies = dedup.results_for(out)
    assert [(c.request_id, c.output_token_ids) for c in copies] == [("e", [5, 6])]
    assert dedup.stats.requests == 1 and dedup.stats.prompt_tokens_saved == 3


def test_window_sweeps_the_token_trie_and_later_reads_join_the_sweep():
    window = PrefixWindow()
    for order, prompt in enumerate([[5, 1, 2], [9, 9], [5, 1, 3], [9, 8, 1], [5, 2]]):
        window.add(prompt, order, prompt)
    assert [window.pop(), window.pop()] == [[5, 1, 2], [5, 1, 3]]
    window.add([5, 1, 2, 7], 5, [5, 1, 2, 7])     # behind the cursor: waits for the next sweep
    window.add([5, 1, 4], 6, [5, 1, 4])           # ahead of it: joins this sweep
    assert [window.pop() for _ in range(4)] == [[5, 1, 4], [5, 2], [9, 8, 1], [9, 9]]
    window.add([1], 7, "first")
    window.add([5, 1, 2], 8, "equal prompts keep read order")
    window.add([5, 1, 2], 9, "second")
    assert [window.pop() for _ in range(len(window))] == [       # wrapped around
        "first", "equal prompts keep read order", "second", [5, 1, 2, 7]]


def test_grouping_stats_count_what_neighbours_share():
    stats = GroupingStats()
    for tokens in ([5, 1, 2], [9, 9], [5, 1, 3]):
        stats.on_read(tokens)
    for tokens in ([5, 1, 2], [5, 1, 3], [9, 9], [9, 9, 4]):
        stats.on_sent(tokens)
    stats.on_read([9, 9, 4])
    assert stats.as_dict() == {"shared_tokens_read_order": 0, "shared_tokens_sent_order": 4,
                               "prefill_tokens_saved": 4}
