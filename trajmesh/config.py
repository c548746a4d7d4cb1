"""Typed run configuration: one pydantic model per component, loaded from one YAML file.

Every field is documented under its declaration. Unknown keys are errors (``extra="forbid"``) and a
failed load names the key and the fix. No torch here: every service imports this module.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError


class ConfigError(ValueError):
    """A configuration could not be loaded; the message names the key and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


StrictModel = _Strict
"""The base of every config class (unknown keys rejected, frozen): plug-ins derive their nested
settings from it (the synthetic engine's timing model, rollout/engines/synthetic_engine.py)."""


class TlsConfig(_Strict):
    """Paths of PEM files (mounted secrets); the files, never their contents, go in the config."""

    ca_file: str | None = None
    """CA bundle that verifies the peer (None: the system roots; a gRPC server then asks no client cert)."""
    cert_file: str | None = None
    """This side's certificate chain: the server's own, or the client certificate for mutual TLS."""
    key_file: str | None = None
    """Private key of cert_file."""
    server_name: str | None = None
    """gRPC clients: expected name on the server certificate when it differs from the address host."""


class SecurityConfig(_Strict):
    """Authentication and TLS (docs/SECURITY.md). Secrets are never config values: services read
    TRAJMESH_NATS_USER, TRAJMESH_NATS_PASSWORD, TRAJMESH_REDIS_PASSWORD (or each NAME_FILE, a path)."""

    nats_auth: bool = True
    """Local launcher: start nats-server with one user per service and subject allow lists, random
    passwords in RUN_DIR/infra/credentials.json (0600), passed to services by environment."""
    redis_auth: bool = True
    """Local launcher: start redis-server with a random password (passed by environment)."""
    nats_tls: TlsConfig | None = None
    """TLS to NATS (clients verify with ca_file; cert_file/key_file for mutual TLS). None: plain."""
    grpc_tls: TlsConfig | None = None
    """TLS on the store and environment gRPC servers and their clients. None: insecure (local default)."""


class InfraConfig(_Strict):
    nats_url: str | None = None
    """NATS server URL. None: `trajmesh train` starts a nats-server with JetStream under the run dir."""
    redis_url: str | None = None
    """Redis URL. None: `trajmesh train` starts a redis-server under the run dir."""
    namespace: str = ""
    """Prefix for streams, consumers and Redis keys, so several runs may share one server."""
    store_address: str = "127.0.0.1:50051"
    """host:port of the trajectory store's gRPC server (the launcher fills in a free port)."""
    store_addresses: list[str] = Field(default_factory=list)
    """host:port of each store replica's gRPC server, in replica order, when `store.replicas` > 1
    (the launcher fills in free ports, the chart the StatefulSet pods' names). Empty: one store at
    `store_address`."""
    environment_addresses: list[str] = Field(default_factory=lambda: ["127.0.0.1:50061"])
    """host:port of each environment service; rollout picks one per session (sticky)."""
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    """NATS users and permissions, Redis AUTH, TLS for NATS and gRPC."""
    max_deliveries: int = Field(8, ge=1)
    """Deliveries one JetStream message may have (each redelivery follows a consumer that crashed or
    missed its ack deadline); the next delivery terminates it as poison: counted in
    trajmesh_bus_poison_messages_total and handed to the consumer's poison hook (trajmesh/bus.py).
    Keep it above the restarts a healthy run survives (the store's held messages are redelivered
    once per store restart)."""


class CurriculumConfig(_Strict):
    """Difficulty curriculum of one source, on the pass rates in `tasks.profile` (trajmesh/tasks.py;
    `trajmesh profile` measures them under the starting policy; with `tasks.reprofile_every_versions`
    the run's own outcomes replace them). Tasks without a profile entry are kept, weight 1."""

    drop: list[Literal["all_pass", "all_fail"]] = Field(default_factory=list)
    """Tasks removed before training: all_pass (every profiled sample passed), all_fail (none did);
    a group of either has no reward variance, so it teaches nothing under GRPO."""
    target_band: tuple[float, float] | None = None
    """[lo, hi] pass rates to sample toward: a task inside it has weight 1, one outside
    `outside_band_weight` (None: every kept task weight 1)."""
    outside_band_weight: float = Field(0.1, ge=0.0, le=1.0)
    """Sampling weight of a profiled task outside `target_band`, relative to one inside."""

    @model_validator(mode="after")
    def _band(self) -> CurriculumConfig:
        if self.target_band is not None and not 0.0 <= self.target_band[0] <= self.target_band[1] <= 1.0:
            raise ValueError(f"target_band {list(self.target_band)}: needs 0 <= lo <= hi <= 1")
        return self


class SourceConfig(_Strict):
    """What every task source's config has. A source type is a plug-in (`trajmesh.plugins`): its
    config class derives from this one, and `tasks.sources` entries are parsed by the class
    registered for their `type` (an unregistered type is rejected at load time)."""

    type: str
    """Selects the source's plug-in (`trajmesh envs` lists the registered types)."""
    name: str
    """Source name recorded on every task and trajectory (unique across sources)."""
    weight: float = Field(1.0, gt=0)
    """Mixture weight of this source."""
    revision: str = "v1"
    """Task revision recorded on every trajectory."""
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    """Drop all-pass / all-fail tasks and sample toward a pass-rate band (off by default)."""


class ToolSourceConfig(SourceConfig):
    """What every tool-using task source's config has (math_tool, workplace, search): the prompt's
    tool-call syntax. `_resolve_tool_format` resolves ``auto`` for every source whose registered config
    class has this field."""

    tool_format: Literal["auto", "tags", "native"] = "auto"
    """How the task prompt asks for tool calls: ``tags`` (the environment's own tags, for the
    character-tokenizer demo model) or ``native`` (the Hermes/Qwen2.5 ``<tool_call>{json}</tool_call>``
    format of a chat model; the tools' JSON schemas travel in the task metadata). The environment
    accepts both forms either way (envs/base.py). ``auto``: native when the model's chat template knows
    tool calls, else tags (resolved when the config is loaded with an existing ``model.path``;
    `_resolve_tool_format`)."""


def _registered_source(value: Any) -> Any:
    """A `tasks.sources` entry parsed by the config class of its type's plug-in (`trajmesh.plugins`)."""
    if isinstance(value, SourceConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"a task source is a mapping with a type, got {type(value).__name__}")
    from trajmesh import plugins

    if "type" not in value:
        raise ValueError(f"a task source needs a type (one of {sorted(plugins.sources())})")
    return plugins.source(str(value["type"])).config.model_validate(value)


