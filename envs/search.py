"""Local search (Search-R1 style, survey §7.6): a BM25 index over a corpus generated here. No torch.

The corpus is a seeded gazetteer of fictional towns (one passage each: country, river, founder,
year) plus people passages as distractors, so answers cannot come from pretraining. Each turn the
policy either searches, ``<search>query</search>`` (or the native ``search`` tool call, see
envs/base.py), and gets the top-k passages back as ``<information>...</information>`` (plain for a
native call; an observation either way: loss mask 0), or answers,
``<answer>...</answer>``, which ends the episode; the grader scores normalized exact match.
Searches beyond the budget are answered with an error and counted as invalid actions.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import re
from collections import Counter
from typing import Any, Literal

from pydantic import Field

from trajmesh.config import ToolSourceConfig
from trajmesh.envs.base import (
    SingleToolEnv,
    StepResult,
    function_schemas,
    native_instruction,
)
from trajmesh.plugins import SourcePlugin


class SearchSource(ToolSourceConfig):
    """Search-R1 style QA over a generated corpus with BM25 (envs/search.py)."""

    type: Literal["search"] = "search"
    """Selects this source: Search-R1 style QA with BM25 search."""
    name: str = "search"
    """Source name recorded on every task and trajectory (unique across sources)."""
    top_k: int = Field(3, ge=1)
    """Passages returned per search."""
    max_searches: int = Field(3, ge=0)
    """Searches per episode; more are answered 'search budget exhausted'."""
    corpus_size: int = Field(200, ge=10)
    """Towns in the generated corpus (4 questions each)."""
    corpus_seed: int = 7
    """Seed of the generated corpus (the corpus, not the questions, is fixed by it)."""


SYLLABLES = ["ka", "lo", "mi", "ren", "tor", "vel", "sa", "dun", "bri", "hol", "quen", "zor", "ath", "ix", "mor"]
PEOPLE = ["Ilsa", "Oren", "Maro", "Tessa", "Ulric", "Wren", "Yara", "Piet", "Nadia", "Soren"]


def tokenize(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class BM25:
    """Okapi BM25 (k1, b) over whitespace/alphanumeric tokens; ties break by passage index."""

    def __init__(self, passages: list[str], k1: float = 1.2, b: float = 0.75) -> None:
        self.passages = passages
        self.k1, self.b = k1, b
        self.tf = [Counter(tokenize(p)) for p in passages]
        self.len = [sum(c.values()) for c in self.tf]
        self.avg = sum(self.len) / max(1, len(self.len))
        df: Counter[str] = Counter()
        for c in self.tf:
            df.update(c.keys())
        n = len(passages)
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def scores(self, query: str) -> list[float]:
        q = tokenize(query)
        out = []
        for tf, dl in zip(self.tf, self.len, strict=True):
            s = 0.0
            for t in q:
                f = tf.get(t, 0)
                if f:
                    s += self.idf[t] * f * (self.k1 + 1) / (f + self.k1 * (1 - self.b + self.b * dl / self.avg))
            out.append(s)
        return out

    def search(self, query: str, k: int) -> list[int]:
        scores = self.scores(query)
        ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return [i for i in ranked[:k] if scores[i] > 0]


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


@functools.cache
def corpus(size: int = 200, seed: int = 7) -> tuple[tuple[dict[str, str], ...], tuple[str, ...]]:
    """(facts per town, passages): deterministic in (size, seed)."""
    rng = random.Random(f"search-corpus|{seed}")
    countries = sorted({_name(rng, 2) + "ia" for _ in range(12)})
    rivers = sorted({_name(rng, 2) for _ in range(20)})
    towns: dict[str, dict[str, str]] = {}
    while len(towns) < size:
        name = _name(rng, 3)
        if name in towns:
            continue
        towns[name] = {"town": name, "country": rng.choice(countries), "river": rng.choice(rivers),
                       "founder": f"{rng.choice(PEOPLE)} {_name(rng, 2)}", "year": str(rng.randrange(900, 1900))}
    facts = tuple(towns.values())
    passages = [f"{f['town']} is a town in {f['country']} on the {f['river']} river. "
                f"It was founded in {f['year']} by {f['founder']}." for f in facts]
    passages += [f"{f['founder']} was a traveller who lived near the {f['river']} river." for f in facts[: size // 2]]
    return facts, tuple(passages)


@functools.cache
def index(size: int = 200, seed: int = 7) -> BM25:
    return BM25(list(corpus(size, seed)[1]))


QUESTIONS = {"year": "In which year was {town} founded?", "founder": "Who founded {town}?",
             "river": "On which river is {town}?", "country": "In which country is {town}?"}
INSTRUCTION = "Search with <search>q</search>; reply <answer>x</answer>.\n"
TOOLS: dict[str, dict[str, Any]] = {
    "search": {"description": "Search the local corpus (BM25); returns the top passages, numbered.",
               "parameters": {"type": "object", "required": ["query"],
                              "properties": {"query": {"type": "string", "description": "Search words."}}}},
}
NATIVE_INSTRUCTION = native_instruction(TOOLS, "reply <answer>x</answer>.")
"""The instruction line of a task whose source has ``tool_format: native``."""


class SearchEnv(SingleToolEnv):
    revision = "search-bm25-v1"
    config_keys = ("top_k", "max_searches", "corpus_size", "corpus_seed")
    invalid_actions = ("schema", "search_budget")
    """`info.invalid_action` reasons its steps report (the environment service pre-creates their series)."""

    tool, argument, tool_tag, output_tag, action_type = "search", "query", "search", "information", "TOOL_CALL"
    budget_key, budget_reason, budget_text = "max_searches", "search_budget", "search budget exhausted"

    def settings(self, task: dict[str, Any]) -> dict[str, Any]:
        cfg = {**search_settings(), **task.get("metadata", {}).get("search", {})}
        self.index = index(int(cfg["corpus_size"]), int(cfg["corpus_seed"]))
        return cfg

    def call(self, query: str, h: str, *, native: bool) -> StepResult:
        """The top-k passages, inside ``<information>`` unless they go back as a native tool message."""
        hits = self.index.search(query, int(self.cfg["top_k"]))
        body = "\n".join(f"[{n + 1}] {self.index.passages[i]}" for n, i in enumerate(hits)) or "no results"
        obs = body if native else f"<information>\n{body}\n</information>\n"
        return StepResult(obs, False, h, info={
            "action_type": "TOOL_CALL",
            "tool_call": {"name": "search", "request": query, "response": obs, "status": "ok", "latency_s": 0.0,
                          "native": native}})


def make_tasks(seed: int, n: int, *, search: dict[str, Any] | None = None, source: str = "search",
               exclude: set[str] | None = None, tool_format: str = "tags") -> list[dict[str, Any]]:
    cfg = {**search_settings(), **(search or {})}
    facts, _ = corpus(int(cfg["corpus_size"]), int(cfg["corpus_seed"]))
    rng = random.Random(f"search-tasks|{seed}")
    pairs = [(f, k) for f in facts for k in sorted(QUESTIONS)]
    rng.shuffle(pairs)
    out = []
    seen = set(exclude or ())
    for f, k in pairs:
        q = QUESTIONS[k].format(town=f["town"])
        if q in seen:
            continue
        seen.add(q)
        instruction = NATIVE_INSTRUCTION if tool_format == "native" else INSTRUCTION
        out.append({"prompt": instruction + q, "answer": f[k],
                    "task_id": hashlib.sha256(f"{source}|{q}".encode()).hexdigest()[:16],
                    "metadata": {"source": source, "grader": "search", "environment": "search", "search": cfg,
                                 "question": q,
                                 **({"tools": function_schemas(TOOLS)} if tool_format == "native" else {})}})
        if len(out) == n:
            return out
    if not out:  # fewer than n: the sampler cycles through what the corpus holds
        raise ValueError("the search corpus holds no question outside the excluded ones; raise corpus_size")
    return out


def search_settings(src: SearchSource | None = None) -> dict[str, Any]:
    """The search settings a task carries (``metadata.search``), from the source's config (None: its defaults)."""
    src = src or SearchSource()
    return {key: getattr(src, key) for key in SearchEnv.config_keys}


def draw(src: SearchSource, seed: int, n: int, exclude: set[str]) -> list[dict[str, Any]]:
    """The source's task generator (`trajmesh.plugins.SourcePlugin.draw`); ``exclude`` holds whole
    prompts, compared here by question (the instruction line depends on tool_format)."""
    return make_tasks(seed, n, search=search_settings(src), source=src.name,
                      exclude={p.split("\n", 1)[-1] for p in exclude}, tool_format=src.tool_format)


PLUGIN = SourcePlugin(
    type="search", config=SearchSource, draw=draw, environments={"search": SearchEnv},
    graders={"search": "trajmesh.graders.search:SearchGrader"},
    description="Search-R1 style QA over a generated corpus with BM25, normalized exact match")
