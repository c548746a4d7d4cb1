"""The rollout's side of the engine contract (rollout/engines/generation.py, engine_client.py): SGLang's
version strings, aborts (ours, others', after EOS), timeouts without paused time, engine errors
ending one trajectory, seeds, newest-only weight announcements.

The engine here is a scripted stand-in returning SGLang's response shapes (the shapes are
checked against the real engines in test_engine_conformance.py); the torch engine's token loop
is driven directly for the abort-after-EOS order.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from trajmesh.rollout.engines import TorchEngineConfig
from trajmesh.rollout.engines.engine_client import (
    EngineError,
    GenerateResult,
    parse_weight_version,
    token_versions,
)
from trajmesh.rollout.engines.generation import (
    EngineFailed,
    NewestOnly,
    PauseClock,
    TurnSampler,
    sampling_seed,
)
from trajmesh.rollout.engines.synthetic_engine import SyntheticEngineConfig
from trajmesh.v1 import trajectory_pb2

EOS = 2
PARAMS = trajectory_pb2.SamplingParams(temperature=1.0, max_new_tokens=8)


def _result(ids: list[int], finish: str, version: str | None = "default", **meta: Any) -> GenerateResult:
    return GenerateResult(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason={"type": finish},
                          weight_version=version, meta_info=meta)


class ScriptedEngine:
    """Answers /generate calls from a script of results, exceptions or callables (called with the
    request); records the requests."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.requests: list[tuple[list[int], dict[str, Any]]] = []

    async def generate(self, input_ids: list[int], sampling: dict[str, Any], return_logprob: bool = True) -> Any:
        self.requests.append((list(input_ids), dict(sampling)))
        step = self.script.pop(0)
        if callable(step):
            step = await step()
        if isinstance(step, BaseException):
            raise step
        return step


def _sampler(engine: Any, pause: PauseClock | None = None, **cfg: Any) -> TurnSampler:
    return TurnSampler(engine, TorchEngineConfig(**{"abort_backoff_s": 0.0, **cfg}), stop_ids={EOS},
                       pause=pause or PauseClock(), context_len=None, loaded_version=lambda: 5)


def test_weight_version_strings():
    assert parse_weight_version("default") == 0  # SGLang >= 0.5 before any named update
    assert parse_weight_version(None) is None  # SGLang 0.4.10
    assert parse_weight_version("12") == 12
    with pytest.raises(EngineError):
        parse_weight_version("v12-final")


def test_token_versions_prefer_per_token_spans_then_the_response_then_the_loaded_version():
    assert token_versions(_result([7, 8, 9], "stop", "4", weight_versions=["3", "3", "4"]), 9) == [3, 3, 4]
    spans = [[0, 2, "3"], [2, 3, "4"]]
    assert token_versions(_result([7, 8, 9], "stop", "4", weight_versions=spans), 9) == [3, 3, 4]
    gap = [[0, 1, "3"], [2, 3, "4"]]  # not a tiling: the response's version instead
    assert token_versions(_result([7, 8, 9], "stop", "4", weight_versions=gap), 9) == [4, 4, 4]
    assert token_versions(_result([7, 8], "stop", "default"), 9) == [0, 0]
    assert token_versions(_result([7, 8], "stop", None), 9) == [9, 9]


def test_default_version_does_not_crash_a_turn():
    turn = asyncio.run(_sampler(ScriptedEngine(_result([5, 6, EOS], "stop"))).sample([1], PARAMS))
    assert turn.ids == [5, 6, EOS] and turn.versions == [0, 0, 0] and turn.finish == "stop"


def test_abort_right_after_eos_counts_as_stopped():
    engine = ScriptedEngine(_result([5, EOS], "abort"), _result([9], "stop"))
    turn = asyncio.run(_sampler(engine).sample([1], PARAMS))
    assert turn.ids == [5, EOS] and turn.finish == "stop"
    assert len(engine.requests) == 1  # not resubmitted past the EOS


def test_abort_during_our_pause_resubmits_prompt_plus_partial_without_counting():
    pause = PauseClock()

    async def paused_abort() -> GenerateResult:
        pause.pause()  # the weight loader pauses while this request runs
        asyncio.get_running_loop().call_soon(pause.resume)
        return _result([5, 6], "abort", "3")

    engine = ScriptedEngine(paused_abort, _result([7, EOS], "stop", "4"))
    turn = asyncio.run(_sampler(engine, pause, max_abort_retries=0).sample([1], PARAMS))
    assert turn.ids == [5, 6, 7, EOS] and turn.versions == [3, 3, 4, 4] and turn.finish == "stop"
    assert engine.requests[1][0] == [1, 5, 6] and engine.requests[1][1]["max_new_tokens"] == 6


def test_aborts_of_other_origin_are_retried_with_a_bound():
    engine = ScriptedEngine(*[_result([5], "abort") for _ in range(4)])
    with pytest.raises(EngineFailed) as failed:
        asyncio.run(_sampler(engine, max_abort_retries=2).sample([1], PARAMS))
    assert failed.value.reason == "aborted" and len(engine.requests) == 3


