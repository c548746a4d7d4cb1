"""Delta weight sync (trajmesh/weights/delta.py): the learner writes only what changed plus anchors;
a rollout rebuilds every version bitwise from its local copy or the anchor, checks every checksum,
falls back to the anchor on a bad delta (counted), catches up late, and retention keeps what a pod
needs. Real files, a real tiny model trained with real AdamW steps at an RL learning rate; the
expected bytes are those of the full export (``weights.sync: full``)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from tiny_llama import tiny_llama

from trajmesh.config import load_config
from trajmesh.learner.weights import export_policy
from trajmesh.services.rollout import RolloutService
from trajmesh.v1 import trajectory_pb2
from trajmesh.weights import announce
from trajmesh.weights import delta as delta_mod
from trajmesh.weights.delta import (
    DELTA_NAME,
    ENCODINGS,
    MANIFEST_NAME,
    SAFETENSORS_NAME,
    DeltaWriter,
    LocalWeights,
    WeightSyncError,
    WeightSyncTimeout,
    apply_delta,
    encode_delta,
    header_tensors,
    prunable,
    reconstruct,
)
from trajmesh.weights.layout import temp_dir_name, version_dir_name

FALLBACKS = "trajmesh_rollout_weight_anchor_fallback_updates_total"
VERSIONS = 6
ANCHOR_EVERY = 3  # anchors: v1, v4


def _fallbacks() -> float:
    return REGISTRY.get_sample_value(FALLBACKS) or 0.0


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _train_and_publish(root: Path, versions: int = VERSIONS, anchor_every: int = ANCHOR_EVERY) -> dict[int, Path]:
    """Real AdamW steps (lr 1e-5) on a tiny Llama; after each, the full export (the expected bytes,
    in root/full/v{n}) and the delta publish into root/weights as the learner does (temp dir,
    rename, commit). Returns the published directory per version."""
    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    writer = DeltaWriter(anchor_every)
    dirs: dict[int, Path] = {}
    (root / "weights").mkdir(parents=True)
    for v in range(1, versions + 1):
        ids = torch.randint(0, 30, (4, 12))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        export_policy(model, root / "full" / f"v{v}", dtype=torch.bfloat16)
        tmp = root / "weights" / temp_dir_name(v)
        sha = export_policy(model, tmp, dtype=torch.bfloat16, delta=writer, version=v)
        assert sha == _sha(root / "full" / f"v{v}" / SAFETENSORS_NAME)
        final = root / "weights" / version_dir_name(v, ns=v)
        os.replace(tmp, final)
        writer.commit(final.name)
        dirs[v] = final
    return dirs


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Path]]:
    root = tmp_path_factory.mktemp("delta")
    return root, _train_and_publish(root)


def _copy(published: tuple[Path, dict[int, Path]], dest: Path) -> dict[int, Path]:
    """A private copy of the published weights dir (a test may corrupt or prune it)."""
    root, dirs = published
    shutil.copytree(root / "weights", dest)
    return {v: dest / d.name for v, d in dirs.items()}


def test_encodings_round_trip_and_the_smaller_one_is_picked() -> None:
    """20 of 2**20 elements changed: indices + values (~120 bytes) beat 2 MiB of XOR zeros through
    zstd; every element changed: the XOR blob is smaller than 6 bytes an element."""
    rng = np.random.default_rng(0)
    old = rng.integers(0, 1 << 16, 1 << 20, dtype=np.uint16)
    few = old.copy()
    few[rng.choice(old.size, 20, replace=False)] ^= 3
    every = old ^ rng.integers(1, 8, old.size, dtype=np.uint16)
    for new, want in ((few, "sparse_planes_zstd"), (every, "xor_planes_zstd")):
        enc, blob = encode_delta(new.view(np.uint8), old.view(np.uint8), "BF16")
        assert enc == want
        assert np.array_equal(apply_delta(old.view(np.uint8), enc, blob, "BF16"), new.view(np.uint8))
    assert len(encode_delta(few.view(np.uint8), old.view(np.uint8), "BF16")[1]) < 200


def _bf16(w: torch.Tensor) -> np.ndarray:
    return w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)


def _typical_bf16_delta(step: str) -> tuple[np.ndarray, np.ndarray]:
    """(new, old) bytes of a 1,024 x 1,024 bf16 weight ~ N(0, 0.02) (fp32 master) after one update:
    "adam", each element moves ~1e-5 (an AdamW step at lr 1e-5: ~20 % of the bf16 values change);
    "relative", each by a 1e-5 fraction of itself (well under 1 % change)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1 << 20, generator=g) * 0.02
    noise = torch.randn(w.shape, generator=g)
    moved = w + 1e-5 * noise if step == "adam" else w * (1 + 1e-5 * noise)
    return _bf16(moved), _bf16(w)


