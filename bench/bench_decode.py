"""The grader's decode of sampled tokens: the `tokenizers` library against trajmesh's byte table
(`trajmesh.tokenizer.TokenBytes`), side by side in one run, CPU time of this process.

For each tokenizer (SmolLM2-135M-Instruct's 49,152-id ByteLevel BPE when `make models` has
imported it; the demo's character tokenizer always), random ids of 4,096 and 65,536 tokens (a
response's sampled span, as `GraderService._sample` hands it over: a numpy array), decoded both
ways; the texts must be equal. Prints ms per decode and `table_over_library` (lower is better).
"""

from __future__ import annotations

import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from trajmesh.tokenizer import TextTokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[1]


def _library(tok: TextTokenizer, ids: np.ndarray) -> str:
    """What the grader's decode was before the table: the library's, from a list of ids."""
    return str(tok.tokenizer.decode(ids.tolist(), skip_special_tokens=True))


def _per_call_ms(fn, arg, seconds: float = 1.0) -> float:  # type: ignore[no-untyped-def]
    fn(arg)
    n, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        fn(arg)
        n += 1
    return (time.process_time() - start) / n * 1e3


def main(argv: list[str] | None = None) -> None:
    tokenizers = []
    smollm2 = REPO / ".models" / "smollm2-135m-instruct"
    if (smollm2 / "tokenizer.json").is_file():
        tokenizers.append(("SmolLM2-135M-Instruct (ByteLevel BPE)", smollm2))
    else:
        print(f"{smollm2} missing (`make models`): SmolLM2's vocabulary skipped")
    demo = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    from trajmesh.learner.models import build_char_tokenizer

    build_char_tokenizer(demo)
    tokenizers.append(("demo character tokenizer (Fuse)", demo))
    rng = np.random.default_rng(0)
    for name, path in tokenizers:
        tok = load_tokenizer(path)
        assert tok.table is not None, name
        for length in (4096, 65536):
            ids = rng.integers(0, tok.vocab_size, length)
            library = partial(_library, tok)
            if library(ids) != tok.decode(ids):
                raise SystemExit(f"{name}: the table's text differs from the library's")
            lib_ms, table_ms = _per_call_ms(library, ids), _per_call_ms(tok.decode, ids)
            print(f"{name}, {length} tokens: library {lib_ms:.3f} ms, table {table_ms:.3f} ms per decode; "
                  f"table_over_library={table_ms / lib_ms:.3f}")


if __name__ == "__main__":
    main()