def test_an_engine_config_without_abort_retries_fails_on_the_first_foreign_abort():
    # The synthetic engine never aborts, so its config has no retries: an abort is not resubmitted.
    engine = ScriptedEngine(_result([5], "abort"), _result([6, EOS], "stop"))
    sampler = TurnSampler(engine, SyntheticEngineConfig(), stop_ids={EOS}, pause=PauseClock(), context_len=None,
                          loaded_version=lambda: 5)
    with pytest.raises(EngineFailed) as failed:
        asyncio.run(sampler.sample([1], PARAMS))
    assert failed.value.reason == "aborted" and len(engine.requests) == 1


def test_an_engine_error_fails_the_turn_with_a_reason():
    engine = ScriptedEngine(EngineError("POST /generate -> 400: too long", 400))
    with pytest.raises(EngineFailed) as failed:
        asyncio.run(_sampler(engine).sample([1], PARAMS))
    assert failed.value.reason == "http_4xx"


def test_request_timeout_excludes_time_paused():
    pause = PauseClock()

    async def slow_while_paused() -> GenerateResult:
        pause.pause()
        await asyncio.sleep(0.6)  # a weight load: three times the timeout
        pause.resume()
        return _result([5, EOS], "stop")

    async def never() -> GenerateResult:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    turn = asyncio.run(_sampler(ScriptedEngine(slow_while_paused), pause, request_timeout_s=0.2).sample([1], PARAMS))
    assert turn.ids == [5, EOS]
    with pytest.raises(EngineFailed) as failed:
        asyncio.run(_sampler(ScriptedEngine(never), request_timeout_s=0.2).sample([1], PARAMS))
    assert failed.value.reason == "timeout"


def test_request_timeout_excludes_time_the_process_was_frozen():
    """The process freezes (SIGSTOP; here its event loop is blocked, which stops it the same way)
    for longer than the request timeout while the engine works; the engine's answer, there right
    after the thaw, is taken: the request does not time out the moment the process thaws."""
    answered = asyncio.Event()

    async def answers_after_the_freeze() -> GenerateResult:
        await answered.wait()
        return _result([5, EOS], "stop")

    async def main() -> Any:
        loop = asyncio.get_running_loop()

        def freeze() -> None:
            time.sleep(3.0)  # the freeze itself (1.5x the timeout), not a synchronization
            loop.call_later(0.1, answered.set)  # the engine's answer arrives just after the thaw
        loop.call_later(0.05, freeze)
        return await _sampler(ScriptedEngine(answers_after_the_freeze), request_timeout_s=2.0).sample([1], PARAMS)

    turn = asyncio.run(main())
    assert turn.ids == [5, EOS]


def test_context_cap_and_seed_reach_the_request():
    engine = ScriptedEngine(_result([5, 6], "length"))
    sampler = _sampler(engine)
    sampler.context_len = 10
    turn = asyncio.run(sampler.sample([1] * 7, PARAMS, seed=99))
    assert engine.requests[0][1]["max_new_tokens"] == 2 and engine.requests[0][1]["sampling_seed"] == 99
    assert turn.finish == "length"
    assert asyncio.run(sampler.sample([1] * 9, PARAMS)).ids == []  # no room: no request
    assert len(engine.requests) == 1


def test_sampling_seed_derivation():
    a = sampling_seed(0, "task-1", 0)
    assert a == sampling_seed(0, "task-1", 0) and 0 <= a < 2**31
    assert len({a, sampling_seed(0, "task-1", 1), sampling_seed(0, "task-2", 0), sampling_seed(1, "task-1", 0)}) == 4


def test_newest_only_skips_intermediate_offers():
    async def go():
        box = NewestOnly()
        box.offer(1)
        first = await box.take()
        box.offer(2)
        box.offer(3)  # announced while the loader was busy with 1
        box.offer(4)
        second = await box.take()
        waiter = asyncio.ensure_future(box.take())
        await asyncio.sleep(0)
        assert not waiter.done()
        box.offer(5)
        return first, second, await waiter, box.replaced

    assert asyncio.run(go()) == (1, 4, 5, 2)


def test_torch_loop_aborts_after_appending_eos():
    torch = pytest.importorskip("torch")
    from trajmesh.rollout.engines.torch_sampler import RequestSampling, decode_batch

    class Fixed(torch.nn.Module):
        """Always predicts token 3 (logits peak there); enough for the loop's order of checks."""

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=True, past_key_values=None):
            logits = torch.zeros((*input_ids.shape, 6))
            logits[..., 3] = 10.0
            return type("Out", (), {"logits": logits, "past_key_values": None, "cache": None})()

    greedy = RequestSampling(temperature=0.0, max_new_tokens=5)
    run = decode_batch(Fixed(), [[1, 1]], [greedy], pad_id=0, eos_ids={3}, decode=str)
    assert run[0].output_ids == [3] and run[0].finish_reason == {"type": "stop", "matched": 3}
    aborted = decode_batch(Fixed(), [[1, 1]], [greedy], pad_id=0, eos_ids={3}, decode=str, should_abort=lambda: True)
    assert aborted[0].output_ids == [3] and aborted[0].finish_reason["type"] == "abort"  # SGLang's order
