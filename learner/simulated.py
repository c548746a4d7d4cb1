"""The benchmarks' stand-in for a learner step (`learner.simulated_step`, bench/bench_systems.py).

A modelled GPU step: no training, the step sleeps `seconds_per_step + seconds_per_token·(trained
tokens)` in the learner's worker thread, so a benchmark's learner takes no CPU from rollout.
It has `learner.step.train_batch`'s signature; the learner service picks one of the two when it
builds its trainer, and everything else of a step (staleness split, version + 1, weights saved
and announced, the store's report) is the real one. Never set in a real run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from trajmesh.config import SimulatedStepCost


def simulated_train_batch(cost: SimulatedStepCost) -> Callable[..., dict[str, Any]]:
    """A `train_batch` that sleeps the modelled time of the batch's trained tokens instead."""
    def train_batch(engine: Any, batch: Any, adv_BT: Any, cfg: Any, plan: Any, **_: Any) -> dict[str, Any]:
        seconds = cost.seconds(int((batch.mask_BT > 0).sum()))
        time.sleep(seconds)  # the modelled step (in a worker thread: no CPU taken)
        return {"simulated_step_seconds": seconds}
    return train_batch
