"""The embedding engine (model.task: embed) against transformers' own arithmetic, written here
independently: the shipped all-MiniLM-L6-v2 as sentence-transformers computes it (AutoModel, mean
over the attention mask, L2 normalize), and a tiny random Qwen3 decoder's last real token after
the final norm (LAST pooling); matryoshka dimensions (cut, then normalized, as vLLM's pooler
head); the pooler's resolution from a model's files; the refusals."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchinfer.engine.config import EngineConfig, ModelConfig
from batchinfer.engine.embedding.engine import EmbeddingEngine, pick_batch
from batchinfer.engine.embedding.model_source import default_embed_model_dir
from batchinfer.engine.embedding.pooler_config import PoolerConfig, resolve_pooling
from batchinfer.engine.embedding.request import EmbeddingRequest
from batchinfer.engine.errors import ConfigError, RequestError

from tests.tiny_families import hf_model, save_model, tokenizer_dir

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "hi",
         "A considerably longer sentence, about embeddings, batching and the padding that "
         "batching adds to the shorter rows of a batch."]


@pytest.fixture(scope="module")
def minilm():
    return EmbeddingEngine.from_config(EngineConfig(model=ModelConfig(task="embed")))


def minilm_by_hand(texts: list[str]) -> torch.Tensor:
    """sentence-transformers' all-MiniLM-L6-v2 arithmetic: token embeddings averaged over the
    attention mask, then L2-normalized (its modules: Transformer, Pooling mean, Normalize)."""
    from transformers import AutoModel, AutoTokenizer

    path = default_embed_model_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return F.normalize(mean, p=2, dim=1)


def test_minilm_equals_sentence_transformers_arithmetic_batched_and_alone(minilm):
    expected = minilm_by_hand(TEXTS)
    batched = torch.tensor(minilm.embed(TEXTS))
    assert batched.shape == (4, 384)
    assert torch.allclose(batched, expected, atol=1e-5), (batched - expected).abs().max()
    alone = torch.tensor([minilm.embed([text])[0] for text in TEXTS])
    assert torch.allclose(alone, batched, atol=1e-6), (alone - batched).abs().max()
    assert minilm.info["pooler"]["pooling_type"] == "MEAN"
    assert minilm.info["pooler"]["sources"]["use_activation"] == "sentence_transformers"
    assert minilm.max_model_len == 256          # sentence_bert_config.json's max_seq_length


def test_the_package_root_exports_the_embedding_engine(minilm):
    """The Python API's names (batchinfer.EmbeddingEngine & co., api/__init__.py's docstring
    example) are the engine's own."""
    import batchinfer

    assert batchinfer.EmbeddingEngine is EmbeddingEngine and isinstance(minilm, batchinfer.EmbeddingEngine)
    assert {"EmbeddingEngine", "EmbeddingRequest", "EmbeddingOutput"} <= set(batchinfer.__all__)
    assert batchinfer.EmbeddingOutput.__module__ == "batchinfer.engine.embedding.request"


def test_one_request_of_several_inputs_finishes_once_with_each_in_order(minilm):
    ids = [minilm.tokenizer.encode(t) for t in TEXTS]
    minilm.drain_step_events()
    minilm.max_num_batched_tokens = 40          # several steps, the inputs split over them
    try:
        minilm.add_request(EmbeddingRequest("many", ids))
        minilm.add_request(EmbeddingRequest("one", [ids[2]]))
        outs = []
        while minilm.has_unfinished():
            outs += minilm.step()
    finally:
        minilm.max_num_batched_tokens = 2048
    by_id = {o.request_id: o for o in outs}
    assert sorted(by_id) == ["many", "one"] and len(outs) == 2
    assert by_id["many"].num_prompt_tokens == sum(map(len, ids))
    expected = minilm_by_hand(TEXTS)
    assert torch.allclose(torch.tensor(by_id["many"].embeddings), expected, atol=1e-5)
    events = minilm.drain_step_events()
    assert len(events) > 1
    assert all(e["padded_tokens"] <= 40 or e["num_seqs"] == 1 for e in events)


