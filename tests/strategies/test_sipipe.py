"""SiPipe: column assignment, column-wise incremental sampling against the default sampler and a
from-scratch computation, the token-safe input handshake under injected delays, and end to end."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from batchinfer.engine.kernels import load_native_kernels
from batchinfer.engine.request import SamplingParams, Sequence
from batchinfer.engine.runtime.input_prep import TokenSafeInputs, VersionedInputs
from batchinfer.engine.sampler import Sampler
from batchinfer.engine.step_plan import StepPlan, model_inputs
from batchinfer.strategies.sipipe.column_sampler import ColumnSampler
from batchinfer.strategies.sipipe.columns import ColumnAssigner, ColumnJoin
from tests.sipipe_churn import churn, pp2_and_single_process, sample_columns


def _join_stub(rid, col):
    return ColumnJoin(col, rid, [], [], None, 0)


def test_columns_stay_dense_leavers_are_filled_by_the_last_column():
    a = ColumnAssigner(capacity=4)
    cols, up = a.assign(["a", "b", "c"], [0, 0, 0], _join_stub)
    assert cols == [0, 1, 2] and [j.request_id for j in up.joins] == ["a", "b", "c"]
    cols, up = a.assign(["a", "c"], [1, 1], _join_stub)          # b left: c moves into its column
    assert cols == [0, 1] and up.moves == [(2, 1)] and not up.joins and up.width == 2
    cols, up = a.assign(["c", "a", "d"], [2, 2, 0], _join_stub)  # d joins at the end
    assert cols == [1, 0, 2] and [j.request_id for j in up.joins] == ["d"]
    cols, up = a.assign(["c", "a", "d"], [3, 2, 1], _join_stub)  # a's history was trimmed: rebuild
    assert cols == [1, 0, 2] and [(j.request_id, j.column) for j in up.joins] == [("a", 0)]
    with pytest.raises(ValueError, match="exceed the sampler's 4 columns"):
        a.assign(list("vwxyz"), [0] * 5, _join_stub)


# --- column-wise sampling ------------------------------------------------------------------------
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                   frequency_penalty=0.2, presence_penalty=0.3),
    SamplingParams(temperature=1.0, top_p=0.5, presence_penalty=-0.5, logprobs=2),
    SamplingParams(temperature=0.7, min_tokens=6, stop_token_ids=[5], frequency_penalty=1.0),
    SamplingParams(temperature=1.2, top_k=1),
    SamplingParams(temperature=0.9, logit_bias={7: 5.0, 11: -100.0}, presence_penalty=0.2),
    SamplingParams(temperature=0.0, allowed_token_ids=[3, 9, 27, 81]),
    # tests/sipipe_churn.BAD_WORD_IDS: 13 the likeliest, 17 next, so bans change the tokens
    SamplingParams(temperature=0.0, logit_bias={13: 40.0, 17: 30.0, 99: 20.0}, bad_words=["x"]),
    SamplingParams(temperature=0.9, logit_bias={13: 8.0, 17: 7.0, 5: 9.0}, bad_words=["x"]),
]


def _scratch(seq: Sequence, vocab: int):
    seen = torch.zeros(vocab, dtype=torch.uint8)
    seen[seq.request.prompt_token_ids] = 1
    counts = torch.zeros(vocab)
    for t in seq.output_token_ids:
        counts[t] += 1
        seen[t] = 1
    return seen, counts, (counts > 0).float()


@pytest.mark.parametrize("native", [True, False])
def test_incremental_columns_equal_scratch_and_the_default_sampler(native):
    """Two replicas (PP=2) over 60 micro-batches with sequences joining, leaving, moving between
    replicas and having their output trimmed: after every step each column's buffers equal a
    from-scratch computation, and (native kernels) the tokens equal the default sampler's."""
    if native and not load_native_kernels():
        pytest.skip("native kernels did not build")
    vocab, rng = 1003, random.Random(3)
    gen = torch.Generator().manual_seed(3)
    default = Sampler(vocab, (2,), torch.device("cpu"), native_kernels=native)
    replicas = [(ColumnAssigner(16), ColumnSampler(vocab, 16, 256, (2,), native)) for _ in range(2)]
    for step, r, batch, rows, seqs in churn(vocab, rng, PARAMS):
        assigner, sampler = replicas[r]
        logits = torch.randn(len(rows), vocab, generator=gen) * 3
        expected, info = default.sample(logits.clone(), default.prepare(rows))
        cols, tokens, logprobs = sample_columns(assigner, sampler, batch, rows, seqs, logits,
                                                vocab)
        got = [tokens[c] for c in cols]
        if native:
            assert got == expected.tolist(), f"step {step}"
            for row, (seq, c) in enumerate(zip(rows, cols)):
                if seq.request.sampling.logprobs is not None:
                    assert logprobs[c]["logprob"] == pytest.approx(float(info["sampled"][row]))
                    assert [t for t, _ in logprobs[c]["top"]] == info["top_ids"][row, :2].tolist()
        for seq, token in zip(rows, got):
            if seq.request.bad_words_token_ids:         # never a bad word's token
                assert token != 5 and not (seq.output_token_ids[-1:] == [13] and token == 13)
            seq.output_token_ids.append(token)
        for seq, c in zip(rows, cols):
            seen, counts, present = _scratch(seq, vocab)
            n = len(seq.output_token_ids)
            assert torch.equal(sampler.seen[:, c], seen)
            assert torch.equal(sampler.counts[:, c], counts)
            assert torch.equal(sampler.present[:, c], present)
            assert int(sampler.lengths[c]) == n
            assert sampler.outputs[:n, c].tolist() == seq.output_token_ids


