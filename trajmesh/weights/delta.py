"""Delta weight sync: per version only the tensors whose bytes changed, a full anchor now and then,
and the rollout's reconstruction of the full checkpoint on its own disk (docs/ARCHITECTURE.md
"Weights"). Torch-free: the learner hands raw tensor bytes in, the rollout reads files.

On the shared volume, one directory per version (``weights/v{version:06d}-{ns}``, renamed into place
whole by the learner), with ``weights.sync: delta``::

    anchor   model.safetensors (full)  weights-manifest.json  [weights-delta.bin]  config.json …
    delta                              weights-manifest.json   weights-delta.bin   config.json …

The manifest names the version, its base (the previous version's directory), its anchor, the
safetensors header, the sha256 of the full file, and per tensor, where its bytes changed since the
base, its encoding and where the blob lies in ``weights-delta.bin``. Each blob
is one of (``encode_delta`` picks the smallest of those the fraction of changed elements says can
win):

    xor_planes_zstd     XOR against the base, split into byte planes (every element's byte 0, then
                        every byte 1, …), zstd: in bf16 the XOR's high byte is nearly always 0
    sparse_planes_zstd  the changed elements' indices, gap-coded as uint32, and their XOR values,
                        each split into byte planes, zstd (with an 8-byte count in front)
    xor_zstd            XOR + zstd (for 1-byte elements, whose planes are the bytes themselves)
    sparse_zstd         gap-coded indices + XOR values + zstd, no planes (no longer written; read
                        where a volume still holds it)

The zstd frames carry their content checksum (older directories' frames may not). An anchor
carries the delta against its base too, so a pod one version behind never reads a full file. The
manifest's ``file_sha256`` and the directory's ``model.safetensors.sha256`` are the sha256 of the
full file (the same bytes ``weights.sync: full`` writes), the announcement's checksum: the one hash
each side computes, streamed on a thread of its own (the learner while it encodes, the rollout
while it writes the rebuilt file). Manifests of format 1 also carry a sha256 per tensor, which
nothing reads any more.

On a rollout pod (`LocalWeights`)::

    announced dir ─▶ chain of manifests back to the copy on local disk (incremental path)
                  │  or back to the nearest anchor (anchor path: late joiner, missed versions)
                  ▼
    per tensor: base bytes ─▶ apply each delta ─▶ local model.safetensors (and the file's sha256)
                                                       │
    once written: file sha256 == manifest? ─▶ renamed into place
                   │ no (or a delta frame's checksum, a file missing or unreadable)
                   ▼
    incremental path failed: the anchor path, counted in
    trajmesh_rollout_weight_anchor_fallback_updates_total

A directory without a manifest (the base model, ``weights.sync: full``) is loaded as it is.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zstandard
from prometheus_client import Counter

from trajmesh.weights.layout import version_dirs

__all__ = ["DELTA_NAME", "MANIFEST_NAME", "SAFETENSORS_NAME", "DeltaWriter", "LocalWeights", "WeightSyncError",
           "WeightSyncTimeout", "is_delta_dir", "prunable", "reconstruct"]

log = logging.getLogger("trajmesh.weights.delta")

SAFETENSORS_NAME = "model.safetensors"
MANIFEST_NAME = "weights-manifest.json"
DELTA_NAME = "weights-delta.bin"
FORMAT = "trajmesh-weights/2"
READABLE_FORMATS = ("trajmesh-weights/1", FORMAT)
"""Format 1 also held a sha256 per tensor (the rollout checked each one and the file's); format 2
drops them: the file's sha256 covers the same bytes, so each side hashes the checkpoint once."""
WEIGHT_FILES = {SAFETENSORS_NAME, MANIFEST_NAME, DELTA_NAME}
"""What a reconstruction writes itself; every other file of a version directory is copied."""

ANCHOR_FALLBACKS = Counter(
    "trajmesh_rollout_weight_anchor_fallback_updates_total",
    "Weight updates whose incremental reconstruction failed (checksum, missing or unreadable delta) "
    "and were rebuilt from the anchor")

# Unsigned integer of each safetensors dtype's element size: XOR and sparse indices work per element.
_ELEMENT = {"F64": np.uint64, "I64": np.uint64, "F32": np.uint32, "I32": np.uint32, "BF16": np.uint16,
            "F16": np.uint16, "I16": np.uint16, "BOOL": np.uint8, "U8": np.uint8, "I8": np.uint8}
_SPARSE_MAX_ELEMENTS = 1 << 32  # gap-coded indices are uint32
_WINDOW = 8  # tensors decoded ahead of the writer (at least; see _window)


def _window(threads: int) -> int:
    """Tensors in flight on a pool of `threads`: _WINDOW, or 2 per thread with more threads."""
    return max(_WINDOW, 2 * threads)


class WeightSyncError(RuntimeError):
    """A version could not be reconstructed: which file or tensor, and why."""


class WeightSyncTimeout(WeightSyncError):
    """A reconstruction ran past its deadline; the message names what it was waiting for."""


# ---------------------------------------------------------------------------------- encoding
def _elements(data: np.ndarray, dtype: str) -> np.ndarray:
    et = _ELEMENT.get(dtype, np.uint8)
    return data.view(et) if data.nbytes % np.dtype(et).itemsize == 0 else data


def _planes(a: np.ndarray) -> np.ndarray:
    """The bytes of `a`'s elements as byte planes: every element's byte 0, then every byte 1, …
    In bf16 at RL learning rates an XOR's high byte is nearly always 0: one plane of zeros."""
    return np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.itemsize).T).reshape(-1)


