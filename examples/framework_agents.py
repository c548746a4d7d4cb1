"""Tool-using agents written with three agent frameworks, each trainable by trajmesh as it is.

One ``solve(task, base_url, api_key)`` per framework, the shape the ``external_agent`` runner calls
(``rollout/agents/agent_runner.py``; see ``examples/openai_agent.py`` for the plain ``openai`` client):

==========================  ====================================================================
``agents_chat``             the OpenAI Agents SDK (``openai-agents``), its Chat Completions model
``agents_responses``        the OpenAI Agents SDK, its Responses model
``langchain_tools``         LangChain: ``ChatOpenAI.bind_tools`` and a hand-written tool loop
``langgraph_react``         LangGraph's prebuilt ``create_react_agent``
``pydantic_ai_agent``       pydantic-ai's ``Agent`` on its OpenAI chat model
==========================  ====================================================================

Each points its framework's OpenAI model at ``base_url`` (a run's ``<rollout>/sessions/<sid>/v1``)
with the model the task names (``task["model"]``), gives it one tool, ``add``, and returns the
final answer as a string. ``task["stop"]`` (optional) is a list of stop strings passed the
framework's own way.

Each agent's first model call requires a tool call, the framework's own way (the Agents SDK's
``ModelSettings(tool_choice="required")``, reset after the first call by the SDK; LangChain's
``bind_tools(..., tool_choice="add")``; LangGraph through a model chosen per state; pydantic-ai
through a capability's per-step ``tool_choice``); the calls after it choose freely
(``tool_choice`` ``auto``), one tool call at most per answer (``parallel_tool_calls`` false). An endpoint that honours ``tool_choice`` (trajmesh's, by constrained
decoding) therefore answers the first call with a tool call even from an untrained model, the tool
runs, and its result goes back in a second call.

Each also writes down what its framework *received* from the endpoint, read back from the
framework's own result objects: when the environment variable ``TRAJMESH_AGENT_RECORD`` names a
file, one JSON line per run is appended to it::

    {"framework": "langchain_tools", "base_url": "...", "stop": [...],
     "received": [{"content": "...", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}, ...]}

``received`` holds one entry per model response, in the order the framework got them. The
e2e test (``tests/e2e/test_e2e_external_agent.py``) compares each with the trained tokens.

Try one by hand against any OpenAI-compatible server::

    python examples/framework_agents.py langgraph_react --base-url http://127.0.0.1:8000/v1 --model NAME "What is 2+3?"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Annotated, Any

from pydantic import Field

RECORD_ENV = "TRAJMESH_AGENT_RECORD"
MAX_STEPS = 4
"""Model calls an agent makes at most (its tool loop's length)."""
MAX_TOKENS = 96
"""Enough for one whole ``add`` call in the native format, even written a character per token."""
TEMPERATURE = 1.0

Operand = Annotated[int, Field(ge=-999, le=999)]
"""``add``'s arguments are bounded (``minimum`` / ``maximum`` in the tool's JSON schema), so a
constrained call cannot spend the budget on digits."""


def add(a: Operand, b: Operand) -> int:
    """Add two integers."""
    return int(a) + int(b)


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as an object (frameworks keep them as a JSON string or a dict)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw or "{}")
        except ValueError:
            return raw
    return raw


def record_received(framework: str, base_url: str, stop: list[str], received: list[dict[str, Any]]) -> None:
    """Appends one run's received responses to the file `RECORD_ENV` names (nothing when unset)."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = json.dumps({"framework": framework, "base_url": base_url, "stop": stop, "received": received})
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


def _stop(task: dict[str, Any]) -> list[str]:
    return list(task.get("stop") or [])


# ----------------------------------------------------------------- the OpenAI Agents SDK


def _agents_sdk(task: dict[str, Any], base_url: str, api_key: str, responses: bool) -> str:
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI
    stop = _stop(task)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=300)
    model_cls = agents.OpenAIResponsesModel if responses else agents.OpenAIChatCompletionsModel
    settings = agents.ModelSettings(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, tool_choice="required",
                                    parallel_tool_calls=False,
                                    extra_body={"stop": stop} if stop else None)
    # reset_tool_choice (the SDK's default): "required" on the first call only, "auto" after a tool ran
    agent = agents.Agent(name="adder", instructions=None, tools=[agents.function_tool(add)],
                         model=model_cls(model=task["model"], openai_client=client), model_settings=settings,
                         reset_tool_choice=True)

    async def run() -> Any:
        async with client:  # closed in this event loop, not after it
            return await agents.Runner.run(agent, input=task["prompt"], max_turns=MAX_STEPS)

    result = asyncio.run(run())
    received = []
    for response in result.raw_responses:
        texts, calls = [], []
        for item in response.output:
            if item.type == "message":
                texts += [part.text for part in item.content if part.type == "output_text"]
            elif item.type == "function_call":
                calls.append({"name": item.name, "arguments": _arguments(item.arguments)})
        received.append({"content": "".join(texts), "tool_calls": calls})
    record_received("agents_responses" if responses else "agents_chat", base_url, stop, received)
    return str(result.final_output or "")


def agents_chat(task: dict[str, Any], base_url: str, api_key: str) -> str:
    """The OpenAI Agents SDK with its Chat Completions model (``/chat/completions``)."""
    return _agents_sdk(task, base_url, api_key, responses=False)


def agents_responses(task: dict[str, Any], base_url: str, api_key: str) -> str:
    """The OpenAI Agents SDK with its Responses model (``/responses``)."""
    return _agents_sdk(task, base_url, api_key, responses=True)


# ----------------------------------------------------------------- LangChain / LangGraph


def _chat_openai(task: dict[str, Any], base_url: str, api_key: str) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=task["model"], base_url=base_url, api_key=api_key, temperature=TEMPERATURE,
                      max_tokens=MAX_TOKENS, stop=_stop(task) or None, timeout=300, max_retries=2)


def _received_langchain(message: Any) -> dict[str, Any]:
    content = message.content if isinstance(message.content, str) else "".join(
        part.get("text", "") for part in message.content if isinstance(part, dict))
    return {"content": content,
            "tool_calls": [{"name": c["name"], "arguments": c["args"]} for c in message.tool_calls]}


def langchain_tools(task: dict[str, Any], base_url: str, api_key: str) -> str:
    """LangChain's ``bind_tools`` and a tool loop of its own."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    add_tool = tool(add)
    chat = _chat_openai(task, base_url, api_key)
    first = chat.bind_tools([add_tool], tool_choice="add", parallel_tool_calls=False)
    model = chat.bind_tools([add_tool], parallel_tool_calls=False)
    messages: list[Any] = [HumanMessage(task["prompt"])]
    received = []
    answer = ""
    for step in range(MAX_STEPS):
        reply = (model if step else first).invoke(messages)
        messages.append(reply)
        received.append(_received_langchain(reply))
        if not reply.tool_calls:
            answer = received[-1]["content"]
            break
        for call in reply.tool_calls:
            try:
                result = str(add_tool.invoke(call["args"]))
            except Exception as exc:  # a bad call is answered with its error, as the model's tool result
                result = f"error: {exc}"
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    record_received("langchain_tools", base_url, _stop(task), received)
    return answer


