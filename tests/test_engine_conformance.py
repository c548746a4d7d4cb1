"""The SGLang behaviours the rollout depends on, checked against every engine it can drive.

The built-in torch engine runs here (``make test``). With ``TRAJMESH_SGLANG_URL`` set (and
``TRAJMESH_SGLANG_MODEL``, the HF directory that server was launched with) the same tests run
against that SGLang server (marker ``gpu``; ``make gpu-check`` starts one). Launch SGLang with
``--enable-deterministic-inference`` for the ``sampling_seed`` test. Behaviours that no HTTP call can
provoke on demand (an abort landing on the very step that sampled EOS) are checked on the torch
engine's token loop and on the rollout's handling of SGLang's response shape.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from trajmesh.learner.models import build_char_tokenizer, build_tiny_model, encode_prompt, load_model  # noqa: E402
from trajmesh.learner.step import Batch, token_logprobs  # noqa: E402
from trajmesh.rollout.engine_client import EngineClient, EngineError, parse_weight_version  # noqa: E402
from trajmesh.rollout.generation import PauseClock, TurnSampler  # noqa: E402

from trajmesh.config import TorchEngineConfig  # noqa: E402
from trajmesh.v1 import trajectory_pb2  # noqa: E402

SGLANG_URL = os.environ.get("TRAJMESH_SGLANG_URL")
SGLANG_MODEL = os.environ.get("TRAJMESH_SGLANG_MODEL")
STARTUP_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + STARTUP_S
    async with EngineClient(url) as client:
        while time.monotonic() < deadline and proc.poll() is None:
            if await client.health():
                return True
            await asyncio.sleep(0.1)
    return False


def _torch_engine(root: Path) -> dict[str, Any]:
    build_char_tokenizer(root / "tok")
    dims = {"hidden": 32, "layers": 2, "heads": 2, "max_positions": 4096}
    build_tiny_model(root / "a", root / "tok", seed=0, **dims)
    build_tiny_model(root / "b", root / "tok", seed=1, **dims)
    port = _free_port()
    log = open(root / "engine.log", "w")  # noqa: SIM115 - closed with the engine
    proc = subprocess.Popen(
        [sys.executable, "-m", "trajmesh.rollout.engine_server", "--model", str(root / "a"), "--port", str(port),
         "--host", "127.0.0.1", "--threads", "1"],  # no --version: SGLang's "default"
        stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    assert _run(_wait_healthy(url, proc)), (root / "engine.log").read_text()
    return {"kind": "torch", "url": url, "model": str(root / "a"), "other": str(root / "b"), "proc": proc,
            "log": log}


@pytest.fixture(scope="module", params=["torch", pytest.param("sglang", marks=pytest.mark.gpu)])
def engine(request, tmp_path_factory):
    if request.param == "sglang":
        if not (SGLANG_URL and SGLANG_MODEL):
            pytest.skip("set TRAJMESH_SGLANG_URL and TRAJMESH_SGLANG_MODEL (make gpu-check)")
        yield {"kind": "sglang", "url": SGLANG_URL, "model": SGLANG_MODEL, "other": SGLANG_MODEL}
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


@pytest.fixture(scope="module")
def model_and_tokenizer(engine):
    """The served model as the learner loads it (any HF causal LM for SGLang's), in float32."""
    if engine["kind"] == "torch":
        return load_model(engine["model"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(engine["model"], dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(engine["model"])


def _prompt(tok: Any, text: str) -> list[int]:
    return encode_prompt(tok, text)


def test_weight_version_default_then_the_updated_one(engine):
    async def go():
        async with EngineClient(engine["url"]) as client:
            before = await client.generate([1, 2, 3], {"max_new_tokens": 1})
            info_before = await client.model_info()
            await client.update_weights_from_disk(engine["other"], version=7)
            after = await client.generate([1, 2, 3], {"max_new_tokens": 1})
            info_after = await client.model_info()
            await client.update_weights_from_disk(engine["model"], version=8)  # back to the served model
            return before, info_before, after, info_after

    before, info_before, after, info_after = _run(go())
    if engine["kind"] == "torch":  # a fresh engine; a shared SGLang server may have been updated before
        assert before.weight_version == info_before["weight_version"] == "default"
        assert parse_weight_version(before.weight_version) == 0
    assert after.weight_version == info_after["weight_version"] == "7"
    assert parse_weight_version(after.weight_version) == 7


async def _until_load(client: EngineClient, running: int, total: int) -> None:
    """Waits until the engine reports (its /get_load) at least `running` requests decoding and
    `total` running or waiting, at most 60 s."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        load = await client._get_json("/get_load")
        ranks = load if isinstance(load, list) else [load]
        run = sum(int(r.get("num_reqs", 0)) for r in ranks)
        if run >= running and run + sum(int(r.get("num_waiting_reqs", 0)) for r in ranks) >= total:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine never reported {running} running / {total} requests")


def test_pause_abort_returns_partial_running_and_empty_queued(engine, model_and_tokenizer):
    _, tok = model_and_tokenizer
    prompt = _prompt(tok, "1+1=")
    long = {"max_new_tokens": 3000, "ignore_eos": True}

    async def go():
        async with EngineClient(engine["url"]) as client:
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
    if engine["kind"] == "torch":  # SGLang batches continuously: it may already be running there
        assert queued_res.output_ids == [] and queued_res.logprobs == []
    assert after.finish_reason["type"] == "length" and len(after.output_ids) == 2


def test_over_long_prompt_gets_400_for_the_whole_batch(engine, model_and_tokenizer):
    _, tok = model_and_tokenizer

    async def go():
        async with EngineClient(engine["url"]) as client:
            ctx = await client.context_length()
            ok = _prompt(tok, "1+2=")
            with pytest.raises(EngineError) as too_long:
                await client.generate([ok, [5] * ctx], [{"max_new_tokens": 2}, {"max_new_tokens": 2}])
            with pytest.raises(EngineError) as over_budget:  # prompt fits, prompt + max_new_tokens does not
                await client.generate([ok, [5] * (ctx - 4)], {"max_new_tokens": 8})
            fits = await client.generate([5] * (ctx - 4), {"max_new_tokens": 3, "ignore_eos": True})
            return ctx, too_long.value, over_budget.value, fits

    ctx, too_long, over_budget, fits = _run(go())
    assert ctx > 8
    assert too_long.status == 400 and "context length" in str(too_long)
    assert over_budget.status == 400 and "context length" in str(over_budget)
    assert len(fits.output_ids) == 3


def test_rollout_caps_max_new_tokens_at_the_context_length(engine):
    async def go():
        async with EngineClient(engine["url"]) as client:
            ctx = await client.context_length()
            sampler = TurnSampler(client, TorchEngineConfig(), stop_ids=set(), pause=PauseClock(), context_len=ctx,
                                  loaded_version=lambda: 0)
            params = trajectory_pb2.SamplingParams(temperature=1.0, max_new_tokens=100)
            near_end = await sampler.sample([5] * (ctx - 5), params)
            no_room = await sampler.sample([5] * (ctx - 1), params)
            return near_end, no_room

    near_end, no_room = _run(go())
    assert near_end.finish == "length" and len(near_end.ids) == 4  # ctx - 1 - (ctx - 5): not 100, no 400
    assert no_room.ids == [] and no_room.finish == "length"


def _greedy(client: EngineClient, prompt: list[int], n: int, **extra: Any):
    return client.generate(prompt, {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra})


def test_stop_token_ids_and_stop_strings(engine, model_and_tokenizer):
    _, tok = model_and_tokenizer
    prompt = _prompt(tok, "12+7-3=")

    async def go():
        async with EngineClient(engine["url"]) as client:
            free = await _greedy(client, prompt, 12)
            stop_id = free.output_ids[3]
            by_id = await _greedy(client, prompt, 12, stop_token_ids=[stop_id])
            stop_text = tok.decode(free.output_ids[2:4])
            by_text = await _greedy(client, prompt, 12, stop=[stop_text])
            return free, stop_id, by_id, stop_text, by_text

    free, stop_id, by_id, stop_text, by_text = _run(go())
    first = free.output_ids.index(stop_id)
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
        async with EngineClient(engine["url"]) as client:
            return await client.generate(prompt, {"temperature": temperature, "max_new_tokens": 16})

    res = _run(go())
    ids = torch.tensor([prompt + res.output_ids])
    n, T = ids.shape[1], len(prompt)
    zeros = torch.zeros((1, n))
    batch = Batch(ids, torch.ones_like(ids), zeros, zeros, zeros.long(), torch.zeros(1),
                  torch.zeros(1, dtype=torch.long), ["probe"], zeros.long())
    with torch.no_grad():
        logp_BT, _ = token_logprobs(model, batch, temperature)
    learner = logp_BT[0, T:].tolist()
    tol = 1e-4 if engine["kind"] == "torch" else 2e-2  # bf16 kernels on GPU
    assert len(learner) == len(res.logprobs) > 0
    assert max(abs(a - b) for a, b in zip(res.logprobs, learner, strict=True)) < tol


def test_sampling_seed_reproduces_tokens(engine, model_and_tokenizer):
    _, tok = model_and_tokenizer
    prompt, other = _prompt(tok, "7+8-9="), _prompt(tok, "1=")
    sp = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True}

    async def go():
        async with EngineClient(engine["url"]) as client:
            a = await client.generate(prompt, {**sp, "sampling_seed": 1234})
            batched = await client.generate([other, prompt], [{**sp, "sampling_seed": 9}, {**sp, "sampling_seed": 1234}])
            c = await client.generate(prompt, {**sp, "sampling_seed": 1235})
            return a, batched[1], c

    a, b, c = _run(go())
    assert a.output_ids == b.output_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert a.output_ids != c.output_ids
