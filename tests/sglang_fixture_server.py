"""An HTTP server that answers as SGLang 0.4.10.post2 or 0.5.23 does, from the recorded responses in
tests/fixtures/sglang/<version>/ (written from the upstream source; the README there names the
file each behaviour follows). No model: every request generates ``reply`` tokens, each with
log-prob -0.5, until a finish check ends it (or the reply runs out: ``length`` at what it gave).

It checks what the real server checks, in its order, for each sample of a batch: the sampling
fields against the version's ``SamplingParams`` (HTTP 500 for any other), the context length in the
tokenizer manager (HTTP 400), then, once the sample is "sent to the scheduler" (recorded in
``scheduled``), the prompt against ``max_req_input_len`` (HTTP 400); a refused sample answers the
whole batch with its error while the samples sent before it stay scheduled. ``max_new_tokens`` is
capped at ``max_req_len - 1 - prompt``. A request that arrives while paused is parked until
``/continue_generation``.

Lengths (the server's default flags: no ``--allow-auto-truncate``, no speculative decoding): the
tokenizer manager refuses prompt + ``max_new_tokens`` >= context (0.4.10.post2) or > context
(0.5.23) with HTTP 400 — it never caps there; the scheduler's silent cap only shortens a request
the tokenizer manager let through, by 1 token (0.4.10) or up to 2 (0.5.23) with a large KV pool.

Finish checks after each token, in the version's order (0.4.10.post2 ``Req.check_finished``: length,
then token stops, then stop strings; 0.5.23 ``Req.update_finish_state``: stop strings, token stops,
length): token stops are ``stop_token_ids`` and the model's ``eos_ids``, **both skipped under
``ignore_eos``**; stop strings (``stop``, matched on ``decode`` of the output, which must then be
given) apply with or without ``ignore_eos``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
VERSIONS = ("0.4.10.post2", "0.5.23")


def fixture(version: str, name: str) -> dict[str, Any]:
    """One recorded response, its ``_mirrors`` note removed."""
    data = json.loads((FIXTURES / version / f"{name}.json").read_text())
    data.pop("_mirrors", None)
    return dict(data)


class SGLangFixtureServer:
    """``async with SGLangFixtureServer("0.4.10.post2") as srv: srv.url``."""

    def __init__(self, version: str, *, context_length: int = 64, max_total_num_tokens: int = 100_000,
                 reply: list[int] | None = None, eos_ids: Iterable[int] = (),
                 decode: Callable[[list[int]], str] | None = None, port: int = 0) -> None:
        assert version in VERSIONS, version
        self.port = port
        self.version = version
        self.new = version.startswith("0.5")
        self.server_info = fixture(version, "server_info")
        self.model_info = fixture(version, "model_info")
        self.context_length = context_length
        self.max_req_len = min(context_length - 1, max_total_num_tokens - 1)  # srt/managers/tp_worker.py
        self.max_req_input_len = self.max_req_len - 5
        self.server_info.update(context_length=context_length, max_total_num_tokens=max_total_num_tokens,
                                max_req_input_len=self.max_req_input_len)
        self.fields = set(fixture(version, "sampling_params")["fields"])
        self.reply = list(reply) if reply is not None else [5, 9, 11, 13]
        self.eos_ids = {int(t) for t in eos_ids}
        """The model's end ids (tokenizer EOS, config ``eos_token_id``): a token stop unless ``ignore_eos``."""
        self.decode = decode
        """The tokenizer's decode, for stop strings; None: a request with ``stop`` is refused (HTTP 500)."""
        self.weight_version = "default"
        self.scheduled: list[dict[str, Any]] = []
        """Every sample the "scheduler" received: {rid, prompt_len, max_new_tokens, sampling}."""
        self.aborted: list[str] = []
        self.deprecated_calls = 0
        """Calls of endpoints 0.5.23 logs as deprecated (/get_model_info, /get_server_info)."""
        self.parked = asyncio.Event()
        """Set when a request arrived while paused."""
        self._running = asyncio.Event()
        self._running.set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> SGLangFixtureServer:
        app = web.Application()
        routes = [web.post("/generate", self._generate), web.get("/health", self._ok),
                  web.get("/health_generate", self._ok), web.get("/get_model_info", self._model_info_old),
                  web.get("/get_server_info", self._server_info_old), web.post("/abort_request", self._abort),
                  web.post("/pause_generation", self._pause), web.post("/continue_generation", self._continue),
                  web.post("/update_weights_from_disk", self._update)]
        if self.new:
            routes += [web.get("/model_info", self._model_info), web.get("/server_info", self._server_info),
                       web.get("/v1/loads", self._loads)]
        else:
            routes += [web.get("/get_load", self._get_load)]
        app.add_routes(routes)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


    def generation_requests(self) -> list[dict[str, Any]]:
        """The scheduled samples other than the client's one-token probes (prompt ``[0]``)."""
        return [s for s in self.scheduled if s["prompt"] != [0]]

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self.model_info, "weight_version": self.weight_version})

    async def _model_info_old(self, request: web.Request) -> web.Response:
        if self.new:
            self.deprecated_calls += 1
            return await self._model_info(request)
        return web.json_response(self.model_info)

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.server_info)

    async def _server_info_old(self, request: web.Request) -> web.Response:
        if self.new:
            self.deprecated_calls += 1
        return web.json_response(self.server_info)

    async def _get_load(self, request: web.Request) -> web.Response:
        return web.json_response(fixture(self.version, "get_load"))

    async def _loads(self, request: web.Request) -> web.Response:
        return web.json_response(fixture(self.version, "v1_loads"))

    async def _abort(self, request: web.Request) -> web.Response:
        self.aborted.append(str((await request.json()).get("rid", "")))
        return web.Response(status=200)

    async def _pause(self, request: web.Request) -> web.Response:
        self._running.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        self._running.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _update(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.new and body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    def _refusal(self, prompt: list[int], sampling: dict[str, Any]) -> tuple[int, str] | None:
        """The tokenizer manager's checks (before the scheduler sees the sample)."""
        unknown = set(sampling) - self.fields
        if unknown:  # SamplingParams(**kwargs): TypeError, not caught as ValueError
            return 500, "Internal Server Error"
        n, max_new = len(prompt), sampling.get("max_new_tokens", 128)
        if n >= self.context_length:
            return 400, f"The input ({n} tokens) is longer than the model's context length ({self.context_length} tokens)."
        # 0.4.10.post2 tokenizer_manager.py:586-598 (>=); 0.5.23 tokenizer_manager.py:1353-1377 (>, and
        # num_reserved_tokens = 0 without eagle): HTTP 400 — the truncation branch needs --allow-auto-truncate
        over = (max_new + n > self.context_length) if self.new else (max_new + n >= self.context_length)
        if max_new is not None and over:
            return 400, (f"Requested token count exceeds the model's maximum context length of {self.context_length} "
                         f"tokens. You requested a total of {max_new + n} tokens: {n} tokens from the input messages "
                         f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input "
                         f"messages or the completion to fit within the limit.")
        if sampling.get("stop") and self.decode is None:
            return 500, "the fixture was given no decode: it cannot match stop strings"
        return None

    def _finish(self, out: list[int], sampling: dict[str, Any], max_new: int) -> dict[str, Any] | None:
        """The finish check after ``out[-1]`` was appended, in the version's order; None: go on."""
        last = out[-1]
        token_stop = (not sampling.get("ignore_eos", False)
                      and (last in set(sampling.get("stop_token_ids") or []) or last in self.eos_ids))
        stop_strs = sampling.get("stop") or []
        stop_strs = [stop_strs] if isinstance(stop_strs, str) else list(stop_strs)
        text = self.decode(out) if stop_strs and self.decode is not None else ""
        matched_str = next((s for s in stop_strs if s and s in text), None)
        checks = [("length", len(out) >= max_new), ("token", token_stop), ("str", matched_str is not None)]
        if self.new:  # 0.5.23 schedule_batch.py:2026-2038: strings, then tokens, then length
            checks = [checks[2], checks[1], checks[0]]
        for kind, hit in checks:  # 0.4.10.post2 schedule_batch.py:690-738: length, tokens, strings
            if hit:
                return ({"type": "length", "length": max_new} if kind == "length"
                        else {"type": "stop", "matched": last if kind == "token" else matched_str})
        return None

    def _answer(self, rid: str, prompt: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
        max_new = min(int(sampling.get("max_new_tokens", 128)), self.max_req_len - len(prompt) - 1)
        out: list[int] = []
        finish: dict[str, Any] | None = None
        for t in self.reply:
            if len(out) >= max_new:
                break
            out.append(t)
            finish = self._finish(out, sampling, max_new)
            if finish is not None:
                break
        if finish is None:  # the reply ran out (or max_new_tokens 0)
            finish = {"type": "length", "length": len(out)}
        template = fixture(self.version, "generate")
        meta = {**template["meta_info"], "id": rid, "finish_reason": finish, "prompt_tokens": len(prompt),
                "output_token_logprobs": [[-0.5, t, None] for t in out], "completion_tokens": len(out)}
        answer: dict[str, Any] = {"text": "", "meta_info": meta}
        if self.new:
            answer["output_ids"] = out
            meta["weight_version"] = self.weight_version
            meta["weight_versions"] = [{"version": self.weight_version, "start": 0, "end": len(out)}]
        return answer

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not self._running.is_set():
            self.parked.set()
            await self._running.wait()
        ids = body["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        raw_sp, raw_rid = body.get("sampling_params") or {}, body.get("rid")
        answers, error = [], None
        for i, prompt in enumerate(prompts):
            sampling = raw_sp[i] if isinstance(raw_sp, list) else raw_sp
            rid = (raw_rid[i] if isinstance(raw_rid, list) else raw_rid) or f"auto-{len(self.scheduled)}"
            refusal = self._refusal(prompt, sampling)
            if refusal is not None:
                error = refusal
                break
            self.scheduled.append({"rid": rid, "prompt": list(prompt), "sampling": dict(sampling)})
            if len(prompt) >= self.max_req_input_len:  # srt/managers/utils.py validate_input_length
                error = (400, f"Input length ({len(prompt)} tokens) exceeds the maximum allowed length "
                              f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.")
                continue  # the batch's other samples are already with the scheduler
            answers.append(self._answer(rid, prompt, sampling))
        if error is not None:
            status, message = error
            if status == 500:
                return web.Response(status=500, text=message)
            return web.json_response({"error": {"message": message}}, status=400)  # _create_error_response
        return web.json_response(answers if batch else answers[0])


@contextlib.contextmanager
def serve_in_thread(version: str, **kwargs: Any) -> Iterator[SGLangFixtureServer]:
    """The fixture on its own event loop in a daemon thread, for synchronous tests that call it
    from their own loops (the conformance suite's ``sglang-fixture-*`` engines)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=f"sglang-fixture-{version}", daemon=True)
    thread.start()
    srv = SGLangFixtureServer(version, **kwargs)
    try:
        asyncio.run_coroutine_threadsafe(srv.__aenter__(), loop).result(30)
        try:
            yield srv
        finally:
            asyncio.run_coroutine_threadsafe(srv.__aexit__(None, None, None), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m sglang.launch_server`` as tests/unit/rollout/engines/test_sglang_check.py fakes it: serves the
    recorded SGLang 0.5.23 on ``--port`` until SIGTERM."""
    import argparse
    import signal

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args(argv)

    async def serve() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with SGLangFixtureServer("0.5.23", port=args.port):
            await stop.wait()

    asyncio.run(serve())
