"""Output-length predictors (issue 5): classes and metrics by hand, history written by real runs,
the mean / oracle / none baselines, and the BERT classifier trained, saved, reloaded and used."""
from __future__ import annotations

import json
import shutil
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from batchinfer.cli.main import app
from batchinfer.runner.job import EXIT_OK, JobSpec, run_job
from batchinfer.runner.recipe import Recipe, RecipeError, parse_recipe
from batchinfer.runner.io.records import RequestPayload
from batchinfer.engine.request import Request, SamplingParams
from batchinfer.predictors import LengthQuery, PredictorError, make_predictor
from batchinfer.predictors.base import class_forecasts
from batchinfer.predictors.classes import (accumulated_error, accumulated_errors, assign_classes,
                                           check_percentiles, class_counts, class_edges,
                                           class_means, cut_tail, edge_percentiles,
                                           majority_accuracy, means_past_cap)
from batchinfer.predictors.history import read_history, sha256_text

TINY_MODEL = {"load_format": "dummy", "max_model_len": 512, "hf_overrides": {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}}


# --- classes, means, metrics (hand-made data) -------------------------------------------------------
def test_percentile_classes_and_means_by_hand():
    lengths = np.arange(1, 101)                     # 1..100
    edges = class_edges(lengths)                    # numpy's linear percentiles
    assert edges == pytest.approx([1.0, 25.75, 50.5, 75.25, 99.01])
    labels = assign_classes(lengths, edges)
    assert class_counts(labels, 5) == [25, 25, 25, 24, 1]
    assert class_means(lengths, labels, 5) == pytest.approx([13.0, 38.0, 63.0, 87.5, 100.0])
    # an edge belongs to the class above it; below P0 is class 0; far above is the last class
    assert assign_classes([25.75, 25.7, 0, 10_000], edges).tolist() == [1, 0, 0, 4]
    assert majority_accuracy(labels, [0, 0, 1, 4], 5) == 0.5


def test_coinciding_percentiles_merge_into_fewer_classes():
    lengths = [5] * 10 + [512] * 10                 # P0 = P25 = 5 and P75 = P99 = 512
    edges = class_edges(lengths)
    assert edges == pytest.approx([5.0, 258.5, 512.0])
    assert edge_percentiles(lengths) == [0.0, 50.0, 75.0]
    labels = assign_classes(lengths, edges)
    assert class_counts(labels, 3) == [10, 0, 10]
    # an empty class predicts its lower edge
    assert class_means(lengths, labels, 3, edges) == pytest.approx([5.0, 258.5, 512.0])


def test_a_request_allowed_more_than_the_training_cap_reads_the_cut_outputs_tail():
    """Exponential lengths of mean 300 generated with max_tokens 512: counted at 512, the cut
    ones make the top class's mean 512 exactly. The tail fitted above the last edge below the
    cap (300) has a mean near 300, so a request allowed 1,024 tokens gets for the top class
    E[min(L, 1024) | L >= 512] (about 759 here, 812 unbounded), one allowed 512 or fewer the
    plain means."""
    rng = np.random.default_rng(0)
    true = rng.exponential(300.0, 20_000)
    lengths = np.minimum(np.ceil(true), 512)
    cut = true >= 512
    edges = [0.0, 100.0, 300.0, 512.0]
    labels = assign_classes(lengths, edges)
    plain = class_means(lengths, labels, 4, edges)
    tail = cut_tail(lengths, labels, 4, edges, cut)
    assert plain[3] == 512 and tail["cut"] == int(cut.sum()) and tail["tail_from"] == 300
    assert tail["cap"] == 512 and tail["cut_at"][3] == [[512.0, int(cut.sum())]]
    assert tail["tail_mean"] == pytest.approx(300, rel=0.05)
    expected = 512 + 300 * (1 - np.exp(-512 / 300))
    assert means_past_cap(plain, tail, 1024)[3] == pytest.approx(expected, rel=0.03)
    assert means_past_cap(plain, tail, None)[3] == pytest.approx(812, rel=0.03)
    assert means_past_cap(plain, tail, 1024)[:3] == plain[:3]
    assert means_past_cap(plain, tail, 512) == plain == means_past_cap(plain, None, 1024)
    # nothing cut, or too few outputs ending above every edge below the stops: no tail
    assert cut_tail(lengths, labels, 4, edges, [False] * len(lengths)) is None
    assert cut_tail(np.full(10, 512.0), [3] * 10, 4, edges, [True] * 10) is None
    # the forecasts read it: a point past the cap for a request allowed more, as before within it
    queries = [LengthQuery("a", max_tokens=m) for m in (256, 512, 1024, None)]
    probs = np.tile([0.0, 0.0, 0.1, 0.9], (4, 1))
    points = [f.point for f in class_forecasts(probs, plain, edges, queries, 75.0, tail)]
    assert points[:2] == [256, 512] and points[2] == round(means_past_cap(plain, tail, 1024)[3])
    assert points[3] == round(means_past_cap(plain, tail, None)[3])


