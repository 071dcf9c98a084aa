"""Metrics, report rendering, Slurm report merging, output ordering, progress lines."""
from __future__ import annotations

import io
import json

import pytest

from batchinfer.runner.report.metrics import Reservoir, SessionMetrics
from batchinfer.runner.report.timeline import MAX_POINTS, BoundedTimeline
from batchinfer.runner.report.plots import PLOT_NAMES, render_plots
from batchinfer.runner.progress import Progress
from batchinfer.runner.report.report import build_report, merge_reports, render_markdown
from batchinfer.engine.request import FinishReason, RequestOutput
from batchinfer.runner.sink import OrderedSink
from batchinfer.runner.slurm import detect_shard, parse_shard


def _out(n_prompt=4, n_out=5, arrival=0.0, first=0.1, finish=0.5, preempt=0):
    return RequestOutput(request_id="r", prompt_token_ids=[1] * n_prompt,
                         output_token_ids=[2] * n_out, text="t", finish_reason=FinishReason.STOP,
                         num_preemptions=preempt, arrival_time=arrival, first_token_time=first,
                         finish_time=finish)


def test_reservoir_is_exact_when_small_and_bounded_when_large():
    small = Reservoir(size=100)
    for v in range(1, 11):
        small.add(float(v))
    summary = small.summary()
    assert summary["count"] == 10 and summary["max"] == 10 and summary["p50"] == pytest.approx(5.5)
    big = Reservoir(size=50)
    for v in range(10_000):
        big.add(float(v))
    assert len(big.values) == 50 and big.summary()["count"] == 10_000
    assert Reservoir().summary() is None


def test_session_metrics_summary():
    m = SessionMetrics(interval_s=1.0)
    m.start({"generation_tokens": 100, "computed_prefill_tokens": 50, "num_preemptions": 2}, 0.0)
    m.on_admit(1.0)
    m.on_steps([{"dur": 0.5, "phase": "prefill", "num_seqs": 2, "kv_usage": 0.2,
                 "num_prefill_tokens": 8}, {"dur": 0.5, "phase": "decode", "num_seqs": 2,
                                             "kv_usage": 0.4, "num_decode_tokens": 2}])
    m.on_result(_out(preempt=1), 2.0)
    m.on_result(_out(n_out=1), 2.5)
    m.on_error("invalid_json", 2.6)
    m.finished_t = 3.0
    sample = m.sample(3.0, {"generation_tokens": 106, "computed_prefill_tokens": 58,
                            "num_preemptions": 3})
    assert sample["output_tokens_per_s"] == pytest.approx(2.0)
    assert sample["requests_done"] == 2 and sample["preemptions_total"] == 1
    s = m.summary(10.0, {"num_preemptions": 3, "kv_capacity_tokens": 1000})
    assert s["generation_s"] == 2.0  # from first admission to the end of generation, not "now"
    tp = s["throughput"]
    assert tp["requests_per_s"] == 1.0 and tp["input_tokens_per_s"] == 4.0
    assert tp["output_tokens_per_s"] == 3.0 and tp["total_tokens_per_s"] == 7.0
    assert s["latency_s"]["e2e"]["count"] == 2 and s["latency_s"]["tpot"]["count"] == 1
    assert s["kv"]["usage_mean"] == pytest.approx(0.3) and s["kv"]["usage_max"] == 0.4
    assert s["preemptions"] == 1 and s["preempted_requests"] == 1
    assert s["batch_size"]["histogram"] == {"2": 2}
    assert s["strategy_decisions"]["phase_switches"] == 1
    assert s["errors_by_code"] == {"invalid_json": 1}
    assert sample["mb_tokens_min"] == 2 and sample["mb_tokens_max"] == 8
    assert sample["mb_prefill_mean"] == 4.0 and sample["mb_decode_mean"] == 1.0
    assert s["micro_batch_tokens"]["micro_batches"] == 2 and s["micro_batch_tokens"]["mean"] == 5.0
    assert "## Micro-batch tokens" in render_markdown({"session": s})


