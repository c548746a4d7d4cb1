"""Grader service: TRAJ_RAW → verify → TRAJ_GRADED (DESIGN.md §1.4).

::

    TRAJ_RAW ──▶ grade_loop ── decode sampled tokens ── task record (Redis) ── grader ──▶ TRAJ_GRADED
                    │ undecodable bytes / unknown task: forwarded ungraded; the store quarantines them

Each message is published to TRAJ_GRADED (msg_id = trajectory id, so a redelivery is stored
once) before it is acked on TRAJ_RAW: a crash between the two only causes a deduplicated resend.
"""

from __future__ import annotations

import json
import logging
import time

import redis.asyncio
from prometheus_client import Counter, Histogram
from trajmesh.graders.reasoning_gym import ReasoningGymGrader

from trajmesh import bus as busmod
from trajmesh.contract import ContractError, Trajectory
from trajmesh.keys import RedisKeys
from trajmesh.service import Service
from trajmesh.tokenizer import load_tokenizer
from trajmesh.v1 import trajectory_pb2

log = logging.getLogger("trajmesh.grader")

GRADED = Counter("trajmesh_grader_trajectories_total", "Trajectories handled by the grader", ["result"])
REWARD_COMPONENT = Counter(
    "trajmesh_grader_reward_component_sum", "Sum of each raw reward component", ["component"]
)
VERIFY_SECONDS = Histogram("trajmesh_grader_verify_seconds", "Verifier latency per trajectory")


class GraderService(Service):
    name = "grader"

    async def setup(self) -> None:
        cfg = self.cfg
        assert cfg.infra.nats_url and cfg.infra.redis_url and cfg.model.path
        self.keys = RedisKeys(cfg.infra.namespace)
        self.redis = redis.asyncio.Redis.from_url(cfg.infra.redis_url)
        self.bus = await busmod.connect(cfg.infra.nats_url, name=self.worker_id, namespace=cfg.infra.namespace)
        await self.bus.ensure_streams()
        self.consumer = await self.bus.pull_subscribe(busmod.STREAM_TRAJ_RAW, "grader", ack_wait_s=30.0)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.grader = ReasoningGymGrader()

    async def run(self) -> None:
        await self.grade_loop()

    async def stop(self) -> None:
        if hasattr(self, "bus"):
            await self.bus.close()
        if hasattr(self, "redis"):
            await self.redis.aclose()

    async def grade_loop(self) -> None:
        """Consumes TRAJ_RAW (pull, shared durable `grader`); waits for messages; never drops one."""
        while True:
            for msg in await self.consumer.fetch(batch=16, timeout=1.0):
                data = await self.consumer.resolve(msg)
                out, msg_id = await self._grade(data)
                await self.bus.publish(busmod.SUBJECT_TRAJ_GRADED, out, msg_id=msg_id)
                await msg.ack()

    async def _grade(self, data: bytes) -> tuple[bytes, str | None]:
        try:
            traj = Trajectory.from_bytes(data)
        except ContractError:
            GRADED.labels(result="not_a_trajectory").inc()
            return data, None
        raw = await self.redis.hget(self.keys.tasks, traj.task_id) if traj.task_id else None
        if raw is None or traj.terminal_reason == trajectory_pb2.INFRA_FAILURE:
            GRADED.labels(result="forwarded_ungraded").inc()
            return data, f"graded-{traj.trajectory_id}"
        task = json.loads(raw)
        start = time.perf_counter()
        mask_T = traj.loss_mask_T
        ids = [int(t) for t, m in zip(traj.token_ids_T, mask_T, strict=False) if m == 1]
        ended_with_eos = bool(ids) and ids[-1] == self.tokenizer.eos_token_id
        try:
            grade = self.grader.grade(self.tokenizer.decode(ids), task, ended_with_eos=ended_with_eos)
        except Exception as exc:  # a verifier crash is infrastructure, never policy reward
            log.warning("verifier failed on %s: %s", traj.trajectory_id, exc)
            GRADED.labels(result="verifier_error").inc()
            traj.finish(trajectory_pb2.INFRA_FAILURE, truncated=traj.truncated)
            traj.pb.verifier_output = f"verifier error: {exc}"
            return traj.to_bytes(), f"graded-{traj.trajectory_id}"
        elapsed = time.perf_counter() - start
        VERIFY_SECONDS.observe(elapsed)
        traj.set_reward(grade.reward, components=grade.components, grader_revision=grade.revision,
                        verifier_output=grade.verifier_output)
        traj.pb.timing.grading_seconds = elapsed
        for name, value in grade.components.items():
            REWARD_COMPONENT.labels(component=name).inc(value)
        GRADED.labels(result="graded").inc()
        return traj.to_bytes(), f"graded-{traj.trajectory_id}"
