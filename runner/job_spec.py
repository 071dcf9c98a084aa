"""What a job is given and what it ends with: the spec, the outcome, exit codes, and the
engine facts its report keeps (runner/job.py runs it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from .io.inputs import Shard
from .recipe import Recipe

EXIT_OK, EXIT_REQUEST_ERRORS, EXIT_USAGE, EXIT_FAILED = 0, 1, 2, 3
ENGINE_INFO_KEYS = ("device", "dtype", "dtype_reason", "kv_cache_dtype", "attention_backend",
                    "kv_cache_bytes", "kv_block_size", "kv_capacity_tokens", "kv_window",
                    "kv_window_freed_blocks", "kv_groups", "num_params", "max_model_len",
                    "scheduler_policy", "strategy", "step_times", "parallel", "strategy_stats",
                    "prefix_cache", "preemption_mode", "kv_swap_blocks", "kv_swap",
                    "linear_kernel", "quantization", "moe_kernel", "expert_load", "cuda_graphs",
                    "async_scheduling", "num_threads", "task", "pooler",
                    "lora_modules", "max_lora_rank")
# ... and the key the strategy's own engine build reports under: the strategy's name


def default_output_dir(recipe_path: Optional[str], input_path: Path) -> Path:
    """Deterministic (no timestamp), so rerunning the same command resumes the same run."""
    recipe_stem = Path(recipe_path).stem if recipe_path else "recipe"
    return Path("runs") / f"{recipe_stem}__{Path(input_path).stem}"


@dataclass
class JobSpec:
    recipe: Recipe
    input_path: Path
    output_dir: Path
    recipe_path: Optional[str] = None
    resume: bool = True
    force_resume: bool = False             # resume even with another input, model or settings
    limit: Optional[int] = None
    shard: Shard = field(default_factory=Shard)
    progress: str = "auto"                 # auto | bar | lines | off
    engine_factory: Optional[Callable] = None   # EngineConfig -> Engine; default Engine.from_config


@dataclass
class JobOutcome:
    status: str                            # completed | interrupted | failed
    exit_code: int
    run_dir: Path
    outputs: int
    errors: int
    session: dict
    message: str = ""


def is_user_error(exc: BaseException) -> bool:
    """A bad recipe, model or input file (exit 2, nothing ran), not a failure of the run."""
    from batchinfer.engine.errors import ConfigError, ModelLoadError

    from .io.inputs import InputFileError

    return isinstance(exc, (ConfigError, ModelLoadError, InputFileError))
