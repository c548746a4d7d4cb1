"""Chat templates that use what transformers adds to Jinja render as transformers renders them
(rollout/agents/chat_format.py): loop controls, the ``{% generation %}`` block, ``strftime_now``. The
expected text is transformers' own rendering (``transformers.utils.chat_template_utils``)."""

from __future__ import annotations

from datetime import datetime

import pytest

from trajmesh.rollout.agents.chat_format import ChatFormat

transformers_templates = pytest.importorskip("transformers.utils.chat_template_utils")

TEMPLATE = (
    "{{ bos_token }}Today is {{ strftime_now('%Y-%m-%d') }}.\n"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}"
    "<|{{ message['role'] }}|>"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|end|>{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "never rendered: past the break"}]


def test_template_with_transformers_extensions_renders_as_transformers_does():
    ours = ChatFormat(TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    theirs = transformers_templates._compile_jinja_template(TEMPLATE)
    for add in (True, False):
        while True:  # strftime_now: both renderings on the same day (retried across midnight)
            day = datetime.now().date()
            expected = theirs.render(messages=MESSAGES, add_generation_prompt=add, bos_token="<s>", eos_token="</s>")
            got = ours.render(MESSAGES, add_generation_prompt=add)
            if datetime.now().date() == day:
                break
        assert got == expected
        assert "never rendered" not in got and "be brief" not in got
