"""report.json (the data) and report.md (the same, for people); merging Slurm parts.

report.json is rewritten every few seconds while a job runs (status "running"), and once more at
the end ("completed", "interrupted" or "failed"). Totals cover every session of the run directory;
throughput and latency describe the current session (earlier sessions are listed briefly).
"""
from __future__ import annotations

import datetime as _dt
import json
from typing import Any, Optional

from .metrics import DEFINITIONS

STATUSES = ("running", "completed", "interrupted", "failed")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def session_brief(session: dict) -> dict:
    keep = ("started_at", "ended_at", "status", "generation_s", "requests_completed",
            "requests_failed", "throughput")
    return {k: session.get(k) for k in keep}


def build_report(*, status: str, meta: dict, totals: dict, session: dict,
                 previous_sessions: list[dict], status_detail: Optional[str] = None) -> dict:
    assert status in STATUSES, status
    return {
        "status": status,
        "status_detail": status_detail,
        "updated_at": now_iso(),
        **meta,
        "totals": totals,
        "session": session,
        "previous_sessions": previous_sessions,
        "definitions": DEFINITIONS,
    }


# --- markdown -------------------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_fmt(c) if not isinstance(c, str) else c for c in row) + " |"
              for row in rows]
    return lines + [""]


def _online_lines(online: Optional[dict]) -> list[str]:
    """The online predictor (issue 43): its refits and the forecast error over the job."""
    if not online:
        return []
    examples = online.get("examples", 0)
    finished = online.get("finished", examples)      # examples: the newest max_examples of them
    kept = f" (the newest {examples} kept to learn from)" if finished != examples else ""
    line = (f"Learning from the job (`predictor.online`): {online.get('refits', 0)} refits on "
            f"{finished} finished requests{kept}, {online.get('refit_seconds', 0)} s "
            f"(longest {online.get('refit_max_ms', 0)} ms), {online.get('reforecasts', 0)} "
            "forecasts redone.")
    timeline = online.get("timeline") or []
    if timeline:
        line += " Forecast error of the finished requests' summed lengths, by window: " + ", ".join(
            f"{w['finished']}: {100 * w['error_online']:.1f}% (at admission "
            f"{100 * w['error_prior']:.1f}%)" for w in timeline[-6:]) + "."
    return [line, ""]


def _predictor_line(choice: Optional[dict]) -> list[str]:
    """The length predictor the job used (for `auto`, which one and why)."""
    if not choice:
        return []
    reason = choice.get("reason") or choice.get("path")     # a named predictor: its directory
    return [f"**Length predictor:** {choice.get('name')}{f' ({reason})' if reason else ''}  "]


def _auto_settings_line(auto: Optional[dict]) -> list[str]:
    """What the strategy's `auto` settings became, by simulating the job, and the runner-up."""
    if not auto:
        return []
    ran = [a for a in auto.get("alternatives", ()) if "simulated_output_tok_per_s" in a]
    line = f"**Auto ({', '.join(auto.get('keys', ()))}):** {auto.get('label')}"
    if ran:
        line += (f" (simulated {ran[0]['simulated_output_tok_per_s']:,.1f} output tok/s, best of "
                 f"{len(auto['alternatives'])}")
        if len(ran) > 1:
            ratio = ran[1]["simulated_output_tok_per_s"] / ran[0]["simulated_output_tok_per_s"]
            line += f"; next: {ran[1]['label']} at {ratio:.2f}x"
        line += ")"
    return [line + "  "]