def _from_planes(raw: np.ndarray, n: int, et: np.dtype[Any]) -> np.ndarray:
    """`n` elements of type `et` from their byte planes (`_planes`); byte 0 is the first in memory."""
    le = np.dtype(et).newbyteorder("<")
    out = raw[:n].astype(le)
    for b in range(1, le.itemsize):
        out |= raw[b * n:(b + 1) * n].astype(le) << (8 * b)
    return out


def _sparse(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gaps between the changed elements' indices (uint32, the first from 0), their XOR values)."""
    idx = np.flatnonzero(x != 0)  # nonzero of a bool mask: ~6x faster than of x itself
    gaps = np.empty(idx.size, "<u4")  # straight into uint32: no int64 temporaries
    if idx.size:
        gaps[0] = idx[0]
        np.subtract(idx[1:], idx[:-1], out=gaps[1:], casting="unsafe")
    return gaps, x[idx]


def _enc_xor(x: np.ndarray, cctx: zstandard.ZstdCompressor) -> bytes:
    return cctx.compress(x.data)


def _enc_xor_planes(x: np.ndarray, cctx: zstandard.ZstdCompressor) -> bytes:
    return cctx.compress(_planes(x).data)


def _enc_sparse(x: np.ndarray, cctx: zstandard.ZstdCompressor) -> bytes:
    gaps, vals = _sparse(x)
    return struct.pack("<Q", gaps.size) + cctx.compress(gaps.tobytes() + vals.tobytes())


def _enc_sparse_planes(x: np.ndarray, cctx: zstandard.ZstdCompressor) -> bytes:
    gaps, vals = _sparse(x)
    return struct.pack("<Q", gaps.size) + cctx.compress(np.concatenate((_planes(gaps), _planes(vals))).data)


_ENCODERS: dict[str, Callable[[np.ndarray, zstandard.ZstdCompressor], bytes]] = {
    "xor_zstd": _enc_xor, "xor_planes_zstd": _enc_xor_planes,
    "sparse_zstd": _enc_sparse, "sparse_planes_zstd": _enc_sparse_planes}
"""Every encoding `apply_delta` reads. ``encode_delta`` builds only the planes ones and, for 1-byte
elements (whose planes are the bytes themselves), xor_zstd. On the bench's model (one version's
changed tensors, bf16) the planes forms came to 1.25 % / 5.8 % of the bytes at lr 1e-6 / 1e-5,
sparse_zstd to 1.8 % / 8.9 %, xor_zstd to 2.4 % / 10.7 %. sparse_zstd is no longer written;
directories on a volume may still hold it."""
ENCODINGS = tuple(_ENCODERS)

_SPARSE_BELOW = 0.75
"""Fraction of changed elements below which the sparse form is built. Measured (bench/bench_weights.py's
model at lr 1e-6 and 1e-5, 2-15 % changed; N(0, 0.02) weights through bf16 at lr 1e-7…1e-3): the
sparse planes are the smaller up to ~50 % changed, the XOR planes from ~60 %."""
_DENSE_FROM = 0.25
"""Fraction of changed elements from which the dense (XOR) form is built."""


def encode_delta(new: np.ndarray, old: np.ndarray, dtype: str, level: int = 1,
                 encodings: Collection[str] | None = None) -> tuple[str, bytes]:
    """(encoding, blob) of `new` against `old` (uint8 arrays of one tensor's bytes): the smallest of
    `encodings` (names in `ENCODINGS`), by default of those that can win at the fraction of
    elements that changed: sparse (gap-coded uint32 indices of the changed elements + their XOR)
    below `_SPARSE_BELOW`, dense (the XOR of every element) from `_DENSE_FROM`, both between; each
    split into byte planes before zstd (level `level`, with a content checksum)."""
    x = np.bitwise_xor(_elements(new, dtype), _elements(old, dtype))
    return _encode(x, level, encodings)


def _encode(x: np.ndarray, level: int, encodings: Collection[str] | None = None,
            changed: int | None = None) -> tuple[str, bytes]:
    if encodings is None:
        changed = int(np.count_nonzero(x)) if changed is None else changed
        fraction = changed / max(x.size, 1)
        sparse = fraction < _SPARSE_BELOW and x.size < _SPARSE_MAX_ELEMENTS
        encodings = ["sparse_planes_zstd"] if sparse else []
        if fraction >= _DENSE_FROM or not sparse:
            encodings.append("xor_zstd" if x.itemsize == 1 else "xor_planes_zstd")
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
    blobs = [(enc, _ENCODERS[enc](x, cctx)) for enc in encodings]
    return min(blobs, key=lambda b: len(b[1]))


def _decompress(blob: bytes | memoryview, size: int) -> np.ndarray:
    """The `size` bytes a zstd frame holds, into a fresh writable array; ValueError if it holds
    another number of bytes (a corrupted frame: zstandard.ZstdError)."""
    out = np.empty(size, np.uint8)
    view, got = out.data, 0
    with zstandard.ZstdDecompressor().stream_reader(blob) as reader:
        while got < size and (n := reader.readinto(view[got:])):
            got += n
        if got != size or reader.read(1):
            raise ValueError(f"delta frame holds {'more than ' if got == size else ''}{got} bytes, "
                             f"the tensor {size}")
    return out


def apply_delta(base: np.ndarray, enc: str, blob: bytes | memoryview, dtype: str) -> np.ndarray:
    """The bytes `encode_delta` encoded, from `base` (not modified) and the blob."""
    b = _elements(base, dtype)
    et, n = b.dtype, b.size
    if enc in ("xor_zstd", "xor_planes_zstd"):
        raw = _decompress(blob, b.nbytes)
        x = raw.view(et) if enc == "xor_zstd" else _from_planes(raw, n, et)
        return np.bitwise_xor(x, b, out=x).view(np.uint8)
    if enc not in ("sparse_zstd", "sparse_planes_zstd"):
        raise ValueError(f"unknown delta encoding {enc!r}")
    (k,) = struct.unpack_from("<Q", blob)
    if k > n:
        raise ValueError(f"sparse delta of {k} elements, the tensor holds {n}")
    raw = _decompress(blob[8:], k * (4 + b.itemsize))
    if enc == "sparse_zstd":
        gaps, vals = raw[:4 * k].view("<u4"), raw[4 * k:].view(et)
    else:
        gaps, vals = _from_planes(raw, k, np.dtype(np.uint32)), _from_planes(raw[4 * k:], k, et)
    idx = np.cumsum(gaps, dtype=np.int64)
    if k and idx[-1] >= n:
        raise ValueError("sparse delta index past the tensor's end")
    out = b.copy()
    out[idx] ^= vals
    return out.view(np.uint8)


def header_tensors(header: bytes) -> list[tuple[str, str, int, int]]:
    """(name, dtype, start, end) per tensor of a safetensors header (8-byte length + JSON), offsets
    into the data section, in file order."""
    (n,) = struct.unpack_from("<Q", header)
    meta = json.loads(header[8:8 + n])
    out = [(k, v["dtype"], *v["data_offsets"]) for k, v in meta.items() if k != "__metadata__"]
    return sorted(out, key=lambda t: t[2])


class _OrderedHash:
    """sha256 of buffers fed in order, hashed on a thread of its own (hashlib releases the GIL) so
    the feeder goes on meanwhile; at most _WINDOW buffers behind it."""

    def __init__(self, first: bytes) -> None:
        self._sha = hashlib.sha256(first)
        self._pool = ThreadPoolExecutor(1)
        self._pending: deque[Future[None]] = deque()

    def update(self, data: bytes | memoryview) -> None:
        self._pending.append(self._pool.submit(self._sha.update, data))
        if len(self._pending) > _WINDOW:
            self._pending.popleft().result()

    def hexdigest(self) -> str:
        while self._pending:
            self._pending.popleft().result()
        self._pool.shutdown()
        return self._sha.hexdigest()

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


# ---------------------------------------------------------------------------------- learner side
class DeltaWriter:
    """The learner's writer rank's delta publisher, kept across versions: holds the last committed
    version's tensor bytes (one model's worth of host memory) as the base of the next delta.

    Per version: ``begin`` (a fresh directory), ``add`` per tensor in file order, ``finish`` (the
    manifest; returns the full file's sha256), then ``commit`` with the directory's final name once
    it is in place. A version not committed (``abort``, or an error) leaves no base: the next is an
    anchor. So is the first, every ``anchor_every``-th after an anchor, and the one after
    ``anchor_next``."""

    def __init__(self, anchor_every: int, level: int = 1, threads: int = 4) -> None:
        if anchor_every < 1:
            raise ValueError("anchor_every must be >= 1")
        self.anchor_every = anchor_every
        self.level = level
        self.threads = threads
        """Tensors encoded at once (zstd and numpy release the GIL)."""
        self._base: dict[str, np.ndarray] = {}
        self._base_name: str | None = None
        self._anchor_name: str | None = None
        self._since_anchor = 0
        self._anchor_next = False
        self._open: dict[str, Any] | None = None
        self.last_bytes_written = 0
        """Bytes of weight files (full file, delta file) the last ``finish`` wrote."""

    def begin(self, out_dir: str | os.PathLike[str], header: bytes, version: int) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        anchor = self._base_name is None or self._since_anchor + 1 >= self.anchor_every or self._anchor_next
        full = open(out / SAFETENSORS_NAME, "wb") if anchor else None  # noqa: SIM115 - closed in finish/abort
        if full is not None:
            full.write(header)
        delta = open(out / DELTA_NAME, "wb") if self._base_name is not None else None  # noqa: SIM115
        file_sha = _OrderedHash(header)
        self._open = {"out": out, "header": header, "version": version, "anchor": anchor, "full": full,
                      "delta": delta, "delta_len": 0, "sha": file_sha, "tensors": [], "next": {},
                      "pool": ThreadPoolExecutor(self.threads), "encoding": deque()}

    def add(self, name: str, data: bytes, dtype: str) -> None:
        st = self._open
        assert st is not None, "add() before begin()"
        new = np.frombuffer(data, dtype=np.uint8)
        st["sha"].update(data)
        if st["full"] is not None:
            st["full"].write(data)
        old = self._base.pop(name, None)  # popped: the base never holds more than one model
        if st["delta"] is not None and (old is None or old.nbytes != new.nbytes):
            raise WeightSyncError(f"tensor {name}: not in the base version, or resized")
        entry: dict[str, Any] = {"name": name}
        st["tensors"].append(entry)
        st["next"][name] = new
        level = self.level

        def encode() -> tuple[str | None, bytes]:
            """(encoding, blob); no encoding where there is no base or nothing changed. No hash:
            the file's sha256 (streamed in `add`) is the one check of these bytes."""
            if old is None:
                return None, b""
            x = np.bitwise_xor(_elements(new, dtype), _elements(old, dtype))
            changed = int(np.count_nonzero(x))
            if not changed:
                return None, b""
            return _encode(x, level, changed=changed)

        st["encoding"].append((entry, st["pool"].submit(encode)))
        if len(st["encoding"]) >= _window(self.threads):
            self._write_encoded(st, 1)

    def _write_encoded(self, st: dict[str, Any], n: int) -> None:
        """The oldest `n` encodings under way into the delta file, in order."""
        for _ in range(min(n, len(st["encoding"]))):
            entry, future = st["encoding"].popleft()
            enc, blob = future.result()
            if enc is not None:
                entry["delta"] = {"enc": enc, "offset": st["delta_len"], "length": len(blob)}
                st["delta"].write(blob)
                st["delta_len"] += len(blob)

    def finish(self) -> str:
        """Writes the manifest and closes the files; the full file's sha256."""
        try:
            return self._finish()
        except BaseException:
            self.abort()
            raise

    def _finish(self) -> str:
        st = self._open
        assert st is not None, "finish() before begin()"
        self._write_encoded(st, len(st["encoding"]))
        st["pool"].shutdown()
        written = len(st["header"]) + sum(int(a.nbytes) for a in st["next"].values()) if st["anchor"] else 0
        for key in ("full", "delta"):
            if st[key] is not None:
                st[key].close()
        sha = st["sha"].hexdigest()
        manifest = {"format": FORMAT, "version": st["version"], "anchor": st["anchor"],
                    "base": self._base_name, "anchor_name": None if st["anchor"] else self._anchor_name,
                    "file_sha256": sha, "header": base64.b64encode(st["header"]).decode(),
                    "delta_bytes": st["delta_len"], "tensors": st["tensors"]}
        (st["out"] / MANIFEST_NAME).write_text(json.dumps(manifest, separators=(",", ":")))
        self.last_bytes_written = written + st["delta_len"]
        return sha

    def commit(self, name: str) -> None:
        """The version finished is in place as directory `name`: it becomes the base."""
        st = self._open
        assert st is not None, "commit() before finish()"
        self._base, self._base_name = st["next"], name
        if st["anchor"]:
            self._anchor_name, self._since_anchor, self._anchor_next = name, 0, False
        else:
            self._since_anchor += 1
        self._open = None

    def anchor_next(self) -> None:
        """The next version written is a full anchor (on demand: a rollout could rebuild no version
        from the current anchor, `announce.request_anchor`); the count to the next periodic one
        restarts from it."""
        self._anchor_next = True

    def abort(self) -> None:
        """Drops the version under way; the base is gone (partly replaced): the next is an anchor."""
        st, self._open = self._open, None
        if st is not None:
            st["pool"].shutdown(cancel_futures=True)
            st["sha"].close()
            for key in ("full", "delta"):
                if st[key] is not None:
                    st[key].close()
        self._base, self._base_name, self._anchor_name = {}, None, None


# ---------------------------------------------------------------------------------- manifests
@dataclass
class _Version:
    path: Path
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def anchor(self) -> bool:
        return bool(self.manifest["anchor"])


def is_delta_dir(path: str | os.PathLike[str]) -> bool:
    """A version directory written by ``weights.sync: delta`` (it has a manifest)."""
    return (Path(path) / MANIFEST_NAME).is_file()


def _read(path: Path) -> _Version:
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, ValueError) as exc:
        raise WeightSyncError(f"manifest {path / MANIFEST_NAME}: {exc}") from exc
    if manifest.get("format") not in READABLE_FORMATS:
        raise WeightSyncError(f"manifest {path / MANIFEST_NAME}: format {manifest.get('format')!r}, "
                              f"not one of {READABLE_FORMATS}")
    return _Version(path, manifest)


