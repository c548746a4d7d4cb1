"""The run manifest id: stable under the same settings, different under any change."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from trajmesh.run.manifest import (
    build_manifest,
    canonical_json,
    code_commit,
    compute_manifest_id,
    config_sha256,
)


def _build_settings(**overrides: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "code_commit": "0" * 40,
        "config": {"learner": {"lr": 1e-6, "batch_size": 64}, "seed": 1},
        "model_revision": "Qwen/Qwen3-0.6B@abc",
        "tokenizer_revision": "Qwen/Qwen3-0.6B@abc",
        "chat_template": "{{ messages }}",
        "environment_revisions": {"chain_sum": "1", "python": "2"},
        "grader_revisions": {"exact_match": "1"},
        "algorithm": {"loss": "grpo", "max_staleness": 4},
        "created_unix_seconds": 1000.0,
    }
    settings.update(overrides)
    return settings


def test_same_settings_give_same_id_whenever_created() -> None:
    first = build_manifest(**_build_settings())
    again = build_manifest(**_build_settings(created_unix_seconds=2000.0))
    assert first.manifest_id == again.manifest_id
    assert len(first.manifest_id) == 64 and int(first.manifest_id, 16) >= 0
    assert compute_manifest_id(first) == first.manifest_id


def test_key_order_does_not_matter() -> None:
    reordered = _build_settings(
        config={"seed": 1, "learner": {"batch_size": 64, "lr": 1e-6}},
        environment_revisions={"python": "2", "chain_sum": "1"},
        algorithm={"max_staleness": 4, "loss": "grpo"},
    )
    assert build_manifest(**reordered).manifest_id == build_manifest(**_build_settings()).manifest_id


@pytest.mark.parametrize(
    "override",
    [
        {"code_commit": "1" * 40},
        {"config": {"learner": {"lr": 2e-6, "batch_size": 64}, "seed": 1}},
        {"config": {"learner": {"lr": 1e-6, "batch_size": 64}, "seed": 1, "extra": None}},
        {"model_revision": "Qwen/Qwen3-0.6B@def"},
        {"tokenizer_revision": "Qwen/Qwen3-0.6B@def"},
        {"chat_template": "{{ messages }} "},
        {"environment_revisions": {"chain_sum": "1", "python": "3"}},
        {"environment_revisions": {"chain_sum": "1"}},
        {"grader_revisions": {"exact_match": "2"}},
        {"algorithm": {"loss": "grpo", "max_staleness": 5}},
    ],
    ids=lambda o: next(iter(o)),
)
def test_any_change_gives_a_new_id(override: dict[str, Any]) -> None:
    assert (
        build_manifest(**_build_settings(**override)).manifest_id
        != build_manifest(**_build_settings()).manifest_id
    )


def test_editing_a_built_manifest_changes_its_content_hash() -> None:
    manifest = build_manifest(**_build_settings())
    manifest.grader_revisions["exact_match"] = "9"
    assert compute_manifest_id(manifest) != manifest.manifest_id


def test_config_hash_is_sha256_of_sorted_compact_json() -> None:
    expected = hashlib.sha256(b'{"a":[1,2.5],"b":{"c":"\xc3\xa9","d":true}}').hexdigest()
    assert config_sha256({"b": {"d": True, "c": "é"}, "a": [1, 2.5]}) == expected


def test_canonical_json_refuses_nan_and_unknown_types() -> None:
    with pytest.raises(ValueError):
        canonical_json({"lr": float("nan")})
    with pytest.raises(TypeError):
        canonical_json({"path": Path("/tmp")})


def test_code_commit_reads_head(tmp_path: Path) -> None:
    assert code_commit(tmp_path) == "unknown"  # not a git checkout
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    # A throwaway repository under tmp_path, isolated from the user's git configuration.
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    ident = ["-c", "user.name=test", "-c", "user.email=test@example.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, env=env, check=True)
    subprocess.run(
        ["git", *ident, "commit", "-q", "--allow-empty", "-m", "x"], cwd=tmp_path, env=env, check=True
    )
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tmp_path, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()
    assert code_commit(tmp_path) == head and len(head) == 40


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_run_manifest_hashes_the_chat_template_wherever_the_model_keeps_it(tmp_path: Path, where: str) -> None:
    """transformers 5 writes the template to chat_template.jinja (SmolLM2 as `make models` imports
    it), not into tokenizer_config.json: the manifest hashes the template the rollout renders."""
    import json

    from trajmesh.config import load_config
    from trajmesh.run.train import _write_manifest

    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    model = tmp_path / "model"
    model.mkdir()
    tok_cfg = {"eos_token": "<|im_end|>"}
    if where == "tokenizer_config.json":
        tok_cfg["chat_template"] = template
    else:
        (model / where).write_text(template)
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    cfg = load_config(overrides={"model.path": str(model), "run_dir": str(tmp_path / "run"),
                                 "tasks.heldout_size": 2})
    (tmp_path / "run").mkdir()
    _write_manifest(cfg)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["chat_template_sha256"] == hashlib.sha256(template.encode()).hexdigest()
