"""On-policy distillation through the real mesh (NATS, Redis, every service a process): a teacher
engine scores every token the student samples, and the student's reverse KL to it falls.

The student is the mesh tests' demo model; the teacher is the same network with its final norm's
weight scaled by 2.5, so its logits are the student's × 2.5 (the student at temperature 0.4: a
sharper teacher sharing the tokenizer). The teacher is a torch engine each rollout process starts
(`distill.teachers[].model_path`), and the learner trains on the teacher's signal alone
(`distill.reward_weight` 0). Checked: every trained trajectory carries the teacher's identity from the
manifest, and its archived teacher log-probs equal the teacher model's own forward over the
archived tokens (recomputed here with transformers); groups a teacher scored are not dropped for
equal rewards; and the learner's reported reverse KL, KL(π_behavior ‖ π_T) over the scored
tokens, is lower over the last steps than over the first.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mesh_checks import learner_steps, train_to_end

from trajmesh.config import load_config

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STEPS, SHARPEN = 16, 2.5
KL = "trajmesh_learner_distill_reverse_kl_nats"


def _sharpened_teacher(student: str, out: Path) -> Path:
    """A copy of the student whose logits are scaled by SHARPEN (final RMSNorm weight × SHARPEN:
    the head is linear after it)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(student, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * SHARPEN
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _teacher_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [0.0, *logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()]


def test_student_reverse_kl_to_its_teacher_falls(tmp_path: Path, tiny_model_dir: str) -> None:
    teacher_dir = _sharpened_teacher(tiny_model_dir, tmp_path / "teacher")
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": tiny_model_dir, "gate.eta": 1,
        "tasks.group_size": 4, "tasks.heldout_size": 8, "tasks.train_size": 400,
        "tasks.sampling.max_new_tokens": 8,
        "distill": {"teachers": [{"source": "chain_sum", "model_path": str(teacher_dir), "name": "sharp"}],
                    "reward_weight": 0.0, "coef": 1.0},
        "rollout.replicas": 1, "rollout.concurrent_tasks": 4, "grader.replicas": 1,
        "learner.engine.type": "torch", "learner.batch_groups": 4, "learner.max_steps": STEPS,
        "learner.checkpoint_every": STEPS, "learner.lr": 3e-3,
    })
    cfg, acct, rows = train_to_end(cfg, timeout_s=500)

    manifest = json.loads((Path(cfg.run_dir) / "manifest.json").read_text())
    (entry,) = json.loads(manifest["algorithm_json"])["distill"]["teachers"]
    identity = entry["identity"]
    assert identity.startswith("sharp@") and len(identity) == len("sharp@") + 16

    intake = {r["trajectory_id"]: r for r in rows if r["outcome"] == "accepted"}
    trained = [intake[r["trajectory_id"]] for r in rows if r["outcome"] == "trained"]
    assert len(trained) >= STEPS * 4 * 4 // 2, len(trained)
    assert {r["teacher"] for r in trained} == {identity}
    for r in trained[:6]:  # the teacher's numbers, recomputed from its weights
        want = _teacher_logprobs(teacher_dir, list(r["token_ids"]))
        got = [lp if m else 0.0 for lp, m in zip(r["teacher_logprobs"], r["loss_mask"], strict=True)]
        assert max(abs(a - (b if m else 0.0)) for a, b, m in zip(got, want, r["loss_mask"], strict=True)) < 1e-4
    assert not acct["by_reason"].get("filtered:zero_variance"), acct["by_reason"]

    kl = [m[KL] for m in learner_steps(cfg) if KL in m]
    assert len(kl) == STEPS, kl
    first, last = sum(kl[:4]) / 4, sum(kl[-4:]) / 4
    print(f"reverse KL to the teacher: first 4 steps {first:.4f} nats, last 4 {last:.4f}; all {kl}")
    assert first > 0 and last < 0.6 * first, kl  # coef 0 (no signal): 0.60 -> 0.64 nats
