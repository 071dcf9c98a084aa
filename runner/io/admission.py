"""A checked request spec -> prompt token ids (chat template applied) -> an engine Request.

Used by the job loop, by `batchinfer validate` (which has a tokenizer but no model) and by the
simulator's workloads. Problems are RequestErrors, so the caller turns them into error records
and goes on.
"""
from __future__ import annotations

from typing import Optional, Sequence

from batchinfer.engine.errors import ConfigError, RequestError
from batchinfer.engine.admission import check_stop_ids
from batchinfer.engine.request import TOKEN_ID_KEYS, Request

from .chat_messages import no_chat_template_for_line
from .input_records import RequestSpec
from .records import RequestPayload


def render_plain(messages: list[dict], add_generation_prompt: bool = True, **_) -> str:
    """A conversation as plain text, for chat_template: never (no template, so no template
    variables); the generation prompt is the last line's "assistant:"."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")


def check_stop_token_ids(spec: RequestSpec, vocab_size: int, tokenizer=None) -> None:
    """`batchinfer validate`'s check of the stop_token_ids a record sets itself, as the engine
    checks them when it admits the request (engine/admission.check_stop_ids), and with the
    tokenizer its bad_words; the recipe's are checked once, at start (check_recipe_stop_ids)."""
    if not spec.sampling_keys.isdisjoint(TOKEN_ID_KEYS) and spec.sampling is not None:
        try:
            check_stop_ids(spec.sampling, vocab_size)
        except RequestError as exc:
            raise located_in_line(spec, exc) from None
    if tokenizer is not None and "bad_words" in spec.sampling_keys and spec.sampling.bad_words:
        from batchinfer.engine.token_constraints import bad_words_token_ids

        try:
            bad_words_token_ids(tokenizer, spec.sampling.bad_words, vocab_size)
        except RequestError as exc:
            raise located_in_line(spec, exc) from None


def located_in_line(spec: RequestSpec, exc: RequestError) -> RequestError:
    """The engine's refusal of a request's stop_token_ids, named where the line holds them: an
    OpenAI batch line's sampling keys are under `body.`, as the reader's own messages say."""
    if (spec.is_openai and exc.code == "invalid_sampling"
            and exc.message.split(":")[0] in (*TOKEN_ID_KEYS, "bad_words")):
        return RequestError(exc.code, f"body.{exc.message}")
    return exc


def check_recipe_stop_ids(sampling, vocab_size: int, tokenizer=None) -> None:
    """The recipe's stop_token_ids past the model's vocabulary, or (with the tokenizer) a
    bad_words entry that does not tokenize as the engine needs: every request would fail
    alike, so a usage error (validate, --dry-run and the job's start)."""
    problem = sampling.token_ids_problem(vocab_size)
    if problem:
        raise ConfigError(f"sampling.{problem}")
    if tokenizer is not None and sampling.bad_words:
        from batchinfer.engine.token_constraints import bad_words_token_ids

        try:
            bad_words_token_ids(tokenizer, sampling.bad_words, vocab_size)
        except RequestError as exc:
            raise ConfigError(f"sampling.{exc.message}") from None


def check_recipe_stop_ids_at_hand(recipe) -> None:
    """check_recipe_stop_ids before any weights load, against the vocabulary in the model's
    config where it is at hand (a directory, or a GGUF already converted): a job whose every
    request would fail is refused before a large model's minutes of loading. Where the config is
    not at hand or does not read, the check after the build (Engine.vocab_size) is the one."""
    if not any(getattr(recipe.sampling, key) for key in TOKEN_ID_KEYS):
        return
    from batchinfer.engine.model.loader import load_arch
    from batchinfer.engine.model.sources import model_dir_at_hand

    try:
        model_dir = model_dir_at_hand(recipe.model.path)
        vocab = (load_arch(model_dir, recipe.model.hf_overrides or None).vocab_size
                 if model_dir is not None else None)
    except Exception:  # noqa: BLE001 - the build reads the config again and reports it
        return
    if vocab:
        check_recipe_stop_ids(recipe.sampling, vocab)


def prompt_token_ids(spec: RequestSpec, tokenizer, chat_template: str = "auto") -> list[int]:
    """Tokens for `spec`: OpenAI token-id prompts as given, messages through the chat template
    (unless chat_template is never), text prompts encoded (wrapped as a user turn when always)."""
    try:
        if isinstance(spec.prompt, list):
            return list(spec.prompt)
        if spec.messages is not None:
            if chat_template == "never":
                return tokenizer.encode(render_plain(spec.messages, **spec.chat_options))
            return tokenizer.apply_chat_template(spec.messages, parts=spec.content_parts,
                                                 **spec.chat_options)
        if chat_template == "always" and not spec.is_openai:
            return tokenizer.apply_chat_template([{"role": "user", "content": spec.prompt}])
        return tokenizer.encode(spec.prompt)
    except RequestError as exc:
        if exc.code == "no_chat_template" and spec.messages is None:   # the recipe's `always`
            raise RequestError(exc.code, f"io.chat_template: always wraps each prompt in the "
                               f"chat template, and {exc.message.split(';')[0]}: set "
                               "io.chat_template: auto to send prompts as written") from None
        raise no_chat_template_for_line(exc, spec.openai_url) from None
    except Exception as exc:  # the tokenizer rejects the text (e.g. lone surrogates)
        raise RequestError("tokenization_failed", f"the tokenizer could not encode the prompt: "
                           f"{type(exc).__name__}: {exc}") from None


def request_lora(spec: RequestSpec, adapters: Sequence[str] = ()) -> Optional[str]:
    """The LoRA adapter `spec` asks for (None: the base model): a plain or chat line's `lora`,
    which must name one of `adapters` (model.lora_modules); an OpenAI line's body.model where it
    names one, as vLLM's server maps a model name to its --lora-modules adapter (any other
    model name, or none, runs the base model). RequestError naming the key otherwise."""
    if spec.is_openai:
        model = spec.extra.get("model")
        return model if isinstance(model, str) and model in adapters else None
    lora = spec.extra.get("lora")
    if lora is None:
        return None
    if not isinstance(lora, str):
        raise RequestError("invalid_type", f"'lora' must be a string, the name of an adapter of "
                           f"model.lora_modules, not {type(lora).__name__}")
    if lora not in adapters:
        known = (", ".join(repr(n) for n in adapters) if adapters
                 else "none (the recipe's model.lora_modules is empty)")
        raise RequestError("unknown_lora", f"lora: {lora!r} is not a LoRA adapter of this job; "
                           f"the adapters are {known}")
    return lora


def build_request(spec: RequestSpec, tokenizer, order: int, chat_template: str = "auto",
                  tokens: Optional[list[int]] = None, adapters: Sequence[str] = ()) -> Request:
    """adapters: the job's LoRA adapters' names (model.lora_modules; request_lora)."""
    lora = request_lora(spec, adapters)
    ids = tokens if tokens is not None else prompt_token_ids(spec, tokenizer, chat_template)
    prompt = spec.prompt if isinstance(spec.prompt, str) else None
    payload = RequestPayload.from_spec(spec, order)
    payload.lora = lora
    return Request(request_id=spec.request_id, prompt_token_ids=ids, sampling=spec.sampling,
                   prompt=prompt, arrival_index=order, payload=payload, lora=lora)
