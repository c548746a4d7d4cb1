"""A stateful multi-turn tool environment over SQLite: a small workplace assistant. No torch.

The database (employees, tasks, meetings) is a pure function of the task's ``db_seed``; the goal is
one of four templates (close a task, reassign someone's open tasks, create a task, schedule a
meeting). Each turn the policy either calls one tool::

    <tool>{"name": "update_task", "arguments": {"task_id": 3, "status": "done"}}</tool>

or, in the model's native format (envs/base.py), ``<tool_call>{...same JSON...}</tool_call>``
(typed by the JSON schemas in ``TOOLS``; bad JSON is a parser error, a schema mismatch an invalid
action, both answered with ``<error>``, or ``{"error": ...}`` for a native call), or ends with
``<done/>``. Verification is by final state:
the grader replays the action log on a fresh instance and compares the state hash with the hash
the reference solution reaches (`expected_state_hash`). The state hash (sha256 over every table's
rows in key order) is returned after every step, keys GiGPO's anchor-state groups (survey §7.7),
and is the same whatever the reset seed: the seed is recorded, never folded into the state.
"""

from __future__ import annotations

import hashlib
import json
import random
import sqlite3
from typing import Any, Literal

from pydantic import Field

from trajmesh.config import ToolSourceConfig
from trajmesh.envs.base import StepResult, first_tag, function_schemas, native_instruction, parse_native
from trajmesh.plugins import SourcePlugin


class WorkplaceSource(ToolSourceConfig):
    """The SQLite workplace assistant (envs/workplace.py), verified by final state."""

    type: Literal["workplace"] = "workplace"
    """Selects this source: the SQLite workplace assistant."""
    name: str = "workplace"
    """Source name recorded on every task and trajectory (unique across sources)."""
    n_employees: int = Field(6, ge=2, le=12)
    """Employees in each generated database."""
    n_tasks: int = Field(8, ge=1)
    """Work items in each generated database."""
    pool_size: int = Field(2000, gt=0)
    """Training tasks generated at most (each builds a database); the sampler cycles through them."""


FIRST = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena"]
DEPTS = ["eng", "ops", "sales"]
TITLES = ["budget review", "fix login", "hire intern", "ship v2", "audit logs", "plan offsite",
          "update docs", "renew certs", "clean backlog", "demo prep"]

TOOLS: dict[str, dict[str, Any]] = {
    "find_employee": {"description": "Look up employees by name.",
                      "parameters": {"type": "object", "required": ["name"],
                                     "properties": {"name": {"type": "string"}}}},
    "list_tasks": {"description": "List tasks, optionally by assignee and status.",
                   "parameters": {"type": "object", "required": [],
                                  "properties": {"assignee_id": {"type": "integer"},
                                                 "status": {"type": "string", "enum": ["open", "done"]}}}},
    "update_task": {"description": "Change a task's status and/or assignee.",
                    "parameters": {"type": "object", "required": ["task_id"],
                                   "properties": {"task_id": {"type": "integer"},
                                                  "status": {"type": "string", "enum": ["open", "done"]},
                                                  "assignee_id": {"type": "integer"}}}},
    "create_task": {"description": "Create an open task.",
                    "parameters": {"type": "object", "required": ["title", "assignee_id"],
                                   "properties": {"title": {"type": "string"}, "assignee_id": {"type": "integer"}}}},
    "schedule_meeting": {"description": "Schedule a meeting (day 1-5, hour 9-17).",
                         "parameters": {"type": "object", "required": ["title", "attendee_ids", "day", "hour"],
                                        "properties": {"title": {"type": "string"},
                                                       "attendee_ids": {"type": "array", "items": {"type": "integer"}},
                                                       "day": {"type": "integer", "minimum": 1, "maximum": 5},
                                                       "hour": {"type": "integer", "minimum": 9, "maximum": 17}}}},
}
NATIVE_INSTRUCTION = native_instruction(TOOLS, "end with <done/>.")
"""The instruction line of a task whose source has ``tool_format: native``."""
_TYPES = {"string": str, "integer": int, "array": list, "object": dict}