def test_prompt_too_long_and_token_ids_outside_the_vocabulary_are_refused(minilm):
    with pytest.raises(RequestError) as exc:
        minilm.add_request(EmbeddingRequest("long", [[101] + [1000] * 300 + [102]]))
    assert exc.value.code == "prompt_too_long"
    assert "302 tokens" in exc.value.message and "256" in exc.value.message
    with pytest.raises(RequestError) as exc:
        minilm.add_request(EmbeddingRequest("oov", [[101, 99999, 102]]))
    assert "99999" in exc.value.message
    with pytest.raises(RequestError) as exc:      # all-MiniLM is no matryoshka model
        minilm.add_request(EmbeddingRequest("dims", [[101, 102]], dimensions=8))
    assert exc.value.code == "invalid_dimensions" and "matryoshka" in exc.value.message
    assert not minilm.has_unfinished()


def test_pick_batch_grows_around_the_oldest_shorter_first_within_the_budget():
    lengths = [3, 4, 5, 10, 10, 50]
    orders = [5, 4, 3, 0, 2, 1]       # the first 10 is the oldest
    assert pick_batch(lengths, orders, max_tokens=40, max_rows=8) == [0, 1, 2, 3]
    assert pick_batch(lengths, orders, max_tokens=50, max_rows=8) == [0, 1, 2, 3, 4]
    assert pick_batch(lengths, orders, max_tokens=50, max_rows=2) == [2, 3]
    assert pick_batch(lengths, [1, 2, 3, 4, 5, 0], max_tokens=10, max_rows=8) == [5]  # alone


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """A tiny random Qwen3 decoder saved with a 4-way matryoshka config and no sentence-
    transformers files: LAST pooling, normalized, by the architecture's default."""
    model = hf_model("qwen3", seed=3).eval()
    directory = save_model(model, tmp_path_factory.mktemp("qwen3-embed"), tokenizer_dir())
    config = json.loads((directory / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, 64]
    (directory / "config.json").write_text(json.dumps(config))
    return directory, model


def _reference_hidden(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt alone through transformers' base model: the final norm's output."""
    out = []
    with torch.no_grad():
        for ids in prompts:
            out.append(model.model(input_ids=torch.tensor([ids])).last_hidden_state[0])
    return out


def test_tiny_decoder_last_pooling_equals_transformers_last_token(tiny_qwen3):
    directory, model = tiny_qwen3
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 9, 30)]
    engine = EmbeddingEngine.from_config(EngineConfig(model=ModelConfig(
        task="embed", path=str(directory))))
    assert engine.pooling.pooling_type == "LAST" and engine.pooling.use_activation
    got = torch.tensor(engine.embed(prompts))
    hidden = _reference_hidden(model, prompts)
    expected = torch.stack([F.normalize(h[-1], dim=-1) for h in hidden])
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    # matryoshka: the first 16 values, then normalized (vLLM's head: cut before the activation)
    cut = torch.tensor(engine.embed(prompts, dimensions=16))
    assert torch.allclose(cut, torch.stack([F.normalize(h[-1][:16], dim=-1) for h in hidden]),
                          atol=1e-5)
    assert not torch.allclose(cut, expected[:, :16], atol=1e-3)   # (not a cut of the unit one)
    with pytest.raises(RequestError, match=r"matryoshka dimensions \[16, 32, 64\], got 24"):
        engine.add_request(EmbeddingRequest("x", [[5, 6]], dimensions=24))


def test_tiny_decoder_mean_pooling_unnormalized_from_the_recipe(tiny_qwen3):
    directory, model = tiny_qwen3
    prompts = [[7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17, 18]]
    engine = EmbeddingEngine.from_config(EngineConfig(model=ModelConfig(
        task="embed", path=str(directory),
        pooler_config={"pooling_type": "MEAN", "use_activation": False, "dimensions": 32})))
    got = torch.tensor(engine.embed(prompts))
    expected = torch.stack([h.mean(0)[:32] for h in _reference_hidden(model, prompts)])
    assert got.shape == (3, 32)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def _copy_minilm_files(tmp_path: Path, modules: list[dict], pooling: dict = None) -> Path:
    src = default_embed_model_dir()
    shutil.copy(src / "config.json", tmp_path / "config.json")
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_pooler_resolution_sentence_transformers_then_architecture_then_recipe(tmp_path):
    st = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
          {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    bert = json.loads((default_embed_model_dir() / "config.json").read_text())
    # no Normalize module: not normalized, as vLLM reads modules.json; cls_token: CLS
    (tmp_path / "a").mkdir()
    folder = _copy_minilm_files(tmp_path / "a", st, {"pooling_mode_cls_token": True,
                                                     "pooling_mode_mean_tokens": False})
    pooling = resolve_pooling(folder, bert, None)
    assert (pooling.pooling_type, pooling.use_activation) == ("CLS", False)
    (tmp_path / "b").mkdir()
    pooling = resolve_pooling(tmp_path / "b", bert, None)        # no files: the architecture's
    assert (pooling.pooling_type, pooling.use_activation) == ("CLS", True)
    pooling = resolve_pooling(tmp_path / "b", {"model_type": "qwen3", "hidden_size": 64}, None)
    assert pooling.pooling_type == "LAST"
    pooling = resolve_pooling(folder, bert, PoolerConfig(pooling_type="MEAN",
                                                         use_activation=True))
    assert (pooling.pooling_type, pooling.use_activation) == ("MEAN", True)
    assert pooling.sources == {"pooling_type": "recipe", "use_activation": "recipe"}
    with pytest.raises(ConfigError, match="model.pooler_config.dimensions: the model does not "
                                          "support matryoshka"):
        resolve_pooling(folder, bert, PoolerConfig(dimensions=8))
    with pytest.raises(ConfigError, match=r"must be in \[1, 384\]"):
        resolve_pooling(folder, {**bert, "is_matryoshka": True}, PoolerConfig(dimensions=400))
    (tmp_path / "c").mkdir()
    dense = _copy_minilm_files(tmp_path / "c", st + [
        {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
        {"pooling_mode_mean_tokens": True})
    with pytest.raises(ConfigError, match="Dense are not supported"):
        resolve_pooling(dense, bert, None)


def test_pooling_settings_beside_the_mode_and_modes_batchinfer_cannot_pool(tmp_path):
    """A Pooling config's other keys (include_prompt: true, as Qwen3-Embedding's) are no mode;
    a max / weightedmean mode is refused unless the recipe names the pooling; a modules.json
    without a Pooling module decides nothing (vLLM: the pooler's default, normalized)."""
    st = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
          {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
          {"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    qwen3 = {"model_type": "qwen3", "hidden_size": 64}
    (tmp_path / "a").mkdir()
    folder = _copy_minilm_files(tmp_path / "a", st, {
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True,
        "include_prompt": True})
    pooling = resolve_pooling(folder, qwen3, None)
    assert (pooling.pooling_type, pooling.use_activation) == ("LAST", True)
    assert pooling.sources["pooling_type"] == "sentence_transformers"
    (tmp_path / "b").mkdir()
    folder = _copy_minilm_files(tmp_path / "b", st, {"pooling_mode_max_tokens": True,
                                                     "pooling_mode_mean_tokens": True})
    with pytest.raises(ConfigError, match="pooling mode 'pooling_mode_max_tokens' is not "
                                          "supported; set model.pooler_config.pooling_type"):
        resolve_pooling(folder, qwen3, None)
    pooling = resolve_pooling(folder, qwen3, PoolerConfig(pooling_type="MEAN"))
    assert (pooling.pooling_type, pooling.use_activation) == ("MEAN", True)
    (tmp_path / "c").mkdir()
    folder = _copy_minilm_files(tmp_path / "c", [st[0]])       # no Normalize, no Pooling
    pooling = resolve_pooling(folder, qwen3, None)
    assert (pooling.pooling_type, pooling.use_activation) == ("LAST", True)
    assert pooling.sources == {"pooling_type": "model_default", "use_activation": "model_default"}


def test_a_decoder_configured_bidirectional_is_refused_not_run_causally(tiny_qwen3, tmp_path):
    """vLLM runs a decoder whose config says is_causal: false bidirectionally, pooling LAST
    still (the architecture's); transformers' AutoModel would run it causally: the embedding
    engine refuses it by name (strategy vllm's pooling resolution still reads LAST)."""
    directory, _ = tiny_qwen3
    config = json.loads((directory / "config.json").read_text())
    bidirectional = tmp_path / "bidirectional"
    shutil.copytree(directory, bidirectional)
    (bidirectional / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    assert resolve_pooling(bidirectional, {**config, "is_causal": False},
                           None).pooling_type == "LAST"
    with pytest.raises(ConfigError, match="'qwen3' decoder sets is_causal: false"):
        EmbeddingEngine.from_config(EngineConfig(model=ModelConfig(
            task="embed", path=str(bidirectional))))


def test_max_model_len_past_the_models_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model.max_model_len: 1024 is more than the model "
                                          r"takes \(256 tokens\)"):
        EmbeddingEngine.from_config(EngineConfig(model=ModelConfig(task="embed",
                                                                   max_model_len=1024)))