def render_markdown(report: dict, plot_names: tuple[str, ...] = ()) -> str:
    if report.get("task") == "embed":           # (also `batchinfer report` re-rendering one)
        from .embed_report import render_embedding_markdown

        return render_embedding_markdown(report, plot_names)
    s = report.get("session") or {}
    totals = report.get("totals") or {}
    out = [f"# batchinfer report: {report.get('run_dir', '')}", ""]
    detail = f" ({report['status_detail']})" if report.get("status_detail") else ""
    out += [f"**Status:** {report.get('status')}{detail}  ", f"**Updated:** {report.get('updated_at')}  ",
            f"**Model:** {report.get('model', '–')}  ",
            *_compute_line(report.get("engine") or {}),
            f"**Input:** {report.get('input', '–')} ({report.get('input_format', '?')})  ",
            f"**Strategy:** {_strategy_line(report.get('strategy'))}  ",
            *_predictor_line(report.get("predictor")),
            *_auto_settings_line(report.get("auto_settings")), ""]
    if report.get("shard"):
        out += [f"**Shard:** task {report['shard']['index']} of {report['shard']['count']}", ""]

    out += ["## Requests (all sessions)", ""]
    total_in = totals.get("input_records")
    out += _table(["input records", "outputs", "errors", "remaining", "prompt tokens",
                   "completion tokens"],
                  [[total_in, totals.get("outputs"), totals.get("errors"), totals.get("remaining"),
                    totals.get("prompt_tokens"), totals.get("completion_tokens")]])
    codes = totals.get("errors_by_code") or {}
    if codes:
        out += ["Errors by code: " + ", ".join(f"`{k}` {v}" for k, v in sorted(codes.items())), ""]

    out += _lora_lines(s)

    tp = s.get("throughput") or {}
    out += ["## Throughput (this session)", ""]
    out += _table(["requests/s", "input tok/s", "output tok/s", "total tok/s", "generation time (s)",
                   "completed", "failed"],
                  [[tp.get("requests_per_s"), tp.get("input_tokens_per_s"),
                    tp.get("output_tokens_per_s"), tp.get("total_tokens_per_s"),
                    s.get("generation_s"), s.get("requests_completed"), s.get("requests_failed")]])
    if tp.get("computed_output_tokens_per_s") is not None:
        out += [f"Generated by the engine: {_fmt(tp['computed_output_tokens_per_s'])} output "
                "tok/s; the rest are replies copied to duplicate requests (see Duplicates).", ""]

    lat = s.get("latency_s") or {}
    rows = [[name] + [(lat.get(key) or {}).get(p) for p in ("mean", "p50", "p90", "p99", "max")]
            for key, name in (("e2e", "end to end"), ("ttft", "time to first token"),
                              ("tpot", "time per output token")) if lat.get(key)]
    if rows:
        out += ["## Latency (seconds, this session)", ""]
        out += _table(["", "mean", "p50", "p90", "p99", "max"], rows)

    kv = s.get("kv") or {}
    bs = s.get("batch_size") or {}
    out += ["## Engine", ""]
    out += _table(["KV capacity (tokens)", "KV usage mean", "KV usage max", "preemptions",
                   "steps", "batch size mean", "batch size max"],
                  [[kv.get("capacity_tokens"), _pct(kv.get("usage_mean")), _pct(kv.get("usage_max")),
                    s.get("preemptions"), bs.get("steps"), bs.get("mean"), bs.get("max")]])
    mb = s.get("micro_batch_tokens") or {}
    if mb:
        out += ["## Micro-batch tokens", "", "Tokens (prefill + decode) per micro-batch: even "
                "micro-batches keep every pipeline stage busy.", ""]
        out += _table(["micro-batches", "mean", "p10", "p50", "p90", "max", "CV",
                       "mean change", "prefill mean", "decode mean"],
                      [[mb.get("micro_batches"), mb.get("mean"), mb.get("p10"), mb.get("p50"),
                        mb.get("p90"), mb.get("max"), mb.get("cv"), mb.get("mean_change"),
                        mb.get("prefill_mean"), mb.get("decode_mean")]])
    pipeline = s.get("pipeline") or {}
    if pipeline.get("ranks"):
        out += ["## Workers", "", "Bubble ratio: share of the replica's active window a rank spent "
                "not computing (waiting for input or for the controller).", ""]
        out += _table(["rank", "replica", "stage", "tp rank", "micro-batches", "busy (s)",
                       "waiting to receive (s)", "bubble ratio"],
                      [[r["rank"], r["replica"], r["stage"], r["tp_rank"], r["micro_batches"],
                        r["busy_s"], r["recv_wait_s"], _pct(r["bubble_ratio"])]
                       for r in pipeline["ranks"]])
    phases = s.get("phases_s") or {}
    if phases:
        out += ["## Time per phase (seconds)", ""]
        out += _table(list(phases), [list(phases.values())])
    predictor = s.get("predictor") or {}
    if predictor:
        share = predictor.get("share_of_job")
        out += ["## Output-length predictor", "",
                f"`{predictor.get('name')}`: {predictor.get('requests')} requests in "
                f"{predictor.get('calls')} batches, {predictor.get('seconds')} s "
                f"({predictor.get('ms_per_request') or 0:.3f} ms per request, "
                f"{'–' if share is None else f'{100 * share:.3f}%'} of the job's time)"
                + (f"; its encoder: {predictor['encoder']}." if predictor.get("encoder") else "."),
                ""]
        if predictor.get("missing_oracle"):
            out += [f"{predictor['missing_oracle']} requests had no "
                    f"`{predictor.get('oracle_field', 'oracle field')}`: forecast at their "
                    "max_tokens.", ""]
        out += _online_lines(predictor.get("online"))
    decisions = s.get("strategy_decisions") or {}
    if decisions:
        by_phase = decisions.get("steps_by_phase") or {}
        out += ["## Strategy decisions", "",
                f"Steps by phase: {', '.join(f'{k} {v}' for k, v in by_phase.items()) or '–'}; "
                f"phase switches: {decisions.get('phase_switches', 0)}; "
                f"preemptions: {decisions.get('preemptions', 0)}.", ""]
        events = decisions.get("events") or []
        if events:
            out += _table(["t (s)", "switch", "reason", "inputs"],
                          [[e.get("t"), e.get("switch"), e.get("reason"),
                            ", ".join(f"{k}={v}" for k, v in e.items()
                                      if k not in ("t", "switch", "reason"))]
                           for e in events[:50]])
            if len(events) > 50:
                out += [f"({len(events) - 50} more in report.json)", ""]
    dedup = (report.get("session") or {}).get("dedup")
    if dedup and dedup.get("requests"):
        out += ["## Duplicates", "",
                f"{dedup['requests']:,} requests were answered from an identical request's "
                f"result (this session): {dedup['prompt_tokens_saved']:,} prompt and "
                f"{dedup['output_tokens_saved']:,} output tokens not computed.", ""]
    grouping = (report.get("session") or {}).get("grouping")
    if (grouping and grouping.get("shared_tokens_sent_order")
            and (report.get("engine") or {}).get("prefix_cache")):
        out += ["## Prefix grouping", "",
                f"Prompt tokens shared with the previous request: "
                f"{grouping['shared_tokens_read_order']:,} in input order, "
                f"{grouping['shared_tokens_sent_order']:,} in the grouped order sent to the "
                f"engine; grouping let up to {grouping['prefill_tokens_saved']:,} prompt tokens "
                f"come from the prefix cache instead of being computed (this session).", ""]
    prefix = (report.get("engine") or {}).get("prefix_cache")
    if prefix:
        rate = prefix.get("hit_rate")
        out += ["## Prefix cache", "",
                f"{prefix.get('hit_tokens', 0):,} of {prefix.get('queried_tokens', 0):,} tokens of "
                f"the admitted sequences came from the cache"
                + (f" ({rate:.1%})." if rate is not None else "."), ""]
    experts = (report.get("engine") or {}).get("expert_load")
    if experts:
        per_expert = experts.get("per_expert") or []
        idle = sum(1 for tokens in per_expert if not tokens)
        out += ["## Expert load", "",
                f"Tokens routed to each of the {len(per_expert)} experts, summed over the "
                f"sparse layers ({len(experts.get('per_layer') or [])}): "
                f"{sum(per_expert):,} in all, "
                f"the busiest expert {experts.get('max_over_mean')}x an even share, {idle} "
                "without a token (per layer in report.json; per interval in metrics.jsonl).", ""]
    strategy_stats = (report.get("engine") or {}).get("strategy_stats") or {}
    if strategy_stats:
        out += ["## Strategy", ""]
        out += _table(["measure", "value"],
                      [[k.replace("_", " "), json.dumps(v) if isinstance(v, dict) else v]
                       for k, v in strategy_stats.items()])
    if report.get("parts"):
        out += ["## Parts", ""]
        out += _table(["part", "status", "outputs", "errors", "output tok/s", "updated"],
                      [[p.get("part"), p.get("status"), p.get("outputs"), p.get("errors"),
                        p.get("output_tokens_per_s"), p.get("updated_at")] for p in report["parts"]])
    prev = report.get("previous_sessions") or []
    if prev:
        out += ["## Earlier sessions", ""]
        out += _table(["started", "status", "completed", "failed", "output tok/s"],
                      [[p.get("started_at"), p.get("status"), p.get("requests_completed"),
                        p.get("requests_failed"), (p.get("throughput") or {}).get("output_tokens_per_s")]
                       for p in prev])
    if plot_names:
        out += ["## Plots", ""] + [f"![{n}](plots/{n})" for n in plot_names] + [""]
    out += ["## Definitions", ""]
    out += [f"- **{k}**: {v}" for k, v in (report.get("definitions") or {}).items()] + [""]
    return "\n".join(out)