def test_a_long_jobs_plot_timeline_stays_bounded_and_keeps_its_sums_and_peaks():
    """A day-long job samples every second; the plots' timeline keeps at most MAX_POINTS evenly
    spaced points (it kept every sample: 1.3 KB a second, and a redraw that grew with the job)
    that still sum to the job's requests and tokens and keep the peaks."""
    m = SessionMetrics(interval_s=1.0)
    m.start({"generation_tokens": 0, "computed_prefill_tokens": 0}, 0.0)
    n = 3 * MAX_POINTS + 5
    tokens = 0
    for i in range(1, n + 1):
        spike = i == 1234
        m.on_steps([{"dur": 0.5, "phase": "decode", "num_seqs": 40 if spike else 4,
                     "kv_usage": 0.9 if spike else 0.1, "num_decode_tokens": 4}])
        m.on_result(_out(), float(i))
        tokens += 10 * i % 7
        m.sample(float(i), {"generation_tokens": tokens, "computed_prefill_tokens": 0})
    points = m.timeline.points()
    assert len(points) <= MAX_POINTS
    assert sum(p["requests_done"] for p in points) == n and sum(p["steps"] for p in points) == n
    assert sum(p["output_tokens_per_s"] * p["dt"] for p in points) == pytest.approx(tokens, rel=1e-3)
    assert max(p["kv_usage_max"] for p in points) == 0.9
    assert max(p["batch_size_max"] for p in points) == 40
    assert points[-1]["t"] == n and points[-1]["completed_total"] == n
    assert len({p["dt"] for p in points[:-1]}) == 1          # evenly spaced
    assert points[0]["batch_size_mean"] == 4.0 and points[0]["phase_s"] == {"decode": 2.0}


def test_a_bounded_timeline_merges_step_weighted_and_keeps_the_later_reading():
    timeline = BoundedTimeline(max_points=2)
    timeline.add({"t": 1.0, "dt": 1.0, "steps": 1, "batch_size_mean": 10.0, "kv_usage": 0.5,
                  "mb_tokens_min": 3, "mode_steps": {"was": 1}, "output_tokens_per_s": 10.0})
    timeline.add({"t": 3.0, "dt": 2.0, "steps": 3, "batch_size_mean": 2.0, "kv_usage": 0.2,
                  "mb_tokens_min": 5, "mode_steps": {"was": 2, "cas": 1},
                  "output_tokens_per_s": 1.0})
    [point] = timeline.points()
    assert point["batch_size_mean"] == 4.0 and point["kv_usage"] == 0.2
    assert point["output_tokens_per_s"] == 4.0 and point["dt"] == 3.0 and point["t"] == 3.0
    assert point["mb_tokens_min"] == 3 and point["mode_steps"] == {"was": 3, "cas": 1}
    assert timeline.samples_per_point == 2


def test_batchinfer_report_reads_the_latest_sessions_samples_into_bounded_points(tmp_path):
    """`batchinfer report` redraws the plots from metrics.jsonl: a long session's samples come
    back as at most MAX_POINTS points (a list of every sample took 1 GB for three days)."""
    from batchinfer.runner.report.report_files import latest_session_metrics

    n = 2 * MAX_POINTS + 3
    with open(tmp_path / "metrics.jsonl", "w") as fh:
        for session, count in ((1, 5), (2, n)):
            for i in range(1, count + 1):
                fh.write(json.dumps({"session": session, "t": float(i), "dt": 1.0,
                                     "requests_done": session, "steps": 1,
                                     "kv_usage_max": 0.7 if i == 77 else 0.1}) + "\n")
    points = latest_session_metrics(tmp_path)
    assert len(points) <= MAX_POINTS
    assert sum(p["requests_done"] for p in points) == 2 * n       # session 2's samples only
    assert points[-1]["t"] == n and max(p["kv_usage_max"] for p in points) == 0.7


def test_micro_batch_tokens_measure_the_balance():
    from batchinfer.runner.report.micro_batch_tokens import MicroBatchTokens

    even, uneven = MicroBatchTokens(), MicroBatchTokens()
    for i in range(100):
        even.add(60, 40)
        uneven.add(200 if i % 2 else 0, 0)                 # Sarathi's big / empty alternation
    assert even.summary()["cv"] == 0.0 and even.summary()["mean_change"] == 0.0
    u = uneven.summary()
    assert u["mean"] == 100.0 and u["cv"] == pytest.approx(1.0) and u["mean_change"] == 200.0
    assert (u["p10"], u["p50"], u["p90"], u["max"]) == (0, 0, 200, 200)
    # consecutive changes are counted within a replica, never across two
    two = MicroBatchTokens()
    for i in range(10):
        two.add(10, 0, replica=0)
        two.add(50, 0, replica=1)
    assert two.summary()["mean_change"] == 0.0
    assert MicroBatchTokens().summary() is None