class ToolError(ValueError):
    """An invalid tool call (unknown tool, schema mismatch, missing row)."""


def validate(name: str, args: Any) -> None:
    """Checks ``args`` against the tool's JSON schema (the subset used in ``TOOLS``)."""
    if name not in TOOLS:
        raise ToolError(f"unknown tool {name!r}; tools: {sorted(TOOLS)}")
    schema = TOOLS[name]["parameters"]
    if not isinstance(args, dict):
        raise ToolError("arguments must be an object")
    for key in schema["required"]:
        if key not in args:
            raise ToolError(f"{name}: missing argument {key!r}")
    for key, value in args.items():
        prop = schema["properties"].get(key)
        if prop is None:
            raise ToolError(f"{name}: unknown argument {key!r}")
        want = _TYPES[prop["type"]]
        if not isinstance(value, want) or isinstance(value, bool):
            raise ToolError(f"{name}: {key} must be {prop['type']}")
        if isinstance(value, list) and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ToolError(f"{name}: {key} must hold integers")
        if "enum" in prop and value not in prop["enum"]:
            raise ToolError(f"{name}: {key} must be one of {prop['enum']}")
        if "minimum" in prop and not prop["minimum"] <= value <= prop["maximum"]:
            raise ToolError(f"{name}: {key} must be in [{prop['minimum']}, {prop['maximum']}]")


def build_db(db_seed: int, n_employees: int = 6, n_tasks: int = 8) -> sqlite3.Connection:
    rng = random.Random(f"workplace-db|{db_seed}")
    # A session's steps may run on different worker threads (the environment service's to_thread,
    # the evaluation loop's pool), never two at once: sqlite's same-thread check would refuse them.
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.executescript(
        "CREATE TABLE employees(id INTEGER PRIMARY KEY, name TEXT, dept TEXT);"
        "CREATE TABLE tasks(id INTEGER PRIMARY KEY, title TEXT, assignee_id INTEGER, status TEXT);"
        "CREATE TABLE meetings(id INTEGER PRIMARY KEY, title TEXT, day INTEGER, hour INTEGER);"
        "CREATE TABLE attendees(meeting_id INTEGER, employee_id INTEGER);"
    )
    names = rng.sample(FIRST, n_employees)
    db.executemany("INSERT INTO employees VALUES (?,?,?)",
                   [(i + 1, n, rng.choice(DEPTS)) for i, n in enumerate(names)])
    db.executemany("INSERT INTO tasks VALUES (?,?,?,?)",
                   [(i + 1, rng.choice(TITLES), rng.randrange(1, n_employees + 1), rng.choice(["open", "open", "done"]))
                    for i in range(n_tasks)])
    db.commit()  # so a rolled-back invalid tool call never undoes the initial state
    return db


def db_hash(db: sqlite3.Connection) -> str:
    h = hashlib.sha256()
    for table in ("employees", "tasks", "meetings", "attendees"):
        for row in db.execute(f"SELECT * FROM {table} ORDER BY 1, 2"):
            h.update(json.dumps([table, *row]).encode())
    return h.hexdigest()[:16]


def call_tool(db: sqlite3.Connection, name: str, args: dict[str, Any]) -> Any:
    validate(name, args)
    if name == "find_employee":
        return [dict(zip(("id", "name", "dept"), r, strict=True))
                for r in db.execute("SELECT * FROM employees WHERE lower(name) = lower(?)", (args["name"],))]
    if name == "list_tasks":
        q, p = "SELECT * FROM tasks WHERE 1=1", []
        for key in ("assignee_id", "status"):
            if key in args:
                q += f" AND {key} = ?"
                p.append(args[key])
        return [dict(zip(("id", "title", "assignee_id", "status"), r, strict=True)) for r in db.execute(q + " ORDER BY id", p)]
    if name == "update_task":
        if db.execute("SELECT 1 FROM tasks WHERE id = ?", (args["task_id"],)).fetchone() is None:
            raise ToolError(f"no task {args['task_id']}")
        for key in ("status", "assignee_id"):
            if key in args:
                db.execute(f"UPDATE tasks SET {key} = ? WHERE id = ?", (args[key], args["task_id"]))
        return {"ok": True}
    if name == "create_task":
        (n,) = db.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM tasks").fetchone()
        db.execute("INSERT INTO tasks VALUES (?,?,?,?)", (n, args["title"], args["assignee_id"], "open"))
        return {"task_id": n}
    (n,) = db.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM meetings").fetchone()
    db.execute("INSERT INTO meetings VALUES (?,?,?,?)", (n, args["title"], args["day"], args["hour"]))
    db.executemany("INSERT INTO attendees VALUES (?,?)", [(n, e) for e in sorted(set(args["attendee_ids"]))])
    return {"meeting_id": n}


