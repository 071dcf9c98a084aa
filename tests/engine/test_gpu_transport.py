"""Several ranks on one GPU (`parallel.gpu_transport: host`, engine/runtime/transport.py).

NCCL refuses two ranks on one device, so ranks that share a GPU send their tensors through pinned
host memory over gloo. On a CUDA machine the end-to-end tests below run the real thing (PP=2,
TP=2, DP=2 and a Seesaw switch on one GPU give the single process's greedy tokens); on a CPU host
the same tests copy every CPU tensor through a host buffer instead (the transport's CPU test
mode), so the staged sends, receives and collectives run in CI. The NCCL path (one GPU per rank)
is not tested here: the project's GPU machines lend one card.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from batchinfer.engine.config import EngineConfig, ParallelConfig
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.model.arch import arch_from_dict
from batchinfer.engine.runtime import build as runtime_build
from batchinfer.engine.runtime import layout as runtime_layout
from batchinfer.engine.runtime import transport
from batchinfer.engine.runtime.layout import (ParallelLayout, check_gpu_count,
                                              ranks_per_device)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --- choosing the transport and sizing the ranks ----------------------------------------------
def test_nccl_only_for_cuda_ranks_that_own_a_gpu():
    assert transport.backend("cuda", staged=False) == "nccl"
    assert transport.backend("cuda", staged=True) == "gloo"
    assert transport.backend("cpu", staged=False) == "gloo"
    assert transport.describe("cpu", False) is None
    assert transport.describe("cpu", True).startswith("host")   # the tests' CPU mode
    assert transport.describe("cuda", False) == "nccl"
    assert transport.describe("cuda", True).startswith("host")


def test_a_layout_wider_than_the_visible_gpus_names_its_counts_and_the_way_out():
    with pytest.raises(ConfigError, match=r"parallel: tp=2 x pp=2 x dp=1 is 4 ranks, one GPU "
                                          r"each over NCCL, and torch sees 1 GPU; .*"
                                          r"gpu_transport: host"):
        check_gpu_count(ParallelConfig(tp=2, pp=2), "cuda", 4, visible=1)
    check_gpu_count(ParallelConfig(tp=2, pp=2, gpu_transport="host"), "cuda", 4, visible=1)
    check_gpu_count(ParallelConfig(tp=2, pp=2), "cuda", 4, visible=4)
    check_gpu_count(ParallelConfig(tp=2, pp=2), "cpu", 4, visible=0)


def test_ranks_share_gpus_round_robin_under_the_host_transport():
    host = ParallelConfig(tp=2, pp=2, gpu_transport="host")
    assert ranks_per_device(host, "cuda", 4, visible=1) == 4
    assert ranks_per_device(host, "cuda", 4, visible=2) == 2
    assert ranks_per_device(host, "cuda", 3, visible=2) == 2
    assert ranks_per_device(ParallelConfig(tp=2, pp=2), "cuda", 4, visible=1) == 1
    assert ranks_per_device(host, "cpu", 4, visible=0) == 1


def test_ranks_sharing_a_gpu_split_its_memory_each_with_its_own_working_memory(monkeypatch):
    """Two PP ranks on one GPU: each gets half the usable memory, less one forward's working
    memory and its half of the weights; over NCCL (a GPU each) a rank gets a GPU's worth, as does
    a simulated GPU (an `available` given). Ranks that leave nothing for their KV are refused."""
    from batchinfer.engine import build as engine_build
    from batchinfer.engine.build import activation_headroom

    monkeypatch.setattr(runtime_layout, "visible_gpus", lambda: 1)
    free = {"bytes": 40 << 30}
    monkeypatch.setattr(engine_build, "available_memory", lambda device: free["bytes"])
    arch = arch_from_dict({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                           "num_hidden_layers": 4, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "vocab_size": 1000,
                           "max_position_embeddings": 512}, "test")
    gpu = torch.device("cuda")

    def budget(available=None, **parallel):
        config = EngineConfig(parallel={"pp": 2, **parallel})
        layout = ParallelLayout.resolve(config.parallel, arch)
        return runtime_build.per_rank_kv_budget(config, layout, arch, gpu, 2, available)

    config = EngineConfig()
    headroom = activation_headroom(arch, config.scheduler.max_num_batched_tokens,
                                   config.scheduler.max_num_seqs, 2)
    usable = free["bytes"] * config.cache.memory_utilization
    half_weights = arch.num_params() * 2 // 2
    assert budget() == int(usable - headroom) - half_weights
    shared = budget(gpu_transport="host")
    assert shared == (int(usable - headroom) + headroom) // 2 - headroom - half_weights
    assert shared < budget() / 2
    assert budget(free["bytes"], gpu_transport="host") == budget()     # simulated: a GPU each
    free["bytes"] = 1 << 30                   # room for one forward's working memory, not two
    with pytest.raises(ConfigError, match=r"puts 2 ranks on each GPU.*nothing is left for "
                                          r"their KV caches"):
        budget(gpu_transport="host")


# --- the staged messages themselves (two gloo processes) ----------------------------------------
def _exchange(rank: int, store_path: str) -> None:
    import torch.distributed as dist

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    transport.configure(True, stage_cpu_tensors=True)
    try:
        values = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        if rank == 0:
            work = transport.isend(values.clone(), 1, tag=5)
            assert isinstance(work, transport.StagedSend)
            work.wait()
            assert work.wait() and work.is_completed()     # again: no second gloo wait
            sent = values.clone()
            work = transport.isend(sent, 1, tag=6)
            sent.add_(100)           # the staged copy was taken at isend: the peer sees values
            work.wait()
            transport.send(values.to(torch.bfloat16), 1, tag=7)
        else:
            posted = torch.zeros(2, 3)
            work = transport.irecv(posted, 0, tag=5)
            assert isinstance(work, transport.StagedReceive) and work.host is not posted
            assert not work.is_completed()                  # delivered only by wait()
            work.wait()
            assert torch.equal(posted, values)
            assert work.wait() and work.is_completed()
            later = torch.zeros(2, 3)
            transport.irecv(later, 0, tag=6).wait()
            assert torch.equal(later, values)
            blocking = torch.zeros(2, 3, dtype=torch.bfloat16)
            transport.recv(blocking, 0, tag=7)
            assert torch.equal(blocking, values.to(torch.bfloat16))
        mine = torch.full((4,), float(rank + 1))
        assert transport.all_reduce(mine) is mine and torch.equal(mine, torch.full((4,), 3.0))
        parts = transport.all_gather(torch.full((2,), float(rank)))
        assert [p.tolist() for p in parts] == [[0.0, 0.0], [1.0, 1.0]]
        transport.barrier()
    finally:
        transport.configure(False)
        dist.destroy_process_group()


def test_staged_sends_receives_and_collectives_deliver_the_values(tmp_path):
    mp.spawn(_exchange, args=(str(tmp_path / "store"),), nprocs=2, join=True)


def test_without_staging_the_calls_are_torch_distributed_itself():
    transport.configure(False)
    cpu = torch.zeros(2)
    assert not transport._stages(cpu)
    transport.configure(True)                       # CUDA tensors only: a CPU one goes as it is
    try:
        assert not transport._stages(cpu)
    finally:
        transport.configure(False)


# --- the runtime through the staged transport ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from tests.tiny_families import hf_model, save_model, tokenizer_dir

    return save_model(hf_model("llama3", num_hidden_layers=4), tmp_path_factory.mktemp("llama3"),
                      tokenizer_dir())


PROMPTS = [list(range(10 + i, 30 + 7 * i)) for i in range(6)]


def _config(model_dir: Path, **sections) -> EngineConfig:
    parallel = {"gpu_transport": "host", "step_timeout_seconds": 120,
                **sections.pop("parallel", {})}
    return EngineConfig(model={"path": str(model_dir), "dtype": "float32", "max_model_len": 128},
                        device={"device": DEVICE}, parallel=parallel,
                        cache=sections.pop("cache", {"kv_cache_memory": "4MiB"}), **sections)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model={"path": str(tiny_llama_dir), "dtype": "float32",
                                 "max_model_len": 256},
                          device={"device": DEVICE}, cache={"kv_cache_memory": "4MiB"})
    with Engine.from_config(config) as engine:
        return params, [o.output_token_ids for o in engine.generate(PROMPTS, params)]


@pytest.fixture
def staged_on_this_host(monkeypatch):
    """On a CPU host, the workers copy every tensor through a host buffer (the transport's CPU test
    mode); on a GPU, gpu_transport: host is the real configuration."""
    if DEVICE == "cpu":
        monkeypatch.setattr(runtime_build, "staged_transport", lambda config, device_type: True)


LAYOUTS = [
    pytest.param({"pp": 2}, {"policy": "hb", "chunk_size": 16, "max_num_batched_tokens": 48},
                 id="pp2-hb-chunks"),
    pytest.param({"tp": 2, "tp_all_reduce": "gloo"}, {"policy": "sb"}, id="tp2"),
    pytest.param({"dp": 2}, {"policy": "hb"}, id="dp2", marks=pytest.mark.skipif(
        DEVICE == "cpu", reason="replicas exchange no tensors: nothing staged on a CPU host")),
]


@pytest.mark.slow
@pytest.mark.parametrize("parallel,scheduler", LAYOUTS)
def test_ranks_on_one_device_give_the_single_process_tokens(tiny_llama_dir, reference,
                                                            staged_on_this_host, parallel,
                                                            scheduler):
    from batchinfer.engine.engine import Engine

    params, expected = reference
    config = _config(tiny_llama_dir, parallel=parallel, scheduler=scheduler)
    with Engine.from_config(config) as engine:
        got = [o.output_token_ids for o in engine.generate(PROMPTS, params)]
        info = engine.info["parallel"]
    assert got == expected
    assert info["gpu_transport"].startswith("host")


@pytest.mark.slow
def test_a_seesaw_switch_on_one_device_gives_the_single_process_tokens(tiny_llama_dir, reference,
                                                                       staged_on_this_host):
    """PP=2 for prefill, TP=2 for decode, both ranks on one device: weights re-sharded at the
    switch, prompts' KV waiting in the CPU store (the device cache holds under half the job),
    activations and all-reduces staged."""
    from batchinfer.engine.engine import Engine
    from batchinfer.strategies.seesaw.params import SeesawParams

    params, expected = reference
    seesaw = SeesawParams(decode_tp=2, decode_pp=1, cpu_kv_cache_memory="8MiB")
    config = _config(tiny_llama_dir, parallel={"pp": 2, "tp_all_reduce": "gloo"},
                     scheduler=seesaw.scheduler_config(), strategy=seesaw,
                     cache={"kv_cache_memory": "80KiB"})   # ~150 of the job's ~320 tokens
    with Engine.from_config(config) as engine:
        got = [o.output_token_ids for o in engine.generate(PROMPTS, params)]
        stats = engine.stats()["strategy_stats"]
    assert got == expected
    assert stats["num_switches"] >= 1 and stats["swapped_out_tokens"] > 0
    assert stats["swapped_in_tokens"] == stats["swapped_out_tokens"]


@pytest.mark.slow
def test_a_sipipe_pipeline_on_one_device_gives_the_single_process_tokens(tiny_llama_dir,
                                                                         staged_on_this_host):
    """SiPipe at PP=2 with every penalty on (the paper's setting), its CPU sampler pool reading
    the last stage's logits (on a GPU: copied through pinned slots on a stream of their own,
    strategies/sipipe/cuda_logits.py), both stages on one device."""
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams
    from batchinfer.strategies.sipipe.params import SiPipeParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                            repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)
    single = EngineConfig(model={"path": str(tiny_llama_dir), "dtype": "float32",
                                 "max_model_len": 128},
                          device={"device": DEVICE}, cache={"kv_cache_memory": "4MiB"})
    with Engine.from_config(single) as engine:
        expected = [o.output_token_ids for o in engine.generate(PROMPTS, params)]
    sipipe = SiPipeParams(policy="hb", chunk_size=16, max_num_batched_tokens=48)
    config = _config(tiny_llama_dir, parallel={"pp": 2}, scheduler=sipipe.scheduler_config(),
                     strategy=sipipe)
    with Engine.from_config(config) as engine:
        got = [o.output_token_ids for o in engine.generate(PROMPTS, params)]
        info = engine.info
    assert got == expected
    assert info["sipipe"]["cpu_sampling"] and info["parallel"]["gpu_transport"].startswith("host")
