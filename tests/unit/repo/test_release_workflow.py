"""The release workflow (.github/workflows/release.yml) parses, builds the Dockerfiles that exist from
the repository root, pushes the image names the chart and docs tell users to set, and its version
step accepts exactly the tag that matches Chart.yaml and pyproject.toml (run here with bash).
No GitHub runner or Docker engine runs here: the build itself is not exercised."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from repo_paths import REPO

WORKFLOW = REPO / ".github" / "workflows" / "release.yml"
CHART = REPO / "deploy" / "helm" / "trajmesh"
COMPONENTS = {"gpu": {"rollout", "rollout.sglang", "learner"}, "cpu": {"environment", "grader", "store", "tests"}}


def _workflow() -> dict[Any, Any]:
    return yaml.safe_load(WORKFLOW.read_text())


def _job() -> dict[str, Any]:
    (job,) = _workflow()["jobs"].values()
    return job


def _step(uses: str) -> dict[str, Any]:
    return next(s for s in _job()["steps"] if s.get("uses", "").startswith(uses))


def test_runs_on_version_tags_only_and_may_push_packages() -> None:
    wf = _workflow()
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert on == {"push": {"tags": ["v*"]}}
    assert wf["permissions"] == {"contents": "read", "packages": "write"}


def test_builds_both_dockerfiles_from_the_root_and_pushes_trajmesh_images() -> None:
    matrix = _job()["strategy"]["matrix"]["include"]
    flavors = {m["flavor"]: m["dockerfile"] for m in matrix}
    assert flavors == {"gpu": "docker/Dockerfile.gpu", "cpu": "docker/Dockerfile.cpu"}
    assert {p.relative_to(REPO).as_posix() for p in (REPO / "docker").glob("Dockerfile.*")} == set(flavors.values())
    for dockerfile in flavors.values():  # context . : the Dockerfiles copy from the repository root
        assert "COPY pyproject.toml" in (REPO / dockerfile).read_text()
    build = _step("docker/build-push-action")["with"]
    assert build["context"] == "." and build["file"] == "${{ matrix.dockerfile }}" and build["push"] is True
    assert build["tags"] == ("ghcr.io/${{ steps.meta.outputs.owner }}/trajmesh-${{ matrix.flavor }}:"
                             "${{ steps.meta.outputs.version }}")
    assert _step("docker/login-action")["with"]["registry"] == "ghcr.io"


def test_documented_image_names_match_the_workflow() -> None:
    """What the chart's render-time error, values.yaml and docs/KUBERNETES.md tell users to set: the
    workflow's ghcr.io/OWNER/trajmesh-<flavor>, each from its Dockerfile, for the right components."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    values = (CHART / "values.yaml").read_text()
    docs = (REPO / "docs" / "KUBERNETES.md").read_text()
    for flavor, components in COMPONENTS.items():
        image, dockerfile = f"ghcr.io/OWNER/trajmesh-{flavor}", f"docker/Dockerfile.{flavor}"
        assert f"{image} from {dockerfile} (set {', '.join(f'{c}.image' for c in _ordered(components, helpers))})" \
            in helpers, flavor
        assert f"{image}:VERSION ({dockerfile}: " in values, flavor
        assert f"{image}:VERSION" in docs and dockerfile in docs, flavor
        # the images the chart tests render with, and every Dockerfile's own build line, use the same names
        assert f"-t trajmesh-{flavor}:" in (REPO / dockerfile).read_text(), flavor
    assert ".github/workflows/release.yml" in docs


def _ordered(components: set[str], text: str) -> list[str]:
    found = sorted(components, key=lambda c: text.find(f"{c}.image"))
    assert all(f"{c}.image" in text for c in found), components
    return found


def _meta(tag: str, out: Path) -> subprocess.CompletedProcess[str]:
    step = next(s for s in _job()["steps"] if s.get("id") == "meta")
    env = dict(os.environ, GITHUB_REF_NAME=tag, GITHUB_REPOSITORY_OWNER="Some-Org", GITHUB_OUTPUT=str(out))
    try:
        proc = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=REPO, env=env, capture_output=True, text=True)
        proc.stdout = out.read_text() if out.exists() else ""
        return proc
    finally:
        out.unlink(missing_ok=True)


def test_version_step_accepts_only_the_released_version(tmp_path: Path) -> None:
    chart = re.search(r'^appVersion: "?([^"\n]+)"?$', (CHART / "Chart.yaml").read_text(), re.M).group(1)  # type: ignore[union-attr]
    ok = _meta(f"v{chart}", tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == [f"version={chart}", "owner=some-org"]
    bad = _meta("v99.0.0", tmp_path / "bad")
    assert bad.returncode != 0 and "must agree" in bad.stderr
