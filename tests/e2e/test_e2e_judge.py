"""The judge grader through the real mesh (NATS, Redis, every service a process): a torch engine
serving a judge model scores chain_sum trajectories instead of the program grader (graders/judge.py).

The judge is the mesh tests' demo model after a short SFT on ``<prompt><response>\\nScore:`` →
``1`` / ``0`` (the response right or not); it judges badly (near chance), and sampling it at T = 1
gives varied verdicts, some unreadable. The point is the mechanics:

- every trajectory ends as exactly one final outcome (`check_archive`), and every judged one
  carries the judge's revision and its raw answer in the archive; its reward is the digit the judge
  wrote (read here from the raw answer by hand), never the program grader's;
- a verdict the judge wrote but that does not read as a score ends INFRA_FAILURE with a
  ``judge_error: unparseable`` verifier output, never reward 0;
- a judge that stalls (a socket that never answers) ends every judged trajectory INFRA_FAILURE
  with ``judge_error: timeout``, counted in ``trajmesh_grader_judge_errors_total{reason="timeout"}``,
  while a second, program-graded source trains on;
- without ``judge.urls`` the launcher (and the audit, for its probes) serves the judge itself;
- a pairwise grader SIGKILLed while judging a group loses no member;
- a source with no program verifier (open_ended) trains on the judge alone, and the audit probes
  it through the judge though it has no gold answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from mesh_checks import FINAL_OUTCOMES, train_to_end

from trajmesh.config import RunConfig, load_config
from trajmesh.infra import die_with_parent, free_port
from trajmesh.run.launcher import Mesh
from trajmesh.tasks import load_split

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

RUBRIC = "{prompt}{response}\nScore:"
PAIRWISE_RUBRIC = "{prompt}{response_a}|{response_b}\nWinner:"
STEPS = 3


@pytest.fixture(scope="module")
def judge_model_dir(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo model after 60 SFT steps on right (→ 1) and wrong (→ 0) chain_sum answers, and on
    pairs of a right and a wrong one (→ the right one's letter, lower case: the demo tokenizer has
    no capitals, and the verdict is read case-blind)."""
    from trajmesh.learner.models import sft

    cfg = load_config(None, {})
    train, _ = load_split(cfg.tasks.sources[0], 300, 1)
    rng = random.Random(0)
    data = []
    for t in train:
        right = rng.random() < 0.5
        wrong = str(int(t.answer) + rng.choice([-3, -1, 1, 2, 10]))
        data.append({"prompt": RUBRIC.replace("{prompt}", t.prompt).replace("{response}", t.answer if right else wrong),
                     "answer": "1" if right else "0"})
        a, b = (t.answer, wrong) if right else (wrong, t.answer)
        data.append({"prompt": PAIRWISE_RUBRIC.replace("{prompt}", t.prompt).replace("{response_a}", a)
                     .replace("{response_b}", b), "answer": "a" if right else "b"})  # the demo charset has no capitals
    out = tmp_path_factory.mktemp("judge-model") / "judge"
    sft(tiny_model_dir, data, steps=60, batch_size=32, lr=1e-2, out_dir=out, warmup_steps=10)
    return str(out)


