"""The plug-in registry (trajmesh/plugins.py): a task source registered in ONE place (here, in the
test) reaches config loading, task generation, `trajmesh envs`, the environment and grader
services' metric label series, the manifest's revisions and held-out evaluation; and the manifest
records the revisions of the graders the configured sources actually use."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from trajmesh import plugins
from trajmesh.config import ConfigError, SourceConfig, load_config
from trajmesh.envs.base import SingleAnswerEnv
from trajmesh.graders import Grade, Sample

TOY_ENV_REVISION = "toy-env-v7"
TOY_GRADER_REVISION = "toy-grader-v3"


class ToySource(SourceConfig):
    """A test-only source: "a+b=" sums, answered by the sum."""

    type: Literal["toy"] = "toy"
    """Selects this source."""
    name: str = "toy"
    """Source name recorded on every task."""
    offset: int = 0
    """Added to every left operand (a knob the generator must honour)."""


class ToyEnv(SingleAnswerEnv):
    revision = TOY_ENV_REVISION
    invalid_actions = ("toy_reason",)


class ToyGrader:
    revision = TOY_GRADER_REVISION
    components = ("toy_correct",)

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        ok = float(sample.text.strip() == task["answer"])
        return Grade(ok, {"toy_correct": ok}, sample.text, self.revision)


def _draw(src: ToySource, seed: int, n: int, exclude: set[str]) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        a, b = src.offset + seed % 97 + i, i % 5
        prompt = f"{a}+{b}="
        if prompt not in exclude:
            out.append({"prompt": prompt, "answer": str(a + b), "task_id": f"toy-{seed}-{i}",
                        "metadata": {"source": src.name, "grader": "toy", "environment": "toy_env"}})
    return out


@pytest.fixture
def toy() -> Iterator[plugins.SourcePlugin]:
    plugin = plugins.SourcePlugin(type="toy", config=ToySource, draw=_draw,
                                  environments={"toy_env": ToyEnv}, graders={"toy": ToyGrader})
    plugins.register_source(plugin)  # the one registration
    yield plugin
    plugins.unregister_source("toy")


def test_unregistered_type_is_rejected_at_load_naming_the_registered_ones() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"tasks.sources": [{"type": "toy"}]})
    assert "unknown task source type 'toy'" in str(err.value) and "math_tool" in str(err.value)


def test_a_registered_source_reaches_config_tasks_cli_and_services(toy: plugins.SourcePlugin,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(overrides={"tasks.sources": [{"type": "toy", "offset": 40}], "tasks.train_size": 6,
                                 "tasks.heldout_size": 3})
    (src,) = cfg.tasks.sources
    assert isinstance(src, ToySource) and src.offset == 40
    assert cfg.model_dump(mode="json")["tasks"]["sources"][0]["offset"] == 40  # dumped as its own class
    with pytest.raises(ConfigError, match="offset"):
        load_config(overrides={"tasks.sources": [{"type": "toy", "offset": "many"}]})

    from trajmesh.tasks import TaskSampler, load_split

    train, held = load_split(src, 6, 3)
    assert {t.environment for t in train + held} == {"toy_env"}
    assert not {t.prompt for t in train} & {t.prompt for t in held}
    assert all(int(t.prompt.split("+")[0]) >= 40 for t in train + held)  # the knob reached the generator
    task = TaskSampler(cfg.tasks, seed=0).task_at(0)
    assert task.source == "toy" and task.prompt in {t.prompt for t in train}

    from trajmesh.run.cli import main

    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert "ToySource" in out and TOY_ENV_REVISION in out and TOY_GRADER_REVISION in out and "toy_correct" in out

    from trajmesh.services import environment, grader

    env_series = environment.label_series()
    assert ("toy_env",) in env_series["parser_errors"] and ("toy_env", "toy_reason") in env_series["invalid_actions"]
    assert ("toy", "toy_correct") in grader.label_series()["raw_component"]
    assert ("toy", "exception") in grader.label_series()["verifier_errors"]

    from trajmesh.envs.base import make_environment
    from trajmesh.graders import make_grader

    assert isinstance(make_environment("toy_env"), ToyEnv) and isinstance(make_grader("toy"), ToyGrader)


def test_manifest_records_the_toy_sources_revisions(toy: plugins.SourcePlugin, tmp_path: Path) -> None:
    from trajmesh.run.train import _write_manifest, heldout_tasks

    cfg = load_config(overrides={"tasks.sources": [{"type": "toy"}], "tasks.heldout_size": 3,
                                 "run_dir": str(tmp_path)})
    _write_manifest(cfg, heldout_tasks(cfg))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["grader_revisions"] == {"toy": TOY_GRADER_REVISION}
    assert manifest["environment_revisions"] == {"toy_env": TOY_ENV_REVISION}


def test_manifest_records_the_graders_that_run_not_reasoning_gym(tmp_path: Path) -> None:
    from trajmesh.graders.math import MathGrader
    from trajmesh.graders.search import SearchGrader
    from trajmesh.run.train import _write_manifest, heldout_tasks

    cfg = load_config(overrides={"tasks.sources": [{"type": "math_tool"}, {"type": "search"}],
                                 "tasks.heldout_size": 2, "run_dir": str(tmp_path)})
    _write_manifest(cfg, heldout_tasks(cfg))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["grader_revisions"] == {"math": MathGrader.revision, "search": SearchGrader.revision}
    assert set(manifest["environment_revisions"]) == {"math_tool", "search"}


class _CharCodec:
    """One id per character; 0 is EOS."""

    eos_token_id = 0
    bos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if i != 0)


def test_held_out_evaluation_scores_the_toy_source_with_its_own_grader(toy: plugins.SourcePlugin) -> None:
    from trajmesh.learner.evaluate import evaluate_tasks
    from trajmesh.rollout.agents.episode import EpisodeFormat
    from trajmesh.rollout.engines.torch_sampler import Sampled, SamplingParams
    from trajmesh.run.train import heldout_tasks

    cfg = load_config(overrides={"tasks.sources": [{"type": "toy"}], "tasks.heldout_size": 4})
    tasks = heldout_tasks(cfg)["toy"]
    codec = _CharCodec()

    class SumPolicy:
        """Answers a+b= with the sum, right for the first two tasks and off by one for the rest."""

        def generate(self, contexts: list[list[int]], params: SamplingParams) -> list[Sampled]:
            out = []
            for ctx in contexts:
                a, b = codec.decode(ctx).rstrip("=").split("+")
                right = any(t["prompt"] == codec.decode(ctx) for t in tasks[:2])
                ids = codec.encode(str(int(a) + int(b) + (0 if right else 1))) + [0]
                out.append(Sampled(ids, [-1.0] * len(ids), {"type": "stop", "matched": 0}))
            return out

    res = evaluate_tasks(SumPolicy(), EpisodeFormat(codec, None, {0}), tasks, temperature=1.0, samples=1, max_new_tokens=16, max_turns=1)
    assert res["accuracy"] == pytest.approx(0.5)
    assert res["grader_revisions"] == {"toy": TOY_GRADER_REVISION}
    assert res["environment_revisions"] == {"toy_env": TOY_ENV_REVISION}


def test_in_process_evaluation_takes_only_what_the_rollout_plays_in_process(toy: plugins.SourcePlugin) -> None:
    """`eval.in_mesh: false` evaluates in the launcher's process: a plug-in's stateless environment
    with a grader that runs no code is evaluated there; a stateful environment or a sandboxed
    grader is refused with the source and the reason named (the evaluator service plays it)."""
    from trajmesh.run.train import (
        InProcessEvaluationRefused,
        check_in_process,
        heldout_tasks,
        in_process_refusals,
    )

    class StatefulEnv(ToyEnv):
        stateless = False

    class SandboxedGrader(ToyGrader):
        uses_sandbox = True

    plugins.register_source(plugins.SourcePlugin(
        type="played", config=PlayedSource, draw=_draw_played, environments={"played_env": StatefulEnv},
        graders={"sandboxed": SandboxedGrader}))
    try:
        cfg = load_config(overrides={"tasks.sources": [{"type": "toy"}, {"type": "played"}], "tasks.heldout_size": 3})
        held = heldout_tasks(cfg)
        assert in_process_refusals({"toy": held["toy"]}) == []
        check_in_process({"toy": held["toy"]})  # the toy source (stateless, no sandbox) plays here
        refusals = in_process_refusals(held)
        assert refusals == ["played: environment played_env keeps state (the environment service plays it)",
                            "played: grader sandboxed runs code in the sandbox (the grader service grades it)"]
        with pytest.raises(InProcessEvaluationRefused, match=r"eval\.in_mesh: false .*played: environment played_env"):
            check_in_process(held)
    finally:
        plugins.unregister_source("played")


class PlayedSource(SourceConfig):
    """A test-only source with a stateful environment and a sandboxed grader."""

    type: Literal["played"] = "played"
    """Selects this source."""
    name: str = "played"
    """Source name recorded on every task."""


def _draw_played(src: PlayedSource, seed: int, n: int, exclude: set[str]) -> list[dict[str, Any]]:
    return [{"prompt": f"play {seed} {i}", "answer": f"answer {i}", "task_id": f"played-{seed}-{i}",
             "metadata": {"source": src.name, "grader": "sandboxed", "environment": "played_env"}}
            for i in range(n) if f"play {seed} {i}" not in exclude]


# --------------------------------------------------------------------------- rollout engines


def test_unregistered_engine_type_is_rejected_at_load() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"rollout.engine.type": "tensorrt"})
    assert "rollout.engine.type" in str(err.value) and all(t in str(err.value) for t in ("torch", "sglang", "synthetic",
                                                                                        "vllm"))
    with pytest.raises(ConfigError, match=r"rollout\.engine\.url: Field required"):
        load_config(overrides={"rollout.engine.type": "sglang"})


class _Factories:
    """Runs an engine factory as a rollout process would (replica 1 at version 3), with the torch
    server's spawn and the health wait recorded instead of run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **engine: Any) -> None:
        import trajmesh.rollout.engines as engines
        from trajmesh.rollout.engines.base import EngineContext

        cfg = load_config(overrides={f"rollout.engine.{k}": v for k, v in engine.items()} | {"model.path": "/models/m"})
        self.ctx = EngineContext(cfg, 1, "rollout-1-7", vocab_size=50, eos_token_id=2, version=3)
        self.started: list[tuple[str, int, int]] = []
        self.waited: list[Any] = []

        def spawn(cfg: Any, replica: int, model_path: str, version: int, log_path: Path) -> tuple[str, Any]:
            self.started.append((model_path, version, replica))
            return "http://127.0.0.1:9/", None

        async def wait(engine: Any, timeout_s: float, **kwargs: Any) -> float:
            self.waited.append(engine)
            return 0.0

        monkeypatch.setattr(engines, "spawn_torch_server", spawn)
        monkeypatch.setattr(engines, "wait_healthy", wait)

    def start(self) -> Any:
        import asyncio

        return asyncio.run(plugins.load(plugins.engine(self.ctx.cfg.rollout.engine.type).start)(self.ctx))