def _lora_lines(session: dict) -> list[str]:
    """The session's completed requests per LoRA adapter (model.lora_modules), the base
    model's the rest; nothing for a job without adapters."""
    by_lora = session.get("requests_by_lora") or {}
    if not by_lora:
        return []
    base = (session.get("requests_completed") or 0) - sum(by_lora.values())
    return ["## LoRA adapters (this session)", ""] + _table(
        ["adapter", "requests completed"],
        [[f"`{name}`".replace("|", "\\|"), n] for name, n in sorted(by_lora.items())]    # a
        + [["base model", base]])                               # name's | would end its cell


def _pct(value: Optional[float]) -> Optional[str]:
    return None if value is None else f"{100 * value:.1f}%"


def _compute_line(engine: dict) -> list[str]:
    """The number format and why (engine/cpu_dtype.py), the linears' kernel, model.quantization
    and the KV dtype."""
    if not engine.get("dtype"):
        return []
    parts = [engine.get("dtype_reason") or engine["dtype"]]
    if engine.get("linear_kernel"):
        parts.append(f"linears: {engine['linear_kernel']}")
    if engine.get("quantization"):
        parts.append(f"quantization: {engine['quantization']}")
    if engine.get("kv_cache_dtype"):
        parts.append(f"KV cache: {engine['kv_cache_dtype']}")
    layout = engine.get("parallel") or {}
    if layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1) > 1:
        parts.append(f"layout: tp={layout.get('tp')} pp={layout.get('pp')} dp={layout.get('dp')}"
                     + (f" ({layout['gpu_transport']})" if layout.get("gpu_transport") else "")
                     + ("" if layout.get("sequence_cache", True) else ", whole block tables"))
    return [f"**Compute:** {'; '.join(parts)}  "]


