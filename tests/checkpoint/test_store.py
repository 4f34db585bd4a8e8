"""The store over LMCache's real backends: publish, longest-prefix lookup, atomic writes."""

from __future__ import annotations

import logging

import pytest

from tests.support.checkpoint_stores import make_checkpoint, make_identity, make_tokens, open_store
from vllm_recoverssm.checkpoint import CheckpointStore
from vllm_recoverssm.checkpoint.lmcache_objects import LMCacheObjects

pytestmark = pytest.mark.lmcache


def test_longest_stored_prefix_wins(store: CheckpointStore) -> None:
    prompt = make_tokens(40)
    answer = make_tokens(25, seed=1)
    at_prompt = make_checkpoint(prompt)
    at_answer = make_checkpoint(prompt + answer, boundary="response")
    assert store.store(at_prompt).stored
    assert store.store(at_answer).stored

    # a longer prompt extending the stored prompt: restore the 40-token bundle
    hit = store.lookup(prompt + make_tokens(7, seed=2))
    assert hit is not None and hit.num_tokens == 40 and not hit.exact
    assert hit.checkpoint.same_as(at_prompt)

    # exact prompt: logits come back, nothing is left to compute
    hit = store.lookup(prompt)
    assert hit is not None and hit.exact and hit.checkpoint.same_as(at_prompt)

    # follow-up turn: prompt + answer + new text hits the response-boundary bundle
    hit = store.lookup(prompt + answer + make_tokens(9, seed=3))
    assert hit is not None and hit.num_tokens == 65
    assert hit.checkpoint.boundary == "response" and hit.checkpoint.same_as(at_answer)

    # a different first token shares no prefix
    assert store.lookup((prompt[0] + 1,) + prompt[1:]) is None
    assert store.stats.hits == 3 and store.stats.misses == 1
    assert store.stats.restored_tokens == 40 + 40 + 65


def test_bundles_span_several_parts(store: CheckpointStore) -> None:
    ck = make_checkpoint(make_tokens(200))
    result = store.store(ck)
    assert result.stored and result.nbytes > 4 * store.config.chunk_bytes
    hit = store.lookup(ck.tokens)
    assert hit is not None and hit.checkpoint.same_as(ck)


def test_requests_with_images_are_never_exported(store: CheckpointStore) -> None:
    ck = make_checkpoint(make_tokens(12), has_images=True)
    result = store.store(ck)
    assert not result.stored and result.reason == "has_images"
    assert not store.contains(ck.tokens) and store.lookup(ck.tokens) is None
    assert store.stats.skipped_images == 1


def test_storing_a_stored_prefix_again_keeps_the_first_bundle(store: CheckpointStore) -> None:
    toks = make_tokens(30)
    first = make_checkpoint(toks, seed=1)
    assert store.store(first).stored
    again = store.store(make_checkpoint(toks, seed=2))
    assert not again.stored and again.reason == "exists"
    hit = store.lookup(toks)
    assert hit is not None and hit.checkpoint.same_as(first)


@pytest.mark.parametrize(
    "change", [{"mode": "full_state"}, {"num_speculative_tokens": 2}, {"tp_rank": 1, "tp_size": 2}]
)
def test_another_layout_never_sees_the_bundle(disk_store: CheckpointStore, change: dict) -> None:
    toks = make_tokens(20)
    assert disk_store.store(make_checkpoint(toks)).stored
    other = open_store("disk", disk_store.config.path, make_identity(**change))
    try:
        assert other.lookup(toks) is None and not other.contains(toks)
        assert other.stats.rejected == 0  # a different key, not a rejected bundle
    finally:
        other.close()


def _fail_after(objects: LMCacheObjects, n_puts: int, exc: BaseException) -> list[int]:
    calls = [0]
    real_put = objects.put

    def put(key, data, hold=False):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] > n_puts:
            raise exc
        real_put(key, data, hold=hold)

    objects.put = put  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("fail_at", [0, 2, "manifest"])
def test_a_write_failing_midway_leaves_nothing_visible(
    store: CheckpointStore, fail_at: int | str, caplog: pytest.LogCaptureFixture
) -> None:
    short = make_checkpoint(make_tokens(10))
    assert store.store(short).stored
    ck = make_checkpoint(make_tokens(10) + make_tokens(390, seed=5))
    n_chunks = -(-ck.nbytes // store.config.chunk_bytes)
    assert n_chunks > 3
    # "manifest": every chunk is written, the manifest write itself fails
    limit = n_chunks + 1 if fail_at == "manifest" else int(fail_at)
    objects = store._objects
    _fail_after(objects, limit, OSError("disk full"))
    with caplog.at_level(logging.WARNING):
        result = store.store(ck)
    assert not result.stored and "disk full" in result.reason
    assert "not stored" in caplog.text
    del objects.put  # back to the real method
    assert not store.contains(ck.tokens)
    hit = store.lookup(ck.tokens)
    assert hit is not None and hit.num_tokens == 10  # the older, shorter bundle only
    if store.config.backend == "disk":
        assert store.config.path is not None
        names = [p.name for p in store.config.path.iterdir()]
        assert not [n for n in names if "ntok%400" in n], names  # parts were cleaned up
    # the same checkpoint stores fine afterwards
    assert store.store(ck).stored
    assert store.lookup(ck.tokens).checkpoint.same_as(ck)  # type: ignore[union-attr]


def test_an_unexpected_error_midway_is_raised_after_cleanup(store: CheckpointStore) -> None:
    ck = make_checkpoint(make_tokens(150))
    _fail_after(store._objects, 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        store.store(ck)
    del store._objects.put
    assert not store.contains(ck.tokens) and store.lookup(ck.tokens) is None


def test_ram_eviction_turns_a_bundle_into_a_miss_not_a_wrong_restore(
    identity, caplog: pytest.LogCaptureFixture
) -> None:
    s = open_store("ram", None, identity, ram_bytes=2**20, chunk_bytes=64 * 1024)
    try:
        first = make_checkpoint(make_tokens(4000))  # about 0.26 MiB each, 1 MiB pool
        assert s.store(first).stored
        for seed in range(1, 4):  # the fourth bundle evicts the first one's oldest parts
            assert s.store(make_checkpoint(make_tokens(4000, seed=seed))).stored
        with caplog.at_level(logging.WARNING):
            assert s.lookup(first.tokens) is None
        assert s.stats.rejected == 1 and "missing" in caplog.text
        assert not s.contains(first.tokens)  # the rest of the broken bundle was dropped
        last = make_checkpoint(make_tokens(4000, seed=3))
        assert s.lookup(last.tokens).checkpoint.same_as(last)  # type: ignore[union-attr]
    finally:
        s.close()
