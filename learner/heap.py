"""Giving freed heap memory back to the OS (glibc ``malloc_trim``). No torch.

PyTorch's CPU allocator takes tensors from the C heap. glibc keeps what is freed there for reuse,
so a learner step's activations and a checkpoint's copies (DeepSpeed clones the model and optimizer
state before it saves) stay resident after they are freed: SmolLM2-135M's learner held 6.3 GB
between steps, 10.5 GB after its first checkpoint, and the kernel's OOM killer chose it on a
shared machine (docs/RESULTS.md, "SmolLM2-135M-Instruct learns basic arithmetic"). Trimmed after
each step and checkpoint, the same engine holds about 2 GB between them; the next step faults its
pages in again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def release_free_heap() -> bool:
    """Return the pages of freed heap memory to the OS (``malloc_trim(0)``); False where the C
    library cannot (nothing happens)."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