def test_markdown_has_every_section():
    m = SessionMetrics()
    m.on_admit(0.0)
    m.on_result(_out(), 1.0)
    report = build_report(status="completed", meta={"run_dir": "runs/x", "model": "m",
                                                     "strategy": {"name": "baseline", "policy": "hb"}},
                          totals={"outputs": 1, "errors": 2, "errors_by_code": {"invalid_json": 2}},
                          session=m.summary(1.0), previous_sessions=[{"status": "interrupted"}])
    md = render_markdown(report, PLOT_NAMES)
    for heading in ("# batchinfer report: runs/x", "## Requests", "## Throughput", "## Latency",
                    "## Engine", "## Strategy decisions", "## Earlier sessions", "## Plots",
                    "## Definitions"):
        assert heading in md
    assert "`invalid_json` 2" in md and "baseline (policy=hb)" in md


def test_compute_line_names_the_format_the_linears_and_the_quantization():
    engine = {"dtype": "float32", "dtype_reason": "float32: asked for", "kv_cache_dtype": "float32",
              "linear_kernel": "int8 (avx512_vnni); LM head: blocked (avx512 tile)",
              "quantization": "int8 (AVX512-VNNI: ...; LM head in the model's dtype)"}
    report = build_report(status="completed", meta={"run_dir": "runs/x", "model": "m",
                                                     "engine": engine},
                          totals={"outputs": 0, "errors": 0}, session={}, previous_sessions=[])
    line = next(l for l in render_markdown(report).splitlines() if l.startswith("**Compute:**"))
    assert "linears: int8 (avx512_vnni)" in line and "quantization: int8 (AVX512-VNNI" in line
    plain = {**engine, "linear_kernel": "blocked (avx512 tile)", "quantization": None}
    report["engine"] = plain
    line = next(l for l in render_markdown(report).splitlines() if l.startswith("**Compute:**"))
    assert "quantization" not in line and "layout" not in line          # one process
    report["engine"] = {**plain, "parallel": {"tp": 1, "pp": 2, "dp": 1, "gpu_transport": None,
                                              "sequence_cache": False}}
    line = next(l for l in render_markdown(report).splitlines() if l.startswith("**Compute:**"))
    assert "layout: tp=1 pp=2 dp=1, whole block tables" in line


def test_merge_reports_sums_parts():
    def part(outputs, errors, start, end, status="completed"):
        return {"status": status, "model": "m", "totals": {
            "input_records": outputs + errors, "outputs": outputs, "errors": errors, "remaining": 0,
            "prompt_tokens": 10 * outputs, "completion_tokens": 20 * outputs,
            "errors_by_code": {"invalid_json": errors}},
            "session": {"requests_completed": outputs, "prompt_tokens": 10 * outputs,
                        "completion_tokens": 20 * outputs, "generation_window": [start, end],
                        "throughput": {"output_tokens_per_s": 1.0}}}
    merged = merge_reports({"part-00000-of-00002": part(3, 1, 100.0, 110.0),
                            "part-00001-of-00002": part(5, 0, 102.0, 120.0)}, "runs/x")
    assert merged["status"] == "completed"
    assert merged["totals"]["outputs"] == 8 and merged["totals"]["errors"] == 1
    assert merged["totals"]["errors_by_code"] == {"invalid_json": 1}
    assert merged["session"]["generation_s"] == 20.0
    assert merged["session"]["throughput"]["output_tokens_per_s"] == 8.0  # 160 tokens / 20 s
    assert "computed_output_tokens_per_s" not in merged["session"]["throughput"]
    assert "## Parts" in render_markdown(merged)
    copied = part(5, 0, 102.0, 120.0)
    copied["session"]["copied_completion_tokens"] = 40          # two replies copied (io.dedup)
    merged = merge_reports({"part-00000-of-00002": part(3, 1, 100.0, 110.0),
                            "part-00001-of-00002": copied}, "runs/x")
    assert merged["session"]["throughput"]["computed_output_tokens_per_s"] == 6.0   # 120 / 20
    missing = merge_reports({"part-00000-of-00002": part(3, 1, 0, 1), "part-00001-of-00002": None},
                            "runs/x")
    assert missing["status"] == "interrupted" and "part-00001" in missing["status_detail"]
    assert missing["totals"]["remaining"] is None and missing["totals"]["input_records"] is None
    assert missing["totals"]["outputs"] == 3
    assert [(r["part"], r["status"]) for r in missing["parts"]] == [
        ("part-00000-of-00002", "completed"), ("part-00001-of-00002", "no report yet")]


