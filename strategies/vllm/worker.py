"""Runs a vLLM LLMEngine for batchinfer's `vllm` strategy, in whatever Python has vLLM installed.

Started by strategies/vllm/params.py as `PYTHON worker.py`; it imports only the standard
library and vLLM (never batchinfer, which that Python may not have). It speaks JSON lines: the
first line in is {"engine_args": {...}}, then one command per line:

    {"op": "add", "id": ..., "prompt_token_ids": [...], "sampling": {...}}   (no reply)
    {"op": "step"}        -> {"finished": [...], "errors": [...], "events": [...], "unfinished": n}
    {"op": "abort_all"}   -> {"aborted": [ids]}
    {"op": "close"}       -> (exits)

The first line out is {"ready": {...engine facts...}} or {"error": "...", "kind": "..."}. vLLM
logs to stdout, so the protocol keeps the original stdout for itself and points fd 1 at stderr.
"""
import importlib
import json
import os
import sys
import time
import traceback

# run as a script, this folder is first on sys.path; its module names (engine, params, worker) are
# generic enough to shadow another package's top-level modules inside vLLM's Python
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _protocol_streams():
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                       # anything else printed goes to stderr
    sys.stdout = sys.stderr
    return sys.stdin, out


class StepStats:
    """A vLLM stat logger (StatLoggerBase) that keeps what each engine step reports."""

    events: list = []
    prefix_queries = 0
    prefix_hits = 0
    preemptions = 0

    def __init__(self, vllm_config, engine_index=0):
        self._last = time.perf_counter()

    def record(self, scheduler_stats, iteration_stats, *args, **kwargs):
        now = time.perf_counter()
        event = {"dur": now - self._last}
        self._last = now
        if scheduler_stats is not None:
            event["num_running"] = getattr(scheduler_stats, "num_running_reqs", 0)
            event["num_seqs"] = event["num_running"]
            event["num_waiting"] = getattr(scheduler_stats, "num_waiting_reqs", 0)
            event["kv_usage"] = getattr(scheduler_stats, "kv_cache_usage", 0.0)
            prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
            if prefix is not None:
                StepStats.prefix_queries += getattr(prefix, "queries", 0)
                StepStats.prefix_hits += getattr(prefix, "hits", 0)
        if iteration_stats is not None:
            event["num_prefill_tokens"] = getattr(iteration_stats, "num_prompt_tokens", 0)
            event["num_decode_tokens"] = getattr(iteration_stats, "num_generation_tokens", 0)
            StepStats.preemptions += getattr(iteration_stats, "num_preempted_reqs", 0)
        StepStats.events.append(event)

    def log_engine_initialized(self):
        pass

    def log(self):
        pass

    def record_sleep_state(self, *args, **kwargs):
        pass


def _stat_logger_class():
    from vllm.v1.metrics.loggers import StatLoggerBase

    return type("BatchinferStepStats", (StepStats, StatLoggerBase), {})


def _engine(engine_args: dict):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(**engine_args, disable_log_stats=False)
    return LLMEngine.from_engine_args(args, stat_loggers=[_stat_logger_class()])


def _facts(engine) -> dict:
    import vllm

    cache = engine.vllm_config.cache_config
    blocks = cache.num_gpu_blocks or 0
    return {"vllm_version": vllm.__version__, "kv_block_size": cache.block_size,
            "kv_capacity_tokens": blocks * cache.block_size,
            "max_model_len": engine.vllm_config.model_config.max_model_len}


def _logprobs(completion, top_n: int) -> list:
    """Per generated token: [token id, its logprob, [[id, logprob] of the top_n, best first]]."""
    out = []
    for token, entry in zip(completion.token_ids, completion.logprobs or []):
        chosen = entry.get(token)
        top = sorted(((tid, lp.logprob) for tid, lp in entry.items()
                      if lp.rank is not None and 1 <= lp.rank <= top_n), key=lambda p: -p[1])
        out.append([token, chosen.logprob if chosen is not None else None, top])
    return out


def _reply(completion, top_n) -> dict:
    return {"token_ids": list(completion.token_ids),
            "text": completion.text, "finish_reason": FINISH.get(completion.finish_reason, "stop"),
            "stop_reason": completion.stop_reason,
            "logprobs": (_logprobs(completion, top_n) if top_n is not None
                         and completion.logprobs is not None else None)}


