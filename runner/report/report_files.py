"""Re-rendering a finished (or killed) run's report from its files, and merging Slurm parts."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from ..io.inputs import Shard
from .embed_report import embedding_totals
from .plots import render_plots
from .report import merge_reports, now_iso, render_markdown
from ..run_dir import (MANIFEST, METRICS, PLOTS, RECIPE, REPORT_JSON, REPORT_MD, RunDir, in_use,
                       iter_jsonl_file, list_parts, read_json, report_writer)
from .timeline import BoundedTimeline

log = logging.getLogger(__name__)


def refreshed_report(path: Path) -> Optional[dict]:
    """report.json with its totals recounted from outputs/errors, and a stale 'running' status
    (the process died without its final report) turned into 'interrupted'."""
    path = Path(path)
    report = read_json(path / REPORT_JSON)
    run_dir, prior = RunDir.open(path, Shard(), resume=True, read_only=True)
    run_dir.close()
    if not isinstance(report, dict):
        if not (prior.num_outputs or prior.num_errors):
            return None
        report = _report_from_files(path)
    report["run_dir"] = str(path)          # where it is now (a copied or moved run)
    totals = dict(report.get("totals") or {})
    totals.update(outputs=prior.num_outputs, errors=prior.num_errors,
                  errors_by_code=dict(prior.error_codes), prompt_tokens=prior.prompt_tokens,
                  completion_tokens=prior.completion_tokens)
    if totals.get("input_records") is not None:
        totals["remaining"] = max(totals["input_records"] - prior.num_outputs - prior.num_errors, 0)
    report["totals"] = embedding_totals(totals) if report.get("task") == "embed" else totals
    if report.get("status") == "running" and not in_use(path):
        report["status"] = "interrupted"
        report["status_detail"] = ("the run stopped without writing its final report (killed?); "
                                   "rerun the same command to resume")
    return report


def _report_from_files(path: Path) -> dict:
    """The report of a run whose report.json is gone or unreadable, from what the run
    directory still holds (run.json, the recipe; the totals are recounted by the caller): the
    session's figures were only in the lost report."""
    import yaml

    from .report import build_report

    manifest = read_json(path / MANIFEST) or {}
    try:
        recipe = yaml.safe_load((path / RECIPE).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        recipe = {}
    lost = "unreadable" if (path / REPORT_JSON).exists() else "missing"
    recipe = recipe if isinstance(recipe, dict) else {}
    meta = {"input": manifest.get("input"), "input_format": manifest.get("input_format"),
            "recipe": manifest.get("recipe"), "shard": manifest.get("shard"),
            "strategy": recipe.get("strategy")}
    model = recipe.get("model")
    if isinstance(model, dict) and model.get("task") == "embed":    # rendered as an embedding run's
        meta["task"] = "embed"
    return build_report(status="interrupted", meta=meta, totals={}, session={},
                        previous_sessions=[],
                        status_detail=f"report.json was {lost}: rebuilt from outputs.jsonl and "
                        "errors.jsonl; the sessions' figures are not known")


def rerender(root: Path) -> Optional[str]:
    """Rewrites report.json / report.md / plots (unless a live run owns the directory) and
    returns the markdown; None when `root` holds no report."""
    root = Path(root)
    parts = list_parts(root)
    if parts:
        reports = {p.name: refreshed_report(p) for p in parts}
        expected = _expected_parts(parts)
        for name in expected:
            reports.setdefault(name, None)
        merged = merge_reports(reports, str(root))
        merged["updated_at"] = now_iso()
        markdown = render_markdown(merged)
        report_writer(root).write_report(merged, markdown)
        return markdown
    report = refreshed_report(root)
    if report is None:
        return None
    live = in_use(root)
    plots = None
    if not live and plots_wanted(root):
        samples = latest_session_metrics(root)
        histogram = ((report.get("session") or {}).get("batch_size") or {}).get("histogram")
        try:
            plots = render_plots(samples, histogram) or None
        except Exception as exc:  # plots are a nicety; the report itself must still render
            log.warning("could not draw the plots: %s", exc)
    names = (tuple(sorted(set(plots) | _job_drawn(root))) if plots else
             tuple(sorted(p.name for p in (root / PLOTS).glob("*.png"))))
    markdown = render_markdown(report, names)
    if not live:
        report_writer(root).write_report(report, markdown, plots)
    return markdown


def latest_session_metrics(path: Path) -> list[dict]:
    """The most recent session's metrics.jsonl samples as the plots' bounded timeline (a
    day-long session has 86,400 samples: read as a list they took a gigabyte in three days)."""
    timeline, session = BoundedTimeline(), None
    for record in iter_jsonl_file(Path(path) / METRICS):
        if record.get("session") != session:
            session, timeline = record.get("session"), BoundedTimeline()
        timeline.add(record)
    return timeline.points()


def _job_drawn(root: Path) -> set[str]:
    """The plots the run's report.md links that are still on disk: the job drew some from what
    only it had (the pipeline's micro-batches, the online predictor's forecast error), so a
    re-render that cannot draw them again keeps them linked."""
    import re

    try:
        text = (Path(root) / REPORT_MD).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return set()
    return {name for name in re.findall(r"\]\(plots/([^)/]+\.png)\)", text)
            if (Path(root) / PLOTS / name).is_file()}


def plots_wanted(root: Path) -> bool:
    """The run's `report.plots`: its latest session's (run.json), else its recipe's
    (recipe.resolved.yaml keeps the one the first results were made with); True where neither
    can be read."""
    import yaml

    manifest = read_json(Path(root) / MANIFEST)
    sessions = (manifest.get("sessions") if isinstance(manifest, dict) else None) or []
    if sessions and isinstance(sessions[-1], dict) and "plots" in sessions[-1]:
        return bool(sessions[-1]["plots"])
    try:
        recipe = yaml.safe_load((Path(root) / RECIPE).read_text())
        return bool(((recipe or {}).get("report") or {}).get("plots", True))
    except (OSError, yaml.YAMLError, AttributeError):
        return True


def _expected_parts(parts: list[Path]) -> list[str]:
    """Every part name the run should have (a task that never started has no directory)."""
    from ..run_dir import PART_RE, part_name

    count = max(int(PART_RE.match(p.name).group(2)) for p in parts)
    return [part_name(Shard(i, count)) for i in range(count)]