def _strategy_line(strategy: Optional[dict]) -> str:
    if not strategy:
        return "–"
    params = ", ".join(f"{k}={v}" for k, v in strategy.items() if k != "name" and v is not None)
    return f"{strategy.get('name')} ({params})" if params else str(strategy.get("name"))


# --- Slurm parts ----------------------------------------------------------------------------------
def merge_reports(parts: dict[str, Optional[dict]], root: str) -> dict:
    """One report over the parts of a sharded run: totals summed, throughput over the union of
    the parts' generation windows (the tasks run side by side)."""
    present = {name: rep for name, rep in parts.items() if rep}
    totals: dict[str, Any] = {"input_records": 0, "outputs": 0, "errors": 0, "remaining": 0,
                              "prompt_tokens": 0, "completion_tokens": 0, "errors_by_code": {}}
    session_tokens = {"requests": 0, "failed": 0, "prompt": 0, "completion": 0, "copied": 0}
    starts, ends, rows = [], [], []
    by_lora: dict[str, int] = {}
    for name, rep in sorted(present.items()):
        t = rep.get("totals") or {}
        for key in ("input_records", "outputs", "errors", "remaining", "prompt_tokens",
                    "completion_tokens"):
            if t.get(key) is None:
                totals[key] = None if key in ("input_records", "remaining") else totals[key]
            elif totals.get(key) is not None:
                totals[key] += t[key]
        for code, n in (t.get("errors_by_code") or {}).items():
            totals["errors_by_code"][code] = totals["errors_by_code"].get(code, 0) + n
        s = rep.get("session") or {}
        session_tokens["requests"] += s.get("requests_completed") or 0
        session_tokens["failed"] += s.get("requests_failed") or 0
        session_tokens["prompt"] += s.get("prompt_tokens") or 0
        session_tokens["completion"] += s.get("completion_tokens") or 0
        session_tokens["copied"] += s.get("copied_completion_tokens") or 0
        for name, n in (s.get("requests_by_lora") or {}).items():
            by_lora[name] = by_lora.get(name, 0) + n
        window = s.get("generation_window")
        if window and window[0] is not None and window[1] is not None:
            starts.append(window[0])
            ends.append(window[1])
        rows.append({"part": name, "status": rep.get("status"), "outputs": t.get("outputs"),
                     "errors": t.get("errors"), "updated_at": rep.get("updated_at"),
                     "output_tokens_per_s": (s.get("throughput") or {}).get("output_tokens_per_s")})
    missing = sorted(set(parts) - set(present))
    if missing:     # a task with no report yet: its records and what is left of them unknown
        totals["input_records"] = totals["remaining"] = None
        rows = sorted(rows + [{"part": name, "status": "no report yet"} for name in missing],
                      key=lambda row: row["part"])
    span = (max(ends) - min(starts)) if starts else 0.0
    rate = (lambda n: round(n / span, 3) if span > 0 else None)
    statuses = {rep.get("status") for rep in present.values()}
    if missing or "failed" in statuses:
        status = "failed" if "failed" in statuses else "interrupted"
    elif statuses == {"completed"}:
        status = "completed"
    elif "running" in statuses:
        status = "running"
    else:
        status = "interrupted"
    first = next(iter(present.values()), {})
    meta = {k: first.get(k) for k in ("batchinfer_version", "model", "input", "input_format",
                                      "recipe", "strategy", "predictor", "auto_settings",
                                      "engine")}
    meta["predictor"] = _merged_predictor(present) or meta["predictor"]
    session = {
        **_merged_engine([rep.get("session") or {} for rep in present.values()]),
        **_merged_predictor_cost([rep.get("session") or {} for rep in present.values()]),
        "requests_completed": session_tokens["requests"], "requests_failed": session_tokens["failed"],
        "prompt_tokens": session_tokens["prompt"], "completion_tokens": session_tokens["completion"],
        **({"requests_by_lora": by_lora} if by_lora else {}),
        "generation_s": round(span, 3),
        "throughput": {"requests_per_s": rate(session_tokens["requests"]),
                       "input_tokens_per_s": rate(session_tokens["prompt"]),
                       "output_tokens_per_s": rate(session_tokens["completion"]),
                       "total_tokens_per_s": rate(session_tokens["prompt"] + session_tokens["completion"]),
                       **({"computed_output_tokens_per_s": rate(session_tokens["completion"]
                                                                 - session_tokens["copied"])}
                          if session_tokens["copied"] else {})},
    }
    detail = f"no report yet from {', '.join(missing)}" if missing else None
    report = build_report(status=status, meta={**meta, "run_dir": root, "shard": None},
                          totals=totals, session=session, previous_sessions=[],
                          status_detail=detail)
    report["parts"] = rows
    report["definitions"] = {**DEFINITIONS, "merged": "totals are summed over parts; throughput "
                             "divides the parts' latest-session tokens by the span from the "
                             "earliest part start to the latest part end (tasks run in parallel)"}
    if first.get("task") == "embed":
        from .embed_report import merged_embedding

        return merged_embedding(report)
    return report


