"""The workload `batchinfer profile` simulates: input lengths from the user's file, output lengths
from the recipe's predictor or from a history of earlier runs.

Input lengths are the prompts' token counts as a run would see them (the reader, the chat
template, the tokenizer). Output lengths, in order of preference: `--history` (earlier runs'
history.jsonl: each request gets a length drawn from their output lengths, seeded, so the mix
matches what the model really generated), else the recipe's predictor (auto: as a TD-Pipe run
would pick it; none: each request's max_tokens, exact under ignore_eos and an upper bound
otherwise; mean; oracle; bert). Every
length is capped by max_tokens and by what max_model_len leaves after the prompt. Lines that would
fail in a run (malformed, too long) are counted and left out.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from batchinfer.runner.io.admission import build_request, prompt_token_ids
from batchinfer.engine.errors import RequestError
from batchinfer.runner.io.input_records import InputError
from batchinfer.runner.io.inputs import InputReader
from batchinfer.predictors.history import spec_text

from .simulator import SimRequest

log = logging.getLogger(__name__)


@dataclass
class Workload:
    requests: list[SimRequest]
    source: str                       # where output lengths came from
    lines_read: int = 0
    skipped: dict = field(default_factory=dict)   # reason -> count

    def summary(self) -> dict:
        n = len(self.requests)
        return {"requests": n, "lines_read": self.lines_read, "skipped": self.skipped,
                "output_lengths_from": self.source,
                "mean_prompt_tokens": round(sum(r.prompt_len for r in self.requests) / n, 1) if n else 0,
                "mean_output_tokens": round(sum(r.output_len for r in self.requests) / n, 1) if n else 0}


def _history_lengths(sources: list[Path], job_model: Optional[str]) -> tuple[list[int], str]:
    """The output lengths of the history's records (the job's own model's where it holds any:
    predictors.history.models_for_job) and what to say of whose they are."""
    from batchinfer.predictors.history import models_for_job, read_history

    try:
        data = read_history(sources)
    except FileNotFoundError as exc:
        raise ValueError(f"--history {exc}") from None
    chosen, note = models_for_job(data.models(), job_model)
    if note:
        log.warning("--history: %s", note)
    lengths = [r.output_tokens for r in data.records
               if r.output_tokens > 0 and (chosen is None or r.model in chosen)]
    if not lengths:
        raise ValueError(f"{', '.join(map(str, sources))}: no usable history records")
    return lengths, f"history ({len(lengths)} records{'; ' + note if note else ''})"


def _job_model(recipe) -> str:
    from batchinfer.engine.model.sources import model_id_for

    model = recipe.model
    return model_id_for(model.path, model.load_format == "dummy", model.hf_overrides)


def _predictor(recipe):
    """The recipe's predictor and how the profile names it; `auto` resolves as a TD-Pipe run
    would pick it, whatever strategy the recipe names: the replies' lengths are the job's, and
    profile ranks every strategy on them (a baseline recipe's profile used to simulate each
    reply at max_tokens, a TD-Pipe recipe's at its forecast: two rankings of one job). Over the
    runs beside the recipe's run directory (default: runs/), on the CPU."""
    from batchinfer.predictors import make_predictor

    cfg = recipe.predictor
    if cfg.name != "auto":
        predictor = make_predictor(cfg, device="cpu")
        chose = getattr(predictor, "for_model", None)    # a mean over several models' history
        note = chose(_job_model(recipe)) if chose is not None else None
        if note:
            log.warning("predictor mean (%s): %s", cfg.path, note)
        return predictor, f"predictor {cfg.name}" + (f" ({note})" if note else "")
    from batchinfer.predictors.auto import choose_predictor
    from batchinfer.predictors.base import NonePredictor

    runs_root = Path(recipe.io.output_dir).parent if recipe.io.output_dir else Path("runs")
    predictor, choice = choose_predictor(cfg, _job_model(recipe), runs_root, "cpu",
                                         reads_forecasts=True)
    return predictor or NonePredictor(cfg.oracle_field), f"predictor auto: {choice.reason}"


def load_workload(recipe, input_path: Path, tokenizer, max_model_len: int,
                  max_requests: Optional[int] = None, history: Optional[list[Path]] = None,
                  seed: int = 0) -> Workload:
    """The first `max_requests` usable requests of the file (all by default)."""
    reader = InputReader(input_path, recipe.io, recipe.sampling)
    skipped: dict[str, int] = {}
    requests = []
    for item in reader:
        if max_requests is not None and len(requests) >= max_requests:
            break
        if isinstance(item, InputError):
            skipped[item.code] = skipped.get(item.code, 0) + 1
            continue
        try:
            tokens = prompt_token_ids(item, tokenizer, recipe.io.chat_template)
            if not tokens or len(tokens) >= max_model_len:
                raise RequestError("prompt_too_long" if tokens else "empty_prompt", "")
            request = build_request(item, tokenizer, len(requests), tokens=tokens,
                                    adapters=list(recipe.model.lora_modules))
        except RequestError as exc:
            skipped[exc.code] = skipped.get(exc.code, 0) + 1
            continue
        # the text a predictor reads, as the job gives it (runner/job.py)
        request.payload.prompt_text = spec_text(item.prompt, item.messages, tokens, tokenizer)
        requests.append(request)
    if history:
        pool, source = _history_lengths(history, _job_model(recipe))
        rng = random.Random(seed)
        lengths = [rng.choice(pool) for _ in requests]
    else:
        predictor, source = _predictor(recipe)
        lengths = predictor.predict(requests) if requests else []
    out = []
    for request, length in zip(requests, lengths):
        room = max_model_len - len(request.prompt_token_ids)
        cap = request.sampling.max_tokens or room
        length = max(1, min(int(length), cap, room))
        out.append(SimRequest(len(request.prompt_token_ids), length, length))
    return Workload(out, source, reader.records_read, skipped)
