"""The built-in CPU torch engine, served over the subset of SGLang's native HTTP API that
trajmesh's rollout client uses, so one client (``engine_client.EngineClient``) drives both.

```
 HTTP /generate ──▶ _Request ──▶ asyncio.Queue (bounded) ──▶ _generation_loop ──▶ worker thread
   (one future per prompt;                                    (drains up to         decode_batch():
    a batch body fans out)                                     max_batch, one        left-padded batch,
        ▲                                                      round at a time,      KV cache, token by
        └──────────── futures resolved with output ids, ◀──── holding _round_lock)  token, polls abort
                      logprobs, finish_reason, version
 /pause_generation: stop taking rounds, abort the running round (rows return partial output with
                    finish_reason abort) and the queued requests; new requests wait for /continue.
 /update_weights_from_disk: take _round_lock (waits for the running round, or aborts it when
                    abort_all_requests), load the checkpoint in the worker thread, swap, set version.
```

Endpoints and shapes follow SGLang (``python/sglang/srt/entrypoints/http_server.py`` and
``managers/io_struct.py``: ``GenerateReqInput``, ``UpdateWeightFromDiskReqInput``,
``PauseGenerationReqInput``; ``meta_info`` as built in ``tokenizer_manager.py``):
``POST /generate`` {input_ids | text, sampling_params, return_logprob} →
{text, output_ids, meta_info: {id, finish_reason: {type: stop|length|abort, ...}, prompt_tokens,
completion_tokens, cached_tokens, weight_version, output_token_logprobs: [[logprob, token_id, null]]}}
(a list of those for a batch body). ``weight_version`` is a string, as in SGLang. With
``logprob_start_len`` ≥ 0 (and ``return_logprob``), ``meta_info.input_token_logprobs`` holds
``[logprob, token_id, null]`` for each prompt token from that position on, the first token's
logprob ``null``, at the request's temperature, as SGLang returns them (a teacher scoring a
student's sequence reads them: rollout/engines/teacher.py).

Log-probs are those of the distribution actually sampled from: ``log_softmax(logits / T)`` before
top-k/top-p truncation (greedy: T = 1); see ``trajmesh.learner.evaluate``. SGLang's structured
outputs (``json_schema`` / ``regex`` / ``ebnf`` in ``sampling_params``) are honoured with xgrammar
(rollout/engines/grammar.py); a constrained token's log-prob is of the masked distribution, as SGLang's. The demo samples at
T = 1, where they equal the learner's ``log π_θ``. All tokens of one request come from one weight
version: weights are only swapped between rounds.

Weights are loaded in the dtype they were written (``stored_dtype``: the safetensors header, else
``config.json``), as SGLang's ``--dtype auto`` would: the learner publishes in its training dtype
(bf16 on GPU, fp32 on CPU), so the engine samples with the numerics the learner trained.

Run: ``python -m trajmesh.rollout.engines.engine_server --model PATH --port P --host 127.0.0.1 --version V``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import struct
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from trajmesh.rollout.engines.engine_client import ANSWER_LOG_ENV
from trajmesh.rollout.engines.grammar import Grammars, RowConstraint
from trajmesh.rollout.engines.hf_model import load_causal_lm
from trajmesh.rollout.engines.torch_sampler import RequestSampling, Sampled, decode_batch

log = logging.getLogger("trajmesh.rollout.engines.engine_server")

QUEUE_LIMIT = 4096


def model_eos_ids(model: Any, tokenizer_eos_id: int | None) -> set[int]:
    """Every EOS id of the loaded model — its config's, its generation config's (generation_config.json:
    chat models stop on an end-of-turn token too) — and the tokenizer's. SGLang stops on all of them."""
    ids = {int(tokenizer_eos_id)} if tokenizer_eos_id is not None else set()
    for source in (model.config, getattr(model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        ids |= {int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None}
    return ids



_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_CONFIG_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def stored_dtype(model_dir: str | Path) -> torch.dtype:
    """The dtype a checkpoint's floating tensors were written in: the first floating tensor in the
    safetensors header (``model.safetensors``, or the first shard of its index), else
    ``config.json``'s ``torch_dtype`` / ``dtype``, else float32."""
    root = Path(model_dir)
    shard = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if not shard.is_file() and index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        shard = root / shards[0] if shards else shard
    if shard.is_file():
        with open(shard, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__" and meta.get("dtype") in _SAFETENSORS_DTYPES:
                return _SAFETENSORS_DTYPES[meta["dtype"]]
    config = root / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        value = cfg.get("torch_dtype") or cfg.get("dtype")
        if value in _CONFIG_DTYPES:
            return _CONFIG_DTYPES[value]
    return torch.float32


def load_served_model(model_dir: str) -> tuple[Any, Any]:
    """(model in eval mode on the CPU, in the dtype its weights were written; tokenizer)."""
    from transformers import AutoTokenizer

    model = load_causal_lm(model_dir, dtype=stored_dtype(model_dir), attn_implementation="eager")
    return model, AutoTokenizer.from_pretrained(model_dir)


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    params: RequestSampling
    return_logprob: bool
    future: asyncio.Future = field(repr=False)
    grammar: Any = None
    """The compiled constraint (``params.constraint``), or None."""
    logprob_start_len: int = -1
    """SGLang's ``logprob_start_len``: the first prompt position whose log-prob is returned in
    ``input_token_logprobs`` (-1: none, only the output's)."""
    input_logprobs: list[float | None] | None = None
    """Log-probs of prompt tokens from ``logprob_start_len`` on (filled by the round)."""


def _aborted() -> Sampled:
    return Sampled(finish_reason={"type": "abort", "message": "generation paused"})


def _error(message: str, status: int = 400) -> web.Response:
    """SGLang's error body (``http_server._create_error_response``)."""
    return web.json_response({"error": {"message": message}}, status=status)


def _fit_context(prompt: list[int], sp: RequestSampling, context_len: int) -> RequestSampling:
    """vLLM's length handling: a prompt that leaves no room for one token fails the whole request,
    batch included (HTTP 400); otherwise ``max_new_tokens`` is capped so prompt + output stays within
    the context (vLLM caps ``max_tokens`` at ``max_model_len`` minus the prompt, silently)."""
    n = len(prompt)
    if n >= context_len:
        raise ValueError(f"The input ({n} tokens) plus the requested output (at least 1 token) is longer "
                         f"than the model's context length ({context_len} tokens).")
    return replace(sp, max_new_tokens=min(sp.max_new_tokens, context_len - n))


def _input_logprobs(model: Any, ids: list[int], start: int, temperature: float) -> list[float | None]:
    """SGLang's ``input_token_logprobs`` values: log π(ids[k] | ids[:k]) for k from `start` on, at
    the request's temperature (SGLang scales input log-probs by it; 0, greedy, reads as 1), the
    first token's ``None`` when `start` is 0 (nothing precedes it)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    target = torch.tensor(ids[1:])
    per_token = logp[:-1].gather(-1, target[:, None])[:, 0].tolist()  # per_token[k-1]: token k
    values: list[float | None] = [None, *per_token]
    return values[start:]


class TorchEngineServer:
    """Lifecycle: ``setup()`` loads the model and builds the app; ``run()`` serves until ``stop()``."""

    def __init__(
        self, model_path: str, *, host: str, port: int, version: str, max_batch: int = 256, seed: int = 0
    ) -> None:
        self.model_path, self.host, self.port = model_path, host, port
        self.weight_version = str(version)
        self.max_batch, self.seed = max_batch, seed
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-engine")
        self._abort_round = threading.Event()  # polled by the worker thread between tokens
        self._stopped = asyncio.Event()
        self._running = 0  # requests in the round being decoded (reported by /get_load)
        answers = os.environ.get(ANSWER_LOG_ENV)
        self._answers = open(Path(answers) / f"engine-{os.getpid()}.jsonl", "a", buffering=1) if answers else None  # noqa: SIM115
        """Tests: every answer this engine gives, one JSON line each (`ANSWER_LOG_ENV`)."""

    # ------------------------------------------------------------------ lifecycle

    async def setup(self) -> None:
        loop = asyncio.get_running_loop()
        self.model, self.tokenizer = await loop.run_in_executor(self._executor, load_served_model, self.model_path)
        self._generator = torch.Generator().manual_seed(self.seed)
        self._grammars = Grammars(self.tokenizer, int(self.model.get_output_embeddings().weight.shape[0]),
                                  model_eos_ids(self.model, self.tokenizer.eos_token_id))
        self._queue: asyncio.Queue[_Request] = asyncio.Queue(maxsize=QUEUE_LIMIT)
        self._not_paused = asyncio.Event()
        self._not_paused.set()
        self._round_lock = asyncio.Lock()
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.add_routes(
            [
                web.post("/generate", self._generate),
                web.post("/update_weights_from_disk", self._update_weights_from_disk),
                web.post("/pause_generation", self._pause_generation),
                web.post("/continue_generation", self._continue_generation),
                web.route("*", "/flush_cache", self._flush_cache),
                web.get("/health", self._health),
                web.get("/health_generate", self._health_generate),
                web.get("/get_model_info", self._get_model_info),
                web.get("/get_server_info", self._get_server_info),
                web.get("/get_load", self._get_load),
            ]
        )
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()

    async def run(self) -> None:
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        log.info(
            "torch engine serving %s (version %s) on %s:%d",
            self.model_path,
            self.weight_version,
            self.host,
            self.port,
        )
        loop_task = asyncio.create_task(self._generation_loop(), name="generation-loop")
        stop_task = asyncio.create_task(self._stopped.wait())
        done, _ = await asyncio.wait({loop_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if loop_task in done:  # a producer that returns is a crash
            stop_task.cancel()
            await self._runner.cleanup()
            loop_task.result()
            raise RuntimeError("generation loop exited")
        self._abort_round.set()
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
        await self._runner.cleanup()
        self._executor.shutdown(wait=True)

    def stop(self) -> None:
        self._stopped.set()

    # ------------------------------------------------------------------ generation

    async def _generation_loop(self) -> None:
        """Consumes ``_queue``; waits for a first request and for ``_not_paused``; drains up to
        ``max_batch`` more and runs them as one round in the worker thread under ``_round_lock``.
        Unblocked by new requests and by /continue_generation."""
        loop = asyncio.get_running_loop()
        while True:
            await self._not_paused.wait()
            first = await self._queue.get()
            batch = [first]
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            batch = [r for r in batch if not r.future.done()]
            if not batch:
                continue
            async with self._round_lock:
                version, model = self.weight_version, self.model
                if not self._not_paused.is_set():  # paused between dequeue and the round: abort them
                    for r in batch:
                        r.future.set_result(self._response(r, _aborted(), version))
                    continue
                self._running = len(batch)
                try:
                    outs = await loop.run_in_executor(self._executor, self._run_round, model, batch)
                except Exception as exc:  # the round fails as a whole; report it to every caller
                    log.exception("generation round failed")
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(exc)
                    continue
                finally:
                    self._running = 0
            for r, o in zip(batch, outs, strict=True):
                if not r.future.done():
                    r.future.set_result(self._response(r, o, version))

    def _run_round(self, model: Any, batch: list[_Request]) -> list[Sampled]:
        for r in batch:
            if r.return_logprob and r.logprob_start_len >= 0:
                r.input_logprobs = _input_logprobs(model, r.input_ids, r.logprob_start_len, r.params.temperature)
        return decode_batch(
            model,
            [r.input_ids for r in batch],
            [r.params for r in batch],
            pad_id=self.tokenizer.pad_token_id,
            eos_ids=model_eos_ids(model, self.tokenizer.eos_token_id),
            decode=self.tokenizer.decode,
            generator=self._generator,
            should_abort=self._abort_round.is_set,
            constraints=[RowConstraint(r.grammar) if r.grammar is not None else None for r in batch],
        )

    @property
    def context_len(self) -> int:
        """The model's context length (``max_position_embeddings``), as SGLang derives it."""
        return int(self.model.config.max_position_embeddings)

    def _response(self, r: _Request, o: Sampled, version: str) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": o.finish_reason,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": len(o.output_ids),
            "cached_tokens": 0,
            "weight_version": version,
        }
        if r.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tid, None] for lp, tid in zip(o.logprobs, o.output_ids, strict=True)
            ]
            if r.input_logprobs is not None:
                starts = r.input_ids[r.logprob_start_len:]
                meta["input_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(r.input_logprobs, starts, strict=True)]
        text = self.tokenizer.decode(o.output_ids, skip_special_tokens=True)
        if self._answers is not None:
            self._answers.write(json.dumps({"input_ids": list(r.input_ids), "output_ids": list(o.output_ids),
                                            "logprobs": list(o.logprobs), "weight_version": version}) + "\n")
        return {"text": text, "output_ids": list(o.output_ids), "meta_info": meta}

    async def _abort_running_and_queued(self) -> int:
        """Abort the running round (partial outputs) and every queued request; returns how many were queued."""
        aborted = 0
        while not self._queue.empty():
            r = self._queue.get_nowait()
            if not r.future.done():
                r.future.set_result(self._response(r, _aborted(), self.weight_version))
                aborted += 1
        self._abort_round.set()
        async with self._round_lock:  # the running round (if any) has returned its partial outputs
            self._abort_round.clear()
        return aborted

    # ------------------------------------------------------------------ handlers

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("stream"):
            return _error("stream is not supported by the torch engine")
        input_ids, text = body.get("input_ids"), body.get("text")
        if (input_ids is None) == (text is None):
            return _error("give exactly one of input_ids or text")
        if text is not None:
            single = isinstance(text, str)
            texts = [text] if single else list(text)
            prompts = [list(self.tokenizer(t)["input_ids"]) for t in texts]
        else:
            single = not (len(input_ids) > 0 and isinstance(input_ids[0], list))
            prompts = [list(map(int, input_ids))] if single else [list(map(int, p)) for p in input_ids]
        n = len(prompts)
        if n == 0 or any(len(p) == 0 for p in prompts):
            return _error("empty prompt")
        if any(t < 0 or t >= len(self.tokenizer) for p in prompts for t in p):
            return _error("token id outside the vocabulary")
        raw_sp = body.get("sampling_params")
        raw_lp = body.get("return_logprob", False)
        raw_start = body.get("logprob_start_len", -1)
        starts = [int(raw_start[i] if isinstance(raw_start, list) else raw_start) for i in range(n)]
        for p, start in zip(prompts, starts, strict=True):
            if start >= len(p):  # SGLang's scheduler aborts such a request with this message
                return _error(f"logprob_start_len={start} is higher than the number of input tokens "
                              f"len(origin_input_ids)={len(p)}. Please use a smaller logprob_start_len.")
        rids = body.get("rid")
        try:
            sps = [_fit_context(p, RequestSampling.parse(raw_sp[i] if isinstance(raw_sp, list) else raw_sp),
                                self.context_len) for i, p in enumerate(prompts)]
        except (ValueError, TypeError) as exc:
            return _error(str(exc))
        loop = asyncio.get_running_loop()
        try:  # structured outputs: compiled off the loop (xgrammar; the first one imports it)
            grammars = [None if sp.constraint is None else
                        await loop.run_in_executor(None, self._grammars.compile, sp.constraint) for sp in sps]
        except ValueError as exc:
            return _error(str(exc))
        reqs = []
        for i in range(n):
            rid = (
                rids[i] if isinstance(rids, list) else rids if single and rids else None
            ) or uuid.uuid4().hex
            rl = bool(raw_lp[i] if isinstance(raw_lp, list) else raw_lp)
            reqs.append(_Request(rid, prompts[i], sps[i], rl, loop.create_future(), grammars[i], starts[i]))
        for r in reqs:
            await self._queue.put(r)
        outs = await asyncio.gather(*(r.future for r in reqs))
        return web.json_response(outs[0] if single else outs)

    async def _update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        model_path = body.get("model_path")
        if not model_path:
            return web.json_response({"success": False, "message": "model_path is required"}, status=400)
        if body.get("abort_all_requests"):
            await self._abort_running_and_queued()
        loop = asyncio.get_running_loop()
        async with self._round_lock:
            try:
                model, _ = await loop.run_in_executor(self._executor, load_served_model, model_path)
            except (OSError, ValueError) as exc:
                return web.json_response(
                    {"success": False, "message": f"Failed to load weights from {model_path}: {exc}"},
                    status=400,
                )
            self.model, self.model_path = model, model_path
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
        log.info("loaded weights from %s (version %s)", model_path, self.weight_version)
        return web.json_response(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    async def _pause_generation(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        mode = body.get("mode", "abort")
        if mode != "abort":
            return web.json_response(
                {"error": f"pause mode {mode!r} is not supported; use 'abort'"}, status=400
            )
        self._not_paused.clear()
        await self._abort_running_and_queued()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue_generation(self, request: web.Request) -> web.Response:
        self._not_paused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _flush_cache(self, request: web.Request) -> web.Response:
        # No KV cache outlives a round, so there is nothing to flush.
        return web.Response(text="Cache flushed.\n")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _health_generate(self, request: web.Request) -> web.Response:
        if not self._not_paused.is_set():
            return web.Response(status=200)  # paused on purpose; the engine itself is alive
        loop = asyncio.get_running_loop()
        r = _Request(
            "health-" + uuid.uuid4().hex,
            [self.tokenizer.bos_token_id],
            RequestSampling(temperature=0.0, max_new_tokens=1),
            False,
            loop.create_future(),
        )
        await self._queue.put(r)
        await asyncio.wait_for(r.future, timeout=30)
        return web.Response(status=200)

    async def _get_model_info(self, request: web.Request) -> web.Response:
        cfg = self.model.config
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "model_type": getattr(cfg, "model_type", None),
                "architectures": getattr(cfg, "architectures", None),
                "context_length": self.context_len,
            }
        )

    async def _get_load(self, request: web.Request) -> web.Response:
        """SGLang's /get_load shape: one entry per data-parallel rank."""
        return web.json_response(
            [{"dp_rank": 0, "num_reqs": self._running, "num_waiting_reqs": self._queue.qsize()}]
        )

    async def _get_server_info(self, request: web.Request) -> web.Response:
        """The fields of SGLang's /get_server_info the client reads (context length)."""
        return web.json_response(
            {"context_length": self.context_len, "max_req_input_len": self.context_len - 1,
             "weight_version": self.weight_version, "version": "trajmesh-torch-engine"}
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model directory (safetensors + tokenizer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--version", default="default",
                        help="policy version of --model (meta_info.weight_version; SGLang's \"default\" if unset)")
    parser.add_argument("--max-batch", type=int, default=256, help="most requests sharing one round")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)

    async def _serve() -> None:
        server = TorchEngineServer(
            args.model,
            host=args.host,
            port=args.port,
            version=args.version,
            max_batch=args.max_batch,
            seed=args.seed,
        )
        await server.setup()
        import signal

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stop)
        await server.run()

    asyncio.run(_serve())


if __name__ == "__main__":
    main()