# --- token-safe execution ------------------------------------------------------------------------
def _plans(rng: random.Random, count: int, block_size: int = 4) -> list[StepPlan]:
    plans = []
    for mb in range(count):
        q_lens, s_lens, tables, ids, sample = [], [], [], [], []
        for i in range(rng.randrange(1, 6)):
            q = rng.choice([1, 1, rng.randrange(1, 20)])
            s = q + rng.randrange(0, 30)
            q_lens.append(q)
            s_lens.append(s)
            tables.append([rng.randrange(100) for _ in range(-(-s // block_size))])
            ids.extend(rng.randrange(1000) for _ in range(q))
            if rng.random() < 0.8:
                sample.append(i)
        plans.append(StepPlan(mb, ids, q_lens, s_lens, tables, sample, [], []))
    return plans


def test_versioned_buffers_hold_the_same_inputs_as_model_inputs():
    versioned = VersionedInputs(block_size=4, device=torch.device("cpu"), tokens=8, seqs=2, blocks=2)
    for i, plan in enumerate(_plans(random.Random(0), 30)):
        got, want = versioned.fill(i % 2, plan), model_inputs(plan, 4, torch.device("cpu"))
        for name in ("input_ids", "positions", "logits_rows"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for name in ("query_start", "seq_lens", "block_tables", "slot_blocks", "slot_offsets"):
            assert torch.equal(getattr(got.meta, name), getattr(want.meta, name)), name


def test_token_safe_handshake_never_overwrites_a_buffer_being_read():
    """Random delays on both sides; the CPU executor must run ahead (overlap happens) and must
    never write the version the forward is reading."""
    rng = random.Random(1)
    lock = threading.Lock()
    content, reading, overlaps = [None, None], [False, False], []
    forward_busy = threading.Event()

    def prepare(version, plan):
        with lock:
            assert not reading[version], f"plan {plan.mb_id} writes version {version} while read"
        if forward_busy.is_set():
            overlaps.append(plan.mb_id)
        time.sleep(rng.random() * 0.002)
        content[version] = plan.mb_id
        with lock:
            assert not reading[version], f"plan {plan.mb_id} wrote version {version} while read"
        return version

    inputs = TokenSafeInputs(prepare)
    plans = _plans(random.Random(2), 150)
    for plan in plans[:3]:
        inputs.submit(plan)
    try:
        for i, plan in enumerate(plans):
            if i + 3 < len(plans):
                inputs.submit(plans[i + 3])
            taken, version = inputs.take(timeout_s=10)
            assert taken.mb_id == plan.mb_id and version == i % 2
            with lock:
                reading[version] = True
            forward_busy.set()
            for _ in range(3):                      # the forward reads its inputs over time
                assert content[version] == plan.mb_id
                time.sleep(rng.random() * 0.001)
            forward_busy.clear()
            with lock:
                reading[version] = False
    finally:
        inputs.close()
    assert len(overlaps) > 20, "the CPU executor never ran ahead of the forward"


def test_a_failing_input_preparation_reaches_the_forward():
    def prepare(version, plan):
        raise ValueError("bad block table")

    inputs = TokenSafeInputs(prepare)
    inputs.submit(_plans(random.Random(0), 1)[0])
    with pytest.raises(RuntimeError, match="bad block table"):
        inputs.take(timeout_s=10)
    inputs.close()


# --- end to end ------------------------------------------------------------------------------------
E2E = ["Hi", "The capital of France is", "Write a haiku about the sea. " * 6,
       "List three prime numbers:", "1, 2, 3,"]
DUMMY8 = {"load_format": "dummy", "max_model_len": 512,
          "hf_overrides": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                           "num_hidden_layers": 4}}


def _e2e_params():
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=40, min_p=0.02,
                            seed=7, repetition_penalty=1.2, frequency_penalty=0.3,
                            presence_penalty=0.2, logprobs=1, ignore_eos=True)
    return [greedy, seeded, greedy, seeded, seeded]


_REFERENCES: dict[str, list] = {}


def _single_process_outputs(make_engine, model: dict) -> list:
    """The single process's outputs of E2E under `model`, computed once per model for every
    switch setting below (the reference does not depend on them)."""
    key = repr(sorted(model.items()))
    if key not in _REFERENCES:
        with make_engine(model=model, cache={"kv_cache_memory": "64MiB"}) as engine:
            _REFERENCES[key] = engine.generate(E2E, _e2e_params())
    return _REFERENCES[key]


@pytest.mark.parametrize("model,parallel,switches", [
    ({"max_model_len": 512}, {"pp": 2}, {}),
    ({"max_model_len": 512}, {"pp": 2}, {"samplers": 3}),
    ({"max_model_len": 512}, {"pp": 2}, {"split_columns": False}),
    ({"max_model_len": 512}, {"pp": 2}, {"cpu_sampling": False, "token_safe_execution": False,
                                         "structure_aware_transmission": False}),
    (DUMMY8, {"tp": 2}, {}),
])
@pytest.mark.slow
def test_sipipe_tokens_equal_the_single_process(make_engine, model, parallel, switches):
    """Every switch setting samples the single process's tokens (the logits are the same bits and
    the column kernels are the row kernels' arithmetic), whichever sampler pool and column split;
    under TP each rank writes its vocabulary rows of the logits into the sampler's slot."""
    from batchinfer.strategies.sipipe.params import SiPipeParams

    params = _e2e_params()
    reference = _single_process_outputs(make_engine, model)
    strategy = SiPipeParams(policy="hb", chunk_size=16, max_num_batched_tokens=64, **switches)
    with make_engine(model=model, cache={"kv_cache_memory": "64MiB"}, parallel=parallel,
                     strategy=strategy, scheduler=strategy.scheduler_config()) as eng:
        outs = eng.generate(E2E, params)
        events = eng.replicas[0].executor.timeline()
        info, parallel_info = eng.info["sipipe"], eng.info["parallel"]
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in reference]
    for got, want in zip(outs, reference):
        if want.logprobs:
            assert [lp["logprob"] for lp in got.logprobs] == pytest.approx(
                [lp["logprob"] for lp in want.logprobs], abs=1e-5)
    kinds = {e["kind"] for e in events}
    assert "prepare" in kinds and "forward" in kinds
    assert ("sample" in kinds) == info["cpu_sampling"] == switches.get("cpu_sampling", True)
    structured = switches.get("structure_aware_transmission", True)
    assert parallel_info["stage_transport"] == ("structured" if structured else "metadata")
    assert info["structure_aware_transmission"] == structured
    if not info["cpu_sampling"]:         # no pool: none of its figures
        assert info["samplers_per_replica"] == 0 and info["sampler_columns"] is None
    if info["cpu_sampling"]:
        _check_the_pool(events, info, parallel.get("pp", 1))


@pytest.mark.slow
def test_sipipe_prompt_logprobs_equal_the_single_process(make_engine):
    """The last stage scores the prompt positions (the CPU samplers see only the sampled rows)
    and sends them to the controller beside the samplers' result: the single process's scores,
    chunked prompts beside requests that do not ask."""
    params = [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3 if i % 2 else None)
              for i in range(len(E2E))]
    outs, reference = pp2_and_single_process(make_engine, E2E, params)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in reference]
    for got, want in zip(outs, reference):
        if want.prompt_logprobs is None:
            assert got.prompt_logprobs is None
            continue
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(got.prompt_token_ids)
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)
            assert (a["token_id"], a["rank"]) == (b["token_id"], b["rank"])
            assert [t["token_id"] for t in a["top_logprobs"]] == \
                [t["token_id"] for t in b["top_logprobs"]]


