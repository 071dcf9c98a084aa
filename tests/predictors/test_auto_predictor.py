"""`predictor: auto` (the default): a predictor trained on the model's own run history, else the
one shipped for it, else the history's mean, else max_tokens; only for strategies that read
forecasts; the choice recorded in the report."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from batchinfer.engine.model.sources import DEFAULT_MODEL_ID, model_id_for
from batchinfer.engine.request import SamplingParams
from batchinfer.predictors.auto import choose_predictor, model_history, shipped_predictor
from batchinfer.predictors.base import LengthQuery
from batchinfer.predictors.history import sha256_text
from batchinfer.runner.job import EXIT_OK, JobSpec, run_job
from batchinfer.runner.recipe import Recipe, RecipeError, parse_recipe

MODEL = "/models/my-own-model"
SHORT = ["Is a {} a mammal? Answer yes or no.", "What color is a {}? One word.",
         "How many legs does a {} have? Only the number."]
LONG = ["Write a long story about a {} who travels the world.",
        "Write a detailed five-paragraph essay about the {}.",
        "Write a complete Python program that simulates a {} farm, with comments."]
ANIMALS = ["cat", "dog", "horse", "eagle", "shark", "frog", "owl", "bee", "whale", "fox",
           "lion", "wolf", "crab", "goat", "duck", "seal"]


def _write_history(run_dir: Path, model: str, n_animals: int, start: int = 0) -> int:
    """Short questions answered in 1-4 tokens and long tasks in 200-400, six per animal."""
    rng = np.random.default_rng(start)
    rows = []
    for animal in ANIMALS[:n_animals]:
        for templates, (lo, hi) in ((SHORT, (1, 5)), (LONG, (200, 400))):
            for template in templates:
                prompt = template.format(animal)
                rows.append({"id": f"h{start + len(rows)}", "prompt": prompt,
                             "prompt_sha256": sha256_text(prompt), "prompt_tokens": 10,
                             "output_tokens": int(rng.integers(lo, hi)), "finish_reason": "stop",
                             "model": model, "max_tokens": 512})
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "history.jsonl", "a", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return len(rows)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("BATCHINFER_CACHE", str(root))
    return root


def _cfg(**kw):
    return Recipe(predictor={"name": "auto", **kw}).predictor


def test_auto_is_the_default_and_its_path_must_exist(tmp_path):
    assert Recipe().predictor.name == "auto"
    import yaml

    text = f"predictor:\n  name: auto\n  path: {tmp_path / 'nope'}\n"
    with pytest.raises(RecipeError) as err:
        parse_recipe(yaml.safe_load(text), "r.yaml", text)
    problems = " ".join(err.value.problems)
    assert "line 3, predictor.path" in problems and "no such directory" in problems


def test_only_strategies_that_read_forecasts_get_one(tmp_path):
    predictor, choice = choose_predictor(_cfg(), DEFAULT_MODEL_ID, tmp_path, "cpu",
                                         reads_forecasts=False)
    assert predictor is None and choice.name == "none" and "reads no" in choice.reason
    assert not Recipe().strategy.reads_length_forecasts()
    assert Recipe(strategy={"name": "tdpipe"}).strategy.reads_length_forecasts()
    # the ablation of Approach 1 reads no forecast: no predictor is paid for
    assert not Recipe(strategy={"name": "tdpipe", "greedy_prefill": False}
                      ).strategy.reads_length_forecasts()


def test_embedded_model_gets_the_shipped_predictor(tmp_path, cache):
    assert shipped_predictor(DEFAULT_MODEL_ID).name == "smollm2-135m-instruct"
    assert shipped_predictor(MODEL) is None
    assert shipped_predictor(model_id_for(None, dummy=True)) is None   # dummy weights: not it
    predictor, choice = choose_predictor(_cfg(), DEFAULT_MODEL_ID, tmp_path, "cpu", True)
    assert (predictor.name, choice.name, choice.source) == ("bert", "bert", "shipped")
    short, long_ = predictor.predict([
        LengthQuery("What color is grass? Answer with one word.", max_tokens=512),
        LengthQuery("Write a detailed essay of at least five paragraphs about the history of "
                    "the printing press.", max_tokens=512)])
    assert short < long_
    assert not cache.exists() or not any(cache.rglob("predictor.json"))   # nothing trained


def test_no_history_forecasts_max_tokens_and_a_little_history_its_mean(tmp_path, cache):
    predictor, choice = choose_predictor(_cfg(), MODEL, tmp_path, "cpu", True)
    assert predictor is None and (choice.name, choice.source) == ("none", "max_tokens")
    assert MODEL in choice.reason and "history" in choice.reason
    n = _write_history(tmp_path / "earlier-run", MODEL, 2)
    _write_history(tmp_path / "other-model-run", "/models/another", 16)
    (tmp_path / "not-a-run").mkdir()
    assert model_history(tmp_path, MODEL).count == n == 12
    predictor, choice = choose_predictor(_cfg(), MODEL, tmp_path, "cpu", True)
    assert (predictor.name, choice.name, choice.history_records) == ("mean", "mean", 12)
    records = model_history(tmp_path, MODEL).newest
    mean = sum(r.output_tokens for r in records) / len(records)
    assert predictor.predict([LengthQuery("x", max_tokens=1000)]) == [round(mean)]
    assert predictor.predict([LengthQuery("x", max_tokens=3)]) == [3]     # capped


def test_enough_history_trains_once_and_retrains_when_it_grows(tmp_path, cache):
    runs = tmp_path / "runs"
    _write_history(runs / "a" / "part-0-of-2", MODEL, 8)           # Slurm parts count too
    _write_history(runs / "b", MODEL, 2, start=1000)
    predictor, choice = choose_predictor(_cfg(path=str(runs)), MODEL, tmp_path / "elsewhere",
                                         "cpu", True)
    assert (predictor.name, choice.source, choice.history_records) == ("bert", "history", 60)
    trained = Path(choice.path)
    assert trained.parent.parent.parent == cache / "predictors" and trained.name == "n60"
    card = json.loads((trained / "predictor.json").read_text())
    assert card["data"]["records"] == 60 and card["data"]["models"] == [MODEL]
    short, long_ = predictor.predict([LengthQuery(SHORT[0].format("cat"), max_tokens=512),
                                      LengthQuery(LONG[1].format("cat"), max_tokens=512)])
    assert short < long_

    _write_history(runs / "c", MODEL, 2, start=2000)               # 72 records: < 1.25 x 60
    _, again = choose_predictor(_cfg(path=str(runs)), MODEL, tmp_path, "cpu", True)
    assert again.path == choice.path and again.history_records == 72
    # the report says what the reused predictor learned from, not the grown history
    assert "60 of the 60 records" in again.reason and "holds 72 now" in again.reason
    assert "72 of 72" not in again.reason
    _write_history(runs / "d", MODEL, 2, start=3000)               # 84 records: retrain
    _, grown = choose_predictor(_cfg(path=str(runs)), MODEL, tmp_path, "cpu", True)
    assert Path(grown.path).name == "n84" and grown.path != choice.path
    other = tmp_path / "other-project"                            # as many records, its own
    _write_history(other / "a", MODEL, 14, start=5000)
    _, theirs = choose_predictor(_cfg(path=str(other)), MODEL, tmp_path, "cpu", True)
    assert Path(theirs.path).name == "n84" and theirs.path != grown.path


@pytest.mark.parametrize("error", [RuntimeError, ValueError, ImportError])
def test_whatever_breaks_a_predictor_the_next_choice_is_taken(tmp_path, cache, monkeypatch,
                                                              error):
    from batchinfer.predictors import auto

    def broken(*args, **kwargs):
        raise error("broken")

    monkeypatch.setattr(auto, "trained_from_history", broken)
    _write_history(tmp_path / "run", MODEL, 10)
    predictor, choice = choose_predictor(_cfg(), MODEL, tmp_path, "cpu", True)
    assert predictor.name == "mean" and choice.name == "mean"
    # the shipped predictor failing to load: the embedded model's job goes on with max_tokens
    monkeypatch.setattr(auto, "bert_from_dir", broken)
    predictor, choice = choose_predictor(_cfg(), DEFAULT_MODEL_ID, tmp_path / "none", "cpu", True)
    assert predictor is None and choice.name == "none"


def test_a_broken_cached_predictor_is_trained_again(tmp_path, cache):
    _write_history(tmp_path / "run", MODEL, 10)
    _, first = choose_predictor(_cfg(), MODEL, tmp_path, "cpu", True)
    (Path(first.path) / "weights.safetensors").write_bytes(b"torn")
    predictor, again = choose_predictor(_cfg(), MODEL, tmp_path, "cpu", True)
    assert (again.name, again.source, again.path) == ("bert", "history", first.path)
    assert len(predictor.predict([LengthQuery("x", max_tokens=512)])) == 1


def test_the_jobs_own_run_and_unreadable_runs_are_left_out(tmp_path):
    own, other = tmp_path / "own", tmp_path / "other"
    _write_history(own, MODEL, 2)
    _write_history(other, MODEL, 1, start=500)
    assert model_history(tmp_path, MODEL).count == 18
    assert model_history(tmp_path, MODEL, exclude=own).count == 6
    (tmp_path / "locked").mkdir(mode=0)          # another user's run: skipped, not fatal
    assert model_history(tmp_path, MODEL, exclude=own).count == 6
    missing = model_history(tmp_path / "missing", MODEL)
    assert (missing.count, missing.newest) == (0, [])


def test_a_history_longer_than_the_training_cap_keeps_only_its_newest_records(tmp_path,
                                                                               monkeypatch):
    """The history is streamed: every record is counted (and its repeats dropped), but only the
    newest MAX_TRAIN_RECORDS are held, and they are what a predictor is trained on."""
    from batchinfer.predictors import auto

    monkeypatch.setattr(auto, "MAX_TRAIN_RECORDS", 10)
    _write_history(tmp_path / "a", MODEL, 4)                       # h0..h23
    _write_history(tmp_path / "b", MODEL, 4)                       # the same 24 again: repeats
    _write_history(tmp_path / "b", MODEL, 6, start=100)            # h100..h135, after them
    _write_history(tmp_path / "c", "/models/another", 5, start=500)
    lines = [json.loads(x) for run in ("a", "b")
             for x in (tmp_path / run / "history.jsonl").read_text().splitlines()]
    distinct = list({(r["id"], r["prompt_sha256"]): r for r in lines}.values())
    history = model_history(tmp_path, MODEL)
    assert history.count == len(distinct) == 60
    assert history.output_tokens == sum(r["output_tokens"] for r in distinct)
    assert [r.id for r in history.newest] == [f"h{100 + i}" for i in range(26, 36)]
    trained_on = []
    monkeypatch.setattr("batchinfer.predictors.train.train_predictor",
                        lambda used, *a, **k: trained_on.append(list(used)) or 1 / 0)
    monkeypatch.setenv("BATCHINFER_CACHE", str(tmp_path / "cache"))
    predictor, choice = choose_predictor(_cfg(), MODEL, tmp_path, "cpu", True)
    assert trained_on and [r.id for r in trained_on[0]] == [r.id for r in history.newest]
    assert choice.history_records == 60 and predictor.name == "mean"    # training failed
    assert predictor.mean == pytest.approx(history.output_tokens / 60)


def test_dummy_models_of_other_shapes_are_other_models():
    """Their replies differ, so their run histories must not train one another's predictor."""
    small, large = {"hidden_size": 64}, {"hidden_size": 128}
    assert model_id_for(None, True, small) != model_id_for(None, True, large)
    assert model_id_for(None, True, small) == model_id_for(None, True, dict(small))
    assert model_id_for(None, True, small) != model_id_for(None, True)
    assert model_id_for(None, False, small) == model_id_for(None) == DEFAULT_MODEL_ID


