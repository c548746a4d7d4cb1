"""The judge grader's pure parts by hand (rubric filling, verdict parsing, the circular pairwise
schedule and its rewards) and its failure handling against real sockets: a judge that stalls and
one that refuses the connection raise `JudgeError` (timeout / unavailable), never score 0."""

from __future__ import annotations

import asyncio
import time

import pytest

from trajmesh.config import JudgeConfig, load_config
from trajmesh.graders.base import Sample
from trajmesh.graders.judge import (
    JudgeError,
    JudgeGrader,
    circular_pairs,
    pairwise_rewards,
    parse_score,
    parse_winner,
    render_pairwise,
    render_pointwise,
    rubric_tail,
)
from trajmesh.infra import free_port

pytestmark = pytest.mark.timeout(60)


def _cfg(**over: object) -> JudgeConfig:
    return JudgeConfig(**{"sources": ["s"], "urls": ["http://127.0.0.1:9"], "revision": "r1", **over})  # type: ignore[arg-type]


def test_rubric_fills_only_its_fields() -> None:
    cfg = _cfg(rubric="T={prompt} R={response} /{max_score} keep {other} {", max_score=5)
    assert render_pointwise(cfg, "2+2?", "4") == "T=2+2? R=4 /5 keep {other} {"
    cfg = _cfg(pairwise_rubric="{prompt}|{response_a}|{response_b}")
    assert render_pairwise(cfg, "q", "x", "y") == "q|x|y"


@pytest.mark.parametrize(("raw", "want"), [
    ("Score: 7", 7.0),
    ("score=3.5\n", 3.5),
    ("I think... Score: 2. On reflection Score: 9", 9.0),  # the last verdict counts
    ("SCORE : 0", 0.0),
    ("Score: 10", 10.0),
])
def test_parse_score(raw: str, want: float) -> None:
    assert parse_score(raw, 10) == want


def test_a_rubric_ending_in_score_takes_a_bare_number_but_never_its_own_digits() -> None:
    assert rubric_tail("Q {prompt} A {response}\nScore:") == "\nScore:"
    assert rubric_tail("{prompt}|{response_a}|{response_b} Winner:") == " Winner:"
    assert parse_score(" 1", 1, "\nScore:") == 1.0
    assert parse_score("0", 1, "\nScore:") == 0.0
    # A number in the rubric's tail is not the judge's: with no number written, no verdict.
    with pytest.raises(JudgeError, match="unparseable"):
        parse_score("", 10, "Score: 9")
    with pytest.raises(JudgeError, match="unparseable"):
        parse_score("oops", 10, "Score:")
    assert parse_winner("B", "\nWinner:") == "B"
    with pytest.raises(JudgeError, match="unparseable"):
        parse_winner("", "Winner: A")


@pytest.mark.parametrize("raw", ["", "7", "The answer is good.", "Score: 11", "Score: -1", "Score: high"])
def test_unreadable_score_is_an_error_not_zero(raw: str) -> None:
    with pytest.raises(JudgeError) as err:
        parse_score(raw, 10)
    assert err.value.reason == "unparseable" and err.value.raw == raw


@pytest.mark.parametrize(("raw", "want"), [("Winner: A", "A"), ("winner: b", "B"),
                                          ("Winner: A ... no, Winner: **B**", "B"), ("Winner:B\n", "B")])
def test_parse_winner(raw: str, want: str) -> None:
    assert parse_winner(raw) == want


@pytest.mark.parametrize("raw", ["", "A", "Winner: C", "Winner: Answer A", "both are fine"])
def test_unreadable_winner_is_an_error(raw: str) -> None:
    with pytest.raises(JudgeError, match="unparseable"):
        parse_winner(raw)


def test_circular_schedule_has_n_calls_and_each_member_once_in_each_position() -> None:
    assert circular_pairs(0) == [] and circular_pairs(1) == []
    assert circular_pairs(2) == [(0, 1), (1, 0)]  # both orders of the one pair
    assert circular_pairs(4) == [(0, 1), (1, 2), (2, 3), (3, 0)]  # 4 calls, not 6 pairs (x2 orders)
    for n in range(2, 17):
        pairs = circular_pairs(n)
        assert len(pairs) == n
        assert sorted(a for a, _ in pairs) == list(range(n)) == sorted(b for _, b in pairs)


