"""The run manifest (docs/DESIGN.md §2, survey §11.1): everything that decides what a run trains on.

Frozen at start; its `manifest_id` is stamped on every task and trajectory. The id is the sha256 of a
canonical JSON (sorted keys, no whitespace) of every `RunManifest` field except `manifest_id` and
`created_unix_seconds`, so two runs with the same settings share an id and any change gives a new
one. The id is computed from the proto's field list, so a field added to the proto later is hashed
without touching this module.

Imports without torch (STYLE.md habit 6).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trajmesh.v1 import trajectory_pb2

# Fields that describe the manifest itself rather than the run's settings.
_NOT_HASHED = frozenset({"manifest_id", "created_unix_seconds"})

_REPO_ROOT = Path(__file__).resolve().parents[2]


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace; NaN/inf and non-JSON types raise (ValueError/TypeError)."""
    if hasattr(value, "model_dump"):  # a pydantic config model
        value = value.model_dump(mode="json")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def config_sha256(config: Mapping[str, Any] | Any) -> str:
    """sha256 of the canonical JSON of a config dict (or pydantic model): key order does not matter."""
    return sha256_hex(canonical_json(config))


def code_commit(repo_dir: str | Path | None = None) -> str:
    """`git rev-parse HEAD` of `repo_dir` (default: this checkout), or "unknown" outside a git checkout."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=repo_dir if repo_dir is not None else _REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.strip() or "unknown"


FRAMEWORKS = ("torch", "transformers", "deepspeed", "sglang", "tokenizers", "reasoning_gym", "math-verify",
              "protobuf", "grpcio", "nats-py", "redis")
"""Distributions whose versions go in the manifest when installed (sglang only where it is)."""


def framework_versions(names: tuple[str, ...] = FRAMEWORKS) -> dict[str, str]:
    """{distribution: version} of every installed one of `names` (package metadata; nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out


def engine_server_version(url: str, timeout_s: float = 5.0) -> str:
    """The `version` an SGLang-API inference server reports on `/get_server_info` (the external
    SGLang server's own release, which the trainer's environment may not have installed);
    "unreachable" when it does not answer."""
    from trajmesh.rollout.engines.engine_client import reported_version

    return reported_version(url, "/get_server_info", timeout_s)


def tree_is_dirty(repo_dir: str | Path | None = None) -> bool:
    """True when tracked files differ from HEAD (`git status --porcelain --untracked-files=no`);
    False outside a git checkout (then `code_commit` is "unknown" and says so)."""
    try:
        result = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=repo_dir if repo_dir is not None else _REPO_ROOT,
                                capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return bool(result.stdout.strip())


def truncation_policy(cfg: Any) -> dict[str, Any]:
    """What a truncated trajectory (MAX_TOKENS / MAX_TURNS) is trained with (`learner.truncation`:
    keep is the reward its grader gave it), and the budgets; `truncation_ratio_max` may stop the run."""
    sp = cfg.tasks.sampling
    trunc = cfg.learner.truncation
    max_length, cache_length = trunc.lengths(sp)
    shaping = {"dapo_max_length": max_length, "dapo_cache_length": cache_length} if trunc.policy == "dapo_soft" else {}
    return {"policy": trunc.policy, **shaping, "max_new_tokens_per_turn": sp.max_new_tokens, "max_turns": sp.max_turns,
            "truncated_terminal_reasons": ["MAX_TOKENS", "MAX_TURNS"],
            # the key keeps the rules' former name: the manifest is hashed (manifest_id), and a resumed
            # run written before the rename must keep its id
            "stop_gate_truncation_ratio_max": cfg.learner.stop_rules.truncation_ratio_max}


def _hashed_fields(manifest: trajectory_pb2.RunManifest) -> dict[str, Any]:
    """The manifest's content as plain JSON values, every field except _NOT_HASHED."""
    out: dict[str, Any] = {}
    for field in manifest.DESCRIPTOR.fields:
        if field.name in _NOT_HASHED:
            continue
        value = getattr(manifest, field.name)
        if isinstance(value, (str, int, float, bool)):
            out[field.name] = value
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = dict(value)
        else:
            # A repeated or message field was added to RunManifest: decide how it hashes here.
            raise TypeError(f"RunManifest.{field.name}: no canonical form for {type(value).__name__}")
    return out


def compute_manifest_id(manifest: trajectory_pb2.RunManifest) -> str:
    """The content hash a manifest's `manifest_id` must equal."""
    return sha256_hex(canonical_json(_hashed_fields(manifest)))


def build_manifest(
    *,
    code_commit: str,
    config: Mapping[str, Any] | Any,
    model_revision: str,
    tokenizer_revision: str,
    chat_template: str,
    environment_revisions: Mapping[str, str],
    grader_revisions: Mapping[str, str],
    algorithm: Mapping[str, Any] | Any,
    framework_versions: Mapping[str, str] | None = None,
    dirty_tree: bool = False,
    truncation_policy: Mapping[str, Any] | None = None,
    evaluation_protocol: Mapping[str, Any] | None = None,
    created_unix_seconds: float | None = None,
) -> trajectory_pb2.RunManifest:
    """A RunManifest with its content-hash `manifest_id` filled in.

    `config` and `algorithm` are dicts (or pydantic models) of JSON values; the manifest keeps the
    config's hash and the algorithm settings' canonical JSON. `chat_template` is the template text
    (hashed). `truncation_policy` and `evaluation_protocol` (held-out samples, sampling, budgets,
    scorer revisions) are kept as canonical JSON. `created_unix_seconds` defaults to now and is not
    part of the id.
    """
    manifest = trajectory_pb2.RunManifest(
        code_commit=code_commit,
        config_sha256=config_sha256(config),
        model_revision=model_revision,
        tokenizer_revision=tokenizer_revision,
        chat_template_sha256=sha256_hex(chat_template),
        environment_revisions=dict(environment_revisions),
        grader_revisions=dict(grader_revisions),
        algorithm_json=canonical_json(algorithm),
        framework_versions=dict(framework_versions or {}),
        dirty_tree=dirty_tree,
        truncation_policy_json=canonical_json(truncation_policy or {}),
        evaluation_protocol_json=canonical_json(evaluation_protocol or {}),
        created_unix_seconds=time.time() if created_unix_seconds is None else created_unix_seconds,
    )
    manifest.manifest_id = compute_manifest_id(manifest)
    return manifest
