"""The bundle format alone (no LMCache): round trips and rejection of every kind of damage."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.checkpoint_stores import make_checkpoint, make_identity, make_tokens
from vllm_recoverssm.checkpoint import BundleFormatError, RequestCheckpoint, prefix_digest
from vllm_recoverssm.checkpoint.wire import (
    ENVELOPE,
    decode,
    encode,
    manifest_from_bytes,
    manifest_to_bytes,
)

BUNDLE_ID = "0" * 32


def _encode(ck: RequestCheckpoint, chunk_bytes: int = 1024):
    return encode(ck, make_identity(), prefix_digest(ck.tokens), BUNDLE_ID, chunk_bytes)


def _rewrap(body: dict) -> bytes:
    """Envelope around edited JSON with a correct checksum: only the schema can catch it."""
    raw = json.dumps(body).encode()
    return ENVELOPE.pack(b"RSSMCKPT", 1, len(raw), hashlib.sha256(raw).digest()) + raw


def test_round_trip_is_bit_exact_for_every_dtype() -> None:
    tokens = make_tokens(5)
    ck = RequestCheckpoint(
        tokens=tokens,
        layers={
            "a": {
                "f64": torch.randn(3, dtype=torch.float64),
                "bf16": torch.randn(2, 3).to(torch.bfloat16),
                "f16": torch.randn(4).half(),
                "i8": torch.tensor([-3, 4], dtype=torch.int8),
                "bool": torch.tensor([True, False, True]),
                "scalar": torch.tensor(2.5),
                "empty": torch.zeros(0, 4),
            },
            "b": {"strided": torch.arange(12.0).reshape(3, 4).t()},
        },
        logits=torch.randn(7),
        boundary="response",
        meta={"num_accepted": 1, "note": "x", "flag": True, "ratio": 0.5},
    )
    manifest, chunks = _encode(ck, chunk_bytes=64)
    assert len(chunks) > 1
    back = decode(manifest_from_bytes(manifest_to_bytes(manifest)), chunks)
    assert back.same_as(ck)
    assert back.layers["b"]["strided"].is_contiguous()


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    seed=st.integers(0, 1000),
    chunk=st.integers(16, 4096),
    flip=st.integers(0, 10**9),
)
def test_any_single_bit_flip_in_a_part_is_rejected(
    n: int, seed: int, chunk: int, flip: int
) -> None:
    ck = make_checkpoint(make_tokens(n, seed), seed)
    manifest, chunks = _encode(ck, chunk)
    assert decode(manifest, [c.clone() for c in chunks]).same_as(ck)
    total = sum(c.numel() for c in chunks)
    pos = flip % (8 * total)
    byte, bit = divmod(pos, 8)
    damaged = [c.clone() for c in chunks]
    for c in damaged:
        if byte < c.numel():
            c[byte] ^= 1 << bit
            break
        byte -= c.numel()
    with pytest.raises(BundleFormatError, match="checksum"):
        decode(manifest, damaged)


def test_missing_short_or_extra_parts_are_rejected() -> None:
    ck = make_checkpoint(make_tokens(20))
    manifest, chunks = _encode(ck)
    with pytest.raises(BundleFormatError, match="parts"):
        decode(manifest, chunks[:-1])
    with pytest.raises(BundleFormatError, match="bytes"):
        decode(manifest, [chunks[0][:-1], *chunks[1:]])
    with pytest.raises(BundleFormatError, match="parts"):
        decode(manifest, [*chunks, chunks[0]])


def test_manifest_envelope_damage_is_rejected() -> None:
    manifest, _ = _encode(make_checkpoint(make_tokens(8)))
    raw = bytearray(manifest_to_bytes(manifest))
    with pytest.raises(BundleFormatError, match="shorter"):
        manifest_from_bytes(raw[:10])
    with pytest.raises(BundleFormatError, match="magic"):
        manifest_from_bytes(b"X" + raw[1:])
    wrong_version = bytearray(raw)
    struct.pack_into("<I", wrong_version, 8, 2)
    with pytest.raises(BundleFormatError, match="version"):
        manifest_from_bytes(wrong_version)
    with pytest.raises(BundleFormatError, match="JSON bytes"):
        manifest_from_bytes(raw[:-1])
    flipped = bytearray(raw)
    flipped[-5] ^= 0x20
    with pytest.raises(BundleFormatError, match="checksum"):
        manifest_from_bytes(flipped)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(extra_field=1), "extra"),
        (lambda m: m.update(format="something-else"), "format"),
        (lambda m: m["identity"].update(mode="full_state"), "identity_digest"),
        (lambda m: m.update(total_bytes=m["total_bytes"] + 1), "total_bytes"),
        (lambda m: m["tensors"][1].update(offset=0), "overlaps"),
        (lambda m: m["tensors"][1].update(shape=[999]), "bytes"),
        (lambda m: m["tensors"][1].update(dtype="object"), "dtype"),
        (lambda m: m["tensors"][1].update(name="../../etc"), "tensor name"),
        (lambda m: m["tensors"][0].update(shape=[3]), "tokens"),
        (lambda m: m["chunks"][0].update(sha256="zz"), "sha256"),
        (lambda m: m.update(num_tokens="8"), "num_tokens"),
    ],
)
def test_manifest_schema_violations_are_rejected(edit, message: str) -> None:
    manifest, _ = _encode(make_checkpoint(make_tokens(8)))
    body = json.loads(manifest.model_dump_json())
    edit(body)
    with pytest.raises(BundleFormatError, match=message):
        manifest_from_bytes(_rewrap(body))


def test_loading_code_never_unpickles() -> None:
    """Bundles are untrusted input: no pickle, no torch.load anywhere in the package."""
    import re
    from pathlib import Path

    import vllm_recoverssm.checkpoint as pkg

    banned = re.compile(r"import pickle|pickle\.|torch\.load\(|import marshal|\beval\(")
    for path in Path(pkg.__file__).parent.glob("*.py"):
        assert not banned.search(path.read_text()), path.name
