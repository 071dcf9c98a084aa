"""The encoder's forward when only the [CLS] state is read (`pooling: cls`, the shipped predictors').

A BERT's last layer turns every token's state into the next one, but `cls` pooling reads one row
of its output. There the last layer needs keys and values for every token and the rest of its
work (the query, the attention, the output projection, the feed-forward) for [CLS] alone: on
all-MiniLM-L6-v2 five sixths of one layer in six, ~14% of the encoder's linear work. And the
linears, norms and activations run on the batch's real tokens only (torch's attention pads them
back; the bf16 kernel below reads them as they are): batches sorted by length still carried ~10%
padding on real prompts. Together 0.86x the encoder's time on 120 ShareGPT prompts
(performance.md), the same [CLS] state to fp32 rounding (tests/predictors/test_cls_encoder.py).

Written over the layers' weights by BERT's submodule names (unchanged since the original), not
through transformers' forward, whose mask and return conventions changed across the versions
the project admits. Encoders it does not describe (relative position embeddings, decoders) take
transformers' forward (`reads_cls_alone`).

On CPU the engine's kernels serve it as the predictor chooses (`EncoderKernels`; bert.py): int8
linears (`encoder_int8`) with q, k and v one stacked linear (`fuse_attention_projections`) and
the feed-forward's GELU fused into the first one's output (`Int8Linear.gelu`); attention over
the packed rows in bf16 dot products (`encoder_bf16_attention`, kernels/encoder_attention.cpp:
no padding written, masked or gathered back); each residual add and LayerNorm one pass
(`add_layer_norm`, fp32).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

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


@dataclass(frozen=True)
class EncoderKernels:
    """Which of the engine's CPU kernels `cls_states` calls (the int8 linears are modules of their
    own, swapped in by bert.quantize_encoder). Off, it is torch's arithmetic throughout."""
    bf16_attention: bool = False    # kernels/encoder_attention.cpp (bidirectional_attention_missing)
    add_layer_norm: bool = False    # kernels/fused_ops.cpp's add_layer_norm


def cls_states(encoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               kernels: EncoderKernels = EncoderKernels()) -> torch.Tensor:
    """The last layer's [CLS] state of each row, [batch, hidden] (eval mode: no dropout). Rows are
    padded on the right (bert.Tokenized.batch), [CLS] first, as transformers' `[:, 0]` reads it."""
    rows = _Rows(attention_mask.bool())
    heads = int(encoder.config.num_attention_heads)
    fused_gelu = getattr(encoder.config, "hidden_act", None) == "gelu"   # the exact (erf) GELU
    states = _embedded(encoder.embeddings, input_ids, rows, kernels)   # [tokens, hidden]
    layers = encoder.encoder.layer
    for layer in layers[:-1]:
        states = _layer(layer, states, states, rows, heads, False, kernels, fused_gelu)
    return _layer(layers[-1], states[rows.cls], states, rows, heads, True, kernels, fused_gelu)


def _embedded(embeddings: nn.Module, input_ids: torch.Tensor, rows: "_Rows",
              kernels: EncoderKernels) -> torch.Tensor:
    """The real tokens' embeddings (token type 0, absolute positions): BERT's sum and LayerNorm
    on those alone, in its order ((word + type) + position); any other embedding module through
    its own forward on the padded batch (RoBERTa's positions, say, count from its padding id)."""
    from transformers.models.bert.modeling_bert import BertEmbeddings

    if type(embeddings) is not BertEmbeddings:
        embedded = embeddings(input_ids=input_ids)
        return embedded.reshape(-1, embedded.shape[-1])[rows.real]
    ids = input_ids.reshape(-1)[rows.real]
    words = embeddings.word_embeddings(ids) + embeddings.token_type_embeddings.weight[0]
    return _add_norm(embeddings.LayerNorm, words, embeddings.position_embeddings(rows.positions),
                     kernels.add_layer_norm)