def _back_to(target: Path, stop: Callable[[_Version], bool], floor: int = -1) -> list[_Version]:
    """Manifests from `target` back through its bases to the first one `stop` accepts, oldest
    first; raises where the chain breaks (no base, a base missing) or goes below version `floor`."""
    chain = [_read(target)]
    while not stop(chain[-1]):
        base = chain[-1].manifest["base"]
        if base is None or chain[-1].manifest["version"] <= floor:
            raise WeightSyncError(f"{chain[-1].path}: no base to reach it from")
        chain.append(_read(target.parent / base))
    return chain[::-1]


def prunable(root: str | os.PathLike[str], keep: int, grace_s: float, now: float | None = None) -> list[Path]:
    """Version directories under `root` that may be deleted: not among the newest `keep`, not on
    the way from one of those back to its anchor (anchor + deltas since: what a pod reconstructing
    them reads), and older than `grace_s`. Directories without a manifest are their own anchor."""
    now = time.time() if now is None else now
    dirs = version_dirs(root)
    needed = set(dirs[-keep:]) if keep > 0 else set()
    for d in dirs[-keep:] if keep > 0 else []:
        if not is_delta_dir(d):
            continue
        try:
            needed.update(v.path for v in _back_to(d, lambda v: v.anchor))
        except WeightSyncError as exc:  # a broken chain: keep everything that could still be part of it
            log.warning("retention: %s", exc)
            return []
    return [d for d in dirs if d not in needed and now - d.stat().st_mtime > grace_s]


