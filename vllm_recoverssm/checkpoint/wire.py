"""The bundle's wire format: raw tensor bytes in checksummed chunks plus a JSON manifest.

A bundle is stored as ``len(chunks)`` payload objects and one manifest object. The payload is
the raw bytes of every tensor (token ids first, then each layer's tensors, then the logits),
each at a 64-byte aligned offset, cut into chunks of at most ``chunk_bytes``. The manifest is a
fixed envelope -- magic, format version, JSON length, SHA-256 of the JSON and, for a store with
an HMAC key, the HMAC-SHA256 of envelope and JSON -- followed by the JSON document that names
the layout identity, the prefix, every chunk (size, SHA-256) and every tensor (dtype, shape,
offset, size).

Reading treats every byte as untrusted: the envelope, the JSON schema (unknown fields refused),
the identity, every count, size, dimension, offset, name and checksum are checked against
fixed bounds before a single tensor is built, and nothing is ever unpickled. A forged manifest
can make a lookup miss, never raise anything but ``BundleFormatError`` here.
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .bundle import MAX_NDIM, RequestCheckpoint, check_name
from .errors import BundleFormatError
from .identity import LayoutIdentity, ScalarValue
from .integrity import TAG_BYTES, sign, verify
from .tensors import DTYPES, as_bytes, dtype_name, from_bytes

MAGIC = b"RSSMCKPT"
MAGIC_KEYED = b"RSSMCKPH"
FORMAT_NAME: Literal["vllm-recoverssm.checkpoint"] = "vllm-recoverssm.checkpoint"
FORMAT_VERSION: Literal[1] = 1
ENVELOPE = struct.Struct("<8sII32s")  # magic, version, JSON length, SHA-256 of the JSON
TAG = struct.Struct(f"<{TAG_BYTES}s")  # keyed envelopes: HMAC of envelope + JSON, after it
MAX_MANIFEST_JSON = 16 * 2**20
MAX_MANIFEST_BYTES = ENVELOPE.size + TAG.size + MAX_MANIFEST_JSON
ALIGN = 64
TOKENS_NAME = "tokens"
LOGITS_NAME = "logits"
_HEX64 = r"^[0-9a-f]{64}$"

# Bounds of every number a manifest may carry. They are far above any real bundle and keep
# every product and every allocation a reader makes finite and small enough to refuse early.
MAX_BUNDLE_BYTES = 2**40
MAX_TOKENS = 2**24
MAX_PARTS = 2**20
MAX_TENSORS = 2**16
MAX_META = 64
MAX_META_STR = 1024
_INT64 = 2**63

Dim = Annotated[int, Field(ge=0, le=MAX_BUNDLE_BYTES)]
Size = Annotated[int, Field(ge=0, le=MAX_BUNDLE_BYTES)]


def check_meta_value(key: str, value: object) -> None:
    """``ValueError`` unless ``value`` is a small, finite scalar (bounded int, str, bool)."""
    check_name(key, "meta key")
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if not -_INT64 <= value < _INT64:
            raise ValueError(f"meta[{key!r}]: integer outside int64")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"meta[{key!r}]: not a finite number")
    elif isinstance(value, str):
        if len(value) > MAX_META_STR:
            raise ValueError(f"meta[{key!r}]: longer than {MAX_META_STR} characters")
    else:
        raise ValueError(f"meta[{key!r}]: expected int, float, str or bool")


class ChunkEntry(BaseModel):
    """One payload chunk: its size and SHA-256."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    nbytes: int = Field(ge=1, le=MAX_BUNDLE_BYTES)
    sha256: str = Field(pattern=_HEX64)