def bidirectional_attention_missing(encoder: nn.Module, device: torch.device) -> Optional[str]:
    """Why `cls_states` cannot run this encoder's attention in the bf16 kernel here (None: it can).
    Builds the native kernels only on a CPU whose flags say the kernel is in them."""
    if torch.device(device).type != "cpu":
        return f"the bf16 encoder attention runs on CPU only, not {torch.device(device).type}"
    if not reads_cls_alone(encoder):
        return "the encoder is not a BERT whose [CLS] state cls_states computes"
    head = int(encoder.config.hidden_size) // int(encoder.config.num_attention_heads)
    if head not in (32, 64):
        return f"the kernel takes heads of 32 or 64 dimensions, not {head}"
    from batchinfer.engine.host_cpu import cpu_identity
    from batchinfer.engine.kernels import load_native_kernels

    _, flags = cpu_identity()
    if flags and ("avx512_bf16" not in flags or "amx_bf16" in flags):
        return "this CPU lacks AVX512-BF16, or has AMX (where vdpbf16ps runs at half rate)"
    if not load_native_kernels() or not hasattr(torch.ops.batchinfer, "encoder_attention_isa"):
        return "the native CPU kernels are unavailable (BATCHINFER_NATIVE_KERNELS=0 or a failed build)"
    if torch.ops.batchinfer.encoder_attention_isa() == "none":
        return "this CPU lacks AVX512-BF16, or has AMX (where vdpbf16ps runs at half rate)"
    return None


