"""The pipeline workers' two runtime switches every PP strategy has (issue 41): the stage
transport (parallel.stage_transport: SiPipe's structure-aware transmission or vLLM's per-transfer
metadata) and inputs prepared one plan ahead (gLLM's preemptive metadata scheduling, on by
default; the baseline's prepare_ahead switch, off). The same resolution reaches the real
workers (runtime/build.rank_extensions) and the simulator's pipeline."""
from __future__ import annotations

import pytest

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.runtime.build import rank_extensions
from batchinfer.engine.runtime.worker_extension import WorkerExtension
from batchinfer.runner.recipe import strategy_class
from batchinfer.sim.simulator import simulated_engine
from tests.sim.test_sim import ARCH, LinearCost


def _config(strategy: dict, **parallel) -> EngineConfig:
    params = strategy_class(strategy["name"]).model_validate(strategy)
    return EngineConfig(model={"max_model_len": 512}, cache={"kv_cache_memory": 1 << 20},
                        parallel={"pp": 2, **parallel}, scheduler=params.scheduler_config(),
                        strategy=params)


CASES = [
    ({"name": "baseline"}, {}, (True, False)),
    ({"name": "baseline", "prepare_ahead": True}, {}, (True, True)),
    ({"name": "baseline"}, {"stage_transport": "metadata"}, (False, False)),
    ({"name": "gllm"}, {}, (True, True)),                              # the paper's runtime
    ({"name": "gllm", "preemptive_metadata": False}, {"stage_transport": "metadata"}, (False, False)),
    ({"name": "tdpipe"}, {}, (True, False)),
]


@pytest.mark.parametrize("strategy,parallel,expected", CASES)
def test_the_workers_and_the_simulator_get_the_same_switches(strategy, parallel, expected):
    config = _config(strategy, **parallel)
    fields = rank_extensions(config, 2, None, None)
    exts = [fields[r]["extension"] for r in (0, 1)]
    assert exts[0] is not exts[1]
    assert all((e.structure_aware, e.token_safe_inputs) == expected for e in exts)
    executor = simulated_engine(config, LinearCost(), ARCH, 512, 4).replicas[0].executor
    assert (executor.structure_aware, executor.token_safe) == expected


def test_metadata_transport_holds_for_a_strategys_own_extension():
    own = WorkerExtension()
    config = _config({"name": "baseline"}, stage_transport="metadata")
    fields = rank_extensions(config, 2, {0: {"extension": own}}, None)
    assert fields[0]["extension"] is own and own.structure_aware is False
    shared = WorkerExtension()
    rank_extensions(config, 2, None, shared)
    assert shared.structure_aware is False
    structured = WorkerExtension()
    rank_extensions(_config({"name": "baseline"}), 2, {1: {"extension": structured}}, None)
    assert structured.structure_aware is True
