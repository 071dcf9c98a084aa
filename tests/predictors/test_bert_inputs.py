"""What the BERT length predictor's encoder reads and how it runs (predictors/bert.py): batches
bounded by their padded tokens, the two truncations of a long prompt (head, head_tail), and the
encoder's linears in int8 where the CPU has VNNI."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from batchinfer.predictors.bert import (PADDED_TOKENS_PER_BATCH, Tokenized, head_and_tail,
                                        load_encoder)


class _Lengths(Tokenized):
    """A Tokenized with given lengths, no tokenizer (sorted_batches reads only the lengths)."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, dtype=np.int64)


@pytest.fixture(scope="module")
def encoder():
    return load_encoder()


def test_head_and_tail_keeps_both_ends_and_the_special_tokens():
    ids = [101, *range(1, 21), 102]                      # [CLS] 1..20 [SEP]
    assert head_and_tail(ids, 22) == ids                 # fits: unchanged
    assert head_and_tail(ids, 30) == ids
    assert head_and_tail(ids, 10) == [101, 1, 2, 3, 4, 17, 18, 19, 20, 102]
    assert head_and_tail(ids, 9) == [101, 1, 2, 3, 4, 18, 19, 20, 102]   # the start gets the odd
    assert head_and_tail(ids, 3) == [101, 1, 102]
    assert head_and_tail(ids, 2) == [101, 102]


def test_sorted_batches_bound_padded_tokens_and_cover_every_row_once():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(400, 513, 10), rng.integers(5, 60, 90)])
    rng.shuffle(lengths)
    tokens = _Lengths(lengths)
    batches = tokens.sorted_batches(64, 1024)
    seen = np.concatenate(batches)
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    assert list(lengths[seen]) == sorted(lengths, reverse=True)          # longest first
    for batch in batches[:-1]:                         # each as full as the bounds allow
        assert len(batch) == min(64, 1024 // lengths[batch].max())
    assert len(batches[0]) == 2 and len(batches) < 20   # 64 rows of 512 would pad 16x more
    fixed = tokens.sorted_batches(64)                 # no budget: rows only, as before
    assert [len(b) for b in fixed] == [64, 36]
    assert len(_Lengths([2000, 3]).sorted_batches(8, 1024)[0]) == 1   # one row over budget runs


def test_batched_features_equal_one_prompt_at_a_time(encoder):
    """Padding and the batch it lands in do not change a prompt's forecast inputs."""
    from batchinfer.predictors.bert import BertLengthClassifier, LengthHead, pooled_states

    model, tokenizer = encoder
    torch.manual_seed(0)
    clf = BertLengthClassifier(model, LengthHead(int(model.config.hidden_size), 3))
    texts = ["Say yes.", "Write a poem about the sea, " * 40, "List three colours.",
             "Explain photosynthesis step by step, in detail. " * 12, "Hi"]
    tokens = Tokenized(tokenizer, texts, 256)
    assert len(tokens.sorted_batches(64, PADDED_TOKENS_PER_BATCH["cpu"])) > 1
    together = pooled_states(clf, tokens, 64, torch.device("cpu"))
    alone = torch.cat([pooled_states(clf, Tokenized(tokenizer, [t], 256), 1,
                                     torch.device("cpu")) for t in texts])
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=1e-4)


def test_inputs_the_encoder_reads_alike_are_encoded_once(encoder):
    """A duplicate, and prompts whose first max_length tokens agree (a long shared preamble under
    `head`), are one encoder row each; every text still gets its state, in input order."""
    from batchinfer.predictors.bert import BertLengthClassifier, LengthHead, pooled_states

    model, tokenizer = encoder
    torch.manual_seed(0)
    clf = BertLengthClassifier(model, LengthHead(int(model.config.hidden_size), 3))
    preamble = "Answer the question as the examples do. Q: what is two and two? A: four. " * 8
    texts = [preamble + "Q: what is the capital of France?", "Say yes.",
             preamble + "Q: how many legs has a spider?", "Say yes.", "List three colours."]
    tokens = Tokenized(tokenizer, texts, 64)
    assert tokens.ids[0] == tokens.ids[2] and tokens.ids[1] == tokens.ids[3]
    unique, inverse = tokens.distinct()
    assert len(unique) == 3 and inverse.tolist() == [0, 1, 0, 1, 2]
    encoded = []
    pooled = clf.pooled
    clf.pooled = lambda ids, mask: encoded.append(len(ids)) or pooled(ids, mask)
    states = pooled_states(clf, tokens, 64, torch.device("cpu"))
    assert sum(encoded) == 3 and states.shape == (5, model.config.hidden_size)
    del clf.pooled
    alone = torch.cat([pooled_states(clf, Tokenized(tokenizer, [t], 64), 1, torch.device("cpu"))
                       for t in texts])
    torch.testing.assert_close(states, alone, atol=1e-4, rtol=1e-4)
    distinct = Tokenized(tokenizer, ["Say yes.", "List three colours."], 64)
    assert distinct.distinct()[0] is distinct                  # nothing shared: no copy


