"""Requests, sequences and sampling parameters.

SamplingParams keeps vLLM's field names, defaults and meanings so a recipe or input line written for
vLLM means the same thing here. Validation is pydantic: an unknown key or an out-of-range value
raises a ValidationError that names the field and what is allowed.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pydantic import ConfigDict, Field, NonNegativeInt, field_validator, model_validator

from .strict_numbers import NumbersNotBooleans
from .structured_params import StructuredOutputsParams


# vLLM SamplingParams keys batchinfer does not implement, each with the values that ask for
# nothing (vLLM's defaults): a line or recipe that writes one of those out (as a dump of vLLM's
# SamplingParams does) runs; any other value is refused by name, never silently left undone
VLLM_KEYS_NOT_IMPLEMENTED: dict[str, tuple] = {
    "spaces_between_special_tokens": (True,), "detokenize": (True,),
}


# the most samples one request may ask for (SamplingParams.n), vLLM's VLLM_MAX_N_SEQUENCES
MAX_SAMPLES = 16384


# the sampling keys that name token ids (a dict's keys for logit_bias), checked against the
# model's vocabulary (SamplingParams.token_ids_problem), in the order they are reported
TOKEN_ID_KEYS = ("stop_token_ids", "logit_bias", "allowed_token_ids")


def not_implemented_problem(key: str, value: Any) -> Optional[str]:
    """Why `value` of one of VLLM_KEYS_NOT_IMPLEMENTED is refused; None where it asks for nothing
    (types compared too: 1 is no true)."""
    offs = VLLM_KEYS_NOT_IMPLEMENTED[key]
    if any(type(value) is type(off) and value == off for off in offs):
        return None
    allowed = " or ".join(json.dumps(off) for off in offs)
    return (f"{key} is a vLLM sampling parameter batchinfer does not implement (only {allowed}, "
            f"vLLM's default, is accepted; got {json.dumps(value, default=repr)})")


class SamplingParams(NumbersNotBooleans):
    """Per-request sampling, vLLM semantics.

    temperature 0 is greedy. top_k 0 or -1 disables top-k; top_p 1 and min_p 0 disable theirs.
    Presence and frequency penalties count output tokens only; repetition_penalty counts prompt
    and output tokens (logit > 0 divided by it, else multiplied), as vLLM does. logprobs=N returns
    the sampled token's log-probability and the top N, from the model's raw distribution.
    """

    # allow_inf_nan: `temperature: .inf` or a NaN would pass a one-sided bound (or fail one with
    # a puzzling "greater than or equal to 0 (got NaN)"); every float must be finite
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    n: int = 1              # samples of the reply (1..MAX_SAMPLES): engine/parallel_sampling.py
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)      # vLLM sets no upper bound
    seed: Optional[int] = None                          # -1: none (vLLM's "random")
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[NonNegativeInt]] = None   # < vocab size: token_ids_problem
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    # each prompt token's log-probability, rank and the top N at its position (vLLM's
    # prompt_logprobs, 0..20 as its default max_logprobs): engine/prompt_logprobs.py
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=20)
    # words the reply must not produce (vLLM's bad_words: a word's last token is banned where
    # the reply ends with its other tokens): engine/token_constraints.py
    bad_words: Optional[list[str]] = None
    skip_special_tokens: bool = True
    # added to the logits of these token ids before penalties and sampling (vLLM's logit_bias:
    # JSON writes the ids as strings); < vocab size: token_ids_problem
    logit_bias: Optional[dict[NonNegativeInt, float]] = None
    # only these token ids can be sampled (vLLM's allowed_token_ids); < vocab size
    allowed_token_ids: Optional[list[NonNegativeInt]] = None
    # the reply held to a JSON schema, regex, choice or grammar (vLLM's structured_outputs,
    # xgrammar): engine/structured_params.py, engine/structured_output.py
    structured_outputs: Optional[StructuredOutputsParams] = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_keys_not_implemented(cls, data: Any) -> Any:
        if isinstance(data, dict) and not VLLM_KEYS_NOT_IMPLEMENTED.keys().isdisjoint(data):
            data = dict(data)
            for key in sorted(VLLM_KEYS_NOT_IMPLEMENTED.keys() & data.keys()):
                problem = not_implemented_problem(key, data.pop(key))
                if problem:
                    raise ValueError(problem)
        return data

    @field_validator("n")
    @classmethod
    def _samples(cls, v: int) -> int:
        if not 1 <= v <= MAX_SAMPLES:
            raise ValueError(f"the number of samples of the reply must be 1..{MAX_SAMPLES} "
                             "(vLLM's limit, VLLM_MAX_N_SEQUENCES)")
        return v

    @field_validator("seed")
    @classmethod
    def _unseeded(cls, v: Optional[int]) -> Optional[int]:
        """vLLM reads seed -1 as no seed (UIs and clients send it for "random"): each such
        request draws its own, and it is never deduplicated as a seeded one."""
        return None if v == -1 else v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _biases_are_numbers(cls, v: Any) -> Any:
        if isinstance(v, dict):
            flags = [k for k, b in v.items() if isinstance(b, bool)]
            if flags:
                raise ValueError(f"logit_bias[{flags[0]!r}]: a bias is a number added to the "
                                 "token's logit, not true or false")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_empty_bias(cls, v: Optional[dict]) -> Optional[dict]:
        return v or None          # {}: vLLM's default, nothing to add

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        """[] is vLLM's default (none); repeats count once, as vLLM's."""
        if v and any(not word for word in v):
            raise ValueError("bad_words cannot contain an empty string")
        return (list(dict.fromkeys(v)) or None) if v is not None else None

    @field_validator("allowed_token_ids")
    @classmethod
    def _some_allowed(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        if v is not None and not v:
            raise ValueError("allowed_token_ids must not be empty (no token could be sampled); "
                             "leave it out to allow every token")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: Any) -> Optional[list[str]]:
        if v is None:
            return None
        items = [v] if isinstance(v, str) else list(v)
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        return items or None

    @model_validator(mode="after")
    def _min_le_max(self) -> "SamplingParams":
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    def token_ids_problem(self, vocab_size: int) -> Optional[str]:
        """What is wrong with the token ids these parameters name (stop_token_ids, logit_bias,
        allowed_token_ids) for a model of `vocab_size` ids, as "key: problem" (None: nothing),
        the rule prompt token ids follow (engine/admission.py): an id past the vocabulary is one
        the model never generates, so a stop would silently never happen, a bias never apply."""
        for key in TOKEN_ID_KEYS:
            bad = [t for t in getattr(self, key) or () if t >= vocab_size]
            if bad:
                return (f"{key}: {bad[:5]} out of range; this model's token ids are "
                        f"0..{vocab_size - 1}")
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def reads_output_tokens(self) -> bool:
        """The sampler reads the values of the reply's tokens so far (penalties, bad words), so
        no step is sampled before the last one's tokens are on the host (steps_ahead.py)."""
        return self.uses_penalties or bool(self.bad_words)

    @property
    def top_k_active(self) -> bool:
        return self.top_k > 0

    def with_overrides(self, **overrides: Any) -> "SamplingParams":
        """A validated copy with some fields replaced (per-request overrides of recipe defaults)."""
        return SamplingParams(**{**self.model_dump(), **overrides})


