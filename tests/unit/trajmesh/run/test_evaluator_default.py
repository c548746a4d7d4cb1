"""Who evaluates by default: `trajmesh train` starts the evaluator service (eval.in_mesh unset),
as a cluster does; `eval.in_mesh: false` keeps the launcher's own evaluation; a mesh started by
itself (start_mesh, as the e2e tests do) gets no evaluator unless asked.

`train` runs for real up to the moment it starts the mesh (preflight, the demo model, the
manifest, and the launcher's own "before" evaluation when it has one); `start_mesh` is replaced
by one that records the configuration it was given and stops there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trajmesh.config import RunConfig, load_config
from trajmesh.run import train as train_mod


class _MeshStarted(Exception):
    pass


def _train_until_the_mesh(tmp_path: Path, model_dir: str, monkeypatch: pytest.MonkeyPatch,
                          extra: dict[str, Any]) -> tuple[RunConfig, list[str]]:
    started: list[RunConfig] = []
    evaluated: list[str] = []

    def start_mesh(cfg: RunConfig) -> Any:
        started.append(cfg)
        raise _MeshStarted

    def evaluate_dir(model: str, held: Any, cfg: RunConfig, samples: int = 4, noise_seeds: int = 0) -> dict[str, Any]:
        evaluated.append(model)
        return {"heldout": {}, "greedy_accuracy": 0.0, "sampled_accuracy": 0.0, "score": 0.0}

    monkeypatch.setattr(train_mod, "start_mesh", start_mesh)
    monkeypatch.setattr(train_mod, "evaluate_dir", evaluate_dir)
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "model.path": model_dir,
                             "tasks.heldout_size": 4, "tasks.train_size": 50, **extra})
    with pytest.raises(_MeshStarted):
        train_mod.train(cfg)
    return started[0], evaluated


def test_train_starts_the_evaluator_by_default(tmp_path: Path, tiny_model_dir: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    assert RunConfig().eval.in_mesh is None  # unset: a bare start_mesh starts no evaluator
    mesh_cfg, evaluated = _train_until_the_mesh(tmp_path, tiny_model_dir, monkeypatch, {})
    assert mesh_cfg.eval.in_mesh is True  # the launcher starts the evaluator with the mesh
    assert evaluated == []  # and evaluates nothing itself: version 0 is the evaluator's
    dumped = load_config(str(tmp_path / "run" / "config.yaml"), {})
    assert dumped.eval.in_mesh is True  # the run's recorded config says who evaluated


def test_in_mesh_false_keeps_the_launchers_evaluation(tmp_path: Path, tiny_model_dir: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    mesh_cfg, evaluated = _train_until_the_mesh(tmp_path, tiny_model_dir, monkeypatch, {"eval.in_mesh": False})
    assert mesh_cfg.eval.in_mesh is False
    assert evaluated == [tiny_model_dir]  # the "before" evaluation, in the launcher's process