@pytest.mark.parametrize(("engine", "started", "url"), [
    ({"type": "torch"}, [("/models/m", 3, 1)], "http://127.0.0.1:9"),
    ({"type": "torch", "url": "http://engine:30000"}, [], "http://engine:30000"),
    ({"type": "sglang", "url": "http://sglang:30000/"}, [], "http://sglang:30000"),
])
def test_http_engines_start_or_connect_by_type(monkeypatch: pytest.MonkeyPatch, engine: dict[str, Any],
                                               started: list[Any], url: str) -> None:
    from trajmesh.rollout.engines.engine_client import CoalescingEngine

    run = _Factories(monkeypatch, **engine)
    got = run.start()
    assert isinstance(got.engine, CoalescingEngine) and got.engine.client.base_url == url
    assert run.started == started and run.waited == [got.engine]


def test_synthetic_engine_is_built_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from trajmesh.rollout.engines.synthetic_engine import SyntheticEngine

    run = _Factories(monkeypatch, type="synthetic")
    got = run.start()
    assert isinstance(got.engine, SyntheticEngine) and got.proc is None and run.started == [] and run.waited == []


def test_manifest_records_the_external_engine_release_by_engine_type() -> None:
    from trajmesh.infra import free_port
    from trajmesh.run.train import _framework_versions

    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: the release reads "unreachable"
    sglang = _framework_versions(load_config(overrides={"rollout.engine.type": "sglang", "rollout.engine.url": closed}))
    assert sglang["sglang_server"] == "unreachable"
    torch_run = _framework_versions(load_config(overrides={"rollout.engine.url": closed}))
    assert not [k for k in torch_run if k.endswith("_server")]


