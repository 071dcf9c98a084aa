"""Runs vLLM's pooling runner (`LLM(..., runner="pooling")`, `llm.embed`) for an embedding job
with the `vllm` strategy, in whatever Python has vLLM installed.

Started by strategies/vllm/embed_engine.py as `PYTHON embed_worker.py`; it imports only the
standard library and vLLM. JSON lines: the first line in is {"engine_args": {...}}, answered
{"ready": {...}} or {"error": ..., "kind": ...}; then

    {"op": "embed", "requests": [{"id", "inputs": [[ids], ...], "dimensions"?,
                                  "use_activation"?}, ...]}
        -> {"done": [{"id", "embeddings": [[...], ...]}], "errors": [{"id", "error"}]}
    {"op": "close"}   -> (exits)

One `embed` is one llm.embed call over every input of the requests sent (vLLM batches them); a
request vLLM refuses (its dimensions) fails alone. vLLM logs to stdout, so the protocol keeps the
original stdout for itself and points fd 1 at stderr.
"""
import importlib
import json
import os
import sys
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def _protocol_streams():
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return sys.stdin, out


def _embed(llm, requests: list) -> tuple:
    from vllm.inputs import TokensPrompt
    from vllm.pooling_params import PoolingParams

    prompts, params, owners = [], [], []
    for req in requests:
        for ids in req["inputs"]:
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            params.append(PoolingParams(dimensions=req.get("dimensions"),
                                        use_activation=req.get("use_activation")))
            owners.append(req["id"])
    outs = llm.embed(prompts, pooling_params=params, use_tqdm=False)
    done: dict = {}
    for owner, out in zip(owners, outs):
        done.setdefault(owner, []).append([float(x) for x in out.outputs.embedding])
    return [{"id": rid, "embeddings": vectors} for rid, vectors in done.items()], []


def serve(llm, commands, reply) -> None:
    for line in commands:
        msg = json.loads(line)
        if msg["op"] == "close":
            return
        requests = msg["requests"]
        try:
            done, errors = _embed(llm, requests)
        except Exception:                  # one request refused: find it, the others run
            done, errors = [], []
            for req in requests:
                try:
                    done += _embed(llm, [req])[0]
                except Exception as exc:
                    errors.append({"id": req["id"], "error": f"{type(exc).__name__}: {exc}"})
        reply({"done": done, "errors": errors})


def main() -> None:
    commands, out = _protocol_streams()

    def reply(obj) -> None:
        out.write(json.dumps(obj) + "\n")

    first = json.loads(commands.readline())
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        reply({"error": f"vLLM cannot be imported by {sys.executable}: {exc}", "kind": "import"})
        return
    try:
        llm = vllm.LLM(**first["engine_args"])
    except Exception as exc:
        traceback.print_exc()
        reply({"error": f"vLLM could not start: {type(exc).__name__}: {exc}", "kind": "start"})
        return
    model_config = llm.llm_engine.vllm_config.model_config
    pooler = model_config.pooler_config
    reply({"ready": {"vllm_version": vllm.__version__,
                     "max_model_len": model_config.max_model_len,
                     "pooler": {"pooling_type": getattr(pooler, "seq_pooling_type", None),
                                "use_activation": getattr(pooler, "use_activation", None),
                                "dimensions": getattr(pooler, "dimensions", None)}}})
    serve(llm, commands, reply)


if __name__ == "__main__":
    main()
