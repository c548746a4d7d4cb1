"""Normalized exact match for the search environment (Search-R1's reward), with an audit (no torch)."""

from __future__ import annotations

import re
import string
from typing import Any

from trajmesh.envs.base import last_tag
from trajmesh.graders.base import Grade, Sample


def normalize(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace (SQuAD-style)."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


class SearchGrader:
    revision = "search-em-v1"
    components = ("exact_match", "format_answer", "searches")

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        answer = last_tag(sample.text, "answer")
        gold = str(task["answer"])
        em = answer is not None and normalize(answer) == normalize(gold)
        audit: dict[str, float] = {}
        if answer is not None:  # consistent renaming of the gold entity in both: EM must not change
            alias = normalize("Zz" + gold[::-1])
            renamed = normalize(answer).replace(normalize(gold), alias) if normalize(gold) else normalize(answer)
            audit["search_rename_invariant"] = float((renamed == alias) == em)
        components = {"exact_match": float(em), "format_answer": float(answer is not None),
                      "searches": float(sample.text.count("<search>"))}
        return Grade(float(em), components, f"answer={answer!r} expected={gold!r}", self.revision, audit)