def parse_action(action: str) -> tuple[str, dict[str, Any]] | None:
    """(tool, arguments) for a ``<tool>`` block; None when the turn has none. Raises ValueError on bad JSON."""
    body = first_tag(action, "tool")
    if body is None:
        return None
    call = json.loads(body)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError('a tool call is {"name": ..., "arguments": {...}}')
    return call["name"], call.get("arguments", {})


class WorkplaceEnv:
    revision = "workplace-v1"
    config_keys = ("n_employees", "n_tasks")
    invalid_actions = ("schema",)
    """`info.invalid_action` reasons its steps report (the environment service pre-creates their series)."""

    def reset(self, task: dict[str, Any], seed: int) -> tuple[str, str]:
        meta = task.get("metadata", {})
        self.seed = seed
        self.db = build_db(int(meta["db_seed"]), int(meta.get("n_employees", 6)), int(meta.get("n_tasks", 8)))
        self.actions: list[str] = []
        return str(task["prompt"]), db_hash(self.db)

    def state_hash(self) -> str:
        return db_hash(self.db)

    def step(self, action: str) -> StepResult:
        self.actions.append(action)
        native = parse_native(action)
        if native is not None and native.call is None:
            return StepResult(f"error: parse: {native.error}", False, self.state_hash(),
                              info={"action_type": "TOOL_CALL", "parser_error": True})
        if native is not None and native.call is not None:
            return self._call(native.call.name, native.call.arguments, native=True)
        try:
            parsed = parse_action(action)
        except ValueError as exc:  # json.JSONDecodeError included
            return StepResult(f"<error>parse: {exc}</error>\n", False, self.state_hash(),
                              info={"action_type": "TOOL_CALL", "parser_error": True})
        if parsed is None:
            return StepResult("", True, self.state_hash(), info={"action_type": "TEXT"})
        return self._call(*parsed, native=False)

    def _call(self, name: str, args: Any, *, native: bool) -> StepResult:
        """Runs one tool call in a transaction (rolled back when invalid). The answer is the result's
        JSON, inside ``<result>``/``<error>`` unless it goes back as a native tool message."""
        request = json.dumps({"name": name, "arguments": args}, sort_keys=True)
        try:
            with self.db:
                result = call_tool(self.db, name, args)
        except ToolError as exc:
            obs = json.dumps({"error": str(exc)}) if native else f"<error>{exc}</error>\n"
            return StepResult(obs, False, self.state_hash(), info={
                "action_type": "TOOL_CALL", "invalid_action": "schema",
                "tool_call": {"name": name, "request": request, "response": obs, "status": "invalid",
                              "latency_s": 0.0, "native": native}})
        text = json.dumps(result, sort_keys=True)
        obs = text if native else f"<result>{text}</result>\n"
        return StepResult(obs, False, self.state_hash(), info={
            "action_type": "TOOL_CALL",
            "tool_call": {"name": name, "request": request, "response": obs, "status": "ok", "latency_s": 0.0,
                          "native": native}})


# --------------------------------------------------------------------------- tasks