TaskSource = Annotated[SerializeAsAny[SourceConfig], BeforeValidator(_registered_source)]
"""One `tasks.sources` entry: the config class registered for its `type` (`trajmesh.plugins`)."""


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of rollout (1.0: behavior log-probs equal the policy's)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1.0: off, so behavior log-probs are the full policy's)."""
    top_k: int = -1
    """-1 disables top-k."""
    max_new_tokens: int = Field(8, gt=0)
    """Response budget per turn, in tokens; reaching it ends the trajectory as MAX_TOKENS."""
    max_turns: int = Field(1, gt=0)
    """Turn budget for multi-turn environments."""


def _default_sources() -> list[SourceConfig]:
    """The default `tasks.sources`: the registered reasoning_gym source's config with its defaults
    (chain_sum). Built on use: config.py imports no source module."""
    from trajmesh import plugins

    default = plugins.source("reasoning_gym").config()
    assert isinstance(default, SourceConfig)
    return [default]


class TasksConfig(_Strict):
    sources: list[TaskSource] = Field(default_factory=_default_sources)
    """Task sources and their mixture weights (default: one reasoning_gym source, chain_sum)."""
    group_size: int = Field(8, ge=1)
    """G: samples per prompt; one task on TASKS is one prompt x G."""
    train_size: int = Field(20000, gt=0)
    """Training tasks drawn per source (the sampler cycles through them in a seeded order)."""
    heldout_size: int = Field(200, gt=0)
    """Held-out problems (disjoint from training) for accuracy before and after RL."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Rollout sampling parameters and token/turn budgets."""
    verifier_audit: Literal["refuse", "warn", "off"] = "refuse"
    """`trajmesh train` probes each source's grader first (trajmesh/run/audit.py) and writes
    RUN_DIR/verifier_audit.json. A reference-answer source gets gold, empty, garbage, format-only
    and prompt-echo answers; an environment-reward source (games, verifiers rubrics, gym-style
    environments: `SourcePlugin.reward_from`) gets empty and garbage actions and a scripted legal
    play where its environment has one. refuse: a source whose grader rewards an empty, garbage or
    format-only answer, a reference-answer source with a task without a gold answer, or an
    environment-reward source whose grader raises on a probe, stops the run before it starts; warn:
    it is reported and trained on. A gold answer scored below 1 is reported as a problem in either
    mode, never refused."""
    verifier_audit_tasks: int = Field(8, ge=1)
    """Held-out tasks per source the audit grades."""
    profile: str = ""
    """Task pass-rate profile (JSON) that each source's `curriculum` reads; `trajmesh profile` writes
    it. "": RUN_DIR.task_profile.json beside the run dir (`trajmesh.tasks.profile_path`), if present."""
    profile_pass_reward: float = 1.0
    """A sample passes when its reward is at least this (profiling and re-profiling)."""
    reprofile_every_versions: int = Field(0, ge=0)
    """Every N policy versions the store replaces a task's profiled pass rate with its outcomes in
    this run since the last re-profile (graded samples it archived; no extra rollouts) and re-weights
    the curriculum; RUN_DIR/task_profile.json is rewritten. 0: the profile stays as loaded."""
    reprofile_min_samples: int = Field(4, ge=1)
    """Outcomes a task needs since the last re-profile before they replace its pass rate."""


class GateConfig(_Strict):
    eta: int = Field(2, ge=0)
    """Maximum policy lag η in versions (0: synchronous)."""
    max_concurrent: int | None = Field(None, gt=0)
    """Optional cap on trajectories in flight."""


class EngineConfig(_Strict):
    """What every rollout engine's config has. An engine type is a plug-in (`trajmesh.plugins.ENGINES`):
    its config class derives from this one, and `rollout.engine` is parsed by the class registered for
    its `type` (`_registered_engine`), so a setting another engine type owns is rejected at load time."""

    type: str
    """A registered engine type (`trajmesh.plugins.ENGINES`, listed by `trajmesh envs`): torch, the
    built-in CPU engine, started by each rollout process; sglang, an external server at url;
    synthetic, uniform random tokens, no model, for load tests and benchmarks (instant unless
    `synthetic` models decode time and response lengths)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Longest one /generate request may take, not counting time the engine spends paused for a
    weight load; past it the trajectory ends as INFRA_FAILURE (reason timeout)."""


def _engine_error(errors: list[tuple[str, str, str, Any]]) -> ValidationError:
    """A validation error at keys of `rollout.engine`: (key, error type, message, input) each."""
    return ValidationError.from_exception_data("EngineConfig", [
        InitErrorDetails(type=PydanticCustomError(kind, "{msg}", {"msg": msg}), loc=(key,), input=value)
        for key, kind, msg, value in errors])


def _registered_engine(value: Any) -> Any:
    """`rollout.engine` parsed by the config class of its type's plug-in (`trajmesh.plugins.ENGINES`;
    no type: torch). A key the chosen class lacks is rejected naming the engine types that have it."""
    if isinstance(value, EngineConfig):
        return value
    from trajmesh import plugins

    if not isinstance(value, dict):
        raise ValueError(f"an engine is a mapping with a type (one of {sorted(plugins.ENGINES)}), "
                         f"got {type(value).__name__}")

    type_ = value.get("type", "torch")
    if not isinstance(type_, str) or type_ not in plugins.ENGINES:
        raise _engine_error([("type", "unknown_engine", f"unknown rollout engine type {type_!r}; registered: "
                                      f"{sorted(plugins.ENGINES)}", type_)])
    cls = plugins.ENGINES[type_].config
    extra = []
    for key in value:
        if key not in cls.model_fields:
            owners = sorted(t for t, p in plugins.ENGINES.items() if key in p.config.model_fields)
            where = f" (a setting of {', '.join(owners)})" if owners else ""
            extra.append((str(key), "extra_forbidden", f"engine type {type_!r} has no such setting{where}", value[key]))
    if extra:
        raise _engine_error(extra)
    return cls.model_validate(value)


Engine = Annotated[SerializeAsAny[EngineConfig], BeforeValidator(_registered_engine)]
"""`rollout.engine`: the config class registered for its `type` (`trajmesh.plugins.ENGINES`)."""


class AgentEndpointConfig(_Strict):
    """rollout/agents/agent_endpoint.py as the rollout service serves it."""

    host: str = "127.0.0.1"
    """Interface the endpoint listens on. The agents run in the environment service (its RunAgent
    RPC), next to the rollout on one host; on a cluster, in the environment's pods: listen on
    0.0.0.0 there (the chart does)."""
    advertise_host: str = ""
    """The address the environment service reaches the endpoint at. Empty: `host`, or for 0.0.0.0
    the pod's IP (``POD_IP``) or this host name's address."""
    port: int = Field(0, ge=0, le=65535)
    """TCP port (0: a free port per process). The evaluator serves one too, for its held-out
    episodes: a fixed port fits one such process per host (a pod each on a cluster)."""
    api_key: str | None = None
    """The key agents must send (``Authorization: Bearer`` or ``x-api-key``); the environment
    service passes it to each run. Unset: a random key per rollout process."""
    max_tokens: int = Field(256, gt=0)
    """Completion budget of a call that names none (capped to what fits the engine's context)."""
    model_name: str = ""
    """The served model's name: calls must name it (another is a 404 ``model_not_found``) and every
    answer carries it; agents get it as the task's ``model``. Empty: the model directory's name."""


class RolloutConfig(_Strict):
    replicas: int = Field(2, ge=1)
    """Rollout processes started by the local launcher."""
    engine: Engine = Field(default_factory=lambda: _registered_engine({"type": "torch"}))
    """The inference engine rollout generates with: the config class of its `type` (default torch)."""
    concurrent_tasks: int = Field(4, ge=1)
    """Tasks one rollout process works on at once."""
    task_ack_wait_s: float = Field(60.0, gt=0)
    """Seconds before a task taken by a rollout that died (never acked) is redelivered to another."""
    environment_wait_s: float = Field(60.0, ge=0)
    """How long an episode's Reset keeps trying while no environment replica answers (a pod
    restarting), with backoff, before the trajectory ends INFRA_FAILURE. Nothing of the episode
    exists yet, so waiting loses nothing; failing at once ends every new task and lets the store
    admit the next as fast as they fail. A Step that fails mid-episode is not retried (the
    session lived on the replica that is gone)."""
    sample_deadline_s: float = Field(3600.0, ge=0)
    """One deadline per sample, from the moment its rollout starts it: environment set-up, the
    agent's run and grading must all end within it (stamped on the trajectory as
    `timing.deadline_unix_seconds`; the rollout cuts the episode, the grader refuses to score past
    it). Its expiry ends the sample INFRA_FAILURE with cause INFRA_DEADLINE, and the store refills
    its group (`store.infra_refills_per_group`). 0: no deadline."""
    agent_endpoint: AgentEndpointConfig = Field(default_factory=lambda: AgentEndpointConfig())
    """The OpenAI/Anthropic-compatible endpoint external agents call (served when a task source is
    ``external_agent``)."""
    stateless_environments_in_process: bool = True
    """Play an episode whose environment class declares `stateless` (one turn; reset and step pure
    functions of task, seed and action: single_answer, chain_sum, reasoning_gym) in the rollout's
    own process, with the environment service's code and replies (`services/environment.py`
    `InProcessSession`): no Reset/Step/Close round trips, the same trajectories. Episodes go through
    the service all the same while `environment.simulated_step_latency` or
    `environment.inject_reset_failure_rate` is set (they model the service), and held-out episodes
    (the evaluator's) always do. False: every episode goes through the service
    (bench/bench_mesh.py `--variants base,new` compares both)."""