def test_outputs_cut_at_different_stops_count_from_their_own():
    """Half the history capped at 256, half at 1,024: each cut output is read on from where it
    stopped, so a class cut at 1,024 keeps 1,024 for a request allowed up to that (capped at
    its max_tokens), one cut at 256 is read on past it, and nothing is infinite."""
    rng = np.random.default_rng(1)
    true = rng.exponential(300.0, 4_000)
    stops = np.where(np.arange(4_000) % 2 == 0, 256.0, 1024.0)
    lengths = np.minimum(np.ceil(true), stops)
    cut = true >= stops
    edges = [0.0, 100.0, 200.0, 1024.0]
    labels = assign_classes(lengths, edges)
    plain = class_means(lengths, labels, 4, edges)
    tail = cut_tail(lengths, labels, 4, edges, cut)
    assert tail["cap"] == 256 and plain[3] == 1024 and tail["tail_from"] == 200
    for limit in (600, 1024, 2048, None):
        past = means_past_cap(plain, tail, limit)
        assert past[3] == pytest.approx(1024 if limit in (600, 1024) else past[3])
        assert all(p >= m - 1e-9 for p, m in zip(past, plain))
    assert means_past_cap(plain, tail, None)[3] > 1024
    assert means_past_cap(plain, tail, 600)[2] > plain[2]      # its outputs cut at 256 read on
    # the stops are the outputs' own lengths (a cut by the model's length limit has no
    # max_tokens): nothing in the card is infinite
    json.dumps(tail, allow_nan=False)


@pytest.mark.parametrize("bad", [[25, 50], [0, 50, 50], [0, 50, 100], [0]])
def test_bad_percentiles_are_rejected(bad):
    with pytest.raises(ValueError):
        check_percentiles(bad)


def test_accumulated_error_by_hand():
    pred, actual = [10, 20, 30, 40], [20, 20, 20, 20]
    # N=1: |10-20|/20, 0, |30-20|/20, |40-20|/20 -> mean (0.5 + 0 + 0.5 + 1) / 4
    assert accumulated_error(pred, actual, 1) == pytest.approx(0.5)
    # N=2: groups (10+20 vs 40) and (30+40 vs 40) -> (0.25 + 0.75) / 2
    assert accumulated_error(pred, actual, 2) == pytest.approx(0.5)
    # N=3: one full group (10+20+30 vs 60), the partial one is dropped
    assert accumulated_error(pred, actual, 3) == pytest.approx(0.0)
    # N=4: 100 vs 80; shuffling cannot change a single group
    assert accumulated_error(pred, actual, 4) == pytest.approx(0.25)
    assert accumulated_error(pred, actual, 4, rounds=5, seed=1) == pytest.approx(0.25)
    assert accumulated_error(pred, actual, 8) is None
    errs = accumulated_errors(pred, actual, (1, 2, 8))
    assert errs["1"] == pytest.approx(0.5) and errs["8"] is None
    # shuffled groups of 2: every pairing has a defined error; the mean stays in its range
    shuffled = accumulated_error(pred, actual, 2, rounds=50, seed=0)
    assert 0.0 <= shuffled <= 0.75
    with pytest.raises(ValueError):
        accumulated_error([1, 2], [1], 1)


