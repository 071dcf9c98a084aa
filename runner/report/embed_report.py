"""An embedding job's report: requests, prompt tokens and their rate, batches and padding; none
of a generation's decode figures (output tokens, time per output token, KV cache, the length
predictor), which would only read zero."""
from __future__ import annotations

from typing import Optional

from .report import _fmt, _pct, _table

# a generation's session keys that say nothing of an embedding job
_DROPPED = ("completion_tokens", "copied_completion_tokens", "preemptions", "preempted_requests",
            "kv", "micro_batch_tokens", "strategy_decisions", "prefix_grouping")

DEFINITIONS = {
    "embedding time (s)": "report.json's session.generation_s: wall time from the first "
                          "request handed to the engine to the last result written (or now, "
                          "while running); model loading is excluded",
    "requests_per_s": "requests completed in this session / embedding time (failed ones "
                      "excluded)",
    "input_tokens_per_s": "prompt tokens of the completed requests (every input of a request "
                          "of several) / embedding time",
    "latency_s.e2e": "per request: from admission to the engine to its last input pooled",
    "batches": "forward passes: inputs per batch; padded_share: the padding's share of the "
               "tokens computed (rows x the longest row, summed)",
    "phases_s": "wall time spent per phase: model load, reading+tokenizing input, forwards "
                "(embedding the batches), writing results, rendering reports",
}

# the generation engine's phase names (SessionMetrics: engine_<step phase>) as an embedding
# user reads them: an embedding's forward passes are all prompt (prefill) steps
_PHASE_NAMES = {"engine_prefill": "forwards"}


def embedding_session(summary: dict, engine_stats: Optional[dict]) -> dict:
    """A session summary (SessionMetrics.summary) as an embedding job reports it."""
    out = {k: v for k, v in summary.items() if k not in _DROPPED}
    tp = summary.get("throughput") or {}
    out["throughput"] = {"requests_per_s": tp.get("requests_per_s"),
                         "input_tokens_per_s": tp.get("input_tokens_per_s")}
    latency = summary.get("latency_s") or {}
    out["latency_s"] = {"e2e": latency.get("e2e")}
    stats = engine_stats or {}
    computed, padded = stats.get("computed_prefill_tokens"), stats.get("padded_tokens")
    bs = summary.get("batch_size") or {}
    out["batches"] = {"steps": bs.get("steps"), "inputs_mean": bs.get("mean"),
                      "inputs_max": bs.get("max"),
                      "padded_tokens": padded, "prompt_tokens_computed": computed,
                      "padded_share": (round(1 - computed / padded, 4)
                                       if computed is not None and padded else None)}
    out.pop("batch_size", None)
    phases = summary.get("phases_s")
    if phases:
        out["phases_s"] = {_PHASE_NAMES.get(k, k): v for k, v in phases.items()}
    return out


def embedding_totals(totals: dict) -> dict:
    """report.json totals of an embedding run: a generation's without completion_tokens (an
    embedding has none; it read 0). Applied where totals are made: the job, `batchinfer report`
    recounting them, the Slurm merge."""
    return {k: v for k, v in totals.items() if k != "completion_tokens"}


def merged_embedding(report: dict) -> dict:
    """A merged Slurm report (report.merge_reports) of an embedding run's parts: its task (so
    it renders as one), totals and session without a generation's output figures, parts
    without output tok/s."""
    session = {k: v for k, v in (report.get("session") or {}).items()
               if k not in (*_DROPPED, "batch_size")}
    tp = session.get("throughput") or {}
    session["throughput"] = {"requests_per_s": tp.get("requests_per_s"),
                             "input_tokens_per_s": tp.get("input_tokens_per_s")}
    parts = [{k: v for k, v in p.items() if k != "output_tokens_per_s"}
             for p in report.get("parts") or []]
    merged_note = (report.get("definitions") or {}).get("merged")
    return {**report, "task": "embed", "totals": embedding_totals(report.get("totals") or {}),
            "session": session, "parts": parts,
            "definitions": {**DEFINITIONS, **({"merged": merged_note} if merged_note else {})}}


def _compute_line(engine: dict) -> list[str]:
    """Device and number format: what an embedding's compute is (no KV cache, no kernels)."""
    parts = [p for p in (engine.get("device"), engine.get("dtype_reason") or engine.get("dtype"))
             if p]
    return [f"**Compute:** {', '.join(parts)}  "] if parts else []


