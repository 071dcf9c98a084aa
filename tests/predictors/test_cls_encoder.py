"""The encoder's [CLS]-only forward (predictors/cls_encoder.py) against transformers' own forward:
the same [CLS] state on padded batches, and transformers' forward wherever it does not apply."""
from __future__ import annotations

import pytest
import torch

from batchinfer.predictors import bert
from batchinfer.predictors.bert import (BertLengthClassifier, LengthHead, Tokenized, load_encoder,
                                        pooled_states)
from batchinfer.predictors.cls_encoder import (EncoderKernels, add_layer_norm_missing, cls_states,
                                               fuse_attention_projections, reads_cls_alone)


def _small_bert(**overrides):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=97, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=96, max_position_embeddings=64, **overrides)
    return BertModel(config).eval()


def _transformers_cls(encoder, ids, mask):
    with torch.no_grad():
        return encoder(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]


def _padded_batch(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=gen)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


@pytest.mark.parametrize("lengths", [[9], [17, 3, 11, 1], [40, 40]])
def test_cls_state_equals_transformers_on_padded_rows(lengths):
    encoder = _small_bert()
    ids, mask = _padded_batch(lengths, encoder.config.vocab_size)
    assert reads_cls_alone(encoder)
    with torch.no_grad():
        got = cls_states(encoder, ids, mask)
    torch.testing.assert_close(got, _transformers_cls(encoder, ids, mask), atol=2e-5, rtol=2e-5)


def test_other_embeddings_take_their_own_forward():
    """RoBERTa counts positions from its padding id: its embeddings keep their own forward."""
    from transformers import RobertaConfig, RobertaModel

    torch.manual_seed(0)
    encoder = RobertaModel(RobertaConfig(vocab_size=97, hidden_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=96,
                                         max_position_embeddings=70, pad_token_id=1)).eval()
    assert reads_cls_alone(encoder)
    ids, mask = _padded_batch([17, 3, 11], encoder.config.vocab_size)
    ids = torch.where(mask.bool(), ids.clamp(min=2), torch.ones_like(ids))   # pad id 1
    with torch.no_grad():
        got = cls_states(encoder, ids, mask)
    torch.testing.assert_close(got, _transformers_cls(encoder, ids, mask), atol=2e-5, rtol=2e-5)


def test_shipped_encoder_cls_state_equals_transformers():
    """all-MiniLM-L6-v2 on real text, padded batch: the predictor's features are unchanged."""
    encoder, tokenizer = load_encoder()
    texts = ["Say yes.", "Explain photosynthesis step by step, in detail. " * 12, "Hi there"]
    tokens = Tokenized(tokenizer, texts, 256)
    ids, mask = tokens.batch(list(range(len(texts))), torch.device("cpu"))
    assert mask.sum(1).min() < mask.shape[1]                   # some rows are padded
    with torch.no_grad():
        got = cls_states(encoder, ids, mask)
    torch.testing.assert_close(got, _transformers_cls(encoder, ids, mask), atol=1e-5, rtol=1e-5)


def test_native_add_layer_norm_keeps_the_cls_state():
    """The residual steps in one pass (add_layer_norm) give transformers' state to fp32 rounding;
    the torch path (the default) is exercised by the tests above whatever the process loaded."""
    why_not = add_layer_norm_missing(torch.device("cpu"))
    if why_not:
        pytest.skip(why_not)
    encoder = _small_bert()
    ids, mask = _padded_batch([17, 3, 11, 1], encoder.config.vocab_size)
    with torch.no_grad():
        got = cls_states(encoder, ids, mask, EncoderKernels(add_layer_norm=True))
        plain = cls_states(encoder, ids, mask)
    torch.testing.assert_close(got, _transformers_cls(encoder, ids, mask), atol=2e-5, rtol=2e-5)
    assert not torch.equal(got, plain)              # it did take the kernel


def test_fused_projections_give_the_three_projections():
    """Each layer's q, k, v (and the last layer's k, v) from one stacked linear: int8 per output
    channel and per token makes them the separate linears' bit for bit; fp32 to rounding."""
    encoder = _small_bert()
    ids, mask = _padded_batch([17, 3, 11, 1], encoder.config.vocab_size)
    with torch.no_grad():
        separate = cls_states(encoder, ids, mask)
        fuse_attention_projections(encoder, lambda linear: linear)
        attentions = [layer.attention.self for layer in encoder.encoder.layer]
        assert all(hasattr(a, "fused_qkv") and not hasattr(a, "fused_kv") for a in attentions[:-1])
        assert hasattr(attentions[-1], "fused_kv") and not hasattr(attentions[-1], "fused_qkv")
        torch.testing.assert_close(cls_states(encoder, ids, mask), separate, atol=2e-5, rtol=2e-5)
    from batchinfer.engine.model.int8_linear import Int8Linear, int8_kernel_available

    if not int8_kernel_available():
        return
    int8 = _small_bert()
    fuse_attention_projections(int8, Int8Linear)
    attentions = [layer.attention.self for layer in int8.encoder.layer]
    for attention in attentions:
        for name in ("query", "key", "value"):
            setattr(attention, name, Int8Linear(getattr(attention, name)))
    with torch.no_grad():
        fused = cls_states(int8, ids, mask)
        for attention in attentions[:-1]:
            del attention.fused_qkv
        del attentions[-1].fused_kv
        assert torch.equal(fused, cls_states(int8, ids, mask))


def test_classifier_takes_the_cls_path_in_eval_only(monkeypatch):
    """Inference reads [CLS] alone; training (dropout, fine-tuned layers) keeps transformers'
    forward; mean pooling needs every token's state."""
    encoder = _small_bert()
    ids, mask = _padded_batch([5, 2], encoder.config.vocab_size)
    calls = []
    monkeypatch.setattr(bert, "cls_states", lambda *a: calls.append(a) or torch.zeros(2, 48))
    clf = BertLengthClassifier(encoder, LengthHead(48, 3)).eval()
    clf.pooled(ids, mask)
    assert len(calls) == 1
    clf.train()
    clf.pooled(ids, mask)
    clf.eval()
    BertLengthClassifier(encoder, LengthHead(48, 3), pooling="mean").eval().pooled(ids, mask)
    assert len(calls) == 1


@pytest.mark.parametrize("overrides", [{"position_embedding_type": "relative_key"},
                                       {"is_decoder": True}])
def test_encoders_it_does_not_describe_keep_transformers_forward(overrides):
    encoder = _small_bert(**overrides)
    assert not reads_cls_alone(encoder)
    clf = BertLengthClassifier(encoder, LengthHead(48, 3)).eval()
    ids, mask = _padded_batch([6, 4], encoder.config.vocab_size)
    tokens = _FixedBatch(ids, mask)
    states = pooled_states(clf, tokens, 8, torch.device("cpu"))
    torch.testing.assert_close(states, _transformers_cls(encoder, ids, mask))


class _FixedBatch(Tokenized):
    """A Tokenized holding one given padded batch."""

    def __init__(self, ids, mask):
        self.ids_, self.mask_ = ids, mask
        self.lengths = mask.sum(1).numpy()
        self.ids = [row[:n].tolist() for row, n in zip(ids, self.lengths)]

    def __len__(self):
        return len(self.lengths)

    def sorted_batches(self, batch_size, budget=None):
        return [list(range(len(self)))]

    def batch(self, index, device):
        return self.ids_[index].to(device), self.mask_[index].to(device)