# --- history -----------------------------------------------------------------------------------------
def _history_line(i: int, prompt: str, out: int, model: str = "tiny", **kw) -> dict:
    return {"id": f"h{i}", "prompt": prompt, "prompt_sha256": sha256_text(prompt),
            "prompt_tokens": 10, "output_tokens": out, "finish_reason": "stop", "model": model,
            "max_tokens": 512, **kw}


def test_history_reader_skips_bad_lines_and_names_them(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    good = [_history_line(i, f"prompt {i}", i + 1) for i in range(3)]
    lines = [json.dumps(good[0]), "{not json", json.dumps(good[1]), "[1, 2]",
             json.dumps({"id": "x", "prompt": "p"}),                       # no token counts
             json.dumps({**good[2], "output_tokens": "many"}), "",
             json.dumps(good[2]), json.dumps(good[0]),                     # a duplicate
             json.dumps({**_history_line(9, "", 3), "prompt": None}),       # hash only
             json.dumps(_history_line(8, "other", 4, model="other-model"))]
    (run_dir / "history.jsonl").write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="batchinfer.predictors.history"):
        data = read_history([run_dir], model="tiny", need_text=True)
    assert [r.id for r in data.records] == ["h0", "h1", "h2"]
    assert data.skipped == {"malformed": 4, "duplicate": 1, "other model": 1,
                            "no prompt text (history_prompts: hash)": 1}
    assert f"{run_dir / 'history.jsonl'}:2:" in caplog.text
    assert f"{run_dir / 'history.jsonl'}:6:" in caplog.text
    assert read_history([run_dir]).records[-1].model == "other-model"
    with pytest.raises(FileNotFoundError, match="no history.jsonl"):
        read_history([tmp_path])


# --- baselines ---------------------------------------------------------------------------------------
def _request(prompt: str, max_tokens, metadata=None) -> Request:
    payload = RequestPayload(line=1, metadata=metadata)
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens), prompt=prompt,
                   payload=payload)


def test_none_mean_oracle_baselines(tmp_path):
    reqs = [_request("a", 100), _request("b", 10), _request("c", None, {"true_len": 42}),
            _request("d", 7, {"true_len": "oops"})]
    none = make_predictor(Recipe(predictor={"name": "none"}).predictor)
    assert none.predict(reqs) == [100, 10, 0, 7]

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "history.jsonl").write_text("".join(
        json.dumps(_history_line(i, f"p{i}", n)) + "\n" for i, n in enumerate([10, 20, 60])))
    mean = make_predictor(Recipe(predictor={"name": "mean", "path": str(run_dir)}).predictor)
    assert mean.predict(reqs) == [30, 10, 30, 7]            # capped at max_tokens
    assert mean.predict([LengthQuery("x")]) == [30]

    oracle = make_predictor(Recipe(predictor={"name": "oracle"}).predictor)
    assert oracle.predict(reqs) == [100, 10, 0, 7]           # max_tokens is the oracle field
    by_meta = make_predictor(Recipe(predictor={"name": "oracle",
                                               "oracle_field": "metadata.true_len"}).predictor)
    # missing / unusable field: falls back to max_tokens, counted
    assert by_meta.predict(reqs) == [100, 10, 42, 7]
    assert by_meta.stats()["missing_oracle"] == 3 and by_meta.stats()["requests"] == 4


def test_predictor_recipe_errors_name_the_key(tmp_path):
    def problems(text):
        import yaml

        with pytest.raises(RecipeError) as info:
            parse_recipe(yaml.safe_load(text), "r.yaml", text)
        return " ".join(info.value.problems)

    assert "predictor.path" in problems("predictor: {name: bert}")
    missing = problems(f"predictor: {{name: bert, path: {tmp_path / 'nope'}}}")
    assert "predictor.path" in missing and "no such directory" in missing
    assert "no predictor.json" in problems(f"predictor: {{name: bert, path: {tmp_path}}}")
    assert "predictor.oracle_field" in problems("predictor: {name: oracle, oracle_field: len}")
    assert "predictor.history_prompts" in problems("predictor: {history_prompts: all}")
    assert "predictor.name" in problems("predictor: {name: bret}")


