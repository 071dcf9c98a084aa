"""The writer end of the job: each item the sink hands over (in output order) becomes its line in
the run directory and is counted in the session's metrics.

    ("output", RequestOutput)        -> outputs.jsonl (+ history.jsonl when predictor.history),
                                        or errors.jsonl when the engine finished it without an
                                        answer (aborted, engine error)
    ("error", InputError)            -> errors.jsonl (an input line that is not a request)
    ("request_error", (payload, request id, RequestError))
                                     -> errors.jsonl (a request the engine refused)
"""
from __future__ import annotations

from typing import Any, Optional

from batchinfer.engine.embedding.request import EmbeddingOutput
from batchinfer.engine.request import FinishReason
from batchinfer.predictors.history import history_record
from .io.embed_records import embedding_record
from .io.records import error_record, input_error_record, output_record
from .report.metrics import SessionMetrics
from .run_dir import RunDir


class ResultWriter:
    def __init__(self, run_dir: RunDir, metrics: SessionMetrics, model_id: Optional[str],
                 openai_input: bool, predictor_cfg: Any):
        self.run_dir = run_dir
        self.metrics = metrics
        self.model_id = model_id
        self.openai_input = openai_input     # error records in the OpenAI batch envelope
        self.predictor_cfg = predictor_cfg   # the recipe's `predictor` section (history, prompts)

    def write(self, kind: str, item: Any, now: float) -> None:
        openai = self.openai_input
        if kind == "output" and failed(item):
            code = "aborted" if item.finish_reason == FinishReason.ABORT else "engine_error"
            payload = item.payload
            self.run_dir.write_error(error_record(payload.line, code, item.error or code,
                                                  item.request_id, payload.metadata,
                                                  payload.custom_id, openai=openai))
            self.metrics.on_error(code, now)
        elif kind == "output" and isinstance(item, EmbeddingOutput):   # no reply: no history
            self.run_dir.write_output(embedding_record(item, item.payload, self.model_id))
            self.metrics.on_result(item, now)
        elif kind == "output":
            self.run_dir.write_output(output_record(item, item.payload, self.model_id))
            self.metrics.on_result(item, now)     # on disk: counted even if history fails
            if self.predictor_cfg.history:
                self.run_dir.write_history(self._history_record(item))
        elif kind == "error":
            self.run_dir.write_error(input_error_record(item, openai))
            self.metrics.on_error(item.code, now)
        else:
            payload, request_id, exc = item
            self.run_dir.write_error(error_record(payload.line, exc.code, exc.message, request_id,
                                                  payload.metadata, payload.custom_id,
                                                  openai=openai))
            self.metrics.on_error(exc.code, now)

    def _history_record(self, out) -> dict:
        """A request of n samples is one record, its first sample's length: one draw of the
        reply's length, as a request of one sample gives (and the predictors learn)."""
        payload = out.payload
        return history_record(out.request_id, payload.prompt_text, out.num_prompt_tokens,
                              len(out.output_token_ids), out.finish_reason, self.model_id,
                              payload.max_tokens, payload.predicted_tokens,
                              prompts=self.predictor_cfg.history_prompts,
                              source=payload.metadata.get("source")
                              if isinstance(payload.metadata, dict) else None)


def failed(out) -> bool:
    """A result the engine finished without an answer: an error record, not an output."""
    return out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT) or bool(out.error)