SAMPLING_KEYS = frozenset(SamplingParams.model_fields)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # not yet admitted (or preempted: its KV was dropped)
    RUNNING = "running"      # holds KV blocks; prefilling or decoding
    SWAPPED = "swapped"      # preempted with its KV in the swap area (memory.preemption_mode)
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"            # EOS, a stop token or a stop string
    LENGTH = "length"        # max_tokens or max_model_len reached
    ABORT = "abort"
    ERROR = "error"


@dataclass
class Request:
    """What the reader hands the engine: ids, tokens, params and an opaque payload passed through."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prompt: Optional[str] = None
    arrival_index: int = 0
    payload: Any = None
    # output tokens the recipe's length predictor expects (set before scheduling; None: no
    # prediction was made). Strategies that forecast future KV use read it.
    predicted_output_len: Optional[int] = None
    # the predictor's upper forecast (its upper_percentile) and how sure it is (0..1): a
    # strategy's KV forecast may read the upper one for a request the predictor is unsure of
    predicted_output_upper: Optional[int] = None
    predicted_confidence: Optional[float] = None
    # sampling.bad_words as token ids (token_constraints.bad_words_token_ids), set when the
    # engine admits the request
    bad_words_token_ids: Optional[list[list[int]]] = None
    # the LoRA adapter (a name of model.lora_modules; None: the base model) and its slot, which
    # the engine sets when it admits the request (0: none; model/lora_adapters.py)
    lora: Optional[str] = None
    lora_slot: int = 0

    @property
    def prefix_root(self) -> Optional[tuple]:
        """What a prefix cache's chain starts from: its adapter (two adapters never share KV)."""
        return None if self.lora is None else ("lora", self.lora)


# an output token sampled on the device whose value the host has not read yet (async scheduling)
PENDING_TOKEN = -1


@dataclass(eq=False)
class Sequence:
    """Engine-side state of one request. The scheduler reads it; the engine mutates it.
    Compared by identity (eq=False): `seq in running` must not compare every field.

    num_computed_tokens counts tokens whose KV is in the cache. A sequence is prefilling while
    num_computed_tokens < len(prompt) (+ generated, after a recompute preemption), decoding after.
    """

    request: Request
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    finish_reason: Optional[FinishReason] = None
    stop_reason: Union[int, str, None] = None
    num_preemptions: int = 0
    output_logprobs: list[dict] = field(default_factory=list)
    # (logprob, rank, top) of each prompt token after the first scored so far (prompt_logprobs)
    prompt_logprobs: list[tuple] = field(default_factory=list)
    text: str = ""
    # timeline (seconds, engine clock)
    arrival_time: float = 0.0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    # sampler state kept between steps so penalties never recount from scratch
    sampler_slot: int = -1
    # inside a submitted micro-batch whose results are not back yet (pipeline parallelism)
    in_flight: bool = False
    # async scheduling (engine/steps_ahead.py): the row of the launched step's sampled ids that
    # holds this sequence's last token while output_token_ids has PENDING_TOKEN in its place
    pending_row: int = -1

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is still missing: the prompt (and, after recompute, outputs) then 1/step."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self) -> list[int]:
        return self.request.prompt_token_ids + self.output_token_ids


@dataclass
class RequestOutput:
    """A finished request as the engine reports it."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stop_reason: Union[int, str, None] = None
    logprobs: Optional[list[dict]] = None
    prompt_logprobs: Optional[list[Optional[dict]]] = None   # None first: nothing predicts it
    num_preemptions: int = 0
    payload: Any = None
    error: Optional[str] = None
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    copied_from: Optional[str] = None   # the identical request whose reply this is (dedup)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