# ---------------------------------------------------------------------------------- rollout side
class _Files:
    """Read-only maps of the files a reconstruction reads, named in errors; `waiting` says which
    one is being read (what a reconstruction past its deadline waits for)."""

    def __init__(self) -> None:
        self.maps: dict[Path, mmap.mmap | bytes] = {}
        self.waiting = "nothing yet"

    def get(self, path: Path) -> mmap.mmap | bytes:
        if path not in self.maps:
            self.waiting = f"opening {path}"
            try:
                with open(path, "rb") as fh:
                    size = os.fstat(fh.fileno()).st_size
                    self.maps[path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            except OSError as exc:
                raise WeightSyncError(f"{path}: {exc}") from exc
        return self.maps[path]

    def close(self) -> None:
        for m in self.maps.values():
            if isinstance(m, mmap.mmap):
                try:
                    m.close()
                except BufferError:  # a view still held (an error's traceback): closed when collected
                    pass
        self.maps.clear()


def _ordered(pool: ThreadPoolExecutor, fn: Callable[[Any], Any], items: list[Any],
             window: int = _WINDOW) -> Iterator[Any]:
    """fn over items on the pool, results in order, at most `window` in flight."""
    pending: deque[Future[Any]] = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _plan(target: Path, base: tuple[str, Path, int] | None) -> tuple[list[_Version], Path, str]:
    """(deltas to apply oldest first, the full file they apply to, its version's name): from `base`
    = (name, model.safetensors, version) of a verified copy, or from `target`'s nearest anchor."""
    if base is not None:
        name, file, version = base
        return _back_to(target, lambda v: v.manifest["base"] == name, floor=version), file, name
    chain = _back_to(target, lambda v: v.anchor)
    return chain[1:], chain[0].path / SAFETENSORS_NAME, chain[0].name


def reconstruct(target: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                base: tuple[str, str | os.PathLike[str], int] | None = None, files: _Files | None = None,
                threads: int = 4) -> str:
    """The full checkpoint of version directory `target` as `out_dir` (written beside it, renamed
    into place): from `base` = (name, model.safetensors, version) of the copy of a version it
    holds, and the deltas since; without one from the nearest anchor. The file is hashed as it is
    written (on a thread of its own) and renamed into place only when that sha256 is the manifest's
    ``file_sha256`` (the one check: any wrong byte of any tensor fails it; a delta frame's own
    checksum fails earlier, naming its tensor); returns the file's sha256."""
    target, out = Path(target), Path(out_dir)
    files = files or _Files()
    chain, base_file, base_name = _plan(target, None if base is None else (base[0], Path(base[1]), base[2]))
    tip = chain[-1] if chain else _read(target)
    header = base64.b64decode(tip.manifest["header"])
    base_map = files.get(base_file)
    if bytes(base_map[:len(header)]) != header:
        raise WeightSyncError(f"{base_file}: its header is not version {tip.manifest['version']}'s")
    deltas = [memoryview(files.get(v.path / DELTA_NAME)) for v in chain]  # every one opened up front
    per_version = [{t["name"]: t.get("delta") for t in v.manifest["tensors"]} for v in chain]

    def build(tensor: tuple[str, str, int, int]) -> np.ndarray:
        name, dtype, start, end = tensor
        data = np.frombuffer(base_map, np.uint8, count=end - start, offset=len(header) + start)
        for v, blobs, entries in zip(chain, deltas, per_version, strict=True):
            d = entries.get(name)
            if d is not None:
                try:
                    data = apply_delta(data, d["enc"], blobs[d["offset"]:d["offset"] + d["length"]], dtype)
                except (ValueError, zstandard.ZstdError, struct.error) as exc:
                    raise WeightSyncError(f"tensor {name}: delta in {v.path / DELTA_NAME}: {exc}") from exc
        return data

    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    sha = _OrderedHash(header)
    try:
        files.waiting = f"the tensors of {target} from {base_name} ({len(chain)} deltas)"
        with open(tmp / SAFETENSORS_NAME, "wb") as fh, ThreadPoolExecutor(threads) as pool:
            fh.write(header)
            for data in _ordered(pool, build, header_tensors(header), _window(threads)):
                sha.update(data.data)
                fh.write(data.data)
        digest = sha.hexdigest()
        if digest != tip.manifest["file_sha256"]:
            raise WeightSyncError(f"{target}: sha256 mismatch: the file rebuilt from {base_file} + the deltas "
                                  f"of {[v.name for v in chain]} is not version {tip.manifest['version']}'s")
        for f in target.iterdir():
            if f.is_file() and f.name not in WEIGHT_FILES:
                shutil.copy(f, tmp / f.name)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        sha.close()
        for m in deltas:
            m.release()
        shutil.rmtree(tmp, ignore_errors=True)
    return digest


class LocalWeights:
    """The rollout's reconstructed checkpoint on its own disk (`local_dir`): the copy the engine
    loads and the base of the next incremental reconstruction. ``prepare`` returns the directory to
    point the engine at; ``loaded`` after the engine loaded it (older local copies are deleted)."""

    def __init__(self, local_dir: str | os.PathLike[str], threads: int = 4) -> None:
        self.local_dir = Path(local_dir)
        self.threads = threads
        self.current: tuple[str, int] | None = None
        """(name, version) of the version directory whose verified copy is local_dir/<name>."""
        self.prepared: dict[str, int] = {}
        """Versions of the local copies `prepare` wrote, by name (until `loaded` prunes them)."""
        self.files: _Files | None = None
        """The reconstruction under way (what it reads), None between them."""

    def waiting_on(self) -> str:
        """What the reconstruction under way is reading (for a deadline's error)."""
        return self.files.waiting if self.files is not None else "nothing"

    def prepare(self, version_dir: str | os.PathLike[str], sha256: str = "") -> Path:
        """The directory the engine should load for announced `version_dir`: it as it is when it
        has no manifest, else its local reconstruction (incremental from the local copy where the
        chain of bases reaches it, else from the anchor; a failed incremental one is rebuilt from
        the anchor and counted). Raises `WeightSyncError` when that fails too, or when `sha256`
        (the announcement's) is not the manifest's."""
        target = Path(version_dir)
        if not is_delta_dir(target):
            return target
        manifest = _read(target).manifest
        if sha256 and manifest["file_sha256"] != sha256:
            raise WeightSyncError(f"{target}: the manifest's sha256 is not the announcement's")
        out = self.local_dir / target.name
        self.files = files = _Files()
        try:
            base = self._base()
            if base is not None and _reaches(target, base):
                try:
                    reconstruct(target, out, base=base, files=files, threads=self.threads)
                    self.prepared[out.name] = int(manifest["version"])
                    return out
                except WeightSyncError as exc:
                    ANCHOR_FALLBACKS.inc()
                    log.warning("weights v%s from the local copy failed (%s); rebuilding from the anchor",
                                manifest["version"], exc)
                    files.close()
                    self.files = files = _Files()
            reconstruct(target, out, files=files, threads=self.threads)
            self.prepared[out.name] = int(manifest["version"])
            return out
        finally:
            files.close()
            self.files = None

    def _base(self) -> tuple[str, Path, int] | None:
        if self.current is None:
            return None
        name, version = self.current
        file = self.local_dir / name / SAFETENSORS_NAME
        return (name, file, version) if file.is_file() else None

    def loaded(self, path: str | os.PathLike[str]) -> None:
        """The engine holds `path` now: its local copy becomes the base; the other copies go."""
        p = Path(path)
        if p.parent != self.local_dir or p.name not in self.prepared:
            return  # a directory loaded as it is (no manifest): the local copy stays the base
        self.current = (p.name, self.prepared[p.name])
        self.prepared = {p.name: self.current[1]}
        for other in self.local_dir.iterdir():
            if other != p and other.is_dir():
                shutil.rmtree(other, ignore_errors=True)


def _reaches(target: Path, base: tuple[str, Path, int]) -> bool:
    """Whether `target`'s chain of bases reaches the version `base` names (manifests readable)."""
    try:
        _plan(target, base)
        return True
    except WeightSyncError:
        return False
