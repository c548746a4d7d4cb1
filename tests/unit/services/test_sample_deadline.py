"""One deadline per sample covers environment set-up, the agent's run and grading (issue 41 item 4).

The rollout's real `run_sample` against a real gRPC channel to a port where no environment
listens: the Reset keeps trying (`rollout.environment_wait_s` is a minute) until the sample's
deadline cuts it, and the sample ends INFRA_FAILURE with cause INFRA_DEADLINE, its deadline
stamped, a refill naming the member it replaces. The grader's real `_grade` refuses to score a
sample past its deadline (INFRA_DEADLINE, ungraded) and scores one within it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

pytest.importorskip("torch")

from trajmesh.config import load_config  # noqa: E402
from trajmesh.contract import Trajectory  # noqa: E402
from trajmesh.infra import free_port  # noqa: E402
from trajmesh.services.grader import GraderService  # noqa: E402
from trajmesh.services.rollout import RolloutService  # noqa: E402
from trajmesh.services.store.intake import judge  # noqa: E402
from trajmesh.tasks import load_split  # noqa: E402
from trajmesh.tokenizer import load_tokenizer  # noqa: E402
from trajmesh.v1 import services_pb2_grpc, trajectory_pb2  # noqa: E402

pytestmark = [pytest.mark.timeout(60)]

# A tool environment: its Reset goes to the environment service (a stateless one is played in the
# rollout's own process, with no set-up to wait for).
TASK = trajectory_pb2.Task(task_id="t1-c0", group_id="g0-t1", environment="math_tool", prompt="2+3=",
                           answer="5", group_size=1, first_sample=4, refill_of="t1-c0-2")


def test_a_sample_past_its_deadline_in_environment_set_up_is_an_infra_failure(tmp_path: Path) -> None:
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "rollout.environment_wait_s": 60.0,
                             "rollout.sample_deadline_s": 1.0})

    async def body() -> tuple[Trajectory, float]:
        rollout = RolloutService(cfg)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}") as channel:  # nothing listens
            rollout.envs = [services_pb2_grpc.EnvironmentStub(channel)]
            start = time.time()
            traj = await asyncio.wait_for(rollout.run_sample(TASK, 4), 30)
            return traj, time.time() - start

    traj, took_s = asyncio.run(body())
    assert took_s < 10, f"the sample ran {took_s:.1f}s past a 1 s deadline"
    assert (traj.trajectory_id, traj.terminal_reason, traj.infra_cause) == (
        "t1-c0-4", trajectory_pb2.INFRA_FAILURE, trajectory_pb2.INFRA_DEADLINE)
    assert traj.pb.timing.deadline_unix_seconds > 0 and list(traj.pb.retry_lineage) == ["t1-c0-2"]
    verdict = judge(traj.to_bytes(), {"group_id": "g0-t1"}, vocab_size=None, learner_version=0)
    assert (verdict.outcome, verdict.reason) == ("failed_infra", "infra_deadline")


def test_the_grader_scores_within_the_deadline_and_refuses_past_it(tiny_model_dir: str) -> None:
    cfg = load_config(None, {})
    spec = load_split(cfg.tasks.sources[0], 1, 1)[1][0]
    svc = GraderService(cfg)
    svc.tokenizer = load_tokenizer(tiny_model_dir)
    svc.task_cache["t1-c0"] = {"source": spec.source, "answer": spec.answer, "prompt": spec.prompt,
                               "metadata": spec.metadata}

    def graded(deadline: float) -> Trajectory:
        t = Trajectory.new(trajectory_pb2.Task(task_id="t1-c0", group_id="g0-t1", source=spec.source),
                           trajectory_id="t1-c0-0")
        t.append_prompt([1, 2, 3])
        t.append_sampled([4, 5], [-1.0, -1.0], 0)
        t.finish(trajectory_pb2.EOS)
        t.pb.timing.deadline_unix_seconds = deadline
        out, _, _ = asyncio.run(svc._grade(t.to_bytes()))
        return Trajectory.from_bytes(out)

    within = graded(time.time() + 600)
    assert within.graded and within.terminal_reason == trajectory_pb2.EOS
    past = graded(time.time() - 1)
    assert not past.graded
    assert (past.terminal_reason, past.infra_cause) == (trajectory_pb2.INFRA_FAILURE, trajectory_pb2.INFRA_DEADLINE)