@pytest.mark.parametrize(("step", "at_most"), [("adam", 0.75), ("relative", 0.9)])
def test_a_typical_bf16_delta_picks_a_planes_encoding_smaller_than_the_old_ones(step: str, at_most: float) -> None:
    """Byte planes put the XOR's nearly always zero high bytes (and the gaps' high bytes) in runs
    zstd removes: the pick is a planes encoding, no larger than what either older encoding gives,
    and clearly smaller than the better of them (measured: 0.66x after the AdamW-sized step, 0.85x
    after the relative one)."""
    new, old = _typical_bf16_delta(step)
    changed = np.count_nonzero(new.view(np.uint16) != old.view(np.uint16)) / (new.size // 2)
    assert (0.1 < changed < 0.4) if step == "adam" else (0 < changed < 0.01)
    enc, blob = encode_delta(new, old, "BF16")
    assert enc in ("xor_planes_zstd", "sparse_planes_zstd")
    older = {e: len(encode_delta(new, old, "BF16", encodings=[e])[1]) for e in ("xor_zstd", "sparse_zstd")}
    assert all(len(blob) <= size for size in older.values()), (enc, len(blob), older)
    assert len(blob) <= at_most * min(older.values()), (enc, len(blob), older)
    assert np.array_equal(apply_delta(old, enc, blob, "BF16"), new)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(["BF16", "F32", "F64", "U8"]), elements=st.integers(0, 200),
       odd=st.integers(0, 3), dense=st.booleans())
def test_every_encoding_round_trips(data: st.DataObject, dtype: str, elements: int, odd: int, dense: bool) -> None:
    """Any bytes, any changes, every encoding (the older ones stay readable): bf16, fp32, fp64, u8
    and tensors whose byte count is no multiple of the element size (coded per byte)."""
    size = elements * {"BF16": 2, "F32": 4, "F64": 8, "U8": 1}[dtype] + odd
    old = np.frombuffer(data.draw(st.binary(min_size=size, max_size=size)), np.uint8)
    if dense:
        new = np.frombuffer(data.draw(st.binary(min_size=size, max_size=size)), np.uint8)
    else:
        new = old.copy()
        for i, v in data.draw(st.lists(st.tuples(st.integers(0, max(size - 1, 0)), st.integers(1, 255)),
                                       max_size=size)):
            new[i] ^= v
    for enc in [None, *ENCODINGS]:
        got, blob = encode_delta(new, old, dtype, encodings=None if enc is None else [enc])
        assert enc is None or got == enc
        assert np.array_equal(apply_delta(old, got, blob, dtype), new), got


@pytest.mark.parametrize("enc", ["xor_planes_zstd", "sparse_planes_zstd"])
def test_a_corrupted_planes_blob_never_decodes_to_wrong_bytes(enc: str) -> None:
    """Every single-byte flip of a planes blob is refused by apply_delta (the frame's checksum, its
    size, the element count), never turned into other weights the rollout would hash and drop."""
    new, old = _typical_bf16_delta("adam")
    new, old = new[:8192], old[:8192]  # 4,096 elements: every byte of the blob flipped below
    got, blob = encode_delta(new, old, "BF16", encodings=[enc])
    refused = 0
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x10
        try:
            out = apply_delta(old, enc, bytes(bad), "BF16")
        except (ValueError, zstandard.ZstdError):
            refused += 1
            continue
        assert np.array_equal(out, new), f"byte {i} of {len(blob)} flipped: wrong weights"
    assert refused > 0.9 * len(blob)  # the rest decode right (e.g. a flip in a frame header field zstd ignores)


