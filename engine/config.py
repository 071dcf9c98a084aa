"""Engine configuration: what model, how much KV memory, which batching policy, which device.

These pydantic models are the engine's half of the recipe schema (the recipe composes them), so an
error from here already names the key and what is allowed.
"""
from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, field_validator, model_validator

from .embedding.pooler_config import PoolerConfig
from .strict_numbers import NumbersNotBooleans

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_size(value: Union[int, float, str]) -> int:
    """'4GiB', '512 MB', 1e9 -> bytes."""
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError("a memory size must be positive")
        return int(value)
    match = _SIZE.match(value)
    if not match:
        raise ValueError(f"{value!r} is not a size; write e.g. 2GiB, 512MiB or a byte count")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit {unit!r}; use B, KiB, MiB, GiB (or KB, MB, GB)")
    if number <= 0:
        raise ValueError("a memory size must be positive")
    return int(number * _UNITS[unit])


# names transformers' apply_chat_template takes itself: as a template variable each would
# change how the conversation is rendered or returned, not what the template reads
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "chat_template", "tokenize", "add_generation_prompt",
    "continue_final_message", "tools", "documents", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def is_inline_template(value: str) -> bool:
    """A chat template written out (Jinja markup), not the path of a file holding one."""
    return "{{" in value or "{%" in value or "\n" in value


class _Strict(NumbersNotBooleans):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ModelConfig(_Strict):
    """Which weights to run. No path means the embedded default (SmolLM2-135M-Instruct)."""

    path: Optional[str] = Field(None, description="HF directory, .gguf file, or empty for the default")
    load_format: Literal["auto", "dummy"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    task: Literal["generate", "embed"] = Field(
        "generate", description="generate: replies (the default); embed: one embedding per "
        "prompt (vLLM's pooling runner, LLM.embed / /v1/embeddings; engine/embedding/); "
        "an empty path then embeds with the shipped all-MiniLM-L6-v2")
    pooler_config: Optional[PoolerConfig] = Field(
        None, description="task embed: vLLM's PoolerConfig keys (pooling_type, use_activation, "
        "dimensions); empty keys come from the model (docs/recipe.md)")
    quantization: Optional[Literal["int8"]] = Field(
        None, description="CPU: int8 linears (W8A8: int8 weights per output channel, int8 "
        "activations per token and per 64 input channels at each step, int32 sums) on CPUs with "
        "AVX512-VNNI (AMX-INT8 CPUs have it); no calibration. The LM head, MoE experts and "
        "routers stay in the model's dtype. Empty: the linears run in the model's dtype")
    quantize_lm_head: bool = Field(
        False, description="with quantization: the LM head in int8 too (faster for a large "
        "vocabulary; the logits sampling reads move further from the model's)")
    max_model_len: Optional[int] = Field(None, ge=16)
    tokenizer: Optional[str] = Field(None, description="tokenizer directory when it differs from path")
    chat_template: Optional[str] = Field(
        None, description="a Jinja chat template, or the path of a file holding one, in place of "
        "the tokenizer's (vLLM's --chat-template); empty: the tokenizer's own")
    chat_template_kwargs: dict = Field(
        default_factory=dict, description="template variables for every chat request, e.g. "
        "{enable_thinking: false} for Qwen3; a line's own chat_template_kwargs win key by key")
    # For load_format=dummy: override fields of the model's config.json (e.g. head counts).
    hf_overrides: dict = Field(default_factory=dict)
    seed: int = 0
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters, name -> a local PEFT adapter "
        "directory (adapter_config.json + adapter_model.safetensors, else .bin / .pt), as "
        "vLLM's --lora-modules; "
        "a request picks one with `lora: <name>` (an OpenAI batch line with its body's model)")
    max_lora_rank: int = Field(16, ge=1, description="the largest adapter rank accepted "
                               "(vLLM's default 16)")
    max_loras: Optional[int] = Field(
        None, ge=1, description="adapters one step may mix (vLLM's max_loras, default 1 there); "
        "empty: every adapter of lora_modules, all loaded at start")

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _vllm_list_forms(cls, value):
        """vLLM's --lora-modules forms as well: a list of "name=path" strings or of {name, path}
        objects (base_model_name allowed and unused), read into {name: path}."""
        if not isinstance(value, list):
            return value
        modules: dict = {}
        for item in value:
            if isinstance(item, str) and "=" in item:
                name, path = item.split("=", 1)
            elif isinstance(item, dict) and {"name", "path"} <= item.keys() <= {
                    "name", "path", "base_model_name"}:
                name, path = item["name"], item["path"]
            else:
                raise ValueError(f"{item!r}: a list entry is \"name=path\" or {{name: ..., "
                                 "path: ...} (vLLM's --lora-modules forms); or give a mapping "
                                 "{name: path}")
            if name in modules:
                raise ValueError(f"adapter {name!r} is named twice")
            modules[name] = path
        return modules

    @field_validator("lora_modules")
    @classmethod
    def _adapter_names(cls, value: dict) -> dict:
        for name, path in value.items():
            if not name or not name.strip():
                raise ValueError("an adapter's name must not be empty")
            if not path:
                raise ValueError(f"{name}: the adapter's directory is empty")
        return value

    @field_validator("chat_template")
    @classmethod
    def _template_or_its_file(cls, value: Optional[str]) -> Optional[str]:
        from pathlib import Path

        if value is None or is_inline_template(value):
            return value
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"{value!r} is neither a Jinja template (no {{{{ or {{% in it) nor "
                             "a file: give the template's text or the path of a file holding it")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict) -> dict:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & value.keys())
        if reserved:
            raise ValueError(f"{reserved[0]} is not a template variable but a rendering option "
                             "(add_generation_prompt and continue_final_message are set per line)")
        return value

    @model_validator(mode="after")
    def _lm_head_needs_quantization(self):
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("model.quantize_lm_head: true needs model.quantization (int8)")
        return self


