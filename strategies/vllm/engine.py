"""The job runner's engine interface over a vLLM worker process (strategies/vllm/worker.py).

Requests go over as token ids with vLLM-named sampling parameters; one `step` is one vLLM engine
step and answers with the requests it finished, the step statistics vLLM's stat logger saw, and
per-request refusals (which become error records: the job goes on).
"""
from __future__ import annotations

import json
import logging
import select
import subprocess
import time
from pathlib import Path
from typing import Optional

from batchinfer.engine.admission import check_lora, check_prompt
from batchinfer.engine.build import model_source, resolve_device
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.output import logprob_entry, prompt_entry
from batchinfer.engine.parallel_sampling import child_id, gather
from batchinfer.engine.errors import ConfigError, RequestError
from batchinfer.engine.model.lora_adapters import lora_info
from batchinfer.engine.request import FinishReason, Request, RequestOutput

from .params import WORKER, VllmParams, engine_args, engine_env, vllm_python

log = logging.getLogger(__name__)

# our SamplingParams fields, all named and meant as vLLM's
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
                   "include_stop_str_in_output", "ignore_eos", "max_tokens", "min_tokens",
                   "logprobs", "prompt_logprobs", "skip_special_tokens", "logit_bias",
                   "allowed_token_ids", "bad_words", "structured_outputs")


class VllmWorkerError(RuntimeError):
    """The vLLM process stopped answering (it crashed or was killed)."""


def sampling_args(request: Request) -> dict:
    """vLLM's parameters for `request`; n > 1 at temperature 0 (which vLLM 0.32 refuses) asks
    for one reply, repeated n times as our engine's (engine/parallel_sampling.py)."""
    params = request.sampling.model_dump()
    if request.sampling.structured_outputs is not None:   # the keys set: vLLM's dataclass
        params["structured_outputs"] = request.sampling.structured_outputs.model_dump(
            exclude_defaults=True)
    if request.sampling.greedy:
        params["n"] = 1
    return {k: params[k] for k in SAMPLING_FIELDS if params.get(k) is not None}


def vllm_model(model_cfg) -> tuple:
    """(directory, model id, tokenizer, vocabulary size) of the model vLLM runs: our engine's
    reading where it runs the architecture; else (an architecture only vLLM runs, the route our
    engine's error names) the tokenizer and config.json's vocabulary (the tokenizer's without)."""
    from batchinfer.engine.model.arch import foreign_model
    from batchinfer.engine.model.sources import resolve_model_dir
    from batchinfer.engine.tokenizer import load_tokenizer

    model_dir, model_id = resolve_model_dir(model_cfg.path)
    foreign = foreign_model(model_dir, model_cfg.hf_overrides or None)
    if foreign is None:
        source = model_source(model_cfg)
        return source.model_dir, source.model_id, source.tokenizer, source.arch.vocab_size
    tokenizer = load_tokenizer(model_cfg, model_dir, model_id)
    return model_dir, model_id, tokenizer, foreign[0] or tokenizer.vocab_size