def test_a_merged_report_shows_the_parts_engines():
    """Each task runs its own engine: the merged Engine table sums capacity, steps and
    preemptions, weights the means by each part's steps and takes the largest maxima."""
    def part(capacity, usage_mean, usage_max, steps, mean, biggest, preemptions, seconds):
        return {"status": "completed", "totals": {"outputs": 1}, "session": {
            "kv": {"capacity_tokens": capacity, "usage_mean": usage_mean, "usage_max": usage_max},
            "batch_size": {"steps": steps, "mean": mean, "max": biggest},
            "preemptions": preemptions, "generation_window": [10.0, 10.0 + seconds]}}
    # usage is a time average: weighted by each part's generation time (1 s and 3 s), the
    # batch size mean by its steps (30 and 10)
    merged = merge_reports({"part-00000-of-00002": part(1000, 0.2, 0.5, 30, 4.0, 6, 1, 1.0),
                            "part-00001-of-00002": part(1000, 0.5, 0.9, 10, 8.0, 12, 2, 3.0)},
                           "runs/x")
    session = merged["session"]
    assert session["kv"] == {"capacity_tokens": 2000, "usage_mean": 0.425, "usage_max": 0.9}
    assert session["batch_size"] == {"steps": 40, "mean": 5.0, "max": 12}
    assert session["preemptions"] == 3
    engine_rows = render_markdown(merged).split("## Engine")[1].split("##")[0]
    assert "| 2,000 | 42.5% | 90.0% | 3 | 40 | 5.00 | 12 |" in engine_rows
    bare = merge_reports({"part-00000-of-00001": {"status": "completed", "session": {}}}, "x")
    assert "kv" not in bare["session"] and "preemptions" not in bare["session"]


def test_plots_are_pngs():
    timeline = [{"t": float(i), "output_tokens_per_s": i, "prefill_tokens_per_s": 1, "kv_usage": 0.1,
                 "kv_usage_max": 0.2, "num_running": 3, "batch_size_mean": 2,
                 "batch_size_max": 3, "mb_prefill_mean": 30.0 * (i % 2), "mb_decode_mean": 8.0,
                 "mb_tokens_min": 8, "mb_tokens_max": 40, "mode_steps": {"was": 3, "cas": i}}
                for i in range(5)]
    plots = render_plots(timeline, {"1": 3, "4": 2})
    assert set(plots) == set(PLOT_NAMES)
    assert all(png.startswith(b"\x89PNG") for png in plots.values())
    assert render_plots([]) == {}


def test_ordered_sink():
    written = []
    sink = OrderedSink("input", lambda kind, item: written.append(item))
    numbers = [sink.admit() for _ in range(4)]
    sink.submit(numbers[2], ("output", "c"))
    sink.submit(numbers[1], ("output", "b"))
    assert written == [] and sink.pending == 4 and sink.held == 2
    sink.submit(numbers[0], ("error", "a"))
    assert written == ["a", "b", "c"] and sink.pending == 1
    sink.submit(numbers[3], ("output", "d"))
    assert written == ["a", "b", "c", "d"] and sink.pending == 0
    completion = OrderedSink("completion", lambda kind, item: written.append(item))
    completion.admit(), completion.admit()
    completion.submit(1, ("output", "y"))
    assert written[-1] == "y" and completion.pending == 1


def test_plain_progress_lines():
    stream = io.StringIO()
    progress = Progress(total=10, already_done=2, mode="lines", interval_s=0.0, stream=stream)
    progress.update(3, 1, 120)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert "batchinfer progress: 6/10 requests (60.0%), 1 errors" in lines[0]
    assert "ETA" in lines[0] and lines[0][:4].isdigit()  # timestamped
    assert "batchinfer finished" in lines[1]


def test_a_resumed_runs_progress_counts_the_errors_already_written():
    """A resume counts the requests already done (outputs and errors) in `done`: its errors
    count the same run's errors, not this session's alone ('300/300 requests, 0 errors' while
    errors.jsonl held one)."""
    stream = io.StringIO()
    progress = Progress(total=10, already_done=4, already_failed=1, mode="lines",
                        interval_s=0.0, stream=stream)
    progress.update(3, 2, 120)
    progress.close()
    first, last = stream.getvalue().splitlines()
    assert "batchinfer progress: 9/10 requests (90.0%), 3 errors" in first
    assert "batchinfer finished: 9/10 requests (90.0%), 3 errors" in last


