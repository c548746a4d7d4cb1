"""verifiers tasksets built here over a local ``datasets.Dataset`` (no hub download), imported by
id (``verifiers_tasksets``, this module) by tests/unit/envs/test_env_verifiers.py and tests/e2e/test_e2e_verifiers.py:
single-turn sums with verifiers' own ``@vf.reward`` functions; tasks whose ``boom`` is set have a
reward function that raises (a rubric exception)."""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf
from datasets import Dataset

ROWS = [{"question": f"What is {a} + {b}? Answer with the number only.", "answer": str(a + b), "boom": a % 3 == 0}
        for a in range(1, 16) for b in (1, 2)]


class SumData(vf.TaskData):
    answer: str = ""
    """The expected sum."""
    boom: bool = False
    """The rubric raises on this task."""


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: SumData, trace: Any) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def mentions_answer(self, task: SumData, trace: Any) -> float:
        if task.boom:
            raise RuntimeError("rubric exploded")
        return float(task.answer in trace.last_reply)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self) -> Any:
        for row in Dataset.from_list(ROWS):
            yield SumTask(SumData(prompt=row["question"], answer=row["answer"], boom=row["boom"]), self.config.task)


__all__ = ["SumTaskset"]
