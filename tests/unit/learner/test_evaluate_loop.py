"""Held-out evaluation through the real environment loop, per environment kind, with a scripted
policy in place of the model: a known-correct and a known-wrong policy, each scored by the source's
own grader (reasoning-gym score_answer, math-verify after a sandboxed tool call, search normalized
EM after a BM25 search, workplace final state after tool calls). Plus pass@k by hand."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from trajmesh.envs.math_tool import MathToolSource
from trajmesh.envs.reasoning_gym import ReasoningGymSource
from trajmesh.envs.search import SearchSource
from trajmesh.envs.workplace import WorkplaceSource
from trajmesh.learner.evaluate import evaluate_tasks, pass_at_k, pass_at_ks
from trajmesh.rollout.agents.episode import EpisodeFormat
from trajmesh.rollout.engines.torch_sampler import Sampled, SamplingParams
from trajmesh.tasks import load_split
from trajmesh.tokenizer import TextTokenizer, load_tokenizer

Respond = Callable[[str, int], str]
"""(decoded context so far, index of the context in this generate call) -> the turn's text."""


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    from trajmesh.learner.models import PRINTABLE_CHARS, build_char_tokenizer

    root: Path = tmp_path_factory.mktemp("tok")
    build_char_tokenizer(root, PRINTABLE_CHARS)
    return load_tokenizer(root)


class ScriptedPolicy:
    """Answers each context with `respond(context text)` + EOS; past the token budget it is cut
    (finish "length"), as an engine would. Records every context it saw."""

    def __init__(self, codec: TextTokenizer, respond: Respond) -> None:
        self.codec, self.respond = codec, respond
        self.seen: list[str] = []

    def generate(self, contexts: list[list[int]], params: SamplingParams) -> list[Sampled]:
        out = []
        for i, ctx in enumerate(contexts):
            text = self.codec.decode(ctx)
            self.seen.append(text)
            ids = self.codec.encode(self.respond(text, i)) + [self.codec.eos_token_id]
            if len(ids) > params.max_new_tokens:
                out.append(Sampled(ids[: params.max_new_tokens], [-1.0] * params.max_new_tokens,
                                   {"type": "length", "length": params.max_new_tokens}))
            else:
                out.append(Sampled(ids, [-1.0] * len(ids), {"type": "stop", "matched": ids[-1]}))
        return out


def _held(src: Any, n: int) -> list[dict[str, Any]]:
    _, held = load_split(src, 4, n)
    return [{"prompt": t.prompt, "answer": t.answer, "task_id": t.task_id, "source": t.source,
             "environment": t.environment, "metadata": t.metadata} for t in held]


def _run(codec: TextTokenizer, tasks: list[dict[str, Any]], respond: Respond, *, max_turns: int = 1,
         max_new_tokens: int = 300, samples: int = 1) -> tuple[dict[str, Any], ScriptedPolicy]:
    policy = ScriptedPolicy(codec, respond)
    fmt = EpisodeFormat(codec, None, {codec.eos_token_id})  # the char model: no chat template
    res = evaluate_tasks(policy, fmt, tasks, temperature=1.0, samples=samples, max_new_tokens=max_new_tokens,
                         max_turns=max_turns, seed=0)
    return res, policy