def _goal(rng: random.Random, db: sqlite3.Connection) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """A goal sentence and a reference solution (tool calls) for it."""
    emps = db.execute("SELECT id, name FROM employees ORDER BY id").fetchall()
    tasks = db.execute("SELECT id, title, assignee_id, status FROM tasks ORDER BY id").fetchall()
    kind = rng.randrange(4)
    open_tasks = [t for t in tasks if t[3] == "open"]
    if kind == 0 and open_tasks:
        t = rng.choice(open_tasks)
        return f"Mark task {t[0]} as done.", [("update_task", {"task_id": t[0], "status": "done"})]
    if kind == 1 and open_tasks:
        src = rng.choice(open_tasks)[2]
        dst = rng.choice([e for e in emps if e[0] != src])
        name = dict(emps)[src]
        calls = [("update_task", {"task_id": t[0], "assignee_id": dst[0]}) for t in open_tasks if t[2] == src]
        return f"Reassign {name}'s open tasks to {dst[1]}.", calls
    a, b = rng.sample(emps, 2)
    title = rng.choice(TITLES)
    if kind == 2:
        return f"Create task '{title}' for {a[1]}.", [("create_task", {"title": title, "assignee_id": a[0]})]
    day, hour = rng.randrange(1, 6), rng.randrange(9, 18)
    return (f"Schedule '{title}' with {a[1]} and {b[1]} on day {day} at {hour}.",
            [("schedule_meeting", {"title": title, "attendee_ids": sorted([a[0], b[0]]), "day": day, "hour": hour})])


def expected_state_hash(metadata: dict[str, Any]) -> str:
    """The state the reference solution reaches (what verification compares against)."""
    db = build_db(int(metadata["db_seed"]), int(metadata.get("n_employees", 6)), int(metadata.get("n_tasks", 8)))
    for name, args in metadata["solution"]:
        with db:
            call_tool(db, name, args)
    return db_hash(db)


def make_tasks(seed: int, n: int, *, n_employees: int = 6, n_tasks: int = 8, source: str = "workplace",
               exclude: set[str] | None = None, tool_format: str = "tags") -> list[dict[str, Any]]:
    """``n`` tasks; metadata carries the reference solution and the tools' JSON schemas (``tools``,
    the list a chat template's ``tools`` takes). ``tool_format`` picks the prompt's call syntax."""
    out: list[dict[str, Any]] = []
    seen = set(exclude or ())
    k = 0
    while len(out) < n:
        db_seed = seed * 100_003 + k
        k += 1
        rng = random.Random(f"workplace-goal|{db_seed}")
        goal, solution = _goal(rng, build_db(db_seed, n_employees, n_tasks))
        prompt = (NATIVE_INSTRUCTION if tool_format == "native"
                  else f"Tools: {','.join(TOOLS)}. Use <tool>json</tool>, end with <done/>.\n") + goal
        key = f"{db_seed}|{goal}"
        if key in seen:
            continue
        seen.add(key)
        meta = {"source": source, "grader": "workplace", "environment": "workplace", "db_seed": db_seed,
                "n_employees": n_employees, "n_tasks": n_tasks, "goal": goal,
                "solution": [[name, args] for name, args in solution], "tools": function_schemas(TOOLS)}
        out.append({"prompt": prompt, "answer": expected_state_hash(meta),
                    "task_id": hashlib.sha256(f"{source}|{key}".encode()).hexdigest()[:16], "metadata": meta})
    return out


def draw(src: WorkplaceSource, seed: int, n: int, exclude: set[str]) -> list[dict[str, Any]]:
    """The source's task generator (`trajmesh.plugins.SourcePlugin.draw`): at most ``pool_size`` tasks."""
    tasks = make_tasks(seed, min(n, src.pool_size), n_employees=src.n_employees, n_tasks=src.n_tasks,
                       source=src.name, tool_format=src.tool_format)
    return [t for t in tasks if t["prompt"] not in exclude]


PLUGIN = SourcePlugin(
    type="workplace", config=WorkplaceSource, draw=draw, environments={"workplace": WorkplaceEnv},
    graders={"workplace": "trajmesh.graders.workplace:WorkplaceGrader"},
    description="SQLite workplace assistant, verified by the database's final state")
