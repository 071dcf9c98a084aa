"""A recipe's refusals for an embedding job (`model.task: embed`), and of embedding keys on a
generation job: each names the key and what is allowed."""
from __future__ import annotations

from typing import Optional

from batchinfer.strategies.base import StrategyParams

from .recipe_errors import RecipeError, YamlLines



def embed_strategies() -> list[str]:
    """The registered strategies an embedding job may run with (StrategyParams.runs_embeddings)."""
    from batchinfer.strategies import STRATEGIES

    return sorted(name for name, cls in STRATEGIES.items()
                  if cls.model_construct().runs_embeddings())


def uses_builtin_embedding_engine(recipe) -> bool:
    """Whether the job embeds with batchinfer's embedding engine (a strategy without an engine
    of its own: baseline), whose refusals validate then makes too."""
    return type(recipe.strategy).build_engine is StrategyParams.build_engine


def embed_recipe_problems(recipe, lines: Optional[YamlLines] = None) -> list[str]:
    def at(*path: str) -> str:
        line = lines.line(path) if lines else None
        return f"line {line}, " if line else ""

    model = recipe.model
    if model.task != "embed":
        if model.pooler_config is not None:
            return [f"{at('model', 'pooler_config')}model.pooler_config: applies to embedding "
                    "jobs; set model.task: embed, or remove it"]
        return []
    problems = []
    name = recipe.strategy.name
    if not recipe.strategy.runs_embeddings():
        problems.append(f"{at('strategy', 'name')}strategy.name: {name} schedules generation; "
                        f"an embedding job (model.task: embed) runs with "
                        f"{' or '.join(embed_strategies())}")
    for key in sorted(recipe.sampling.model_fields_set):
        problems.append(f"{at('sampling', key)}sampling.{key}: an embedding job (model.task: "
                        "embed) does not sample; remove the sampling section")
    if recipe.predictor.name not in ("auto", "none"):
        problems.append(f"{at('predictor', 'name')}predictor.name: {recipe.predictor.name} "
                        "predicts reply lengths; an embedding job has none (allowed: auto, none)")
    par = recipe.parallel
    if uses_builtin_embedding_engine(recipe) and (par.tp, par.pp, par.dp) != (1, 1, 1):
        problems.append(f"{at('parallel')}parallel: the embedding engine runs in one process "
                        f"(tp, pp and dp 1; got tp {par.tp}, pp {par.pp}, dp {par.dp}); run "
                        "Slurm shards (srun -n N) to embed on several hosts")
    if model.quantization is not None:
        problems.append(f"{at('model', 'quantization')}model.quantization: not applied to "
                        "embedding models; remove it (model.dtype: bfloat16 halves the weights)")
    if getattr(model, "lora_modules", None):
        problems.append(f"{at('model', 'lora_modules')}model.lora_modules: LoRA adapters apply "
                        "to generation jobs")
    if model.path and str(model.path).endswith(".gguf"):
        problems.append(f"{at('model', 'path')}model.path: an embedding job reads a Hugging "
                        "Face directory, not a .gguf file")
    return problems


def check_embed_recipe(recipe, source: str = "<recipe>", lines: Optional[YamlLines] = None
                       ) -> None:
    problems = embed_recipe_problems(recipe, lines)
    if problems:
        raise RecipeError(source, problems)
