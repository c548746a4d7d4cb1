"""``make gpu-check``: start a local SGLang server, run the engine conformance suite and every
``gpu``-marked test against it, stop the server.

Run with the Python that has SGLang and its own torch (the GPU image's ``/opt/trajmesh/bin/python``;
never the ``make setup`` venv, whose torch is not SGLang's), on a machine with a CUDA GPU::

    python -m trajmesh.rollout.engines.sglang_check --model /models/Qwen2.5-0.5B-Instruct [--port 30000]
        [--precision auto|bf16|fp32] [--sglang-arg=--enable-deterministic-inference ...]
        [--tests-root DIR] [-- PYTEST ARGS]

The tests come with it: ``--tests-root`` is a directory holding ``tests/`` and the
``pyproject.toml`` that configures pytest — by default the source checkout this module runs from,
else ``<sys.prefix>/share/trajmesh`` (where docker/Dockerfile.gpu installs them).

The server is launched as ``python -m sglang.launch_server --model-path MODEL --port PORT --dtype D``
(D from ``--precision``, the learner.precision the run trains with: the dtype its weights are
published in, ``sglang_dtype``; the Helm chart sets the same; plus ``--sglang-arg`` values), its /health is awaited for ``--startup-s`` seconds, the tests see it via
``TRAJMESH_SGLANG_URL`` and ``TRAJMESH_SGLANG_MODEL``, and the server is stopped by its pid (its
process group) whatever the tests do. Exit status: pytest's, or 2 if the server never came up.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

from trajmesh.rollout.engines.base import wait_healthy
from trajmesh.rollout.engines.engine_client import EngineClient
from trajmesh.service import StartFailed

ROOT = Path(__file__).resolve().parents[2]
SGLANG_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
INSTALLED_TESTS = Path(sys.prefix) / "share" / "trajmesh"
"""Where the GPU image puts the tests and pyproject.toml (docker/Dockerfile.gpu)."""


def tests_root(given: str | None) -> Path | None:
    """The directory with ``tests/`` the check runs: `given`, else the checkout this module is in,
    else ``INSTALLED_TESTS``; None if that one has no ``tests/``."""
    for root in ([Path(given)] if given else [ROOT, INSTALLED_TESTS]):
        if (root / "tests").is_dir():
            return root
    return None


def sglang_dtype(precision: str, cuda: bool = True) -> str:
    """SGLang's ``--dtype`` for a learner trained at ``learner.precision`` (auto: bf16 on CUDA, fp32
    on CPU): the dtype the learner publishes its weights in (learner/weights.export_policy)."""
    if precision == "auto":
        precision = "bf16" if cuda else "fp32"
    return SGLANG_DTYPES[precision]


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log_path: Path) -> bool:
    async with EngineClient(url) as client:
        try:
            await wait_healthy(client, timeout_s, proc=proc, what="SGLang", log_path=log_path, poll_s=2.0)
        except StartFailed as exc:
            print(exc, file=sys.stderr)
            return False
    return True


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model directory SGLang serves (also read by the tests)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--startup-s", type=float, default=1800.0, help="how long to wait for /health")
    parser.add_argument("--precision", choices=["auto", *SGLANG_DTYPES], default="auto",
                        help="learner.precision of the run (sets SGLang's --dtype; auto: bf16, a GPU learner's)")
    parser.add_argument("--sglang-arg", action="append", default=[], help="extra launch_server argument")
    parser.add_argument("--log", default="sglang-check.log", help="SGLang's stdout/stderr")
    parser.add_argument("--tests-root", help=f"directory with tests/ and pyproject.toml (default: the checkout, "
                                             f"else {INSTALLED_TESTS})")
    args, pytest_args = parser.parse_known_args(argv)
    if any(a.startswith("--dtype") for a in args.sglang_arg):
        parser.error("--dtype follows --precision (the dtype the learner publishes weights in); set that")
    root = tests_root(args.tests_root)
    if root is None:
        print(f"no tests/ in {args.tests_root or f'{ROOT} or {INSTALLED_TESTS}'}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("sglang") is None:
        print(f"SGLang is not installed for {sys.executable}: run this with the GPU image's Python "
              "(docs/ENGINE.md, make gpu-check GPU_PYTHON=...)", file=sys.stderr)
        return 2
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model, "--host", "127.0.0.1",
           "--port", str(args.port), "--dtype", sglang_dtype(args.precision), *args.sglang_arg]
    with open(args.log, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if not asyncio.run(_wait_healthy(url, proc, args.startup_s, Path(args.log))):
            print(f"SGLang did not become healthy (see {args.log})", file=sys.stderr)
            return 2
        env = dict(os.environ, TRAJMESH_SGLANG_URL=url, TRAJMESH_SGLANG_MODEL=args.model)
        tests = [sys.executable, "-m", "pytest", "-m", "gpu", str(root / "tests"), "-q", "-rs",
                 *[a for a in pytest_args if a != "--"]]
        return subprocess.call(tests, cwd=root, env=env)
    finally:
        _stop(proc)


if __name__ == "__main__":
    sys.exit(main())
