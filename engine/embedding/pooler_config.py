"""`model.pooler_config` and how an embedding model's pooling is decided, as vLLM 0.32 decides it.

    the recipe's pooler_config keys win; a key left empty comes from the model's
    sentence-transformers files (modules.json: its Pooling module's 1_Pooling/config.json
    pooling_mode_* -> pooling_type, a Normalize module -> use_activation), else from the
    architecture (encoders: CLS; decoders: LAST) and the pooler's default (normalize: true).

`dimensions` (matryoshka) needs a model whose config says `is_matryoshka` or lists
`matryoshka_dimensions`, and at most the hidden size (vLLM's PoolingParams.verify).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field, model_validator

from ..errors import ConfigError
from ..strict_numbers import NumbersNotBooleans

log = logging.getLogger(__name__)

POOLING_TYPES = ("CLS", "LAST", "MEAN")
TOKEN_POOLING_TYPES = ("ALL", "STEP")     # vLLM's tok_pooling_type: not an embed job's

# model_type of the bidirectional encoders: their default pooling is CLS (vLLM's registry gives
# BertModel, RobertaModel, XLMRobertaModel ... CLS); every other model is read as a decoder (LAST)
ENCODER_MODEL_TYPES = frozenset({
    "bert", "roberta", "xlm-roberta", "distilbert", "electra", "mpnet", "albert", "camembert",
    "deberta", "deberta-v2", "modernbert", "nomic_bert", "new", "ernie", "xlm", "megatron-bert",
    "roformer", "mobilebert", "luke", "esm"})

_ST_POOLING_MODULES = {"sentence_transformers.models.Pooling",
                       "sentence_transformers.sentence_transformer.modules.pooling.Pooling"}
_ST_NORMALIZE_MODULES = {"sentence_transformers.models.Normalize",
                         "sentence_transformers.base.modules.normalize.Normalize",
                         "sentence_transformers.sentence_transformer.modules.normalize.Normalize"}
_ST_PLAIN_MODULES = {"sentence_transformers.models.Transformer",
                     "sentence_transformers.sentence_transformer.modules.transformer.Transformer"}


class PoolerConfig(NumbersNotBooleans):
    """vLLM's PoolerConfig keys for an embedding job (`model.task: embed`); empty keys are
    decided from the model (module docstring)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    pooling_type: Optional[Literal["CLS", "LAST", "MEAN"]] = Field(
        None, description="CLS: the first token's hidden state; LAST: the last token's; MEAN: "
        "the mean over the prompt's tokens. Empty: the model's sentence-transformers "
        "1_Pooling/config.json, else CLS for encoders and LAST for decoders")
    use_activation: Optional[bool] = Field(
        None, description="L2-normalize each embedding (vLLM's name; its removed `normalize`). "
        "Empty: whether the model's modules.json has a Normalize module, else true")
    dimensions: Optional[int] = Field(
        None, ge=1, description="keep the first N dimensions (matryoshka; then normalized), for "
        "models whose config says is_matryoshka or lists matryoshka_dimensions. A request's own "
        "`dimensions` wins")

    @model_validator(mode="before")
    @classmethod
    def _vllm_names(cls, data: Any) -> Any:
        """vLLM 0.32's other names: seq_pooling_type is what its pooling_type sets for CLS /
        LAST / MEAN (both set: refused, as vLLM refuses them); tok_pooling_type (ALL / STEP) is
        token-wise pooling, which an embedding never uses; the removed normalize."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.pop("tok_pooling_type", None) is not None:
            raise ValueError("tok_pooling_type is vLLM's token-wise pooling (ALL / STEP: one "
                             "vector per token, its token_embed / token_classify tasks), not "
                             "one embedding per prompt; set pooling_type or seq_pooling_type "
                             "(CLS, LAST or MEAN)")
        seq = data.pop("seq_pooling_type", None)
        if seq is not None:
            if data.get("pooling_type") is not None:
                raise ValueError("cannot set both pooling_type and seq_pooling_type (vLLM "
                                 "refuses it too); set one")
            if seq not in POOLING_TYPES:
                raise ValueError(f"seq_pooling_type must be CLS, LAST or MEAN (got {seq!r})")
            data["pooling_type"] = seq
        return cls._refuse_removed_and_token_wise(data)

    @staticmethod
    def _refuse_removed_and_token_wise(data: dict) -> dict:
        if "normalize" in data:
            raise ValueError("normalize was removed in vLLM; use use_activation (true: "
                             "L2-normalize each embedding)")
        if data.get("pooling_type") in TOKEN_POOLING_TYPES:
            # vLLM 0.32 takes them as its tok_pooling_type, which an embed job never uses
            raise ValueError(f"pooling_type {data['pooling_type']} is vLLM's token-wise pooling "
                             "(one vector per token: its token_embed / token_classify tasks), "
                             "not one embedding per prompt; use CLS, LAST or MEAN")
        return data


@dataclass
class Pooling:
    """An embedding model's pooling, decided (PoolerConfig's keys, filled) with what the model
    allows of `dimensions`; `sources` says where each key came from (the engine info shows it)."""

    pooling_type: str
    use_activation: bool
    dimensions: Optional[int]
    hidden_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: Optional[list[int]] = None
    sources: dict = field(default_factory=dict)

    def dimensions_problem(self, dimensions: int) -> Optional[str]:
        """What is wrong with `dimensions` for this model (vLLM's checks and wording), or None."""
        if not self.is_matryoshka:
            return (f"the model does not support matryoshka embeddings (its config.json sets "
                    f"neither is_matryoshka nor matryoshka_dimensions); leave dimensions unset "
                    f"(got {dimensions})")
        if not 1 <= dimensions <= self.hidden_size:
            return f"must be in [1, {self.hidden_size}] (the model's hidden size), got {dimensions}"
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            return (f"the model supports the matryoshka dimensions {self.matryoshka_dimensions}, "
                    f"got {dimensions}")
        return None

    def describe(self) -> dict:
        return {"pooling_type": self.pooling_type, "use_activation": self.use_activation,
                "dimensions": self.dimensions, "hidden_size": self.hidden_size,
                "sources": dict(self.sources)}


def _read_json(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def parse_pooling_type(name: str) -> str:
    """sentence-transformers' pooling mode name -> vLLM's type (its parse_pooling_type):
    pooling_mode_mean_tokens -> MEAN, pooling_mode_cls_token -> CLS, lasttoken -> LAST."""
    name = name.replace("pooling_mode_", "")
    if "_" in name:
        name = name.split("_", 1)[0]
    if "lasttoken" in name:
        name = "last"
    return name.upper()


def sentence_transformers_pooling(model_dir: Path) -> Optional[dict]:
    """{use_activation, pooling_type?, unsupported_mode?} from the model's modules.json and its
    Pooling module's config (None: no modules.json or no Pooling module, as vLLM reads them:
    then the architecture's and the pooler's defaults apply). Only pooling_mode* keys name a
    mode (others, such as include_prompt, are settings); a mode batchinfer cannot pool (max,
    weightedmean, ...) is reported, refused only where the recipe sets no pooling_type."""
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return None
    types = [m.get("type") for m in modules if isinstance(m, dict)]
    others = [t for t in types if t not in _ST_POOLING_MODULES | _ST_NORMALIZE_MODULES
              | _ST_PLAIN_MODULES]
    if others:
        raise ConfigError(f"{model_dir}/modules.json: sentence-transformers modules "
                          f"{', '.join(map(str, others))} are not supported (batchinfer runs "
                          "Transformer, Pooling and Normalize); embed with a model without them")
    pooling = next((m for m in modules if isinstance(m, dict)
                    and m.get("type") in _ST_POOLING_MODULES), None)
    if pooling is None:
        return None
    found: dict[str, Any] = {"use_activation": any(t in _ST_NORMALIZE_MODULES for t in types)}
    settings_file = model_dir / str(pooling.get("path", "")) / "config.json"
    for key, value in (_read_json(settings_file) or {}).items():
        if key == "pooling_mode" and isinstance(value, str):
            name = value
        elif key.startswith("pooling_mode_") and value is True:
            name = key
        else:
            continue
        kind = parse_pooling_type(name)
        if kind in POOLING_TYPES:
            found["pooling_type"] = kind
        else:
            found["unsupported_mode"] = (
                f"{settings_file}: pooling mode {name!r} is not supported; set "
                f"model.pooler_config.pooling_type to one of {', '.join(POOLING_TYPES)}")
    return found


def is_encoder(hf_config: dict) -> bool:
    """A bidirectional encoder by its model_type (vLLM's default pooling is the architecture's:
    a decoder whose config says is_causal: false still pools LAST)."""
    return hf_config.get("model_type") in ENCODER_MODEL_TYPES


def bidirectional_decoder_problem(hf_config: dict) -> Optional[str]:
    """A decoder whose config says is_causal: false: vLLM runs it bidirectionally, transformers'
    AutoModel (the embedding engine's) keeps it causal, so its embeddings would differ."""
    if is_encoder(hf_config) or hf_config.get("is_causal") is not False:
        return None
    return (f"model.path: config.json of this {hf_config.get('model_type')!r} decoder sets "
            "is_causal: false (bidirectional attention), which the embedding engine cannot run "
            "(transformers' AutoModel keeps a decoder causal); use strategy vllm, or a model "
            "without it")


def resolve_pooling(model_dir: Path, hf_config: dict, recipe: Optional[PoolerConfig]) -> Pooling:
    """The pooling an embedding job runs with (module docstring); a recipe `dimensions` the
    model cannot give is a ConfigError naming the key."""
    recipe = recipe or PoolerConfig()
    st = sentence_transformers_pooling(model_dir) or {}
    if "unsupported_mode" in st and recipe.pooling_type is None:
        raise ConfigError(st["unsupported_mode"])
    sources: dict[str, str] = {}

    def pick(key: str, default: Any) -> Any:
        if getattr(recipe, key) is not None:
            sources[key] = "recipe"
            return getattr(recipe, key)
        if key in st:
            sources[key] = "sentence_transformers"
            return st[key]
        sources[key] = "model_default"
        return default

    pooling_type = pick("pooling_type", "CLS" if is_encoder(hf_config) else "LAST")
    use_activation = pick("use_activation", True)
    hidden = int(hf_config.get("hidden_size") or hf_config.get("d_model") or 0)
    mds = hf_config.get("matryoshka_dimensions")
    pooling = Pooling(pooling_type, bool(use_activation), recipe.dimensions, hidden,
                      is_matryoshka=bool(mds) or bool(hf_config.get("is_matryoshka", False)),
                      matryoshka_dimensions=list(mds) if mds else None, sources=sources)
    if recipe.dimensions is not None:
        problem = pooling.dimensions_problem(recipe.dimensions)
        if problem:
            raise ConfigError(f"model.pooler_config.dimensions: {problem}")
    return pooling