def _merged_predictor(present: dict[str, dict]) -> Optional[dict]:
    """The parts' length predictors when they differ (`auto` in tasks started together: one
    trains from the history, the others take the next choice meanwhile); None when one."""
    choices = {name: rep.get("predictor") for name, rep in sorted(present.items())}
    if len({json.dumps(c, sort_keys=True) for c in choices.values()}) < 2:
        return None
    reason = "; ".join(f"{name}: {(c or {}).get('name')}"
                       + (f" ({c['reason']})" if (c or {}).get("reason") else "")
                       for name, c in choices.items())
    return {"name": "per part", "reason": reason, "parts": choices}


def _merged_predictor_cost(sessions: list[dict]) -> dict:
    """The parts' length predictor work summed, its share of the parts' job time together (each
    part's time is its seconds over its share); {} when no part ran a predictor."""
    parts = [s["predictor"] for s in sessions if s.get("predictor")]
    if not parts:
        return {}
    def total(key: str):
        return sum(p.get(key) or 0 for p in parts)
    seconds, requests = total("seconds"), total("requests")
    job_s = sum(p["seconds"] / p["share_of_job"] for p in parts
                if p.get("share_of_job") and p.get("seconds"))
    merged = {"name": ", ".join(sorted({str(p.get("name")) for p in parts})),
              "calls": total("calls"), "requests": requests, "seconds": round(seconds, 4),
              "ms_per_request": round(1e3 * seconds / requests, 4) if requests else None,
              "share_of_job": round(seconds / job_s, 6) if job_s else None}
    fields = {p["oracle_field"] for p in parts if p.get("oracle_field")}
    if total("missing_oracle"):
        merged["missing_oracle"] = total("missing_oracle")
    if len(fields) == 1:
        merged["oracle_field"] = fields.pop()
    return {"predictor": merged}