class CacheConfig(_Strict):
    block_size: int = Field(16, ge=1, le=256)
    kv_cache_memory: Optional[Union[int, str]] = Field(
        None, description="KV budget (bytes or e.g. '2GiB'); empty: auto from free memory")
    memory_utilization: float = Field(0.9, gt=0.0, le=1.0,
                                      description="CPU: share of free memory auto may take; "
                                      "GPU, one process: share of the card's whole memory this "
                                      "engine may use (vLLM's gpu_memory_utilization)")
    kv_cache_dtype: Literal["auto", "bfloat16", "float16"] = Field(
        "auto", description="how K and V are stored: auto = the model's dtype; bfloat16 / float16 "
        "halve the cache's bytes on an fp32 model (twice the tokens in the same memory, half the "
        "DRAM traffic of decode attention) at the price of rounding K and V; the arithmetic "
        "stays in the model's dtype")
    enable_prefix_caching: bool = Field(
        False, description="automatic prefix caching: reuse the KV of full blocks a sequence "
        "shares with earlier ones, kept until their room is needed (LRU)")
    preemption_mode: Literal["recompute", "swap"] = Field(
        "recompute", description="what a sequence preempted for KV room loses: recompute drops "
        "its KV and computes its prompt and replies again when it returns (the papers' and "
        "vLLM's default); swap copies its KV to a swap area in host memory and back (vLLM's "
        "swap mode), where the strategy's scheduler brings swapped sequences back (the "
        "baseline's and the temporally-disaggregated pipeline's) on models with one block "
        "table; elsewhere it recomputes and the log says why")
    swap_space: Union[int, str] = Field(
        4 * 2**30, description="preemption_mode swap: host memory of each replica's swap area "
        "(bytes or e.g. '4GiB'); on CPU an automatic KV budget leaves it out where the job "
        "swaps (kv_swap.swap_area_used)")
    free_outside_window: bool = Field(
        True, description="sliding-window models: release a sequence's blocks that no later "
        "query can see, so it holds about window / block_size + 1 blocks, not its whole context "
        "(every layer windowed: Phi-3-mini, Qwen with use_sliding_window on all layers); with "
        "global layers among them (Gemma 2/3) the windowed layers' blocks, each layer group with "
        "its own block table (baseline strategy). false keeps every block in one table (the "
        "ablation; docs/engine.md, Paged KV cache)")

    def kv_window(self, arch) -> int:
        """The sliding window the block manager releases blocks outside of (0: none)."""
        return arch.kv_window() if self.free_outside_window else 0

    @field_validator("kv_cache_memory", "swap_space")
    @classmethod
    def _size(cls, v):
        return None if v is None else parse_size(v)

    @property
    def swap_bytes(self) -> int:
        """Host bytes the swap area takes (0 unless preemption_mode is swap)."""
        return parse_size(self.swap_space) if self.preemption_mode == "swap" else 0


