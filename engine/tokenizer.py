"""Tokenizer, chat template and incremental detokenization, all through transformers / tokenizers.

Loading a tokenizer never loads weights, so `batchinfer validate` can count prompt tokens cheaply.
Stop strings are checked on text decoded incrementally (tokenizers' DecodeStream), so a long
output is never re-decoded from the start each step.
"""
from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .chat_format import shape_conversation
from .config import ModelConfig, is_inline_template
from .errors import ModelLoadError, RequestError

log = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, hf_tokenizer, model_id: str, eos_token_ids: tuple[int, ...] = (),
                 chat_template: Optional[str] = None, template_kwargs: Optional[dict] = None):
        """chat_template: a template to render with in place of the tokenizer's own;
        template_kwargs: variables every rendering gets (a request's own win key by key)."""
        self.hf = hf_tokenizer
        self.model_id = model_id
        ids = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(ids))
        self.vocab_size = len(hf_tokenizer)
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        self.has_chat_template = bool(chat_template or getattr(hf_tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            template_kwargs: Optional[dict] = None,
                            parts: Optional[list] = None,
                            add_special_tokens: bool = False) -> list[int]:
        """The conversation's prompt ids as vLLM's chat builds them: the conversation shaped
        for the template (engine/chat_format.py: content parts for templates that take them,
        `parts` being each message's as the line gave them; the developer role), the template
        rendered to text (with the assistant's generation prompt, or open at the end of the
        last message with continue_final_message; template_kwargs are variables the template
        reads, e.g. Qwen3's enable_thinking), then encoded without adding special tokens
        unless add_special_tokens (vLLM's chat request key: the tokenizer's on top of the
        template's)."""
        if not self.has_chat_template:
            raise RequestError("no_chat_template",
                               f"the tokenizer of {self.model_id} has no chat template; send "
                               "'prompt' instead of 'messages', or give one as "
                               "model.chat_template")
        template = self.chat_template or self.hf.chat_template
        if isinstance(template, dict):        # named templates: transformers renders "default"
            template = template.get("default")
        if isinstance(template, str):
            messages = shape_conversation(messages, template, parts)
        try:
            text = self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=self.chat_template,
                **{**self.template_kwargs, **(template_kwargs or {})})
        except Exception as exc:  # jinja errors from a template that rejects the conversation
            raise RequestError("bad_messages", f"the chat template rejected the messages: {exc}") from None
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_reply(self, ids: list[int], skip_special_tokens: bool = True,
                     prompt_ids: Sequence[int] = ()) -> str:
        """A finished reply's text as vLLM's detokenizer gives it: what its tokens add to the
        prompt's text (IncrementalDetokenizer), so a SentencePiece reply's first word keeps its
        leading space (" Paris"; decode alone strips it), and without the last tokens of a
        multi-byte character the reply ends inside (cut by max_tokens: decode shows U+FFFD
        there); their ids stay in the output's token ids."""
        stream = self.stream(skip_special_tokens, prompt_ids)
        for token in ids:
            stream.add(token)
        return stream.text

    def token_text(self, token_id: int) -> str:
        """The text one token stands for, as a log-probability entry shows it: " there", not the
        vocabulary's "Ġthere" / "▁there"; a token holding part of a multi-byte character shows
        U+FFFD (its bytes are in token_bytes)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text one token stands for (OpenAI's logprobs `bytes`): a byte-level BPE
        piece mapped back through its byte alphabet, a SentencePiece piece with its space marker
        replaced and a byte-fallback piece ("<0xE2>") as that byte; a special or added token its
        content; anything else what the tokenizer decodes the token alone to."""
        token_id = int(token_id)
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        rules = self._piece_rules
        if rules.byte_level:
            table = _unicode_to_bytes()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        elif rules.replacements or rules.byte_fallback:
            byte = _BYTE_PIECE.fullmatch(piece) if rules.byte_fallback else None
            if byte:
                return bytes([int(byte.group(1), 16)])
            for pattern, content in rules.replacements:
                piece = piece.replace(pattern, content)
            return piece.encode("utf-8")
        return self.hf.decode([token_id], skip_special_tokens=False,
                              clean_up_tokenization_spaces=False).encode("utf-8")

    @functools.cached_property
    def _added_ids(self) -> frozenset:
        added = getattr(self.hf, "added_tokens_decoder", None) or {}
        return frozenset(int(i) for i in added) | frozenset(self.hf.all_special_ids)

    @functools.cached_property
    def _piece_rules(self) -> "_PieceRules":
        backend = getattr(self.hf, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        return _PieceRules.of(json.loads(decoder.__getstate__()) if decoder is not None else {})

    def stream(self, skip_special_tokens: bool = True,
               prompt_ids: Sequence[int] = ()) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens, prompt_ids)