@pytest.mark.parametrize("unit, shown", [("output", "out tok/s"), ("prompt", "prompt tok/s")])
def test_the_progress_bar_names_the_tokens_its_rate_counts(unit, shown):
    """An embedding job's rate counts prompt tokens: its bar says so (the bar is built when the
    Progress is, so the unit is a constructor argument)."""
    stream = io.StringIO()
    progress = Progress(total=4, mode="bar", stream=stream, unit=unit)
    progress.update(2, 0, 64)
    progress.close()
    assert shown in stream.getvalue() and progress.unit == unit


def test_slurm_shard_detection():
    assert detect_shard({}).count == 1
    # an sbatch script (no step) runs one process: it takes the whole input
    assert detect_shard({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).count == 1
    shard = detect_shard({"SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_NTASKS": "4"})
    assert (shard.index, shard.count) == (2, 4)
    shard = detect_shard({"SLURM_STEP_ID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "8",
                          "SLURM_STEP_NUM_TASKS": "2"})
    assert (shard.index, shard.count) == (1, 2)
    assert (parse_shard("3/5").index, parse_shard("3/5").count) == (3, 5)
    from batchinfer.engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"must be in 0\.\.4"):
        parse_shard("5/5")
    with pytest.raises(ConfigError, match="N, the number of shards, must be at least 1"):
        parse_shard("0/0")
    with pytest.raises(ConfigError):
        detect_shard({"SLURM_STEP_ID": "0", "SLURM_PROCID": "4", "SLURM_NTASKS": "4"})


def test_report_follows_the_latest_sessions_plots_setting(tmp_path):
    """recipe.resolved.yaml keeps the recipe the first results were made with, so `batchinfer
    report` reads report.plots from the newest session in run.json (the recipe where run.json
    has none)."""
    from batchinfer.runner.report.report_files import plots_wanted

    (tmp_path / "recipe.resolved.yaml").write_text("report:\n  plots: true\n")
    assert plots_wanted(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"sessions": [{"plots": True},
                                                                {"plots": False}]}))
    assert not plots_wanted(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"sessions": [{"pid": 1}]}))
    assert plots_wanted(tmp_path)


def test_report_rebuilds_a_lost_report_and_names_where_the_run_is(tmp_path):
    """`batchinfer report` on a run whose report.json is gone or unreadable rebuilds it from
    the results (said in its status); a copied run is titled by where it is now; a directory
    without results stays "no report"."""
    from batchinfer.runner.report.report_files import rerender

    run = tmp_path / "copied"
    run.mkdir()
    (run / "outputs.jsonl").write_text("".join(
        json.dumps({"id": f"r{i}", "prompt_tokens": 3, "completion_tokens": 2}) + "\n"
        for i in range(3)))
    (run / "run.json").write_text(json.dumps({"input": "/data/in.jsonl", "input_format": "jsonl"}))
    (run / "recipe.resolved.yaml").write_text("strategy:\n  name: gllm\n")
    for lost, content in (("unreadable", "{bad"), ("missing", None)):
        if content is None:
            (run / "report.json").unlink()
        else:
            (run / "report.json").write_text(content)
        markdown = rerender(run)
        report = json.loads((run / "report.json").read_text())
        assert report["totals"]["outputs"] == 3 and report["strategy"]["name"] == "gllm"
        assert f"report.json was {lost}: rebuilt from outputs.jsonl" in report["status_detail"]
        assert markdown.startswith(f"# batchinfer report: {run}")
    report["run_dir"] = "/elsewhere/original"
    (run / "report.json").write_text(json.dumps(report))
    assert rerender(run).startswith(f"# batchinfer report: {run}")
    (tmp_path / "empty").mkdir()
    assert rerender(tmp_path / "empty") is None


