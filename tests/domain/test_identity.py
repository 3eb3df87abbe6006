"""ByIdentity: one result per identity of its objects, never another object's through a reused
id (each entry keeps its objects alive), and a bounded memo."""

from __future__ import annotations

from crossflow_ctl.domain.identity import ByIdentity


class _Box:
    def __init__(self, value: int) -> None:
        self.value = value


def test_one_result_per_identity_and_equal_objects_are_still_other_objects() -> None:
    calls: list[tuple[int, int]] = []

    def build(a: _Box, b: _Box) -> int:
        calls.append((a.value, b.value))
        return a.value * 10 + b.value

    memo: ByIdentity[int] = ByIdentity(build)
    a, b = _Box(1), _Box(2)
    assert memo.get(a, b) == 12 and memo.get(a, b) == 12
    assert calls == [(1, 2)]
    assert memo.get(_Box(1), b) == 12 and len(calls) == 2  # another object: built again
    assert memo.get(b, a) == 21  # the order is part of the key


def test_a_freed_objects_id_never_gives_its_result_to_another() -> None:
    memo: ByIdentity[int] = ByIdentity(lambda box: box.value)
    seen: dict[int, int] = {}
    for i in range(200):  # freed boxes' ids get reused by new ones, unless the memo keeps them
        box = _Box(i)
        seen[id(box)] = seen.get(id(box), 0) + 1
        assert memo.get(box) == i
    assert max(seen.values()) == 1  # the memo kept each alive, so no id came back


def test_the_memo_is_dropped_when_full() -> None:
    built: list[int] = []

    def build(box: _Box) -> int:
        built.append(box.value)
        return box.value

    memo: ByIdentity[int] = ByIdentity(build, size=2)
    boxes = [_Box(i) for i in range(3)]
    for box in boxes:
        memo.get(box)
    memo.get(boxes[0])  # the third entry dropped the first two
    assert built == [0, 1, 2, 0]