def _batching_line(strategy: Optional[dict], engine: dict) -> str:
    """The strategy by what batches an embedding's inputs (its generation settings, such as
    a scheduling policy, do nothing here)."""
    if not strategy:
        return "–"
    seqs, tokens = strategy.get("max_num_seqs"), strategy.get("max_num_batched_tokens")
    limits = " and ".join(f"{n:,} {what}" for n, what in ((seqs, "inputs"), (tokens, "tokens"))
                          if n)
    line = f"{strategy.get('name')}: up to {limits or 'the engine defaults'} per forward"
    if seqs and not tokens:
        line += " (tokens: the engine's default)"
    if engine.get("max_model_len"):
        line += f"; inputs up to {engine['max_model_len']:,} tokens (max_model_len)"
    return line


def render_embedding_markdown(report: dict, plot_names: tuple[str, ...] = ()) -> str:
    s = report.get("session") or {}
    totals = report.get("totals") or {}
    engine = report.get("engine") or {}
    pooler = engine.get("pooler") or {}
    out = [f"# batchinfer report: {report.get('run_dir', '')} (embeddings)", ""]
    detail = f" ({report['status_detail']})" if report.get("status_detail") else ""
    out += [f"**Status:** {report.get('status')}{detail}  ",
            f"**Updated:** {report.get('updated_at')}  ",
            f"**Model:** {report.get('model', '–')}  ", *_compute_line(engine)]
    if pooler:
        out += [f"**Pooling:** {pooler.get('pooling_type')}, normalized: "
                f"{str(pooler.get('use_activation')).lower()}, dimensions: "
                f"{pooler.get('dimensions') or pooler.get('hidden_size')}  "]
    out += [f"**Input:** {report.get('input', '–')} ({report.get('input_format', '?')})  ",
            f"**Batching:** {_batching_line(report.get('strategy'), engine)}  ", ""]
    if report.get("shard"):
        out += [f"**Shard:** task {report['shard']['index']} of {report['shard']['count']}", ""]
    out += ["## Requests (all sessions)", ""]
    out += _table(["input records", "outputs", "errors", "remaining", "prompt tokens"],
                  [[totals.get("input_records"), totals.get("outputs"), totals.get("errors"),
                    totals.get("remaining"), totals.get("prompt_tokens")]])
    codes = totals.get("errors_by_code") or {}
    if codes:
        out += ["Errors by code: " + ", ".join(f"`{k}` {v}" for k, v in sorted(codes.items())), ""]
    tp = s.get("throughput") or {}
    out += ["## Throughput (this session)", ""]
    out += _table(["requests/s", "prompt tok/s", "embedding time (s)", "completed", "failed"],
                  [[tp.get("requests_per_s"), tp.get("input_tokens_per_s"),
                    s.get("generation_s"), s.get("requests_completed"), s.get("requests_failed")]])
    e2e = (s.get("latency_s") or {}).get("e2e")
    if e2e:
        out += ["## Latency (seconds, this session)", ""]
        out += _table(["", "mean", "p50", "p90", "p99", "max"],
                      [["end to end"] + [e2e.get(p) for p in ("mean", "p50", "p90", "p99",
                                                              "max")]])
    batches = s.get("batches") or {}
    if batches:
        out += ["## Batches", ""]
        out += _table(["forwards", "inputs mean", "inputs max", "padded tokens", "padding share"],
                      [[batches.get("steps"), batches.get("inputs_mean"),
                        batches.get("inputs_max"), batches.get("padded_tokens"),
                        _pct(batches.get("padded_share"))]])
    phases = s.get("phases_s") or {}
    if phases:      # (a report.json written before the renaming still says engine_prefill)
        out += ["## Time per phase (seconds)", ""]
        out += _table([_PHASE_NAMES.get(k, k) for k in phases],
                      [[_fmt(v, 3) for v in phases.values()]])
    dedup = s.get("dedup") or {}
    if dedup.get("requests"):
        out += ["## Duplicates", "", f"{dedup['requests']:,} requests answered from an "
                f"identical request's embeddings; {dedup['prompt_tokens_saved']:,} prompt "
                "tokens not computed.", ""]
    if report.get("parts"):
        out += ["## Parts", ""]
        out += _table(["part", "status", "outputs", "errors", "updated"],
                      [[p.get("part"), p.get("status"), p.get("outputs"), p.get("errors"),
                        p.get("updated_at")] for p in report["parts"]])
    if plot_names:
        out += ["## Plots", ""] + [f"![{n}](plots/{n})" for n in plot_names] + [""]
    out += ["## Definitions", ""]
    out += [f"- **{k}**: {v}" for k, v in DEFINITIONS.items()] + [""]
    return "\n".join(out)
