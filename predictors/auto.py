"""`predictor.name: auto` (the default): the best length predictor that exists for this job's model.

TD-Pipe's prefill decisions run on forecasts, so a job whose strategy reads them gets, in order:
1. a predictor trained from this model's own run history: the history.jsonl of the runs beside
   this one (or under `predictor.path`) holding at least MIN_RECORDS records of the same model id
   with prompt text (the job's own run directory excluded). It is trained once (the frozen
   encoder plus the head, seconds for a few thousand prompts) on the newest MAX_TRAIN_RECORDS
   into the setup cache and reused until the history has grown by a quarter; a job that finds
   another one training it takes the next choice rather than wait. The history is streamed, so
   however long it grows only those newest records are held (ModelHistory);
2. a predictor shipped in the package for this model (predictors/shipped/*/predictor.json whose
   card lists the model id): the embedded default model has one;
3. with neither: the mean output length of whatever history there is, or else each request's
   max_tokens (what `none` does).
Whatever goes wrong on the way (a broken cache entry is discarded and trained again once) is
logged and the next choice taken: a predictor never fails a job. The choice and why are logged
and recorded in the report (AutoChoice). A strategy that reads no forecast gets no predictor at
all (nothing to pay for). The predictor runs on the CPU unless the recipe names a device: on a
GPU host it would otherwise take memory from the engine's first rank.
"""
from __future__ import annotations

import hashlib
import logging
import re
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from .base import PREDICTOR_CARD, LengthPredictor, MeanPredictor, bert_from_dir
from .history import HISTORY, HistoryData, HistoryRecord, log_skipped, stream_history

log = logging.getLogger(__name__)
T = TypeVar("T")

SHIPPED_DIR = Path(__file__).parent / "shipped"
MAX_TRAIN_RECORDS = 4000     # the newest records a history-trained predictor learns from: the
                             # only records of the history held in memory (ModelHistory)
RETRAIN_GROWTH = 1.25        # a cached predictor is reused until the history is this much larger
TRAIN_WAIT_S = 2.0           # another job training the same predictor: take the next choice


@dataclass(frozen=True)
class AutoChoice:
    """What `auto` picked for the job, as the report shows it."""

    name: str                 # bert | mean | none
    source: str               # shipped | history | max_tokens
    reason: str
    path: Optional[str] = None
    history_records: int = 0

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class ModelHistory:
    """What `auto` needs of a model's run history, read in one pass in bounded memory: how many
    distinct records there are (the training threshold, the retrain trigger), their summed output
    tokens (the `mean` fallback) and the newest MAX_TRAIN_RECORDS of them (what a predictor is
    trained on). The prompts of the older ones are never held: a long history costs its reading
    time and one 8-byte digest per distinct record (to drop repeats across runs), not its text."""

    count: int = 0
    output_tokens: int = 0
    newest: list[HistoryRecord] = field(default_factory=list)   # oldest first

    @property
    def mean_output_tokens(self) -> float:
        return self.output_tokens / self.count


