"""`batchinfer validate` for an embedding job (`model.task: embed`): the model's files (config,
tokenizer, pooling) without its weights, and each record tokenized and checked as the job would
(lengths, vocabulary, dimensions)."""
from __future__ import annotations

import logging

from batchinfer.engine.embedding.engine import check_embedding_request
from batchinfer.engine.errors import ConfigError

from .embed_recipe import uses_builtin_embedding_engine
from .io.embed_records import build_embed_request


def _check_engine_refusals(recipe, hf_config: dict) -> None:
    """What the embedding engine refuses at start from the config alone (a decoder set
    is_causal: false), refused here alike; a strategy with its own engine (vllm) runs it."""
    from batchinfer.engine.embedding.pooler_config import bidirectional_decoder_problem

    problem = bidirectional_decoder_problem(hf_config)
    if problem and uses_builtin_embedding_engine(recipe):
        raise ConfigError(problem)


def embed_model_for_validate(recipe, tokenize: bool = True) -> tuple:
    """(the model's EmbeddingSource, in validate's tokenizer slot; max_model_len; vocabulary
    size); with tokenize false (None, None, 0) after the checks that read only config files."""
    from batchinfer.engine.embedding.model_source import embed_model_dir, embedding_source
    from batchinfer.engine.embedding.pooler_config import resolve_pooling

    if not tokenize:
        try:
            model_dir, _ = embed_model_dir(recipe.model.path)
        except Exception:  # noqa: BLE001 - a model not here: inputs validated elsewhere
            logging.getLogger("batchinfer").warning(
                "--no-tokenize: the model is not at hand: its pooling was not checked")
            return None, None, 0
        import json

        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        config = {**config, **(recipe.model.hf_overrides or {})}    # as the engine reads it
        resolve_pooling(model_dir, config, recipe.model.pooler_config)
        _check_engine_refusals(recipe, config)
        return None, None, 0
    source = embedding_source(recipe.model)
    _check_engine_refusals(recipe, source.hf_config)
    return source, source.max_model_len, source.vocab_size


def check_embed_item(item, source, chat_template: str) -> None:
    """RequestError where the job would write the record as an error."""
    request = build_embed_request(item, source.tokenizer, 0, source.max_model_len, chat_template)
    check_embedding_request(request, source.max_model_len, source.vocab_size, source.pooling)
