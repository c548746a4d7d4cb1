"""chain_sum task source: compact format, stable ids, disjoint held-out split, upstream scoring."""

import subprocess
import sys

from trajmesh.envs import chain_sum


def test_compact_format_and_scoring():
    tasks = chain_sum.make_tasks(3, 20)
    for t in tasks:
        assert t["prompt"].endswith("=") and " " not in t["prompt"]
        assert eval(t["prompt"][:-1]) == int(t["answer"])  # noqa: S307 - digits and +/- only
        assert chain_sum.score(t["answer"], t) == 1.0
        assert chain_sum.score(str(int(t["answer"]) + 1), t) < 1.0
    assert [t["task_id"] for t in tasks] == [t["task_id"] for t in chain_sum.make_tasks(3, 20)]
    assert len({t["task_id"] for t in tasks}) == 20


def test_heldout_split_is_disjoint():
    train, heldout = chain_sum.make_split(2000, 200)
    assert len(heldout) == 200 and len({t["prompt"] for t in heldout}) == 200
    assert not {t["prompt"] for t in train} & {t["prompt"] for t in heldout}


def test_task_source_and_engine_client_import_without_torch():
    code = (
        "import sys, trajmesh.envs.chain_sum, trajmesh.rollout.engines.engine_client; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