def choose_predictor(cfg: Any, model_id: str, runs_root: Path, device: Optional[str],
                     reads_forecasts: bool, exclude: Optional[Path] = None
                     ) -> tuple[Optional[LengthPredictor], AutoChoice]:
    """The predictor `auto` resolves to (None: each request's max_tokens) and why. `exclude`: a
    run directory whose history is not read (the job's own: a resumed run or a Slurm part would
    otherwise learn from a different, growing set). Nothing here fails the job: a predictor is an
    optimisation, so each step that goes wrong is logged and the next choice taken."""
    if not reads_forecasts:
        return None, AutoChoice("none", "max_tokens", "the strategy reads no length forecast")
    root = Path(cfg.path) if cfg.path else Path(runs_root)
    history = model_history(root, model_id, exclude)
    count = history.count
    failed: list[str] = []          # why training did not give one, when it was tried
    if count >= min_records():
        built = _attempt(f"training one from the history under {root}",
                         lambda: _from_history(cfg, history, model_id, device, root), failed)
        if built is not None:
            path, predictor = built
            reason = f"trained on this model's own history: {_trained_on(path, history, root)}"
            log.info("length predictor (auto): bert %s (%s)", path, reason)
            return predictor, AutoChoice("bert", "history", reason, str(path), count)
    shipped = shipped_predictor(model_id)
    if shipped is not None:
        predictor = _attempt(f"loading {shipped}", lambda: bert_from_dir(cfg, shipped, device))
        if predictor is not None:
            reason = f"shipped for {model_id}" + (
                f" ({_not_trained(count, failed)})" if count else "")
            log.info("length predictor (auto): bert %s (%s)", shipped, reason)
            return predictor, AutoChoice("bert", "shipped", reason, str(shipped), count)
    if count:
        mean = history.mean_output_tokens
        reason = (f"no predictor for {model_id}: the mean output length ({mean:.1f} tokens) of "
                  f"its {count} history records under {root}; " + (
                      _not_trained(count, failed) if failed else
                      f"{min_records()} records train a BERT predictor"))
        log.warning("length predictor (auto): %s", reason)
        return (MeanPredictor(mean, cfg.oracle_field, source=str(root)),
                AutoChoice("mean", "history", reason, str(root), count))
    reason = (f"no predictor and no history for {model_id} under {root}: forecasting each "
              "request's max_tokens; runs write history.jsonl, from which the next run of this "
              "model learns")
    log.warning("length predictor (auto): %s", reason)
    return None, AutoChoice("none", "max_tokens", reason)


def _trained_on(path: Path, history: ModelHistory, root: Path) -> str:
    """What the predictor at `path` learned from: a cached one was trained when the history
    was smaller (its directory says how large: n<records>), on its newest records then."""
    match = re.fullmatch(r"n(\d+)", path.name)
    then = int(match.group(1)) if match else history.count
    if then == history.count:
        return f"{len(history.newest)} of {then} records under {root}"
    used = min(then, MAX_TRAIN_RECORDS)
    return (f"{used} of the {then} records under {root} when it was trained (cached; the "
            f"history holds {history.count} now, retrained past {int(then * RETRAIN_GROWTH)})")


def _not_trained(count: int, failed: list[str]) -> str:
    """Why this model's history did not give the job a predictor."""
    if failed:
        return (f"training one on this model's {count} history records failed ({failed[0]}; "
                "see the log)")
    return (f"this model's history has {count} records, fewer than the {min_records()} "
            "needed to train")


def _attempt(what: str, build: Callable[[], T], failed: Optional[list] = None) -> Optional[T]:
    try:
        return build()
    except Exception as exc:  # noqa: BLE001 - an optimisation never fails the job
        log.warning("length predictor (auto): %s failed (%s: %s); taking the next choice", what,
                    type(exc).__name__, exc)
        if failed is not None:
            failed.append(type(exc).__name__)
        return None


def _from_history(cfg: Any, history: ModelHistory, model_id: str, device: Optional[str],
                  root: Path) -> tuple[Path, LengthPredictor]:
    """The cached (or newly trained) predictor, loaded; a cached one that does not load is
    discarded and trained again once."""
    from batchinfer.engine.setup_cache import discard

    path = trained_from_history(history, model_id, device, root)
    try:
        return path, bert_from_dir(cfg, path, device)
    except Exception as exc:  # noqa: BLE001 - whatever broke the entry, it is rebuilt
        log.warning("length predictor (auto): the cached %s does not load (%s: %s); training "
                    "it again", path, type(exc).__name__, exc)
        discard(path, "discarding a broken length predictor", TRAIN_WAIT_S)
    path = trained_from_history(history, model_id, device, root)
    return path, bert_from_dir(cfg, path, device)


def min_records() -> int:
    from .train import MIN_RECORDS

    return MIN_RECORDS


