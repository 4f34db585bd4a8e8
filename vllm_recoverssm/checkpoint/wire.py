"""The bundle's wire format: raw tensor bytes in checksummed chunks plus a JSON manifest.

A bundle is stored as ``len(chunks)`` payload objects and one manifest object. The payload is
the raw bytes of every tensor (token ids first, then each layer's tensors, then the logits),
each at a 64-byte aligned offset, cut into chunks of at most ``chunk_bytes``. The manifest is a
fixed envelope -- magic, format version, JSON length, SHA-256 of the JSON -- followed by the JSON
document that names the layout identity, the prefix, every chunk (size, SHA-256) and every
tensor (dtype, shape, offset, size).

Reading treats every byte as untrusted: the envelope, the JSON schema (unknown fields refused),
the identity, every size, offset and checksum are checked before a single tensor is built,
and nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .bundle import MAX_NDIM, RequestCheckpoint, check_name
from .errors import BundleFormatError
from .identity import LayoutIdentity, ScalarValue
from .tensors import DTYPES, as_bytes, dtype_name, from_bytes

MAGIC = b"RSSMCKPT"
FORMAT_NAME: Literal["vllm-recoverssm.checkpoint"] = "vllm-recoverssm.checkpoint"
FORMAT_VERSION: Literal[1] = 1
ENVELOPE = struct.Struct("<8sII32s")  # magic, version, JSON length, SHA-256 of the JSON
MAX_MANIFEST_JSON = 16 * 2**20
ALIGN = 64
TOKENS_NAME = "tokens"
LOGITS_NAME = "logits"
_HEX64 = r"^[0-9a-f]{64}$"


class ChunkEntry(BaseModel):
    """One payload chunk: its size and SHA-256."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    nbytes: int = Field(ge=1)
    sha256: str = Field(pattern=_HEX64)


class TensorEntry(BaseModel):
    """Where one tensor lies in the payload. ``layer`` is None for tokens and logits."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    layer: str | None
    name: str
    dtype: str
    shape: list[int]
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)

    @model_validator(mode="after")
    def _check(self) -> TensorEntry:
        if self.layer is not None:
            check_name(self.layer, "layer name")
        check_name(self.name, "tensor name")
        if self.dtype not in DTYPES:
            raise ValueError(f"tensor {self.name!r}: unknown dtype {self.dtype!r}")
        if len(self.shape) > MAX_NDIM or any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: bad shape {self.shape}")
        numel = 1
        for d in self.shape:
            numel *= d
        itemsize = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        if numel * itemsize != self.nbytes:
            raise ValueError(
                f"tensor {self.name!r}: shape {self.shape} x {self.dtype} is "
                f"{numel * itemsize} bytes, manifest says {self.nbytes}"
            )
        return self


class Manifest(BaseModel):
    """The manifest of one bundle; written last, so its presence publishes the bundle."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    format: Literal["vllm-recoverssm.checkpoint"]
    version: Literal[1]
    identity: LayoutIdentity
    identity_digest: str = Field(pattern=_HEX64)
    num_tokens: int = Field(ge=1)
    prefix_digest: str = Field(pattern=_HEX64)
    boundary: Literal["prompt", "response"]
    bundle_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    meta: dict[str, ScalarValue]
    total_bytes: int = Field(ge=0)
    chunks: list[ChunkEntry]
    tensors: list[TensorEntry]

    @model_validator(mode="after")
    def _check(self) -> Manifest:
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


def manifest_to_bytes(manifest: Manifest) -> bytes:
    """Envelope + JSON of ``manifest``."""
    body = manifest.model_dump_json().encode()
    head = ENVELOPE.pack(MAGIC, FORMAT_VERSION, len(body), hashlib.sha256(body).digest())
    return head + body


def manifest_from_bytes(raw: bytes | bytearray | memoryview) -> Manifest:
    """Parse and check a manifest; ``BundleFormatError`` says what was wrong."""
    data = bytes(raw)
    if len(data) < ENVELOPE.size:
        raise BundleFormatError(f"manifest is {len(data)} bytes, shorter than its envelope")
    magic, version, length, digest = ENVELOPE.unpack_from(data)
    if magic != MAGIC:
        raise BundleFormatError("manifest does not start with the checkpoint magic")
    if version != FORMAT_VERSION:
        raise BundleFormatError(f"manifest format version {version}, expected {FORMAT_VERSION}")
    if length > MAX_MANIFEST_JSON or ENVELOPE.size + length != len(data):
        raise BundleFormatError(
            f"manifest says {length} JSON bytes, object holds {len(data) - ENVELOPE.size}"
        )
    body = data[ENVELOPE.size :]
    if hashlib.sha256(body).digest() != digest:
        raise BundleFormatError("manifest checksum mismatch")
    try:
        return Manifest.model_validate_json(body)
    except ValidationError as exc:
        raise BundleFormatError(f"manifest is not valid: {exc}") from None


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
