"""Any reasoning-gym task family by name, with its own config and its own ``score_answer``. No torch.

A task is entry ``index`` of ``reasoning_gym.create_dataset(family, seed=seed, size=..., **knobs)``;
the grader regenerates that entry from (family, seed, index, knobs) rather than trusting a JSON
round trip of its metadata, and checks the question matches. Difficulty knobs are the family's
config fields (e.g. ``min_terms`` for chain_sum, ``max_n`` for gcd); a mixture across families is
several sources with weights (`tasks.sources`). chain_sum keeps its compact demo format
(`trajmesh.envs.chain_sum`).

The answer format is the source's: the text after the question (`prompt_suffix`) and how the
response is read (`answer`). Both travel in the task metadata (`prompt_suffix`, `answer_read`), so
the grader regenerates the prompt with the same suffix; a task without them (written before they
existed) has the default format.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any, Literal

from pydantic import Field, model_validator

from trajmesh.config import SourceConfig
from trajmesh.envs.base import SingleAnswerEnv
from trajmesh.plugins import SourcePlugin

ANSWER_SUFFIX = "\nAnswer only."
AnswerRead = Literal["exact", "last_integer"]

# An integer; its minus is a sign unless a digit or ")" comes before it (then it is the operator of
# "5-3" or "(4)-3", and "2-3" does not read as -3).
_INTEGER = re.compile(r"-?\d+")
_OPERAND_END = re.compile(r"[\d)]\s*$")


def last_integer(text: str) -> str | None:
    """The last integer in ``text`` as written ("-3", "12"), or None. Only the final number counts, so
    a response cannot hedge by listing candidates ("7 or 8" reads 8), and the response length is capped
    by `tasks.sampling.max_new_tokens`: "3 + 4 = 7" passes on its result, not on its operands."""
    found = list(_INTEGER.finditer(text))
    if not found:
        return None
    m = found[-1]
    number = m.group()
    if number.startswith("-") and _OPERAND_END.search(text[:m.start()]):
        number = number[1:]
    return str(int(number))


class ReasoningGymSource(SourceConfig):
    """A reasoning-gym task family by name (this module), scored by the family's own ``score_answer``."""

    type: Literal["reasoning_gym"] = "reasoning_gym"
    """Selects this source: a reasoning-gym task family."""
    name: str = "chain_sum"
    """Source name recorded on every task and trajectory."""
    family: str = "chain_sum"
    """reasoning-gym task family by name (e.g. chain_sum, gcd, basic_arithmetic); chain_sum keeps its
    compact demo format, every other family is served as single-answer with its own score_answer."""
    knobs: dict[str, Any] = Field(default_factory=dict)
    """Difficulty knobs passed to the family's generator (e.g. min_terms, max_digits)."""
    prompt_suffix: str = ANSWER_SUFFIX
    """Text after the question in the prompt: how the model is asked to answer (a small instruct model
    rarely writes a bare number; " Write the equation with its result." gets "4 - 1 = 3")."""
    answer: AnswerRead = "exact"
    """How the response is read before the family's score_answer: "exact" passes the whole stripped
    response; "last_integer" passes the last integer in it (`last_integer`), for families whose answer
    is an integer."""

    @model_validator(mode="after")
    def _chain_sum_keeps_its_format(self) -> ReasoningGymSource:
        if self.family == "chain_sum" and (self.prompt_suffix != ANSWER_SUFFIX or self.answer != "exact"):
            raise ValueError("chain_sum keeps its compact demo format: no prompt_suffix or answer for it")
        return self


@functools.cache
def _dataset(family: str, seed: int, size: int, knobs_json: str) -> Any:
    """The family's dataset. reasoning-gym is imported here, on first use: every service loads this
    plug-in with its config, and reasoning-gym imports sympy and matplotlib (≈ 1.5 s of CPU) that only
    the processes drawing or scoring tasks need."""
    import reasoning_gym

    return reasoning_gym.create_dataset(family, seed=seed, size=size, **json.loads(knobs_json))