# --- history written by real runs ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_recipe():
    return Recipe(model=TINY_MODEL, memory={"kv_cache_memory": "16MiB"},
                  sampling=SamplingParams(max_tokens=6, temperature=0.7, seed=1),
                  strategy={"name": "baseline", "max_num_seqs": 8},
                  report={"refresh_seconds": 0.2, "plots": False})


@pytest.fixture(scope="module")
def shared_engine(tiny_recipe):
    from batchinfer.engine.engine import Engine

    return Engine.from_config(tiny_recipe.engine_config())


def _run(recipe, input_path, out_dir, engine):
    spec = JobSpec(recipe=recipe, input_path=Path(input_path), output_dir=Path(out_dir),
                   progress="off", engine_factory=lambda cfg: engine)
    return run_job(spec)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def test_runs_write_history(tmp_path, tiny_recipe, shared_engine):
    lines = [{"id": f"q{i}", "prompt": f"Question number {i}?", "max_tokens": 3 + i % 4,
              "metadata": {"true_len": i}} for i in range(10)]
    lines.append({"id": "chat", "messages": [{"role": "user", "content": "Hi there"}]})
    lines.append({"id": "bad", "prompt": 5})
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    recipe = tiny_recipe.model_copy(update={"predictor": tiny_recipe.predictor.model_copy(
        update={"name": "oracle", "oracle_field": "metadata.true_len"})})
    outcome = _run(recipe, path, tmp_path / "run", shared_engine)
    assert outcome.exit_code == EXIT_OK and outcome.outputs == 11 and outcome.errors == 1
    outputs = {o["id"]: o for o in _jsonl(tmp_path / "run" / "outputs.jsonl")}
    history = {h["id"]: h for h in _jsonl(tmp_path / "run" / "history.jsonl")}
    assert set(history) == set(outputs)
    for i in range(10):
        h, o = history[f"q{i}"], outputs[f"q{i}"]
        assert h["prompt"] == f"Question number {i}?"
        assert h["prompt_sha256"] == sha256_text(h["prompt"])
        assert h["output_tokens"] == o["completion_tokens"] <= h["max_tokens"] == 3 + i % 4
        assert h["prompt_tokens"] == o["prompt_tokens"] and h["finish_reason"] == o["finish_reason"]
        assert h["model"] == shared_engine.model_id
        assert h["predicted_tokens"] == min(i, 3 + i % 4)       # the oracle, capped
    assert history["chat"]["prompt"] == "user: Hi there"
    assert history["chat"]["predicted_tokens"] == 6            # no oracle: max_tokens
    session = json.loads((tmp_path / "run" / "report.json").read_text())["session"]
    assert session["predictor"]["name"] == "oracle" and session["predictor"]["requests"] == 11
    assert 0 <= session["predictor"]["share_of_job"] < 1
    assert "Output-length predictor" in (tmp_path / "run" / "report.md").read_text()
    assert "encoder" not in session["predictor"]                 # the oracle has none
    assert "its encoder" not in (tmp_path / "run" / "report.md").read_text()

    hashed = tiny_recipe.model_copy(update={"predictor": tiny_recipe.predictor.model_copy(
        update={"history_prompts": "hash"})})
    _run(hashed, path, tmp_path / "hashed", shared_engine)
    rows = _jsonl(tmp_path / "hashed" / "history.jsonl")
    assert len(rows) == 11 and all(r["prompt"] is None and "predicted_tokens" not in r
                                   for r in rows)
    assert {r["prompt_sha256"] for r in rows} == {h["prompt_sha256"] for h in history.values()}
    off = tiny_recipe.model_copy(update={"predictor": tiny_recipe.predictor.model_copy(
        update={"history": False})})
    _run(off, path, tmp_path / "off", shared_engine)
    assert not (tmp_path / "off" / "history.jsonl").exists()


# --- the BERT classifier -----------------------------------------------------------------------
SHORT = ["Is a {} a mammal? Answer yes or no.", "What color is a {}? One word.",
         "How many legs does a {} have? Only the number."]
LONG = ["Write a long story about a {} who travels the world.",
        "Write a detailed five-paragraph essay about the {}.",
        "Write a complete Python program that simulates a {} farm, with comments."]
ANIMALS = ["cat", "dog", "horse", "eagle", "shark", "frog", "owl", "bee", "whale", "fox"]