def _merged_engine(sessions: list[dict]) -> dict:
    """The Engine table's figures over the parts' latest sessions (each task its own engine):
    KV capacity and preemptions and steps summed, the KV usage mean (a time average) weighted
    by each part's generation time and the batch size mean (per step) by its steps, maxima the
    largest; a figure no part has is left out."""
    def weighted(section: str, key: str, weight_of) -> Optional[float]:
        pairs = [((s.get(section) or {}).get(key), weight_of(s)) for s in sessions]
        pairs = [(v, w) for v, w in pairs if v is not None and w]
        total = sum(w for _, w in pairs)
        return round(sum(v * w for v, w in pairs) / total, 4) if total else None

    def steps(s: dict) -> int:
        return (s.get("batch_size") or {}).get("steps") or 0

    def seconds(s: dict) -> float:
        window = s.get("generation_window") or (None, None)
        return (window[1] - window[0]) if None not in window else 0.0

    def summed(values) -> Optional[float]:
        values = [v for v in values if v is not None]
        return sum(values) if values else None

    def largest(values) -> Optional[float]:
        values = [v for v in values if v is not None]
        return max(values) if values else None

    kv = {"capacity_tokens": summed((s.get("kv") or {}).get("capacity_tokens") for s in sessions),
          "usage_mean": weighted("kv", "usage_mean", seconds),
          "usage_max": largest((s.get("kv") or {}).get("usage_max") for s in sessions)}
    batch = {"steps": summed(steps(s) or None for s in sessions),
             "mean": weighted("batch_size", "mean", steps),
             "max": largest((s.get("batch_size") or {}).get("max") for s in sessions)}
    out = {"kv": {k: v for k, v in kv.items() if v is not None},
           "batch_size": {k: v for k, v in batch.items() if v is not None},
           "preemptions": summed(s.get("preemptions") for s in sessions)}
    return {k: v for k, v in out.items() if v not in (None, {})}
