"""Fuzzing the manifest decoder: random JSON and random field mutations, each behind a valid
envelope (checksum recomputed, as a forger would), must give a ``BundleFormatError`` or a
valid restore, never another exception; through a store, a miss or a hit, never a raise."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.checkpoint_stores import (
    make_checkpoint,
    make_identity,
    make_tokens,
    open_store,
    put_manifest,
    rewrap,
)
from vllm_recoverssm.checkpoint import (
    BundleFormatError,
    CheckpointStore,
    RequestCheckpoint,
    prefix_digest,
)
from vllm_recoverssm.checkpoint.wire import decode, encode, manifest_from_bytes

TOKENS = make_tokens(24)
_BASE = make_checkpoint(TOKENS)
# An empty tensor (nbytes 0) too: a single changed dimension of it keeps the size consistent,
# the way the overflowing shapes of the fault test did.
CK = RequestCheckpoint(
    tokens=TOKENS,
    layers={**_BASE.layers, "layers.3": {"empty": torch.zeros(0, 2, 3, 4, 5),
                                         "none": torch.zeros(4, 0), "flag": torch.ones(3) > 0}},
    logits=_BASE.logits,
    meta=_BASE.meta,
)
MANIFEST, CHUNKS = encode(CK, make_identity(), prefix_digest(TOKENS), "0" * 32, 512)
BODY = json.loads(MANIFEST.model_dump_json())

EDGE_INTS = [0, 1, -1, 2, 3, 7, 8, 24, 64, 2**31, 2**32, 2**40, 2**63 - 1, 2**63, 2**64,
             -(2**63), 10**30]
scalars = (
    st.none() | st.booleans() | st.sampled_from(EDGE_INTS) | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
    | st.sampled_from(["float32", "int64", "bool", "logits", "tokens", "../x", "a/b", "",
                       "0" * 32, "f" * 64, "prompt", "response"])
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _at(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


PATHS = [p for p in _paths(BODY) if p]
INT_PATHS = [p for p in PATHS if type(_at(BODY, p)) is int]
SHAPE_PATHS = [p for p in PATHS if p[-1] == "shape"]
DIM_PATHS = [p for p in INT_PATHS if len(p) >= 2 and p[-2] == "shape"]
edge_ints = st.sampled_from(EDGE_INTS) | st.integers(-(2**70), 2**70)


@st.composite
def mutated_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """The valid manifest with 1-3 fields replaced, removed, or list items duplicated."""
    body = copy.deepcopy(BODY)
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        # Numbers and shapes are where sizes are computed: aim a good share of the
        # mutations there, the rest anywhere.
        target = draw(st.sampled_from(["dim", "dim", "int", "shape", "any", "any", "any"]))
        pool = {"dim": DIM_PATHS, "int": INT_PATHS, "shape": SHAPE_PATHS, "any": PATHS}[target]
        path = draw(st.sampled_from(pool))
        try:
            parent = _at(body, path[:-1])
            last = path[-1]
            parent[last]  # noqa: B018 - the path may be gone after an earlier mutation
        except (KeyError, IndexError, TypeError):
            continue
        if not isinstance(parent, dict | list):  # an earlier mutation made it a string
            continue
        if target in ("dim", "int"):
            parent[last] = draw(edge_ints)
            continue
        if target == "shape":
            parent[last] = draw(st.lists(edge_ints, max_size=4))
            continue
        action = draw(st.sampled_from(["replace", "replace", "delete", "duplicate"]))
        if action == "replace":
            parent[last] = draw(json_values)
        elif action == "delete":
            del parent[last]
        elif isinstance(parent, list):
            parent.insert(last, copy.deepcopy(parent[last]))
    return body


def _decode_or_format_error(raw: bytes) -> RequestCheckpoint | None:
    try:
        return decode(manifest_from_bytes(raw), [c.clone() for c in CHUNKS])
    except BundleFormatError:
        return None


@settings(max_examples=300, deadline=None)
@given(doc=json_values)
def test_random_json_is_a_format_error(doc: Any) -> None:
    assert _decode_or_format_error(rewrap(doc)) is None


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=300))
def test_random_bytes_are_a_format_error(data: bytes) -> None:
    assert _decode_or_format_error(data) is None


@settings(max_examples=500, deadline=None)
@given(body=mutated_bodies())
def test_field_mutations_give_a_format_error_or_a_valid_restore(body: dict[str, Any]) -> None:
    ck = _decode_or_format_error(rewrap(body))
    if ck is not None:  # a mutation the schema allows: it must be a whole, valid checkpoint
        assert isinstance(ck, RequestCheckpoint) and ck.num_tokens >= 1
        assert ck.nbytes <= sum(c.numel() for c in CHUNKS)


@pytest.fixture(scope="module")
def ram_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CheckpointStore]:
    pytest.importorskip("lmcache")
    s = open_store("ram", None, make_identity())
    yield s
    s.close()


@pytest.mark.lmcache
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=mutated_bodies())
def test_a_store_turns_any_forged_manifest_into_a_miss_or_a_hit(
    ram_store: CheckpointStore, body: dict[str, Any]
) -> None:
    digest = prefix_digest(TOKENS)
    # the real parts under the bundle id the mutated manifest may still name
    for i, chunk in enumerate(CHUNKS):
        ram_store._objects.put(ram_store._chunk_key(len(TOKENS), digest, "0" * 32, i), chunk)
    put_manifest(ram_store, TOKENS, rewrap(body))
    hit = ram_store.lookup(TOKENS + (1, 2))
    if hit is not None:
        assert hit.num_tokens == len(TOKENS) and hit.checkpoint.tokens == TOKENS
        assert isinstance(hit.checkpoint.logits, torch.Tensor)
