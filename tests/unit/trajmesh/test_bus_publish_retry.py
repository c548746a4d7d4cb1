"""A deduplicated publish outlasts a stall past its request deadline (Bus.publish's ``retry_s``).

A grader held with SIGSTOP in CI woke with its TRAJ_GRADED publish past nats-py's request
deadline and exited on ``nats: timeout``, although the stream had taken the message. The same
stall is made here from the other side: the NATS server is stopped while a publish waits for its
ack, so the first attempt times out; the retry, with the same msg id, is acked once the server
continues, and the stream holds the message once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import nats.errors
import pytest

from trajmesh import bus as busmod
from trajmesh.infra import NatsServer


def _retries() -> float:
    return busmod.PUBLISH_RETRIES.labels(subject=busmod.SUBJECT_TRAJ_GRADED)._value.get()


def _stop(pid: int) -> None:
    """SIGSTOP the server and return once every one of its threads is stopped: a signal is only
    pending until each thread next enters the kernel, and a thread still running could take and
    ack the publish that should have met a stalled server."""
    os.kill(pid, signal.SIGSTOP)
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that exited
                continue
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.001)


def test_a_publish_timed_out_by_a_stall_is_retried_and_stored_once(nats_server: NatsServer) -> None:
    pid = nats_server.pid
    assert pid is not None

    async def body() -> None:
        grader = await busmod.connect(nats_server.url, name="grader")
        await grader.ensure_streams()
        # Without retry_s the stall fails the publish: what the grader did before.
        _stop(pid)
        try:
            with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):
                await grader.publish(busmod.SUBJECT_TRAJ_GRADED, b"first", msg_id="graded-t0")
            before = _retries()
            publish = asyncio.ensure_future(
                grader.publish(busmod.SUBJECT_TRAJ_GRADED, b"second", msg_id="graded-t1", retry_s=60))
            while _retries() == before:  # the event: an attempt timed out during the stall
                assert not publish.done(), publish.exception()
                await asyncio.sleep(0.05)
        finally:
            os.kill(pid, signal.SIGCONT)
        ack = await asyncio.wait_for(publish, 60)
        assert ack.stream == grader.layout.stream(busmod.STREAM_TRAJ_GRADED)
        info = await grader.js.stream_info(ack.stream)
        # "first" (its ack lost, stored on resume), "second" once though sent at least twice.
        assert info.state.messages == 2, info.state
        msg = await grader.js.get_last_msg(ack.stream, grader.layout.subject(busmod.SUBJECT_TRAJ_GRADED))
        assert msg.data == b"second"
        with pytest.raises(ValueError, match="msg_id"):
            await grader.publish(busmod.SUBJECT_TRAJ_GRADED, b"x", retry_s=5)
        await grader.close()

    asyncio.run(asyncio.wait_for(body(), 120))
