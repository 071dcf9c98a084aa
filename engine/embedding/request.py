"""An embedding request (one or several inputs: an OpenAI `input` may list several) and its
result. The job loop reads a result as it reads a generation's (RequestOutput's names), so the
writer, the metrics and the deduplication take either."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

from ..request import FinishReason


@dataclass
class EmbeddingRequest:
    request_id: str
    inputs: list[list[int]]                 # each input's prompt token ids
    dimensions: Optional[int] = None        # None: the pooler's (model.pooler_config)
    use_activation: Optional[bool] = None   # None: the pooler's
    payload: Any = None
    arrival_index: int = 0
    prompt: Optional[str] = None

    @property
    def prompt_token_ids(self) -> list[int]:
        """The first input's tokens: what the read-ahead window groups by."""
        return self.inputs[0]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)

    def dedup_key(self) -> Hashable:
        """Two requests with this key get the same embeddings (the forward is deterministic)."""
        return ("embed", tuple(tuple(ids) for ids in self.inputs), self.dimensions,
                self.use_activation)


@dataclass
class EmbeddingOutput:
    request_id: str
    embeddings: list[list[float]]            # one per input, in input order
    num_prompt_tokens: int
    finish_reason: FinishReason = FinishReason.STOP
    payload: Any = None
    error: Optional[str] = None
    arrival_time: float = 0.0
    finish_time: Optional[float] = None
    first_token_time: Optional[float] = None   # (no tokens are generated)
    copied_from: Optional[str] = None          # the identical request whose result this is
    num_preemptions: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""

    @property
    def num_output_tokens(self) -> int:
        return 0
