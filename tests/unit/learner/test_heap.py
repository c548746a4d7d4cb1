"""The learner gives freed heap memory back to the OS after each step and checkpoint
(learner/heap.py): glibc keeps freed tensors resident otherwise, and SmolLM2-135M's learner sat at
10.5 GB between steps until the OOM killer took it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tiny_llama import tiny_llama_dir

from trajmesh.config import load_config
from trajmesh.contract import Trajectory
from trajmesh.learner import heap
from trajmesh.v1 import trajectory_pb2

# Fragmented, as a training step leaves the heap: 2 MB tensors (below glibc's mmap threshold once a
# 4 MB block was freed) with a small one kept alive after each, so free() cannot shrink the heap
# from its top. RSS in MB before and after the release.
FRAGMENTED = """
import os, sys, torch
from trajmesh.learner.heap import release_free_heap

def rss_mb():
    return int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

block = torch.ones(1 << 20)
del block  # 4 MB freed: glibc raises its mmap threshold past it
big, small = [], []
for _ in range(200):
    big.append(torch.ones(1 << 19))  # 2 MB, from the heap, pages touched
    small.append(torch.ones(64))
del big
before = rss_mb()
released = release_free_heap()
print(released, before, rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS from /proc; glibc's malloc_trim")
def test_release_returns_freed_tensors_to_the_os() -> None:
    out = subprocess.run([sys.executable, "-c", FRAGMENTED], capture_output=True, text=True, check=True, timeout=120)
    released, before, after = out.stdout.split()
    if released != "True":
        pytest.skip("this C library has no malloc_trim")
    assert float(before) - float(after) > 200, out.stdout  # of the 400 MB freed


def _trajectories() -> list[Trajectory]:
    """One group of four, two rewarded 1 and two 0."""
    out = []
    for i in range(4):
        t = Trajectory.new(trajectory_id=f"t{i}")
        t.pb.group_id, t.pb.task_id = "g", "task"
        t.append_prompt([1, 2])
        t.append_sampled([3 + i, 8 + i], [-3.0, -3.1], 0)
        t.finish(trajectory_pb2.EOS)
        t.set_reward(float(i < 2))
        out.append(t)
    return out


def test_the_learner_releases_after_each_step_and_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trajmesh.services import learner

    calls: list[int] = []

    def release() -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr(learner, "release_free_heap", release)
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "model.path": tiny_llama_dir(tmp_path),
                             "learner.engine.type": "torch", "learner.consistency_probe_trajectories": 0})
    svc = learner.LearnerService(cfg)
    svc._build_trainer()
    svc._train_step(_trajectories(), eta=100, temperature=1.0)
    svc._train_step(_trajectories(), eta=100, temperature=1.0)
    assert len(calls) == 2
    svc._checkpoint()
    assert len(calls) == 3


def test_release_is_a_no_op_without_malloc_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    assert heap.release_free_heap() is False
