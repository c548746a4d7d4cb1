"""A verifiers tool taskset built here over a local ``datasets.Dataset`` (no hub download), imported by
id (``verifiers_tool_tasksets``, this module) by tests/unit/envs/test_env_verifiers.py and
tests/e2e/test_e2e_verifiers.py: sums the model is asked to do with the ``calc_add`` tool.

The tool lives in an MCP server, ``AddToolset``, that verifiers launches per rollout as
``python -m verifiers_tool_tasksets`` (its local subprocess runtime; hence the ``__main__`` below).
The harness offers its schema to the model as an OpenAI ``tools`` entry, runs the model's native tool
call against the server and sends the result back as a ``tool`` message. Two reward functions of
verifiers' own score the episode: one that a tool answered, one that the final reply is the sum.
"""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf
from datasets import Dataset

ROWS = [{"question": f"Use the calc_add tool to add {a} and {b}, then answer with the number only.",
         "answer": str(a + b)} for a in range(1, 16) for b in (1, 2)]
TOOL_NAME = "calc_add"
"""The name the harness gives the tool: the server's prefix, "_", the tool's name."""


class AddToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers and return their sum."""
        return a + b


class AddData(vf.TaskData):
    answer: str = ""
    """The expected sum."""


class AddTask(vf.Task[AddData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [AddToolset(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def tool_answered(self, task: AddData, trace: Any) -> float:
        return float(bool(trace.tool_messages))

    @vf.reward(weight=1.0)
    async def correct(self, task: AddData, trace: Any) -> float:
        return float(trace.last_reply == task.answer)


class AddTaskset(vf.Taskset[AddTask, vf.TasksetConfig]):
    def load(self) -> Any:
        for row in Dataset.from_list(ROWS):
            yield AddTask(AddData(prompt=row["question"], answer=row["answer"]), self.config.task)


__all__ = ["AddTaskset"]

if __name__ == "__main__":  # the tool server, as verifiers starts it for each rollout
    AddToolset.run()