def _write_raw(writer: DeltaWriter, root: Path, v: int, tensors: dict[str, np.ndarray]) -> Path:
    """One version of raw bf16 tensors through `writer` (temp dir, rename, commit)."""
    offsets, meta = 0, {}
    for name, t in tensors.items():
        meta[name] = {"dtype": "BF16", "shape": [t.size // 2], "data_offsets": [offsets, offsets + t.size]}
        offsets += t.size
    js = json.dumps(meta).encode()
    tmp = root / f".v{v}.tmp"
    writer.begin(tmp, len(js).to_bytes(8, "little") + js, v)
    for name, t in tensors.items():
        writer.add(name, t.tobytes(), "BF16")
    writer.finish()
    final = root / version_dir_name(v, ns=0)
    os.replace(tmp, final)
    writer.commit(final.name)
    return final


def test_an_unchanged_tensor_has_no_delta_and_a_corrupted_planes_blob_names_its_tensor(tmp_path: Path) -> None:
    """v2 changes one tensor: only it has a (planes) delta, the other no entry but its name; the
    rebuild is v2's bytes. One byte of that blob flipped: the rebuild fails naming the tensor and
    the delta file (the blob's own check), not only the sha256 after it."""
    new, old = _typical_bf16_delta("adam")
    same = np.arange(4096, dtype=np.uint16).view(np.uint8)
    writer = DeltaWriter(anchor_every=10)
    v1 = _write_raw(writer, tmp_path, 1, {"a": old, "b": same})
    v2 = _write_raw(writer, tmp_path, 2, {"a": new, "b": same.copy()})
    m1, m2 = (json.loads((d / MANIFEST_NAME).read_text())["tensors"] for d in (v1, v2))
    assert [t["name"] for t in m2 if "delta" in t] == ["a"]
    assert m2[0]["delta"]["enc"] in ("xor_planes_zstd", "sparse_planes_zstd")
    assert m2[1] == m1[1] == {"name": "b"}
    base = (v1.name, v1 / SAFETENSORS_NAME, 1)
    reconstruct(v2, tmp_path / "ok", base=base)
    header_len = (tmp_path / "ok" / SAFETENSORS_NAME).stat().st_size - new.size - same.size
    assert (tmp_path / "ok" / SAFETENSORS_NAME).read_bytes()[header_len:] == new.tobytes() + same.tobytes()
    blob = bytearray((v2 / DELTA_NAME).read_bytes())
    blob[m2[0]["delta"]["offset"] + m2[0]["delta"]["length"] // 2] ^= 0x01
    (v2 / DELTA_NAME).write_bytes(bytes(blob))
    with pytest.raises(WeightSyncError, match=f"tensor a: delta in {v2 / DELTA_NAME}"):
        reconstruct(v2, tmp_path / "bad", base=base)


def test_delta_sync_rebuilds_every_version_bitwise(published: tuple[Path, dict[int, Path]], tmp_path: Path) -> None:
    """A pod following every version rebuilds each from its previous local copy; the file is the
    full export's, byte for byte, the delta versions hold no full file and their weight bytes are a
    fraction of it, and the torch engine loads the rebuilt checkpoint with the learner's tensors."""
    root, dirs = published
    pod = LocalWeights(tmp_path / "local")
    before = _fallbacks()
    for v, d in dirs.items():
        expected = root / "full" / f"v{v}" / SAFETENSORS_NAME
        out = pod.prepare(d, sha256=_sha(expected))
        assert (out / SAFETENSORS_NAME).read_bytes() == expected.read_bytes(), f"v{v}"
        assert out.parent == tmp_path / "local" and (out / "config.json").is_file()
        pod.loaded(out)
        assert [p.name for p in (tmp_path / "local").iterdir()] == [d.name]  # older local copies deleted
        anchor = v in (1, 4)
        assert (d / SAFETENSORS_NAME).exists() == anchor
        if not anchor:
            assert (d / DELTA_NAME).stat().st_size < 0.5 * expected.stat().st_size
    assert _fallbacks() == before
    from safetensors.torch import load_file

    from trajmesh.rollout.engines.engine_server import stored_dtype
    from trajmesh.rollout.engines.hf_model import load_causal_lm

    # The torch engine's load (load_served_model without the tokenizer this model has none of).
    engine_model = load_causal_lm(str(out), dtype=stored_dtype(out), attn_implementation="eager")
    want = load_file(str(root / "full" / f"v{VERSIONS}" / SAFETENSORS_NAME))
    got = engine_model.state_dict()
    assert all(torch.equal(got[k], t) for k, t in want.items())


def test_a_corrupted_delta_falls_back_to_the_anchor_and_is_counted(
        published: tuple[Path, dict[int, Path]], tmp_path: Path) -> None:
    root, _ = published
    dirs = _copy(published, tmp_path / "weights")
    pod = LocalWeights(tmp_path / "local")
    pod.loaded(pod.prepare(dirs[3]))
    # v4 is an anchor that also carries its delta against v3: the pod at v3 reads that delta.
    blob = bytearray((dirs[4] / DELTA_NAME).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (dirs[4] / DELTA_NAME).write_bytes(bytes(blob))
    before = _fallbacks()
    out = pod.prepare(dirs[5])
    assert _fallbacks() == before + 1
    assert (out / SAFETENSORS_NAME).read_bytes() == (root / "full" / "v5" / SAFETENSORS_NAME).read_bytes()
    pod.loaded(out)
    # A delta missing where the pod's only path needs it: counted, then a loud error naming it.
    (dirs[6] / DELTA_NAME).unlink()
    with pytest.raises(WeightSyncError, match=DELTA_NAME):
        pod.prepare(dirs[6])
    assert _fallbacks() == before + 2
    assert pod.current == (dirs[5].name, 5)  # the engine's copy stays the base


def test_a_corrupted_local_copy_is_rebuilt_from_the_anchor(
        published: tuple[Path, dict[int, Path]], tmp_path: Path) -> None:
    root, dirs = published
    pod = LocalWeights(tmp_path / "local")
    out = pod.prepare(dirs[1])
    pod.loaded(out)
    local = bytearray((out / SAFETENSORS_NAME).read_bytes())
    local[-3] ^= 0x01  # one bit of the last tensor on the pod's disk
    (out / SAFETENSORS_NAME).write_bytes(bytes(local))
    before = _fallbacks()
    rebuilt = pod.prepare(dirs[2])
    assert _fallbacks() == before + 1
    assert (rebuilt / SAFETENSORS_NAME).read_bytes() == (root / "full" / "v2" / SAFETENSORS_NAME).read_bytes()


def test_a_delta_that_decodes_to_wrong_bytes_is_caught_by_the_file_sha256_and_falls_back(
        published: tuple[Path, dict[int, Path]], tmp_path: Path) -> None:
    """A delta blob that is a valid frame of the wrong XOR (one bit of one tensor off; its zstd
    checksum holds): only the rebuilt file's sha256 can find it. The pod at v3 rebuilds v5 through
    v4's delta, fails that check, and falls back to the anchor v4 (+ v5's delta), counted."""
    root, _ = published
    dirs = _copy(published, tmp_path / "weights")
    pod = LocalWeights(tmp_path / "local")
    pod.loaded(pod.prepare(dirs[3]))
    manifest = json.loads((dirs[4] / MANIFEST_NAME).read_text())
    entry = next(t for t in manifest["tensors"] if "delta" in t)
    header = base64.b64decode(manifest["header"])
    _, dtype, start, end = next(t for t in header_tensors(header) if t[0] == entry["name"])
    v3, v4 = ((root / "full" / f"v{v}" / SAFETENSORS_NAME).read_bytes() for v in (3, 4))
    old = np.frombuffer(v3, np.uint8, end - start, len(header) + start)
    wrong = np.frombuffer(v4, np.uint8, end - start, len(header) + start).copy()
    wrong[1] ^= 0x01  # the low byte's last bit of a bf16 value: a weight off by one ulp
    enc, blob = encode_delta(wrong, old, dtype)
    with open(dirs[4] / DELTA_NAME, "ab") as fh:
        entry["delta"] = {"enc": enc, "offset": fh.tell(), "length": len(blob)}
        fh.write(blob)
    (dirs[4] / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert np.array_equal(apply_delta(old, enc, blob, dtype), wrong)  # the frame itself decodes fine
    before = _fallbacks()
    out = pod.prepare(dirs[5])
    assert _fallbacks() == before + 1
    assert (out / SAFETENSORS_NAME).read_bytes() == (root / "full" / "v5" / SAFETENSORS_NAME).read_bytes()
    with pytest.raises(WeightSyncError, match="sha256 mismatch"):  # the incremental path alone
        reconstruct(dirs[5], tmp_path / "direct", base=(dirs[3].name, tmp_path / "local" / dirs[3].name
                                                       / SAFETENSORS_NAME, 3))


def test_each_side_hashes_the_checkpoint_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The learner's publish of a delta version and the rollout's rebuild of it each feed sha256
    exactly the file's bytes once (the streamed file hash), and both get the full file's sha256."""
    fed = {"bytes": 0}

    class _Counted:
        def __init__(self, data: bytes = b"") -> None:
            self._sha = hashlib.sha256()
            self.update(data)

        def update(self, data: bytes | memoryview) -> None:
            fed["bytes"] += memoryview(data).nbytes
            self._sha.update(data)

        def hexdigest(self) -> str:
            return self._sha.hexdigest()

    monkeypatch.setattr(delta_mod, "hashlib", type("_hashlib", (), {"sha256": _Counted}))
    new, old = _typical_bf16_delta("adam")
    same = np.arange(4096, dtype=np.uint16).view(np.uint8)
    writer = DeltaWriter(anchor_every=10)
    v1 = _write_raw(writer, tmp_path, 1, {"a": old, "b": same})
    fed["bytes"] = 0
    v2 = _write_raw(writer, tmp_path, 2, {"a": new, "b": same.copy()})
    header_len = 8 + int.from_bytes(base64.b64decode(json.loads((v2 / MANIFEST_NAME).read_text())["header"])[:8],
                                    "little")
    size = header_len + new.size + same.size
    assert fed["bytes"] == size
    fed["bytes"] = 0
    digest = reconstruct(v2, tmp_path / "out", base=(v1.name, v1 / SAFETENSORS_NAME, 1))
    assert fed["bytes"] == size == (tmp_path / "out" / SAFETENSORS_NAME).stat().st_size
    assert digest == _sha(tmp_path / "out" / SAFETENSORS_NAME) == json.loads((v2 / MANIFEST_NAME).read_text())["file_sha256"]


def test_a_format_1_volume_is_still_rebuilt_and_an_unknown_format_refused(
        published: tuple[Path, dict[int, Path]], tmp_path: Path) -> None:
    """Directories a learner wrote before the per-tensor sha256s went (format 1: a sha256 per
    tensor beside the file's) rebuild as before; a manifest of a format this code does not know
    fails naming it."""
    root, _ = published
    dirs = _copy(published, tmp_path / "weights")
    for v, d in dirs.items():
        manifest = json.loads((d / MANIFEST_NAME).read_text())
        full = (root / "full" / f"v{v}" / SAFETENSORS_NAME).read_bytes()
        header = base64.b64decode(manifest["header"])
        spans = {name: (start, end) for name, _, start, end in header_tensors(header)}
        for t in manifest["tensors"]:
            start, end = spans[t["name"]]
            t["sha256"] = hashlib.sha256(full[len(header) + start:len(header) + end]).hexdigest()
        manifest["format"] = "trajmesh-weights/1"
        (d / MANIFEST_NAME).write_text(json.dumps(manifest))
    pod = LocalWeights(tmp_path / "local")
    for v, d in dirs.items():
        out = pod.prepare(d)
        assert (out / SAFETENSORS_NAME).read_bytes() == (root / "full" / f"v{v}" / SAFETENSORS_NAME).read_bytes()
        pod.loaded(out)
    manifest = json.loads((dirs[VERSIONS] / MANIFEST_NAME).read_text())
    manifest["format"] = "trajmesh-weights/99"
    (dirs[VERSIONS] / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(WeightSyncError, match="trajmesh-weights/99"):
        LocalWeights(tmp_path / "late").prepare(dirs[VERSIONS])


def test_a_late_joiner_and_a_pod_that_missed_versions_catch_up(
        published: tuple[Path, dict[int, Path]], tmp_path: Path) -> None:
    root, dirs = published
    expected = (root / "full" / f"v{VERSIONS}" / SAFETENSORS_NAME).read_bytes()
    before = _fallbacks()
    late = LocalWeights(tmp_path / "late")  # nothing local: the anchor v4 + deltas v5, v6
    assert (late.prepare(dirs[VERSIONS]) / SAFETENSORS_NAME).read_bytes() == expected
    behind = LocalWeights(tmp_path / "behind")  # at v1, missed v2..v5: deltas 2..6 (across the anchor)
    behind.loaded(behind.prepare(dirs[1]))
    assert (behind.prepare(dirs[VERSIONS]) / SAFETENSORS_NAME).read_bytes() == expected
    assert _fallbacks() == before
    with pytest.raises(WeightSyncError, match="sha256"):  # an announcement that disagrees with the files
        late.prepare(dirs[VERSIONS], sha256="0" * 64)


def test_retention_keeps_the_anchor_and_the_deltas_since(
        published: tuple[Path, dict[int, Path]], tmp_path: Path) -> None:
    """Newest two kept (v5, v6): with them their anchor v4; v1..v3 go, and a late joiner still
    rebuilds v6. Newest four (v3..v6): v3's way back to its anchor (v2, v1) stays too."""
    root, _ = published
    dirs = _copy(published, tmp_path / "weights")
    gone = prunable(tmp_path / "weights", keep=2, grace_s=0)
    assert sorted(gone) == [dirs[1], dirs[2], dirs[3]]
    assert prunable(tmp_path / "weights", keep=4, grace_s=0) == []  # v3 needs v2 and its anchor v1
    assert prunable(tmp_path / "weights", keep=2, grace_s=3600) == []  # all younger than the grace period
    for d in gone:
        shutil.rmtree(d)
    late = LocalWeights(tmp_path / "late")
    out = late.prepare(dirs[VERSIONS])
    assert (out / SAFETENSORS_NAME).read_bytes() == (root / "full" / f"v{VERSIONS}" / SAFETENSORS_NAME).read_bytes()
    full = tmp_path / "full-dirs"  # weights.sync full: no manifests, the newest `keep` stay
    for v in range(1, 5):
        (full / version_dir_name(v, ns=0)).mkdir(parents=True)
    assert [p.name for p in prunable(full, keep=2, grace_s=0)] == ["v000001-0", "v000002-0"]


def test_a_rebuild_stuck_past_its_deadline_fails_naming_what_it_waits_for(
        published: tuple[Path, dict[int, Path]], tmp_path: Path) -> None:
    """The rollout's rebuild (the evaluator's too) under weights.sync_timeout_s: a delta file that
    never opens (a FIFO with no writer: a hung volume) fails the update with its path."""
    dirs = _copy(published, tmp_path / "weights")
    (dirs[5] / DELTA_NAME).unlink()
    os.mkfifo(dirs[5] / DELTA_NAME)
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "weights.sync": "delta",
                             "weights.local_dir": str(tmp_path / "local"), "weights.sync_timeout_s": 1.0})
    svc = RolloutService(cfg, replica=0)
    ann = trajectory_pb2.WeightsAnnouncement(version=5, path=str(dirs[5]))

    async def load() -> None:
        try:
            with pytest.raises(WeightSyncTimeout, match=f"v5 not rebuilt.*{dirs[5] / DELTA_NAME}"):
                await svc._checkpoint_dir(ann)
        finally:  # a writer lets the stuck thread go (it then fails on the empty pipe)
            os.close(os.open(dirs[5] / DELTA_NAME, os.O_WRONLY | os.O_NONBLOCK))

    asyncio.run(load())
    assert (dirs[5] / MANIFEST_NAME).is_file()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_zero3_delta_export_gathers_each_module_and_rebuilds_the_full_export(tmp_path: Path) -> None:
    """Under ZeRO-3 the delta publish takes the same per-module gathers; a version where one
    tensor changed is a delta of that tensor alone, rebuilt to the ZeRO-3 full export's bytes."""
    import deepspeed

    from trajmesh.learner.logprobs import PolicyLogprobs, policy_of
    from trajmesh.learner.train_engine import build_train_engine, ensure_distributed, shutdown_distributed

    created = ensure_distributed("gloo")
    try:
        engine = build_train_engine(PolicyLogprobs(tiny_llama()), type="deepspeed", lr=1e-5, warmup_steps=0,
                                    weight_decay=0.0, grad_clip=1.0, zero_stage=3, seed=0)
        policy = policy_of(engine.model)
        writer, pod = DeltaWriter(anchor_every=10), LocalWeights(tmp_path / "local")
        for v in (1, 2):
            if v == 2:
                norm = policy.model.norm.weight
                with deepspeed.zero.GatheredParameters([norm], modifier_rank=0), torch.no_grad():
                    norm.add_(1e-2)
            full = export_policy(policy, tmp_path / f"full-v{v}", zero3=True)
            name = version_dir_name(v, ns=0)
            sha = export_policy(policy, tmp_path / name, zero3=True, delta=writer, version=v)
            writer.commit(name)
            assert sha == full
            assert all(p.numel() == 0 for p in policy.parameters())  # released again
            pod.loaded(out := pod.prepare(tmp_path / name))
            assert _sha(out / SAFETENSORS_NAME) == full
    finally:
        if created:
            shutdown_distributed()
    manifest = json.loads((tmp_path / "v000002-0" / MANIFEST_NAME).read_text())
    assert [t["name"] for t in manifest["tensors"] if "delta" in t] == ["model.norm.weight"]


def _write(model: torch.nn.Module, writer: DeltaWriter, root: Path, v: int) -> Path:
    """One published version, as the learner writes it (temp dir, rename, commit)."""
    tmp = root / temp_dir_name(v)
    export_policy(model, tmp, dtype=torch.bfloat16, delta=writer, version=v)
    final = root / version_dir_name(v, ns=v)
    os.replace(tmp, final)
    writer.commit(final.name)
    return final


def test_a_rollout_that_cannot_rebuild_asks_for_an_anchor_and_the_next_version_is_one(
        published: tuple[Path, dict[int, Path]], tmp_path: Path, nats_server) -> None:
    """The anchor v4 unreadable: a pod with nothing local cannot rebuild v5 (anchor + delta) by
    any path. The rollout's weight load asks for a full anchor over NATS (KV); the learner's next
    version is then an anchor (far from its anchor_every) and the one after a delta again, and a
    fresh pod rebuilds the anchor with nothing local."""
    from trajmesh import bus as busmod
    from trajmesh.services import learner as learner_mod

    dirs = _copy(published, tmp_path / "weights")
    blob = bytearray((dirs[4] / SAFETENSORS_NAME).read_bytes())
    blob[-5] ^= 0xFF  # one byte of the anchor's full file
    (dirs[4] / SAFETENSORS_NAME).write_bytes(bytes(blob))
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "weights.sync": "delta",
                             "weights.local_dir": str(tmp_path / "local")})
    svc = RolloutService(cfg, replica=0)
    svc.version = 0  # the base model, as setup() leaves it
    sent = REGISTRY.get_sample_value("trajmesh_rollout_weight_anchor_requests_total") or 0.0
    honoured = REGISTRY.get_sample_value("trajmesh_learner_weight_anchor_requests_total") or 0.0
    torch.manual_seed(1)
    model = tiny_llama()
    writer = DeltaWriter(100)  # a periodic anchor only every 100 versions
    out = tmp_path / "learner-weights"
    out.mkdir()

    async def go() -> list[bool]:
        svc.bus = await busmod.connect(nats_server.url, name="rollout")
        learner_bus = await busmod.connect(nats_server.url, name="learner")
        anchors = []
        try:
            assert await announce.anchor_request_revision(learner_bus) == 0
            seen = await learner_mod.honour_anchor_request(learner_bus, writer, 0)
            assert seen == 0
            first = _write(model, writer, out, 1)  # the first version: an anchor (no base)
            await svc._load_weights(trajectory_pb2.WeightsAnnouncement(version=5, path=str(dirs[5])))
            assert svc.version == 0  # nothing loaded: the engine keeps its weights
            for v in (2, 3):
                seen = await learner_mod.honour_anchor_request(learner_bus, writer, seen)
                with torch.no_grad():
                    next(model.parameters()).add_(1e-3)
                anchors.append(json.loads((_write(model, writer, out, v) / MANIFEST_NAME).read_text())["anchor"])
            assert json.loads((first / MANIFEST_NAME).read_text())["anchor"]
        finally:
            await svc.bus.close()
            await learner_bus.close()
        return anchors

    assert asyncio.run(go()) == [True, False]  # v2 on demand, v3 a delta on it
    assert REGISTRY.get_sample_value("trajmesh_rollout_weight_anchor_requests_total") == sent + 1
    assert REGISTRY.get_sample_value("trajmesh_learner_weight_anchor_requests_total") == honoured + 1
    fresh = LocalWeights(tmp_path / "fresh")
    v2 = next(out.glob("v000002-*"))
    assert (fresh.prepare(v2) / SAFETENSORS_NAME).is_file()
    assert (v2 / SAFETENSORS_NAME).is_file()  # a full file in the on-demand anchor
