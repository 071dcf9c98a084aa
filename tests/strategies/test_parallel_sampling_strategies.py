"""n > 1 samples under every strategy: the samples are ordinary requests to each scheduler and
give the replies of the n = 1 requests seeded seed + index (the single process's), with the
prompt computed once where the scheduler shares its blocks (not seesaw, whose device KV is laid
out per phase); strategy vllm passes n to vLLM and maps its outputs into the same result."""
from __future__ import annotations

import io
import json
import os
import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.parallel_sampling import ParallelOutput, child_id
from batchinfer.engine.request import FinishReason, Request, SamplingParams
from batchinfer.runner.job import EXIT_OK, JobSpec, run_job
from batchinfer.runner.recipe import Recipe
from batchinfer.strategies.vllm.engine import VllmEngine, sampling_args
from tests.strategy_e2e import E2E_PROMPTS

# the longer E2E prompts: past one KV block, so the samples after the first fork its blocks
# (three: each strategy's engine start dominates; more prompts checked nothing more)
PROMPTS = [p for p in E2E_PROMPTS if len(p.split()) > 12][:3]
N = 3


def _params(i: int) -> SamplingParams:
    return SamplingParams(n=N, temperature=0.8, top_p=0.95, seed=17 * i, ignore_eos=True,
                          max_tokens=10 + 3 * i)


def _strategies() -> dict:
    from batchinfer.strategies.gllm.scheduler import GLLMParams
    from batchinfer.strategies.seesaw.params import SeesawParams
    from batchinfer.strategies.sidp.params import SiDPParams
    from batchinfer.strategies.sipipe.params import SiPipeParams
    from batchinfer.strategies.tdpipe.params import TDPipeParams

    model = {"max_model_len": 128}
    seesaw = SeesawParams(decode_tp=1, decode_pp=2, decode_pp_layers=[20, 10],
                          cpu_kv_cache_memory="40MiB")
    sipipe = SiPipeParams(policy="hb", chunk_size=16, max_num_batched_tokens=64)
    sidp = SiDPParams()
    return {
        "tdpipe": dict(model=model, cache={"kv_cache_memory": "16MiB"}, parallel={"pp": 2},
                       strategy=TDPipeParams(max_num_batched_tokens=64,
                                             profile_decode_batch_sizes=[1, 8],
                                             profile_prefill_tokens=[32, 64],
                                             profile_context_len=16)),
        "gllm": dict(model=model, cache={"kv_cache_memory": "16MiB"}, parallel={"pp": 2},
                     strategy=GLLMParams(T=2, MaxP=48, MinP=8)),
        "seesaw": dict(model=model, cache={"kv_cache_memory": "5MiB"},
                       parallel={"pp": 2, "pp_layers": [15, 15], "step_timeout_seconds": 120},
                       scheduler=seesaw.scheduler_config(), strategy=seesaw),
        "sipipe": dict(model=model, cache={"kv_cache_memory": "16MiB"}, parallel={"pp": 2},
                       scheduler=sipipe.scheduler_config(), strategy=sipipe),
        "sidp": dict(model=model, cache={"kv_cache_memory": "16MiB"}, parallel={"dp": 2},
                     scheduler=sidp.scheduler_config(), strategy=sidp),
    }


@pytest.fixture(scope="module")
def single_process_samples():
    """The single process's n = 1 replies seeded seed + index, and the prompts' token count: the
    reference of every strategy below, computed once."""
    params = [_params(i) for i in range(len(PROMPTS))]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHINFER_LINEAR_KERNEL", "torch")    # SiDP's replicas: as the reference
        with Engine.from_config(EngineConfig(model={"max_model_len": 128},
                                             cache={"kv_cache_memory": "32MiB"})) as single:
            reference = single.generate(
                [p for p in PROMPTS for _ in range(N)],
                [sp.model_copy(update={"n": 1, "seed": sp.seed + i})
                 for sp in params for i in range(N)])
            prompt_tokens = sum(len(single.tokenizer.encode(p)) for p in PROMPTS)
    return [o.output_token_ids for o in reference], prompt_tokens


