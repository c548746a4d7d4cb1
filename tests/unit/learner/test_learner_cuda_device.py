"""A learner rank's collectives and training threads use its own GPU, cuda:LOCAL_RANK
(learner/microbatch.py): CUDA's current device is per thread and 0 in a new one, and the learner
trains and broadcasts in asyncio.to_thread workers, so nothing may rely on the current device."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from trajmesh.learner.microbatch import (
    collective_device,
    local_cuda_device,
    thread_cuda_device,
    worker_executor,
)


def test_collectives_name_the_local_rank_device(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_cuda_device() == torch.device("cuda", 3)
    assert collective_device("nccl") == torch.device("cuda", 3)
    assert collective_device("gloo") == torch.device("cpu")
    monkeypatch.delenv("LOCAL_RANK")
    assert collective_device("nccl") == torch.device("cuda", 0)


def test_every_to_thread_worker_binds_the_local_rank_device(monkeypatch: pytest.MonkeyPatch):
    """The learner sets worker_executor() as its loop's default executor (services/learner.py):
    each asyncio.to_thread worker has bound cuda:LOCAL_RANK before it runs anything."""
    monkeypatch.setenv("LOCAL_RANK", "2")

    def where() -> tuple[str, torch.device | None]:
        return threading.current_thread().name, thread_cuda_device()

    async def main() -> list[tuple[str, torch.device | None]]:
        asyncio.get_running_loop().set_default_executor(worker_executor(max_workers=4))
        return list(await asyncio.gather(*(asyncio.to_thread(where) for _ in range(8))))

    seen = asyncio.run(main())
    assert {name.split("_")[0] for name, _ in seen} == {"learner"}
    assert {device for _, device in seen} == {torch.device("cuda", 2)}
    assert threading.current_thread() is threading.main_thread() and thread_cuda_device() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_worker_threads_current_device_is_the_local_rank(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LOCAL_RANK", "1")

    async def main() -> int:
        asyncio.get_running_loop().set_default_executor(worker_executor(max_workers=1))
        return await asyncio.to_thread(torch.cuda.current_device)

    assert asyncio.run(main()) == 1
