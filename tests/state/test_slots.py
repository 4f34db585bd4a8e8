"""Slot allocator: all-or-nothing, lowest ids first, clear errors."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from vllm_recoverssm.state import PoolExhaustedError, SlotAllocator


def test_lowest_ids_first_and_counts():
    a = SlotAllocator(5)
    assert (a.num_slots, a.num_free, a.num_used) == (5, 5, 0)
    assert a.acquire("r1") == [0]
    assert a.acquire("r2", 2) == [1, 2]
    assert (a.num_free, a.num_used) == (2, 3)
    assert a.release("r1") == [0]
    # the freed low id is handed out first
    assert a.acquire("r3", 2) == [0, 3]
    assert a.owned("r3") == [0, 3]
    assert a.owned("nobody") == []
    assert "r2" in a and "r1" not in a


def test_owner_may_acquire_more():
    a = SlotAllocator(4)
    a.acquire("r", 1)
    a.acquire("x", 1)
    assert a.acquire("r", 2) == [2, 3]
    assert a.owned("r") == [0, 2, 3]
    assert a.release("r") == [0, 2, 3]
    assert a.num_free == 3


def test_exhausted_is_all_or_nothing_and_names_everything():
    a = SlotAllocator(3)
    a.acquire("a", 2)
    with pytest.raises(PoolExhaustedError) as ei:
        a.acquire("req-7", 2)
    msg = str(ei.value)
    assert "'req-7'" in msg and "2 slot" in msg and "only 1 of 3" in msg
    assert (ei.value.owner, ei.value.requested, ei.value.free) == ("req-7", 2, 1)
    assert isinstance(ei.value, RuntimeError)
    assert a.num_free == 1 and a.owned("req-7") == []
    assert a.can_acquire(1) and not a.can_acquire(2)


def test_release_unknown_owner():
    a = SlotAllocator(2)
    with pytest.raises(KeyError, match="ghost"):
        a.release("ghost")
    a.acquire("r")
    a.release("r")
    with pytest.raises(KeyError, match="'r'"):
        a.release("r")


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="num_slots"):
        SlotAllocator(bad)
    a = SlotAllocator(2)
    with pytest.raises(ValueError, match="count"):
        a.acquire("r", bad)


def test_bad_types():
    with pytest.raises(TypeError, match="num_slots"):
        SlotAllocator(2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="count"):
        SlotAllocator(2).acquire("r", True)


def test_reset():
    a = SlotAllocator(3)
    a.acquire("a", 3)
    a.reset()
    assert a.num_free == 3 and a.acquire("b") == [0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 4)), max_size=40))
def test_random_sequences_against_a_model(ops):
    """Compare with a trivially correct model: a sorted free set and a dict."""
    a = SlotAllocator(8)
    free = set(range(8))
    held: dict[int, list[int]] = {}
    for is_acquire, owner, count in ops:
        if is_acquire:
            if count > len(free):
                with pytest.raises(PoolExhaustedError):
                    a.acquire(owner, count)
                continue
            want = sorted(free)[:count]
            assert a.acquire(owner, count) == want
            free -= set(want)
            held.setdefault(owner, []).extend(want)
        elif owner in held:
            assert a.release(owner) == sorted(held.pop(owner))
            assert a.owned(owner) == []
            free = set(range(8)) - {s for v in held.values() for s in v}
        else:
            with pytest.raises(KeyError):
                a.release(owner)
        assert a.num_free == len(free)
        assert a.num_used + a.num_free == 8
        all_held = [s for v in held.values() for s in v]
        assert len(all_held) == len(set(all_held))
