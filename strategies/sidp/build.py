"""Assembles a SiDP engine: d data-parallel workers sharing one FFN store, each with the KV cache
its freed FFN memory buys (the per-replica memory budget stays plain DP's). On CUDA the replicas
share one GPU (parallel.gpu_transport: host) and the store lives in its memory (ffn_store.py)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from batchinfer.engine.build import kv_element_bytes
from batchinfer.engine.cpu_binding import numa_nodes
from batchinfer.engine.cpu_dtype import activation_dtype
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.kv_groups import kv_capacity
from batchinfer.engine.runtime.build import (assemble_engine, per_rank_kv_budget, plan_parallel,
                                             rank_bytes_per_block, start_workers)

from .executor import SiDPExecutor
from .ffn_store import FFNStore, blocked_layout_available
from .mode_switch import ModeSwitch, profiled_threshold
from .orchestrator import Orchestrator
from .ownership import prefetch_order, resolve_owners, weight_slots
from .shared_ffn import SiDPWorkerSpec
from .worker import SiDPWorker

log = logging.getLogger("batchinfer")


def freed_ffn_bytes(rank: int, owners: list[int], dp: int, layer_bytes: int,
                    with_slots: bool = True) -> int:
    """FFN bytes a rank no longer holds: the layers it does not own, less its weight slots."""
    remote = len(prefetch_order(rank, owners, dp))
    return (remote - weight_slots(rank, owners, dp, with_slots)) * layer_bytes


def sidp_num_blocks(config, layout, arch, device, dtype_bytes: int, owners: list[int],
                    layer_bytes: int, with_slots: bool, available=None, groups=None) -> int:
    """KV blocks per replica: plain DP's per-rank budget plus the FFN bytes each rank no longer
    holds (the simulator sizes SiDP's cache with it too; available: as kv_budget's; groups: the
    KV layer groups, whose blocks are pages of fewer layers)."""
    budget = per_rank_kv_budget(config, layout, arch, device, dtype_bytes, available, groups)
    kv_bytes = kv_element_bytes(config, dtype_bytes)
    return min((budget + freed_ffn_bytes(r, owners, layout.dp, layer_bytes, with_slots))
               // rank_bytes_per_block(layout, arch, r, config.cache.block_size, kv_bytes,
                                       groups)
               for r in range(layout.world_size))


def resolve_weight_slots(requested: Optional[bool], device, nodes: Optional[int] = None,
                         one_gpu: bool = False) -> bool:
    """The recipe's weight_slots, or where unset: slots (the paper's WaS) when a remote read is
    slower than a local one (CUDA peers, or a CPU set over several NUMA nodes); in place when the
    replicas share one memory (one CPU memory, or `one_gpu`: replicas sharing a GPU), where a
    slot copy buys nothing and costs bandwidth. device: a torch.device or its type; nodes: the
    CPU set's NUMA nodes (default: this host's; the simulator passes its host's)."""
    if requested is not None:
        return requested
    if getattr(device, "type", device) != "cpu":
        return not one_gpu
    return (numa_nodes() if nodes is None else nodes) > 1


def check_one_gpu(config, dp: int, visible: Optional[int] = None) -> None:
    """SiDP on CUDA: every replica on one GPU, where the controller's FFN store lives."""
    from batchinfer.engine.runtime.layout import ranks_per_device

    if config.parallel.gpu_transport != "host":
        raise ConfigError("strategy sidp on CUDA runs its replicas on one GPU, which holds the "
                          "FFN store they share: set parallel.gpu_transport: host (owner "
                          "buffers spread over several GPUs are not built)")
    if ranks_per_device(config.parallel, "cuda", dp, visible) != dp:
        raise ConfigError(f"strategy sidp on CUDA runs its {dp} replicas on one GPU, and torch "
                          "sees several: make one visible (CUDA_VISIBLE_DEVICES=0)")


def check_sidp_layout(par) -> None:
    if par.tp != 1 or par.pp != 1 or par.dp < 2:
        key = "tp" if par.tp != 1 else "pp" if par.pp != 1 else "dp"    # the line to point at
        raise ConfigError(f"parallel.{key}: strategy sidp shares FFN weights between "
                          f"data-parallel replicas of one rank each; needs tp: 1, pp: 1, "
                          f"dp >= 2 (got tp: {par.tp}, pp: {par.pp}, dp: {par.dp})")


def mlp_adapter_refusal(model_cfg, arch) -> Optional[str]:
    """LoRA adapters on attention run under SiDP (each replica computes its own attention); one
    on the MLP is refused: the shared FFN (and a CaS round's owner, over other replicas' rows)
    computes the base weights alone, so the adapter's MLP delta would be silently lost."""
    from batchinfer.engine.model.lora_adapters import lora_spec, read_adapter

    spec = lora_spec(model_cfg)
    for name, path in spec.modules if spec is not None else ():
        mlp = sorted(m.split(".")[1] for m in read_adapter(name, path, arch, spec.max_rank,
                                                          layers=range(0)).targets
                     if m.startswith("mlp."))
        if mlp:
            return (f"model.lora_modules.{name}: strategy sidp shares each layer's FFN between "
                    f"replicas and applies no LoRA there; this adapter targets {', '.join(mlp)}: "
                    "use an adapter on attention only (q/k/v/o_proj) or another strategy "
                    "(baseline, gllm, tdpipe, sipipe)")
    return None


