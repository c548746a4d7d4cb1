"""The ``gym`` task source: Gymnasium-style text environments people already have, by import path.
No torch; the environment packages are optional extras (``pip install trajmesh[gym]``) imported on
first use, so this module (and `trajmesh envs`) loads without them.

Three shapes of environment, told apart by ``env``:

* a SkyRL-Gym environment (``skyrl_gym.envs.base_text_env.BaseTextEnv``): a registered id
  (``gsm8k_multi_turn``) or ``package.module:Class``, built as ``Class(env_config=..., extras=row)``
  for each task row; ``init(prompt messages)`` opens the episode, ``step(text)`` answers
  ``{observations, reward, done, metadata}``;
* any other class by ``package.module:Class`` with the Gymnasium API: ``reset(seed=...)`` ->
  ``(observation, info)``, ``step(text)`` -> ``(observation, reward, terminated, truncated, info)``
  (a 4-tuple ``(observation, reward, done, info)`` also works), built as ``Class(**env_config)``;
* a TextArena game, ``textarena:<game id>`` (``textarena:TicTacToe-v0``): the policy plays seat
  ``player`` against a fixed opponent policy (``opponent``); the reward is the game's outcome for
  the policy's seat (TextArena's ``close()``: 1 win, 0 draw, -1 loss), given on the final step.

Tasks: a SkyRL / Gymnasium source takes its rows from ``rows`` (inline) or ``rows_file`` (JSON
lines), one task per row, split into training and held-out by the usual rules (held-out drawn first
with its own seed, training disjoint by prompt); a TextArena source draws one task per game seed
(held-out games use seeds training never does). Every task names the environment, its config and
its row in the metadata, so the environment service and the grader rebuild it from the task alone.

The environment's own rewards are the reward: the grader (graders/gym.py) replays the policy's
turns on a fresh environment, checks the replay reproduces the recorded state hashes, and scores
the episode's return (the sum of the per-step rewards, or the last one: ``reward``), recording each
step's reward as a raw reward component ``step_<k>``.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random
import re
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from trajmesh.config import SourceConfig
from trajmesh.envs.base import StepResult, state_hash
from trajmesh.plugins import SourcePlugin

TEXTARENA_PREFIX = "textarena:"


def package_version(name: str) -> str:
    """The installed version of a distribution, or ``not-installed``."""
    try:
        return importlib_metadata.version(name)
    except importlib_metadata.PackageNotFoundError:
        return "not-installed"


class GymSource(SourceConfig):
    """A Gymnasium-style text environment by import path: SkyRL-Gym's ``BaseTextEnv`` environments,
    any class with the Gymnasium ``reset``/``step`` API, or a TextArena game (envs/gym_env.py)."""

    type: Literal["gym"] = "gym"
    """Selects this source: a Gymnasium-style text environment (SkyRL-Gym, Gymnasium, TextArena)."""
    name: str = "gym"
    """Source name recorded on every task and trajectory (unique across sources)."""
    env: str
    """The environment: a SkyRL-Gym registered id (``gsm8k_multi_turn``), ``package.module:Class``
    (a SkyRL ``BaseTextEnv`` subclass or a Gymnasium-API class), or ``textarena:<game id>``."""
    env_config: dict[str, Any] = Field(default_factory=dict)
    """Passed to the environment's constructor: ``env_config=`` of a SkyRL environment, the keyword
    arguments of a Gymnasium-API class, ``textarena.make(id, **env_config)`` of a game."""
    rows: list[dict[str, Any]] = Field(default_factory=list)
    """The dataset (SkyRL / Gymnasium): one task per row. A row's ``prompt`` (a string or a list of
    ``{role, content}`` messages) opens the episode; the whole row is a SkyRL environment's
    ``extras`` (``reward_spec``, ``extra_info``, ...) and a Gymnasium class's ``reset(options=row)``."""
    rows_file: str = ""
    """A JSON-lines file of rows, read in addition to ``rows``."""
    reward: Literal["sum", "last"] = "sum"
    """The trajectory's reward from the per-step rewards: their sum (the return) or the last one."""
    player: int = Field(0, ge=0)
    """TextArena: the seat the policy plays (0 moves first in most games)."""
    num_players: int = Field(2, ge=1)
    """TextArena: players of the game (the policy plus fixed opponents)."""
    opponent: str = "random"
    """TextArena: the fixed policy of the other seats: ``random`` (a uniformly drawn move among the
    bracketed options of the latest observation, e.g. TicTacToe's ``[4]``, seeded by the game's
    seed), ``first`` (the first such option), or ``package.module:function`` called as
    ``function(observation: str, rng: random.Random) -> str``."""

    @model_validator(mode="after")
    def _has_tasks(self) -> GymSource:
        if not self.env.startswith(TEXTARENA_PREFIX) and not self.rows and not self.rows_file:
            raise ValueError(f"tasks.sources[{self.name}]: a {self.env!r} source needs rows or rows_file")
        if self.env.startswith(TEXTARENA_PREFIX) and self.player >= self.num_players:
            raise ValueError(f"tasks.sources[{self.name}]: player {self.player} of {self.num_players}")
        return self


