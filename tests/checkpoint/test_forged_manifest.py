"""Forged manifests (valid envelope, hostile JSON) are misses with a warning, never an error.

Whoever can write the checkpoint directory can write a manifest with a correct checksum.
Every field is bounded and checked, and whatever decoding raises becomes a miss: the lookup
falls back to the next shorter valid prefix and the request goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from tests.support.checkpoint_stores import (
    make_checkpoint,
    make_tokens,
    manifest_body,
    put_manifest,
    rewrap,
)
from vllm_recoverssm.checkpoint import CheckpointStore
from vllm_recoverssm.checkpoint import store as store_module

pytestmark = pytest.mark.lmcache

SHORT, LONG = 12, 80


def _tensor(m: dict, name: str) -> dict:
    return next(t for t in m["tensors"] if t["name"] == name)


FORGERIES: dict[str, Callable[[dict], object]] = {
    # the case: a dimension beyond int64 whose product is zero bytes
    "dimension beyond int64": lambda m: _tensor(m, "state").update(shape=[2**64, 0], nbytes=0),
    "dimensions whose product overflows int64": lambda m: _tensor(m, "state").update(
        shape=[2**40, 2**40, 2**40], nbytes=2**120
    ),
    "zero-sized overflow": lambda m: _tensor(m, "conv").update(shape=[2**63, 2**63, 0], nbytes=0),
    "negative dimension": lambda m: _tensor(m, "state").update(shape=[-2, 8, 8]),
    "offset beyond the payload": lambda m: _tensor(m, "logits").update(offset=2**62),
    "negative offset": lambda m: _tensor(m, "logits").update(offset=-64),
    "element count against nbytes": lambda m: _tensor(m, "logits").update(nbytes=4),
    "unknown dtype name": lambda m: _tensor(m, "state").update(dtype="torch.float32"),
    "object dtype": lambda m: _tensor(m, "state").update(dtype="object"),
    "layer name with a path": lambda m: _tensor(m, "state").update(layer="../../etc"),
    "tensor name with a separator": lambda m: _tensor(m, "conv").update(name="a/b"),
    "bundle id with a path": lambda m: m.update(bundle_id="../../../../etc/passwd"),
    "total beyond the bound": lambda m: m.update(total_bytes=2**41),
    "part size beyond the bound": lambda m: m["chunks"][0].update(nbytes=2**50),
    "tokens beyond the bound": lambda m: m.update(num_tokens=2**40),
    "tokens as floats": lambda m: _tensor(m, "tokens").update(dtype="float64"),
    "no logits": lambda m: m.update(tensors=[t for t in m["tensors"] if t["name"] != "logits"]),
    "not-a-number in meta": lambda m: m["meta"].update(x=float("nan")),
    "huge string in meta": lambda m: m["meta"].update(x="y" * 100_000),
    "integer beyond int64 in meta": lambda m: m["meta"].update(x=2**70),
    "bool for a count": lambda m: m.update(num_tokens=True),
    "nested lists for a shape": lambda m: _tensor(m, "state").update(shape=[[[[2]]]]),
    "too many dimensions": lambda m: _tensor(m, "state").update(shape=[1] * 64),
    "a list where an object belongs": lambda m: m.update(identity=[1, 2, 3]),
}


@pytest.fixture
def with_bundles(store: CheckpointStore) -> CheckpointStore:
    toks = make_tokens(LONG)
    assert store.store(make_checkpoint(toks[:SHORT])).stored
    assert store.store(make_checkpoint(toks)).stored
    return store


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_forged_manifest_is_a_miss_with_a_warning(
    with_bundles: CheckpointStore, forgery: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = with_bundles
    toks = make_tokens(LONG)
    body = manifest_body(store, toks)
    FORGERIES[forgery](body)
    put_manifest(store, toks, rewrap(body))
    with caplog.at_level(logging.WARNING, logger="vllm_recoverssm.checkpoint"):
        hit = store.lookup(toks)
    assert hit is not None and hit.num_tokens == SHORT
    assert hit.checkpoint.same_as(make_checkpoint(toks[:SHORT]))
    assert store.stats.rejected == 1
    assert f"{LONG}-token prefix ignored" in caplog.text


def test_any_exception_while_decoding_is_a_miss(
    with_bundles: CheckpointStore, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    real = store_module.decode

    def decode(manifest, chunks):  # type: ignore[no-untyped-def]
        if manifest.num_tokens == LONG:
            raise TypeError("an error nobody anticipated")
        return real(manifest, chunks)

    monkeypatch.setattr(store_module, "decode", decode)
    with caplog.at_level(logging.WARNING, logger="vllm_recoverssm.checkpoint"):
        hit = with_bundles.lookup(make_tokens(LONG))
    assert hit is not None and hit.num_tokens == SHORT
    assert "TypeError: an error nobody anticipated" in caplog.text


def test_a_forged_manifest_is_replaced_by_the_next_store(with_bundles: CheckpointStore) -> None:
    store = with_bundles
    toks = make_tokens(LONG)
    body = manifest_body(store, toks)
    FORGERIES["dimension beyond int64"](body)
    put_manifest(store, toks, rewrap(body))
    good = make_checkpoint(toks)
    assert store.store(good).stored
    hit = store.lookup(toks)
    assert hit is not None and hit.exact and hit.checkpoint.same_as(good)