def _synthetic_history(run_dir: Path) -> None:
    """60 records: short questions answered in 1-4 tokens, long tasks in 200-400."""
    rng = np.random.default_rng(0)
    rows, i = [], 0
    for animal in ANIMALS:
        for template in SHORT:
            rows.append(_history_line(i, template.format(animal), int(rng.integers(1, 5))))
            i += 1
        for template in LONG:
            rows.append(_history_line(i, template.format(animal), int(rng.integers(200, 400))))
            i += 1
    run_dir.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run_dir / "history.jsonl").write_text(text + '{"id": "torn", "prompt": "x"')


def test_train_save_reload_eval_and_use_in_a_run(tmp_path, tiny_recipe, shared_engine):
    from batchinfer.predictors.bert import BertLengthPredictor
    from batchinfer.predictors.train import TrainConfig, split_records, train_predictor

    history_dir, out = tmp_path / "history", tmp_path / "predictor"
    _synthetic_history(history_dir)
    data = read_history([history_dir], need_text=True)
    assert len(data.records) == 60 and data.skipped == {"malformed": 1}
    with pytest.raises(PredictorError, match="10 usable records, at least 50"):
        train_predictor(data.records[:10], tmp_path / "small")

    cfg = TrainConfig(epochs=30, lr=3e-3, seed=0, device="cpu")
    trained = train_predictor(data.records, out, cfg, sources=[str(history_dir)])
    card = json.loads((out / "predictor.json").read_text())
    assert card == json.loads(json.dumps(trained.card))
    for name in ("README.md", "weights.safetensors", "split.json"):
        assert (out / name).is_file()
    assert (out / "weights.safetensors").stat().st_size < 2_000_000     # the head only
    assert card["data"]["split"] == {"fractions": [0.6, 0.2, 0.2], "seed": 0, "train": 36,
                                     "val": 12, "test": 12}
    train, _, test = split_records(data.records, (0.6, 0.2, 0.2), 0)
    train_lengths = [r.output_tokens for r in train]
    edges = class_edges(train_lengths)
    labels = assign_classes(train_lengths, edges)
    assert card["classes"]["edges"] == pytest.approx(edges)
    assert card["classes"]["means"] == pytest.approx(class_means(train_lengths, labels,
                                                                 len(edges)), abs=1e-3)
    assert card["classes"]["cut_tail"] == cut_tail(train_lengths, labels, len(edges), edges,
                                                   [r.cut for r in train])
    assert card["classes"]["train_mean"] == pytest.approx(np.mean(train_lengths), abs=1e-3)
    assert "## Classes" in (out / "README.md").read_text()

    queries = [LengthQuery(r.prompt, max_tokens=r.max_tokens) for r in data.records]
    before = trained.predict(queries)
    reloaded = BertLengthPredictor.load(out, device="cpu")
    assert reloaded.predict(queries) == before
    head, head2 = trained.model.head.state_dict(), reloaded.model.head.state_dict()
    assert all(torch.equal(head[k], head2[k]) for k in head)
    # it learned the obvious: long tasks get longer predictions than yes/no questions
    by_kind = {"short": [], "long": []}
    for q, p in zip(queries, before):
        by_kind["long" if q.text.startswith("Write") else "short"].append(p)
    assert np.mean(by_kind["long"]) > 4 * np.mean(by_kind["short"])
    assert reloaded.predict([LengthQuery("Write a long story about a cat.", max_tokens=3)]) \
        == [min(3, reloaded.predict([LengthQuery("Write a long story about a cat.")])[0])]

    result = CliRunner().invoke(app, ["predictor", "eval", str(out), "--history",
                                      str(history_dir), "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output[result.output.index("{"):])
    assert metrics["records"] == 12 and metrics["held_out_only"]        # the test split
    assert metrics["class_accuracy"] == card["metrics"]["test"]["class_accuracy"]
    assert metrics["accumulated_error"] == card["metrics"]["test"]["accumulated_error"]
    assert metrics["accumulated_error"]["256"] is None                  # 12 records: no group
    unsplit = tmp_path / "unsplit"               # which records it trained on is unknown
    shutil.copytree(out, unsplit)
    (unsplit / "split.json").unlink()
    result = CliRunner().invoke(app, ["predictor", "eval", str(unsplit), "--history",
                                      str(history_dir), "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "no readable split.json" in result.output
    metrics = json.loads(result.output[result.output.index("{"):])
    assert metrics["records"] == 60 and not metrics["held_out_only"]
    for groups in ("0", "-3", "2.7", ""):
        result = CliRunner().invoke(app, ["predictor", "eval", str(out), "--history",
                                          str(history_dir), "--groups", groups])
        assert result.exit_code == 2 and "whole numbers of at least 1" in result.output, groups

    # a run with predictor: bert predicts every request before scheduling
    path = tmp_path / "in.jsonl"
    prompts = ["Is a cat a mammal? Answer yes or no.", "Write a long story about a dog."]
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p, "max_tokens": 400}) + "\n"
                            for i, p in enumerate(prompts)))
    # every token is a stop token: the dummy model stops after one token whatever max_tokens is
    one_token = tiny_recipe.sampling.model_copy(
        update={"stop_token_ids": list(range(shared_engine.tokenizer.vocab_size))})
    recipe = tiny_recipe.model_copy(update={"predictor": Recipe(
        predictor={"name": "bert", "path": str(out)}).predictor, "sampling": one_token,
        "device": tiny_recipe.device.model_copy(update={"device": "cpu"})})
    _run(recipe, path, tmp_path / "run", shared_engine)
    history = {h["id"]: h for h in _jsonl(tmp_path / "run" / "history.jsonl")}
    expected = reloaded.predict([LengthQuery(p, max_tokens=400) for p in prompts])
    assert [history[f"p{i}"]["predicted_tokens"] for i in range(2)] == expected
    assert all(h["output_tokens"] == 1 for h in history.values())


def test_cli_train_on_too_little_history_is_a_clear_error(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "history.jsonl").write_text("".join(
        json.dumps(_history_line(i, f"p{i}", i + 1)) + "\n" for i in range(7)))
    result = CliRunner().invoke(app, ["predictor", "train", "--history", str(run_dir), "--out",
                                      str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "7 usable records, at least 50" in result.output
    result = CliRunner().invoke(app, ["predictor", "train", "--history", str(tmp_path / "nope"),
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "no such run directory" in result.output
    a_file = tmp_path / "a-file"
    a_file.write_text("x")        # refused before any history is read or training runs
    result = CliRunner().invoke(app, ["predictor", "train", "--history", str(tmp_path / "nope"),
                                      "--out", str(a_file)])
    assert result.exit_code == 2 and "a file is there" in result.output
    result = CliRunner().invoke(app, ["predictor", "train", "--history", str(tmp_path / "nope"),
                                      "--out", str(a_file / "predictor")])
    assert result.exit_code == 2 and "is a file, so the directory cannot be made" in result.output
    assert not (tmp_path / "out").exists()      # nothing made for a train that did not run


def test_fine_tuned_top_layer_is_saved_and_reloaded(tmp_path):
    from safetensors.torch import load_file

    from batchinfer.predictors.bert import BertLengthPredictor
    from batchinfer.predictors.train import TrainConfig, train_predictor

    _synthetic_history(tmp_path / "history")
    data = read_history([tmp_path / "history"], need_text=True)
    trained = train_predictor(data.records, tmp_path / "p",
                              TrainConfig(epochs=1, train_layers=1, device="cpu"))
    keys = set(load_file(str(tmp_path / "p" / "weights.safetensors")))
    assert {k.split(".")[3] for k in keys if k.startswith("encoder.")} == {"5"}   # the top layer
    reloaded = BertLengthPredictor.load(tmp_path / "p", device="cpu")
    a, b = trained.model.state_dict(), reloaded.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    queries = [LengthQuery(r.prompt) for r in data.records[:8]]
    assert reloaded.predict(queries) == trained.predict(queries)


def test_shipped_predictor_tells_short_answers_from_long_ones():
    """predictors/shipped/smollm2-135m-instruct, trained on SmolLM2's own replies to the template
    prompts (examples/predictor_history), ShareGPT and HumanEval (examples/predictor_history_real;
    BIG-bench held out), loads offline and ranks unseen prompts sensibly."""
    repo = Path(__file__).resolve().parents[2]
    card = json.loads((repo / "predictors" / "shipped" / "smollm2-135m-instruct" / "predictor.json").read_text())
    assert card["data"]["records"] == 4126
    assert card["data"]["sources"] == ["examples/predictor_history", "examples/predictor_history_real"]
    assert card["data"]["prompt_sources"] == ["humaneval", "sharegpt", "templates"]   # no bigbench
    predictor = make_predictor(Recipe(predictor={
        "name": "bert", "path": str(repo / "predictors" / "shipped" / "smollm2-135m-instruct")}).predictor)
    short, long_ = predictor.predict([
        LengthQuery("What color is grass? Answer with one word.", max_tokens=512),
        LengthQuery("Write a detailed essay of at least five paragraphs about the history of "
                    "the printing press.", max_tokens=512)])
    assert short < 100 and long_ > 200      # class means: 25 / 100 vs 280 / 457 / 512
    # its card's cut outputs (461 at max_tokens 512): a request put in the top class is forecast
    # 512 within that cap and read past it when allowed more
    tail = predictor.cut_tail
    assert tail["cap"] == 512 and tail["cut_at"][4] == [[512.0, 461]]
    top = np.tile(np.eye(len(predictor.means))[-1], (3, 1))
    predictor.features = lambda texts: (None, top[:len(texts)])
    predictor.predict_class_ids = lambda texts: np.full(len(texts), len(predictor.means) - 1)
    queries = [LengthQuery("x", max_tokens=m) for m in (512, 1024, None)]
    past = [round(means_past_cap(predictor.means, tail, m)[-1]) for m in (1024, None)]
    assert [f.point for f in predictor.forecast_queries(queries)] == [512, *past]
    assert predictor.predict_queries(queries) == [512, *past]
    assert 700 < past[0] < 1024 and past[1] > past[0]


def test_a_run_learns_from_its_own_replies_online(tmp_path, tiny_recipe, shared_engine):
    """predictor.online (issue 43): a mean predictor that expects 30 tokens, in a job whose
    replies are 1 token long, forecasts the later requests shorter; online: false does not."""
    history_dir = tmp_path / "history"
    history_dir.mkdir()
    (history_dir / "history.jsonl").write_text("".join(
        json.dumps(_history_line(i, f"p{i}", 30)) + "\n" for i in range(4)))
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Question {i}?",
                                        "max_tokens": 12, "metadata": {"source": "web"}}) + "\n"
                            for i in range(48)))
    one_token = tiny_recipe.sampling.model_copy(
        update={"stop_token_ids": list(range(shared_engine.tokenizer.vocab_size))})
    # a strategy that reads no forecast still gets a named predictor (and so learns)
    settings = {"name": "mean", "path": str(history_dir), "online_refit_every": 4,
                "online_min_examples": 4}
    recipe = tiny_recipe.model_copy(update={"predictor": Recipe(predictor=settings).predictor,
                                            "sampling": one_token})
    _run(recipe, path, tmp_path / "run", shared_engine)
    history = _jsonl(tmp_path / "run" / "history.jsonl")
    assert all(h["output_tokens"] == 1 and h["source"] == "web" for h in history)
    predicted = {h["id"]: h["predicted_tokens"] for h in history}
    assert predicted["q0"] == 12 and predicted["q47"] < 12           # learned: shorter
    online = json.loads((tmp_path / "run" / "report.json").read_text()
                        )["session"]["predictor"]["online"]
    assert online["refits"] >= 1 and online["examples"] == 48 and online["timeline"]
    assert online["timeline"][-1]["error_online"] < online["timeline"][-1]["error_prior"]
    assert "Learning from the job" in (tmp_path / "run" / "report.md").read_text()

    off = recipe.model_copy(update={"predictor": Recipe(
        predictor={**settings, "online": False}).predictor})
    _run(off, path, tmp_path / "off", shared_engine)
    assert {h["predicted_tokens"] for h in _jsonl(tmp_path / "off" / "history.jsonl")} == {12}
    session = json.loads((tmp_path / "off" / "report.json").read_text())["session"]
    assert "online" not in session["predictor"]