class IncrementalDetokenizer:
    """Appends tokens, returns the text they add ("" while a multi-byte character is split).

    Primed with the prompt's ids, as vLLM's detokenizer is: the first token's text is what it
    adds after the prompt. One difference: a prompt of token ids that ends inside a character
    primes the stream up to that character only (vLLM's stream would give the whole prompt's
    text back with the reply's first character)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool,
                 prompt_ids: Sequence[int] = ()):
        from tokenizers.decoders import DecodeStream

        self._backend = getattr(tokenizer.hf, "_tokenizer", None) or getattr(tokenizer.hf, "backend_tokenizer")
        self._skip_special_tokens = skip_special_tokens
        prompt = _priming_ids(tokenizer, prompt_ids, skip_special_tokens)
        split = len(prompt) - _tokens_inside_last_character(tokenizer, prompt)
        self._stream = DecodeStream(ids=prompt[:split], skip_special_tokens=skip_special_tokens)
        for token in prompt[split:]:
            self._step(token)                   # their character is not complete: no text
        self.text = ""

    def add(self, token_id: int) -> str:
        chunk = self._step(int(token_id))
        self.text += chunk
        return chunk

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._backend, token_id) or ""
        except Exception as exc:
            # tokenizers refuses a decode that does not extend the text before it; vLLM starts a
            # new stream there (vllm-project/vllm#17448), and so does this
            if not str(exc).startswith("Invalid prefix encountered"):
                raise
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._backend, token_id) or ""


# prompt ids a stream is primed with: a reply's text is the same after the prompt's last ones as
# after the whole prompt (decoding the whole of a long prompt costs ~0.7 us a token per request)
PRIMING_TOKENS = 64


def _priming_ids(tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool
                 ) -> list[int]:
    """The prompt's last PRIMING_TOKENS ids, or all of them where those give no text (special
    tokens skipped): a decoder that strips the text's first space (SentencePiece's) would then
    strip the reply's, which the whole prompt's text keeps."""
    tail = [int(t) for t in prompt_ids[-PRIMING_TOKENS:]]
    if len(tail) == len(prompt_ids) or tokenizer.decode(tail, skip_special_tokens):
        return tail
    return [int(t) for t in prompt_ids]


def _tokens_inside_last_character(tokenizer: Tokenizer, ids: list[int]) -> int:
    """How many of the last ids hold the start of a character they do not finish (0 for any
    prompt made from text): a UTF-8 character is at most 4 bytes, so at most 3 such ids."""
    tail = ids[-8:]
    if not tail or not tokenizer.decode(tail, skip_special_tokens=False).endswith("\ufffd"):
        return 0
    for held in range(1, min(3, len(tail)) + 1):
        rest = tail[:-held]         # empty only where the tail is the whole prompt
        if not rest or not tokenizer.decode(rest, skip_special_tokens=False).endswith("\ufffd"):
            return held
    return 0


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class _PieceRules:
    """How the tokenizer's decoder turns vocabulary pieces into text (its tokenizers JSON)."""

    byte_level: bool = False                            # GPT-2's byte alphabet
    byte_fallback: bool = False                         # "<0xHH>" pieces are raw bytes
    replacements: tuple[tuple[str, str], ...] = ()      # e.g. SentencePiece's "▁" -> " "

    @classmethod
    def of(cls, decoder: dict) -> "_PieceRules":
        parts = decoder.get("decoders") if decoder.get("type") == "Sequence" else [decoder]
        byte_level = byte_fallback = False
        replacements = []
        for part in parts or []:
            kind = part.get("type")
            byte_level |= kind == "ByteLevel"
            byte_fallback |= kind == "ByteFallback"
            if kind == "Metaspace":
                replacements.append((part.get("replacement", "\u2581"), " "))
            elif kind == "Replace" and isinstance(part.get("pattern"), dict) \
                    and "String" in part["pattern"]:
                replacements.append((part["pattern"]["String"], part.get("content", "")))
        return cls(byte_level, byte_fallback, tuple(replacements))


@functools.lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: byte for byte, ch in bytes_to_unicode().items()}


def find_stop(text: str, new_len: int, stops: list[str]) -> Optional[tuple[str, int]]:
    """The stop string that ends inside the last `new_len` characters, (stop, index in text): of
    several, the one that ends first, ties to the first listed, as vLLM's check_stop_strings
    picks (" capital" with stops "capital" and "pit" stops at "pit")."""
    if not stops or new_len <= 0:
        return None
    best: Optional[tuple[str, int]] = None
    best_end = len(text) + 1
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and idx + len(stop) < best_end:
            best, best_end = (stop, idx), idx + len(stop)
    return best