@pytest.mark.parametrize("name", ["tdpipe", "gllm", "seesaw", "sipipe", "sidp"])
@pytest.mark.slow
def test_every_strategy_runs_samples_as_their_n1_requests(name, monkeypatch,
                                                         single_process_samples):
    monkeypatch.setenv("BATCHINFER_LINEAR_KERNEL", "torch")     # SiDP's replicas: as the reference
    params = [_params(i) for i in range(len(PROMPTS))]
    reference, prompt_tokens = single_process_samples
    with Engine.from_config(EngineConfig(**_strategies()[name])) as engine:
        assert engine.info["strategy"] == name
        outs = engine.generate(PROMPTS, params)
        prefill = engine.stats()["computed_prefill_tokens"]
        assert not engine.has_unfinished()
    assert all(isinstance(o, ParallelOutput) and len(o.samples) == N for o in outs)
    assert [s.output_token_ids for o in outs for s in o.samples] == reference
    if name == "seesaw":       # every sample computes its prompt (and preemptions recompute)
        assert prefill >= N * prompt_tokens
    else:
        assert prefill < 0.7 * N * prompt_tokens


# --- strategy vllm ------------------------------------------------------------------------------
def test_vllm_gets_n_and_one_reply_for_greedy_samples():
    """vLLM samples n itself (seed + index, as ours); n > 1 at temperature 0, which vLLM 0.32
    refuses ("n must be 1 when using greedy sampling"), asks for one reply."""
    seeded = sampling_args(Request("r", [1, 2], SamplingParams(n=3, temperature=0.7, seed=4)))
    assert (seeded["n"], seeded["seed"]) == (3, 4)
    assert sampling_args(Request("g", [1, 2], SamplingParams(n=3, temperature=0)))["n"] == 1


def test_the_vllm_worker_sends_every_sample_in_index_order():
    worker = runpy.run_path(str(Path(__file__).resolve().parents[2] / "strategies" / "vllm" /
                                "worker.py"))

    def completion(index, ids):
        return SimpleNamespace(index=index, token_ids=ids, text=f"t{index}", finish_reason="length",
                               stop_reason=None, logprobs=None)

    done = worker["_finished"](SimpleNamespace(request_id="r", outputs=[
        completion(1, [5]), completion(0, [4, 4]), completion(2, [6])]), None)
    assert (done["id"], done["token_ids"], done["text"]) == ("r", [4, 4], "t0")
    assert [s["token_ids"] for s in done["samples"]] == [[4, 4], [5], [6]]
    one = worker["_finished"](SimpleNamespace(request_id="q", outputs=[completion(0, [7])]), None)
    assert "samples" not in one and one["token_ids"] == [7]


class _FakeVllm:
    """The vLLM worker's pipe ends, answering each step with `replies`."""

    def __init__(self, replies: list[dict]):
        self.stdin = io.StringIO()
        self.stdout = io.StringIO("".join(json.dumps(r) + "\n" for r in replies))

    def poll(self):
        return None


def test_the_vllm_engine_gathers_samples_into_one_result():
    def reply(ids, reason="length"):
        return {"token_ids": ids, "text": "x" * len(ids), "finish_reason": reason,
                "stop_reason": None, "logprobs": None}

    step = {"finished": [{"id": "s", **reply([1, 2]), "samples": [reply([1, 2]), reply([3], "stop")]},
                         {"id": "g", **reply([9, 9, 9])}, {"id": "one", **reply([4])}],
            "errors": [], "events": []}
    engine = VllmEngine(_FakeVllm([step]), None, "m", {"max_model_len": 64}, {}, 1000)
    engine.add_request(Request("s", [1, 2, 3], SamplingParams(n=2, seed=1)))
    engine.add_request(Request("g", [1, 2, 3], SamplingParams(n=3, temperature=0)))
    engine.add_request(Request("one", [1, 2, 3], SamplingParams()))
    sent = [json.loads(line) for line in engine._proc.stdin.getvalue().splitlines()]
    assert [m["sampling"]["n"] for m in sent if m["op"] == "add"] == [2, 1, 1]
    s, g, one = engine.step()
    assert isinstance(s, ParallelOutput) and [x.output_token_ids for x in s.samples] == [[1, 2], [3]]
    assert [x.request_id for x in s.samples] == [child_id("s", 0), child_id("s", 1)]
    assert s.samples[1].finish_reason is FinishReason.STOP and s.num_output_tokens == 3
    assert [x.output_token_ids for x in g.samples] == [[9, 9, 9]] * 3 and g.num_output_tokens == 9
    assert not isinstance(one, ParallelOutput) and one.output_token_ids == [4]


