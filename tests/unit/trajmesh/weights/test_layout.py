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
