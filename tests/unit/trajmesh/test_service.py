"""Honest exits: `supervise` and `serve` turn every crash into an error naming the loop, and only a
signal or `run()` returning ends cleanly; `stop()` always runs and is bounded."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from trajmesh.config import load_config
from trajmesh.service import LoopError, Service, ServiceFailed, serve, supervise


async def _forever(cancelled: asyncio.Event) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        cancelled.set()


async def _returns() -> None:
    return None


async def _raises() -> None:
    raise ValueError("bad frame 7")


# ---------------------------------------------------------------------------------- supervise
def test_a_loop_that_returns_is_a_crash_naming_it_and_cancels_its_siblings() -> None:
    async def body() -> None:
        cancelled = asyncio.Event()
        with pytest.raises(LoopError, match=r"loop _returns returned"):
            await supervise(_forever(cancelled), _returns())
        assert cancelled.is_set()

    asyncio.run(body())


def test_a_loop_that_raises_names_the_loop_and_the_error() -> None:
    async def body() -> None:
        cancelled = asyncio.Event()
        with pytest.raises(LoopError, match=r"loop _raises failed: ValueError: bad frame 7") as err:
            await supervise(_forever(cancelled), _raises())
        assert isinstance(err.value.__cause__, ValueError)
        assert cancelled.is_set()

    asyncio.run(body())


def test_nested_supervise_keeps_the_inner_loop_name() -> None:
    async def outer() -> None:
        await supervise(_raises(), _forever(asyncio.Event()))

    async def body() -> None:
        with pytest.raises(LoopError, match=r"^loop _raises failed"):
            await supervise(outer())

    asyncio.run(body())


def test_a_loop_may_return_once_stopping_is_set() -> None:
    async def body() -> None:
        stopping = asyncio.Event()
        cancelled = asyncio.Event()

        async def finishes_on_stop() -> None:
            await stopping.wait()

        task = asyncio.ensure_future(supervise(finishes_on_stop(), _forever(cancelled), stopping=stopping))
        stopping.set()
        await task  # no LoopError
        assert cancelled.is_set()

    asyncio.run(body())


# ---------------------------------------------------------------------------------- serve
class _Toy(Service):
    """A service whose run() does what the test asks; records its lifecycle."""

    name = "toy"

    def __init__(self, behaviour: str) -> None:
        super().__init__(load_config(None, {}))
        self.behaviour = behaviour
        self.events: list[str] = []
        self.running = asyncio.Event()

    async def setup(self) -> None:
        self.events.append("setup")
        if self.behaviour == "setup_raises":
            raise OSError("no NATS")

    async def run(self) -> None:
        self.running.set()
        if self.behaviour == "loop_returns":
            await supervise(_returns(), _forever(asyncio.Event()))
        elif self.behaviour == "done":
            return
        await asyncio.Event().wait()

    async def stop(self) -> None:
        self.events.append("stop")
        if self.behaviour == "stop_hangs":
            await asyncio.Event().wait()


async def _serve_and(service: _Toy, action: str) -> None:
    """serve() the service; once run() started, do ``action`` to it."""
    task = asyncio.ensure_future(serve(service))
    if action != "none":
        await asyncio.wait({task, asyncio.ensure_future(service.running.wait())},
                           return_when=asyncio.FIRST_COMPLETED)
    if action == "signal":
        service.request_stop(signal.SIGTERM)
    elif action == "set_stopping":
        service.stopping.set()  # what a crashed background task did before fail() existed
    elif action == "fail":
        service.fail(KeyError("task-3"))
    await task


@pytest.mark.parametrize("behaviour,action,error,words", [
    ("loop_returns", "none", LoopError, "loop _returns returned"),
    ("setup_raises", "none", OSError, "no NATS"),
    ("forever", "set_stopping", ServiceFailed, "stopped itself without a signal"),
    ("forever", "fail", ServiceFailed, "KeyError: 'task-3'"),
    ("stop_hangs", "signal", ServiceFailed, "stop() did not finish"),
])
def test_serve_raises_on_every_unclean_end_and_still_stops(behaviour: str, action: str,
                                                           error: type[BaseException], words: str) -> None:
    service = _Toy(behaviour)
    service.stop_timeout_s = 0.5
    with pytest.raises(error) as err:
        asyncio.run(_serve_and(service, action))
    assert words in str(err.value)
    assert service.events[-1] == "stop" and service.stopping.is_set()


@pytest.mark.parametrize("behaviour,action", [("forever", "signal"), ("done", "none")])
def test_serve_returns_after_a_signal_or_when_run_is_done(behaviour: str, action: str) -> None:
    service = _Toy(behaviour)
    asyncio.run(_serve_and(service, action))
    assert service.events == ["setup", "stop"]


_CRASHING_SERVICE = textwrap.dedent("""
    import asyncio
    from trajmesh.config import load_config
    from trajmesh.service import Service, serve, supervise

    class Crashy(Service):
        name = "crashy"
        async def setup(self): pass
        async def run(self):
            await supervise(self.intake_loop(), self.idle_loop())
        async def intake_loop(self):
            raise RuntimeError("poisoned message m-42")
        async def idle_loop(self):
            await asyncio.Event().wait()

    asyncio.run(serve(Crashy(load_config(None, {}))))