class TensorEntry(BaseModel):
    """Where one tensor lies in the payload. ``layer`` is None for tokens and logits."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    layer: str | None
    name: str
    dtype: str
    shape: list[Dim] = Field(max_length=MAX_NDIM)
    offset: Size
    nbytes: Size

    @model_validator(mode="after")
    def _check(self) -> TensorEntry:
        if self.layer is not None:
            check_name(self.layer, "layer name")
        check_name(self.name, "tensor name")
        if self.dtype not in DTYPES:
            raise ValueError(f"tensor {self.name!r}: unknown dtype {self.dtype!r}")
        size = DTYPES[self.dtype].itemsize
        for d in self.shape:
            size *= d
            if size > MAX_BUNDLE_BYTES:  # stop before the product grows without bound
                raise ValueError(f"tensor {self.name!r}: shape {self.shape} is too large")
        if size != self.nbytes:
            raise ValueError(
                f"tensor {self.name!r}: shape {self.shape} x {self.dtype} is "
                f"{size} bytes, manifest says {self.nbytes}"
            )
        return self


class Manifest(BaseModel):
    """The manifest of one bundle; written last, so its presence publishes the bundle."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    format: Literal["vllm-recoverssm.checkpoint"]
    version: Literal[1]
    identity: LayoutIdentity
    identity_digest: str = Field(pattern=_HEX64)
    num_tokens: int = Field(ge=1, le=MAX_TOKENS)
    prefix_digest: str = Field(pattern=_HEX64)
    boundary: Literal["prompt", "response"]
    bundle_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    meta: dict[str, ScalarValue] = Field(max_length=MAX_META)
    total_bytes: Size
    chunks: list[ChunkEntry] = Field(max_length=MAX_PARTS)
    tensors: list[TensorEntry] = Field(min_length=2, max_length=MAX_TENSORS)

    @model_validator(mode="after")
    def _check(self) -> Manifest:
        for k, v in self.meta.items():
            check_meta_value(k, v)
        if self.identity.digest() != self.identity_digest:
            raise ValueError("identity_digest does not match the identity it names")
        if sum(c.nbytes for c in self.chunks) != self.total_bytes:
            raise ValueError("chunk sizes do not add up to total_bytes")
        seen: set[tuple[str | None, str]] = set()
        end = 0
        for t in sorted(self.tensors, key=lambda e: e.offset):
            if (t.layer, t.name) in seen:
                raise ValueError(f"tensor {t.layer}/{t.name} is listed twice")
            seen.add((t.layer, t.name))
            if t.offset < end or t.offset + t.nbytes > self.total_bytes:
                raise ValueError(f"tensor {t.layer}/{t.name} overlaps or runs past the payload")
            end = t.offset + t.nbytes
        tokens = [t for t in self.tensors if t.layer is None and t.name == TOKENS_NAME]
        if len(tokens) != 1 or tokens[0].dtype != "int64" or tokens[0].shape != [self.num_tokens]:
            raise ValueError(f"expected one int64 '{TOKENS_NAME}' tensor of {self.num_tokens}")
        if not any(t.layer is None and t.name == LOGITS_NAME for t in self.tensors):
            raise ValueError(f"no '{LOGITS_NAME}' tensor")
        if any(t.layer is None and t.name not in (TOKENS_NAME, LOGITS_NAME) for t in self.tensors):
            raise ValueError("a tensor without a layer must be the tokens or the logits")
        return self

    def tensor_layout(self) -> list[tuple[str | None, str, str, tuple[int, ...]]]:
        """Every tensor as (layer, name, dtype, shape) in manifest order: what a model reads."""
        return [(t.layer, t.name, t.dtype, tuple(t.shape)) for t in self.tensors]