def test_truncations_of_a_long_prompt(encoder):
    _, tokenizer = encoder
    long_text = "filler words here " * 200 + "summarise the above in one sentence"
    short_text = "What colour is grass?"
    head = Tokenized(tokenizer, [long_text, short_text], 64, "head")
    both = Tokenized(tokenizer, [long_text, short_text], 64, "head_tail")
    assert head.lengths[0] == both.lengths[0] == 64
    assert head.ids[1] == both.ids[1] == tokenizer(short_text)["input_ids"]   # fits: unchanged
    ending = tokenizer("summarise the above in one sentence", add_special_tokens=False)[
        "input_ids"]
    assert both.ids[0][-1 - len(ending):-1] == ending and ending[-1] not in head.ids[0]
    assert head.ids[0][:30] == both.ids[0][:30]
    with pytest.raises(ValueError, match="head, head_tail"):
        Tokenized(tokenizer, [short_text], 64, "tail")


def test_a_predictor_reads_as_its_card_says(tmp_path):
    """The shipped predictor reads 256 tokens from the start; a card without `truncation` (made
    before it existed) reads from the start too."""
    from batchinfer.predictors.bert import BertLengthPredictor

    shipped = SHIPPED
    card = json.loads((shipped / "predictor.json").read_text())
    assert card["encoder"]["max_length"] == 256 and card["encoder"]["truncation"] == "head"
    old = tmp_path / "old"
    old.mkdir()
    del card["encoder"]["truncation"]
    (old / "predictor.json").write_text(json.dumps(card))
    (old / "weights.safetensors").write_bytes((shipped / "weights.safetensors").read_bytes())
    predictor = BertLengthPredictor.load(old, device="cpu")
    assert (predictor.max_length, predictor.truncation) == (256, "head")


SHIPPED = Path(__file__).resolve().parents[2] / "predictors" / "shipped" / "smollm2-135m-instruct"
PROMPTS = ["What colour is grass? One word.", "Write a long essay on the printing press.",
           "Translate 'good morning' into French.", "List ten prime numbers.",
           "Explain, step by step and in detail, how a compiler turns source code into a program, "
           "with examples of each stage. " * 3, "Summarise the plot of Hamlet in two sentences."]