def langgraph_react(task: dict[str, Any], base_url: str, api_key: str) -> str:
    """LangGraph's prebuilt ReAct agent (``create_react_agent``)."""
    import warnings

    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent
    from langgraph.warnings import LangGraphDeprecatedSinceV10

    # LangGraph 1.x points at langchain.agents.create_agent (the `langchain` package) instead
    warnings.filterwarnings("ignore", category=LangGraphDeprecatedSinceV10)
    tools = [tool(add)]
    chat = _chat_openai(task, base_url, api_key)
    first = chat.bind_tools(tools, tool_choice="required", parallel_tool_calls=False)
    model = chat.bind_tools(tools, parallel_tool_calls=False)

    def choose(state: dict[str, Any], runtime: Any) -> Any:
        """The model for the next call: a tool call required until a tool has answered."""
        return model if any(isinstance(m, ToolMessage) for m in state["messages"]) else first

    graph = create_react_agent(choose, tools)
    out = graph.invoke({"messages": [("user", task["prompt"])]}, {"recursion_limit": 2 * MAX_STEPS})
    replies = [m for m in out["messages"] if isinstance(m, AIMessage)]
    received = [_received_langchain(m) for m in replies]
    record_received("langgraph_react", base_url, _stop(task), received)
    return received[-1]["content"] if received else ""


# ----------------------------------------------------------------- pydantic-ai


def pydantic_ai_agent(task: dict[str, Any], base_url: str, api_key: str) -> str:
    """pydantic-ai's ``Agent`` on ``OpenAIChatModel`` (its own client, so no shared connection pool)."""
    from openai import AsyncOpenAI
    from pydantic_ai import Agent, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    stop = _stop(task)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=300, max_retries=2)
    model = OpenAIChatModel(task["model"], provider=OpenAIProvider(openai_client=client))
    settings = ModelSettings(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, parallel_tool_calls=False)
    if stop:
        settings["stop_sequences"] = stop

    class ToolFirst(AbstractCapability[None]):
        """``tool_choice: "required"`` on the run's first model call (pydantic-ai refuses it static)."""

        def get_model_settings(self) -> Any:
            return lambda ctx: ModelSettings(tool_choice="required") if ctx.run_step <= 1 else ModelSettings()

    agent = Agent(model, model_settings=settings, tools=[add], capabilities=[ToolFirst()])

    async def run() -> Any:
        async with client:
            return await agent.run(task["prompt"])

    result = asyncio.run(run())
    received = []
    for message in result.all_messages():
        if isinstance(message, ModelResponse):
            received.append({
                "content": "".join(p.content for p in message.parts if isinstance(p, TextPart)),
                "tool_calls": [{"name": p.tool_name, "arguments": p.args_as_dict()}
                               for p in message.parts if isinstance(p, ToolCallPart)]})
    record_received("pydantic_ai_agent", base_url, stop, received)
    return str(result.output)


AGENTS = {"agents_chat": agents_chat, "agents_responses": agents_responses, "langchain_tools": langchain_tools,
          "langgraph_react": langgraph_react, "pydantic_ai_agent": pydantic_ai_agent}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("agent", choices=sorted(AGENTS))
    parser.add_argument("prompt")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--model", required=True, help="the served model's name (GET <base-url>/models)")
    ns = parser.parse_args()
    print(AGENTS[ns.agent]({"prompt": ns.prompt, "model": ns.model}, ns.base_url, ns.api_key))
