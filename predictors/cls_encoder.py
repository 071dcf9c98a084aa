"""The encoder's forward when only the [CLS] state is read (`pooling: cls`, the shipped predictors').

A BERT's last layer turns every token's state into the next one, but `cls` pooling reads one row
of its output. There the last layer needs keys and values for every token and the rest of its
work (the query, the attention, the output projection, the feed-forward) for [CLS] alone: on
all-MiniLM-L6-v2 five sixths of one layer in six, ~14% of the encoder's linear work. And the
linears, norms and activations run on the batch's real tokens only (attention pads them back):
batches sorted by length still carried ~10% padding on real prompts. Together 0.86x the
encoder's time on 120 ShareGPT prompts (performance.md), the same [CLS] state to fp32 rounding
(tests/predictors/test_cls_encoder.py).

Written over the layers' weights by BERT's submodule names (unchanged since the original), not
through transformers' forward, whose mask and return conventions changed across the versions
the project admits. Encoders it does not describe (relative position embeddings, decoders) take
transformers' forward (`reads_cls_alone`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def reads_cls_alone(encoder: nn.Module) -> bool:
    """Whether `cls_states` computes this encoder: a bidirectional BERT with absolute positions."""
    config = getattr(encoder, "config", None)
    layers = getattr(getattr(encoder, "encoder", None), "layer", None)
    return (config is not None and layers is not None and len(layers) > 0
            and getattr(config, "position_embedding_type", "absolute") in (None, "absolute")
            and not getattr(config, "is_decoder", False)
            and not getattr(config, "add_cross_attention", False)
            and all(hasattr(layer, name) for layer in layers
                    for name in ("attention", "intermediate", "output")))


def cls_states(encoder: nn.Module, input_ids: torch.Tensor,
               attention_mask: torch.Tensor) -> torch.Tensor:
    """The last layer's [CLS] state of each row, [batch, hidden] (eval mode: no dropout). Rows are
    padded on the right (bert.Tokenized.batch), [CLS] first, as transformers' `[:, 0]` reads it."""
    rows = _Rows(attention_mask.bool())
    heads = int(encoder.config.num_attention_heads)
    embedded = encoder.embeddings(input_ids=input_ids)   # token type 0, absolute positions
    states = embedded.reshape(-1, embedded.shape[-1])[rows.real]       # [tokens, hidden]
    layers = encoder.encoder.layer
    for layer in layers[:-1]:
        states = _layer(layer, states, states, rows, heads, cls_alone=False)
    return _layer(layers[-1], states[rows.cls], states, rows, heads, cls_alone=True)


class _Rows:
    """Where a padded batch's real tokens are: the linears run on those alone ([tokens, hidden],
    the padding never computed), attention on them padded back to [batch, width]."""

    def __init__(self, mask: torch.Tensor):
        self.batch, self.width = mask.shape
        self.real = mask.reshape(-1).nonzero().squeeze(1)       # flat padded index of each token
        lengths = mask.sum(1)
        self.cls = torch.cumsum(lengths, 0) - lengths           # each row's [CLS] among tokens
        self.keys = mask[:, None, None, :]                      # attends to: True takes part

    def padded(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[tokens, hidden] -> [batch, heads, width, hidden / heads], zeros at the padding."""
        out = x.new_zeros(self.batch * self.width, x.shape[-1])
        out[self.real] = x
        return out.view(self.batch, self.width, heads, -1).transpose(1, 2)


def _layer(layer: nn.Module, queries: torch.Tensor, states: torch.Tensor, rows: _Rows,
           heads: int, cls_alone: bool) -> torch.Tensor:
    """One BERT layer's output at the `queries` (post-norm): every token's, or (`cls_alone`) each
    row's [CLS], one query a row; either attends over all of `states`."""
    attention = layer.attention.self
    k = rows.padded(attention.key(states), heads)
    v = rows.padded(attention.value(states), heads)
    if cls_alone:                                       # [batch, heads, 1, head]
        q = attention.query(queries).view(rows.batch, 1, heads, -1).transpose(1, 2)
    else:
        q = rows.padded(attention.query(queries), heads)
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=rows.keys)  # 1 / sqrt(head)
    context = context.transpose(1, 2).reshape(rows.batch * q.shape[2], -1)
    if not cls_alone:
        context = context[rows.real]
    out = layer.attention.output
    attended = out.LayerNorm(out.dense(context) + queries)
    ffn = layer.output
    inner = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(attended))
    return ffn.LayerNorm(ffn.dense(inner) + attended)
