"""The rollout's engine client against SGLang 0.4.10.post2 and 0.5.23 as their source says they
answer (tests/sglang_fixture_server.py, recorded responses in tests/fixtures/sglang/): the probe at
engine start, no field a version rejects, the real input limit, 0.5.23's weight-version spans,
one refused sample in a batch, a request parked by a 0.4.10 pause, the /get_load shapes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sglang_fixture_server import VERSIONS, SGLangFixtureServer, fixture

from trajmesh.rollout.engines import TorchEngineConfig
from trajmesh.rollout.engines.engine_client import (
    NO_VERSIONS,
    SPANS_DICT,
    CoalescingEngine,
    EngineClient,
    EngineError,
    EngineLoad,
    GenerateResult,
    token_versions,
)
from trajmesh.rollout.engines.generation import PauseClock, TurnSampler
from trajmesh.v1 import trajectory_pb2

EOS = 2
PARAMS = trajectory_pb2.SamplingParams(temperature=1.0, max_new_tokens=8)


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def _build_sampler(engine: Any, *, pause: PauseClock | None = None, version: list[int] | None = None,
                   **kw: Any) -> TurnSampler:
    box = version if version is not None else [3]
    return TurnSampler(engine, TorchEngineConfig(abort_backoff_s=0.0), stop_ids={EOS}, pause=pause or PauseClock(),
                       loaded_version=lambda: box[0], **kw)


@pytest.mark.parametrize("version", VERSIONS)
def test_probe_reads_what_each_version_reports(version: str):
    async def main() -> None:
        async with SGLangFixtureServer(version) as srv, EngineClient(srv.url) as client:
            await client.context_length()
            caps = client.capabilities
            assert caps is not None
            assert caps.server_version == version
            # --context-length 64, a large KV pool: max_req_len = min(64 - 1, pool - 1) = 63, input < 58
            assert caps.max_input_len == 58
            assert caps.context_len == 63
            assert caps.sampling_seed is (version == "0.5.23")
            assert caps.weight_versions == (SPANS_DICT if version == "0.5.23" else NO_VERSIONS)
            assert caps.reports_weight_version is (version == "0.5.23")
            assert caps.pause_modes == (("abort", "retract", "in_place") if version == "0.5.23" else ("abort",))
            assert srv.deprecated_calls == 0  # 0.5.x: /server_info and /model_info, not the deprecated names

    _run(main())


@pytest.mark.parametrize("version", VERSIONS)
def test_seeded_turn_sends_no_field_the_server_rejects(version: str):
    async def main() -> None:
        async with SGLangFixtureServer(version) as srv:
            engine = CoalescingEngine(EngineClient(srv.url))
            try:
                sampler = _build_sampler(engine, context_len=await engine.context_length())  # probes
                turn = await sampler.sample(list(range(3, 13)), PARAMS, seed=1234)
            finally:
                await engine.close()
        assert turn.ids == srv.reply and turn.finish == "length"
        sent = srv.generation_requests()
        assert len(sent) == 1
        assert ("sampling_seed" in sent[0]["sampling"]) is (version == "0.5.23")
        assert set(sent[0]["sampling"]) <= set(fixture(version, "sampling_params")["fields"])

    _run(main())


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("prompt_len", [56, 57, 58, 60])
def test_context_at_the_input_limit_ends_as_max_tokens(version: str, prompt_len: int):
    """A context at or past max_req_input_len (58 here) is not sent: the turn ends as length
    (MAX_TOKENS), not an HTTP 400 (INFRA_FAILURE); below it max_new_tokens fits what the scheduler
    would cap it to (max_req_len - 1 - prompt)."""
    async def main() -> None:
        async with SGLangFixtureServer(version, reply=list(range(20, 28))) as srv:
            engine = CoalescingEngine(EngineClient(srv.url))
            try:
                sampler = _build_sampler(engine, context_len=await engine.context_length())  # probes
                turn = await sampler.sample(list(range(3, 3 + prompt_len)), PARAMS, seed=None)
            finally:
                await engine.close()
        assert turn.finish == "length"
        sent = srv.generation_requests()
        if prompt_len >= 58:
            assert turn.ids == [] and sent == []
        else:
            room = 63 - 1 - prompt_len
            assert [s["sampling"]["max_new_tokens"] for s in sent] == [room]
            assert turn.ids == srv.reply[:room]

    _run(main())


def test_one_token_response_with_weight_version_spans():
    """0.5.23 labels every finished request with [{"version","start","end"}] spans: an immediate
    EOS (one token, one span) is that span's version, not a bad response."""
    async def main() -> None:
        async with SGLangFixtureServer("0.5.23", reply=[EOS]) as srv:
            engine = CoalescingEngine(EngineClient(srv.url))
            try:
                sampler = _build_sampler(engine, context_len=None)
                first = await sampler.sample([3, 4, 5], PARAMS, seed=None)
                await engine.update_weights_from_disk("/weights/v7", 7)
                second = await sampler.sample([3, 4, 5], PARAMS, seed=None)
            finally:
                await engine.close()
        assert (first.ids, first.versions, first.finish) == ([EOS], [0], "stop")  # "default" is version 0
        assert (second.ids, second.versions) == ([EOS], [7])

    _run(main())