def test_manifest_records_the_grader_an_external_agent_run_delegates_to(tmp_path: Path) -> None:
    from trajmesh.graders.external_agent import ExternalAgentGrader
    from trajmesh.graders.reasoning_gym import ReasoningGymGrader
    from trajmesh.run.train import _write_manifest, heldout_tasks

    cfg = load_config(overrides={"tasks.sources": [{"type": "external_agent", "agent": "my_agent:solve"}],
                                 "tasks.heldout_size": 2, "run_dir": str(tmp_path)})
    _write_manifest(cfg, heldout_tasks(cfg))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["grader_revisions"] == {"external_agent": ExternalAgentGrader.revision,
                                            "reasoning_gym": ReasoningGymGrader.revision}


def test_a_source_whose_grader_runs_code_makes_the_grader_service_check_the_sandbox() -> None:
    from trajmesh.services import grader

    class SandboxedToyGrader(ToyGrader):
        uses_sandbox = True

    assert "toy" not in grader.sandboxed_graders() and "code" in grader.sandboxed_graders()
    plugins.register_source(plugins.SourcePlugin(type="toy", config=ToySource, draw=_draw,
                                                 environments={"toy_env": ToyEnv}, graders={"toy": SandboxedToyGrader}))
    try:
        assert "toy" in grader.sandboxed_graders()
        cfg = load_config(overrides={"tasks.sources": [{"type": "math_tool"}, {"type": "toy", "name": "toy_a"}]})
        assert grader.sandboxed_sources(cfg) == ["toy_a"]  # math_tool's grader (math-verify) runs no code
    finally:
        plugins.unregister_source("toy")