# --------------------------------------------------------------------------- pass@k


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (4, 1, 1, 0.25),          # c / n
    (4, 1, 2, 0.5),           # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),           # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (8, 2, 4, 1 - 15 / 70),   # 1 - C(6,4)/C(8,4)
    (3, 0, 2, 0.0),
    (4, 3, 2, 1.0),           # fewer than k wrong samples: some draw of k always holds a correct one
])
def test_pass_at_k_by_hand(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_counts() -> None:
    for n, c, k in ((4, 5, 1), (4, 1, 5), (4, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)
    assert pass_at_ks(4) == [1, 2, 4] and pass_at_ks(6) == [1, 2, 4, 6] and pass_at_ks(1) == [1]


# --------------------------------------------------------------------------- one-turn sources


def test_chain_sum_scored_by_reasoning_gym(codec: TextTokenizer) -> None:
    tasks = _held(ReasoningGymSource(), 6)
    gold = {t["prompt"]: t["answer"] for t in tasks}
    right, _ = _run(codec, tasks, lambda ctx, i: gold[ctx])
    wrong, _ = _run(codec, tasks, lambda ctx, i: str(int(gold[ctx]) + 1))
    assert (right["accuracy"], wrong["accuracy"]) == (1.0, 0.0)
    assert right["terminal_reasons"] == {"EOS": 6} and right["grader_revisions"] == {
        "reasoning_gym": "reasoning_gym-score_answer-v2"}
    # Half right (sample 0 of each problem), half wrong: pass@1 = 1/2, pass@2 = 1 by hand.
    half, _ = _run(codec, tasks, lambda ctx, i: gold[ctx] if i % 2 == 0 else "x", samples=2)
    assert half["accuracy"] == pytest.approx(0.5) and half["pass_at_k"] == {1: pytest.approx(0.5), 2: 1.0}


def test_other_reasoning_gym_family_uses_its_own_score_answer(codec: TextTokenizer) -> None:
    tasks = _held(ReasoningGymSource(name="gcd", family="gcd"), 4)
    gold = {t["prompt"]: t["answer"] for t in tasks}
    right, _ = _run(codec, tasks, lambda ctx, i: gold[ctx])
    wrong, _ = _run(codec, tasks, lambda ctx, i: "none")  # (a near miss earns partial credit in gcd)
    assert (right["accuracy"], wrong["accuracy"]) == (1.0, 0.0)
    assert right["environment_revisions"] == {"reasoning_gym": "single_answer-v1"}


def test_an_answer_cut_by_the_token_budget_is_max_tokens_and_wrong(codec: TextTokenizer) -> None:
    tasks = _held(ReasoningGymSource(), 3)
    gold = {t["prompt"]: t["answer"] for t in tasks}
    res, _ = _run(codec, tasks, lambda ctx, i: "it is " + gold[ctx], max_new_tokens=4)
    assert res["accuracy"] == 0.0 and res["terminal_reasons"] == {"MAX_TOKENS": 3}


# --------------------------------------------------------------------------- multi-turn sources


def _math_program(question: str, off_by_one: bool) -> str:
    if m := re.match(r"Sum of the integers from (\d+) to (\d+)\?", question):
        return f"print(sum(range({m[1]}, {m[2]}{'' if off_by_one else ' + 1'})))"
    m = re.match(r"(\d+)\^(\d+) mod (\d+)\?", question)
    assert m, question
    return f"print(pow({m[1]}, {m[2]}, {m[3]}){' + 1' if off_by_one else ''})"


def _math_respond(off_by_one: bool) -> Respond:
    """Turn 1: a program for the question, run in the sandbox; turn 2: answer what the tool printed."""
    def respond(ctx: str, i: int) -> str:
        out = re.findall(r"<output>\s*(.*?)\s*</output>", ctx, flags=re.DOTALL)
        if out:
            return f"<answer>{out[-1].strip()}</answer>"
        return f"<code>{_math_program(ctx.rsplit(chr(10), 1)[-1], off_by_one)}</code>"
    return respond


def test_math_tool_runs_code_in_the_sandbox_and_math_verify_scores(codec: TextTokenizer) -> None:
    tasks = [t for t in _held(MathToolSource(), 16)
             if re.match(r"(Sum of the integers|\d+\^)", t["metadata"]["question"])][:3]
    assert len(tasks) == 3
    right, policy = _run(codec, tasks, _math_respond(False), max_turns=3)
    wrong, _ = _run(codec, tasks, _math_respond(True), max_turns=3)
    assert (right["accuracy"], wrong["accuracy"]) == (1.0, 0.0)
    assert right["grader_revisions"] == {"math": "math-verify-0.9.0-v1"}
    # The second turn saw the sandbox's output (the gold answer) as an observation.
    assert all(any(re.search(rf"<output>\s*{t['answer']}\s*</output>", s) for s in policy.seen) for t in tasks)
    assert right["terminal_reasons"] == {"EOS": 3}
    # With a one-turn budget the code runs but no answer is ever given.
    short, _ = _run(codec, tasks, _math_respond(False), max_turns=1)
    assert short["accuracy"] == 0.0 and short["terminal_reasons"] == {"MAX_TURNS": 3}


_SEARCH_FACT = {"year": r"founded in (\d+)", "founder": r"founded in \d+ by ([A-Za-z ]+)\.",
                "river": r"on the (\w+) river", "country": r"is a town in (\w+)"}


def _search_respond(give_up: bool) -> Respond:
    """Turn 1: search the town; turn 2: read the fact off the retrieved passage (or give up)."""
    def respond(ctx: str, i: int) -> str:
        question = ctx.split("\n")[1].split("?")[0] + "?"
        town = re.search(r"([A-Z][a-z]+)\?$", question)
        assert town, question
        if "<information>" not in ctx:
            return f"<search>{town[1]}</search>"
        if give_up:
            return "<answer>unknown</answer>"
        kind = ("year" if "year" in question else "founder" if "Who" in question
                else "river" if "river" in question else "country")
        passage = next(p for p in ctx.split("\n") if p.startswith("[") and f"] {town[1]} is a town" in p)
        fact = re.search(_SEARCH_FACT[kind], passage)
        assert fact, passage
        return f"<answer>the {fact[1]}</answer>"  # articles are normalized away
    return respond


def test_search_retrieves_with_bm25_and_em_scores(codec: TextTokenizer) -> None:
    tasks = _held(SearchSource(), 4)
    right, policy = _run(codec, tasks, _search_respond(False), max_turns=3)
    wrong, _ = _run(codec, tasks, _search_respond(True), max_turns=3)
    assert (right["accuracy"], wrong["accuracy"]) == (1.0, 0.0)
    assert right["grader_revisions"] == {"search": "search-em-v1"}
    assert sum("<information>" in s for s in policy.seen) == 4  # one retrieval per episode


def _workplace_respond(tasks: list[dict[str, Any]], wrong: bool) -> Respond:
    """The reference solution, one tool call per turn, then <done/>; `wrong` marks the wrong task done."""
    import json

    by_goal = {t["metadata"]["goal"]: t["metadata"]["solution"] for t in tasks}

    def respond(ctx: str, i: int) -> str:
        goal = next(g for g in by_goal if ctx.split("\n")[1].startswith(g))
        calls = by_goal[goal]
        if wrong:
            calls = [["create_task", {"title": "not asked for", "assignee_id": 1}]]
        done = ctx.count("<result>") + ctx.count("<error>")
        if done >= len(calls):
            return "<done/>"
        name, args = calls[done]
        return f"<tool>{json.dumps({'name': name, 'arguments': args})}</tool>"
    return respond


def test_workplace_tool_calls_verified_by_final_state(codec: TextTokenizer) -> None:
    tasks = _held(WorkplaceSource(), 4)
    right, policy = _run(codec, tasks, _workplace_respond(tasks, False), max_turns=8, max_new_tokens=400)
    wrong, _ = _run(codec, tasks, _workplace_respond(tasks, True), max_turns=8, max_new_tokens=400)
    assert (right["accuracy"], wrong["accuracy"]) == (1.0, 0.0)
    assert right["grader_revisions"] == {"workplace": "workplace-final-state-v1"}
    assert right["environment_revisions"] == {"workplace": "workplace-v1"}
    assert any("<result>" in s for s in policy.seen)  # tool results came back as observations
    assert right["terminal_reasons"] == {"EOS": 4}  # each ended with <done/> + EOS


def test_infra_failures_are_counted_apart_from_accuracy_and_pass_at_k() -> None:
    """An episode the infrastructure failed (reward None) is neither right nor wrong: accuracy and
    pass@k are over the graded samples only, and a pass with none graded has no accuracy."""
    from trajmesh.learner.evaluate import Outcome, heldout_result, pass_figures

    outcomes = [Outcome("a", 1.0, 3, "EOS"), Outcome("a", None, 2, "INFRA_FAILURE"), Outcome("a", 0.0, 4, "EOS"),
                Outcome("b", None, 1, "INFRA_FAILURE"), Outcome("b", None, 0, "INFRA_FAILURE"),
                Outcome("b", 1.0, 2, "ENV_DONE")]
    fig = pass_figures(outcomes, ["a", "b"], 3)
    # graded: a -> [1, 0], b -> [1]; by hand: accuracy 2/3, pass@1 mean(1/2, 1) = 3/4,
    # pass@2 over a alone (b has 1 graded sample) = 1 - C(1,2)/C(2,2) = 1, pass@3 over no task
    assert fig["accuracy"] == pytest.approx(2 / 3)
    assert fig["pass_at_k"] == {1: pytest.approx(0.75), 2: pytest.approx(1.0), 3: None}
    assert (fig["graded"], fig["infra_failures"], fig["n_tasks"]) == (3, 3, 2)
    assert fig["terminal_reasons"] == {"ENV_DONE": 1, "EOS": 2, "INFRA_FAILURE": 3}
    assert fig["mean_response_tokens"] == pytest.approx(12 / 6)
    none = pass_figures([Outcome("a", None, 0, "INFRA_FAILURE")], ["a"], 1)
    assert none["accuracy"] is None and none["infra_failures"] == 1
    per = {"s": {"greedy_accuracy": None, "sampled_accuracy": None, "n_tasks": 1, "greedy_infra_failures": 1,
                 "sampled_infra_failures": 1}}
    record = heldout_result(per, "greedy")
    assert "score" not in record and record["greedy_infra_failures"] == 1  # nothing to compare or stop on
    per["t"] = {"greedy_accuracy": 0.5, "sampled_accuracy": 0.25, "n_tasks": 3, "greedy_infra_failures": 0,
                "sampled_infra_failures": 2}
    record = heldout_result(per, "greedy")
    assert record["score"] == 0.5 and record["sampled_infra_failures"] == 3  # the source with a figure
