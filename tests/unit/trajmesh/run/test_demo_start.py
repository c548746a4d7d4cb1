"""The demo's warm start is shipped (examples/demo-start/): the same weights on every machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_paths import REPO

from trajmesh.config import load_config
from trajmesh.run import launcher


def _refuse_to_build(cfg, dest):  # pragma: no cover - called only when the test fails
    raise AssertionError(f"built a demo model in {dest} although a shipped start should have been used")


def test_the_demo_config_has_a_shipped_start():
    cfg = load_config(REPO / "examples" / "demo.yaml")
    folder = REPO / "examples" / "demo-start" / launcher.demo_model_name(cfg)
    assert (folder / "sft" / "config.json").is_file(), (
        f"examples/demo.yaml builds {folder.name}, which is not shipped: regenerate it "
        "(examples/demo-start/README.md)")


def test_prepare_model_uses_the_shipped_start_without_building(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "build_demo_model", _refuse_to_build)
    cfg = load_config(REPO / "examples" / "demo.yaml", overrides={"run_dir": str(tmp_path / "run")})
    path = Path(launcher.prepare_model(cfg).model.path)
    assert path.parent.parent == (REPO / "examples" / "demo-start").resolve()
    assert not (tmp_path / ".cache").exists()


def test_the_shipped_start_has_the_demo_configs_dimensions():
    cfg = load_config(REPO / "examples" / "demo.yaml")
    folder = REPO / "examples" / "demo-start" / launcher.demo_model_name(cfg)
    model_cfg = json.loads((folder / "sft" / "config.json").read_text())
    demo = cfg.model.demo
    assert (model_cfg["hidden_size"], model_cfg["num_hidden_layers"], model_cfg["num_attention_heads"]) == (
        demo.hidden_size, demo.layers, demo.heads)
    stats = json.loads((folder / "sft_stats.json").read_text())
    assert stats["steps"] == demo.sft_steps and stats["sft"]["lr"] == demo.sft_lr


def test_another_demo_config_builds_its_own_start(monkeypatch, tmp_path):
    built: list[Path] = []

    def fake_build(cfg, dest):
        built.append(dest)
        (dest / "sft").mkdir(parents=True)
        (dest / "sft" / "config.json").write_text("{}")

    monkeypatch.setattr(launcher, "build_demo_model", fake_build)
    cfg = load_config(REPO / "examples" / "demo.yaml",
                      overrides={"run_dir": str(tmp_path / "run"), "model.demo.sft_steps": 7})
    path = Path(launcher.prepare_model(cfg).model.path)
    assert built == [tmp_path / ".cache" / launcher.demo_model_name(cfg)]
    assert path == (built[0] / "sft").resolve()


@pytest.mark.parametrize("override", [{"seed": 1}, {"model.demo.hidden_size": 64}])
def test_the_name_changes_with_what_changes_the_weights(override):
    base = load_config(REPO / "examples" / "demo.yaml")
    assert launcher.demo_model_name(load_config(REPO / "examples" / "demo.yaml", overrides=override)) != \
        launcher.demo_model_name(base)
