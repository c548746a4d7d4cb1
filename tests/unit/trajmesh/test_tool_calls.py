"""Native (Hermes / Qwen2.5) tool calls: trajmesh/tool_calls.py. Expected values are written by hand."""

from __future__ import annotations

from trajmesh.tool_calls import ToolCall, count_malformed, parse_tool_calls, render_tool_calls


def test_one_call_with_text_around() -> None:
    text = 'Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(2+2)"}}\n</tool_call>'
    rest, calls = parse_tool_calls(text)
    assert rest == "Let me compute."
    assert calls == [ToolCall("call_0", "python", {"code": "print(2+2)"})]


def test_several_calls_get_positional_ids() -> None:
    text = ('<tool_call>{"name": "search", "arguments": {"query": "nile"}}</tool_call>\n'
            '<tool_call>{"name": "open", "arguments": {"doc_id": 3}}</tool_call>')
    rest, calls = parse_tool_calls(text)
    assert rest == ""
    assert calls == [ToolCall("call_0", "search", {"query": "nile"}), ToolCall("call_1", "open", {"doc_id": 3})]


def test_no_call_is_plain_text() -> None:
    assert parse_tool_calls("  <answer>4</answer>\n") == ("<answer>4</answer>", [])


def test_arguments_as_json_string_and_missing_arguments() -> None:
    text = ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
            '<tool_call>{"name": "b"}</tool_call>')
    assert parse_tool_calls(text)[1] == [ToolCall("call_0", "a", {"x": 1}), ToolCall("call_1", "b", {})]


def test_malformed_blocks_stay_as_text_and_do_not_raise() -> None:
    bad_json = "<tool_call>{name: python}</tool_call>"
    no_name = '<tool_call>{"arguments": {"code": "1"}}</tool_call>'
    not_object = "<tool_call>[1, 2]</tool_call>"
    bad_args = '<tool_call>{"name": "python", "arguments": [1]}</tool_call>'
    good = '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>'
    text = f"a {bad_json} b {no_name} {not_object} {bad_args} {good} c"
    rest, calls = parse_tool_calls(text)
    assert rest == f"a {bad_json} b {no_name} {not_object} {bad_args}  c"
    assert calls == [ToolCall("call_0", "python", {"code": "1"})]
    assert count_malformed(text) == 4


def test_unclosed_block_is_text_and_counted() -> None:
    text = 'x <tool_call>{"name": "python", "arguments": {"code": "1"}}'
    assert parse_tool_calls(text) == (text, [])
    assert count_malformed(text) == 1
    assert count_malformed('<tool_call>{"name": "f"}</tool_call>') == 0


def test_render_matches_qwen25_template_text() -> None:
    calls = [ToolCall("call_0", "python", {"code": "print('é')"}), ToolCall("call_1", "search", {"query": "a", "k": 2})]
    assert render_tool_calls(calls) == (
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(\'é\')"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "a", "k": 2}}\n</tool_call>')
    assert render_tool_calls([]) == ""


def test_render_then_parse_round_trips() -> None:
    calls = [ToolCall("call_0", "set", {"key": "b", "value": [1, {"z": None}]})]
    assert parse_tool_calls(render_tool_calls(calls)) == ("", calls)


TOOLS_TEMPLATE = (  # the shape of Qwen2.5's: tools listed in the system turn, one JSON object per line
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools><|im_end|>{{ '\\n' }}{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_format_passes_the_task_tools_to_the_template() -> None:
    from trajmesh.envs.base import function_schemas
    from trajmesh.rollout.agents.chat_format import ChatFormat

    chat = ChatFormat(TOOLS_TEMPLATE, {})
    tools = function_schemas({"search": {"description": "Search.", "parameters": {"type": "object"}}})
    assert chat.prompt("Q?", tools) == (
        '<|im_start|>system\n# Tools\n<tools>\n{"type": "function", "function": {"name": "search", '
        '"description": "Search.", "parameters": {"type": "object"}}}\n</tools><|im_end|>\n'
        "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n")
    assert chat.prompt("Q?") == "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