def test_weight_version_spans_over_tokens():
    recorded = fixture("0.5.23", "generate")
    res = GenerateResult(output_ids=recorded["output_ids"], logprobs=[-1.0, -1.0], finish_reason={"type": "length"},
                         weight_version=recorded["meta_info"]["weight_version"], meta_info=recorded["meta_info"])
    assert token_versions(res, fallback=9) == [0, 0]
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    res = GenerateResult(output_ids=[1, 2, 3, 4, 5], logprobs=[-1.0] * 5, finish_reason={"type": "stop"},
                         weight_version="4", meta_info={"weight_versions": spans})
    assert token_versions(res, fallback=9) == [3, 3, 4, 4, 4]


@pytest.mark.parametrize("probed", [True, False])
def test_batch_with_a_refused_sample_generates_each_sample_once(probed: bool):
    """One sample over the input limit in a batch of three: SGLang answers the batch with a 400 while
    the samples sent before it keep running. Probed, the client never sends it; not probed, it
    aborts the batch's requests before sending them again one by one."""
    async def main() -> tuple[SGLangFixtureServer, list[Any], CoalescingEngine]:
        async with SGLangFixtureServer("0.4.10.post2") as srv:
            engine = CoalescingEngine(EngineClient(srv.url), window_s=0.05)
            try:
                if probed:
                    await engine.context_length()  # probes
                sampling = {"max_new_tokens": 4, "temperature": 1.0}
                results = await asyncio.gather(*(engine.generate(list(range(3, 3 + n)), sampling)
                                                 for n in (10, 58, 11)), return_exceptions=True)
            finally:
                await engine.close()
        return srv, list(results), engine

    srv, results, engine = _run(main())
    assert isinstance(results[1], EngineError) and results[1].status == 400
    assert [len(r.output_ids) for r in (results[0], results[2])] == [4, 4]
    ran = [len(s["prompt"]) for s in srv.generation_requests() if s["rid"] not in srv.aborted]
    assert sorted(n for n in ran if n != 58) == [10, 11]  # each good sample generated once
    if probed:
        assert engine.requests_sent == 1 and engine.refused_unsent == 1 and srv.aborted == []
    else:
        assert engine.isolated_batches == 1 and len(srv.aborted) == 3


def test_request_parked_by_a_pause_is_labelled_by_when_it_ran():
    """SGLang 0.4.10 parks a request that arrives while paused and runs it after
    /continue_generation, on the new weights, and reports no version: its tokens are the version
    loaded when it ran, not the one loaded when it was sent."""
    async def main() -> list[int]:
        async with SGLangFixtureServer("0.4.10.post2") as srv:
            engine = CoalescingEngine(EngineClient(srv.url))
            pause, version = PauseClock(), [3]
            sampler = _build_sampler(engine, pause=pause, version=version, context_len=None)
            try:
                await engine.pause()  # the server pauses before our clock does: the request is in flight
                task = asyncio.ensure_future(sampler.sample([3, 4, 5], PARAMS, seed=None))
                await srv.parked.wait()
                pause.pause()
                await engine.update_weights_from_disk("/weights/v4", 4)
                version[0] = 4
                await engine.resume()
                pause.resume()
                turn = await task
            finally:
                await engine.close()
        return turn.versions

    assert _run(main()) == [4, 4, 4, 4]