class _Rows:
    """Where a padded batch's real tokens are: the linears run on those alone ([tokens, hidden],
    the padding never computed), attention on them as they are (the bf16 kernel, `starts`) or
    padded back to [batch, width] (torch's SDPA)."""

    def __init__(self, mask: torch.Tensor):
        self.batch, self.width = mask.shape
        self.real = mask.reshape(-1).nonzero().squeeze(1)       # flat padded index of each token
        self.positions = self.real % self.width                 # each token's place in its row
        lengths = mask.sum(1)
        self.starts = F.pad(torch.cumsum(lengths, 0), (1, 0))   # row b: [starts[b], starts[b + 1])
        self.cls = self.starts[:-1]                             # each row's [CLS] among tokens
        self.one_each = torch.arange(self.batch + 1)            # a query a row: [CLS]
        self.keys = mask[:, None, None, :]                      # attends to: True takes part

    def padded(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[tokens, hidden] -> [batch, heads, width, hidden / heads], zeros at the padding."""
        out = x.new_zeros(self.batch * self.width, x.shape[-1])
        out[self.real] = x
        return out.view(self.batch, self.width, heads, -1).transpose(1, 2)


def fuse_attention_projections(encoder: nn.Module, convert: Callable[[nn.Linear], nn.Module]
                               ) -> None:
    """Stacks each layer's attention projections into one linear, `convert`ed (e.g. to int8,
    whose per-output-channel weights and per-token inputs make the stacked outputs those of the
    separate ones bit for bit): `fused_qkv` on every layer but the last, `fused_kv` on the last
    (whose query is [CLS]'s alone). One call where there were three and the input quantized once:
    2.6% of the int8 encoder's time (performance.md)."""
    layers = encoder.encoder.layer
    for i, layer in enumerate(layers):
        attention = layer.attention.self
        if i + 1 < len(layers):
            attention.fused_qkv = convert(_stacked(attention.query, attention.key, attention.value))
        else:
            attention.fused_kv = convert(_stacked(attention.key, attention.value))


def _stacked(*linears: nn.Linear) -> nn.Linear:
    first = linears[0]
    out = torch.nn.utils.skip_init(nn.Linear, first.in_features,
                                   sum(x.out_features for x in linears),
                                   bias=first.bias is not None, device=first.weight.device,
                                   dtype=first.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(torch.cat([x.weight for x in linears]))
        if out.bias is not None:
            out.bias.copy_(torch.cat([x.bias for x in linears]))
    return out


def _projections(attention: nn.Module, queries: torch.Tensor, states: torch.Tensor,
                 cls_alone: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q at the queries, k and v at the states, through the fused projections where there are."""
    width = queries.shape[-1]
    if cls_alone:
        fused = getattr(attention, "fused_kv", None)
        q = attention.query(queries)
        k, v = (fused(states).split(width, 1) if fused is not None
                else (attention.key(states), attention.value(states)))
        return q, k, v
    fused = getattr(attention, "fused_qkv", None)
    if fused is not None:
        q, k, v = fused(states).split(width, 1)
        return q, k, v
    return attention.query(states), attention.key(states), attention.value(states)


def _attention(attention: nn.Module, queries: torch.Tensor, states: torch.Tensor, rows: _Rows,
               heads: int, cls_alone: bool, bf16: bool) -> torch.Tensor:
    """Self-attention's context at the `queries` ([tokens or batch, hidden]) over all `states`."""
    q, k, v = _projections(attention, queries, states, cls_alone)
    if bf16:
        return torch.ops.batchinfer.encoder_attention(
            q, k, v, rows.one_each if cls_alone else rows.starts, rows.starts, heads,
            (q.shape[-1] // heads) ** -0.5)
    k, v = rows.padded(k, heads), rows.padded(v, heads)
    if cls_alone:                                       # [batch, heads, 1, head]
        q = q.view(rows.batch, 1, heads, -1).transpose(1, 2)
    else:
        q = rows.padded(q, heads)
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=rows.keys)  # 1 / sqrt(head)
    context = context.transpose(1, 2).reshape(rows.batch * q.shape[2], -1)
    return context if cls_alone else context[rows.real]


def _layer(layer: nn.Module, queries: torch.Tensor, states: torch.Tensor, rows: _Rows,
           heads: int, cls_alone: bool, kernels: EncoderKernels, fused_gelu: bool) -> torch.Tensor:
    """One BERT layer's output at the `queries` (post-norm): every token's, or (`cls_alone`) each
    row's [CLS], one query a row; either attends over all of `states`."""
    context = _attention(layer.attention.self, queries, states, rows, heads, cls_alone,
                         kernels.bf16_attention)
    out = layer.attention.output
    attended = _add_norm(out.LayerNorm, out.dense(context), queries, kernels.add_layer_norm)
    dense = layer.intermediate.dense
    if fused_gelu and callable(getattr(dense, "gelu", None)):    # an int8 linear
        inner = dense.gelu(attended)
    else:
        inner = layer.intermediate.intermediate_act_fn(dense(attended))
    ffn = layer.output
    return _add_norm(ffn.LayerNorm, ffn.dense(inner), attended, kernels.add_layer_norm)


def _add_norm(norm: nn.LayerNorm, x: torch.Tensor, residual: torch.Tensor,
              native: bool) -> torch.Tensor:
    """norm(x + residual), in one pass with `native` (an fp32 CPU tensor and an affine norm)."""
    if (native and x.device.type == "cpu" and x.dtype == torch.float32
            and norm.weight is not None and norm.bias is not None):
        return torch.ops.batchinfer.add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps)
    return norm(x + residual)


def add_layer_norm_missing(device: torch.device) -> Optional[str]:
    """Why `EncoderKernels.add_layer_norm` cannot be on here (None: it can; builds the kernels)."""
    if torch.device(device).type != "cpu":
        return f"add_layer_norm runs on CPU only, not {torch.device(device).type}"
    from batchinfer.engine.kernels import load_native_kernels

    if not load_native_kernels() or not hasattr(torch.ops.batchinfer, "add_layer_norm"):
        return "the native CPU kernels are unavailable (BATCHINFER_NATIVE_KERNELS=0 or a failed build)"
    return None