class SimulatedLatency(_Strict):
    median_s: float = Field(0.0, ge=0)
    """Median extra seconds per environment step (0: off). For latency benchmarks only."""
    sigma: float = Field(1.0, ge=0)
    """Log-normal shape: the tail grows fast with sigma (p99 ≈ median·e^(2.33σ))."""


class SandboxConfig(_Strict):
    """Untrusted-code sandbox of the environment and grader services (trajmesh/sandbox/,
    docs/SECURITY.md "Sandbox")."""

    allow_without_cgroup: bool = False
    """Run sandboxed code where no per-call cgroup can be made (neither a delegated cgroup v2 subtree
    nor writable cgroup v1 memory/pids/cpu/cpuacct hierarchies), with per-process rlimits only: CPU
    seconds and memory then multiply by the process count, and tmpfs/shm/memfd pages are not
    counted. False: a service calling `sandbox.preflight` refuses to start there and says why."""


class EnvironmentServiceConfig(_Strict):
    replicas: int = Field(1, ge=1)
    """Environment service processes started by the local launcher."""
    simulated_step_latency: SimulatedLatency = Field(default_factory=lambda: SimulatedLatency())
    """A long-tailed delay added to every Step, drawn per session deterministically: models slow
    tools or remote environments (bench/bench_async.py)."""
    inject_sandbox_failure: Literal["never", "evaluation"] = "never"
    """Fault injection for tests: "evaluation" fails the sandbox setup of every tool run in a
    held-out evaluation episode (a task with `evaluation` set), as a pod without the sandbox's
    security context would; training episodes are untouched. Never set it in a real run."""
    inject_reset_failure_rate: float = Field(0.0, ge=0, le=1)
    """Fault injection for tests: this fraction of sessions (chosen by a hash of the session id, the
    same on every replica) has its Reset fail with UNAVAILABLE, as an environment that cannot set
    the episode up; once `rollout.environment_wait_s` has passed the rollout ends that sample
    INFRA_FAILURE (cause INFRA_ENVIRONMENT). Never set it in a real run."""


class ServiceConfig(_Strict):
    """Lifecycle settings every service process shares (trajmesh/service.py)."""

    stop_timeout_s: float = Field(30.0, gt=0)
    """Seconds a service may take to stop once its stop began (a signal, or a failure such as a
    crashed task), on top of the learner's time to finish its step on a signal and of what a
    service's own stop work needs (`Service.stop_work_s`: the store's finalization). Past them it
    logs what it is still waiting for and exits non-zero anyway, so a failing service always ends
    in an exit and a restart. Keep it below the launcher's grace and the pods'
    terminationGracePeriodSeconds."""


class ServiceReplicas(_Strict):
    replicas: int = Field(1, ge=1)
    """Processes of this service started by the local launcher."""


class AdvantageConfig(_Strict):
    type: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gigpo", "prime"] = "grpo"
    """Estimator: GRPO (group mean, optional std scaling), Dr.GRPO (no std, no length norm), RLOO (leave-one-out baseline), REINFORCE++ with a group baseline, GiGPO (episode groups plus anchor-state step groups from the environments' state hashes), or PRIME (RLOO on the outcome plus a leave-one-out process return of an online implicit PRM's token rewards, `learner.prime`; learner/advantages.py, learner/prm.py)."""
    gigpo_omega: float = Field(1.0, ge=0)
    """GiGPO: weight ω of the step-level (anchor-state) advantage added to the episode's."""
    gigpo_gamma: float = Field(0.95, ge=0, le=1)
    """GiGPO: discount of the step returns compared within an anchor-state group (the episode's
    reward sits on its last step)."""
    scale_by_std: bool = True
    """GRPO only: divide by the group std (needs group_size > 1)."""
    eps: float = Field(1e-6, gt=0)
    """Added to the group std before dividing (GRPO with scale_by_std)."""


class PrimeConfig(_Strict):
    """PRIME's implicit process reward model (survey §7.4; learner/prm.py), trained when
    `learner.advantage.type` is prime: a second causal LM πφ initialised from the policy's start, the
    start kept frozen as π_ref, trained on every batch with binary cross-entropy on the sequence's
    implicit-reward logit β·Σ_t log πφ/π_ref against the outcome label."""

    beta: float = Field(0.05, gt=0)
    """β: the token reward r_t = β·(log πφ(y_t) − log π_ref(y_t)) and the PRM's sequence logit
    β·Σ_t(log πφ − log π_ref) over the trajectory's action tokens (the paper: 0.05)."""
    lr: float = Field(1e-6, gt=0)
    """The PRM's AdamW learning rate, constant (the paper: 1e-6 for a 7B model)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip of the PRM's update."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of the process return Σ_{u≥t} γ^{u−t}(r_u − baseline) over action tokens."""
    label_threshold: float = 1.0
    """The outcome label: a trajectory whose reward is at least this is correct (1), else 0."""
    update: Literal["before", "after"] = "before"
    """before: the PRM takes its step on the batch, then a second no-grad forward gives the token
    rewards (verl's default, two forwards); after: the rewards come from the update's own forward,
    the PRM before its step (one forward)."""


class ObjectiveConfig(_Strict):
    """The learner's policy loss (learner/objective.py builds from this type). Defaults: DAPO's
    clip-higher, verl's dual clip, TIS on."""

    eps_low: float = Field(0.2, ge=0, lt=1)
    """Lower PPO clip: r is clipped at 1 - eps_low (binds only with ppo.minibatches x epochs > 1)."""
    eps_high: float = Field(0.28, ge=0)
    """Upper PPO clip: r is clipped at 1 + eps_high (DAPO's clip-higher)."""
    dual_clip: float | None = Field(3.0, gt=1)
    """Dual clip c for negative advantages: the loss of a token with A < 0 is at most c·|A|·w (None: off)."""
    behavior_correction: Literal["tis", "mis", "none"] = "tis"
    """Behavior weight w = π_prox/π_beh: truncated (tis), masked outside [lo, hi] (mis), or off."""
    tis_cap: float = Field(2.0, gt=0)
    """tis: the behavior weight w is truncated at this cap."""
    mis_low: float = Field(0.5, ge=0, lt=1)
    """mis: tokens with w below this are masked out (still counted in D)."""
    mis_high: float = Field(2.0, gt=1)
    """mis: tokens with w above this are masked out (still counted in D)."""
    denominator: Literal["token_global", "sequence_mean", "constant"] = "token_global"
    """D: token_global = Σ loss-mask tokens over the whole batch (all micro-batches and ranks); sequence_mean = mean over sequences of each sequence's token mean; constant = constant_denominator (Dr.GRPO)."""
    constant_denominator: float = Field(1024.0, gt=0)
    """D when denominator is constant (tokens)."""


class EntropyConfig(_Strict):
    type: Literal["none", "magic"] = "none"
    """none: no entropy term. magic: Skywork-OR1's adaptive coefficient (survey §7.5), checkpointed."""
    target_entropy: float = Field(0.2, ge=0)
    """H*: the controller raises the entropy bonus while entropy is at or below this (nats)."""
    delta: float = Field(0.005, gt=0)
    """Step of the coefficient per learner step."""
    max_coef: float | None = Field(0.05, gt=0)
    """Upper clamp of the coefficient (None: unclamped)."""


