"""A verifiers taskset for examples/adapters/verifiers_sums.yaml: one-digit additions over a local
``datasets.Dataset`` (no hub download), scored by verifiers' own ``@vf.reward`` functions.

``taskset: adapter_sums`` names this module; the config's ``python_path`` puts this folder on the
path of the processes that import it (docs/ENVIRONMENTS.md, "A verifiers taskset").
"""

from __future__ import annotations

import re
from typing import Any

import verifiers.v1 as vf
from datasets import Dataset

ROWS = [{"question": f"What is {a} + {b}? Write the equation with its result.", "answer": str(a + b)}
        for a in range(1, 10) for b in range(1, 10)]


def last_integer(text: str) -> str:
    """The reply's last integer ("" if none): SmolLM2 writes "7 + 8 = 15" when asked for the equation."""
    found = re.findall(r"-?\d+", text or "")
    return found[-1] if found else ""


class SumData(vf.TaskData):
    answer: str = ""
    """The expected sum."""


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: SumData, trace: Any) -> float:
        """1 when the reply's last integer is the sum."""
        return float(last_integer(trace.last_reply) == task.answer)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self) -> Any:
        for row in Dataset.from_list(ROWS):
            yield SumTask(SumData(prompt=row["question"], answer=row["answer"]), self.config.task)


__all__ = ["SumTaskset"]
