"""The torch engine versus vLLM-CPU, side by side in one run: the same model, the same requests.

Both engines serve the demo model's shape (a tiny Llama, 128 wide, 4 layers, 4 heads of 32, built
here with a second set of weights to load) and start the way a rollout process starts them (the
torch engine server; the `vllm` plug-in's server from ``.venv-vllm``, ``make setup-vllm``). For each,
with the same prompts and sampling (T = 1, a fixed number of new tokens, EOS ignored):

* generated tokens/s at 1, 8 and 32 concurrent requests (each request its own HTTP call, as the
  rollout's samples are on vLLM; the torch engine batches concurrent calls per round);
* the weight-swap time the rollout pays per version: pause → load the other weights → resume, median
  of `--swaps`.

Prints one JSON line per engine and the ratios ``vllm_vs_torch_tokens_per_s_<n>`` and
``vllm_vs_torch_weight_swap_ratio``. Start-up times are reported too (they are paid once per
rollout process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trajmesh.infra import free_port
from trajmesh.learner.models import build_char_tokenizer, build_tiny_model, encode_prompt
from trajmesh.rollout.engines.base import wait_healthy
from trajmesh.rollout.engines.engine_client import EngineClient
from trajmesh.rollout.engines.vllm_engine import VLLMEngine, VLLMEngineConfig, start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["12+7-3=", "34-5+6=", "1+2+3+4=", "9-8+7=", "50-25=", "3+3-1=", "18+2=", "7+8-9="]


def _build(root: Path) -> tuple[str, str, Any]:
    tok = build_char_tokenizer(root / "tok")
    build_tiny_model(root / "a", root / "tok", seed=0)
    build_tiny_model(root / "b", root / "tok", seed=1)
    return str(root / "a"), str(root / "b"), tok


async def _throughput(client: Any, prompts: list[list[int]], concurrency: int, new_tokens: int, rounds: int) -> float:
    """Generated tokens per second with `concurrency` requests in flight, `rounds` waves."""
    sp = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    await asyncio.gather(*(client.generate(prompts[i % len(prompts)], sp) for i in range(concurrency)))  # warm
    start, tokens = time.perf_counter(), 0
    for _ in range(rounds):
        results = await asyncio.gather(*(client.generate(prompts[i % len(prompts)], sp) for i in range(concurrency)))
        tokens += sum(len(r.output_ids) for r in results)
    return tokens / (time.perf_counter() - start)


async def _swap(client: Any, paths: tuple[str, str], swaps: int) -> float:
    """Median seconds of pause → update_weights_from_disk → resume, alternating the two weight sets."""
    times = []
    for i in range(swaps):
        start = time.perf_counter()
        await client.pause()
        await client.update_weights_from_disk(paths[(i + 1) % 2], version=i + 1)
        await client.resume()
        times.append(time.perf_counter() - start)
    await client.update_weights_from_disk(paths[0], version=swaps + 1)
    return statistics.median(times)


async def _measure(client: Any, proc: subprocess.Popen[bytes], paths: tuple[str, str], prompts: list[list[int]],
                   args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"startup_s": round(await wait_healthy(client, args.startup_timeout_s, proc=proc, poll_s=0.2), 1)}
    for n in args.concurrency:
        out[f"tokens_per_s_{n}"] = round(await _throughput(client, prompts, n, args.new_tokens, args.rounds), 1)
    out["weight_swap_s"] = round(await _swap(client, paths, args.swaps), 4)
    return out


def _torch(model: str, root: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(root / "torch-engine.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen([sys.executable, "-m", "trajmesh.rollout.engines.engine_server", "--model", model, "--port",
                             str(port), "--host", "127.0.0.1", "--version", "0", "--threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=40, help="tokens per request (the model has 64 positions)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--swaps", type=int, default=5)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        root = Path(tmp)
        a, b, tok = _build(root)
        prompts = [encode_prompt(tok, t) for t in PROMPTS]
        results: dict[str, dict[str, Any]] = {}
        proc, url = _torch(a, root)
        try:
            results["torch"] = asyncio.run(_run(EngineClient(url), proc, (a, b), prompts, args))
        finally:
            stop_server(proc)
        print(json.dumps({"engine": "torch", **results["torch"]}), flush=True)
        cfg = VLLMEngineConfig(python=args.vllm_python)
        port = free_port()
        proc = start_server(cfg, a, port, root / "vllm.log")
        try:
            results["vllm"] = asyncio.run(_run(VLLMEngine(f"http://127.0.0.1:{port}", proc=proc), proc, (a, b),
                                               prompts, args))
        finally:
            stop_server(proc)
        print(json.dumps({"engine": "vllm", **results["vllm"]}), flush=True)
    ratios = {f"vllm_vs_torch_tokens_per_s_{n}": round(results["vllm"][f"tokens_per_s_{n}"]
                                                       / results["torch"][f"tokens_per_s_{n}"], 2)
              for n in args.concurrency}
    ratios["vllm_vs_torch_weight_swap_ratio"] = round(results["vllm"]["weight_swap_s"]
                                                      / results["torch"]["weight_swap_s"], 2)
    print(json.dumps(ratios))


async def _run(client: Any, proc: subprocess.Popen[bytes], paths: tuple[str, str], prompts: list[list[int]],
               args: argparse.Namespace) -> dict[str, Any]:
    async with client:
        return await _measure(client, proc, paths, prompts, args)


if __name__ == "__main__":
    main(sys.argv[1:])
