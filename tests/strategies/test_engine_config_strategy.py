"""A strategy through the Python API: EngineConfig(strategy=...) takes a strategy's parameters
and builds with its batching knobs, as a recipe's strategy section does."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.request import SamplingParams
from batchinfer.strategies import STRATEGIES


@pytest.mark.parametrize("value", ["tdpipe", {"name": "tdpipe"}])
def test_a_strategy_name_or_section_is_refused_with_what_to_give(value):
    """Not an AttributeError from deep in the build ('str' object has no attribute ...)."""
    with pytest.raises(ValidationError, match=r"(?s)strategy\n.*a strategy's parameters \(a "
                                              r"StrategyParams\).*STRATEGIES\[name\]"):
        EngineConfig(strategy=value)


def test_a_strategy_alone_brings_its_batching_knobs():
    params = STRATEGIES["baseline"](policy="sb", max_num_seqs=8, max_num_batched_tokens=4096)
    assert EngineConfig(strategy=params).scheduler == params.scheduler_config()
    assert EngineConfig(strategy=STRATEGIES["gllm"]()).scheduler.max_num_seqs == \
        STRATEGIES["gllm"]().scheduler_config().max_num_seqs
    given = EngineConfig(strategy=params, scheduler={"max_num_seqs": 3})   # both: as given
    assert given.scheduler.max_num_seqs == 3
    assert EngineConfig().scheduler.policy == "hb"


def test_an_engine_built_with_a_strategy_alone_reports_its_policy(tiny_engine_config):
    params = STRATEGIES["baseline"](policy="sb", max_num_seqs=8)
    with Engine.from_config(EngineConfig(**tiny_engine_config, strategy=params)) as engine:
        assert engine.info["scheduler_policy"] == "sb"
        out = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2,
                                                        ignore_eos=True))
        assert len(out[0].output_token_ids) == 2