def _check_the_pool(events, info, pp: int) -> None:
    """Split: every micro-batch sampled by the whole pool, shares within one column of each
    other, some micro-batch on all of them; else each micro-batch on sampler n mod p alone."""
    from collections import defaultdict

    samples = [e for e in events if e["kind"] == "sample"]
    ranks = sorted({e["rank"] for e in samples})
    pool = info["samplers_per_replica"]
    assert len(ranks) == pool and (info["split_columns"] or pool == pp)
    by_mb = defaultdict(list)
    for e in samples:
        by_mb[e["mb"]].append(e)
    for mb, shares in by_mb.items():
        widths = [e["columns"] for e in shares]
        if info["split_columns"]:
            assert len(shares) == pool and max(widths) - min(widths) <= 1, mb
        else:
            assert len(shares) == 1 and ranks.index(shares[0]["rank"]) == mb % pp, mb
    if info["split_columns"] and pool > 1:
        assert any(min(e["columns"] for e in shares) > 0 for shares in by_mb.values())


@pytest.mark.slow
def test_sipipe_recipe_runs_out_of_the_box(tmp_path):
    from tests.strategy_e2e import run_shipped_recipe

    _, report = run_shipped_recipe("sipipe", tmp_path / "run", limit=4)
    assert report["strategy"]["name"] == "sipipe"
    assert report["engine"]["sipipe"]["samplers_per_replica"] == 2