def _wait_health(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    from trajmesh.rollout.engines.base import wait_healthy
    from trajmesh.rollout.engines.engine_client import EngineClient

    async def go() -> None:
        async with EngineClient(url) as client:
            await wait_healthy(client, timeout_s, proc=proc, what=f"judge engine at {url}")

    asyncio.run(go())


@contextmanager
def _judge_server(model_dir: str, log_path: Path) -> Iterator[str]:
    """A torch engine server serving the judge model, stopped by pid."""
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trajmesh.rollout.engines.engine_server", "--model",
                                 model_dir, "--port", str(port), "--host", "127.0.0.1", "--version", "0",
                                 "--threads", "1"], stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent(signal.SIGKILL))  # no orphan if the test dies
    try:
        _wait_health(f"http://127.0.0.1:{port}", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def judge_engine(judge_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The judge for the mesh runs, one server for the module: they only ask it for verdicts (none
    loads weights into it or pauses it), a mesh's verdicts depend on its timing anyway, and a start
    costs a torch import and a model load (8 s of the suite's time per test on 2 cores)."""
    with _judge_server(judge_model_dir, tmp_path_factory.mktemp("judge-engine") / "judge-engine.log") as url:
        yield url


@pytest.fixture
def fresh_judge_engine(judge_model_dir: str, tmp_path: Path) -> Iterator[str]:
    """The judge for the audits, started for the test: an audit's requests go out in a fixed order
    and the server samples (T = 1) from its seed at start, so its verdicts are the same in every run
    only from a fresh server (from the module's one they would depend on the meshes before it)."""
    with _judge_server(judge_model_dir, tmp_path / "judge-engine.log") as url:
        yield url


@pytest.fixture
def stalling_judge() -> Iterator[str]:
    """An address that accepts connections and never answers (a hung judge)."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


def _config(run_dir: Path, model_dir: str, judge: dict[str, Any], sources: list[dict[str, Any]],
            graders: int = 1) -> RunConfig:
    return load_config(None, {
        "run_dir": str(run_dir), "model.path": model_dir, "gate.eta": 1,
        "tasks.sources": sources, "tasks.group_size": 4, "tasks.heldout_size": 4, "tasks.train_size": 200,
        "tasks.sampling.max_new_tokens": 6,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 4, "grader.replicas": graders,
        "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": STEPS,
        "learner.checkpoint_every": STEPS, "judge": judge,
    })


def _run(cfg: RunConfig, during: Callable[[Mesh], None] | None = None,
         ) -> tuple[RunConfig, dict[str, Any], list[dict[str, Any]], str]:
    """`train_to_end` with `during` (the mesh running), and the grader's /metrics once the learner
    is done."""
    metrics: list[str] = []

    def read_grader_metrics(mesh: Mesh) -> None:
        grader = next(p for p in mesh.procs if p.name == "grader")
        with urllib.request.urlopen(f"http://127.0.0.1:{grader.metrics_port}/metrics", timeout=10) as resp:
            metrics.append(resp.read().decode())

    cfg, acct, rows = train_to_end(cfg, during=during, before_end=read_grader_metrics)
    return cfg, acct, rows, metrics[0]


def _counter(metrics: str, name: str, **labels: str) -> float:
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(want + " "))


def test_judge_scores_a_source_through_the_mesh(tmp_path: Path, tiny_model_dir: str, judge_model_dir: str,
                                                judge_engine: str) -> None:
    judge = {"sources": ["chain_sum"], "type": "torch", "urls": [judge_engine], "model_path": judge_model_dir,
             "name": "sft-judge", "rubric": RUBRIC, "max_score": 1, "max_new_tokens": 3, "temperature": 1.0,
             "timeout_s": 10.0, "attempts": 2}
    cfg, acct, rows, metrics = _run(_config(tmp_path / "run", tiny_model_dir, judge, [{"type": "reasoning_gym"}]))

    manifest = json.loads((Path(cfg.run_dir) / "manifest.json").read_text())
    pinned = json.loads(manifest["algorithm_json"])["judge"]
    identity = f"sft-judge@{_sha16(Path(judge_model_dir) / 'model.safetensors')}"
    assert pinned["model_path"] == judge_model_dir and pinned["urls"] == [judge_engine]
    assert pinned["identity"] == identity
    revision = f"judge-pointwise:{identity}"

    accepted = [r for r in rows if r["outcome"] == "accepted"]
    failed = [r for r in rows if r["outcome"] == "failed_infra"]
    assert accepted
    for r in accepted:  # every judged trajectory: the judge's revision, its raw answer, its digit as reward
        assert r["grader_revision"] == revision, r["grader_revision"]
        verdict = json.loads(r["verifier_output"])
        assert verdict["judge"] == revision.split(":", 1)[1] and verdict["mode"] == "pointwise"
        digit = verdict["raw"].strip()  # the rubric ends in "Score:", so the answer is the number
        assert digit in ("0", "1"), verdict["raw"]
        assert r["reward"] == float(digit) and dict(r["reward_components"]) == {"judge_score": float(digit)}
    for r in failed:  # nothing failed but unreadable verdicts: the engine answered every request
        assert r["verifier_output"].startswith("judge_error: unparseable"), r["verifier_output"]
        raw = json.loads(r["verifier_output"].split(" raw=", 1)[1]) if " raw=" in r["verifier_output"] else ""
        assert raw.strip() not in ("0", "1"), raw
        assert r["terminal_reason"] == "INFRA_FAILURE" and r["reason"] == "infra_grader", r
    rewards = {r["reward"] for r in accepted}
    assert rewards == {0.0, 1.0}, rewards  # a T = 1 judge gives both verdicts
    assert _counter(metrics, "trajmesh_grader_judge_requests_total", result="ok") >= len(accepted) + len(failed)
    assert _counter(metrics, "trajmesh_grader_judge_errors_total", reason="unparseable") == len(failed)
    print(f"judged: {len(accepted)} scored (mean {sum(r['reward'] for r in accepted) / len(accepted):.2f}), "
          f"{len(failed)} unreadable verdicts; outcomes {acct['outcomes']}")


def test_a_stalled_judge_ends_its_trajectories_as_infra_failures(tmp_path: Path, tiny_model_dir: str,
                                                                 stalling_judge: str) -> None:
    judge = {"sources": ["judged"], "type": "sglang", "urls": [stalling_judge], "revision": "stalled",
             "timeout_s": 0.5, "attempts": 2}
    sources = [{"type": "reasoning_gym"}, {"type": "reasoning_gym", "name": "judged", "weight": 0.5}]
    cfg, acct, rows, metrics = _run(_config(tmp_path / "run", tiny_model_dir, judge, sources))

    judged = [r for r in rows if r["task_source"] == "judged" and r["outcome"] in ("accepted", "failed_infra")]
    assert judged, acct
    for r in judged:  # not one reward from a judge that never answered
        assert r["outcome"] == "failed_infra" and r["terminal_reason"] == "INFRA_FAILURE", r
        assert r["verifier_output"].startswith("judge_error: timeout"), r["verifier_output"]
        assert r["reason"] == "infra_grader", r
    source_of = {r["trajectory_id"]: r["task_source"] for r in rows if r["outcome"] == "accepted"}
    trained = [source_of[r["trajectory_id"]] for r in rows if r["outcome"] == "trained"]
    assert trained and set(trained) == {"chain_sum"}, set(trained)  # the program-graded source trains on
    assert _counter(metrics, "trajmesh_grader_judge_errors_total", reason="timeout") == len(judged)
    assert _counter(metrics, "trajmesh_grader_judge_requests_total", result="timeout") == 2 * len(judged)


def test_pairwise_judge_compares_each_group_in_a_circle(tmp_path: Path, tiny_model_dir: str, judge_model_dir: str,
                                                        judge_engine: str) -> None:
    """Two graders share TRAJ_RAW, so a group's members reach both: they are parked in Redis until
    the group is whole (graders/judge_groups.py), then judged in G calls."""
    judge = {"sources": ["chain_sum"], "mode": "pairwise", "type": "torch", "urls": [judge_engine],
             "model_path": judge_model_dir, "name": "sft-judge", "pairwise_rubric": PAIRWISE_RUBRIC,
             "max_new_tokens": 3, "temperature": 1.0, "timeout_s": 10.0, "attempts": 2}
    cfg, acct, rows, _ = _run(_config(tmp_path / "run", tiny_model_dir, judge, [{"type": "reasoning_gym"}], graders=2))

    accepted = [r for r in rows if r["outcome"] == "accepted"]
    failed = [r for r in rows if r["outcome"] == "failed_infra"]
    assert accepted
    by_group: dict[str, list[dict[str, Any]]] = {}
    for r in accepted:
        assert r["grader_revision"].startswith("judge-pairwise:sft-judge@"), r["grader_revision"]
        by_group.setdefault(r["group_id"], []).append(r)
    for gid, members in by_group.items():
        verdicts = [json.loads(r["verifier_output"]) for r in members]
        n = verdicts[0]["members"]
        assert n == 4 == len(members), (gid, n, len(members))  # G = 4, all judged together
        assert sorted(v["member"] for v in verdicts) == list(range(n))
        calls = {(c["a"], c["b"]): c for v in verdicts for c in v["comparisons"]}
        assert sorted(calls) == [(0, 1), (1, 2), (2, 3), (3, 0)]  # n calls in a circle, not n(n-1)/2
        for r, v in zip(members, verdicts, strict=True):  # the reward: comparisons won, read by hand
            mine = [c for c in calls.values() if v["member"] in (c["a"], c["b"])]
            won = sum((c["raw"].strip().upper() == "A") == (c["a"] == v["member"]) for c in mine)
            assert all(c["raw"].strip().upper() in ("A", "B") for c in mine), mine
            assert r["reward"] == won / 2, (r["reward"], mine)
        assert sum(r["reward"] for r in members) == n / 2  # one winner per comparison
    for r in failed:  # a group with an unreadable verdict fails whole; a refill of it comes too late to pair
        assert r["verifier_output"].startswith(("judge_error: unparseable", "judge_error: no_pair")), r
    print(f"pairwise: {len(by_group)} groups judged, {len(failed)} failed; outcomes {acct['outcomes']}")


def test_verifier_audit_probes_the_judge(tmp_path: Path, tiny_model_dir: str, judge_model_dir: str,
                                         fresh_judge_engine: str) -> None:
    """The run-start audit asks the judge itself: a judge at chance (T = 1 over 0 / 1) scores empty,
    garbage or echoed answers high on some of 8 tasks and the run is refused; the same verdicts on
    a 0-10 scale never score high (1/10), so the source passes, with its gold answers reported as
    scored low (a problem, not a refusal)."""
    from trajmesh.run.audit import VerifierAuditRefused, audit_run

    judge = {"sources": ["chain_sum"], "type": "torch", "urls": [fresh_judge_engine], "model_path": judge_model_dir,
             "rubric": RUBRIC, "max_score": 1, "max_new_tokens": 3, "temperature": 1.0}
    cfg = _config(tmp_path / "a", tiny_model_dir, judge, [{"type": "reasoning_gym"}])
    (tmp_path / "a").mkdir()
    with pytest.raises(VerifierAuditRefused, match="chain_sum"):
        audit_run(cfg, tmp_path / "a")
    (record,) = json.loads((tmp_path / "a" / "verifier_audit.json").read_text())["sources"]
    assert record["reward_from"] == "judge" and record["tasks"] == 8, record
    assert sum(record["accepted"].values()) > 0 and record["refused"], record

    cfg = _config(tmp_path / "b", tiny_model_dir, {**judge, "max_score": 10}, [{"type": "reasoning_gym"}])
    (tmp_path / "b").mkdir()
    (audit,) = audit_run(cfg, tmp_path / "b")
    assert audit.reward_from == "judge" and not audit.refused, audit.as_dict()
    assert audit.accepted == {"empty": 0, "garbage": 0, "prompt_echo": 0}
    assert audit.gold_rejected > 0 and audit.problems, audit.as_dict()


WORDS = ("tea", "rain", "glass", "snow", "bread", "maps", "clocks", "wind", "boats", "trees", "birds", "stone",
         "milk", "fire", "salt", "ink", "wool", "sand", "bells", "lamps", "roads", "seeds", "coins", "rope")


def _open_ended_source(tmp_path: Path) -> dict[str, Any]:
    """An open_ended source (envs/open_ended.py) over a JSONL file of 24 prompts in the demo
    model's charset (lower case): no gold answer, no program verifier."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say one thing about {w}."}) + "\n" for w in WORDS))
    return {"type": "open_ended", "name": "notes", "prompts_file": str(path)}


def test_an_open_ended_source_trains_on_the_judge_alone(tmp_path: Path, tiny_model_dir: str, judge_model_dir: str,
                                                        judge_engine: str) -> None:
    """A source with no program verifier: every reward is the judge's digit, every trajectory ends
    as exactly one final outcome (admitted = trained + filtered + quarantined + failed + in flight),
    and none reached the source's grader kind (it refuses to score: a ``verifier error``)."""
    from trajmesh.envs.open_ended import task_id

    judge = {"sources": ["notes"], "type": "torch", "urls": [judge_engine], "model_path": judge_model_dir,
             "name": "sft-judge", "rubric": RUBRIC, "max_score": 1, "max_new_tokens": 3, "temperature": 1.0,
             "timeout_s": 10.0, "attempts": 2}
    cfg, acct, rows, metrics = _run(_config(tmp_path / "run", tiny_model_dir, judge, [_open_ended_source(tmp_path)]))

    outcomes = acct["outcomes"]
    assert acct["admitted"] == sum(outcomes.get(k, 0) for k in FINAL_OUTCOMES), acct
    assert outcomes.get("trained", 0) == STEPS * cfg.batch_trajectories, acct  # zero-variance groups kept
    ids = {task_id("notes", f"say one thing about {w}.") for w in WORDS}
    assert {r["task_id"].split("-c")[0] for r in rows if r["task_id"]} <= ids  # the file's prompts, nothing else
    revision = f"judge-pointwise:sft-judge@{_sha16(Path(judge_model_dir) / 'model.safetensors')}"
    accepted = [r for r in rows if r["outcome"] == "accepted"]
    failed = [r for r in rows if r["outcome"] == "failed_infra"]
    assert accepted and {r["task_source"] for r in rows if r["task_id"]} == {"notes"}
    for r in accepted:  # the judge's digit, read by hand, is the reward
        assert r["grader_revision"] == revision, r["grader_revision"]
        digit = json.loads(r["verifier_output"])["raw"].strip()
        assert r["reward"] == float(digit) and dict(r["reward_components"]) == {"judge_score": float(digit)}, r
    for r in failed:  # an unreadable verdict; never the grader kind that refuses to score
        assert r["verifier_output"].startswith("judge_error: unparseable"), r["verifier_output"]
    assert _counter(metrics, "trajmesh_grader_judge_errors_total", reason="unparseable") == len(failed)
    assert _counter(metrics, "trajmesh_grader_verifier_errors_total") == 0
    print(f"open-ended: {len(accepted)} judged (mean {sum(r['reward'] for r in accepted) / len(accepted):.2f}), "
          f"{len(failed)} unreadable; admitted {acct['admitted']}, outcomes {outcomes}")


def test_the_audit_probes_an_open_ended_source_through_the_judge(tmp_path: Path, tiny_model_dir: str,
                                                                 judge_model_dir: str, fresh_judge_engine: str) -> None:
    """No gold answer is no refusal: the empty, garbage and prompt-echo probes go to the judge on
    every task. At chance over 0 / 1 (T = 1) some probe scores high and the source is refused for
    it, for nothing else; on a 0-10 scale (1/10 at most) none does and it passes."""
    from trajmesh.run.audit import JUDGE_PROBES, VerifierAuditRefused, audit_run

    judge = {"sources": ["notes"], "type": "torch", "urls": [fresh_judge_engine], "model_path": judge_model_dir,
             "rubric": RUBRIC, "max_score": 1, "max_new_tokens": 3, "temperature": 1.0}
    source = _open_ended_source(tmp_path)
    cfg = _config(tmp_path / "a", tiny_model_dir, judge, [source])
    (tmp_path / "a").mkdir()
    with pytest.raises(VerifierAuditRefused, match="notes"):
        audit_run(cfg, tmp_path / "a")
    (record,) = json.loads((tmp_path / "a" / "verifier_audit.json").read_text())["sources"]
    assert record["reward_from"] == "judge" and record["tasks"] == record["gold_missing"] == 8, record
    assert record["refused"] and all(why.startswith("accepts ") for why in record["refused"]), record

    cfg = _config(tmp_path / "b", tiny_model_dir, {**judge, "max_score": 10}, [source])
    (tmp_path / "b").mkdir()
    (audit,) = audit_run(cfg, tmp_path / "b")
    assert audit.tasks == audit.gold_missing == 8 and not audit.refused and not audit.problems, audit.as_dict()
    assert audit.accepted == dict.fromkeys(JUDGE_PROBES, 0)
    assert set(audit.raised) <= set(JUDGE_PROBES), audit.raised  # an unreadable verdict at most, no gold probe


def _sha16(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _niceness(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def test_the_launcher_starts_the_judge_engine(tmp_path: Path, tiny_model_dir: str, judge_model_dir: str) -> None:
    """No ``judge.urls``: the mesh starts a torch engine serving ``judge.model_path`` (niced, as the
    evaluator is), gives the graders its URL, restarts it when it dies and stops it with the run."""
    judge = {"sources": ["chain_sum"], "type": "torch", "model_path": judge_model_dir, "name": "own-judge",
             "rubric": RUBRIC, "max_score": 1, "max_new_tokens": 3, "temperature": 1.0, "nice": 7}
    seen: dict[str, Any] = {}

    def during(mesh: Mesh) -> None:
        engine = mesh.judge_engine
        assert engine is not None and engine.running and engine.popen is not None
        assert mesh.cfg.judge.urls == [engine.url]  # what the graders read (config.resolved.yaml)
        assert load_config(str(mesh.config_path), {}).judge.urls == [engine.url]
        assert _niceness(engine.popen.pid) == min(19, _niceness(os.getpid()) + 7)  # judge.nice
        first = engine.popen
        first.kill()  # a dead judge engine comes back on its port, as NATS and Redis do
        first.wait()
        assert mesh.restart_dead() == [] and engine.running and engine.popen is not first
        seen["engine"] = engine

    cfg, acct, rows, metrics = _run(_config(tmp_path / "run", tiny_model_dir, judge, [{"type": "reasoning_gym"}]),
                                    during)
    assert not seen["engine"].running  # stopped with the run
    assert (Path(cfg.run_dir) / "logs" / "judge-engine.log").is_file()
    accepted = [r for r in rows if r["outcome"] == "accepted"]
    assert accepted
    revision = f"judge-pointwise:own-judge@{_sha16(Path(judge_model_dir) / 'model.safetensors')}"
    for r in accepted:  # judged by the engine the launcher started: its raw digit is the reward
        assert r["grader_revision"] == revision, r["grader_revision"]
        digit = json.loads(r["verifier_output"])["raw"].strip()
        assert r["reward"] == float(digit), r
    for r in rows:
        if r["outcome"] == "failed_infra":  # an unreadable verdict, or both tries while the engine restarted
            assert r["verifier_output"].startswith(("judge_error: unparseable", "judge_error: unavailable")), r
    assert _counter(metrics, "trajmesh_grader_judge_requests_total", result="ok") >= len(accepted)


class HoldingJudge:
    """A proxy before the judge engine: forwards every request, except that it holds the first one
    (its sender's local port in `first_port`, `first_seen` set) until `release` is set."""

    def __init__(self, target: str) -> None:
        import http.server

        self.target, self.requests = target, 0
        lock = threading.Lock()
        self.first_seen, self.release = threading.Event(), threading.Event()
        self.first_port = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    proxy.requests += 1
                    first = proxy.requests == 1
                if first:
                    proxy.first_port = self.client_address[1]
                    proxy.first_seen.set()
                    proxy.release.wait(300)
                req = urllib.request.Request(proxy.target + self.path, data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as resp:
                    data = resp.read()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # its sender was killed

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HoldingJudge:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _pid_owning_port(pids: list[int], port: int) -> int | None:
    """Which of `pids` holds the TCP socket bound to local `port` (/proc/net/tcp and its fds)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port:
            inodes.add(f"socket:[{fields[9]}]")
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) in inodes:
                    return pid
            except OSError:
                continue
    return None


@pytest.mark.slow  # a grader's 30 s redelivery on top of a mesh run: about 2 min on 2 loaded cores
def test_a_grader_killed_mid_group_loses_no_member(tmp_path: Path, tiny_model_dir: str, judge_model_dir: str,
                                                  judge_engine: str) -> None:
    """Pairwise with two graders: the grader that claimed the first whole group is SIGKILLed while
    its judge request is in flight. Its claim stays in Redis; its message is redelivered after the
    ack wait and the group is judged again, by the other grader or the restarted one. Every
    trajectory still ends as exactly one final outcome (`check_archive`), and every group's members
    are judged together, once each."""
    killed: dict[str, Any] = {}
    with HoldingJudge(judge_engine) as proxy:
        judge = {"sources": ["chain_sum"], "mode": "pairwise", "type": "torch", "urls": [proxy.url],
                 "model_path": judge_model_dir, "name": "sft-judge", "pairwise_rubric": PAIRWISE_RUBRIC,
                 "max_new_tokens": 3, "temperature": 0.0, "timeout_s": 10.0, "attempts": 2}

        def during(mesh: Mesh) -> None:
            assert proxy.first_seen.wait(300), "no judge request"
            graders = [p for p in mesh.procs if p.name == "grader"]
            pid = _pid_owning_port([p.popen.pid for p in graders], proxy.first_port)
            assert pid is not None, "no grader holds the judge request's connection"
            victim = next(p for p in graders if p.popen.pid == pid)
            victim.popen.send_signal(signal.SIGKILL)
            killed["rc"], killed["label"] = victim.popen.wait(), victim.label
            killed["restarted"] = [p.label for p in mesh.restart_dead()]  # as `trajmesh train` does
            proxy.release.set()

        cfg = _config(tmp_path / "run", tiny_model_dir, judge, [{"type": "reasoning_gym"}], graders=2)
        cfg, acct, rows, _ = _run(cfg, during)
    assert killed["rc"] == -signal.SIGKILL and killed["restarted"] == [killed["label"]], killed

    graded = Counter(r["trajectory_id"] for r in rows if r["outcome"] in ("accepted", "failed_infra"))
    assert graded and max(graded.values()) == 1, graded.most_common(3)  # graded once, or failed once
    by_group: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["outcome"] == "accepted":
            by_group.setdefault(r["group_id"], []).append(r)
    assert by_group
    for gid, members in by_group.items():  # each judged member once, with the group it was judged in
        verdicts = [json.loads(r["verifier_output"]) for r in members]
        assert sorted(v["member"] for v in verdicts) == list(range(4)), (gid, verdicts)
        assert len({r["trajectory_id"] for r in members}) == 4
    for r in rows:
        if r["outcome"] == "failed_infra":
            assert r["verifier_output"].startswith(("judge_error: unparseable", "judge_error: no_pair")), r
    # the killed claimant's group was asked again: more judge requests than 4 per judged group
    assert proxy.requests > 4 * len(by_group), (proxy.requests, len(by_group))
    print(f"killed {killed['label']} mid-group; {len(by_group)} groups judged, {proxy.requests} judge requests; "
          f"outcomes {acct['outcomes']}")


def test_the_audit_starts_a_judge_engine_of_its_own(tmp_path: Path, tiny_model_dir: str, judge_model_dir: str) -> None:
    """No ``judge.urls``: the run-start audit serves the judge itself for its probes and stops it
    after them. Every probe was answered: one the judge could not score was unreadable (T = 1),
    never unavailable."""
    from trajmesh.run.audit import audit_run

    judge = {"sources": ["chain_sum"], "type": "torch", "model_path": judge_model_dir, "rubric": RUBRIC,
             "max_score": 10, "max_new_tokens": 3, "temperature": 1.0}
    cfg = _config(tmp_path / "a", tiny_model_dir, judge, [{"type": "reasoning_gym"}])
    (tmp_path / "a").mkdir()
    (audit,) = audit_run(cfg, tmp_path / "a")
    assert audit.reward_from == "judge" and audit.tasks == 8 and not audit.error, audit.as_dict()
    assert all(why.startswith("unparseable") for why in audit.raised.values()), audit.raised
    assert audit.accepted == {"empty": 0, "garbage": 0, "prompt_echo": 0}
    log_text = (tmp_path / "a" / "logs" / "judge-engine-audit.log").read_text()
    served = re.search(r"torch engine serving .* on 127\.0\.0\.1:(\d+)", log_text)
    assert served, log_text[-2000:]
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", int(served.group(1))), timeout=2):
        pass  # stopped after the probes: nothing listens on its port