def check_sidp_model(config, params, arch) -> None:
    """The model and number format SiDP's shared FFN store is built for (the build and
    `batchinfer validate` both refuse the rest)."""
    if arch.moe is not None:
        raise ConfigError(f"strategy sidp shares each layer's dense FFN weights; this model "
                          f"({arch.model_type}) has a mixture of experts: run it with another "
                          "strategy (baseline, gllm, tdpipe, seesaw, sipipe)")
    if config.model.quantization is not None:
        raise ConfigError("model.quantization: strategy sidp shares each layer's FFN weights "
                          "between replicas in the fp32 blocked layout; int8 is not built for it: "
                          "leave model.quantization empty, or run another strategy (baseline, "
                          "gllm, tdpipe, seesaw, sipipe)")
    refusal = mlp_adapter_refusal(config.model, arch)
    if refusal:
        raise ConfigError(refusal)
    if arch.hidden_act != "silu":
        raise ConfigError(f"strategy sidp's shared FFN computes SiLU-gated MLPs; this model "
                          f"({arch.model_type}) gates with {arch.hidden_act}: run it with "
                          "another strategy (baseline, gllm, tdpipe, seesaw, sipipe)")


def build_sidp_engine(config, params):
    par = config.parallel
    check_sidp_layout(par)
    plan = plan_parallel(config)
    setup, layout, arch = plan.setup, plan.layout, plan.setup.arch
    try:
        owners = resolve_owners(params.owners, arch.num_layers, layout.dp)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if setup.device.type == "cuda":
        check_one_gpu(config, layout.dp)
    check_sidp_model(config, params, arch)
    with_slots = resolve_weight_slots(params.weight_slots, setup.device,
                                      one_gpu=setup.device.type == "cuda")
    # the shared FFN computes in the activations' dtype: fp32 for a bf16 model on CPU, whose
    # shared FFN weights stay fp32 (only the attention's linears get bf16 weights there)
    store_dtype = activation_dtype(setup.device, setup.dtype)
    blocked = blocked_layout_available(arch.hidden_size, arch.intermediate_size, store_dtype,
                                       setup.device.type)
    block_size = config.cache.block_size
    # sized before the store is allocated: the free memory measured must still include it
    num_blocks = sidp_num_blocks(config, layout, arch, setup.device, setup.dtype_bytes, owners,
                                 FFNStore.bytes_per_layer(arch.hidden_size,
                                                          arch.intermediate_size, store_dtype),
                                 with_slots, groups=plan.kv_groups)
    store = FFNStore.allocate(arch.num_layers, arch.hidden_size, arch.intermediate_size,
                              store_dtype, blocked=blocked, device=setup.device)
    plain_blocks, plan = plan.num_blocks, dataclasses.replace(plan, num_blocks=num_blocks)
    profile = params.compute_service and params.batch_threshold is None
    spec = SiDPWorkerSpec(store, owners, layout.dp, params.peak_shifting, with_slots,
                          params.compute_service, params.gemm_fusion, profile_costs=profile)
    pool = start_workers(config, setup, layout, num_blocks, plan.threads,
                         extension=SiDPWorker(spec), kv_groups=plan.kv_groups)
    pool.shared += [store.gate_up, store.down]     # CUDA IPC: the workers map the store
    threshold, costs = params.batch_threshold, None
    if profile:
        costs = pool.infos[0]["sidp_costs"]
        threshold = profiled_threshold(costs["was_s"], costs["cas_s"])
        log.info("SiDP: B_th = %d (profiled FFN path of a forward, WaS / CaS ms by rows: %s)",
                 threshold, ", ".join(f"{b}: {costs['was_s'][b] * 1e3:.1f} / "
                                      f"{costs['cas_s'][b] * 1e3:.1f}" for b in costs["was_s"]))
    switch = ModeSwitch(threshold or 1, params.mode_switch_patience,
                        params.mode_switch_hysteresis, enabled=params.compute_service)
    orchestrator = Orchestrator(pool, layout.dp, switch, params.dummy_skipping)
    timeout = par.step_timeout_seconds
    info = {"sidp": {
        "owners": owners, "peak_shifting": params.peak_shifting,
        "weight_slots": with_slots, "ffn_layout": "blocked" if blocked else "rows",
        "compute_service": params.compute_service, "batch_threshold": threshold,
        "batch_threshold_costs": costs,
        "ffn_store_bytes": store.layer_bytes() * arch.num_layers,
        "weight_slots_per_rank": [weight_slots(r, owners, layout.dp, with_slots)
                                  for r in range(layout.dp)],
        # in tokens of sequences that release nothing, as kv_capacity_tokens counts them
        "kv_tokens_per_replica": kv_capacity(plan.kv_groups, num_blocks, block_size,
                                             setup.max_model_len)[0],
        "plain_dp_kv_tokens_per_replica": kv_capacity(plan.kv_groups, plain_blocks, block_size,
                                                      setup.max_model_len)[0],
        "kv_capacity_vs_plain_dp": round(num_blocks / plain_blocks, 3) if plain_blocks else None}}
    log.info("SiDP: %d replicas share one FFN store (%.0f MiB); KV per replica %d tokens "
             "(plain DP: %d)", layout.dp, info["sidp"]["ffn_store_bytes"] / 2**20,
             info["sidp"]["kv_tokens_per_replica"], info["sidp"]["plain_dp_kv_tokens_per_replica"])
    return assemble_engine(config, plan, lambda replica, block_manager: SiDPExecutor(
        pool, layout, replica, block_manager, timeout, orchestrator), extra_info=info,
        scheduler_of=lambda block_manager: params.make_scheduler(
            block_manager, setup.max_model_len, layout.pp))