def model_history(root: Path, model_id: str, exclude: Optional[Path] = None) -> ModelHistory:
    """The records of `model_id` with prompt text in `root` itself (a run directory) or in the run
    directories directly under it, but `exclude`, streamed (ModelHistory: what is kept of them).
    Runs are read in name order, each file in line order: "newest" is the last read. A repeat of
    a record already read (the same id and prompt, e.g. one input run under two recipes) counts
    once. A run that cannot be read is skipped (from the failing read on) with a warning, never
    fatal."""
    history = ModelHistory()
    if not root.is_dir():
        return history
    try:
        runs = [root] if _has_history(root) else []
        runs += sorted(p for p in root.iterdir() if p.is_dir() and _has_history(p))
    except OSError as exc:
        log.warning("length predictor (auto): cannot list %s (%s)", root, exc)
        return history
    skip = _resolved(exclude) if exclude is not None else None
    newest: deque[HistoryRecord] = deque(maxlen=MAX_TRAIN_RECORDS)
    seen: set[bytes] = set()
    stats = HistoryData()
    for run in runs:
        if skip is not None and _resolved(run) == skip:
            continue
        try:
            for record in stream_history([run], model=model_id, need_text=True, stats=stats):
                digest = _key_digest(record)
                if digest in seen:
                    continue
                seen.add(digest)
                history.count += 1
                history.output_tokens += record.output_tokens
                newest.append(record)
        except OSError as exc:
            log.warning("length predictor (auto): skipping %s (%s)", run, exc)
    log_skipped(stats)
    history.newest = list(newest)
    return history


def _key_digest(record: HistoryRecord) -> bytes:
    """A record's identity (its id and prompt hash) in 8 bytes: a collision among a million
    records has odds of about 3e-8."""
    key = "\0".join(record.key).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(key, digest_size=8).digest()


def _resolved(path: Path) -> Path:
    try:
        return Path(path).resolve()
    except OSError:
        return Path(path).absolute()


def _has_history(path: Path) -> bool:
    try:
        return (path / HISTORY).is_file() or any(path.glob(f"part-*-of-*/{HISTORY}"))
    except OSError:          # e.g. another user's run directory
        return False


def shipped_predictor(model_id: str) -> Optional[Path]:
    """The predictor shipped in the package whose card was trained on `model_id`'s outputs."""
    import json

    for card_path in sorted(SHIPPED_DIR.glob(f"*/{PREDICTOR_CARD}")):
        try:
            models = json.loads(card_path.read_text(encoding="utf-8"))["data"]["models"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if model_id in models:
            return card_path.parent
    return None


def trained_from_history(history: ModelHistory, model_id: str, device: Optional[str],
                         root: Path) -> Path:
    """A BERT predictor trained on the newest (at most MAX_TRAIN_RECORDS) records of `history`
    (read under `root`), from the setup cache when one trained on the history under the same
    root at least 1 / RETRAIN_GROWTH as large is there: another project's history of the model
    trains its own."""
    from batchinfer.engine.setup_cache import build_once, cache_root

    model_dir = cache_root() / "predictors" / _slug(model_id) / _slug(str(_resolved(root)))
    used = history.newest
    cached = _cached(model_dir, history.count)
    if cached is not None:
        return cached
    target = model_dir / f"n{history.count}"

    def build(staging: Path) -> None:
        from .train import TrainConfig, train_predictor

        log.info("length predictor (auto): training on %d history records of %s (once; cached "
                 "in %s)", len(used), model_id, target)
        train_predictor(used, staging, TrainConfig(device=device), sources=["auto"])
        (staging / "history_records").write_text(f"{history.count}\n", encoding="utf-8")

    model_dir.mkdir(parents=True, exist_ok=True)
    return build_once(target, build, what=f"training the length predictor of {model_id}",
                      wait_timeout_s=TRAIN_WAIT_S,
                      is_complete=lambda p: (p / PREDICTOR_CARD).is_file())


def _cached(model_dir: Path, num_records: int) -> Optional[Path]:
    """The newest cached predictor whose history is within RETRAIN_GROWTH of `num_records`."""
    best = None
    for path in model_dir.glob("n*"):
        match = re.fullmatch(r"n(\d+)", path.name)
        if match is None or not (path / PREDICTOR_CARD).is_file():
            continue
        trained = int(match.group(1))
        if trained * RETRAIN_GROWTH >= num_records and trained <= num_records:
            if best is None or trained > best[0]:
                best = (trained, path)
    return None if best is None else best[1]


def _slug(model_id: str) -> str:
    """A directory name per model id: readable, and unique by its hash."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model_id.split(" [")[0]).name)[:48]
    return f"{readable or 'model'}-{hashlib.sha256(model_id.encode()).hexdigest()[:12]}"

