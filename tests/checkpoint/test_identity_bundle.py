"""Layout identity, prefix hashing and checkpoint validation (no LMCache)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tests.support.checkpoint_stores import make_identity
from vllm_recoverssm.checkpoint import RequestCheckpoint, prefix_digest
from vllm_recoverssm.checkpoint.identity import prefix_digests


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"revision": "seed-1"},
        {"dtypes": {"state": "float32", "conv": "float32", "kv": "bfloat16", "logits": "float32"}},
        {"layout_version": 2},
        {"tp_rank": 1, "tp_size": 2},
        {"num_speculative_tokens": 4},
        {"mode": "full_state"},
        {"extra": {"block_size": 32}},
    ],
)
def test_every_identity_field_changes_the_digest(change: dict) -> None:
    assert make_identity(**change).digest() != make_identity().digest()


def test_identity_digest_and_prefix_digest_are_the_same_in_a_fresh_process() -> None:
    here = str(Path(__file__).resolve().parents[2])
    code = (
        f"import sys; sys.path.insert(0, {here!r});"
        "from tests.support.checkpoint_stores import make_identity;"
        "from vllm_recoverssm.checkpoint import prefix_digest;"
        "print(make_identity().digest(), prefix_digest([1, 2, 3]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    ).stdout.split()
    assert out == [make_identity().digest(), prefix_digest([1, 2, 3])]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tp_rank": 1}, "tp_rank"),
        ({"dtypes": {"state": "float128"}}, "float128"),
        ({"mode": "speculative"}, "mode"),
        ({"model": ""}, "model"),
        ({"unknown": 1}, "unknown"),
        ({"num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ],
)
def test_bad_identity_is_refused_with_the_field_named(change: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        make_identity(**change)


def test_prefix_digests_match_single_digests() -> None:
    toks = [5, 0, 2**32 - 1, 7]
    assert prefix_digests(toks) == [prefix_digest(toks[:n]) for n in range(1, 5)]
    assert prefix_digest([1, 2]) != prefix_digest([2, 1])
    assert prefix_digest([1]) != prefix_digest([1, 0])


@pytest.mark.parametrize(
    ("tokens", "message"), [([1, -1], r"tokens\[1\]"), ([2**32], "outside"), ([1.0], "int")]
)
def test_bad_tokens_are_refused(tokens: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prefix_digest(tokens)


def _ck(**kw: object) -> RequestCheckpoint:
    args: dict[str, object] = dict(
        tokens=(1, 2), layers={"l0": {"state": torch.zeros(2)}}, logits=torch.zeros(4)
    )
    args.update(kw)
    return RequestCheckpoint(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tokens": ()}, "at least one token"),
        ({"layers": {"l0": {"state": [1.0]}}}, "'l0' tensor 'state': expected a torch.Tensor"),
        ({"layers": {"l/0": {"s": torch.zeros(1)}}}, "layer name 'l/0'"),
        ({"layers": {"l0": {}}}, "non-empty"),
        ({"layers": {"l0": {"s": torch.zeros(1, dtype=torch.complex64)}}}, "complex64"),
        ({"logits": torch.zeros([1] * 9)}, "9 dimensions"),
        ({"boundary": "middle"}, "boundary"),
        ({"has_images": 1}, "has_images"),
        ({"meta": {"x": [1]}}, r"meta\['x'\]"),
    ],
)
def test_bad_checkpoint_is_refused_with_the_part_named(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _ck(**kw)


def test_same_as_compares_bits() -> None:
    a = _ck()
    assert a.same_as(_ck())
    assert not a.same_as(_ck(logits=torch.tensor([0.0, 0.0, 0.0, -0.0])))
    assert not a.same_as(_ck(boundary="response"))
