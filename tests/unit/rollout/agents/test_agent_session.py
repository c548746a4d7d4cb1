"""AgentSession without an engine: prompts continue the recorded tokens, not a re-encoding; changed
history, branches and extra samples get their own segments with earlier tokens masked 0; retried and
unreceived completions are dropped. Outputs are hand-made token ids (what an engine could return)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")

from trajmesh.rollout.agents.agent_session import AgentSession  # noqa: E402
from trajmesh.rollout.agents.chat_format import ChatFormat  # noqa: E402
from trajmesh.tokenizer import load_tokenizer  # noqa: E402
from trajmesh.v1 import trajectory_pb2  # noqa: E402

TEXTS = ["What is 2+3?", "The answer is 5.", "Say hi.", "hello there"] * 30


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ChatFormat]:
    pytest.importorskip("transformers")
    from chatml_model import build_chatml_model

    root: Path = build_chatml_model(tmp_path_factory.mktemp("session"), TEXTS, max_positions=256)
    chat = ChatFormat.load(root)
    assert chat is not None
    return load_tokenizer(root), chat


def _session(tools: tuple[Any, ChatFormat]) -> AgentSession:
    tok, chat = tools
    return AgentSession("s", tok, chat, tok.tokenizer.token_to_id("<|im_end|>"))


def _render(chat: ChatFormat) -> Any:
    return lambda msgs, gen: chat.render(msgs, add_generation_prompt=gen)


def _spelled(tok: Any, text: str) -> list[int]:
    return [tok.encode(ch)[0] for ch in text]


def _turn(s: AgentSession, msgs: list[dict[str, Any]], out: list[int], reply: str, fp: str = "f") -> Any:
    chat = s.chat
    plan = s.chat_prompt(msgs, None, _render(chat))
    call = s.begin("chat", plan, fp)
    comp = s.add_completion(call, out, [-0.5] * len(out), [3] * len(out))
    call.finished = 1.0
    s.remember_chat(comp, msgs, None, {"role": "assistant", "content": reply})
    return call


def test_resent_conversation_keeps_the_generated_tokens(tools: tuple[Any, ChatFormat]) -> None:
    tok, chat = tools
    s = _session(tools)
    end = tok.tokenizer.token_to_id("<|im_end|>")
    out1 = _spelled(tok, "The answer is 5.") + [end]  # not how the tokenizer would encode the text
    assert tok.encode("The answer is 5.") != out1[:-1]
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    c1 = _turn(s, msgs, out1, "The answer is 5.")
    msgs2 = [*msgs, {"role": "assistant", "content": "The answer is 5."}, {"role": "user", "content": "Say hi."}]
    out2 = tok.encode("hello there") + [end]
    c2 = _turn(s, msgs2, out2, "hello there")
    assert c2.reason == "continued" and c2.parent is c1.completions[0]
    rendered_prompt1 = chat.render(msgs, add_generation_prompt=True)
    assert c1.prompt_ids == tok.encode(rendered_prompt1)
    assert c2.prompt_ids[:len(c1.prompt_ids) + len(out1)] == c1.prompt_ids + out1
    between = tok.tokenizer.decode(c2.prompt_ids[len(c1.prompt_ids) + len(out1):], skip_special_tokens=False)
    assert between == "\n<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    (traj,) = s.trajectories(None, base_id="t")
    ids, mask = traj.token_ids_T.tolist(), traj.loss_mask_T.tolist()
    assert ids == c2.prompt_ids + out2
    assert [i for i, m in zip(ids, mask, strict=True) if m] == out1 + out2
    assert set(traj.behavior_versions_T.tolist()[i] for i, m in enumerate(mask) if m) == {3}
    assert traj.pb.trajectory_id == "t-s0-first"


def test_length_capped_turn_gets_the_template_close_masked_out(tools: tuple[Any, ChatFormat]) -> None:
    tok, chat = tools
    s = _session(tools)
    out1 = tok.encode("hello")  # no end-of-turn token: the budget ran out
    msgs = [{"role": "user", "content": "Say hi."}]
    c1 = _turn(s, msgs, out1, "hello")
    c2 = _turn(s, [*msgs, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "Say hi."}],
               tok.encode("hi"), "hi")
    between = tok.tokenizer.decode(c2.prompt_ids[len(c1.prompt_ids) + len(out1):], skip_special_tokens=False)
    assert between.startswith("<|im_end|>\n<|im_start|>user\n")


def test_edited_history_branch_and_retry(tools: tuple[Any, ChatFormat]) -> None:
    tok, _ = tools
    s = _session(tools)
    end = tok.tokenizer.token_to_id("<|im_end|>")
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    c1 = _turn(s, msgs, tok.encode("5") + [end], "5")
    follow = [*msgs, {"role": "assistant", "content": "5"}, {"role": "user", "content": "Say hi."}]
    c2 = _turn(s, follow, tok.encode("hi") + [end], "hi")
    c3 = _turn(s, follow, tok.encode("hello") + [end], "hello")  # a second continuation of c1: a branch
    edited = [*msgs, {"role": "assistant", "content": "six"}, {"role": "user", "content": "Say hi."}]
    c4 = _turn(s, edited, tok.encode("ok") + [end], "ok", fp="edit")
    assert [c.reason for c in (c1, c2, c3, c4)] == ["first", "continued", "continued", "history_changed"]
    # an SDK retry of the edited request arrives (the endpoint drops before it generates): the
    # first attempt was never received
    assert s.drop_retried("edit") == 1 and c4.completions[0].orphan
    c5 = _turn(s, edited, tok.encode("fine") + [end], "fine", fp="edit")
    assert not c5.completions[0].orphan
    trajs = s.trajectories(trajectory_pb2.Task(task_id="x", group_id="g"), base_id="t")
    assert [t.pb.trajectory_id for t in trajs] == ["t-s0-first", "t-s1-branch", "t-s2-history_changed"]
    branch = trajs[1]
    mask = branch.loss_mask_T.tolist()
    assert [i for i, m in zip(branch.token_ids_T.tolist(), mask, strict=True) if m] == tok.encode("hello") + [end]
    assert branch.token_ids_T.tolist() == c3.prompt_ids + tok.encode("hello") + [end]  # c1's tokens masked 0 here
    assert [i for i, m in zip(trajs[2].token_ids_T.tolist(), trajs[2].loss_mask_T.tolist(), strict=True) if m] == \
        tok.encode("fine") + [end]
    assert s.final_segment() == 2
    # published: ONE trajectory, the three segments as sequences of their own
    whole = s.trajectory(trajectory_pb2.Task(task_id="x", group_id="g"), trajectory_id="t")
    assert whole is not None
    hi, hello, fine = (tok.encode(w) + [end] for w in ("hi", "hello", "fine"))
    seg0, seg1, seg2 = c2.prompt_ids + hi, c3.prompt_ids + hello, c5.prompt_ids + fine
    assert whole.token_ids_T.tolist() == seg0 + seg1 + seg2
    assert list(whole.pb.sequence_starts) == [0, len(seg0), len(seg0) + len(seg1)]
    trained = [i for i, m in zip(whole.token_ids_T.tolist(), whole.loss_mask_T.tolist(), strict=True) if m]
    assert trained == tok.encode("5") + [end] + hi + hello + fine  # each generated token once
    whole.finish(trajectory_pb2.EOS)
    assert whole.validate() == []


def test_plain_completions_continue_by_text(tools: tuple[Any, ChatFormat]) -> None:
    tok, _ = tools
    s = _session(tools)
    p1 = s.text_prompt("What is 2+3?")
    call = s.begin("completions", p1, "a")
    out = _spelled(tok, " 5.")
    comp = s.add_completion(call, out, [-1.0] * len(out), [0] * len(out))
    call.finished = 1.0
    s.remember_text(comp, "What is 2+3?", " 5.")
    p2 = s.text_prompt("What is 2+3? 5. Say hi.")
    assert p2.reason == "continued" and p2.prompt_ids == p1.prompt_ids + out + tok.encode(" Say hi.")
    assert s.text_prompt("What is 2+4?").reason == "history_changed"


def test_external_agent_grader_scores_the_returned_answer_and_never_a_timeout() -> None:
    from trajmesh.config import load_config
    from trajmesh.graders import make_grader
    from trajmesh.graders.base import Sample
    from trajmesh.tasks import load_split

    cfg = load_config(None, {"tasks.sources": [{"type": "external_agent", "agent": "m:f", "family": "gcd"}]})
    spec = load_split(cfg.tasks.sources[0], 2, 1)[0][0]
    task = {"prompt": spec.prompt, "answer": spec.answer, "metadata": spec.metadata}
    assert spec.metadata["grader"] == "external_agent" and spec.environment == "external_agent"
    grader = make_grader("external_agent")
    wrong = str(int(spec.answer) + 1)
    # the model's last turn is right, the agent returned something else: scored on the return value
    returned_wrong = Sample(spec.answer, [spec.answer], True, [], "EOS", final_answer=wrong)
    assert grader.grade(returned_wrong, task).reward == 0.0
    returned_right = Sample(wrong, [wrong], True, [], "EOS", final_answer=spec.answer)
    grade = grader.grade(returned_right, task)
    assert (grade.reward, grade.components["correct"], grade.components["finished"]) == (1.0, 1.0, 1.0)
    assert repr(spec.answer) in grade.verifier_output
    # no agent answer: held-out evaluation (the policy answers itself), scored on the final turn
    call = '<tool_call>\n{"name": "gcd", "arguments": {}}\n</tool_call>'
    assert grader.grade(Sample(call + spec.answer, [call, spec.answer], True, [], "EOS"), task).reward == 1.0
    assert grader.grade(Sample(spec.answer + wrong, [spec.answer, wrong], True, [], "EOS"), task).reward == 0.0
    # a timed-out run: never rewarded
    timed_out = Sample(spec.answer, [spec.answer], True, [], "WALL_TIMEOUT", final_answer=spec.answer)
    grade = grader.grade(timed_out, task)
    assert (grade.reward, grade.components["finished"]) == (0.0, 0.0)


def test_a_retry_drops_only_its_own_previous_attempt(tools: tuple[Any, ChatFormat]) -> None:
    """An identical request sent twice (two samples the agent asked for), the second refused while
    weights load and retried: nothing is dropped. A retry whose previous attempt generated an answer
    drops that answer; one whose previous attempt is still generating drops nothing."""
    tok, _ = tools
    s = _session(tools)
    end = tok.tokenizer.token_to_id("<|im_end|>")
    msgs = [{"role": "user", "content": "Say hi."}]
    delivered = _turn(s, msgs, tok.encode("hi") + [end], "hi", fp="same")
    s.refuse("same")  # the second request's first attempt, refused (503)
    assert s.drop_retried("same") == 0 and not delivered.completions[0].orphan
    retried = _turn(s, msgs, tok.encode("hello") + [end], "hello", fp="same")
    # another SDK retry of the same body: the previous attempt (`retried`) was never received
    assert s.drop_retried("same") == 1 and retried.completions[0].orphan
    assert not delivered.completions[0].orphan
    running = s.begin("chat", s.chat_prompt(msgs, None, _render(s.chat)), "same")  # not finished yet
    assert s.drop_retried("same") == 0 and running.completions == []
    assert [call is None for _, call in s.attempts] == [False, True, False, False]