def _finished(output, top_n) -> dict:
    """A finished request: its first reply; of n > 1, every reply in index order (samples)."""
    replies = sorted(output.outputs, key=lambda c: c.index)
    done = {"id": output.request_id, **_reply(replies[0], top_n)}
    if len(replies) > 1:
        done["samples"] = [_reply(c, top_n) for c in replies]
    return done


def _prompt_logprobs(output, top_n: int) -> list:
    """Per prompt token: None for the first, then [its logprob, its rank, [[id, logprob] of the
    top_n, best first]] (vLLM's dict holds the prompt token first, the top ones after it)."""
    out = []
    for token, entry in zip(output.prompt_token_ids, output.prompt_logprobs):
        if entry is None:
            out.append(None)
            continue
        chosen = entry[token]
        top = sorted(((tid, lp.logprob, lp.rank) for tid, lp in entry.items()
                      if lp.rank is not None and 1 <= lp.rank <= top_n), key=lambda p: p[2])
        out.append([chosen.logprob, chosen.rank, [[tid, lp] for tid, lp, _ in top]])
    return out


def serve(engine, commands, reply) -> None:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    errors: list = []
    running: dict = {}                  # id -> logprobs asked (None: none)
    prompt_asked: dict = {}             # id -> prompt_logprobs asked, where asked
    for line in commands:
        msg = json.loads(line)
        op = msg["op"]
        if op == "add":
            try:
                sampling = msg["sampling"]
                if sampling.get("logit_bias"):       # JSON made its token ids strings
                    sampling["logit_bias"] = {int(t): b for t, b in sampling["logit_bias"].items()}
                if sampling.get("structured_outputs"):
                    sampling["structured_outputs"] = StructuredOutputsParams(
                        **sampling["structured_outputs"])
                params = SamplingParams(**sampling, output_kind=RequestOutputKind.FINAL_ONLY)
                lora = msg.get("lora")          # [name, id, path]: the request's adapter
                engine.add_request(msg["id"], {"prompt_token_ids": msg["prompt_token_ids"]},
                                   params, lora_request=LoRARequest(*lora) if lora else None)
                running[msg["id"]] = msg["sampling"].get("logprobs")
                if sampling.get("prompt_logprobs") is not None:
                    prompt_asked[msg["id"]] = sampling["prompt_logprobs"]
            except Exception as exc:           # a request vLLM refuses fails alone
                errors.append({"id": msg["id"], "error": f"{type(exc).__name__}: {exc}"})
        elif op == "step":
            outputs = [o for o in engine.step() if o.finished]
            finished = [_finished(o, running.pop(o.request_id, None)) for o in outputs]
            for output, done in zip(outputs, finished):
                top_n = prompt_asked.pop(output.request_id, None)
                if top_n is not None and output.prompt_logprobs is not None:
                    done["prompt_logprobs"] = _prompt_logprobs(output, top_n)
            events, StepStats.events = StepStats.events, []
            reply({"finished": finished, "errors": errors, "events": events,
                   "unfinished": engine.get_num_unfinished_requests(),
                   "preemptions": StepStats.preemptions,
                   "prefix_cache": [StepStats.prefix_queries, StepStats.prefix_hits]})
            errors = []
        elif op == "abort_all":
            ids = list(running)
            engine.abort_request(ids)
            running.clear()
            prompt_asked.clear()
            reply({"aborted": ids})
        elif op == "close":
            return


def main() -> None:
    commands, out = _protocol_streams()

    def reply(obj) -> None:
        out.write(json.dumps(obj) + "\n")

    first = json.loads(commands.readline())
    try:
        importlib.import_module("vllm")
    except ImportError as exc:
        reply({"error": f"vLLM cannot be imported by {sys.executable}: {exc}", "kind": "import"})
        return
    try:
        engine = _engine(first["engine_args"])
    except Exception as exc:
        traceback.print_exc()
        reply({"error": f"vLLM could not start: {type(exc).__name__}: {exc}", "kind": "start"})
        return
    reply({"ready": _facts(engine)})
    serve(engine, commands, reply)


if __name__ == "__main__":
    main()
