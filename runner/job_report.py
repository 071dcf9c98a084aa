"""The job's report: its totals, this session's summary, what made the results (meta), and
report.json / report.md / the plots written from them (a base of runner/job.Job)."""
from __future__ import annotations

import logging
import time
from typing import Optional

from .job_spec import ENGINE_INFO_KEYS
from .report.embed_report import DEFINITIONS as EMBED_DEFINITIONS
from .report.embed_report import (embedding_session, embedding_totals,
                                  render_embedding_markdown)
from .report.metrics import predictor_summary
from .report.plots import job_plots
from .report.report import build_report, now_iso, render_markdown

log = logging.getLogger("batchinfer")
_MADE_WITH = ("model", "engine", "strategy", "predictor", "auto_settings")   # report.json keys


class JobReports:
    """Job's reporting half; reads the job's state (metrics, prior results, engine, recipe)."""

    def _totals(self) -> dict:
        m, p = self.metrics, self.prior
        outputs, errors = p.num_outputs + m.completed, p.num_errors + m.failed
        codes = dict(p.error_codes)
        for code, n in m.error_codes.items():
            codes[code] = codes.get(code, 0) + n
        remaining = None
        if self._input_records is not None:
            remaining = max(self._input_records - outputs - errors, 0)
        totals = {"input_records": self._input_records, "limit": self.spec.limit,
                  "outputs": outputs, "errors": errors,
                  "remaining": remaining, "errors_by_code": codes,
                  "prompt_tokens": p.prompt_tokens + m.prompt_tokens,
                  "completion_tokens": p.completion_tokens + m.completion_tokens}
        return embedding_totals(totals) if self.embed else totals

    def _session_summary(self) -> dict:
        now = self.clock()
        stats = self.engine.stats() if self.engine is not None else None
        summary = self.metrics.summary(now, stats)
        m = self.metrics
        window = None
        if m.first_admit_t is not None:
            window = [round(self._wall0 + m.first_admit_t, 3),
                      round(self._wall0 + m.first_admit_t + m.generation_s(now), 3)]
        if self.predictor is not None:
            summary["predictor"] = predictor_summary(self.predictor, now)
        summary.update(self.read_ahead.summary())
        if self.embed:                  # no decode figures (runner/report/embed_report.py)
            summary = embedding_session(summary, stats)
        return {"started_at": self.started_at, "session": self.session_number,
                "elapsed_s": round(now, 3), "generation_window": window, **summary}

    def _write_report(self, status: str, detail: Optional[str] = None, final: bool = False,
                      draw: bool = True) -> None:
        t = time.perf_counter()
        self._last_report = self.clock()
        session, previous = self._session_summary(), self._previous_sessions
        if self._kept() and self._old_report.get("session"):
            # a session that ran nothing: the report stays the one of the results' sessions
            session, previous = (self._old_report["session"],
                                 self._old_report.get("previous_sessions") or [])
        elif final:
            session["ended_at"] = now_iso()
            session["status"] = status
        report = build_report(status=status, meta=self._meta(), totals=self._totals(),
                              session=session, previous_sessions=previous,
                              status_detail=detail)
        plots = None
        cfg = self.recipe.report
        if self.embed:                  # (the plots draw a generation's timelines)
            report["definitions"] = EMBED_DEFINITIONS
            self.run_dir.write_report(report, render_embedding_markdown(report), None)
            if final:
                self.run_dir.sync()
            self.metrics.phases_s["report"] += time.perf_counter() - t
            return
        if draw and cfg.plots and (final or self._last_report - self._last_plots
                                   >= cfg.plot_refresh_seconds):
            self._last_plots = self._last_report
            try:
                timeline = getattr(self.engine, "timeline", None)
                plots = job_plots(self.metrics.timeline.points(), session,
                                  timeline(last=4000) if timeline is not None else [])
            except Exception as exc:  # a plot must never fail a job
                log.warning("could not draw the plots: %s", exc)
        names = tuple(sorted(plots)) if plots else tuple(
            sorted(p.name for p in (self.run_dir.path / "plots").glob("*.png")))
        self.run_dir.write_report(report, render_markdown(report, names), plots)
        if final:
            self.run_dir.sync()
        self.metrics.phases_s["report"] += time.perf_counter() - t

    def _meta(self) -> dict:
        from batchinfer import __version__

        stats = self.engine.stats() if self.engine is not None else {}
        meta = {
            "batchinfer_version": __version__,
            "run_dir": str(self.run_dir.path),
            "input": str(self.spec.input_path),
            "input_format": self.reader.format,
            "recipe": self.spec.recipe_path,
            "model": getattr(self.engine, "model_id", None),
            "engine": {k: stats[k] for k in (*ENGINE_INFO_KEYS, self.recipe.strategy.name)
                       if k in stats},
            "strategy": self.recipe.strategy.model_dump(mode="json"),
            "predictor": self.predictor_choice or {"name": self.recipe.predictor.name},
            "auto_settings": self.auto_settings,
            "shard": self.spec.shard.as_record(),
            **({"task": "embed"} if self.embed else {}),
        }
        if self._kept():      # what made the results, not this session's recipe
            meta.update({key: self._old_report.get(key, meta[key]) for key in _MADE_WITH})
        return meta

    def _kept(self) -> bool:
        """Whether this session ran nothing (all done already) over earlier results."""
        return self.engine is None and self._records is None and bool(self._old_report)
