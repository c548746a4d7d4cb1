"""PRIME in a mesh run (every service a real process, real NATS and Redis): the demo model,
warm-started on chain_sum's one-digit sums and differences, trains on 8 of those prompts with
`learner.advantage.type: prime`. The implicit PRM trains on each batch's outcome labels: its BCE
starts at log 2 (πφ = π_ref) and over the second half of the run its mean is below log 2 by a
margin (a PRM that never steps stays at log 2; one trained against the flipped label gave 0.683). The
trained advantages are PRIME's (they differ from RLOO's on the same batch), both updates are timed,
and the manifest records the recipe. 31 s of call time and 15-23 s for the model on this 2-core
machine. The loss is compared with the best constant guess only in the printed report: in 12 steps
this model's PRM does not learn beyond the label rate (docs/RECIPES.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mesh_checks import learner_steps, train_to_end

from trajmesh.config import load_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STEPS = 12
SFT_STEPS = 300
MARGIN = 0.03
KNOBS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
"""Sums and differences of two digits (200 prompts): the demo model warm-started on them solves
some and misses others, so a batch holds both outcome labels."""


@pytest.fixture(scope="module")
def sums_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo model (learner/models.py: character tokenizer, tiny Llama, SFT) on `KNOBS`."""
    from trajmesh.envs import chain_sum
    from trajmesh.learner.models import build_char_tokenizer, build_tiny_model, sft

    out = tmp_path_factory.mktemp("sums-model")
    build_char_tokenizer(out / "tokenizer")
    build_tiny_model(out / "init", out / "tokenizer", seed=0, hidden=32, layers=1, heads=2)
    train, _ = chain_sum.make_split(1000, 20, **KNOBS)
    sft(out / "init", train, steps=SFT_STEPS, batch_size=32, lr=3e-3, out_dir=out / "sft", seed=0)
    return str((out / "sft").resolve())


def _entropy(p: float) -> float:
    """The BCE of the best constant prediction on labels with a rate p of ones (nats)."""
    return 0.0 if p in (0.0, 1.0) else -(p * math.log(p) + (1 - p) * math.log(1 - p))


def test_the_implicit_prm_learns_the_outcome_label_in_a_mesh_run(tmp_path: Path, sums_model_dir: str) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config(None, {
        "run_dir": str(run_dir), "model.path": sums_model_dir, "mode": "sync", "seed": 3,
        "tasks.sources": [{"type": "reasoning_gym", "name": "chain_sum", "family": "chain_sum", "knobs": KNOBS}],
        "tasks.group_size": 4, "tasks.heldout_size": 20, "tasks.train_size": 8,
        "tasks.sampling.max_new_tokens": 6, "tasks.sampling.temperature": 0.5, "rollout.replicas": 1, "grader.replicas": 1,
        "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 4, "learner.max_steps": STEPS,
        "learner.lr": 1e-5, "learner.warmup_steps": 0, "learner.checkpoint_every": STEPS,
        "learner.advantage.type": "prime", "learner.prime.lr": 1e-3, "learner.prime.beta": 0.5,
    })
    train_to_end(cfg, timeout_s=600)  # and the checks of every healthy run: exact accounting, no stale
    steps = learner_steps(cfg)
    assert [m["version"] for m in steps] == list(range(1, STEPS + 1))
    algorithm = json.loads(json.loads((run_dir / "manifest.json").read_text())["algorithm_json"])
    assert algorithm["learner"]["advantage"]["type"] == "prime"
    assert algorithm["learner"]["prime"]["beta"] == 0.5
    loss = [m["trajmesh_learner_prm_loss"] for m in steps]
    rate = [m["trajmesh_learner_prm_positive_label_ratio"] for m in steps]
    floor = [_entropy(p) for p in rate]
    report = json.dumps({"loss": loss, "constant_guess": floor,
                         "accuracy": [m["trajmesh_learner_prm_accuracy_ratio"] for m in steps],
                         "correct": rate})
    print(report)
    assert 0.0 < sum(rate) / len(rate) < 1.0, report  # both labels occur: there is something to learn
    # At the start πφ = π_ref: every logit 0, the loss log 2.
    assert loss[0] == pytest.approx(math.log(2.0), rel=1e-5), report
    half = STEPS // 2
    assert sum(loss[half:]) / half < math.log(2.0) - MARGIN, report
    # The policy trained with PRIME's advantages, not RLOO's, and both steps were timed.
    assert all(m["advantage_minus_rloo_max_abs"] > 0 for m in steps), report
    assert all(m["trajmesh_learner_prm_step_seconds"] > 0 and m["trajmesh_learner_policy_update_seconds"] > 0
               for m in steps)
