"""The weights layout: the names the learner publishes under are the ones every reader lists."""

from __future__ import annotations

from pathlib import Path

from trajmesh.weights.layout import (
    latest_version_dir,
    temp_dir_name,
    version_dir_name,
    version_dirs,
    weights_root,
)


def test_published_versions_list_in_version_order_and_temp_dirs_never(tmp_path: Path) -> None:
    root = weights_root(tmp_path)
    assert root == tmp_path / "weights"
    root.mkdir()
    assert latest_version_dir(root) is None
    # version 9 saved before 10 and 100 (zero padding keeps them in order); 10 saved twice (a replay)
    for version, ns in [(100, 5), (9, 7), (10, 1), (10, 3)]:
        (root / version_dir_name(version, ns)).mkdir()
    (root / temp_dir_name(101, 4242)).mkdir()  # being written: not published
    (root / version_dir_name(11, 2)).write_text("a file, not a version")
    names = [p.name for p in version_dirs(root)]
    assert names == ["v000009-7", "v000010-1", "v000010-3", "v000100-5"]
    assert [p.name for p in version_dirs(root, 10)] == ["v000010-1", "v000010-3"]
    assert version_dirs(root, 1) == []
    assert latest_version_dir(root) == root / "v000100-5"
    assert temp_dir_name(101, 4242) == ".v000101.tmp-4242"
    assert version_dir_name(3).startswith("v000003-") and version_dir_name(3)[8:].isdigit()


def test_the_checksum_an_announcement_carries(tmp_path: Path) -> None:
    """Recorded beside a published version; computed for a directory without a record (the base
    model); the empty input's hash for one without a model.safetensors."""
    import hashlib

    from trajmesh.weights.layout import CHECKSUM_NAME, checksum, sha256_file

    published, base, other = tmp_path / "v000001-5", tmp_path / "base", tmp_path / "other"
    for d in (published, base, other):
        d.mkdir()
    data = b"\x00\x01weights" * 100_000  # more than one read block
    (base / "model.safetensors").write_bytes(data)
    assert sha256_file(base / "model.safetensors", block=4096) == hashlib.sha256(data).hexdigest()
    assert checksum(base) == hashlib.sha256(data).hexdigest()
    (published / "model.safetensors").write_bytes(data)
    (published / CHECKSUM_NAME).write_text("ab" * 32 + "\n")  # what the learner recorded wins
    assert checksum(published) == "ab" * 32
    assert checksum(other) == hashlib.sha256(b"").hexdigest()
