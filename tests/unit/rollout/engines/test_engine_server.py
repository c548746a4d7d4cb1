"""The CPU torch engine over SGLang's native HTTP API, driven by the rollout client."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from trajmesh.infra import free_port  # noqa: E402
from trajmesh.learner.models import build_char_tokenizer, build_tiny_model, encode_prompt, load_model  # noqa: E402
from trajmesh.rollout.engines.base import wait_healthy  # noqa: E402
from trajmesh.rollout.engines.engine_client import CoalescingEngine, EngineClient, EngineError  # noqa: E402
from trajmesh.service import StartFailed  # noqa: E402


def _build_models(root: Path) -> tuple[Path, Path]:
    build_char_tokenizer(root / "tok")
    dims = {"hidden": 32, "layers": 2, "heads": 2, "max_positions": 4096}
    build_tiny_model(root / "a", root / "tok", seed=0, **dims)
    build_tiny_model(root / "b", root / "tok", seed=1, **dims)
    return root / "a", root / "b"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    model_a, model_b = _build_models(root)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trajmesh.rollout.engines.engine_server",
            "--model",
            str(model_a),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--version",
            "0",
            "--threads",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(root / "server.log", "w"),  # noqa: SIM115
    )
    url = f"http://127.0.0.1:{port}"

    async def _wait_healthy() -> bool:  # the rollout's own wait (rollout/engines/base.py)
        async with EngineClient(url) as client:
            try:
                # A process start (torch, transformers): ~12 s of imports alone at load 5 on 2 cores;
                # a server that dies fails at once (`proc`).
                await wait_healthy(client, 120.0, proc=proc, what="torch engine", poll_s=0.1)
            except StartFailed:
                return False
        return True

    try:
        assert asyncio.run(_wait_healthy()), (root / "server.log").read_text()
        yield {"url": url, "a": model_a, "b": model_b}
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _direct_logprobs(model, prompt_ids, output_ids):
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    n = len(prompt_ids)
    return [logp[n - 1 + i, t].item() for i, t in enumerate(output_ids)]


def test_generate_logprobs_match_direct_forward(engine):
    model, tok = load_model(engine["a"])
    prompt = encode_prompt(tok, "12+7-3=")

    async def go():
        async with EngineClient(engine["url"]) as client:
            return await client.generate(prompt, {"temperature": 1.0, "max_new_tokens": 12})

    res = asyncio.run(go())
    assert res.finish_reason["type"] in ("stop", "length") and res.weight_version == "0"
    assert 0 < len(res.output_ids) <= 12 and len(res.logprobs) == len(res.output_ids)
    assert all(lp <= 0 for lp in res.logprobs)
    direct = _direct_logprobs(model, prompt, res.output_ids)
    assert max(abs(a - b) for a, b in zip(res.logprobs, direct, strict=True)) < 1e-4
    if res.finish_reason["type"] == "stop":
        assert res.output_ids[-1] == tok.eos_token_id


def test_concurrent_and_batched_requests(engine):
    _, tok = load_model(engine["a"])
    prompts = [encode_prompt(tok, p) for p in ["1+2=", "34-5=", "7+8-90=", "5="]]

    async def go():
        async with EngineClient(engine["url"]) as client:
            sp = {"temperature": 0, "max_new_tokens": 6}
            singles = await asyncio.gather(*(client.generate(p, sp) for p in prompts * 4))
            batched = await client.generate(prompts, sp)
            return singles, batched

    singles, batched = asyncio.run(go())
    assert len(singles) == 16 and len(batched) == 4
    for i, b in enumerate(batched):  # greedy: the same continuation however requests were grouped
        assert b.output_ids == singles[i].output_ids == singles[i + 4].output_ids


def test_update_weights_changes_outputs_and_version(engine):
    _, tok = load_model(engine["a"])
    prompt = encode_prompt(tok, "12+7-3=")
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}

    async def go():
        async with EngineClient(engine["url"]) as client:
            before = await client.generate(prompt, sp)
            await client.update_weights_from_disk(str(engine["b"]), version=1)
            after = await client.generate(prompt, sp)
            info = await client.model_info()
            await client.update_weights_from_disk(str(engine["a"]), version=2)
            back = await client.generate(prompt, sp)
            return before, after, info, back

    before, after, info, back = asyncio.run(go())
    assert (before.weight_version, after.weight_version, back.weight_version) == ("0", "1", "2")
    assert info["weight_version"] == "1"
    assert before.logprobs != after.logprobs
    assert back.output_ids == before.output_ids


async def _load(client: EngineClient) -> dict:
    return (await client._get_json("/get_load"))[0]


async def _until_running(client: EngineClient) -> None:
    for _ in range(3000):
        if (await _load(client))["num_reqs"] >= 1:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the request never started")


async def _until_queued(client: EngineClient) -> None:
    for _ in range(3000):
        if (await _load(client))["num_waiting_reqs"] >= 1:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the request never reached the engine's queue")


def test_pause_aborts_in_flight_and_continue_resumes(engine):
    _, tok = load_model(engine["a"])
    prompt = encode_prompt(tok, "1+1=")

    async def go():
        async with EngineClient(engine["url"]) as client:
            long = asyncio.create_task(client.generate(prompt, {"max_new_tokens": 3000, "ignore_eos": True}))
            await _until_running(client)
            t0 = time.perf_counter()
            await client.pause()
            partial = await asyncio.wait_for(long, timeout=10)
            pause_s = time.perf_counter() - t0
            waiting = asyncio.create_task(client.generate(prompt, {"max_new_tokens": 4, "ignore_eos": True}))
            await _until_queued(client)  # it reached the engine, which holds it while paused
            assert not waiting.done()
            await client.resume()
            resumed = await asyncio.wait_for(waiting, timeout=10)
            return partial, pause_s, resumed

    partial, pause_s, resumed = asyncio.run(go())
    assert partial.finish_reason["type"] == "abort"
    assert 0 < len(partial.output_ids) < 3000 and len(partial.logprobs) == len(partial.output_ids)
    assert pause_s < 5
    assert resumed.finish_reason["type"] == "length" and len(resumed.output_ids) == 4


def test_coalescing_engine_batches_concurrent_calls_per_prompt_params(engine):
    _, tok = load_model(engine["a"])
    prompts = [encode_prompt(tok, p) for p in ["1+2=", "34-5=", "7+8-90=", "5="]]

    async def go():
        async with EngineClient(engine["url"]) as plain:
            singles = [await plain.generate(p, {"temperature": 0, "max_new_tokens": 2 + i, "ignore_eos": True})
                       for i, p in enumerate(prompts)]
        eng = CoalescingEngine(EngineClient(engine["url"]), window_s=0.05)
        try:
            # one batch request, each prompt with its own max_new_tokens
            coalesced = await asyncio.gather(*(
                eng.generate(p, {"temperature": 0, "max_new_tokens": 2 + i, "ignore_eos": True})
                for i, p in enumerate(prompts)))
            sent_after_batch = eng.requests_sent
            # a 400 for the batch is retried per sample: only the bad sample's caller gets the error
            bad = await asyncio.gather(eng.generate([10**6], {"max_new_tokens": 2}),
                                       eng.generate(prompts[0], {"max_new_tokens": 2}), return_exceptions=True)
            isolated = eng.isolated_batches
            # a cancelled caller does not break the others
            task = asyncio.ensure_future(eng.generate(prompts[1], {"temperature": 0, "max_new_tokens": 3}))
            other = asyncio.ensure_future(eng.generate(prompts[2], {"temperature": 0, "max_new_tokens": 3}))
            await asyncio.sleep(0)
            task.cancel()
            survivor = await other
            healthy = await eng.health()
        finally:
            await eng.close()
        return singles, coalesced, sent_after_batch, bad, isolated, survivor, healthy

    singles, coalesced, sent, bad, isolated, survivor, healthy = asyncio.run(go())
    assert sent == 1
    for i, (a, b) in enumerate(zip(singles, coalesced, strict=True)):
        assert len(b.output_ids) == 2 + i and b.output_ids == a.output_ids  # greedy: same tokens
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    assert isinstance(bad[0], EngineError) and bad[0].status == 400
    assert len(bad[1].output_ids) == 2 and isolated == 1
    assert len(survivor.output_ids) == 3 and healthy