def load_tokenizer(model_cfg: ModelConfig, model_dir: Optional[Path] = None,
                   model_id: Optional[str] = None, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """The tokenizer for a model config; resolves the model source if `model_dir` is not given."""
    from .model.sources import resolve_model_dir

    if model_dir is None:
        model_dir, model_id = resolve_model_dir(model_cfg.path)
    source = Path(model_cfg.tokenizer).expanduser() if model_cfg.tokenizer else Path(model_dir)
    if not model_cfg.tokenizer and model_cfg.load_format == "dummy" and not _has_tokenizer(source):
        source = resolve_model_dir(None)[0]
        log.warning("%s has no tokenizer files: the dummy model tokenizes with the embedded "
                    "SmolLM2 tokenizer (set model.tokenizer to use another)", model_dir)
    key = "model.tokenizer" if model_cfg.tokenizer else "model.path"
    wanted = "give a directory with tokenizer.json, or tokenizer.model with tokenizer_config.json"
    if not source.is_dir():
        what = "is not a directory" if source.exists() else "does not exist"
        raise ModelLoadError(f"{key}: {str(source)!r} {what}; {wanted}")
    if not _has_tokenizer(source):     # (transformers may build an empty one from config.json)
        raise ModelLoadError(f"{key}: {str(source)!r} holds no tokenizer files; {wanted}")
    try:
        hf = _hf_tokenizer(str(source.resolve()), _version(source))
    except Exception as exc:
        raise ModelLoadError(f"{key}: {source}: cannot load a tokenizer ({exc}); {wanted}") \
            from None
    if len(hf) < 2:
        raise ModelLoadError(f"{key}: {source}: the tokenizer loaded has {len(hf)} token(s); "
                             f"{wanted}")
    return Tokenizer(hf, model_id or str(source), eos_token_ids,
                     recipe_chat_template(model_cfg), model_cfg.chat_template_kwargs)


def recipe_chat_template(model_cfg: ModelConfig) -> Optional[str]:
    """model.chat_template's text: as written, or read from the file it names."""
    value = model_cfg.chat_template
    if value is None:
        return None
    where = "model.chat_template"
    if is_inline_template(value):
        text = value
    else:
        path = Path(value).expanduser()
        where += f" ({path})"
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{where}: cannot read it ({exc})") from None
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:     # as transformers compiles it: a broken template would fail every chat request
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as exc:
        raise ModelLoadError(f"{where}: not a valid Jinja template: line {exc.lineno}: "
                             f"{exc.message}") from None
    return text


def warn_if_past_vocabulary(tokenizer: Tokenizer, vocab_size: int, model_cfg: ModelConfig) -> None:
    """A tokenizer with more tokens than the model has rows (another model's, as model.tokenizer
    or a dummy model's fallback): text whose tokens fall past them fails request by request as
    'prompt token ids out of range', which reads as if the user had sent ids. Said once, up
    front, naming both sizes."""
    if tokenizer.vocab_size <= vocab_size:
        return
    key = "model.tokenizer" if model_cfg.tokenizer else "model.path"
    log.warning("%s: the tokenizer has %d tokens but the model's vocabulary is %d: a prompt "
                "whose text encodes to ids %d and above is refused (bad_token_id); is the "
                "tokenizer the model's own?", key, tokenizer.vocab_size, vocab_size, vocab_size)


# a tokenizer's own files: one of these (or a vocabulary with its merges) is needed
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def _has_tokenizer(folder: Path) -> bool:
    return folder.is_dir() and (
        any((folder / name).is_file() for name in TOKENIZER_FILES)
        or all((folder / name).is_file() for name in ("vocab.json", "merges.txt")))


def _version(source: Path) -> tuple:
    """The tokenizer files' sizes and mtimes: a changed file is a new tokenizer."""
    stamp = []
    for path in sorted(source.glob("*")) if source.is_dir() else [source]:
        try:
            st = path.stat()
            stamp.append((path.name, st.st_size, st.st_mtime_ns))
        except OSError:
            continue
    return tuple(stamp)


@functools.lru_cache(maxsize=4)
def _hf_tokenizer(source: str, version: tuple):
    """One tokenizer per source and version in a process: each engine a process builds (the
    test suite, a notebook, `batchinfer profile`) would otherwise parse the same files again,
    0.3-0.5 s each on 2 cores. Engines only read it (encode, decode, the chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, config=_class_deciding_config(Path(source)))


def _class_deciding_config(source: Path):
    """What AutoTokenizer reads of the model config to pick the tokenizer class (model_type,
    tokenizer_class), as a bare PreTrainedConfig read from config.json, when tokenizer_config.json
    names its class itself; None (AutoTokenizer loads the config) otherwise. Loading the model's
    own config class imports transformers' modelling stack (torch.distributed.tensor, sympy):
    ~1 s of a run's start on 2 cores, for two strings."""
    import json

    try:
        model = json.loads((source / "config.json").read_text())
        tokenizer = json.loads((source / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(model, dict) and isinstance(tokenizer, dict) and model.get("model_type")
            and tokenizer.get("tokenizer_class") and "auto_map" not in tokenizer
            and "auto_map" not in model):
        return None
    from transformers.configuration_utils import PreTrainedConfig

    config = PreTrainedConfig()
    config.model_type = model["model_type"]
    config.tokenizer_class = model.get("tokenizer_class")
    return config
