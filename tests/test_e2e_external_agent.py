"""An external agent (examples/openai_agent.py, the official `openai` client and a tool loop) trains
a few learner steps through the real mesh: the rollout serves the agent endpoint, runs the agent in
its own process per sample, and publishes the session as one trajectory (every segment in it).

Checked in the archive: exact accounting (every admitted trajectory ends as exactly one final
outcome, nothing trained twice, every trained token's lag within η, the gate's counters reconcile),
and the masks: the prompt (the chat template's rendering of the agent's messages) is masked 0, every
sampled span is masked 1, and every masked-out token after the first sampled one is text the model
did not generate (the template's framing / tool results), version -1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mesh_checks import check_archive, check_gate_reconciles, check_no_stale, write_manifest

from trajmesh.config import RunConfig, load_config
from trajmesh.run.launcher import accounting, start_mesh
from trajmesh.run.run_end import end_run
from trajmesh.run.train import read_metrics
from trajmesh.tasks import load_split

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
pytest.importorskip("openai")

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
SOURCE = {"type": "external_agent", "agent": "openai_agent:solve", "python_path": [EXAMPLES], "budget_s": 120,
          "knobs": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
STEPS = 3


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from chatml_model import build_chatml_model

    root = tmp_path_factory.mktemp("agent-model")
    cfg = load_config(None, {"tasks.sources": [SOURCE]})
    texts = [t.prompt for t in load_split(cfg.tasks.sources[0], 30, 5)[0]] * 4
    return str(build_chatml_model(root / "model", texts, max_positions=1024))


def _train_through_the_mesh(tmp_path: Path, model_dir: str, source: dict[str, Any], steps: int
                            ) -> tuple[RunConfig, list[dict[str, Any]]]:
    """The whole mesh on one external-agent source until the learner's `steps`; exact accounting,
    no stale, gate = archive. The run's config and archive rows."""
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": model_dir, "gate.eta": 1,
        "tasks.sources": [source], "tasks.group_size": 2, "tasks.train_size": 30, "tasks.heldout_size": 5,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 2, "rollout.agent_endpoint.max_tokens": 24,
        "grader.replicas": 1, "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": steps,
        "learner.checkpoint_every": steps,
    })
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        learner = next(p for p in mesh.procs if p.name == "learner")
        assert learner.popen.wait(timeout=360) == 0, learner.log_path.read_text()[-3000:]
        assert end_run(mesh) == 0
        acct = accounting(mesh.cfg)
        rows = check_archive(mesh.cfg, acct, eta=1)
        check_no_stale(acct)
        check_gate_reconciles(mesh.cfg, rows)
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    return cfg, rows


def test_example_agent_trains_through_the_mesh(tmp_path: Path, chat_model_dir: str) -> None:
    cfg, rows = _train_through_the_mesh(tmp_path, chat_model_dir, SOURCE, STEPS)
    steps = [m for m in read_metrics(Path(cfg.run_dir)) if m.get("kind") == "learner_step"]
    assert [m["version"] for m in steps] == list(range(1, STEPS + 1))
    from trajmesh.tokenizer import load_tokenizer

    tok = load_tokenizer(chat_model_dir)
    accepted = [r for r in rows if r["outcome"] == "accepted"]
    # one trajectory per sample, named <task id>-<sample> (not a session segment's <sid>-s<k>-<reason>)
    assert accepted and all(r["trajectory_id"] == f"{r['task_id']}-{r['trajectory_id'].rsplit('-', 1)[1]}"
                            and r["trajectory_id"].rsplit("-", 1)[1] in ("0", "1") for r in accepted)
    for r in accepted:
        ids, mask, versions = list(r["token_ids"]), list(r["loss_mask"]), list(r["behavior_versions"])
        first = mask.index(1)
        prompt = tok.tokenizer.decode(ids[:first], skip_special_tokens=False)
        assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n"), prompt
        assert all(v == -1 for v, m in zip(versions, mask, strict=True) if not m)
        assert all(v >= 0 for v, m in zip(versions, mask, strict=True) if m)


EDITING_AGENT = '''
from openai import OpenAI
from openai_agent import solve


def solve_then_edit_history(task, base_url, api_key):
    """The example's tool loop, then one call on a rewritten history: a second segment."""
    answer = solve(task, base_url, api_key)
    OpenAI(base_url=base_url, api_key=api_key, timeout=300).chat.completions.create(
        model=task["model"], messages=[{"role": "user", "content": task["prompt"]},
                                  {"role": "assistant", "content": "I will not use tools."},
                                  {"role": "user", "content": "Why?"}], temperature=0, max_tokens=4)
    return answer
'''


def test_agent_that_edits_history_trains_every_segment(tmp_path: Path, chat_model_dir: str) -> None:
    """Every sample's trajectory holds two sequences (the tool loop, then the edited call, which
    opens with its own prompt, masked 0); the store and the learner take them with exact accounting."""
    (tmp_path / "edit_agent.py").write_text(EDITING_AGENT)
    source = {**SOURCE, "agent": "edit_agent:solve_then_edit_history", "python_path": [str(tmp_path), EXAMPLES]}
    cfg, rows = _train_through_the_mesh(tmp_path, chat_model_dir, source, 2)
    steps = [m for m in read_metrics(Path(cfg.run_dir)) if m.get("kind") == "learner_step"]
    assert [m["version"] for m in steps] == [1, 2]
    from trajmesh.tokenizer import load_tokenizer

    tok = load_tokenizer(chat_model_dir)
    trained_ids = {r["trajectory_id"] for r in rows if r["outcome"] == "trained"}
    trained = [r for r in rows if r["outcome"] == "accepted" and r["trajectory_id"] in trained_ids]  # with tokens
    assert trained and len(trained) == len(trained_ids)
    for r in trained:
        ids, mask = list(r["token_ids"]), list(r["loss_mask"])
        last = max(i for i, m in enumerate(mask) if m == 0 and i < len(mask) - 1 and mask[i + 1] == 1)
        earlier = [i for i in range(last + 1) if mask[i] == 1]
        assert earlier, "the tool loop's segment is missing"  # (only the final segment was kept before)
        start = earlier[-1] + 1  # the edited call's prompt
        assert list(r["sequence_starts"]) == [0, start], r["sequence_starts"]  # the archive keeps the segments
        prompt = tok.tokenizer.decode(ids[start:last + 1], skip_special_tokens=False)
        # it is a whole conversation of its own (not a continuation), masked 0, before its answer
        assert prompt.startswith("<|im_start|>") and "I will not use tools." in prompt, prompt
        assert prompt.endswith("Why?<|im_end|>\n<|im_start|>assistant\n"), prompt