class TrainEngineConfig(_Strict):
    type: Literal["deepspeed", "torch"] = "deepspeed"
    """deepspeed (ZeRO, gloo on CPU) or plain torch AdamW."""
    zero_stage: int = Field(0, ge=0, le=3)
    """DeepSpeed ZeRO stage: 0 (none), 1/2 (optimizer state, gradients), 3 (parameters too)."""

    @model_validator(mode="after")
    def _zero_needs_deepspeed(self) -> TrainEngineConfig:
        if self.type != "deepspeed" and self.zero_stage > 0:
            raise ValueError(f"learner.engine.zero_stage {self.zero_stage} needs learner.engine.type: deepspeed "
                             f"(the {self.type} engine is plain AdamW and would ignore it)")
        return self


class StopRulesConfig(_Strict):
    """Predeclared bounds checked after every learner step (survey §11.4); a breach stops the run.

    Every bound is off (None) by default. On a breach the learner writes RUN_DIR/stop_reason.json and
    a `{"kind": "stop"}` record to metrics.jsonl, checkpoints, and exits 0. See docs/WATCHING.md.
    """

    entropy_min: float | None = Field(None, ge=0)
    """Stop when the mean token entropy (trajmesh_learner_entropy_nats) falls below this (nats)."""
    kl_max: float | None = Field(None, ge=0)
    """Stop when KL(π_beh ‖ π_θ), k3 estimator (trajmesh_learner_kl_k3), exceeds this (nats)."""
    ess_ratio_min: float | None = Field(None, ge=0)
    """Stop when the ESS fraction of the behavior weight (trajmesh_learner_effective_sample_size_ratio)
    falls below this (0–1; a value above 1 can never hold and forces a stop, used by tests)."""
    verifier_disagreement_max: float | None = Field(None, ge=0, le=1)
    """Stop when the fraction of graded batch trajectories whose pass/fail components (see
    `verifier_components`) disagree with the scalar reward exceeds this (0–1)."""
    verifier_components: list[str] = Field(default_factory=lambda: ["correct", "format_eos"])
    """Pass/fail reward components for verifier disagreement: a trajectory disagrees when
    (reward > 0) differs from (every listed component present on it is > 0)."""
    truncation_ratio_max: float | None = Field(None, ge=0, le=1)
    """Stop when the fraction of batch trajectories marked truncated (MAX_TOKENS/MAX_TURNS) exceeds this."""
    engine_consistency_max_abs_logprob_diff_max: float | None = Field(None, ge=0)
    """Stop when the engine-consistency probe's max |log π_learner − log π_engine| over
    version-matched tokens exceeds this (nats); see trajmesh.learner.consistency."""
    start_after_steps: int = Field(0, ge=0)
    """Check the gates only from this learner step on (1 = from the first step)."""


class PpoConfig(_Strict):
    """Optimizer updates per learner step (docs/DESIGN.md §4): the batch is split into `minibatches`
    (balanced by tokens) and swept `epochs` times. With more than one update π_prox comes from a
    no-grad pass before the first, so r = π_θ/π_prox moves and the clip binds; with exactly one
    update (and no dropout) r ≡ 1 and the clip is inert."""

    minibatches: int = Field(1, ge=1)
    """K: optimizer updates per epoch over the step's batch."""
    epochs: int = Field(1, ge=1)
    """E: sweeps over the batch per learner step."""


class SimulatedStepCost(_Strict):
    """Benchmark model of a GPU learner step (bench/bench_systems.py): when either figure is above
    0 the learner does not train; each step sleeps seconds_per_step + seconds_per_token·(trained
    tokens) instead, so a benchmark's learner takes no CPU from rollout. Everything else of a step
    (staleness split, version + 1, weights saved and announced, the store's report) is unchanged;
    the weights never change. Never set in a real run."""

    seconds_per_token: float = Field(0.0, ge=0)
    """Modelled seconds per trained (sampled, non-stale) token."""
    seconds_per_step: float = Field(0.0, ge=0)
    """Modelled fixed seconds per step (optimizer step, weight sync)."""

    @property
    def enabled(self) -> bool:
        return self.seconds_per_token > 0 or self.seconds_per_step > 0

    def seconds(self, tokens: int) -> float:
        """The modelled duration of a step that trains ``tokens`` tokens."""
        return self.seconds_per_step + self.seconds_per_token * tokens