# --------------------------------------------------------------------------- rollout hooks

_HOOK_CALLS: list[tuple[Any, ...]] = []
"""What the toy source's rollout hooks were called with, in order."""


async def _toy_rollout_setup(rollout: Any, sources: list[Any]) -> None:
    _HOOK_CALLS.append(("setup", rollout, [s.name for s in sources]))


async def _toy_rollout_episode(rollout: Any, task: Any, index: int) -> Any:
    from trajmesh.contract import Trajectory

    _HOOK_CALLS.append(("episode", rollout, task.task_id, index))
    return Trajectory.new(task, trajectory_id=f"toy-run-{index}", rollout_worker="toy", created_unix_seconds=0.0)


def test_the_rollout_runs_a_sources_setup_hook_and_episode_runner_from_the_registry() -> None:
    # services/rollout.py names no source: what it starts at setup and which episodes it hands to a
    # source's own runner (external_agent's agent runs) come from SourcePlugin.rollout_setup/_episodes.
    pytest.importorskip("torch")
    import asyncio

    from trajmesh.services.rollout import RolloutService
    from trajmesh.v1 import trajectory_pb2

    plugins.register_source(plugins.SourcePlugin(
        type="toy", config=ToySource, draw=_draw, environments={"toy_env": ToyEnv}, graders={"toy": ToyGrader},
        rollout_setup=f"{__name__}:_toy_rollout_setup", rollout_episodes={"toy_env": f"{__name__}:_toy_rollout_episode"}))
    _HOOK_CALLS.clear()
    try:
        cfg = load_config(overrides={"tasks.sources": [{"type": "toy", "name": "toy_a"}, {"type": "reasoning_gym"},
                                                       {"type": "toy", "name": "toy_b"}]})
        service = RolloutService(cfg)
        asyncio.run(service._source_setups())
        assert _HOOK_CALLS == [("setup", service, ["toy_a", "toy_b"])]  # once per type, with its entries
        task = trajectory_pb2.Task(task_id="t7", group_id="g", source="toy_a", group_size=1, environment="toy_env")
        traj = asyncio.run(service.run_episode(task, 3))
        assert _HOOK_CALLS[1:] == [("episode", service, "t7", 3)] and traj.pb.trajectory_id == "toy-run-3"
        assert "chain_sum" not in service.episode_runners  # other environments keep the environment loop
        assert plugins.source("external_agent").rollout_episodes.keys() == {"external_agent"}
        assert "external_agent" in service.episode_runners
        _HOOK_CALLS.clear()  # a config without the (registered) toy source runs no toy setup hook
        asyncio.run(RolloutService(load_config(None))._source_setups())
        assert _HOOK_CALLS == []
    finally:
        plugins.unregister_source("toy")
