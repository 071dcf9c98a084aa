"""The job loop: input stream -> engine -> run directory, with resume, reports and signals.

    reader (InputReader) --specs--> admission (tokenize) --Request--> engine.step()
        --RequestOutput--> OrderedSink --> ResultWriter --records--> RunDir (outputs / errors)

At most `max_in_flight` requests are read but not yet written, so input of any length streams
through bounded memory. Every few seconds a timeline sample goes to metrics.jsonl and report.json
(+ report.md and the plots) is rewritten. SIGTERM / SIGINT during setup (run directory, kernels,
model, workers) stop it at once; during the loop they stop the reading, drop the requests in
flight (they were never written, so a resume runs them), write a partial report and exit 143 / 130;
a second signal exits at once (still safe: every written line is flushed). A full disk or a
file-size limit stops the job with exit 3 and leaves every file as it was before the failed write.
"""
from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from batchinfer.predictors.history import spec_text
from .io.admission import (build_request, check_recipe_stop_ids, check_recipe_stop_ids_at_hand,
                           located_in_line, prompt_token_ids)
from batchinfer.engine.errors import RequestError
from .read_ahead import ReadAhead
from .io.input_records import InputError, RequestSpec
from .io.inputs import InputFileError, InputReader
from .report.metrics import SessionMetrics
from .job_report import JobReports
from .predictor_setup import apply_forecast, build_job_predictor, learn
from .progress import Progress
from .result_writer import ResultWriter
from .io.records import RequestPayload
from .report.report import now_iso, session_brief
from .resume_check import (check_other_parts, check_resume, fingerprint_with_prefix,
                           model_locations, numerics_changed, recipe_change_warning,
                           recorded_input_bytes)
from .run_dir import MANIFEST, RECIPE, REPORT_JSON, PriorState, RunDir, RunDirWriteError
from .sink import OrderedSink
from .stop_signals import StopRequested, StopSignals, exit_code_for, signal_name
from .job_spec import (EXIT_FAILED, EXIT_OK, EXIT_REQUEST_ERRORS,
                       EXIT_USAGE, JobOutcome, JobSpec, default_output_dir, is_user_error)

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_REQUEST_ERRORS", "EXIT_USAGE", "Job", "JobOutcome",
           "JobSpec", "default_output_dir", "run_job"]
log = logging.getLogger("batchinfer")


