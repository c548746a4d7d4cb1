"""Verifications per second on this machine with a process pool: math (math-verify) and sandboxed code.

For scale, AceReason reports 1,024 math verifications in 3.9 s and 1,024 code verifications in
552 s on 64 processes.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

N_MATH, N_CODE = 256, 32


def _math(i: int) -> bool:
    from trajmesh.graders.math import equivalent

    return equivalent(f"\\frac{{{i}}}{{{i + 1}}}", f"{i}/{i + 1}")


def _code(i: int) -> bool:
    from trajmesh.graders import Sample, make_grader

    task: dict[str, Any] = {"metadata": {"tests": [f"assert f({i}) == {i * i}", "assert f(3) == 9"]}}
    return make_grader("code").grade(Sample("```python\ndef f(x):\n    return x * x\n```"), task).reward == 1.0


def _rate(fn: Any, n: int, workers: int) -> tuple[float, int]:
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(fn, range(workers)))  # warm the workers (imports)
        start = time.perf_counter()
        ok = sum(pool.map(fn, range(n)))
    return n / (time.perf_counter() - start), ok


def main(argv: list[str] | None = None) -> None:
    workers = os.cpu_count() or 1
    rate, ok = _rate(_math, N_MATH, workers)
    print(f"math-verify: {rate:.1f} verifications/s ({ok}/{N_MATH} equivalent, {workers} processes)")
    rate, ok = _rate(_code, N_CODE, workers)
    print(f"sandboxed code: {rate:.1f} verifications/s ({ok}/{N_CODE} passed, {workers} processes)")


if __name__ == "__main__":
    main()
