"""Seesaw's two layouts over one set of ranks: the tp x pp splits the model can take, the decode
layout c_d a recipe's integers fix, and, where the recipe says `auto`, every (c_p, c_d) pair for
the simulator to price.

The paper chooses c_p and c_d separately from its model of the hardware (§3.1: TP pays
all-reduces that grow with the tokens of a step, so prefill prefers PP; PP splits the decode batch
into micro-batches that each read the weights again, so decode prefers TP) and switches between
them (§4.1). Here the model of the hardware is the simulator's cost model, and each pair is priced
by simulating the whole job with Seesaw's real scheduler (strategies/seesaw/sim.py): both stages,
the re-shards, the KV copies and the CPU tier, on the job's own prompt and output lengths.
"""
from __future__ import annotations

from batchinfer.engine.errors import ConfigError
from batchinfer.strategies.base import AutoAlternative, AutoSearch

AUTO = "auto"


def splits(ranks: int, arch) -> list[tuple[int, int]]:
    """(tp, pp) with tp x pp = ranks that the model can take: TP over head counts it divides, at
    most one pipeline stage per layer."""
    from batchinfer.sim.search import layouts

    return [(tp, pp) for tp, pp, dp in layouts(ranks, arch) if dp == 1]


def describe(tp: int, pp: int) -> str:
    if tp > 1 and pp > 1:
        return f"TP={tp} x PP={pp}"
    return f"PP={pp}" if pp > 1 else f"TP={tp}"


def allowed_decode(ranks: int, arch) -> str:
    options = ", ".join(f"{tp} x {pp}" for tp, pp in splits(ranks, arch))
    return (f"allowed over {ranks} rank(s): decode_tp x decode_pp = {options or 'none'}, either "
            f"one given and the other auto, or both auto")


def check_one_replica(parallel) -> None:
    if parallel.dp != 1:
        raise ConfigError(f"parallel.dp: strategy seesaw runs one replica over its ranks; dp must "
                          f"be 1 (got {parallel.dp})")


def decode_split(params, ranks: int, arch) -> tuple[int, int]:
    """c_d's (tp, pp) from the recipe: both integers as given, or one given and the other what
    the ranks leave. Both `auto` is resolved before the engine is built (sim/auto_settings.py)."""
    tp, pp = params.decode_tp, params.decode_pp
    if tp == AUTO and pp == AUTO:
        raise ConfigError(f"strategy.decode_tp / decode_pp: auto is resolved by `batchinfer run` "
                          f"from the job's prompts before the engine is built; an engine built "
                          f"directly needs integers ({allowed_decode(ranks, arch)})")
    for key, given in (("decode_tp", tp), ("decode_pp", pp)):
        if given != AUTO and ranks % given:
            raise ConfigError(f"strategy.{key}: {given} does not divide the prefill layout's "
                              f"{ranks} rank(s); {allowed_decode(ranks, arch)}")
    tp = ranks // pp if tp == AUTO else tp
    pp = ranks // tp if pp == AUTO else pp
    if tp * pp != ranks:
        raise ConfigError(f"strategy.decode_tp x decode_pp = {tp} x {pp} must use the same "
                          f"{ranks} ranks as the prefill layout (parallel.tp x pp); "
                          f"{allowed_decode(ranks, arch)}")
    return tp, pp


def layout_search(params, parallel, arch) -> AutoSearch:
    """Every (c_p, c_d) the recipe leaves open over parallel's ranks: c_p is parallel's own
    split unless prefill_layout is auto; c_d every split that matches the integers given."""
    check_one_replica(parallel)
    ranks = parallel.tp * parallel.pp
    options = splits(ranks, arch)
    prefills = options if params.prefill_layout == AUTO else [(parallel.tp, parallel.pp)]
    if params.decode_tp == AUTO and params.decode_pp == AUTO:
        decodes = [(tp, pp) for tp, pp in options if params.decode_pp_layers is None
                   or pp == len(params.decode_pp_layers)]
    else:
        decodes = [decode_split(params, ranks, arch)]
    if not decodes:
        raise ConfigError(f"strategy.decode_pp_layers: {params.decode_pp_layers} lists "
                          f"{len(params.decode_pp_layers)} decode stages, and no decode layout "
                          f"over {ranks} rank(s) has that many; {allowed_decode(ranks, arch)}")
    if not prefills:
        raise ConfigError(f"strategy.prefill_layout: auto, but the model can split its "
                          f"{ranks} rank(s) no way (set parallel.tp x pp to ranks it takes)")
    alternatives = []
    for p_tp, p_pp in prefills:
        for d_tp, d_pp in decodes:
            resolved = params.model_copy(update={"decode_tp": d_tp, "decode_pp": d_pp,
                                                 "prefill_layout": "parallel"})
            label = f"prefill {describe(p_tp, p_pp)} -> decode {describe(d_tp, d_pp)}"
            alternatives.append(AutoAlternative(label, resolved, p_tp, p_pp))
    return AutoSearch(alternatives, params.layout_costs, "strategy.layout_costs",
                      params.layout_sample_requests)
