"""chain_sum task source: reasoning-gym's ``chain_sum`` in a compact character format.

A reasoning-gym entry ``"State the final answer ...: 12 + 7 - 3 ="`` / ``"16"`` becomes the prompt
``"12+7-3="`` and the answer ``"16"``; the policy emits the answer followed by EOS. Scoring uses
reasoning-gym's own ``score_answer`` on the original entry, so the reward is the upstream one.

No torch here: the store, grader and environment services import this module.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

SOURCE = "reasoning_gym/chain_sum"

# Vetted demo difficulty (see learner/models.py::prepare_demo_model for the measurements).
DEMO_KNOBS: dict[str, Any] = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
TRAIN_SEED = 1234
HELDOUT_SEED = 98765


def compact_prompt(expression: str) -> str:
    """``"12 + 7 - 3"`` -> ``"12+7-3="``."""
    return expression.replace(" ", "") + "="


def _task_id(seed: int, index: int, knobs: dict[str, Any]) -> str:
    key = f"{SOURCE}|seed={seed}|index={index}|" + ",".join(f"{k}={knobs[k]}" for k in sorted(knobs))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def make_tasks(seed: int, n: int, *, exclude_prompts: set[str] | None = None, **knobs: Any) -> list[dict]:
    """``n`` tasks ``{prompt, answer, task_id, metadata}`` drawn from reasoning-gym with ``seed``.

    ``knobs`` are ChainSumConfig fields (min_terms, max_terms, min_digits, max_digits, ...); unset
    ones take ``DEMO_KNOBS``. Prompts in ``exclude_prompts`` are skipped (the dataset is drawn
    larger as needed), which is how the training split is kept disjoint from the held-out split.
    ``metadata["entry"]`` keeps the original reasoning-gym entry for ``score``.
    """
    knobs = {**DEMO_KNOBS, **knobs}
    exclude = exclude_prompts or set()
    size = max(8, n)
    while True:
        dataset = _create("chain_sum", seed=seed, size=size, **knobs)
        tasks = []
        for index in range(size):
            entry = dataset[index]
            prompt = compact_prompt(entry["metadata"]["expression"])
            if prompt in exclude:
                continue
            tasks.append(
                {
                    "prompt": prompt,
                    "answer": str(entry["answer"]),
                    "task_id": _task_id(seed, index, knobs),
                    "metadata": {
                        "source": SOURCE,
                        "seed": seed,
                        "index": index,
                        "knobs": knobs,
                        "entry": entry,
                    },
                }
            )
            if len(tasks) == n:
                return tasks
        if size > 64 * max(n, 8):
            raise ValueError(f"cannot draw {n} tasks outside the excluded prompts with knobs {knobs}")
        size *= 2


def make_split(
    n_train: int,
    n_heldout: int,
    *,
    train_seed: int = TRAIN_SEED,
    heldout_seed: int = HELDOUT_SEED,
    **knobs: Any,
) -> tuple[list[dict], list[dict]]:
    """(train, held-out) with different seeds and disjoint prompts (asserted).

    Held-out prompts are unique among themselves; training tasks never repeat a held-out prompt.
    """
    assert train_seed != heldout_seed, "the held-out split needs its own seed"
    heldout, seen = [], set()
    for task in make_tasks(heldout_seed, 4 * n_heldout + 64, **knobs):
        if task["prompt"] not in seen:
            seen.add(task["prompt"])
            heldout.append(task)
        if len(heldout) == n_heldout:
            break
    if len(heldout) < n_heldout:
        raise ValueError(f"only {len(heldout)} distinct held-out prompts exist for knobs {knobs}")
    train = make_tasks(train_seed, n_train, exclude_prompts=seen, **knobs)
    assert not {t["prompt"] for t in train} & seen, "train and held-out prompts overlap"
    return train, heldout


def _create(family: str, **kwargs: Any) -> Any:
    """reasoning-gym's dataset, imported on first use: every service loads the task-source
    plug-ins with its config, and reasoning-gym imports sympy and matplotlib (≈ 1.5 s of CPU) that
    only the processes drawing or scoring tasks need."""
    import reasoning_gym

    return reasoning_gym.create_dataset(family, **kwargs)


@functools.cache
def _scorer() -> Any:
    """A chain_sum dataset object, used only for its ``score_answer``."""
    return _create("chain_sum", seed=0, size=1)


def extract_answer(response_text: str) -> str:
    """The answer is the response up to EOS; the caller already stripped special tokens."""
    return response_text.strip()


def score(response_text: str, task: dict) -> float:
    """1.0 for a correct answer, else 0.0 (partial credit as reasoning-gym defines it)."""
    answer = extract_answer(response_text)
    entry = task.get("metadata", {}).get("entry")
    if entry is not None:
        return float(_scorer().score_answer(answer, entry))
    return float(answer == task["answer"])