def entry(family: str, seed: int, index: int, size: int, knobs: dict[str, Any]) -> dict[str, Any]:
    return dict(_dataset(family, seed, size, json.dumps(knobs, sort_keys=True))[index])


def make_tasks(family: str, seed: int, n: int, knobs: dict[str, Any], *, source: str,
               exclude: set[str] | None = None, prompt_suffix: str = ANSWER_SUFFIX,
               answer: AnswerRead = "exact") -> list[dict[str, Any]]:
    """``n`` tasks ``{prompt, answer, task_id, metadata}`` (prompts in ``exclude`` skipped). The
    task id covers the answer format only when it is not the default, so existing ids stay."""
    skip = exclude or set()
    size = max(8, 2 * n)
    ds = _dataset(family, seed, size, json.dumps(knobs, sort_keys=True))
    fmt = "" if (prompt_suffix, answer) == (ANSWER_SUFFIX, "exact") else f"|{prompt_suffix!r}|{answer}"
    out = []
    for i in range(size):
        e = ds[i]
        prompt = str(e["question"]) + prompt_suffix
        if prompt in skip:
            continue
        key = f"{source}|{family}|{seed}|{i}|{json.dumps(knobs, sort_keys=True)}{fmt}"
        out.append({"prompt": prompt, "answer": str(e["answer"]),
                    "task_id": hashlib.sha256(key.encode()).hexdigest()[:16],
                    "metadata": {"source": source, "grader": "reasoning_gym", "environment": "reasoning_gym",
                                 "family": family, "seed": seed, "index": i, "size": size, "knobs": knobs,
                                 "prompt_suffix": prompt_suffix, "answer_read": answer}})
        if len(out) == n:
            break
    return out


def score(response_text: str, task: dict[str, Any]) -> float:
    """The family's own ``score_answer`` on the regenerated entry, with the response read as the
    task's metadata says (`ReasoningGymSource.answer`; "exact" when absent). No integer in the
    response under "last_integer" scores 0."""
    m = task["metadata"]
    e = entry(m["family"], int(m["seed"]), int(m["index"]), int(m["size"]), m.get("knobs", {}))
    if str(e["question"]) + m.get("prompt_suffix", ANSWER_SUFFIX) != task["prompt"]:
        raise ValueError(f"task {m['family']}#{m['index']} no longer matches its generator (revision drift)")
    ds = _dataset(m["family"], int(m["seed"]), int(m["size"]), json.dumps(m.get("knobs", {}), sort_keys=True))
    read = m.get("answer_read", "exact")
    if read == "exact":
        return float(ds.score_answer(response_text.strip(), e))
    if read != "last_integer":
        raise ValueError(f"task {m['family']}#{m['index']}: unknown answer read {read!r}")
    number = last_integer(response_text)
    return 0.0 if number is None else float(ds.score_answer(number, e))


def draw(src: ReasoningGymSource, seed: int, n: int, exclude: set[str]) -> list[dict[str, Any]]:
    """The source's task generator (`trajmesh.plugins.SourcePlugin.draw`)."""
    return make_tasks(src.family, seed, n, dict(src.knobs), source=src.name, exclude=exclude,
                      prompt_suffix=src.prompt_suffix, answer=src.answer)


def split(src: ReasoningGymSource, n_train: int, n_heldout: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """chain_sum keeps its compact demo format and its own split (envs/chain_sum.py); other
    families use the generic one (None)."""
    if src.family != "chain_sum":
        return None
    from trajmesh.envs import chain_sum

    return chain_sum.make_split(n_train, n_heldout, **src.knobs)


PLUGIN = SourcePlugin(
    type="reasoning_gym", config=ReasoningGymSource, draw=draw, split=split,
    environments={"chain_sum": SingleAnswerEnv, "single_answer": SingleAnswerEnv, "reasoning_gym": SingleAnswerEnv},
    graders={"reasoning_gym": "trajmesh.graders.reasoning_gym:ReasoningGymGrader"},
    default_environment="chain_sum",
    description="a reasoning-gym task family, one answer, scored by the family's score_answer")