def tensor_layout(ck: RequestCheckpoint) -> list[tuple[str | None, str, str, tuple[int, ...]]]:
    """``ck``'s tensors as :meth:`Manifest.tensor_layout` lists them (tokens first)."""
    out: list[tuple[str | None, str, str, tuple[int, ...]]] = [
        (None, TOKENS_NAME, "int64", (ck.num_tokens,))
    ]
    out += [(lname, tname, dtype_name(t.dtype), tuple(t.shape)) for lname, tname, t in
            ck.named_tensors()]
    return out


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().data).hexdigest()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def encode(
    ck: RequestCheckpoint,
    identity: LayoutIdentity,
    prefix_digest: str,
    bundle_id: str,
    chunk_bytes: int,
) -> tuple[Manifest, list[torch.Tensor]]:
    """Lay ``ck`` out as payload chunks (uint8 tensors) and the manifest that names them."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    items: list[tuple[str | None, str, torch.Tensor]] = [
        (None, TOKENS_NAME, torch.tensor(ck.tokens, dtype=torch.int64))
    ]
    items += list(ck.named_tensors())
    entries: list[TensorEntry] = []
    raws: list[torch.Tensor] = []
    offset = 0
    for layer, name, t in items:
        raw = as_bytes(t)
        offset = _align(offset)
        entries.append(
            TensorEntry(
                layer=layer,
                name=name,
                dtype=dtype_name(t.dtype),
                shape=list(t.shape),
                offset=offset,
                nbytes=raw.numel(),
            )
        )
        raws.append(raw)
        offset += raw.numel()
    payload = torch.zeros(offset, dtype=torch.uint8)
    for e, raw in zip(entries, raws, strict=True):
        payload[e.offset : e.offset + e.nbytes].copy_(raw)
    chunks = list(payload.split(chunk_bytes)) if offset else []
    manifest = Manifest(
        format=FORMAT_NAME,
        version=FORMAT_VERSION,
        identity=identity,
        identity_digest=identity.digest(),
        num_tokens=ck.num_tokens,
        prefix_digest=prefix_digest,
        boundary=ck.boundary,
        bundle_id=bundle_id,
        meta=dict(ck.meta),
        total_bytes=offset,
        chunks=[ChunkEntry(nbytes=c.numel(), sha256=_sha256(c)) for c in chunks],
        tensors=entries,
    )
    return manifest, chunks


def manifest_to_bytes(manifest: Manifest, key: bytes | None = None) -> bytes:
    """Envelope + JSON of ``manifest``; with ``key`` the keyed envelope carrying its HMAC."""
    body = manifest.model_dump_json().encode()
    magic = MAGIC if key is None else MAGIC_KEYED
    head = ENVELOPE.pack(magic, FORMAT_VERSION, len(body), hashlib.sha256(body).digest())
    if key is None:
        return head + body
    return head + TAG.pack(sign(key, head + body)) + body


def manifest_from_bytes(
    raw: bytes | bytearray | memoryview, key: bytes | None = None
) -> Manifest:
    """Parse and check a manifest; ``BundleFormatError`` says what was wrong.

    With ``key``, only a keyed envelope whose HMAC checks out is accepted. Without one both
    kinds are read (a keyed manifest's SHA-256 still catches accidental damage).
    """
    data = bytes(raw)
    if len(data) < ENVELOPE.size:
        raise BundleFormatError(f"manifest is {len(data)} bytes, shorter than its envelope")
    magic, version, length, digest = ENVELOPE.unpack_from(data)
    if magic not in (MAGIC, MAGIC_KEYED):
        raise BundleFormatError("manifest does not start with the checkpoint magic")
    if version != FORMAT_VERSION:
        raise BundleFormatError(f"manifest format version {version}, expected {FORMAT_VERSION}")
    start = ENVELOPE.size + (TAG.size if magic == MAGIC_KEYED else 0)
    if length > MAX_MANIFEST_JSON or start + length != len(data):
        raise BundleFormatError(
            f"manifest says {length} JSON bytes, object holds {len(data) - start}"
        )
    body = data[start:]
    if hashlib.sha256(body).digest() != digest:
        raise BundleFormatError("manifest checksum mismatch")
    if key is not None:
        if magic != MAGIC_KEYED:
            raise BundleFormatError("manifest is not signed, and this store needs a signature")
        (tag,) = TAG.unpack_from(data, ENVELOPE.size)
        if not verify(key, data[: ENVELOPE.size] + body, tag):
            raise BundleFormatError("manifest signature (HMAC) does not match this store's key")
    try:
        return Manifest.model_validate_json(body)
    except ValidationError as exc:
        raise BundleFormatError(f"manifest is not valid: {_short(exc)}") from None


def _short(exc: ValidationError) -> str:
    # One bounded line for the log: a forged manifest may carry thousands of errors.
    errors = exc.errors(include_url=False, include_input=False)
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}".lstrip(": ") for e in errors[:3]]
    more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
    return ("; ".join(parts) + more).replace("\n", " ")[:500]


def decode(manifest: Manifest, chunks: list[torch.Tensor]) -> RequestCheckpoint:
    """Check every chunk against the manifest and rebuild the checkpoint from copies.

    ``chunks`` are flat uint8 tensors in manifest order. Raises ``BundleFormatError`` before
    building any tensor if a chunk is missing, has the wrong size or the wrong checksum.
    """
    if len(chunks) != len(manifest.chunks):
        raise BundleFormatError(f"{len(chunks)} parts, manifest names {len(manifest.chunks)}")
    for i, (c, entry) in enumerate(zip(chunks, manifest.chunks, strict=True)):
        if c.dtype != torch.uint8 or c.dim() != 1 or c.numel() != entry.nbytes:
            raise BundleFormatError(
                f"part {i}: {c.numel()} bytes of {c.dtype}, manifest says {entry.nbytes} uint8"
            )
        if _sha256(c.contiguous()) != entry.sha256:
            raise BundleFormatError(f"part {i}: checksum mismatch")
    payload = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    tokens: tuple[int, ...] = ()
    logits: torch.Tensor | None = None
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for e in manifest.tensors:
        t = from_bytes(payload[e.offset : e.offset + e.nbytes], DTYPES[e.dtype], tuple(e.shape))
        if e.layer is None and e.name == TOKENS_NAME:
            tokens = tuple(int(x) for x in t.tolist())
        elif e.layer is None:
            logits = t
        else:
            layers.setdefault(e.layer, {})[e.name] = t
    assert logits is not None  # the manifest validator guarantees it
    try:
        return RequestCheckpoint(
            tokens=tokens,
            layers=layers,
            logits=logits,
            boundary=manifest.boundary,
            meta=manifest.meta,
        )
    except ValueError as exc:
        raise BundleFormatError(f"bundle content is not valid: {exc}") from None
