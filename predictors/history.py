"""The runner's history: one record per finished request, the predictors' training data.

Every `batchinfer run` appends to `history.jsonl` in its run directory (through the run-dir
writer), one line per request written to outputs.jsonl:

    {"id": "q1", "prompt": "What is ...?", "prompt_sha256": "9f2c...", "prompt_tokens": 31,
     "output_tokens": 12, "finish_reason": "stop", "model": "SmolLM2-135M-Instruct",
     "max_tokens": 512, "predicted_tokens": 40, "source": "sharegpt"}

`prompt` is the text the predictor sees (a chat conversation rendered as `role: content` lines);
with `predictor.history_prompts: hash` only its sha256 is kept. `predicted_tokens` is there when
the run used a predictor, so a run's own history shows how good the predictions were (with
`predictor.online` it is the last forecast before the request finished); `source` is the input
line's metadata.source, when it has one (eval reports each source apart).
Reading is forgiving: a malformed line is skipped and counted, with a warning naming file:line.
"""
from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import jsonlines

log = logging.getLogger(__name__)

HISTORY = "history.jsonl"
SCHEMA_KEYS = ("id", "prompt", "prompt_sha256", "prompt_tokens", "output_tokens",
               "finish_reason", "model", "max_tokens")
MAX_WARNINGS = 10   # individual file:line warnings logged; the rest are only counted


@dataclass
class HistoryRecord:
    id: str
    prompt: Optional[str]
    prompt_sha256: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    predicted_tokens: Optional[int] = None
    source: Optional[str] = None          # where the prompt came from (metadata.source), if said

    @property
    def cut(self) -> bool:
        """The output stopped before its end (finish reason `length`: max_tokens or the model's
        length limit), so its true length is longer; without a finish reason, at max_tokens."""
        if self.finish_reason:
            return self.finish_reason == "length"
        return self.max_tokens is not None and self.output_tokens >= self.max_tokens

    @property
    def key(self) -> tuple[str, str]:
        """Identity across run directories: the same request id with the same prompt."""
        return (self.id, self.prompt_sha256)

    def to_json(self) -> dict:
        out = asdict(self)
        for optional in ("predicted_tokens", "source"):
            if out[optional] is None:
                del out[optional]
        return out


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def render_messages(messages: list[dict]) -> str:
    """A chat conversation as the text the predictor reads (role-tagged lines)."""
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages)


def spec_text(prompt: Union[str, list, None], messages: Optional[list[dict]],
              tokens: Optional[list[int]] = None, tokenizer: Any = None) -> str:
    """The text of a request as predictors see it: the prompt, the rendered conversation, or
    (OpenAI token-id prompts) the tokens decoded."""
    if isinstance(prompt, str):
        return prompt
    if messages is not None:
        return render_messages(messages)
    ids = prompt if isinstance(prompt, list) else tokens
    if ids is not None and tokenizer is not None:
        try:
            return tokenizer.decode(list(ids))
        except Exception:  # noqa: BLE001 - text is only for prediction; never fail a request
            return ""
    return ""


def history_record(request_id: str, prompt_text: Optional[str], prompt_tokens: int,
                   output_tokens: int, finish_reason: Any, model: Optional[str],
                   max_tokens: Optional[int], predicted_tokens: Optional[int] = None,
                   prompts: str = "text", source: Optional[str] = None) -> dict:
    """The JSON line for one finished request (`prompts`: text keeps the prompt, hash only its
    sha256)."""
    text = prompt_text or ""
    return HistoryRecord(
        id=str(request_id), prompt=text if prompts == "text" else None,
        prompt_sha256=sha256_text(text), prompt_tokens=int(prompt_tokens),
        output_tokens=int(output_tokens),
        finish_reason=str(getattr(finish_reason, "value", finish_reason)), model=model,
        max_tokens=max_tokens, predicted_tokens=predicted_tokens,
        source=None if source is None else str(source)).to_json()


# --- reading --------------------------------------------------------------------------------------
@dataclass
class HistoryData:
    records: list[HistoryRecord] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)      # reason -> count

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def models(self) -> Counter:
        return Counter(r.model for r in self.records)


def history_files(source: Union[str, Path]) -> list[Path]:
    """history.jsonl of a run directory (and of its Slurm parts), or a history file itself."""
    path = Path(source)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such run directory or history file")
    files = [path / HISTORY] if (path / HISTORY).is_file() else []
    files += sorted(p / HISTORY for p in path.glob("part-*-of-*") if (p / HISTORY).is_file())
    if not files:
        raise FileNotFoundError(f"{path}: no {HISTORY} here (is it a batchinfer run directory? "
                                "runs write it since the predictor landed)")
    return files