""")


def test_a_crashed_loop_makes_the_process_exit_non_zero_naming_loop_and_error() -> None:
    res = subprocess.run([sys.executable, "-c", _CRASHING_SERVICE], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "loop Crashy.intake_loop failed: RuntimeError: poisoned message m-42" in res.stderr, res.stderr


# ------------------------------------------------------------ a cancellation a library swallows


def test_redis_commands_swallow_cancels_and_supervise_still_ends(redis_server: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """On Python 3.11, a redis-py command can swallow its task's cancellation (`asyncio.wait_for`,
    which redis-py sends every command through, returns its result instead): the loop goes on
    looping. A clean-clone CI run's store never stopped that way (its admission loop). First the
    probe: loops of real Redis commands, each cancelled once; some go on. Then the same loops
    under `supervise`, cancelled once: every one ends, since it cancels again what is still running
    (each cancel is a new draw: up to 11 were needed in 200 loops, so each loop has 60 s, 120
    re-cancels). Last, with the process's `wait_for` made `service.wait_for` (`run_service` does
    it): no loop goes on after its one cancel."""
    import redis.asyncio

    from trajmesh import service as service_mod

    monkeypatch.setattr(service_mod, "RECANCEL_S", 0.5)
    monkeypatch.setattr(asyncio, "wait_for", service_mod._STDLIB_WAIT_FOR)

    async def commands(r: Any, ran: list[int]) -> None:
        while True:
            await r.get("k")
            ran.append(1)
            await asyncio.sleep(0)

    async def trials(supervised: bool) -> int:
        """Of 20 loops, each cancelled once: those that went on (supervised: ran 60 s on; else:
        issued 3 more commands)."""
        r = redis.asyncio.Redis.from_url(redis_server.url)
        left = 0
        try:
            for _ in range(20):
                ran: list[int] = []
                loop = supervise(commands(r, ran), asyncio.Event().wait()) if supervised else commands(r, ran)
                task = asyncio.ensure_future(loop)
                while len(ran) < 3:  # the loop is issuing commands
                    await asyncio.sleep(0.001)
                task.cancel()
                went_on = len(ran) + 3
                deadline = asyncio.get_running_loop().time() + (60.0 if supervised else 30.0)
                while not task.done() and (supervised or len(ran) < went_on) \
                        and asyncio.get_running_loop().time() < deadline:
                    await asyncio.wait({task}, timeout=0.01)
                if not task.done():
                    left += 1
                    while not task.done():  # the probe's own clean-up
                        task.cancel()
                        await asyncio.wait({task}, timeout=0.5)
        finally:
            await r.aclose()
        return left

    swallowed = asyncio.run(trials(supervised=False))
    if swallowed == 0:
        pytest.skip(f"redis-py {redis.__version__} swallowed no cancellation in 20 loops: nothing to check here "
                    "(test_a_loop_that_swallows_its_cancellation_still_ends still checks supervise)")
    hung = asyncio.run(trials(supervised=True))
    assert hung == 0, f"{hung} of 20 loops under supervise went on 60 s after their cancellation " \
                      f"(the probe: {swallowed} of 20 went on after one cancel)"
    service_mod.keep_cancellations()  # monkeypatch puts the standard library's back
    assert asyncio.wait_for is service_mod.wait_for
    kept = asyncio.run(trials(supervised=False))
    assert kept == 0, f"with service.wait_for, {kept} of 20 loops went on after their one cancel " \
                      f"(the standard library's: {swallowed})"


def test_a_loop_that_swallows_its_cancellation_still_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that catches its first cancellation and goes on (what a swallowed cancel looks like
    from outside): `supervise`, cancelled once, cancels it again and ends."""
    from trajmesh import service as service_mod

    monkeypatch.setattr(service_mod, "RECANCEL_S", 0.2)
    swallowed = asyncio.Event()

    async def swallows_once() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.Event().wait()

    async def body() -> None:
        task = asyncio.ensure_future(supervise(swallows_once(), asyncio.Event().wait()))
        await asyncio.sleep(0)  # both loops started
        task.cancel()
        await asyncio.wait_for(swallowed.wait(), 30)
        done, _ = await asyncio.wait({task}, timeout=30)
        assert done, "supervise did not end after its loop swallowed the cancellation"
        assert task.cancelled()

    asyncio.run(body())
