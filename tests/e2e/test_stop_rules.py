"""Stop rules (survey §11.4) and the engine-consistency probe (§8.5).

Unit level: every gate is forced by a metric past its bound; verifier disagreement and truncation
are computed from real trajectories; the probe's version-matched difference is hand-checked and is ~0
for a model scoring its own samples. One real mesh run: a gate with an impossible bound stops the
learner after its first step, cleanly (exit 0, checkpoint, stop_reason.json naming the gate).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from trajmesh.config import StopRulesConfig, load_config
from trajmesh.contract import Trajectory
from trajmesh.learner import consistency
from trajmesh.stoprules import (
    RULES,
    TRUNCATED_RATIO,
    VERIFIER_DISAGREEMENT_RATIO,
    batch_health,
    check_stop_rules,
    read_stop_reason,
    stop_record,
    write_stop_reason,
)
from trajmesh.v1 import trajectory_pb2

# A value past each gate's bound, and one inside it.
_BOUNDS = {
    "entropy_min": (0.5, 0.1, 0.9),
    "kl_max": (0.05, 0.2, 0.01),
    "ess_ratio_min": (0.6, 0.3, 0.95),
    "verifier_disagreement_max": (0.1, 0.5, 0.0),
    "truncation_ratio_max": (0.2, 0.8, 0.1),
    "engine_consistency_max_abs_logprob_diff_max": (0.01, 0.5, 1e-4),
}


def _build_traj(tid: str, *, reward: float, components: dict[str, float], terminal: Any = trajectory_pb2.EOS,
                versions: tuple[int, int] = (0, 0)) -> Trajectory:
    t = Trajectory.new(trajectory_id=tid)
    t.append_prompt([1, 5, 6])
    t.append_sampled([7, 2], [-0.5, -0.1], 0)
    t.replace_token_arrays(behavior_versions=[-1, -1, -1, *versions])
    t.finish(terminal)
    t.set_reward(reward, components=components)
    return t


@pytest.mark.parametrize("rule", [r.name for r in RULES])
def test_each_rule_breaches_past_its_bound_only(rule: str) -> None:
    bound, bad, good = _BOUNDS[rule]
    metric = next(r.metric for r in RULES if r.name == rule)
    cfg = StopRulesConfig(**{rule: bound})
    breaches = check_stop_rules({metric: bad}, cfg, step=1)
    assert [b.rule for b in breaches] == [rule]
    assert breaches[0].value == bad and breaches[0].bound == bound and rule in breaches[0].message
    assert check_stop_rules({metric: good}, cfg, step=1) == []
    assert check_stop_rules({metric: math.nan}, cfg, step=1)[0].rule == rule, "NaN is a breach"
    assert check_stop_rules({}, cfg, step=1) == [], "an absent metric is not evaluated"
    assert check_stop_rules({metric: bad}, StopRulesConfig(), step=1) == [], "rules are off by default"
    assert check_stop_rules({metric: bad}, StopRulesConfig(**{rule: bound, "start_after_steps": 5}), step=4) == []


def test_the_former_stop_gates_key_and_files_still_read(tmp_path: Path) -> None:
    """`learner.stop_gates` (the rules' former name) configures the rules, with a warning; a run's
    stop_reason.json written under that name reads as one of the rules'."""
    with pytest.warns(FutureWarning, match="learner.stop_rules"):
        cfg = load_config(None, {"learner.stop_gates.kl_max": 0.5})
    assert cfg.learner.stop_rules.kl_max == 0.5
    (tmp_path / "stop_reason.json").write_text(json.dumps({"reason": "stop_gate", "gates": ["kl_max"], "step": 3}))
    assert read_stop_reason(tmp_path) == {"reason": "stop_rule", "rules": ["kl_max"], "step": 3}


def test_several_gates_breach_together_and_the_record_names_them(tmp_path: Path) -> None:
    cfg = StopRulesConfig(entropy_min=0.5, kl_max=0.1)
    breaches = check_stop_rules({"trajmesh_learner_entropy_nats": 0.1, "trajmesh_learner_kl_k3": 1.0}, cfg, step=3)
    record = stop_record(breaches, step=3, version=3)
    write_stop_reason(tmp_path, record)
    got = read_stop_reason(tmp_path)
    assert got is not None and got["rules"] == ["entropy_min", "kl_max"] and got["step"] == 3
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["kind"] == "stop" and last["rules"] == ["entropy_min", "kl_max"]


def test_batch_health_truncation_and_verifier_disagreement() -> None:
    trajs = [
        _build_traj("ok", reward=1.0, components={"correct": 1.0, "format_eos": 1.0}),
        _build_traj("no-eos", reward=1.0, components={"correct": 1.0, "format_eos": 0.0},
                    terminal=trajectory_pb2.MAX_TOKENS),  # rewarded without the format: disagreement
        _build_traj("wrong", reward=0.0, components={"correct": 0.0, "format_eos": 1.0}),
        _build_traj("both-pass-no-reward", reward=0.0, components={"correct": 1.0, "format_eos": 1.0}),
        _build_traj("other-grader", reward=1.0, components={"tests_passed": 1.0}),  # skipped: no listed component
    ]
    health = batch_health(trajs, ["correct", "format_eos"])
    assert health[TRUNCATED_RATIO] == pytest.approx(1 / 5)
    assert health[VERIFIER_DISAGREEMENT_RATIO] == pytest.approx(2 / 4)
    assert batch_health([], ["correct"]) == {}


def test_version_matched_diff_by_hand() -> None:
    learner_BT = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    behavior_BT = torch.tensor([[0.0, -1.5, -2.1, -9.0]])
    mask_BT = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    versions_BT = torch.tensor([[-1, 4, 4, 3]])  # the last token is stale (v3): excluded
    out = consistency.version_matched_diff(learner_BT, behavior_BT, mask_BT, versions_BT, version=4)
    assert out[consistency.MAX_ABS] == pytest.approx(0.5)
    assert out[consistency.MEAN_ABS] == pytest.approx(0.3)
    assert out[consistency.TOKENS] == 2
    assert consistency.version_matched_diff(learner_BT, behavior_BT, mask_BT, versions_BT, version=7) == {
        consistency.TOKENS: 0.0}


def test_probe_of_a_model_scoring_its_own_samples_is_near_zero(tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from trajmesh.learner.step import build_batch, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    torch.manual_seed(0)
    trajs = []
    for i in range(3):
        t = Trajectory.new(trajectory_id=f"p{i}")
        t.append_prompt([1, 5 + i, 6])
        t.append_sampled([7, 8, 9], [-1.0, -1.0, -1.0], 2)
        trajs.append(t)
    with torch.no_grad():
        logp_BT, _ = token_logprobs(model, build_batch(trajs, 0), 1.0)
    for i, t in enumerate(trajs):  # behavior log-probs = the model's own (as a matched engine would return)
        t.replace_token_arrays(behavior_logprobs=[0.0] * 3 + [float(logp_BT[i, j]) for j in range(3, 6)])
    out = consistency.probe(model, trajs, version=2, pad_id=0, temperature=1.0, max_trajectories=2)
    assert out[consistency.TOKENS] == 6  # two trajectories x three sampled tokens
    assert out[consistency.MAX_ABS] < 1e-5
    t = trajs[0]
    lp_T = t.behavior_logprobs_T.copy()
    lp_T[4] -= 0.25  # an engine that disagrees on one token
    t.replace_token_arrays(behavior_logprobs=lp_T)
    out = consistency.probe(model, trajs, version=2, pad_id=0, temperature=1.0, max_trajectories=2)
    assert out[consistency.MAX_ABS] == pytest.approx(0.25, abs=1e-4)
    assert consistency.probe(model, trajs, version=3, pad_id=0, temperature=1.0, max_trajectories=2) == {
        consistency.TOKENS: 0.0}


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_an_impossible_ess_bound_stops_the_learner_cleanly_after_one_step(tmp_path: Path, tiny_model_dir: str) -> None:
    from trajmesh.run.inspect import inspect_run
    from trajmesh.run.launcher import start_mesh
    from trajmesh.run.run_end import drain
    from trajmesh.run.train import _write_manifest, read_metrics

    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": tiny_model_dir, "gate.eta": 1,
        "tasks.group_size": 4, "tasks.heldout_size": 20, "tasks.train_size": 300, "tasks.sampling.max_new_tokens": 6,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 2, "grader.replicas": 1,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": 50,
        "learner.stop_rules.ess_ratio_min": 1.01,  # ESS / N ≤ 1 always: the gate must fire at step 1
    })
    Path(cfg.run_dir).mkdir(parents=True)
    _write_manifest(cfg)
    run = Path(cfg.run_dir)
    try:
        mesh = start_mesh(cfg)
    except RuntimeError as exc:
        # Groups are buffered before the learner starts, so it may step and stop (exit 0) before the
        # launcher's start-up health poll sees it; start_mesh then reports it and stops the mesh.
        assert "learner-0 exited with 0 during start" in str(exc), str(exc)
    else:
        try:
            learner = next(p for p in mesh.procs if p.name == "learner")
            assert learner.popen.wait(timeout=240) == 0, learner.log_path.read_text()[-3000:]
            assert not [p.label for p in mesh.dead() if p is not learner]
            drain(mesh.cfg, timeout_s=30)
            mesh.stop_services()
        finally:
            mesh.stop_services()
            mesh.stop_infra()
    reason = read_stop_reason(run)
    assert reason is not None and reason["rules"] == ["ess_ratio_min"] and reason["step"] == 1
    records = read_metrics(run)
    assert [r["version"] for r in records if r.get("kind") == "learner_step"] == [1]
    assert [r["rules"] for r in records if r.get("kind") == "stop"] == [["ess_ratio_min"]]
    assert (run / "checkpoints" / "latest").exists()
    assert "stop rule breached" in (run / "logs" / "learner-0.log").read_text()
    assert inspect_run(run)["stop_reason"]["rules"] == ["ess_ratio_min"]
