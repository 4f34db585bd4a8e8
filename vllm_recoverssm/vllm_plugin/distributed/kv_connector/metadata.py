"""What the connector's scheduler side tells its workers each step, and what they answer.

The scheduler side never reads bundle bytes (under ``vllm serve`` the workers live in other
processes, and a RAM store lives in a worker): it decides *what* to capture, export and
load; the workers do the copies and the storage and report which bundles they published.
Everything here is plain data, pickled with vLLM's scheduler output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ... import compat
from .keys import BundleKey

CaptureKind = Literal["prompt", "interval"]
BlockIds = tuple[tuple[int, ...], ...]
"""A request's block ids, one tuple per KV-cache group (vLLM's group order)."""


@dataclass(frozen=True)
class Capture:
    """Take the state after ``key.num_tokens`` tokens of a request in this step's prefill.

    ``offset`` counts the tokens of this step's chunk (``chunk_len`` tokens) before the
    capture point: ``offset == chunk_len`` is the chunk's end (read from the page after the
    forward), anything less is a state tap inside the chunk. A ``prompt`` capture (after
    ``len(prompt) - 1`` tokens) also keeps the logits this step samples the first token
    from.
    """

    req_id: str
    key: BundleKey
    kind: CaptureKind
    offset: int
    chunk_len: int


@dataclass(frozen=True)
class Export:
    """Export a finished request's response bundle from its held blocks."""

    req_id: str
    key: BundleKey
    tokens: tuple[int, ...]
    block_ids: BlockIds


@dataclass(frozen=True)
class Load:
    """Restore ``key`` into a request's blocks; the first ``local_tokens`` are vLLM's own
    prefix-cache hit (block-aligned) and are not written. ``valid`` False: the load must
    fail (the scheduler could not match what vLLM asked for to a bundle)."""

    req_id: str
    key: BundleKey
    tokens: tuple[int, ...]
    block_ids: BlockIds
    local_tokens: int
    valid: bool = True
    exact_prompt: bool = False
    """The bundle holds this request's whole prompt but its last token (the stored logits
    then sample the same first token as the engine will)."""


_Base: Any = compat.KVConnectorMetadata
_WorkerBase: Any = compat.KVConnectorWorkerMetadata


@dataclass
class RecoverSSMConnectorMetadata(_Base):  # type: ignore[misc]
    """One step's work for the workers.

    ``prompts`` carries a request's prompt tokens the first time one of its captures is
    scheduled (workers keep them until the request finishes); ``block_ids`` the block ids
    of every request captured this step (and, for the test-only pre-commit stage, of every
    scheduled request). ``limits`` names the requests whose verify window reaches past
    their output budget (``max_tokens``, ``max_model_len``): they end this step, and at
    most that many sampled tokens count for their state.
    """

    captures: list[Capture] = field(default_factory=list)
    exports: list[Export] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    prompts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    block_ids: dict[str, BlockIds] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)
    ends: dict[str, int] = field(default_factory=dict)
    """Runner V2: per scheduled request, the most tokens its state may hold (its prompt
    plus ``max_tokens``, capped by ``max_model_len``, less the last token)."""


@dataclass
class RecoverSSMWorkerMetadata(_WorkerBase):  # type: ignore[misc]
    """Bundles one rank published (complete on that rank) or failed to store since the last
    step; merged across ranks by vLLM (``aggregate``), deduplicated."""

    published: list[tuple[int, str, int]] = field(default_factory=list)
    failed: list[tuple[int, str, int]] = field(default_factory=list)

    def aggregate(self, other: Any) -> RecoverSSMWorkerMetadata:
        """This rank's report merged with ``other``'s (order-independent, idempotent)."""
        published = dict.fromkeys(self.published)
        failed = dict.fromkeys(self.failed)
        if isinstance(other, RecoverSSMWorkerMetadata):
            published.update(dict.fromkeys(other.published))
            failed.update(dict.fromkeys(other.failed))
        return RecoverSSMWorkerMetadata(published=list(published), failed=list(failed))
