"""open_ended task source: prompts with no gold answer and no program verifier; only a judge scores
them (graders/judge.py). No torch.

The prompts come from a small built-in generator (every `templates` entry with every `topics` entry:
"Write one short sentence about the sea.") or from a JSONL file (`prompts_file`, one
``{"prompt": "..."}`` per line, prompt only). A draw is deterministic per seed: the pool in its
order, shuffled by ``random.Random(seed)``, excluded prompts skipped. A task's id is its prompt's
hash (the prompt is the whole task), its ``answer`` is empty.

Such a source is valid only when ``judge.sources`` names it: the config refuses it otherwise
(`trajmesh.config.RunConfig`), and its grader kind, ``open_ended``, is `JudgeOnly`, which refuses to
score, so a trajectory that reached it anyway ends INFRA_FAILURE (a broken grader) and never gets a
reward. Its held-out split is judged by the grader service like its training samples (the evaluator
service); in-process evaluation (``eval.in_mesh: false``) has no judge and is refused for it.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from trajmesh.config import SourceConfig
from trajmesh.envs.base import SingleAnswerEnv
from trajmesh.plugins import SourcePlugin

TEMPLATES = ("Write one short sentence about {topic}.",)
TOPICS = (
    "the sea", "a rainy day", "your favourite food", "the moon", "a busy city", "an old tree", "winter",
    "a good friend", "the desert", "a train journey", "coffee", "a quiet library", "the mountains", "a cat",
    "a dog", "music", "the first day of school", "a thunderstorm", "a market", "the night sky", "a river",
    "a garden", "bread", "a bicycle", "the wind", "a lighthouse", "a birthday", "snow", "a forest",
    "the sun", "a museum", "a bridge", "an island", "a kitchen", "the autumn", "a song", "a map",
    "a candle", "a farm", "the ocean floor", "a clock", "a volcano", "a letter", "a park bench",
    "a football match", "a mountain lake", "a window", "a teacher",
)
"""The built-in generator's topics (48): with the one default template, 48 prompts."""


class OpenEndedSource(SourceConfig):
    """Open-ended prompts, no gold answer, no program verifier (this module): only a judge scores them."""

    type: Literal["open_ended"] = "open_ended"
    """Selects this source: open-ended prompts scored by the judge (`judge.sources` must name it)."""
    name: str = "open_ended"
    """Source name recorded on every task and trajectory."""
    templates: list[str] = Field(default_factory=lambda: list(TEMPLATES))
    """The built-in generator's prompt templates; ``{topic}`` is filled with each of `topics`."""
    topics: list[str] = Field(default_factory=lambda: list(TOPICS))
    """The built-in generator's topics (the default: 48 everyday subjects)."""
    prompts_file: str | None = None
    """A JSONL file of prompts, one ``{"prompt": "..."}`` object per line (prompt only: no answer),
    used instead of the built-in generator. Every process that draws tasks (store, grader,
    evaluator, the launcher's audit) reads it: give a path they all see."""

    @field_validator("templates")
    @classmethod
    def _one_topic_each(cls, templates: list[str]) -> list[str]:
        if not templates or any("{topic}" not in t for t in templates):
            raise ValueError("open_ended templates: each needs a {topic} field")
        return templates


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a JSONL file in order, duplicates dropped (the first kept), blank lines skipped.
    A line that is not an object with exactly a non-empty string ``prompt`` is an error naming it."""
    out: dict[str, None] = {}
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"open_ended prompts_file {str(p)!r}: no such file")
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}:{n}: not JSON ({exc})") from None
        if not isinstance(row, dict) or set(row) != {"prompt"} or not isinstance(row["prompt"], str) \
                or not row["prompt"].strip():
            raise ValueError(f"{p}:{n}: an open-ended prompt line is {{\"prompt\": \"<text>\"}} and nothing else "
                             f"(there is no gold answer), got {line[:120]!r}")
        out.setdefault(row["prompt"], None)
    if not out:
        raise ValueError(f"open_ended prompts_file {str(p)!r} holds no prompt")
    return list(out)


def pool(src: OpenEndedSource) -> list[str]:
    """Every prompt the source can draw, in a fixed order: the file's, else templates x topics."""
    if src.prompts_file:
        return read_prompts(src.prompts_file)
    return list(dict.fromkeys(t.replace("{topic}", topic) for t in src.templates for topic in src.topics))


def task_id(source: str, prompt: str) -> str:
    return hashlib.sha256(f"{source}|open_ended|{prompt}".encode()).hexdigest()[:16]


def draw(src: OpenEndedSource, seed: int, n: int, exclude: set[str]) -> list[dict[str, Any]]:
    """Up to ``n`` tasks (fewer when the pool runs out), the pool shuffled by ``seed``, prompts in
    ``exclude`` skipped (`trajmesh.plugins.SourcePlugin.draw`)."""
    prompts = pool(src)
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order:
        if prompts[i] in exclude:
            continue
        out.append({"prompt": prompts[i], "answer": "", "task_id": task_id(src.name, prompts[i]),
                    "metadata": {"source": src.name, "grader": "open_ended", "environment": "open_ended",
                                 "seed": seed, "index": i}})
        if len(out) == n:
            break
    return out


class NoProgramVerifier(RuntimeError):
    """An open-ended task reached a program grader: there is none (the judge scores it)."""


class JudgeOnly:
    """The grader kind of open-ended tasks: it refuses to score (`NoProgramVerifier`). The grader
    service asks the judge instead for every source `judge.sources` names, which the config makes
    every open-ended source; a trajectory that reaches this class anyway is an infrastructure
    failure (graders/base.py `grade_sample`: the task has no gold answer to try), never a reward."""

    revision = "open_ended-judge-only-v1"
    components: tuple[str, ...] = ()

    def grade(self, sample: Any, task: dict[str, Any]) -> Any:
        raise NoProgramVerifier(
            f"source {task.get('source', '?')!r} is open-ended: it has no program verifier, only the judge "
            "scores it (name it in judge.sources; held-out evaluation through the evaluator service)")


PLUGIN = SourcePlugin(
    type="open_ended", config=OpenEndedSource, draw=draw,
    environments={"open_ended": SingleAnswerEnv}, graders={"open_ended": JudgeOnly},
    default_environment="open_ended", reward_from="judge",
    description="open-ended prompts (built-in or a JSONL file), no gold answer: scored by the judge only")
