"""`make bench`: every benchmark, each printing a ratio measured side by side in one run.

Run one with `python bench/run.py NAME` (names: the keys of BENCHES).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
BENCHES = {
    "math": "bench_math.py",            # learner math vs one forward+backward (goal ≤ 0.03)
    "mesh": "bench_mesh.py",            # mesh vs raw JetStream (goal ≥ 0.3); 2 stores vs 1 (≥ 1.6); 64k/4k CPU per 1k tokens (≤ 1.5)
    "async": "bench_async.py",          # async (η=2) vs sync wall time to the same accuracy (goal ≥ 2×)
    "learning": "bench_learning.py",    # async vs sync held-out accuracy vs wall clock, 3 seeds each, 95% CIs (~45 min)
    "verify": "bench_verify.py",        # math / sandboxed-code verifications per second
    "decode": "bench_decode.py",        # the grader's decode: tokenizers library vs byte table
    "learner": "bench_learner.py",      # learner peak memory: 4x/1x batch (goal ≤ 1.2), chunked/naive log-probs (≤ 0.25)
    "systems": "bench_systems.py",      # async (η=1,2,4) vs sync trained tokens/s on a GPU-like timing model (goal ≥ 2×)
    "engines": "bench_engines.py",      # torch engine vs vLLM-CPU tokens/s at 1/8/32 concurrent, weight swap time
    "weights": "bench_weights.py",      # weight sync: full vs delta bytes per version, publish->loaded vs raw I/O
    "vllm_start": "bench_vllm_start.py",  # vLLM-CPU start: compile off, on with an empty / full compile cache
    "prime": "bench_prime.py",          # PRIME (implicit PRM) vs outcome-only RLOO: step time and peak memory on one batch
    "real_model": "bench_real_model.py",  # SmolLM2-135M: rollout vs raw vLLM, learner vs plain loop (goals >= 0.9), train -> step 1
    "judge": "bench_judge.py",          # SmolLM2-135M as judge: agreement of its verdicts with a program verifier (no goal)
}


def _load(path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod  # so process pools can pickle its functions by module name
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str]) -> int:
    names = argv or list(BENCHES)
    for name in names:
        path = HERE / BENCHES[name]
        if not path.exists():
            print(f"== {name}: {path.name} not present, skipped")
            continue
        print(f"== {name} ({path.name})", flush=True)
        start = time.perf_counter()
        _load(path).main([])
        print(f"== {name} done in {time.perf_counter() - start:.0f}s\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