# ------------------------------------------------------------------ rendering


def render_messages(messages: Any) -> str:
    """The text of a prompt or an observation: a string as is, a list of ``{role, content}``
    messages as their contents joined by blank lines (the rollout's chat template frames it)."""
    if isinstance(messages, str):
        return messages
    if isinstance(messages, dict):
        return str(messages.get("content", ""))
    return "\n\n".join(str(m.get("content", "")) for m in messages or [])


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"environment {path!r} is not 'package.module:Class'")
    return getattr(importlib.import_module(module), name)


def _is_skyrl(cls: Any) -> bool:
    try:
        from skyrl_gym.envs.base_text_env import BaseTextEnv
    except ImportError:
        return False
    return isinstance(cls, type) and issubclass(cls, BaseTextEnv)


def build_text_env(env: str, env_config: dict[str, Any], row: dict[str, Any]) -> tuple[str, Any]:
    """("skyrl" | "gymnasium", the environment instance) for one task row."""
    if ":" not in env:  # a SkyRL-Gym registered id
        import skyrl_gym

        return "skyrl", skyrl_gym.make(env, env_config=dict(env_config), extras=dict(row))
    cls = _load(env)
    if _is_skyrl(cls):
        return "skyrl", cls(env_config=dict(env_config), extras=dict(row))
    return "gymnasium", cls(**env_config)


# ------------------------------------------------------------------ environments


class GymEnv:
    """A SkyRL-Gym or Gymnasium-API text environment, rebuilt from the task's metadata (``env``,
    ``env_config``, ``row``). Each step's reward is the environment's (``StepResult.reward``); the
    state hash covers the prompt, every action, observation and reward, so a replay that diverges
    (a non-deterministic environment) is detected by the grader. An episode depends on the task
    and the actions only, never on the sample's reset seed (every sample of a group meets the same
    environment; a Gymnasium class is reset with ``seed=row["seed"]``, default 0)."""

    revision = f"gym-adapter-v1+skyrl-gym-{package_version('skyrl-gym')}"
    config_keys = ("env", "env_config", "row")

    def reset(self, task: dict[str, Any], seed: int) -> tuple[str, str]:
        m = task["metadata"]
        row = dict(m.get("row") or {})
        self.api, self.env = build_text_env(str(m["env"]), dict(m.get("env_config") or {}), row)
        if self.api == "skyrl":
            messages, _ = self.env.init(row.get("prompt", task["prompt"]))
            obs = render_messages(messages)
        else:
            out = self.env.reset(seed=int(row.get("seed", 0)), options=row)
            obs = render_messages(out[0] if isinstance(out, tuple) else out)
        self.trail: list[Any] = [obs]
        return obs, state_hash(*self.trail)

    def step(self, action: str) -> StepResult:
        if self.api == "skyrl":
            out = self.env.step(action)
            obs, reward, done = render_messages(out.get("observations") or []), float(out["reward"]), bool(out["done"])
            extra = dict(out.get("metadata") or {})
        else:
            out = self.env.step(action)
            if len(out) == 5:
                raw, reward, terminated, truncated, extra = out
                done = bool(terminated or truncated)
            else:
                raw, reward, done, extra = out
            obs, reward, done = render_messages(raw), float(reward), bool(done)
            extra = dict(extra or {})
        if done:
            obs = ""
            self.env.close()
        self.trail += [action, obs, reward]
        info = {"action_type": "TEXT", "step_reward": reward,
                "env_info": json.loads(json.dumps(extra, default=str))}
        return StepResult(obs, done, state_hash(*self.trail), reward=reward, info=info)


BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")


def bracketed_options(observation: str) -> list[str]:
    """The bracketed moves offered in the latest line of `observation` that has any (TextArena's
    ``Available Moves: '[0]', '[4]'``)."""
    for line in reversed(observation.splitlines()):
        found = BRACKETED.findall(line)
        if found:
            return found
    return []


def random_move(observation: str, rng: random.Random) -> str:
    """A uniformly drawn bracketed option of the latest observation ("[0]" when there is none)."""
    options = bracketed_options(observation)
    return rng.choice(options) if options else "[0]"


def first_move(observation: str, rng: random.Random) -> str:
    """The first bracketed option of the latest observation ("[0]" when there is none)."""
    options = bracketed_options(observation)
    return options[0] if options else "[0]"


def opponent_policy(name: str) -> Any:
    return {"random": random_move, "first": first_move}.get(name) or _load(name)


class TextArenaEnv:
    """A TextArena game from the policy's seat: the fixed opponent policy plays every other seat
    (seeded by the task's ``game_seed``, never the sample's reset seed, so every sample of a group
    meets the same opponent) between the policy's turns; each observation is what the game
    showed the policy since its last turn. The game's outcome for the policy's seat is the final
    step's reward (1 win, 0 draw or unfinished, -1 loss); earlier steps get 0."""

    revision = f"textarena-adapter-v1+textarena-{package_version('textarena')}"
    config_keys = ("game", "env_config", "player", "num_players", "opponent", "game_seed")

    def reset(self, task: dict[str, Any], seed: int) -> tuple[str, str]:
        import textarena

        m = task["metadata"]
        self.game = textarena.make(str(m["game"]), **dict(m.get("env_config") or {}))
        self.player, self.opponent = int(m["player"]), opponent_policy(str(m["opponent"]))
        game_seed = int(m["game_seed"])
        self.rng = random.Random(game_seed)
        self.game.reset(num_players=int(m["num_players"]), seed=game_seed)
        self.seen = ""
        self.done, self.outcome = False, 0.0
        self._opponents()
        obs = self._observation()
        self.trail: list[Any] = [obs, game_seed]
        return obs, state_hash(*self.trail)

    @staticmethod
    def scripted_action(observation: str) -> str:
        """A legal move for `observation` (its first bracketed option, as the ``first`` opponent
        plays): the verifier audit (trajmesh/run/audit.py) plays whole games with it."""
        return first_move(observation, random.Random(0))

    def _observation(self) -> str:
        """What the game shows the policy now, less what it was shown before (TextArena's default
        wrappers show the whole history on every turn)."""
        _, full = self.game.get_observation()
        text = full if isinstance(full, str) else "\n".join(f"[{s}] {msg}" for s, msg, *_ in full)
        new = text[len(self.seen):] if text.startswith(self.seen) else text
        self.seen = text
        return new.strip("\n")

    def _opponents(self) -> None:
        """The fixed policy's moves until the policy's seat is to move or the game ends."""
        while not self.done:
            pid, obs = self.game.get_observation()
            if pid == self.player:
                return
            text = obs if isinstance(obs, str) else "\n".join(str(o[1]) for o in obs)
            self._move(str(self.opponent(text, self.rng)))

    def _move(self, action: str) -> None:
        done, _ = self.game.step(action)
        if done:
            self.done = True
            rewards, _ = self.game.close()
            self.outcome = float((rewards or {}).get(self.player) or 0.0)

    def step(self, action: str) -> StepResult:
        self._move(action)
        self._opponents()
        obs = "" if self.done else self._observation()
        reward = self.outcome if self.done else 0.0
        self.trail += [action, obs, reward]
        return StepResult(obs, self.done, state_hash(*self.trail), reward=reward,
                          info={"action_type": "TEXT", "step_reward": reward})