def test_int8_encoder_stays_close_to_fp32():
    from batchinfer.predictors.bert import BertLengthPredictor, encoder_int8_missing

    why_not = encoder_int8_missing(torch.device("cpu"))
    if why_not:
        pytest.skip(f"int8 encoder: {why_not}")
    fp32 = BertLengthPredictor.load(SHIPPED, device="cpu")
    int8 = BertLengthPredictor.load(SHIPPED, device="cpu", encoder_int8=True)
    assert not fp32.encoder_int8 and int8.encoder_int8
    assert int8.describe()["encoder"] == "256 tokens, int8 linears, fp32 attention"
    linears = [m for m in int8.model.encoder.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == []                                   # every encoder linear swapped
    assert isinstance(int8.model.head.fc1, torch.nn.Linear)   # the head stays fp32
    f32, p32 = fp32.features(PROMPTS)
    f8, p8 = int8.features(PROMPTS)
    assert np.linalg.norm(f8 - f32) / np.linalg.norm(f32) < 0.1
    assert np.abs(p8 - p32).max() < 0.15
    assert not np.array_equal(f8, f32)                      # it did run the int8 kernel


def test_int8_encoder_where_the_cpu_cannot(monkeypatch):
    from batchinfer.predictors import PredictorError
    from batchinfer.predictors import bert

    monkeypatch.setattr(bert, "encoder_int8_missing",
                        lambda device: "this CPU lacks avx512_vnni")
    auto = bert.BertLengthPredictor.load(SHIPPED, device="cpu", encoder_int8="auto")
    assert not auto.encoder_int8
    assert auto.describe()["encoder"].startswith("256 tokens, fp32 linears")
    with pytest.raises(PredictorError, match="encoder_int8: true, but this CPU lacks "
                                             "avx512_vnni; set it to auto or false"):
        bert.BertLengthPredictor.load(SHIPPED, device="cpu", encoder_int8=True)


def test_bf16_attention_stays_close_to_fp32():
    from batchinfer.predictors.bert import BertLengthPredictor
    from batchinfer.predictors.cls_encoder import bidirectional_attention_missing

    fp32 = BertLengthPredictor.load(SHIPPED, device="cpu")
    why_not = bidirectional_attention_missing(fp32.model.encoder, torch.device("cpu"))
    if why_not:
        pytest.skip(f"bf16 encoder attention: {why_not}")
    bf16 = BertLengthPredictor.load(SHIPPED, device="cpu", encoder_bf16_attention=True)
    assert not fp32.model.kernels.bf16_attention and bf16.model.kernels.bf16_attention
    assert bf16.describe()["encoder"] == "256 tokens, fp32 linears, bf16 attention"
    f32, p32 = fp32.features(PROMPTS)
    f16, p16 = bf16.features(PROMPTS)
    assert np.linalg.norm(f16 - f32) / np.linalg.norm(f32) < 0.02
    assert np.abs(p16 - p32).max() < 0.05
    assert not np.array_equal(f16, f32)                     # it did run the bf16 kernel


def test_bf16_attention_where_the_cpu_cannot(monkeypatch):
    from batchinfer.predictors import PredictorError
    from batchinfer.predictors import bert

    monkeypatch.setattr(bert, "bidirectional_attention_missing",
                        lambda encoder, device: "this CPU lacks AVX512-BF16")
    auto = bert.BertLengthPredictor.load(SHIPPED, device="cpu", encoder_bf16_attention="auto")
    assert not auto.model.kernels.bf16_attention
    assert auto.describe()["encoder"].endswith("fp32 attention")
    with pytest.raises(PredictorError, match="encoder_bf16_attention: true, but this CPU lacks "
                                             "AVX512-BF16; set it to auto or false"):
        bert.BertLengthPredictor.load(SHIPPED, device="cpu", encoder_bf16_attention=True)


def test_bf16_attention_is_never_built_for_where_the_flags_rule_it_out(monkeypatch):
    """An AVX2 or AMX host never builds the kernels for the bf16 attention; a mean-pooling
    predictor never asks."""
    from batchinfer.engine import host_cpu
    from batchinfer.engine import kernels as native
    from batchinfer.predictors.bert import load_encoder
    from batchinfer.predictors.cls_encoder import bidirectional_attention_missing

    encoder, _ = load_encoder()
    monkeypatch.setattr(native, "load_native_kernels",
                        lambda: pytest.fail("built the kernels for nothing"))
    for flags in ({"avx2", "fma"}, {"avx512f", "avx512_bf16", "amx_bf16"}):
        monkeypatch.setattr(host_cpu, "cpu_identity", lambda flags=flags: ("a CPU", frozenset(flags)))
        assert "lacks AVX512-BF16, or has AMX" in bidirectional_attention_missing(encoder, "cpu")
    assert "runs on CPU only" in bidirectional_attention_missing(encoder, "cuda")
    from batchinfer.predictors import bert

    monkeypatch.setattr(bert, "bidirectional_attention_missing",
                        lambda *args: pytest.fail("asked for a mean-pooling predictor"))
    mean = bert.BertLengthClassifier(encoder, bert.LengthHead(int(encoder.config.hidden_size), 2),
                                     pooling="mean")
    card = {"classes": {"means": [10.0, 100.0], "edges": [0, 50, 1000]},
            "encoder": {"max_length": 64}}
    predictor = bert.BertLengthPredictor(mean, None, card, device="cpu",
                                         encoder_bf16_attention="auto")
    assert predictor.model.kernels == bert.EncoderKernels()
    with pytest.raises(bert.PredictorError, match="this predictor pools by mean"):
        bert.BertLengthPredictor(mean, None, card, device="cpu", encoder_bf16_attention=True)


def test_a_cpu_without_the_instructions_never_builds_kernels_for_the_predictor(monkeypatch):
    """On an AVX2 host the `auto` predictor is torch's fp32 throughout: nothing is built for it."""
    from batchinfer.engine import host_cpu
    from batchinfer.engine import kernels as native
    from batchinfer.engine.model import int8_linear
    from batchinfer.predictors.bert import BertLengthPredictor

    avx2 = lambda: ("an AVX2 CPU", frozenset({"avx2", "fma"}))  # noqa: E731
    monkeypatch.setattr(host_cpu, "cpu_identity", avx2)
    monkeypatch.setattr(int8_linear, "cpu_identity", avx2)
    monkeypatch.setattr(native, "load_native_kernels",
                        lambda: pytest.fail("built the kernels for nothing"))
    auto = BertLengthPredictor.load(SHIPPED, device="cpu", encoder_int8="auto",
                                    encoder_bf16_attention="auto")
    assert not auto.encoder_int8
    assert auto.model.kernels == bert_kernels_off()


def bert_kernels_off():
    from batchinfer.predictors.cls_encoder import EncoderKernels

    return EncoderKernels(bf16_attention=False, add_layer_norm=False)


def test_recipe_key_reaches_the_predictor(monkeypatch):
    from batchinfer.predictors import bert, make_predictor
    from batchinfer.runner.recipe import Recipe

    seen = []
    monkeypatch.setattr(bert.BertLengthPredictor, "load", classmethod(
        lambda cls, path, **kw: seen.append((kw["encoder_int8"], kw["encoder_bf16_attention"]))))
    for value, expected in (("auto", "auto"), (False, False), (True, True)):
        make_predictor(Recipe(predictor={"name": "bert", "path": str(SHIPPED),
                                         "encoder_int8": value}).predictor)
        assert seen[-1] == (expected, "auto")
        make_predictor(Recipe(predictor={"name": "bert", "path": str(SHIPPED),
                                         "encoder_bf16_attention": value}).predictor)
        assert seen[-1] == ("auto", expected)
    predictor = Recipe(predictor={"name": "bert", "path": str(SHIPPED)}).predictor
    assert predictor.encoder_int8 == "auto" and predictor.encoder_bf16_attention == "auto"