class Job(JobReports):
    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.recipe = spec.recipe
        self.embed = spec.recipe.model.task == "embed"    # an embedding job (engine/embedding/)
        self.reader = InputReader(spec.input_path, spec.recipe.io, spec.recipe.sampling,
                                  spec.shard, limit=spec.limit, embed=self.embed)
        self.metrics = SessionMetrics(spec.recipe.report.metrics_interval_seconds)
        self.engine = None
        self.predictor = None                  # the recipe's output-length predictor
        self.predictor_choice: Optional[dict] = None   # what predictor: auto picked, and why
        self.auto_settings: Optional[dict] = None      # what the strategy's auto settings became
        self._input_failure: Optional[Exception] = None  # the input file broke part way
        self.read_ahead = ReadAhead(spec.recipe.io, spec.recipe.max_in_flight, self._add)
        self.run_dir: Optional[RunDir] = None
        self.prior = PriorState()
        self.signals = StopSignals()
        self.session_number = 1
        self.started_at = now_iso()
        self._t0, self._wall0 = time.perf_counter(), time.time()
        self._previous_sessions: list[dict] = []
        self._old_report: dict = {}   # report.json before this session, where results exist
        self._total: Optional[int] = None          # input records within --limit
        self._input_records: Optional[int] = None  # all of them (this shard's)
        self._progress: Optional[Progress] = None
        self._sink: Optional[OrderedSink] = None
        self._results: Optional[ResultWriter] = None
        self._last_report = self._last_plots = 0.0
        self._records = None          # the input still to run (_pending_records)

    def clock(self) -> float:
        return time.perf_counter() - self._t0

    # --- entry point ------------------------------------------------------------------------------
    def run(self) -> JobOutcome:
        spec = self.spec
        restore = self.signals.install()
        status, exit_code, message = "failed", EXIT_FAILED, ""
        try:
            self.run_dir, self.prior = RunDir.open(spec.output_dir, spec.shard, resume=spec.resume)
            self._start_session()
            self._records = self._pending_records()
            if self._records is not None:
                self._build_engine()
            # no engine: nothing to run, or a signal came before it was built (the loop then
            # writes nothing)
            model_id = self.engine.model_id if self.engine is not None else None
            self._results = ResultWriter(self.run_dir, self.metrics, model_id,
                                         self.reader.format == "openai", self.recipe.predictor)
            self._sink = OrderedSink(self.recipe.io.output_order, self._write)
            self._progress = Progress(self._total, already_done=self.prior.num_outputs
                                      + self.prior.num_errors, mode=spec.progress,
                                      interval_s=self.recipe.report.progress_interval_seconds,
                                      already_failed=self.prior.num_errors,
                                      unit="prompt" if self.embed else "output")
            self.signals.setting_up = False   # from here a signal stops the loop after its step
            finished = self._loop()
            if finished and self._input_failure is not None:
                log.error("%s", self._input_failure)
                status, exit_code = "failed", EXIT_USAGE
                message = (f"{self._input_failure}; the records before it are done: mend that "
                           "row in place (the rows' order kept) and rerun with --force-resume "
                           "(ids then decide what is skipped), or run the mended file into "
                           "another --output")
            elif finished:
                status, exit_code = "completed", EXIT_OK
                message = self._limit_note()
            else:
                status, message = "interrupted", f"stopped by {signal_name(self.signals.received)}"
        except StopRequested as stop:
            status, message = "interrupted", f"stopped by {signal_name(stop.signum)} during setup"
        except KeyboardInterrupt:
            status, message = "interrupted", "interrupted"
            self.signals.received = self.signals.received or signal.SIGINT
        except (Exception, SystemExit) as exc:
            if self.engine is None and is_user_error(exc):
                if self.run_dir is not None and self._results is None:
                    self.run_dir.abandon()      # a refused start leaves no run behind
                self._close(restore, "failed")
                raise
            if isinstance(exc, RunDirWriteError):
                log.error("%s", exc)
                message = str(exc)   # it names the file, says what is intact and to rerun
            else:
                log.exception("the run failed")
                message = f"{type(exc).__name__}: {exc}; everything finished so far is on disk"
        self.signals.setting_up = False
        if self.signals.received is not None and status == "failed":
            status = "interrupted"         # a failure the signal caused (e.g. a child it killed)
        if status != "completed" and exit_code != EXIT_USAGE and \
                not message.endswith("rerun to resume"):
            message += "; rerun to resume"
        if status == "completed" and self._progress is not None:
            self._progress.total = self._progress.done  # blank lines are not requests
        if self.run_dir is not None:
            self._finish(status, message)
        self._close(restore, "finished" if status == "completed" else status)
        if self.signals.received is not None:
            # a signal always answers 130 / 143, also one that came during the final report
            exit_code = exit_code_for(self.signals.received)
            if status == "completed":
                message = (f"every request is done; {signal_name(self.signals.received)} came "
                           f"as the run ended (exit {exit_code})")
        totals = self._totals()
        path = self.run_dir.path if self.run_dir is not None else Path(spec.output_dir)
        return JobOutcome(status, exit_code, path, totals["outputs"], totals["errors"],
                          self._session_summary(), message)

    def _limit_note(self) -> str:
        """What a --limit left of the input, for a completed session's report and summary."""
        left = self._totals()["remaining"]
        if self.spec.limit is None or not left:
            return ""
        return (f"--limit {self.spec.limit}: {left} input record(s) not run yet; rerun with a "
                "larger --limit, or none, to continue")

    def _close(self, restore: Callable[[], None], outcome: str) -> None:
        close_engine = getattr(self.engine, "close", None)
        if close_engine is not None:
            try:
                close_engine()  # stops worker processes, if any
            except Exception:  # noqa: BLE001 - the run's outcome is already decided
                log.exception("stopping the engine failed")
        if self._progress is not None:
            self._progress.close(outcome)
            self._progress = None
        if self.run_dir is not None:
            self.run_dir.close()
        restore()     # last: a signal while the workers stop is still this job's to answer

    # --- setup ------------------------------------------------------------------------------------
    def _start_session(self) -> None:
        run_dir = self.run_dir
        has_results = bool(self.prior.num_outputs or self.prior.num_errors)
        old_recipe = run_dir.read_text(RECIPE)
        manifest = run_dir.read_json(MANIFEST) or {}
        input_path = str(Path(self.spec.input_path).resolve())
        checking = has_results and not self.spec.force_resume
        # one read of the input: the recorded prefix to check and the whole to record
        prefix, whole = fingerprint_with_prefix(
            Path(input_path), recorded_input_bytes(manifest) if checking else None)
        if checking:      # before writing anything
            check_resume(run_dir.path, manifest, old_recipe, self.recipe, self.spec.input_path,
                         prefix)
        if self.spec.shard.count > 1 and not self.spec.force_resume:   # report merges parts
            check_other_parts(run_dir.path, self.recipe, Path(input_path), whole)
        recipe_yaml = self.recipe.to_yaml()
        changed = recipe_change_warning(run_dir.path, old_recipe, recipe_yaml, has_results)
        if changed:
            log.warning("%s", changed)
        # kept while results exist: what they were first made with (unless forced past it)
        if not has_results or old_recipe is None or self.spec.force_resume:
            run_dir.write_text(RECIPE, recipe_yaml)
        checked = "input_fingerprint" in manifest and not self.spec.force_resume
        if has_results and not checked and manifest.get("input") not in (None, input_path):
            log.warning("%s was started with input %s; now resuming with %s (ids decide what is "
                        "skipped)", run_dir.path, manifest["input"], input_path)
        sessions = list(manifest.get("sessions") or [])
        self.session_number = len(sessions) + 1
        sessions.append({"started_at": self.started_at, "pid": os.getpid(),
                         "host": socket.gethostname(), "argv": sys.argv,
                         "strategy": self.recipe.strategy.name,
                         "plots": self.recipe.report.plots})
        run_dir.write_json(MANIFEST, {"input": input_path, "input_format": self.reader.format,
                                      "input_fingerprint": whole,
                                      "recipe": self.spec.recipe_path,
                                      "model_locations": model_locations(self.recipe.model),
                                      "shard": self.spec.shard.as_record(), "sessions": sessions})
        old_report = run_dir.read_json(REPORT_JSON) or {}
        if has_results:   # what computed them: kept in a report no engine rewrites (nothing ran)
            self._old_report = old_report
        self._previous_sessions = list(old_report.get("previous_sessions") or [])
        if old_report.get("session"):
            brief = session_brief(old_report["session"])
            brief["status"] = "interrupted" if old_report.get("status") == "running" \
                else old_report.get("status")
            self._previous_sessions.append(brief)
        self._input_records = self.reader.total(limited=False)
        limit = self.spec.limit
        self._total = (self._input_records if limit is None or self._input_records is None
                       else min(self._input_records, limit))      # what this session may run
        if self.prior.num_outputs or self.prior.num_errors:
            log.info("resuming %s: %d outputs and %d errors already written; skipping them",
                     run_dir.path, self.prior.num_outputs, self.prior.num_errors)

    def _build_engine(self) -> None:
        t = time.perf_counter()
        if self.signals.received is None:
            factory = self.spec.engine_factory
            if factory is None:
                from batchinfer.engine.engine import Engine

                factory = Engine.from_config
                if self.embed:
                    from batchinfer.engine.embedding import build_embedding_engine

                    factory = build_embedding_engine
            # the predictor first: a bad predictor directory is a usage error (exit 2)
            if not self.embed:          # (an embedding has no reply length to predict)
                self.predictor, self.predictor_choice = build_job_predictor(self.recipe,
                                                                            self.spec.output_dir)
            if not self.embed:          # refused before an automatic layout's search
                from batchinfer.engine.build import check_strategy_applies_lora

                check_strategy_applies_lora(self.recipe.engine_config())
            self._resolve_auto_settings()
            check_recipe_stop_ids_at_hand(self.recipe)      # before the weights load
            engine = factory(self.recipe.engine_config())
            try:        # every request would fail alike: a usage error, as validate's
                check_recipe_stop_ids(self.recipe.sampling, engine.vocab_size, engine.tokenizer)
            except BaseException:
                engine.close()      # (its workers, or another engine's process)
                raise
            self.engine = engine
            changed = numerics_changed(self._old_report.get("engine"),
                                       getattr(self.engine, "info", {}))
            if changed:
                log.warning("%s", changed)
            self.engine.drain_step_events()
            self.metrics.start(self.engine.stats(), self.clock())
        self.metrics.phases_s["load"] += time.perf_counter() - t

    def _resolve_auto_settings(self) -> None:
        """Strategy settings the recipe leaves to `auto`, decided by simulating this job's own
        prompts (sim/auto_settings.py); the job then runs the resolved recipe."""
        if not self.recipe.strategy.auto_keys():
            return
        from batchinfer.sim.auto_settings import resolve_auto_settings

        resolution = resolve_auto_settings(self.recipe, self.spec.input_path, self.spec.limit)
        self.recipe, self.auto_settings = resolution.recipe, resolution.record

    # --- the loop ---------------------------------------------------------------------------------
    def _pending_records(self):
        """The input's records still to run or report, or None (and a warning) when there are
        none: an empty input, or every request already in the run directory. The model is then
        never loaded."""
        records = self.reader.records(self.prior.done_ids, self.prior.done_lines)
        first = next(records, _NOTHING)
        if first is not _NOTHING:
            return itertools.chain([first], records)
        if self.prior.num_outputs or self.prior.num_errors:
            log.info("%s: every request of %s is already in this run directory; nothing to run",
                     self.run_dir.path, self.spec.input_path)
        else:
            log.warning("%s holds no requests (no non-blank line or row%s); nothing to run",
                        self.spec.input_path,
                        f" within --limit {self.spec.limit}" if self.spec.limit else "")
        return None

    def _loop(self) -> bool:
        """Runs until the input is done (True) or a signal stops it (False)."""
        engine = self.engine
        finished = False
        records = self._records
        if records is None:
            self.metrics.finished_t = self.clock()
            return self.signals.received is None
        exhausted = False
        while self.signals.received is None:
            if not exhausted:
                exhausted = self._fill(records)
            self.read_ahead.feed()
            if engine.has_unfinished():
                outputs = engine.step()
                for out in outputs:
                    self._sink.submit(out.payload.order, ("output", out))
                    for copy in self.read_ahead.finished(out):
                        self._sink.submit(copy.payload.order, ("output", copy))
                if outputs and self.predictor is not None:
                    learn(self.predictor, engine, outputs, self.clock())
                self.metrics.on_steps(engine.drain_step_events())
            elif exhausted and not self.read_ahead.waiting:
                finished = True
                break
            self._tick()
        self.metrics.finished_t = self.clock()
        if self.signals.received is not None and engine is not None and engine.has_unfinished():
            dropped = engine.abort_all()
            log.warning("dropped %d requests in flight; they were not written and run again on "
                        "resume", len(dropped) + self.read_ahead.drop())
        return finished

    def _fill(self, records) -> bool:
        """Reads records until max_in_flight (plus io.group_window when grouping) are pending;
        True when input is exhausted.

        The records read in one call are tokenized one by one, then predicted in one batch (the
        length predictor runs before scheduling); a duplicate waits for its leader, the others
        go to the engine, through the prefix window when grouping."""
        t = time.perf_counter()
        limit = self.read_ahead.read_limit
        batch: list = []
        exhausted = False
        try:
            while self._sink.pending < limit and self.signals.received is None:
                try:
                    item = next(records, None)
                except InputFileError as exc:   # the file breaks part way (a bad CSV row):
                    self._input_failure = exc   # what was read runs, then the job stops
                    item = None
                if item is None:
                    exhausted = True
                    break
                order = self._sink.admit()
                if isinstance(item, InputError):
                    self._sink.submit(order, ("error", item))
                    continue
                request = self._prepare(item, order)
                if request is not None:
                    batch.append((item, request))
        finally:
            self.metrics.phases_s["input"] += time.perf_counter() - t
        leaders = self.read_ahead.leaders(batch)
        self._predict([request for _, request in leaders])
        self.read_ahead.place(leaders)
        return exhausted

    def _prepare(self, spec: RequestSpec, order: int):
        """Tokenizes `spec` into an engine Request; a RequestError becomes its error record."""
        try:
            if self.embed:
                from .io.embed_records import build_embed_request

                return build_embed_request(spec, self.engine.tokenizer, order,
                                           self.engine.max_model_len, self.recipe.io.chat_template)
            tokens = prompt_token_ids(spec, self.engine.tokenizer, self.recipe.io.chat_template)
            request = build_request(spec, self.engine.tokenizer, order, tokens=tokens,
                                    adapters=self.engine.info.get("lora_modules") or ())
        except RequestError as exc:
            self._request_error(spec, order, exc)
            return None
        if self.recipe.predictor.history or self.predictor is not None:
            request.payload.prompt_text = spec_text(spec.prompt, spec.messages, tokens,
                                                    self.engine.tokenizer)
        return request

    def _predict(self, requests: list) -> None:
        if self.predictor is None or not requests:
            return
        t = time.perf_counter()
        for request, forecast in zip(requests, self.predictor.forecast(requests)):
            apply_forecast(request, forecast)
        self.metrics.phases_s["predict"] += time.perf_counter() - t

    def _add(self, spec: RequestSpec, request) -> bool:
        try:
            self.engine.add_request(request)
        except RequestError as exc:
            exc = located_in_line(spec, exc)
            self._request_error(spec, request.payload.order, exc)
            if self.predictor is not None and hasattr(self.predictor, "forget"):
                self.predictor.forget(request.request_id)
            for follower in self.read_ahead.dedup.abandon(request):   # the same error
                self._sink.submit(follower.payload.order,
                                  ("request_error", (follower.payload, follower.request_id, exc)))
            return False
        self.metrics.on_admit(self.clock())
        self._progress.begin()              # its rates count from here, as generation_s does
        return True

    def _request_error(self, spec: RequestSpec, order: int, exc: RequestError) -> None:
        payload = RequestPayload.from_spec(spec, order)
        self._sink.submit(order, ("request_error", (payload, spec.request_id, exc)))

    def _write(self, kind: str, item) -> None:
        """Called by the sink, in output order."""
        t = time.perf_counter()
        self._results.write(kind, item, self.clock())
        if self._progress is not None:
            m = self.metrics
            self._progress.update(m.completed, m.failed,
                                  m.prompt_tokens if self.embed else m.completion_tokens)
        self.metrics.phases_s["write"] += time.perf_counter() - t

    def _tick(self, force: bool = False, report: bool = True) -> None:
        now = self.clock()
        stats = self.engine.stats() if self.engine is not None else None
        sample = self.metrics.sample(now, stats, force=force)
        if sample is not None:
            self.run_dir.write_metrics({"session": self.session_number, **sample})
        cfg = self.recipe.report
        if report and (force or now - self._last_report >= cfg.refresh_seconds):
            self._write_report("running")

    # --- reporting: runner/job_report.py (JobReports) -----------------------------------------
    def _finish(self, status: str, message: str) -> None:
        kept = self._kept()    # a session that ran nothing: no sample, the results' plots
        try:
            if not kept:
                self._tick(force=True, report=False)
            # after a signal the plots keep their last refresh: drawing takes seconds, and a
            # signalled job must exit within a few
            self._write_report(status, message or None, final=True,
                               draw=self.signals.received is None and not kept)
        except RunDirWriteError as exc:
            log.error("could not write the final report: %s", exc)
        except Exception:
            log.exception("could not write the final report")


_NOTHING = object()


def run_job(spec: JobSpec) -> JobOutcome:
    return Job(spec).run()