def test_load_in_each_shape():
    async def main() -> list[EngineLoad]:
        loads = []
        for version in VERSIONS:
            async with SGLangFixtureServer(version) as srv, EngineClient(srv.url) as client:
                loads.append(await client.load())
        return loads

    old, new = _run(main())
    assert old == EngineLoad(running_reqs=None, waiting_reqs=None, tokens=1234)
    assert new == EngineLoad(running_reqs=3, waiting_reqs=2, tokens=512)
    # the torch engine's /get_load (rollout/engines/engine_server.py)
    assert EngineLoad.parse([{"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 1}]) == EngineLoad(2, 1, None)
    with pytest.raises(EngineError):
        EngineLoad.parse({"something": "else"})


def test_probe_of_the_torch_engine(tmp_path):
    """The same probe against the built-in torch engine (a real server process): it takes
    sampling_seed and reports versions, so nothing the sampler sends changes for it."""
    import subprocess
    import sys

    from trajmesh.infra import free_port
    from trajmesh.learner.models import build_char_tokenizer, build_tiny_model

    build_char_tokenizer(tmp_path / "tok")
    build_tiny_model(tmp_path / "m", tmp_path / "tok", seed=0, hidden=32, layers=1, heads=2, max_positions=128)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trajmesh.rollout.engines.engine_server", "--model", str(tmp_path / "m"),
                             "--port", str(port), "--host", "127.0.0.1", "--version", "0", "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def main() -> Any:
        async with EngineClient(f"http://127.0.0.1:{port}") as client:
            while not await client.health():
                assert proc.poll() is None, "torch engine exited"
                await asyncio.sleep(0.2)
            return await client.probe(), await client.load()

    try:
        caps, load = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert caps.sampling_seed and caps.reports_weight_version and caps.pause_modes == ("abort",)
    assert caps.context_len == 128 and caps.fits(10, 100) and not caps.fits(10, 118)
    assert load == EngineLoad(running_reqs=0, waiting_reqs=0, tokens=None)


def _letters(ids: list[int]) -> str:
    """A decode for the fixture's stop strings: token t is the letter ``chr(ord("a") + t - 20)``."""
    return "".join(chr(ord("a") + t - 20) for t in ids)


@pytest.mark.parametrize("version", VERSIONS)
def test_token_stops_are_skipped_under_ignore_eos_and_stop_strings_are_not(version: str):
    """Both versions skip every token stop — ``stop_token_ids`` and the model's EOS — under
    ``ignore_eos`` (0.4.10.post2 schedule_batch.py:703, 0.5.23 :1857), and match stop strings either
    way (outside that guard). The fixture used to stop on ``stop_token_ids`` whatever ``ignore_eos``."""
    reply = [20, 21, EOS, 22, 23, 24]

    async def main() -> dict[str, GenerateResult]:
        async with SGLangFixtureServer(version, reply=reply, eos_ids=[EOS], decode=_letters) as srv, \
                EngineClient(srv.url) as client:
            cases = {"stop_id": {"stop_token_ids": [21]}, "stop_id_ignored": {"stop_token_ids": [21], "ignore_eos": True},
                     "eos": {}, "eos_ignored": {"ignore_eos": True},
                     "string_ignoring_eos": {"stop": [_letters([22, 23])], "ignore_eos": True}}
            return {name: await client.generate([3, 4, 5], {"max_new_tokens": 6, **sp}) for name, sp in cases.items()}

    out = _run(main())
    assert (out["stop_id"].output_ids, out["stop_id"].finish_reason) == ([20, 21], {"type": "stop", "matched": 21})
    assert (out["eos"].output_ids, out["eos"].finish_reason) == ([20, 21, EOS], {"type": "stop", "matched": EOS})
    for name in ("stop_id_ignored", "eos_ignored"):
        assert (out[name].output_ids, out[name].finish_reason) == (reply, {"type": "length", "length": 6}), name
    res = out["string_ignoring_eos"]
    assert (res.output_ids, res.finish_reason) == ([20, 21, EOS, 22, 23], {"type": "stop", "matched": "cd"})


@pytest.mark.parametrize("version", VERSIONS)
def test_a_stop_on_the_last_allowed_token_finishes_by_the_versions_order(version: str):
    """0.4.10.post2's ``check_finished`` tests the length before the token stops
    (schedule_batch.py:690, :703): a stop id sampled as the last allowed token finishes as
    ``length``; 0.5.23's ``update_finish_state`` tests stops first (:2026-2038): ``stop``. Either
    way the token is in the output, and the rollout ends the turn on it (its last token is a stop)."""
    async def main() -> GenerateResult:
        async with SGLangFixtureServer(version, reply=[20, 21, 22]) as srv, EngineClient(srv.url) as client:
            return await client.generate([3, 4, 5], {"max_new_tokens": 2, "stop_token_ids": [21]})

    res = _run(main())
    assert res.output_ids == [20, 21]
    assert res.finish_reason == ({"type": "stop", "matched": 21} if version == "0.5.23" else {"type": "length", "length": 2})


@pytest.mark.parametrize("version", VERSIONS)
def test_prompt_and_max_new_tokens_past_the_context_is_refused_not_capped(version: str):
    """The tokenizer manager refuses prompt + ``max_new_tokens`` >= context (0.4.10.post2
    tokenizer_manager.py:586-598) or > context (0.5.23 :1353-1377; it truncates only with
    ``--allow-auto-truncate``) with HTTP 400; what it lets through the scheduler caps silently at
    ``max_req_len - 1 - prompt`` (0.4.10.post2 scheduler.py:1179-1185, 0.5.23 :2693-2736). Context
    64, a large pool: max_req_len 63; a 50-token prompt gets at most 12 tokens."""
    async def main() -> dict[int, Any]:
        async with SGLangFixtureServer(version, reply=list(range(20, 40))) as srv, EngineClient(srv.url) as client:
            out: dict[int, Any] = {}
            for new in (15, 14, 13):  # prompt + new = 65, 64, 63
                try:
                    out[new] = await client.generate(list(range(3, 53)), {"max_new_tokens": new})
                except EngineError as exc:
                    out[new] = exc
            return out

    out = _run(main())
    refused = [new for new, res in out.items() if isinstance(res, EngineError)]
    assert refused == ([15] if version == "0.5.23" else [15, 14])
    for new in refused:
        assert out[new].status == 400
        assert "Requested token count exceeds the model's maximum context length of 64 tokens" in str(out[new])
        assert f"a total of {50 + new} tokens" in str(out[new])
    for new, res in out.items():
        if new not in refused:
            assert len(res.output_ids) == 12 and res.finish_reason == {"type": "length", "length": 12}


@pytest.mark.parametrize("version", VERSIONS)
def test_rollout_turn_stops_on_eos_as_it_never_sends_ignore_eos(version: str):
    """The rollout sends the model's end ids as ``stop_token_ids`` and never ``ignore_eos``, so
    SGLang's skipping of token stops under ``ignore_eos`` never reaches a turn: it ends on EOS."""
    async def main() -> tuple[Any, list[dict[str, Any]]]:
        async with SGLangFixtureServer(version, reply=[20, 21, EOS, 22]) as srv:
            engine = CoalescingEngine(EngineClient(srv.url))
            try:
                sampler = _build_sampler(engine, context_len=await engine.context_length())
                turn = await sampler.sample([3, 4, 5], PARAMS, seed=None)
            finally:
                await engine.close()
            return turn, srv.generation_requests()

    turn, sent = _run(main())
    assert turn.ids == [20, 21, EOS] and turn.finish == "stop"
    assert [s["sampling"].get("ignore_eos", False) for s in sent] == [False]
    assert sent[0]["sampling"]["stop_token_ids"] == [EOS]