TINY_MODEL = {"load_format": "dummy", "max_model_len": 512, "hf_overrides": {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}}


def test_a_job_learns_from_the_runs_beside_it_and_reports_the_choice(tmp_path, monkeypatch):
    from batchinfer.engine.engine import Engine

    recipe = Recipe(model=TINY_MODEL, memory={"kv_cache_memory": "16MiB"},
                    sampling=SamplingParams(max_tokens=4, temperature=0.0),
                    strategy={"name": "tdpipe", "max_num_seqs": 8},
                    report={"refresh_seconds": 0.2, "plots": False})
    # the job reads the recipe's strategy; any engine serves to run the few requests
    engine = Engine.from_config(Recipe(model=TINY_MODEL, memory={"kv_cache_memory": "16MiB"},
                                       strategy={"name": "baseline", "max_num_seqs": 8}
                                       ).engine_config())
    model_id = model_id_for(None, dummy=True, hf_overrides=TINY_MODEL["hf_overrides"])
    assert engine.model_id == model_id
    # the predictor trains into a fresh cache (the engine above used the usual one: no rebuild)
    monkeypatch.setenv("BATCHINFER_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": LONG[1].format(a)}) + "\n"
                            for i, a in enumerate(ANIMALS[:3])))
    runs = tmp_path / "runs"

    def run(name):
        outcome = run_job(JobSpec(recipe=recipe, input_path=path, output_dir=runs / name,
                                  progress="off", engine_factory=lambda cfg: engine))
        assert outcome.exit_code == EXIT_OK
        return json.loads((runs / name / "report.json").read_text())

    first = run("first")
    assert first["predictor"]["name"] == "none" and "no history" in first["predictor"]["reason"]
    assert "**Length predictor:** none" in (runs / "first" / "report.md").read_text()
    _write_history(runs / "earlier", model_id, 10)
    second = run("second")
    assert (second["predictor"]["name"], second["predictor"]["source"]) == ("bert", "history")
    assert second["session"]["predictor"]["requests"] == 3
    encoder = second["session"]["predictor"]["encoder"]      # the encoder's arithmetic, reported
    assert encoder.endswith(" attention") and " linears, " in encoder
    assert f"its encoder: {encoder}." in (runs / "second" / "report.md").read_text()
    history = [json.loads(x) for x in (runs / "second" / "history.jsonl").read_text().splitlines()]
    assert len(history) == 3 and all("predicted_tokens" in h for h in history)
    # the 60 records beside it and the first run's 3, not its own (a resumed run's or a part's)
    assert second["predictor"]["history_records"] == 63


def test_a_training_that_failed_is_not_reported_as_too_little_history(tmp_path, cache,
                                                                      monkeypatch):
    """A Slurm task that found another training the predictor (or a training that broke) took
    the shipped one "(this model's history has 80 records, fewer than the 50 needed to
    train)": now the reason says the training failed, and why."""
    from batchinfer.predictors import auto

    def busy(*args, **kwargs):
        raise RuntimeError("another process is training it")

    monkeypatch.setattr(auto, "trained_from_history", busy)
    _write_history(tmp_path / "run", DEFAULT_MODEL_ID, 10)          # 60 records
    predictor, choice = choose_predictor(_cfg(), DEFAULT_MODEL_ID, tmp_path, "cpu", True)
    assert choice.source == "shipped" and choice.history_records == 60
    assert "training one on this model's 60 history records failed (RuntimeError" in choice.reason
    assert "fewer than" not in choice.reason
    _write_history(tmp_path / "mine", MODEL, 10)
    _, choice = choose_predictor(_cfg(), MODEL, tmp_path, "cpu", True)
    assert choice.name == "mean" and "failed (RuntimeError" in choice.reason
    assert "records train a BERT predictor" not in choice.reason
