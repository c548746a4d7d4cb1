"""The store judges a fetched batch in runs without repeated trajectory ids (so a redelivered copy
in the same batch sees the first copy's effects, as if the messages were taken one by one)."""

from __future__ import annotations

from trajmesh.services.store.service import _Incoming, runs_without_repeats


def _items(tids: list[str]) -> list[_Incoming]:
    return [_Incoming(b"", i, None, t) for i, t in enumerate(tids)]


def _shape(tids: list[str]) -> list[list[str]]:
    return [[it.tid for it in run] for run in runs_without_repeats(_items(tids))]


def test_no_repeat_is_one_run() -> None:
    assert _shape(["a", "b", "c"]) == [["a", "b", "c"]]


def test_a_repeat_starts_a_new_run_and_order_is_kept() -> None:
    assert _shape(["a", "b", "a", "c", "b", "b"]) == [["a", "b"], ["a", "c", "b"], ["b"]]
    runs = runs_without_repeats(_items(["a", "b", "a"]))
    assert [it.msg for run in runs for it in run] == [0, 1, 2]


def test_unparseable_messages_have_no_id_and_never_split() -> None:
    assert _shape(["", "", "a", ""]) == [["", "", "a", ""]]
    assert _shape([]) == []