def test_vllms_prompt_scores_of_a_request_of_samples_reach_its_result():
    """vLLM scores the prompt once per request, beside its replies: the gathered result (the
    first sample's fields) carries them, as our engine's first child does."""
    def reply(ids):
        return {"token_ids": ids, "text": "x", "finish_reason": "length", "stop_reason": None,
                "logprobs": None}

    scores = [None, [-1.5, 3, [[7, -0.5]]], [-0.25, 1, [[3, -0.25]]]]
    step = {"finished": [{"id": "s", **reply([1]), "samples": [reply([1]), reply([2])],
                          "prompt_logprobs": scores},
                         {"id": "g", **reply([9]), "prompt_logprobs": scores}],
            "errors": [], "events": []}
    engine = VllmEngine(_FakeVllm([step]), None, "m", {"max_model_len": 64}, {}, 1000)
    engine.tokenizer = _Tokens()
    engine.add_request(Request("s", [1, 2, 3], SamplingParams(n=2, seed=1, prompt_logprobs=1)))
    engine.add_request(Request("g", [1, 2, 3], SamplingParams(n=2, temperature=0,
                                                              prompt_logprobs=1)))
    for out in engine.step():
        assert isinstance(out, ParallelOutput)
        entries = out.prompt_logprobs
        assert entries[0] is None and [e["logprob"] for e in entries[1:]] == [-1.5, -0.25]
        assert [e["rank"] for e in entries[1:]] == [3, 1]
        assert entries[1]["top_logprobs"][0]["token_id"] == 7


class _Tokens:
    def token_text(self, token: int) -> str:
        return f"t{token}"

    def token_bytes(self, token: int) -> bytes:
        return f"t{token}".encode()


VLLM_PYTHON = os.environ.get("BATCHINFER_VLLM_PYTHON", "")


@pytest.mark.skipif(not VLLM_PYTHON or not Path(VLLM_PYTHON).is_file(),
                    reason="no vLLM: set BATCHINFER_VLLM_PYTHON to a Python with vLLM's CPU build")
def test_a_job_of_samples_through_vllm_has_our_records_shape(tmp_path):
    """The same input through vLLM and through ours: one record per line, n outputs each;
    greedy samples are the greedy reply (as ours: equal text); seeded ones n different
    replies (vLLM's own random numbers, so not ours)."""
    (tmp_path / "in.jsonl").write_text(
        json.dumps({"id": "g", "prompt": "The capital of France is", "n": 2,
                    "temperature": 0}) + "\n"
        + json.dumps({"id": "s", "prompt": "Once upon a time", "n": 3, "seed": 7}) + "\n")
    records = {}
    for name, strategy in (("ours", {"name": "baseline"}),
                           ("vllm", {"name": "vllm", "python": VLLM_PYTHON})):
        recipe = Recipe(model={"max_model_len": 512, "dtype": "float32"}, strategy=strategy,
                        sampling={"max_tokens": 12, "temperature": 0.8},
                        memory={"kv_cache_memory": "256MiB"}, report={"plots": False})
        outcome = run_job(JobSpec(recipe=recipe, input_path=tmp_path / "in.jsonl",
                                  output_dir=tmp_path / name, progress="off"))
        assert outcome.exit_code == EXIT_OK and outcome.outputs == 2
        records[name] = {r["id"]: r for r in map(
            json.loads, (tmp_path / name / "outputs.jsonl").read_text().splitlines())}
    for rid, count in (("g", 2), ("s", 3)):
        ours, theirs = records["ours"][rid], records["vllm"][rid]
        assert list(theirs) == list(ours)
        assert [o["index"] for o in theirs["outputs"]] == list(range(count))
        assert theirs["completion_tokens"] == sum(len(o["token_ids"]) for o in theirs["outputs"])
    assert [o["text"] for o in records["vllm"]["g"]["outputs"]] == \
        [o["text"] for o in records["ours"]["g"]["outputs"]]
    assert len({o["text"] for o in records["vllm"]["s"]["outputs"]}) == 3
