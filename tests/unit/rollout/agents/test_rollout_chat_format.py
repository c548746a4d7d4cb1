"""The rollout's chat format (rollout/agents/chat_format.py) against Hugging Face's own template rendering,
on the tiny ChatML model (tests/chatml_model.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from chatml_model import build_chatml_model  # noqa: E402

from trajmesh.rollout.agents.chat_format import ChatFormat, model_stop_ids  # noqa: E402
from trajmesh.tokenizer import load_tokenizer  # noqa: E402

TEXTS = ["What is 2+3? Answer with a number.", "<code>print(1)</code>", "<search>town</search>"] * 40


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chatml_model(tmp_path_factory.mktemp("chatml"), TEXTS, max_positions=256)


def test_prompt_and_observations_render_as_huggingface_does(chat_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(chat_dir))
    chat = ChatFormat.load(chat_dir)
    assert chat is not None and chat.turn_end() == "<|im_end|>"
    user = [{"role": "user", "content": "What is 2+3?"}]
    prompt = chat.prompt("What is 2+3?")
    assert prompt == hf.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    action = "<code>print(5)</code>"
    for role in ("tool", "user"):
        convo = [*user, {"role": "assistant", "content": action}, {"role": role, "content": "<output>5</output>"}]
        full = hf.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
        # the context rollout builds: prompt, generated action + end of turn, observation
        assert prompt + action + "<|im_end|>" + chat.observation("<output>5</output>", role, turn_closed=True) == full
        assert prompt + action + chat.observation("<output>5</output>", role, turn_closed=False) == full
    assert "<tool_response>\n<output>5</output>\n</tool_response>" in chat.observation("<output>5</output>", "tool",
                                                                                       turn_closed=True)


def test_special_and_tool_tokens_are_single_ids(chat_dir: Path) -> None:
    tok = load_tokenizer(chat_dir)
    ids = tok.encode(ChatFormat.load(chat_dir).prompt("hi"))  # type: ignore[union-attr]
    assert ids[0] == tok.tokenizer.token_to_id("<|im_start|>")
    call = tok.encode('<tool_call>{"name": "python"}</tool_call>')
    assert call[0] == tok.tokenizer.token_to_id("<tool_call>") and call[-1] == tok.tokenizer.token_to_id("</tool_call>")
    assert tok.decode(call) == '<tool_call>{"name": "python"}</tool_call>'  # tool tokens are not skipped


def test_stop_ids_include_every_eos(chat_dir: Path) -> None:
    tok = load_tokenizer(chat_dir)
    end_of_turn, end_of_text = tok.tokenizer.token_to_id("<|im_end|>"), tok.tokenizer.token_to_id("<|endoftext|>")
    assert tok.eos_token_id == end_of_turn
    assert model_stop_ids(chat_dir, tok.eos_token_id) == {end_of_turn, end_of_text}


def test_a_model_without_a_template_keeps_the_plain_format(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    assert ChatFormat.load(tmp_path) is None
    assert model_stop_ids(tmp_path, 7) == {7}