def test_report_keeps_the_plots_only_the_job_could_draw(tmp_path):
    """`batchinfer report` redraws the metrics' plots but cannot redraw the pipeline timeline
    (the engine's events) or the online predictor's forecast error: report.md dropped their
    links though the files were there. Linked before and still on disk, they stay linked."""
    from batchinfer.runner.report.report_files import rerender

    run = tmp_path / "run"
    (run / "plots").mkdir(parents=True)
    (run / "outputs.jsonl").write_text(json.dumps({"id": "r0", "prompt_tokens": 3,
                                                   "completion_tokens": 2}) + "\n")
    (run / "run.json").write_text(json.dumps({"input": "/data/in.jsonl", "input_format": "jsonl"}))
    (run / "recipe.resolved.yaml").write_text("strategy:\n  name: baseline\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(
        {"session": 1, "t": t, "dt": 1.0, "requests_done": t, "output_tokens_per_s": 5.0,
         "batch_size_mean": 2.0, "batch_size_max": 2, "kv_usage": 0.1, "kv_usage_max": 0.1,
         "num_running": 2}) + "\n" for t in (1.0, 2.0)))
    for name in ("pipeline_timeline.png", "forecast_error.png", "old.png"):
        (run / "plots" / name).write_bytes(b"\x89PNG")
    (run / "report.md").write_text("## Plots\n\n![pipeline_timeline.png](plots/pipeline_timeline"
                                   ".png)\n![forecast_error.png](plots/forecast_error.png)\n"
                                   "![gone.png](plots/gone.png)\n")
    markdown = rerender(run)
    assert "![throughput.png](plots/throughput.png)" in markdown          # redrawn
    assert "![pipeline_timeline.png](plots/pipeline_timeline.png)" in markdown
    assert "![forecast_error.png](plots/forecast_error.png)" in markdown
    assert "gone.png" not in markdown and "old.png" not in markdown
    assert (run / "report.md").read_text() == markdown


def test_a_merged_report_says_each_parts_predictor_when_they_differ():
    """Tasks started together with `predictor: auto`: one trains a predictor from the history,
    the others take the shipped one meanwhile. The merged report named the first part's for
    all; now each part's, when they differ (one when they agree)."""
    def part(choice):
        return {"status": "completed", "model": "m", "predictor": choice,
                "totals": {"outputs": 1, "errors": 0, "input_records": 1, "remaining": 0},
                "session": {}}
    trained = {"name": "bert", "source": "history", "reason": "trained on 80 records"}
    shipped = {"name": "bert", "source": "shipped", "reason": "shipped for m"}
    merged = merge_reports({"part-00000-of-00002": part(trained),
                            "part-00001-of-00002": part(shipped)}, "runs/x")
    assert merged["predictor"]["parts"] == {"part-00000-of-00002": trained,
                                            "part-00001-of-00002": shipped}
    line = next(l for l in render_markdown(merged).splitlines()
                if l.startswith("**Length predictor:**"))
    assert "part-00000-of-00002: bert (trained on 80 records)" in line
    assert "part-00001-of-00002: bert (shipped for m)" in line
    same = merge_reports({"part-00000-of-00002": part(trained),
                          "part-00001-of-00002": part(dict(trained))}, "runs/x")
    assert same["predictor"] == trained


def test_a_merged_report_sums_the_parts_predictor_work():
    """Each part's report has its predictor's cost (session.predictor); the merged one summed
    them (it had none), its share over the parts' job time together, and says how many
    requests an oracle predictor found without its field, as each part's report.md does."""
    def part(seconds, share, requests, missing):
        return {"status": "completed", "model": "m", "totals": {"outputs": requests},
                "session": {"predictor": {"name": "oracle", "calls": 2, "requests": requests,
                                          "seconds": seconds, "share_of_job": share,
                                          "missing_oracle": missing,
                                          "oracle_field": "metadata.true_len"}}}
    # part 0: 1 s of a 100 s job, part 1: 3 s of a 50 s job -> 4 s of 150 s
    merged = merge_reports({"part-00000-of-00002": part(1.0, 0.01, 10, 0),
                            "part-00001-of-00002": part(3.0, 0.06, 30, 4)}, "runs/x")
    predictor = merged["session"]["predictor"]
    assert predictor["seconds"] == 4.0 and predictor["requests"] == 40
    assert predictor["calls"] == 4 and predictor["ms_per_request"] == 100.0
    assert predictor["share_of_job"] == pytest.approx(4 / 150, abs=1e-6)
    text = render_markdown(merged)
    assert "`oracle`: 40 requests in 4 batches, 4.0 s" in text and "2.667% of the job" in text
    assert "4 requests had no `metadata.true_len`: forecast at their max_tokens." in text
    assert "requests had no" not in render_markdown(
        merge_reports({"part-00000-of-00001": part(1.0, 0.01, 10, 0)}, "runs/x"))
    bare = merge_reports({"part-00000-of-00001": {"status": "completed", "session": {}}}, "x")
    assert "predictor" not in bare["session"]