def _parse(obj: Any) -> tuple[Optional[HistoryRecord], str]:
    """A record, or None and why it is unusable."""
    if not isinstance(obj, dict):
        return None, "not an object"
    missing = [k for k in ("id", "prompt_sha256", "output_tokens") if obj.get(k) is None]
    if missing:
        return None, f"missing {', '.join(missing)}"
    try:
        output_tokens = int(obj["output_tokens"])
        prompt_tokens = int(obj.get("prompt_tokens") or 0)
        max_tokens = None if obj.get("max_tokens") is None else int(obj["max_tokens"])
        predicted = None if obj.get("predicted_tokens") is None else int(obj["predicted_tokens"])
    except (TypeError, ValueError):
        return None, "a token count is not an integer"
    if output_tokens < 0 or prompt_tokens < 0:
        return None, "a token count is negative"
    prompt = obj.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        return None, "prompt is not a string"
    source = obj.get("source")
    if source is None and isinstance(obj.get("metadata"), dict):
        source = obj["metadata"].get("source")
    return HistoryRecord(id=str(obj["id"]), prompt=prompt, prompt_sha256=str(obj["prompt_sha256"]),
                         prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                         # without one: "" (cut then reads max_tokens), never "None"
                         finish_reason=str(obj.get("finish_reason") or ""),
                         model=obj.get("model"),
                         max_tokens=max_tokens, predicted_tokens=predicted,
                         source=None if source is None else str(source)), ""


def _read_file(path: Path) -> Iterator[tuple[int, Optional[HistoryRecord], str]]:
    """(line number, record or None, why not) for each non-blank line of one history file."""
    line_no = 0

    def lines():
        nonlocal line_no
        with open(path, "rb") as fh:
            for raw in fh:
                line_no += 1
                yield raw

    reader = jsonlines.Reader(lines())
    while True:
        try:
            record, why = _parse(reader.read(skip_empty=True, type=dict))
        except EOFError:
            return
        except jsonlines.InvalidLineError as exc:
            record, why = None, str(exc).split(":")[0]
        yield line_no, record, why


def stream_history(sources: Iterable[Union[str, Path]], model: Optional[str] = None,
                   need_text: bool = False, stats: Optional[HistoryData] = None
                   ) -> Iterator[HistoryRecord]:
    """The usable records of run directories / history files, one at a time, in file order
    (repeats included: what counts as one is the caller's). Malformed lines, hash-only prompts
    (when `need_text`) and other models' records (when `model`) are skipped and counted by reason
    into `stats` (its files too; its records are left alone); each malformed line is named
    (file:line) in a warning."""
    stats = stats if stats is not None else HistoryData()
    warned = 0
    for source in sources:
        for path in history_files(source):
            stats.files.append(str(path))
            for line_no, record, why in _read_file(path):
                if record is None:
                    stats.skipped["malformed"] += 1
                    if warned < MAX_WARNINGS:
                        log.warning("%s:%d: skipping a malformed history line (%s)", path,
                                    line_no, why)
                        warned += 1
                    continue
                if model is not None and record.model != model:
                    stats.skipped["other model"] += 1
                    continue
                if need_text and not record.prompt:
                    stats.skipped["no prompt text (history_prompts: hash)"] += 1
                    continue
                yield record


def read_history(sources: Iterable[Union[str, Path]], model: Optional[str] = None,
                 need_text: bool = False) -> HistoryData:
    """Every record from run directories / history files, in memory. Skipped as in
    `stream_history`, and repeats of the same (id, prompt) too, all counted by reason."""
    data = HistoryData()
    seen: set[tuple[str, str]] = set()
    for record in stream_history(sources, model, need_text, data):
        if record.key in seen:
            data.skipped["duplicate"] += 1
            continue
        seen.add(record.key)
        data.records.append(record)
    log_skipped(data)
    return data


def models_for_job(models: Counter, job_model: Optional[str]
                   ) -> tuple[Optional[set], Optional[str]]:
    """Whose records a job's lengths come from, given how many the history holds of each model:
    its own model's where it has any ({job_model} and a note of how many others were left out),
    else everyone's (None and a note saying whose they are). (None, None): one model, or none
    named, so nothing to choose or say. Records without a model count as the job's."""
    named = {m for m in models if m}
    if job_model is None or not named or named == {job_model}:
        return None, None
    if job_model in named:
        others = sum(n for m, n in models.items() if m and m != job_model)
        return {job_model, None}, (f"{models[job_model]} records of {job_model} used, {others} "
                                   "of other models left out")
    return None, (f"no record of this job's model {job_model}: the lengths are the replies "
                  f"of {', '.join(sorted(named))}")


def log_skipped(data: HistoryData) -> None:
    if data.num_skipped:
        log.warning("history: skipped %d lines (%s) in %d files", data.num_skipped,
                    ", ".join(f"{k}: {v}" for k, v in sorted(data.skipped.items())),
                    len(data.files))