class TruncationConfig(_Strict):
    """What the learner trains a truncated trajectory (MAX_TOKENS / MAX_TURNS) with, applied where
    it builds its batch (learner/step.py `apply_truncation`, learner/shaping.py). The peers disagree
    (survey §3.7, §7.5), so it is a choice, recorded in the manifest."""

    policy: Literal["keep", "mask", "zero_reward", "dapo_soft"] = "keep"
    """keep: as graded; mask: its tokens leave the loss (its reward still counts in its group's
    baseline); zero_reward: reward 0, tokens trained (MAGIC); dapo_soft: every trajectory's reward
    gets DAPO's soft overlong penalty on its response length (truncated or not)."""
    max_length: int | None = Field(None, ge=1)
    """dapo_soft's L_max, in response tokens (a trajectory's loss-masked tokens); None:
    tasks.sampling.max_new_tokens x max_turns."""
    cache_length: int | None = Field(None, ge=1)
    """dapo_soft's L_cache, the width of the penalty's ramp below L_max; None: L_max // 5 (DAPO:
    4,096 of 20,480), at least 1."""

    def lengths(self, sampling: SamplingConfig) -> tuple[int, int]:
        """(L_max, L_cache) with the defaults resolved."""
        max_length = self.max_length or sampling.max_new_tokens * sampling.max_turns
        return max_length, self.cache_length or max(1, max_length // 5)


class ReferenceConfig(_Strict):
    """A frozen reference policy on the learner and a KL-to-reference loss term (learner/reference.py,
    learner/objective.py ``reference_kl_loss``), with ProRL's periodic reference and optimizer resets."""

    enabled: bool = False
    """Keep a frozen copy of the initial policy on the learner (sharded like the policy under ZeRO-3)
    and report KL(π_θ ‖ π_ref) every step (trajmesh_learner_reference_kl_k1/k2/k3), apart from the
    behavior-drift KL (trajmesh_learner_kl_*)."""
    kl_coef: float = Field(0.0, ge=0)
    """β: the loss gains β · (the estimator's per-token value, reduced like the policy loss); 0
    measures the KL without the term."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator on y = log π_ref − log π_θ (|y| clamped at 20): k1 = −y, k2 = y²/2,
    k3 = eʸ − 1 − y (Schulman's; verl's kl, mse and low_var_kl)."""
    aggregation: Literal["objective", "token_global", "sequence_mean"] = "objective"
    """How the per-token KL values reduce to the term: with the objective's denominator (objective),
    over all eligible tokens of the batch (token_global), or as the mean over sequences of each
    sequence's token mean (sequence_mean)."""
    reset_every: int = Field(0, ge=0)
    """ProRL: at every version that is a positive multiple of this, before training from it, the
    reference becomes the current policy (0: never reset)."""
    reset_optimizer: bool = True
    """With reset_every: also clear the optimizer's moments and step counts at each reset (the
    learning-rate schedule goes on)."""


class LearnerConfig(_Strict):
    engine: TrainEngineConfig = Field(default_factory=TrainEngineConfig)
    """Optimizer backend and ZeRO stage."""
    world_size: int = Field(1, ge=1, le=4096)
    """Data-parallel learner ranks (torch.distributed; gloo on CPU, NCCL on GPU). Locally the launcher
    starts this many learner processes; on Kubernetes it is learner.replicaCount x learner.gpus.
    Rank 0 alone talks to the store and publishes weights; each batch is split over the ranks by
    tokens. More than 1 needs learner.engine.type deepspeed and a batch of at least this many
    trajectories."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Training dtype: bf16 compute with fp32 master weights, or fp32; auto = bf16 on CUDA, fp32 on
    CPU. Weights are published in the training dtype."""
    attention: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """HF attention kernel; auto = sdpa on CUDA, eager on CPU (SDPA with a padding mask is ~10x
    slower than eager at the demo's tiny shapes on CPU)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward (HF gradient checkpointing)."""
    deterministic: Literal["auto", "on", "off"] = "auto"
    """torch.use_deterministic_algorithms in the learner: auto = on on CPU (bitwise resume, the fault
    tests' comparison), off on CUDA (deterministic GPU kernels are slower and some ops have none)."""
    micro_batch_tokens: int = Field(16384, ge=1)
    """Padded tokens (rows x longest row) per forward/backward; an update's micro-batches
    accumulate gradients, each loss scaled by the update's global counts (exact). The default
    holds the demo's whole batch (256 short sequences) in one micro-batch."""
    logprob_chunk_tokens: int = Field(1024, ge=1)
    """Positions per chunk of the output head + log-softmax + entropy (memory O(chunk x vocab))."""
    ppo: PpoConfig = Field(default_factory=PpoConfig)
    """Minibatches x epochs of PPO updates per learner step."""
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate (AdamW)."""
    warmup_steps: int = Field(5, ge=0)
    """Linear warm-up of the learning rate over this many optimizer updates (a learner step makes
    ppo.minibatches x ppo.epochs of them)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After the warm-up: a constant lr, or one decayed (linearly, or along half a cosine) to
    `min_lr_ratio` x lr at `max_steps`, so the last steps of a run move the policy least."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where a decaying `lr_schedule` ends, as a fraction of `lr`."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip per optimizer update."""
    batch_groups: int = Field(8, ge=1)
    """Groups (prompts) per learner step; the gate's B is batch_groups x group_size trajectories."""
    max_steps: int = Field(100, ge=0)
    """RL steps; the learner stops after this many (or max_seconds)."""
    max_seconds: float = Field(600.0, gt=0)
    """Wall-clock budget of RL in seconds."""
    checkpoint_every: int = Field(20, ge=1)
    """Checkpoint every N learner steps (and always on stop)."""
    keep_batches: bool = False
    """Keep every step's batch in RUN_DIR/learner_batches (normally only those since the last
    checkpoint are kept, for replay after a crash); for audits and determinism tests."""
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    """Advantage estimator."""
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    """Decoupled-PPO objective: clips, behavior correction, denominator."""
    entropy: EntropyConfig = Field(default_factory=EntropyConfig)
    """Entropy bonus and its controller."""
    stop_rules: StopRulesConfig = Field(default_factory=StopRulesConfig)
    """Bounds on entropy, KL, ESS, verifier disagreement, truncation and engine consistency (all off
    by default). Formerly ``stop_gates`` ("gate" now means only the staleness gate): that key is
    still read, with a warning, and giving both is an error."""

    @model_validator(mode="before")
    @classmethod
    def _former_stop_gates(cls, data: Any) -> Any:
        if isinstance(data, dict) and "stop_gates" in data:
            if "stop_rules" in data:
                raise ValueError("learner.stop_gates is the former name of learner.stop_rules: give only stop_rules")
            warnings.warn("learner.stop_gates is now learner.stop_rules (read as such)", FutureWarning, stacklevel=2)
            data = {("stop_rules" if k == "stop_gates" else k): v for k, v in data.items()}
        return data
    truncation: TruncationConfig = Field(default_factory=TruncationConfig)
    """What truncated trajectories are trained with (default: as graded)."""
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    """Frozen reference model, KL-to-reference term and resets (off by default)."""
    prime: PrimeConfig = Field(default_factory=PrimeConfig)
    """PRIME's online implicit PRM (used when advantage.type is prime)."""
    consistency_probe_trajectories: int = Field(8, ge=0)
    """Trajectories per step the engine-consistency probe re-scores (0 disables the probe)."""
    seed: int = 0
    """Learner seed: torch's RNG in the learner process (dropout, minibatch order) and DeepSpeed's."""
    simulated_step: SimulatedStepCost = Field(default_factory=lambda: SimulatedStepCost())
    """Benchmarks only: a modelled step duration in place of training (off by default)."""
    stop_step_allowance_s: float | None = Field(None, gt=0)
    """How long a stop (Ctrl-C, SIGTERM, the end of the run) waits for the step in progress to
    finish, publish and report before the learner checkpoints and exits. None: twice the longest step
    of this process so far (train + publish + report), at least 120 s; 1800 s while no step has
    finished (a real model's first step on a CPU takes minutes). The launcher waits as long
    (docs/RELIABILITY.md)."""

    @property
    def optimizer_updates(self) -> int:
        """Optimizer updates in the step budget: max_steps x ppo.minibatches x ppo.epochs (what
        `warmup_steps` counts in, and where a decaying `lr_schedule` ends)."""
        return self.max_steps * self.ppo.minibatches * self.ppo.epochs

    @model_validator(mode="after")
    def _decay_needs_steps_past_warmup(self) -> LearnerConfig:
        if self.lr_schedule != "constant" and self.optimizer_updates <= self.warmup_steps:
            raise ValueError(f"learner.lr_schedule {self.lr_schedule} decays over max_steps x PPO updates = "
                             f"{self.optimizer_updates} optimizer updates, which must exceed warmup_steps "
                             f"{self.warmup_steps}")
        return self


class ResampleOnCorrectConfig(_Strict):
    """GRPO-RoC (rStar2-Agent, survey §5.2; services/store/roc.py): the store admits
    ``oversample × tasks.group_size`` samples per task and keeps ``tasks.group_size`` of each
    complete group: incorrect ones drawn uniformly (up to half), correct ones drawn favouring few
    tool errors and a clean answer format. Every drop is archived with its reason."""

    enabled: bool = False
    """Select each group by RoC (off: every valid member is kept)."""
    oversample: int = Field(2, ge=2)
    """Samples admitted per task, as a multiple of tasks.group_size (rStar2: 2, 32 for 16)."""
    correct_above: float = 0.5
    """A sample is correct (a positive) when its reward is above this."""
    answer_pattern: str = r"<answer>"
    """Regular expression of one answer tag in the sampled text (the format score counts them)."""
    penalty_floor: float = Field(0.1, gt=0)
    """A correct sample is drawn with weight 1 / (penalty + this): the weight of a clean one."""

    @field_validator("answer_pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"answer_pattern {v!r} is not a regular expression: {e}") from None
        return v


class StoreConfig(_Strict):
    replicas: int = Field(1, ge=1)
    """Store processes (the chart's store.replicaCount). Replica k owns the groups whose
    `trajmesh.bus.partition_of(group id)` is k: their graded trajectories reach it alone, it
    assembles them and hands them out, and the learner gathers each batch from every replica.
    Admission and the staleness gate stay global (Redis). Fixed for the life of a run."""
    resample_on_correct: ResampleOnCorrectConfig = Field(default_factory=ResampleOnCorrectConfig)
    """GRPO-RoC group selection (off by default)."""
    drop_zero_variance_groups: bool = True
    """Dynamic sampling: drop groups whose rewards are all equal (they carry no GRPO signal). A
    group a distillation teacher scored is kept: its tokens carry the teacher's signal."""
    max_buffered_groups: int = Field(256, ge=1)
    """Bound on assembled groups waiting for the learner."""
    intake_ack_wait_s: float = Field(30.0, gt=0)
    """Seconds before an unacked graded trajectory is redelivered (the store heartbeats the ones it
    holds; a dead store's come back to its successor)."""
    straggler_slack_s: float = Field(30.0, ge=0)
    """Seconds, beyond the slowest redelivery (the longest ack wait on a trajectory's way), that the
    learner is held for a due straggler (a group that after this step could only be trained stale):
    time for the redelivered work to be done again — a restarted service's start, a queue ahead of
    it on a busy machine. Past it the learner goes on and the straggler's members that come back
    too stale are cut (`filtered:stale_on_arrival`). With `replicas` > 1 the learner waits as long
    for a replica that does not answer, then gathers without it (docs/ARCHITECTURE.md "Store replicas")."""
    infra_refills_per_group: int = Field(2, ge=0)
    """At most this many members of one group are refilled: a member that ends INFRA_FAILURE (its
    engine, environment, agent, teacher or grader failed, or its deadline passed) is replaced by a
    new sample of the same task, admitted through the gate as one more trajectory, so the group
    trains on G (docs/RELIABILITY.md "Infra failures refill the sample"). Past the cap — a dead
    dependency failing every sample — the group ends with the members it has, as with 0 (off)."""
    pipelined_admission: bool = True
    """Each admission-loop round reads the finished flag and the gate's counters, draws the sampler
    position and clears the last published task's unpublished mark in one Redis round trip, so an
    admitted task costs two (that round and the admission script; services/store/repo.py
    `admission_round`). False: the same round, one round trip per command (five per task); kept
    so bench/bench_mesh.py (`--variants base,new`) can measure both in one run."""
    pipelined_intake: bool = True
    """Each run of graded trajectories the store takes in (a fetch, split at a repeated id) is one
    Redis round trip: every message's lookup, its group membership and the gate's finish of the
    groups it completes, one script (services/store/repo.py `intake_round`). False, and for a run
    with an infra failure to refill or a poison message: a lookup, a MULTI for the memberships and
    one finish script per completed group (a filtered one also leaves the pending set on its own
    round trip); kept so bench/bench_mesh.py (`--variants base,new`) measures both in one run."""


class TeacherConfig(_Strict):
    """One teacher of on-policy distillation: an engine that scores the student's own samples of
    one task source (rollout/engines/teacher.py). It must share the student's tokenizer."""

    source: str = Field(min_length=1)
    """The task source (a `tasks.sources` name) whose trajectories this teacher scores."""
    type: Literal["torch", "sglang", "vllm"] = "torch"
    """The teacher's engine: the built-in torch engine (a child of each rollout process when `url`
    is unset) or a running SGLang or vLLM server at `url` (their native APIs)."""
    url: str | None = None
    """Base URL of a running teacher engine (None: torch only, started from `model_path`)."""
    model_path: str | None = None
    """The teacher's HF model directory: served by the torch engine when `url` is unset; its
    model.safetensors hash is the default `revision`."""
    name: str = ""
    """The teacher's name in the manifest and on every trajectory it scores ("": the last part of
    `model_path`, else the source's name)."""
    revision: str = ""
    """The teacher's revision ("": the first 16 hex digits of model.safetensors' sha256 in
    `model_path`). Give one (an HF commit) for a teacher the rollout cannot read."""

    @model_validator(mode="after")
    def _served(self) -> TeacherConfig:
        if self.url is None and (self.type != "torch" or not self.model_path):
            raise ValueError(f"distill.teachers[{self.source}]: give url (a running {self.type} server)"
                             + (" or model_path (the torch engine serves it)" if self.type == "torch" else ""))
        if not self.revision and not self.model_path:
            raise ValueError(f"distill.teachers[{self.source}]: give revision or model_path (its hash is the revision)")
        return self


class DistillConfig(_Strict):
    """On-policy distillation (multi-teacher MOPD; survey §4.7/§4.9): a teacher scores each token
    the student sampled, and the learner adds ``coef · (log π_teacher − log π_behavior)`` — the
    per-token reverse KL's negation — to the token's advantage (learner/step.py)."""

    teachers: list[TeacherConfig] = Field(default_factory=list)
    """One teacher per task source (empty: no distillation). Sources without one train on their reward."""
    coef: float = Field(1.0, ge=0)
    """Weight of the per-token reverse-KL advantage."""
    reward_weight: float = Field(1.0, ge=0)
    """Weight of the task reward's advantage on a scored trajectory (0: distillation alone)."""
    max_batch: int = Field(16, ge=1)
    """Sequences a rollout process sends a teacher in one scoring request at most."""
    batch_window_ms: float = Field(5.0, ge=0, le=1000)
    """How long a rollout process collects sequences before sending them to a teacher as one batch."""
    retry_s: float = Field(60.0, gt=0)
    """How long a failed scoring request is retried (with backoff) before its trajectories end as
    INFRA_FAILURE (reason teacher_unavailable in the rollout's metrics)."""

    def teacher_for(self, source: str) -> TeacherConfig | None:
        """The teacher of a task source, or None."""
        return next((t for t in self.teachers if t.source == source), None)


DEFAULT_JUDGE_RUBRIC = (
    "You are grading an answer to a task.\n\nTask:\n{prompt}\n\nAnswer:\n{response}\n\n"
    "Rate the answer from 0 (wrong, empty or off-topic) to {max_score} (correct and complete). "
    "Reply with one line: Score: <integer>\n")
DEFAULT_JUDGE_PAIRWISE_RUBRIC = (
    "You are comparing two answers to a task.\n\nTask:\n{prompt}\n\nAnswer A:\n{response_a}\n\n"
    "Answer B:\n{response_b}\n\nWhich answer is better? Reply with one line: Winner: A or Winner: B\n")


class JudgeConfig(_Strict):
    """A judge grader (GenRM / LLM-as-judge; graders/judge.py): the task sources named in `sources`
    are scored by asking an engine instead of their program grader. The judge's answer is parsed
    into a score; a judge that times out, fails or answers unparseably ends the trajectory
    INFRA_FAILURE (counted by reason), never reward 0."""

    sources: list[str] = Field(default_factory=list)
    """Task source names (`tasks.sources[].name`) the judge scores (empty: no judge)."""
    mode: Literal["pointwise", "pairwise"] = "pointwise"
    """pointwise: each trajectory gets ``score / max_score`` from `rubric`. pairwise: a group's n
    members are compared in a circle, member i as answer A against member i+1 mod n as answer B
    (n calls, not n(n-1)/2): each member is shown once first and once second, so a judge that
    always prefers one position gives every member the same reward. A member's reward is its
    share of its two comparisons won (0, 0.5 or 1)."""
    type: Literal["torch", "sglang", "vllm"] = "sglang"
    """The judge engine's API: torch and sglang speak SGLang's native ``/generate`` (text in, text
    out); vllm its OpenAI-compatible ``/v1/completions``."""
    urls: list[str] = Field(default_factory=list)
    """Base URLs of the running judge engines (requests go round-robin). Empty with `sources` set:
    the local launcher starts one torch engine serving `model_path` (trajmesh/run/judge_engine.py;
    ``type: torch`` only)."""
    model_path: str | None = None
    """The judge model's HF directory: its model.safetensors hash is the default `revision`, and
    without `urls` the model the launcher's judge engine serves."""
    nice: int = Field(10, ge=0, le=19)
    """Niceness of the judge engine the local launcher starts (without `urls`): on one machine it
    yields the CPUs to the rollout and the learner, as the evaluator does (`eval.evaluator_nice`)."""
    name: str = ""
    """The judge's name in the manifest and on every trajectory it scores ("": the last part of
    `model_path`, else ``judge``)."""
    revision: str = ""
    """The judge model's revision ("": the first 16 hex digits of model.safetensors' sha256 in
    `model_path`). Give one (an HF commit) for a judge whose weights this machine cannot read."""
    rubric: str = DEFAULT_JUDGE_RUBRIC
    """Pointwise prompt; ``{prompt}``, ``{response}`` and ``{max_score}`` are filled in. The verdict is
    the last ``Score: <number>`` of the answer."""
    pairwise_rubric: str = DEFAULT_JUDGE_PAIRWISE_RUBRIC
    """Pairwise prompt; ``{prompt}``, ``{response_a}`` and ``{response_b}`` are filled in. The verdict is
    the last ``Winner: A`` or ``Winner: B`` of the answer."""
    max_score: int = Field(10, ge=1)
    """The top of the pointwise scale (reward = score / max_score; a score outside [0, max_score]
    is unparseable)."""
    max_new_tokens: int = Field(16, gt=0)
    """Tokens the judge may write per verdict."""
    temperature: float = Field(0.0, ge=0)
    """The judge's sampling temperature (0: greedy, so a redelivered trajectory is judged alike)."""
    timeout_s: float = Field(10.0, gt=0)
    """Wall time one judge request may take; past it the request fails (reason ``timeout``)."""
    attempts: int = Field(2, ge=1)
    """Tries per judge request before the trajectory ends INFRA_FAILURE (a timeout or a failed
    request is retried; an unparseable verdict is not)."""

    @model_validator(mode="after")
    def _served(self) -> JudgeConfig:
        if self.sources and not self.urls and not (self.model_path and self.type == "torch"):
            raise ValueError("judge.sources needs judge.urls (the judge engines' base URLs), or judge.type torch "
                             "and judge.model_path: the local launcher then starts the judge engine")
        if self.sources and not self.revision and not self.model_path:
            raise ValueError("judge: give revision or model_path (its hash is the revision)")
        if self.timeout_s * self.attempts >= 30.0:  # trajmesh.bus.GRADER_ACK_WAIT_S
            raise ValueError(f"judge.timeout_s x judge.attempts ({self.timeout_s * self.attempts:g} s) must stay "
                             "under the grader's 30 s ack wait, or a slow judge's trajectories are redelivered")
        return self


class DemoModelConfig(_Strict):
    hidden_size: int = 128
    """Width of the tiny demo model."""
    layers: int = 4
    """Transformer layers of the demo model."""
    heads: int = 4
    """Attention heads of the demo model."""
    sft_steps: int = 800
    """Warm-start SFT optimizer steps (cached under runs/.cache/ by config hash)."""
    sft_batch_size: int = 64
    """Sequences per SFT step."""
    sft_lr: float = 3e-3
    """SFT learning rate (AdamW)."""
    sft_size: int = 20000
    """Generated SFT examples (disjoint from held-out)."""


class ModelConfig(_Strict):
    path: str | None = None
    """A Hugging Face causal-LM directory. None: build the embedded demo model (tiny Llama + SFT)."""
    demo: DemoModelConfig = Field(default_factory=DemoModelConfig)
    """How the embedded demo model is built and warm-started (used only when path is None)."""


class EvalConfig(_Strict):
    """Held-out evaluation protocol (recorded in the manifest) and the held-out early stop.

    Every source is evaluated on its own `tasks.heldout_size` problems, through its environment and
    scored by its own grader, greedy and sampled (learner/evaluate.py, docs/WATCHING.md)."""

    samples: int = Field(4, ge=1)
    """Sampled completions per held-out problem before and after RL (pass@k for k up to this)."""
    samples_during: int = Field(1, ge=1)
    """Sampled completions per problem in the evaluations during RL (`--eval-every`)."""
    temperature: float = Field(1.0, gt=0)
    """Temperature of the sampled evaluation (the greedy one is T = 0)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus of the sampled evaluation."""
    max_new_tokens: int | None = Field(None, gt=0)
    """Token budget per turn; None: the training budget `tasks.sampling.max_new_tokens`."""
    max_turns: int | None = Field(None, gt=0)
    """Turn budget per episode; None: the training budget `tasks.sampling.max_turns`."""
    noise_seeds: int = Field(3, ge=0)
    """Before/after RL: extra sampled evaluations (one sample per problem each, different seeds)
    whose spread is the evaluation noise reported as `sampled_accuracy_seed_std`."""
    selection_metric: Literal["sampled", "greedy"] = "sampled"
    """Held-out score that picks the best checkpoint and drives the early stop: the mean over
    sources of each source's sampled (or greedy) accuracy."""
    stop_regression_margin: float | None = Field(None, ge=0, le=1)
    """Early stop: end the run when the held-out score falls more than this (absolute, 0–1) below
    the best so far on `stop_confirmations` consecutive evaluations. None: off."""
    stop_confirmations: int = Field(2, ge=1)
    """Consecutive evaluations below best − margin that confirm a regression."""
    in_mesh: bool | None = None
    """Who evaluates. True: the evaluator service (services/evaluator.py, one process with its own
    engine, as on a cluster) starts with the mesh, and summary.json's before/after figures are its
    records of the first and last version. False: `trajmesh train` evaluates in its own process
    (before RL, every `--eval-every` seconds, after RL), only sources whose episodes the rollout
    itself plays in process (stateless environments, graders without the sandbox; any other is
    refused before the run starts). None (default): True for `trajmesh
    train`; a mesh started by itself (`trajmesh.run.launcher.start_mesh`) has no evaluator."""
    every_versions: int = Field(10, ge=1)
    """The evaluator service evaluates a version at least this many versions after the last one
    it evaluated (and always the first, version 0, and the last); it loads no other version."""
    evaluator_nice: int = Field(10, ge=0, le=19)
    """The evaluator service lowers its CPU priority (and its engine child's) by this much at start
    (`os.nice`): on one machine it yields the CPUs to training, and evaluates whatever is due when
    they are free; in a pod of its own it changes nothing."""


class WeightsConfig(_Strict):
    """How the learner's weights reach the engines (trajmesh/weights/delta.py, docs/ARCHITECTURE.md "Weights")."""

    sync: Literal["full", "delta"] = "full"
    """full: every version is a full safetensors checkpoint on the shared volume, which each engine
    loads as it is. delta: per version only the tensors whose bytes changed (XOR or sparse + zstd)
    and a manifest with the full file's sha256, with a full anchor every `anchor_every` versions;
    each rollout (and the evaluator) rebuilds the full checkpoint in `local_dir`, checks its sha256
    (and every delta frame's checksum) and points its engine there."""
    anchor_every: int = Field(10, ge=1)
    """delta: a full checkpoint every this many versions (and the learner's first one after a
    start); a pod that joins late or missed versions rebuilds from the newest anchor + its deltas."""
    local_dir: str | None = None
    """delta: where a rollout rebuilds checkpoints (one or two at a time); None: a directory per
    process under the system temp dir. An engine in another container (SGLang, vLLM on a cluster)
    must see this path (docs/KUBERNETES.md)."""
    sync_timeout_s: float = Field(600.0, gt=0)
    """delta: a rebuild still running after this many seconds fails that weight update (an error
    naming the file it waits for); the engine keeps the weights it has."""


class RunConfig(_Strict):
    run_dir: str = "runs/demo"
    """Where the manifest, metrics, archive, checkpoints and weights go."""
    seed: int = 0
    """Run seed: task order, the demo model's SFT and the learner's initialization derive from it."""
    mode: Literal["async", "sync"] = "async"
    """sync: η is forced to 0 and the learner waits for a full batch from the current version."""
    infra: InfraConfig = Field(default_factory=InfraConfig)
    """NATS, Redis and gRPC addresses, security."""
    service: ServiceConfig = Field(default_factory=ServiceConfig)
    """What every service process shares: how long its stop may take."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    """Task sources, group size and sampling."""
    gate: GateConfig = Field(default_factory=GateConfig)
    """The staleness gate."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout processes and their engine."""
    grader: ServiceReplicas = Field(default_factory=lambda: ServiceReplicas(replicas=2))
    """Grader processes."""
    environment: EnvironmentServiceConfig = Field(default_factory=lambda: EnvironmentServiceConfig())
    """Environment service processes."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Isolation the environment and grader services require of the code sandbox."""
    store: StoreConfig = Field(default_factory=StoreConfig)
    """The trajectory store."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """The learner: optimizer, advantage, objective, stop rules."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation protocol, checkpoint choice and the held-out regression stop."""
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    """How published weights reach the engines: full checkpoints or deltas."""
    distill: DistillConfig = Field(default_factory=DistillConfig)
    """On-policy distillation: teachers scoring the student's samples (off: no teachers)."""
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    """A judge grader (LLM-as-judge) for the sources it names (off: no sources)."""

    @model_validator(mode="before")
    @classmethod
    def _tool_format(cls, data: Any) -> Any:
        return _resolve_tool_format(data)

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        adv = self.learner.advantage
        if adv.type in ("grpo", "gigpo") and adv.scale_by_std and self.tasks.group_size < 2:
            raise ValueError(
                "learner.advantage: GRPO std scaling needs tasks.group_size >= 2 "
                "(set group_size >= 2 or advantage.scale_by_std: false)"
            )
        if adv.type == "prime":
            if self.tasks.group_size < 2:
                raise ValueError("learner.advantage prime: its leave-one-out baselines need tasks.group_size >= 2")
            if self.learner.world_size > 1 or self.learner.engine.zero_stage == 3:
                raise ValueError("learner.advantage prime: the implicit PRM trains on one rank without ZeRO-3 "
                                 "(learner.world_size 1, learner.engine.zero_stage < 3)")
        trunc = self.learner.truncation
        if trunc.policy == "dapo_soft":
            max_length, cache_length = trunc.lengths(self.tasks.sampling)
            if cache_length > max_length:
                raise ValueError(f"learner.truncation: cache_length {cache_length} is larger than "
                                 f"max_length {max_length} (the penalty ramps over the last cache_length tokens)")
        ws = self.learner.world_size
        if ws > 1 and self.learner.engine.type != "deepspeed":
            raise ValueError(f"learner.world_size {ws} needs learner.engine.type: deepspeed "
                             "(the torch engine does not average gradients over ranks)")
        if ws > self.batch_trajectories:
            raise ValueError(f"learner.world_size {ws} is larger than a batch ({self.batch_trajectories} "
                             "trajectories = learner.batch_groups x tasks.group_size): every rank needs rows")
        names = [src.name for src in self.tasks.sources]
        taught = [t.source for t in self.distill.teachers]
        if unknown := sorted(set(taught) - set(names)):
            raise ValueError(f"distill.teachers: no task source named {unknown} (sources: {names})")
        if len(taught) != len(set(taught)):
            raise ValueError(f"distill.teachers: one teacher per task source, got {taught}")
        if unknown := sorted(set(self.judge.sources) - set(names)):
            raise ValueError(f"judge.sources: no task source named {unknown} (sources: {names})")
        self._judge_only_sources_judged()
        addrs = self.infra.store_addresses
        if addrs and len(addrs) != self.store.replicas:
            raise ValueError(f"infra.store_addresses has {len(addrs)} addresses for store.replicas "
                             f"{self.store.replicas}: one per replica, in replica order")
        roc = self.store.resample_on_correct
        if roc.enabled and self.effective_eta * self.learner.batch_groups < roc.oversample - 1:
            # The gate counts a kept group's G as accepted and frees its other (k-1)·G: with fewer than
            # a full batch buffered its capacity is at least η·B + G, which must hold one admission of k·G.
            raise ValueError(
                f"store.resample_on_correct: oversample {roc.oversample} admits {self.admitted_group_size} samples "
                f"per task, more than the gate can always hold (it needs eta x learner.batch_groups >= "
                f"oversample - 1; eta {self.effective_eta}{' (sync mode)' if self.mode == 'sync' else ''}, "
                f"batch_groups {self.learner.batch_groups})")
        return self

    def _judge_only_sources_judged(self) -> None:
        """A source without a program verifier (its plug-in's ``reward_from: judge``, open_ended)
        has only the judge to score it: `judge.sources` must name it, and its held-out split needs
        the evaluator service, whose episodes the grader service judges (``eval.in_mesh: false``
        evaluates in process, with the sources' own graders and no judge)."""
        from trajmesh import plugins

        judge_only = [src.name for src in self.tasks.sources if plugins.source(src.type).reward_from == "judge"]
        if unjudged := [name for name in judge_only if name not in self.judge.sources]:
            raise ValueError(
                f"tasks.sources {unjudged}: no program verifier (no gold answer), only a judge can score it; "
                f"name it in judge.sources (judge.sources: {self.judge.sources}) with the judge's model_path or urls")
        if judge_only and self.eval.in_mesh is False:
            raise ValueError(
                f"eval.in_mesh: false evaluates in process with each source's program grader, and {judge_only} "
                "has none: leave eval.in_mesh unset or true (the evaluator service's episodes are judged by the "
                "grader service)")

    @property
    def effective_eta(self) -> int:
        return 0 if self.mode == "sync" else self.gate.eta

    @property
    def store_endpoints(self) -> list[str]:
        """host:port of each store replica, in replica order (`infra.store_addresses`, else the
        one `infra.store_address`)."""
        if self.infra.store_addresses:
            return list(self.infra.store_addresses)
        if self.store.replicas > 1:
            raise ValueError(f"store.replicas {self.store.replicas} needs infra.store_addresses "
                             "(the launcher and the chart fill it in)")
        return [self.infra.store_address]

    @property
    def batch_trajectories(self) -> int:
        return self.learner.batch_groups * self.tasks.group_size

    @property
    def admitted_group_size(self) -> int:
        """Samples the store admits per task: tasks.group_size, times RoC's oversampling when on."""
        roc = self.store.resample_on_correct
        return self.tasks.group_size * (roc.oversample if roc.enabled else 1)

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def _resolve_tool_format(data: Any) -> Any:
    """A source's ``tool_format: auto`` (or unset) becomes the model's own: ``native`` when its chat
    template knows tool calls (`trajmesh.tokenizer.native_tool_calls`), else ``tags``, once
    ``model.path`` is a local directory (every service loads the same model, so all agree). Without
    one (the demo model is built later; it has no template) auto stays and reads as tags. The tool
    sources are those whose registered config class has the field (`ToolSourceConfig`), by type."""
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict) or not isinstance(data.get("tasks"), dict):
        return data
    path, tasks = data["model"].get("path"), data["tasks"]
    sources = tasks.get("sources")
    if not path or not isinstance(sources, list) or not Path(path).is_dir():
        return data
    from trajmesh import plugins

    tool_sources = {t for t, p in plugins.sources().items() if "tool_format" in p.config.model_fields}
    if not any(isinstance(s, dict) and s.get("type") in tool_sources and s.get("tool_format", "auto") == "auto"
               for s in sources):
        return data
    from trajmesh.tokenizer import native_tool_calls

    fmt = "native" if native_tool_calls(path) else "tags"
    resolved = [{**s, "tool_format": fmt} if isinstance(s, dict) and s.get("type") in tool_sources
                and s.get("tool_format", "auto") == "auto" else s for s in sources]
    return {**data, "tasks": {**tasks, "sources": resolved}}


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            fix = "remove it or check its spelling"
        elif e["type"] == "missing":
            fix = "add it"
        else:
            fix = f"got {e.get('input')!r}"
        lines.append(f"  {key}: {e['msg']} ({fix})")
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load a RunConfig from YAML (None: all defaults), apply dotted-key overrides, validate."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config {p} must be a mapping at the top level, got {type(loaded).__name__}")
        data = loaded
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