# ------------------------------------------------------------------ tasks


def _rows(src: GymSource) -> list[dict[str, Any]]:
    rows = [dict(r) for r in src.rows]
    if src.rows_file:
        rows += [json.loads(line) for line in Path(src.rows_file).read_text().splitlines() if line.strip()]
    return rows


def _task_id(*parts: object) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


def _answer(row: dict[str, Any]) -> str:
    spec = row.get("reward_spec")
    truth = spec.get("ground_truth") if isinstance(spec, dict) else row.get("answer")
    return "" if truth is None else str(truth)


def draw(src: GymSource, seed: int, n: int, exclude: set[str]) -> list[dict[str, Any]]:
    """The source's task generator (`trajmesh.plugins.SourcePlugin.draw`): `n` rows in an order
    drawn with `seed`, prompts in `exclude` skipped; a TextArena source: `n` games seeded from `seed`."""
    base = {"source": src.name, "grader": "gym", "env_config": dict(src.env_config), "reward": src.reward}
    if src.env.startswith(TEXTARENA_PREFIX):
        game = src.env[len(TEXTARENA_PREFIX):]
        out = []
        for i in range(n):
            game_seed = seed * 1000 + i
            meta = {**base, "environment": "textarena", "game": game, "player": src.player,
                    "num_players": src.num_players, "opponent": src.opponent, "game_seed": game_seed}
            prompt, _ = TextArenaEnv().reset({"prompt": "", "answer": "", "metadata": meta}, 0)
            out.append({"prompt": prompt, "answer": "", "metadata": meta,
                        "task_id": _task_id(src.name, game, src.player, src.opponent, game_seed)})
        return out
    rows = _rows(src)
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order:
        row = rows[i]
        prompt = render_messages(row.get("prompt", ""))
        if prompt in exclude:
            continue
        meta = {**base, "environment": "gym", "env": src.env, "row": row}
        out.append({"prompt": prompt, "answer": _answer(row), "metadata": meta,
                    "task_id": _task_id(src.name, src.env, json.dumps(row, sort_keys=True, default=str))})
        if len(out) == n:
            break
    return out


def split(src: GymSource, n_train: int, n_heldout: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """TextArena games: held-out games are seeded apart from training ones (a game's opening
    observation is often the same whatever the seed, so the split by prompt does not apply); rows
    use the generic split (None)."""
    if not src.env.startswith(TEXTARENA_PREFIX):
        return None
    from trajmesh.tasks import HELDOUT_SEED, TRAIN_SEED

    return draw(src, TRAIN_SEED, n_train, set()), draw(src, HELDOUT_SEED, n_heldout, set())


PLUGIN = SourcePlugin(
    type="gym", config=GymSource, draw=draw, split=split,
    environments={"gym": GymEnv, "textarena": TextArenaEnv},
    graders={"gym": "trajmesh.graders.gym:GymGrader"},
    default_environment="gym", reward_from="environment",
    description="a Gymnasium-style text environment by import path (SkyRL-Gym, Gymnasium, TextArena games); "
                "its own per-step rewards are the reward")
