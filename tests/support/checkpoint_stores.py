"""Checkpoints and identities for the checkpoint tests (also imported by the worker script)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from vllm_recoverssm.checkpoint import (
    CheckpointConfig,
    CheckpointStore,
    LayoutIdentity,
    RequestCheckpoint,
)

MiB = 2**20


def open_store(
    backend: str, path: Path | None, identity: LayoutIdentity, **cfg: int
) -> CheckpointStore:
    """A store with small pools and 4 KiB chunks, so test bundles span several parts."""
    settings: dict[str, object] = {"ram_bytes": 16 * MiB, "chunk_bytes": 4096}
    settings.update(cfg)
    config = CheckpointConfig(
        backend=backend,  # type: ignore[arg-type]
        path=path if backend == "disk" else None,
        **settings,  # type: ignore[arg-type]
    )
    return CheckpointStore(config, identity)


def make_identity(**changes: object) -> LayoutIdentity:
    """A small GLM-5.3-shaped layout identity; keyword arguments change single fields."""
    fields: dict[str, object] = dict(
        model="toy-glm5next",
        revision="seed-0",
        dtypes={"state": "float32", "conv": "bfloat16", "kv": "bfloat16", "logits": "float32"},
        layout="reference",
        layout_version=1,
        tp_rank=0,
        tp_size=1,
        num_speculative_tokens=3,
        mode="recovery",
        extra={"block_size": 16},
    )
    fields.update(changes)
    return LayoutIdentity(**fields)  # type: ignore[arg-type]


def make_tokens(n: int, seed: int = 0) -> tuple[int, ...]:
    """``n`` deterministic token ids."""
    g = torch.Generator().manual_seed(1000 + seed)
    return tuple(int(t) for t in torch.randint(0, 50_000, (n,), generator=g))


CRASH_PROMPT = make_tokens(400, seed=4)
"""The prompt whose write the restart worker's ``crash`` action interrupts."""


def make_checkpoint(
    tokens: tuple[int, ...],
    seed: int = 0,
    boundary: str = "prompt",
    has_images: bool = False,
) -> RequestCheckpoint:
    """A deterministic checkpoint after ``tokens``: two KDA layers, one attention layer."""
    g = torch.Generator().manual_seed(seed * 7919 + len(tokens))
    n = len(tokens)
    layers = {
        "layers.0": {
            "state": torch.randn(2, 8, 8, generator=g),
            "conv": torch.randn(48, 3, generator=g).to(torch.bfloat16),
        },
        "layers.1": {"kv": torch.randn(2, n, 2, 8, generator=g).to(torch.bfloat16)},
        "layers.2": {
            "state": torch.randn(2, 8, 8, generator=g),
            "conv": torch.randn(48, 3, generator=g).to(torch.bfloat16),
        },
    }
    return RequestCheckpoint(
        tokens=tokens,
        layers=layers,
        logits=torch.randn(64, generator=g),
        boundary=boundary,  # type: ignore[arg-type]
        has_images=has_images,
        meta={"num_accepted": 1},
    )


HEADER = 28
"""Bytes of LMCache's ``RemoteMetadata`` header in front of every fs object (one group)."""


def manifest_file(root: Path, n: int) -> Path:
    """The file holding the manifest of the ``n``-token bundle (the only one of that length)."""
    (path,) = [p for p in root.glob("*.data") if f"kind%manifest@ntok%{n}." in p.name]
    return path


def part_files(root: Path, n: int) -> list[Path]:
    """The files holding the parts of the ``n``-token bundle, in part order."""
    parts = [p for p in root.glob("*.data") if f"kind%chunk@ntok%{n}@" in p.name]
    return sorted(parts, key=lambda p: int(re.search(r"part%(\d+)", p.name).group(1)))  # type: ignore[union-attr]


def flip_bit(path: Path, offset: int) -> None:
    """Flip the lowest bit of the byte at ``offset``."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


RACE_PROMPTS = tuple(make_tokens(24 + 3 * i, seed=100 + i) for i in range(60))
"""Prompts two processes store into one directory at the same time (distinct lengths)."""


def rewrap(body: object, key: bytes | None = None) -> bytes:
    """A manifest envelope with a correct checksum (and, with ``key``, signature) around any
    JSON: what someone who can write the directory can produce."""
    import hashlib
    import json

    from vllm_recoverssm.checkpoint.integrity import sign
    from vllm_recoverssm.checkpoint.wire import ENVELOPE, MAGIC, MAGIC_KEYED

    raw = json.dumps(body, allow_nan=True).encode()
    head = ENVELOPE.pack(MAGIC if key is None else MAGIC_KEYED, 1, len(raw),
                         hashlib.sha256(raw).digest())
    return head + raw if key is None else head + sign(key, head + raw) + raw


def manifest_body(store, tokens: tuple[int, ...]) -> dict:  # type: ignore[no-untyped-def]
    """The JSON document of the manifest published for exactly ``tokens``."""
    import json

    from vllm_recoverssm.checkpoint import prefix_digest
    from vllm_recoverssm.checkpoint.wire import manifest_from_bytes

    raw = store._objects.get(store._manifest_key(len(tokens), prefix_digest(tokens)))
    assert raw is not None
    return json.loads(manifest_from_bytes(raw.numpy().tobytes()).model_dump_json())


def put_manifest(store, tokens: tuple[int, ...], data: bytes) -> None:  # type: ignore[no-untyped-def]
    """Store ``data`` as the manifest of ``tokens``, through the store's own backend."""
    from vllm_recoverssm.checkpoint import prefix_digest

    key = store._manifest_key(len(tokens), prefix_digest(tokens))
    store._objects.put(key, torch.frombuffer(bytearray(data), dtype=torch.uint8))


def object_path(store, key) -> Path:  # type: ignore[no-untyped-def]
    """The file a disk store keeps the object ``key`` in."""
    return Path(store.config.path) / store._objects._fs.file_name(store._objects._key(key))
