"""An ordinary tool-using agent written against the official `openai` package, trainable by trajmesh.

It knows nothing about trajmesh: it gets a base URL and an API key, asks the model, runs the tools
the model calls (here an integer calculator it executes itself), sends the results back as ``tool``
messages and returns the model's final answer. Point it at a run's agent endpoint
(``<rollout>/sessions/<sid>/v1``) and every call it makes is recorded as trajectory tokens; the
``external_agent`` runner (``rollout/agents/agent_runner.py``) calls ``solve`` in its own process,
and what ``solve`` returns is the answer the run is graded on (``None``: an infrastructure failure,
never rewarded).

Try it by hand against any OpenAI-compatible server::

    python examples/openai_agent.py --base-url http://127.0.0.1:8000/v1 --model NAME "What is 2+3?"
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
MAX_STEPS = 4


def run_tool(name: str, arguments: str) -> str:
    """The agent's own tools; a bad call is answered with an error text, never raised."""
    try:
        args = json.loads(arguments or "{}")
        if name == "add":
            return str(int(args["a"]) + int(args["b"]))
        return f"error: unknown tool {name!r}"
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def solve(task: dict[str, Any], base_url: str, api_key: str) -> str:
    """Answers ``task["prompt"]``, calling tools until the model answers in text (or MAX_STEPS),
    with the model the task names (``task["model"]``: the name the endpoint serves)."""
    client = OpenAI(base_url=base_url, api_key=api_key, timeout=300)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    for _ in range(MAX_STEPS):
        reply = client.chat.completions.create(model=task["model"], messages=messages, tools=TOOLS,
                                               temperature=0, max_tokens=64).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return reply.content or ""
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    return ""


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--model", required=True, help="the served model's name (GET <base-url>/models)")
    ns = parser.parse_args()
    print(solve({"prompt": ns.prompt, "model": ns.model}, ns.base_url, ns.api_key))