def test_pairwise_rewards_by_hand() -> None:
    pairs = circular_pairs(4)  # (0,1) (1,2) (2,3) (3,0)
    # 0 beats 1 and 3; 1 loses to 0, beats 2; 2 loses both; 3 beats 2, loses to 0.
    assert pairwise_rewards(4, pairs, ["A", "A", "B", "B"]) == [1.0, 0.5, 0.0, 0.5]
    # A judge that always says "A" (pure positional bias) gives nobody an edge.
    assert pairwise_rewards(4, pairs, ["A"] * 4) == [0.5] * 4
    assert pairwise_rewards(3, circular_pairs(3), ["B"] * 3) == [0.5] * 3
    assert pairwise_rewards(2, circular_pairs(2), ["A", "B"]) == [1.0, 0.0]  # 0 wins as A and as B


def test_config_refuses_a_judge_without_engine_or_revision_or_a_timeout_past_the_ack_wait() -> None:
    with pytest.raises(ValueError, match="judge.urls"):
        JudgeConfig(sources=["s"], revision="r")
    with pytest.raises(ValueError, match="judge.urls"):  # the launcher starts only a torch engine itself
        JudgeConfig(sources=["s"], model_path="/m", type="vllm")
    assert JudgeConfig(sources=["s"], model_path="/m", type="torch").urls == []  # the launcher's to start
    with pytest.raises(ValueError, match="revision or model_path"):
        JudgeConfig(sources=["s"], urls=["http://x"])
    with pytest.raises(ValueError, match="ack wait"):
        JudgeConfig(sources=["s"], urls=["http://x"], revision="r", timeout_s=20, attempts=2)
    with pytest.raises(ValueError, match="no task source named"):
        load_config(None, {"judge": {"sources": ["nope"], "urls": ["http://x"], "revision": "r"}})


async def _stalling_server() -> tuple[asyncio.Server, str]:
    """A judge that accepts connections and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def accept(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_a_stalling_judge_times_out_after_every_attempt() -> None:
    async def go() -> tuple[JudgeError, float]:
        server, url = await _stalling_server()
        grader = JudgeGrader(_cfg(urls=[url], timeout_s=0.3, attempts=2))
        t0 = time.monotonic()
        try:
            with pytest.raises(JudgeError) as err:
                await grader.grade(Sample("4"), {"prompt": "2+2?"})
            return err.value, time.monotonic() - t0
        finally:
            await grader.close()
            server.close()

    err, elapsed = asyncio.run(go())
    assert err.reason == "timeout" and 0.6 <= elapsed < 5.0, (err, elapsed)
    assert err.verifier_output().startswith("judge_error: timeout")


def test_a_refused_connection_is_unavailable() -> None:
    async def go() -> JudgeError:
        grader = JudgeGrader(_cfg(urls=[f"http://127.0.0.1:{free_port()}"], timeout_s=2.0, attempts=1))
        try:
            with pytest.raises(JudgeError) as err:
                await grader.grade(Sample("4"), {"prompt": "2+2?"})
            return err.value
        finally:
            await grader.close()

    assert asyncio.run(go()).reason == "unavailable"


def test_pairwise_of_one_member_has_no_pair() -> None:
    async def go() -> None:
        grader = JudgeGrader(_cfg(mode="pairwise"))
        try:
            with pytest.raises(JudgeError, match="no_pair"):
                await grader.grade_group([Sample("x")], {"prompt": "p"})
        finally:
            await grader.close()

    asyncio.run(go())


def test_identity_is_the_weights_hash(tmp_path: object) -> None:
    from pathlib import Path

    d = Path(str(tmp_path)) / "judge-model"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights")
    grader = JudgeGrader(JudgeConfig(sources=["s"], urls=["http://x"], model_path=str(d)))
    # `printf weights | sha256sum`: 9a129038d9a00aed0cf6a7ea…
    assert grader.identity == "judge-model@9a129038d9a00aed"
    assert grader.revision == "judge-pointwise:judge-model@9a129038d9a00aed"
