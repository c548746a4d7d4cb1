"""A service whose stop path never finishes, served as a real process (tests/unit/trajmesh/test_service_stop.py).

Run like `trajmesh serve`: ``python stop_hang_service.py NAME --config PATH --replica N
--metrics-port PORT --hang HOW [--crash-once FILE]``. ``--hang`` picks what never ends once the
stop began:

- ``stop_awaits``: ``stop()`` awaits an event nobody sets (the event loop keeps running);
- ``stop_blocks``: ``stop()`` blocks the event loop (a synchronous sleep, as a blocking call would);
- ``loop_ignores_cancel``: a supervised loop swallows its cancellation and keeps looping.

With ``--crash-once FILE`` a background task crashes right after setup (the service calls
``fail()``, as the rollout does for a crashed task) unless FILE exists; it creates FILE, so the
restarted process serves normally (its stop still hangs when stopped).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from trajmesh.config import load_config
from trajmesh.service import Service, run_service, supervise


class StopHangs(Service):
    name = "stop_hangs"

    def __init__(self, *args: object, hang: str, crash_once: str | None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.hang = hang
        self.crash_once = Path(crash_once) if crash_once else None

    async def setup(self) -> None:
        pass

    async def run(self) -> None:
        loops = [self.idle_loop()]
        if self.hang == "loop_ignores_cancel":
            loops.append(self.stubborn_loop())
        if self.crash_once is not None and not self.crash_once.exists():
            self.crash_once.touch()
            task = asyncio.ensure_future(self.crashing_task())
            task.add_done_callback(lambda t: self.fail(t.exception() or RuntimeError("no error")))
        await supervise(*loops)

    async def crashing_task(self) -> None:
        raise TimeoutError("an episode timed out")

    async def idle_loop(self) -> None:
        await asyncio.Event().wait()

    async def stubborn_loop(self) -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # swallowed: the loop runs on

    async def stop(self) -> None:
        if self.hang == "stop_awaits":
            await asyncio.Event().wait()
        elif self.hang == "stop_blocks":
            time.sleep(3600)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("service")
    p.add_argument("--config", required=True)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--hang", choices=["stop_awaits", "stop_blocks", "loop_ignores_cancel"], required=True)
    p.add_argument("--crash-once", default=None)
    args = p.parse_args()
    cfg = load_config(args.config, {})
    run_service(StopHangs(cfg, replica=args.replica, metrics_port=args.metrics_port, hang=args.hang,
                          crash_once=args.crash_once))


if __name__ == "__main__":
    main()