class SchedulerConfig(_Strict):
    """Baseline batching. sb: separate prefill and decode batches (vLLM's classic scheduler).
    hb: hybrid batches, decode first then prefill chunks under a token budget (Sarathi-Serve)."""

    policy: Literal["sb", "hb"] = "hb"
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    chunk_size: Optional[int] = Field(None, ge=1, description="largest prefill chunk (hb); "
                                      "default: max_num_batched_tokens")
    async_scheduling: Optional[bool] = Field(
        None, description="schedule and launch the next step while the GPU runs this one (its "
        "sampled ids fed to the next step on the device, stop checks one step late, as vLLM's "
        "async scheduling): the host's work per step hides under the GPU's. One process, the "
        "baseline strategy, no prefix caching; requests with penalties run step by step. "
        "Empty: on with CUDA, off on CPU (where the forward runs on the host, nothing overlaps)")


class DeviceConfig(_Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: Optional[int] = Field(None, ge=1, description="CPU threads; default all cores")
    attention_backend: Literal["auto", "native", "triton", "torch"] = Field(
        "auto", description="native: compiled CPU paged-attention kernel; triton: the CUDA paged "
                            "kernel; torch: portable path; auto: native on CPU, triton on CUDA")
    bind_threads: Literal["auto", "none"] = Field(
        "none", description="auto: on CPU pin each compute thread to its own core (each worker "
                            "process its own run of cores among those the job may use); none: "
                            "leave placement to the OS")
    cuda_graphs: Optional[bool] = Field(
        None, description="CUDA, one GPU: pure-decode steps replay captured CUDA graphs "
                          "(engine/cuda_graphs.py); empty: on with the triton attention backend")
    moe_kernel: Literal["auto", "triton", "torch"] = Field(
        "auto", description="a mixture of experts' experts on CUDA: triton: every expert in two "
                            "grouped kernels, no host read (engine/triton_moe.py); torch: one "
                            "GEMM chain per expert that got tokens (each layer reads its counts "
                            "on the host); auto: triton where triton imports. On CPU the experts "
                            "run the CPU's kernels")
    max_seq_len_to_capture: int = Field(
        8192, ge=1, description="CUDA graphs cover decode steps whose longest sequence is at "
                                "most this many tokens; longer ones run eagerly (vLLM's knob)")


class ParallelConfig(_Strict):
    """How many processes run the model: tp x pp ranks per replica, dp replicas.

    Anything but 1/1/1 runs on worker processes (engine/runtime/) exchanging tensors through
    torch.distributed; the controller (this process) keeps requests, block tables and scheduling.
    """

    tp: int = Field(1, ge=1, description="tensor-parallel degree")
    pp: int = Field(1, ge=1, description="pipeline-parallel depth")
    dp: int = Field(1, ge=1, description="data-parallel replicas")
    pp_layers: Optional[list[int]] = Field(
        None, description="layers per pipeline stage, e.g. [17, 13]; default: from pp_balance")
    pp_balance: Literal["compute", "layers"] = Field(
        "compute", description="default split: equal work per generated token on each stage (the "
                               "last stage's LM head counted) or equal layer counts")
    tp_all_reduce: Literal["shm", "gloo"] = Field(
        "shm", description="how tensor-parallel ranks on a CPU host sum their partial results: "
                           "through shared memory, or gloo's all-reduce (loopback TCP, 0.6-2 ms "
                           "a call); on CUDA NCCL either way (gloo over host "
                           "copies with gpu_transport: host)")
    stage_transport: Literal["structured", "metadata"] = Field(
        "structured", description="activations between pipeline stages: structured (structure-"
                                  "aware transmission: receives posted from the plan, no "
                                  "per-transfer metadata) or metadata (a metadata message "
                                  "before each transfer and a blocking receive, as vLLM's "
                                  "send_tensor_dict)")
    gpu_transport: Literal["nccl", "host"] = Field(
        "nccl", description="how ranks on CUDA exchange tensors: NCCL, one GPU per rank; or host "
                            "(gloo through pinned host memory), which lets several ranks share "
                            "a GPU (slower: a test and small-GPU configuration). CPU ranks use "
                            "gloo either way")
    sequence_cache: bool = Field(
        True, description="workers keep each running sequence's block tables and plans carry "
                          "only what changed since the last plan (the entries added, or a "
                          "table changed otherwise, whole): the SequenceCache of arXiv:2506.22033 "
                          "§5.2; false: whole tables in every plan")
    threads_per_rank: Optional[int] = Field(
        None, ge=1, description="CPU threads of each worker; default: the cores split evenly")
    step_timeout_seconds: float = Field(
        600.0, gt=0, description="longest wait for a micro-batch's result before the run fails")
    startup_timeout_seconds: float = Field(
        900.0, gt=0, description="longest wait for the workers to load their model partitions")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def multiprocess(self) -> bool:
        return self.world_size > 1

    def stages_through_host(self, device_type: str) -> bool:
        """Whether ranks on this device exchange tensors through host memory, so several may
        share a GPU (gpu_transport: host on CUDA; engine/runtime/transport.py)."""
        return device_type == "cuda" and self.gpu_transport == "host"


class EngineConfig(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    # The recipe's strategy (a StrategyParams): builds each replica's scheduler and prepares the
    # engine. None: the baseline policy of `scheduler`.
    strategy: Optional[Any] = Field(None, exclude=True)

    @field_validator("strategy")
    @classmethod
    def _strategy_params(cls, v):
        """A name or a dict here would fail deep in the build ('str' object has no attribute
        ...): the engine does not know the registry (batchinfer.strategies does)."""
        if v is None or all(callable(getattr(v, hook, None))
                            for hook in ("scheduler_config", "make_scheduler", "check_config")):
            return v
        raise ValueError(f"a strategy's parameters (a StrategyParams), not {type(v).__name__} "
                         f"{v!r}: from batchinfer.strategies import STRATEGIES; "
                         "EngineConfig(strategy=STRATEGIES[name](**its keys), ...)")

    @model_validator(mode="after")
    def _strategy_batching(self):
        """A strategy's own batching knobs (max_num_seqs, max_num_batched_tokens) are what the
        build sizes activations and CUDA graphs for, unless `scheduler` is given as well."""
        if self.strategy is not None and "scheduler" not in self.model_fields_set:
            try:
                self.scheduler = self.strategy.scheduler_config()
            except NotImplementedError:     # a strategy with no batching knobs of its own
                pass
        return self

    def make_scheduler(self, block_manager, max_model_len: int, pipeline_depth: int = 1):
        if self.strategy is not None:
            return self.strategy.make_scheduler(block_manager, max_model_len, pipeline_depth)
        from .batching_policies import scheduler_from_config

        return scheduler_from_config(self.scheduler, block_manager, max_model_len, pipeline_depth)
