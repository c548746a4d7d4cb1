"""An HTTP server that answers as SGLang 0.4.10.post2 or 0.5.23 does, from the recorded responses in
tests/fixtures/sglang/<version>/ (written from the upstream source; the README there names the
file each behaviour follows). No model: every request generates ``reply`` tokens (cut at the
capped ``max_new_tokens``), each with log-prob -0.5.

It checks what the real server checks, in its order, for each sample of a batch: the sampling
fields against the version's ``SamplingParams`` (HTTP 500 for any other), the context length in the
tokenizer manager (HTTP 400), then, once the sample is "sent to the scheduler" (recorded in
``scheduled``), the prompt against ``max_req_input_len`` (HTTP 400); a refused sample answers the
whole batch with its error while the samples sent before it stay scheduled. ``max_new_tokens`` is
capped at ``max_req_len - 1 - prompt``. A request that arrives while paused is parked until
``/continue_generation``.
"""

from __future__ import annotations

import asyncio
import json
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
                 reply: list[int] | None = None, port: int = 0) -> None:
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
        over = (max_new + n > self.context_length) if self.new else (max_new + n >= self.context_length)
        if max_new is not None and over:
            return 400, f"Requested token count exceeds the model's maximum context length of {self.context_length} tokens."
        return None

    def _answer(self, rid: str, prompt: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
        max_new = min(int(sampling.get("max_new_tokens", 128)), self.max_req_len - len(prompt) - 1)
        stops = set(sampling.get("stop_token_ids") or [])
        out: list[int] = []
        for t in self.reply[:max_new]:
            out.append(t)
            if t in stops:
                break
        finish = ({"type": "stop", "matched": out[-1]} if out and out[-1] in stops
                  else {"type": "length", "length": len(out)})
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
