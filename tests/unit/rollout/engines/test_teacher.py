"""The rollout's distillation teacher (rollout/engines/teacher.py) against a real torch engine server.

Two trajectories scored at once reach the teacher as one batch request, a segmented one (an
agent session's two sequences) as one sequence per segment; every sampled token's teacher
log-prob equals the teacher model's own forward over its segment (transformers, here). A teacher
nobody serves makes its trajectory INFRA_FAILURE after `retry_s`, counted by reason, never
published unscored.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from trajmesh.config import DistillConfig, TeacherConfig
from trajmesh.contract import Trajectory
from trajmesh.infra import free_port
from trajmesh.rollout.engines.engine_client import EngineClient
from trajmesh.rollout.engines.teacher import TEACHER_BATCH, TEACHER_FAILURES, Teacher
from trajmesh.v1 import trajectory_pb2

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def teacher_url(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("teacher") / "engine.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trajmesh.rollout.engines.engine_server", "--model", tiny_model_dir,
                                 "--port", str(port), "--host", "127.0.0.1", "--version", "0", "--threads", "1"],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    async def healthy() -> bool:
        async with EngineClient(url) as client:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                if await client.health():
                    return True
                await asyncio.sleep(0.2)
        return False

    try:
        assert asyncio.run(healthy()), log_path.read_text()[-2000:]
        yield url
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _traj(tid: str, segments: list[tuple[list[int], list[int]]]) -> Trajectory:
    t = Trajectory.new(trajectory_id=tid)
    t.pb.task_id = t.pb.group_id = "g"
    for k, (prompt, sampled) in enumerate(segments):
        if k:
            t.start_segment()
        t.append_prompt(prompt, turn_index=k)
        t.append_sampled(sampled, [-1.0] * len(sampled), 0, turn_index=k)
    t.finish(trajectory_pb2.EOS)
    return t


def _hf_logprobs(model_dir: str, ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_teacher_scores_each_segment_in_one_batch(teacher_url: str, tiny_model_dir: str) -> None:
    one = _traj("one", [([1, 5, 6, 7], [8, 9, 10])])
    two = _traj("two", [([1, 11, 12], [13, 14]), ([1, 15], [16, 17, 18])])  # two segments
    cfg = TeacherConfig(source="s", url=teacher_url, revision="r1", name="t-batch")
    teacher = Teacher(cfg, EngineClient(teacher_url), DistillConfig(teachers=[cfg], batch_window_ms=50))

    async def go() -> None:
        await teacher.start()
        try:
            await asyncio.gather(teacher.score_trajectory(one), teacher.score_trajectory(two))
        finally:
            await teacher.close()

    asyncio.run(go())
    assert TEACHER_BATCH.labels("t-batch@r1")._sum.get() == 3  # 3 sequences ...
    assert sum(b.get() for b in TEACHER_BATCH.labels("t-batch@r1")._buckets) == 1  # ... in one request
    for t in (one, two):
        assert t.pb.teacher == "t-batch@r1" and t.pb.terminal_reason == trajectory_pb2.EOS
        ids, lp, mask = t.token_ids_T.tolist(), t.teacher_logprobs_T.tolist(), t.loss_mask_T.tolist()
        for a, e in t.segment_bounds():
            want = _hf_logprobs(tiny_model_dir, ids[a:e])
            for k in range(a + 1, e):
                assert lp[k] == pytest.approx(want[k - a - 1] if mask[k] else 0.0, abs=1e-4), (t.trajectory_id, k)
        assert t.validate() == []


def test_an_unserved_teacher_fails_its_trajectory_after_retry_s() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    cfg = TeacherConfig(source="s", url=url, revision="r2", name="t-down")
    teacher = Teacher(cfg, EngineClient(url), DistillConfig(teachers=[cfg], retry_s=0.5))
    t = _traj("down", [([1, 5, 6], [8, 9])])
    before = TEACHER_FAILURES.labels("t-down@r2", "unavailable")._value.get()

    async def go() -> None:
        teacher._loop_task = asyncio.create_task(teacher._batch_loop())  # start() would ask the dead server
        try:
            await teacher.score_trajectory(t)
        finally:
            await teacher.close()

    asyncio.run(go())
    assert t.pb.terminal_reason == trajectory_pb2.INFRA_FAILURE and t.teacher_logprobs_T is None
    assert TEACHER_FAILURES.labels("t-down@r2", "unavailable")._value.get() == before + 1