class VllmEngine:
    def __init__(self, proc: subprocess.Popen, tokenizer, model_id: str, facts: dict,
                 info: dict, vocab_size: int):
        self._proc = proc
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_model_len = facts["max_model_len"]
        self.info = info
        self._facts = facts
        self.vocab_size = vocab_size          # the model's token ids are 0..vocab_size-1
        self._running: dict[str, tuple[Request, float]] = {}
        self._events: list[dict] = []
        self._preemptions = 0
        self._prefix = (0, 0)
        self._kv_usage = 0.0
        self._t0 = time.perf_counter()

    @classmethod
    def start(cls, config: EngineConfig, params: VllmParams) -> "VllmEngine":
        python = vllm_python(params)
        device = resolve_device(config.device.device).type
        model_dir, model_id, tokenizer, vocab_size = vllm_model(config.model)
        args = engine_args(config, params, model_dir, device)
        log.info("starting vLLM under %s: %s", python, args)
        proc, facts = start_worker(WORKER, python, args, engine_env(config, device=device),
                                   params.startup_timeout_seconds)
        log.info("vLLM %s ready: KV cache %d tokens", facts.get("vllm_version"),
                 facts.get("kv_capacity_tokens", 0))
        info = {"device": device, "dtype": args["dtype"], "strategy": "vllm",
                "model_id": model_id, "kv_block_size": facts.get("kv_block_size"),
                "max_model_len": facts["max_model_len"],
                "parallel": {"tp": config.parallel.tp, "pp": config.parallel.pp, "dp": 1},
                "strategy_stats": {"vllm_version": facts.get("vllm_version"), "python": python,
                                   "engine_args": args}, **lora_info(config.model)}
        return cls(proc, tokenizer, model_id, facts, info, vocab_size)

    def now(self) -> float:
        return time.perf_counter() - self._t0

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self._running:
            raise RequestError("duplicate_id",
                               f"request id {request.request_id!r} is already running")
        check_prompt(request, self.max_model_len, self.vocab_size)
        check_lora(request, self.info.get("lora_modules"))
        lora = ([request.lora, request.lora_slot, self.info["lora_paths"][request.lora]]
                if request.lora is not None else None)      # a LoRARequest's fields
        self._send({"op": "add", "id": request.request_id,
                    "prompt_token_ids": request.prompt_token_ids,
                    "sampling": sampling_args(request), "lora": lora})
        self._running[request.request_id] = (request, self.now())

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def step(self) -> list[RequestOutput]:
        self._send({"op": "step"})
        reply = _read(self._proc)
        now = self.now()
        self._events.extend(reply["events"])
        if reply["events"]:
            self._kv_usage = float(reply["events"][-1].get("kv_usage", 0.0))
        self._preemptions = reply.get("preemptions", 0)
        self._prefix = tuple(reply.get("prefix_cache") or (0, 0))
        outs = []
        for done in reply["finished"]:
            request, arrival = self._running.pop(done["id"])
            if request.sampling.n == 1:
                outs.append(self._reply(request, request.request_id, done, arrival, now))
                continue
            samples = done.get("samples") or [done]      # greedy: one reply stands for n
            if done.get("prompt_logprobs") is not None:   # scored once, for the request:
                samples[0] = {**samples[0], "prompt_logprobs": done["prompt_logprobs"]}
            outs.append(gather(request, [
                self._reply(request, child_id(request.request_id, i), sample, arrival, now)
                for i, sample in enumerate(samples)], arrival))
        for refused in reply["errors"]:
            request, arrival = self._running.pop(refused["id"])
            outs.append(RequestOutput(
                request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                output_token_ids=[], text="", finish_reason=FinishReason.ERROR,
                payload=request.payload, error=f"vLLM refused the request: {refused['error']}",
                arrival_time=arrival, finish_time=now))
        return outs

    def _reply(self, request: Request, rid: str, done: dict, arrival: float,
               now: float) -> RequestOutput:
        """One reply the worker sent (a request's, or one of its n samples')."""
        return RequestOutput(
            request_id=rid, prompt_token_ids=request.prompt_token_ids,
            output_token_ids=done["token_ids"], text=done["text"],
            finish_reason=FinishReason(done["finish_reason"]), stop_reason=done.get("stop_reason"),
            logprobs=self._logprobs(done["logprobs"]),
            prompt_logprobs=self._prompt_logprobs(request, done.get("prompt_logprobs")),
            payload=request.payload, arrival_time=arrival, finish_time=now)

    def _prompt_logprobs(self, request: Request, entries: Optional[list]) -> Optional[list]:
        """The worker's [None, [logprob, rank, [[id, logprob], ...]], ...] as our engine's."""
        if entries is None:
            return None
        return [None if entry is None else prompt_entry(self.tokenizer, token, *entry)
                for token, entry in zip(request.prompt_token_ids, entries)]

    def _logprobs(self, entries: Optional[list]) -> Optional[list[dict]]:
        """The worker's [id, logprob, [[id, logprob], ...]] in our engine's record format."""
        if entries is None:
            return None
        return [logprob_entry(self.tokenizer, token, logprob, top)
                for token, logprob, top in entries]

    def abort_all(self) -> list[RequestOutput]:
        self._send({"op": "abort_all"})
        _read(self._proc)
        now = self.now()
        outs = [RequestOutput(request_id=rid, prompt_token_ids=request.prompt_token_ids,
                              output_token_ids=[], text="", finish_reason=FinishReason.ABORT,
                              payload=request.payload, arrival_time=arrival, finish_time=now)
                for rid, (request, arrival) in self._running.items()]
        self._running.clear()
        return outs

    def close(self) -> None:
        stop_worker(self._proc)

    # --- reporting ------------------------------------------------------------------------------
    def drain_step_events(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict:
        capacity = self._facts.get("kv_capacity_tokens") or 0
        queried, hit = self._prefix
        return {**self.info,
                "kv_capacity_tokens": capacity,
                "kv_usage": self._kv_usage,
                "max_concurrency": capacity / self.max_model_len if capacity else None,
                "num_preemptions": self._preemptions,
                **({"prefix_cache": {"queried_tokens": queried, "hit_tokens": hit,
                                     "hit_rate": round(hit / queried, 4) if queried else None}}
                   if self.info["strategy_stats"]["engine_args"].get("enable_prefix_caching")
                   else {})}

    def _send(self, message: dict) -> None:
        send_to_worker(self._proc, message, flush=message["op"] != "add")   # adds go with a step


def send_to_worker(proc: subprocess.Popen, message: dict, flush: bool = True) -> None:
    """One JSON line to a worker; VllmWorkerError when it has stopped."""
    try:
        proc.stdin.write(json.dumps(message) + "\n")
        if flush:
            proc.stdin.flush()
    except (BrokenPipeError, OSError) as exc:
        raise VllmWorkerError(f"the vLLM process has stopped (exit code {proc.poll()}); its log "
                              "is above") from exc


def stop_worker(proc: subprocess.Popen) -> None:
    """Asks a running worker to close (a minute's grace), else kills it."""
    if proc.poll() is None:
        try:
            send_to_worker(proc, {"op": "close"})
            proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired, VllmWorkerError):
            proc.kill()
            proc.wait()


def start_worker(script: Path, python: str, args: dict, env: dict,
                 timeout: float) -> tuple[subprocess.Popen, dict]:
    """Starts a vLLM worker process (`script` under `python`) with `args` and waits for its
    ready facts; a refusal is a ConfigError with vLLM's words, and a signal or the start-up
    bound never leaves vLLM running."""
    proc = subprocess.Popen([python, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, text=True, bufsize=1, start_new_session=True)
    try:
        proc.stdin.write(json.dumps({"engine_args": args}) + "\n")
        proc.stdin.flush()
        first = _read(proc, timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if "ready" not in first:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise ConfigError(f"strategy vllm: {first.get('error')}")
    return proc, first["ready"]


def _read(proc: subprocess.Popen, timeout: Optional[float] = None) -> dict:
    """The worker's next reply; VllmWorkerError when it exits or stays silent past `timeout`."""
    if timeout is not None:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            proc.kill()
            raise VllmWorkerError(f"vLLM did not start within {timeout:.0f} s")
    line = proc.stdout.readline()
    if not line:
        code = proc.wait()
        raise VllmWorkerError(f"the vLLM process exited (code {code}) without answering; its "
                              "log is above")
    return json.loads(line)
