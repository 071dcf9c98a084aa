"""The recipe: one YAML file that says what model, how to sample, which strategy, where outputs go.

    model:    {path, dtype, max_model_len, ...}       -> engine ModelConfig
    sampling: {temperature, max_tokens, ...}           -> default SamplingParams (vLLM names)
    strategy: {name: baseline, policy: hb, ...}        -> a registered strategy and its parameters
    parallel: {tp, pp, dp}
    memory:   {kv_cache_memory, block_size, ...}       -> engine CacheConfig
    device:   {device, num_threads, ...}               -> engine DeviceConfig
    io:       {input_format, output_dir, output_order, prompt_field, ...}
    predictor: {name: none|mean|oracle|bert, path, history_prompts, ...}
    report:   {refresh_seconds, plots, ...}

The sections compose the engine's own pydantic models, so a key means the same thing in a recipe
and in Python. Loading is yaml's SafeLoader (a key given twice refused) plus pydantic: a recipe is
data and never executes code.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import (ConfigDict, Field, SerializeAsAny, ValidationError,
                      ValidationInfo, field_validator)

from batchinfer.engine.strict_numbers import NumbersNotBooleans
from batchinfer.engine.config import (CacheConfig, DeviceConfig, EngineConfig, ModelConfig,
                                      ParallelConfig, parse_size)
from batchinfer.strategies.base import BaselineStrategy, StrategyParams
from .recipe_errors import RecipeError, YamlLines, suggest, validation_problems
from .shipped_files import missing_file_problem
from batchinfer.engine.request import SamplingParams


class _Strict(NumbersNotBooleans):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


def strategy_class(name: Any) -> type[StrategyParams]:
    """The parameter model registered for `name`; ValueError listing the known ones otherwise."""
    from batchinfer.strategies import STRATEGIES

    if isinstance(name, str) and name in STRATEGIES:
        return STRATEGIES[name]
    hint = suggest(str(name), STRATEGIES)
    known = ", ".join(sorted(STRATEGIES))
    raise ValueError(f"unknown strategy {name!r}" + (f"; did you mean '{hint}'?" if hint else ".")
                     + f" Known strategies: {known}")


# --- the other sections ---------------------------------------------------------------------------
class PredictorConfig(_Strict):
    """Output-length predictor (arXiv:2506.10470 §3.3) and the history every run writes to train it."""

    name: Literal["auto", "none", "mean", "oracle", "bert"] = Field(
        "auto", description="auto: for a strategy that reads forecasts, a BERT predictor trained "
        "on this model's own run history, else the one shipped for it, else the history's mean, "
        "else max_tokens (predictors/auto.py; the report says which); none: each request's "
        "max_tokens; mean: a history's mean; oracle: the true length from the input line; bert: "
        "a trained BERT length classifier")
    path: Optional[str] = Field(None, validate_default=True, description="bert: a directory made "
                                "by `batchinfer predictor train`; mean: that, or a run directory "
                                "holding history.jsonl; auto: where earlier runs are (default: "
                                "the directory holding this run's directory)")
    oracle_field: str = Field("max_tokens", description="oracle: where the input line holds the "
                              "true output length: max_tokens (a replayed trace sets it to the "
                              "recorded length, with ignore_eos) or metadata.<key>")
    batch_size: int = Field(64, ge=1, description="requests per predictor forward pass")
    encoder_int8: Union[Literal["auto"], bool] = Field(
        "auto", description="bert: run the encoder's linear layers in int8 (the engine's "
        "AVX512-VNNI kernel; ~1.8x faster, the head still reads fp32): auto: on a CPU that has "
        "the instructions; true: required (an error names the missing flags); false: fp32")
    encoder_bf16_attention: Union[Literal["auto"], bool] = Field(
        "auto", description="bert: run the encoder's attention in bf16 dot products over the "
        "prompts' own tokens, no padding (the engine's AVX512-BF16 kernel; fp32 softmax and "
        "sums): auto: on a CPU that has the instructions (and no AMX); true: required (an error "
        "says what is missing); false: torch's fp32 attention")
    history: bool = Field(True, description="append one history.jsonl line per finished request "
                          "(the training data of `batchinfer predictor train`)")
    history_prompts: Literal["text", "hash"] = Field(
        "text", description="text: keep each prompt in history.jsonl; hash: only its sha256")
    online: bool = Field(True, description="learn from the running job (bert and mean, and what "
                         "auto picks of them): each finished request is a labelled example; "
                         "every online_refit_every of them the predictor recalibrates on the "
                         "job's replies and re-forecasts the requests still waiting "
                         "(predictors/online.py); false: the forecasts made at admission stay")
    online_refit_every: int = Field(16, ge=1, description="finished requests between refits")
    online_min_examples: int = Field(8, ge=1, description="finished requests before the first "
                                     "refit")
    online_prior_weight: float = Field(8.0, ge=0, description="pseudo-examples the prior "
                                       "predictor's class means are worth against the job's "
                                       "own replies")
    online_head: bool = Field(True, description="also fit a ridge head on the cached encoder "
                              "embeddings (its strength chosen by leave-one-out error; off by "
                              "itself when it does not help); false: recalibrate the class "
                              "means only")
    online_head_se: float = Field(1.0, ge=0, description="the head stays off unless its "
                                  "leave-one-out error beats the classes' alone by this many "
                                  "standard errors, and takes the strongest regularisation "
                                  "within as many of the best (the one-standard-error rule); "
                                  "0: the least leave-one-out error, on at any gain")
    online_censored: bool = Field(True, description="also learn from the requests still "
                                  "decoding (at least the tokens they generated so far): the "
                                  "first to finish are the short ones")
    online_impute: Literal["job", "prior"] = Field(
        "job", description="with online_censored, what a decoding request that generated g "
        "tokens is expected to add: job: its class's mean as the job's replies put it (each "
        "class's lengths read as exponential, the prior's mean worth "
        "online_tail_prior_weight finished requests); prior: the prior's class mean, rescaled "
        "(the earlier rule: it cannot learn a class whose replies differ from the prior's)")
    online_tail_prior_weight: float = Field(
        32.0, ge=0, description="online_impute: job: finished requests the prior's "
        "(rescaled) class mean is worth in each class's censored estimate")
    upper_percentile: float = Field(75.0, gt=0, lt=100, description="the upper forecast each "
                                    "request carries: this percentile of the predictor's length "
                                    "distribution (a strategy that plans unsure requests for "
                                    "their upper forecast reads it)")

    @field_validator("path")
    @classmethod
    def _path(cls, v, info: ValidationInfo):
        if "name" not in info.data:   # the name itself is wrong: that is the error to show
            return v
        name = info.data["name"]
        if name == "auto":
            if v is not None and not Path(v).is_dir():
                raise ValueError(f"{_not_a_dir(v)} (auto learns from the run directories there)")
            return v
        if name not in ("bert", "mean"):
            if v is not None:
                raise ValueError(f"only the auto, bert and mean predictors read a path (name is "
                                 f"{name})")
            return v
        if not v:
            need = ("a directory made by `batchinfer predictor train`" if name == "bert" else
                    "a trained predictor directory or a run directory holding history.jsonl")
            raise ValueError(f"the {name} predictor needs a path: {need}")
        path = Path(v)
        if not path.is_dir():
            raise ValueError(_not_a_dir(v))
        if (path / "predictor.json").is_file():
            return v
        if name == "mean" and ((path / "history.jsonl").is_file()
                               or any(path.glob("part-*-of-*/history.jsonl"))):
            return v
        what = "predictor.json" if name == "bert" else "predictor.json or history.jsonl"
        raise ValueError(f"{v}: no {what} there (train a predictor with `batchinfer predictor "
                         "train --history RUN_DIR --out DIR`)")

    @field_validator("oracle_field")
    @classmethod
    def _oracle_field(cls, v: str):
        if v == "max_tokens" or (v.startswith("metadata.") and len(v) > len("metadata.")):
            return v
        raise ValueError("use max_tokens or metadata.<key>")


def _not_a_dir(v: str) -> str:
    """predictor.path is not a directory: a file there (a predictor's or a run's own file:
    its directory is meant), or nothing."""
    path = Path(v)
    if not path.is_file():
        return f"{v}: no such directory"
    if path.name in ("predictor.json", "history.jsonl"):
        return f"{v}: a file; give the directory holding it ({path.parent})"
    return f"{v}: a file, not a directory"


InputFormat = Literal["auto", "jsonl", "openai", "parquet", "arrow", "csv", "json"]


class IOConfig(_Strict):
    input_format: InputFormat = Field(
        "auto", description="auto: from the extension, and for JSONL from the first record")
    prompt_field: str = Field("prompt", description="dataset column holding the prompt text")
    messages_field: str = Field("messages", description="dataset column holding chat messages")
    id_field: str = Field("id", description="dataset column holding the request id")
    lora_field: str = Field("lora", description="dataset column naming the row's LoRA adapter "
                            "(model.lora_modules); an empty cell: the base model")
    metadata_fields: list[str] = Field(default_factory=list,
                                       description="dataset columns copied into metadata")
    chat_template: Literal["auto", "always", "never"] = Field(
        "auto", description="auto: apply to messages; always: also wrap plain prompts as a user "
        "turn; never: render messages as plain 'role: content' text")
    output_dir: Optional[str] = Field(None, description="run directory; default "
                                      "runs/<recipe>__<input>")
    output_order: Literal["completion", "input"] = "completion"
    max_in_flight: Optional[int] = Field(None, ge=1, description="requests read but not yet "
                                         "written; default 2 x max_num_seqs")
    group_prefixes: bool = Field(True, description="hold requests read ahead in a window "
                                 "sorted by prompt tokens and hand them to the engine in that "
                                 "order, so requests sharing a prefix run together "
                                 "(runner/read_ahead.py)")
    group_window: int = Field(1024, ge=0, description="with group_prefixes: requests read ahead "
                              "beyond max_in_flight to group (bounds memory with it)")
    dedup: bool = Field(True, description="compute a request once when its prompt and "
                        "deterministic sampling (greedy or seeded) equal an earlier one's in "
                        "flight; each gets its own result record")
    max_line_bytes: Union[int, str] = Field("4MiB", validate_default=True,
                                            description="longer input lines are errors")

    @field_validator("max_line_bytes")
    @classmethod
    def _size(cls, v):
        return parse_size(v)


class ReportConfig(_Strict):
    refresh_seconds: float = Field(5.0, gt=0, description="report.json/report.md refresh period")
    plots: bool = True
    plot_refresh_seconds: float = Field(30.0, gt=0,
                                        description="plot refresh period (a render costs ~0.5 s CPU)")
    metrics_interval_seconds: float = Field(1.0, gt=0, description="metrics.jsonl sample period")
    progress_interval_seconds: float = Field(10.0, gt=0,
                                             description="plain progress lines (not a TTY)")


class Recipe(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    strategy: SerializeAsAny[StrategyParams] = Field(default_factory=BaselineStrategy)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    memory: CacheConfig = Field(default_factory=CacheConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    io: IOConfig = Field(default_factory=IOConfig)
    predictor: PredictorConfig = Field(default_factory=PredictorConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)

    @field_validator("strategy", mode="before")
    @classmethod
    def _registered_strategy(cls, value):
        if isinstance(value, dict):
            return strategy_class(value.get("name", "baseline")).model_validate(value)
        return value

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model=self.model, cache=self.memory,
                            scheduler=self.strategy.scheduler_config(), device=self.device,
                            parallel=self.parallel, strategy=self.strategy)

    @property
    def max_in_flight(self) -> int:
        if self.io.max_in_flight:
            return self.io.max_in_flight
        return 2 * self.strategy.scheduler_config().max_num_seqs

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


SECTIONS = tuple(Recipe.model_fields)


def parse_recipe(data: Any, source: str = "<recipe>", text: Optional[str] = None) -> Recipe:
    """Validates recipe data (already parsed YAML); RecipeError lists every problem found."""
    lines = YamlLines(text) if text else None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(source, [f"the recipe must be a mapping of sections "
                                   f"({', '.join(SECTIONS)}), not {type(data).__name__}"])
    problems: list[str] = []
    # a section whose keys are all commented out reads as null: an empty section, its defaults
    data = {key: value for key, value in data.items() if value is not None or key not in SECTIONS}
    strategy = data.get("strategy")
    if strategy is not None:
        data["strategy"] = _validate_strategy(strategy, problems, lines)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        problems.extend(validation_problems(exc, Recipe, lines=lines))
        raise RecipeError(source, problems) from None
    if problems:
        raise RecipeError(source, problems)
    return recipe


def _validate_strategy(raw: Any, problems: list[str], lines: Optional[YamlLines]):
    """The strategy section against its registered parameter model (errors keyed strategy.*)."""
    at = lambda path: f"line {lines.line(path)}, " if lines and lines.line(path) else ""  # noqa: E731
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict):
        problems.append(f"{at(('strategy',))}strategy: must be a mapping like "
                        "{name: baseline, ...parameters}")
        return BaselineStrategy()
    try:
        cls = strategy_class(raw.get("name", "baseline"))
    except ValueError as exc:
        problems.append(f"{at(('strategy', 'name'))}strategy.name: {exc}")
        return BaselineStrategy()
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        problems.extend(validation_problems(exc, cls, prefix=("strategy",), lines=lines))
        return BaselineStrategy()


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (plain YAML keeps the last, so a
    second `sampling:` section would drop the first without a word)."""

    def construct_mapping(self, node, deep=False):
        first: dict = {}                # key -> the line it was first given on
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":      # `<<`: construct_mapping merges
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice (lines {first[key]} and {line}); "
                        "give each key once", key_node.start_mark)
                first[key] = line
            except TypeError:           # an unhashable key: construct_mapping says so
                break
        return super().construct_mapping(node, deep=deep)


def load_recipe(path: Union[str, Path]) -> Recipe:
    """Reads and validates a recipe file; every error names the file, line and key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(str(path), [missing_file_problem(path)]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(str(path), [f"cannot read it: {exc}"]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)   # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(str(path), [f"{where}not valid YAML ({problem})"]) from None
    recipe = parse_recipe(data, str(path), text)
    check_supported(recipe, str(path), YamlLines(text))
    return recipe


def check_supported(recipe: Recipe, source: str = "<recipe>", lines: Optional[YamlLines] = None) -> None:
    """Checks that need no model: the ones needing its shape (heads, layers) run at engine start."""
    from .embed_recipe import check_embed_recipe

    check_embed_recipe(recipe, source, lines)     # model.task: embed (and pooler_config)
    par = recipe.parallel
    if par.pp_layers is not None and len(par.pp_layers) != par.pp:
        line = lines.line(("parallel", "pp_layers")) if lines else None
        where = f"line {line}, parallel.pp_layers" if line else "parallel.pp_layers"
        raise RecipeError(source, [f"{where}: lists {len(par.pp_layers)} stages but pp is "
                                   f"{par.pp}; give one layer count per pipeline stage"])
