"""The runtime's side of a checkpoint store: look up on admission, export at request boundaries.

A runtime built with ``RuntimeConfig(checkpoint=CheckpointConfig(...))`` owns one
:class:`~vllm_recoverssm.checkpoint.CheckpointStore` for its layout identity. Building it
checks the whole LMCache set-up, so a missing or misconfigured LMCache fails when the runtime
is built, never in the middle of a request.

* **Lookup** (once per request, on its first admission attempt): the longest stored prefix of
  the prompt, longer than what the runtime's own prefix cache holds. A bundle the store
  rejects (corrupt, incomplete, another layout) is a miss with a warning; so is one that
  passes the store's checks but does not fit this model (shapes, dtypes), after which the
  next shorter stored prefix is tried. Requests that carry images are never looked up: their
  token ids do not identify the image content.
* **Export** at the end of the prompt and of the response, in the order of
  :mod:`.boundary`. The store refuses requests that carried images and leaves a prefix that
  already has a complete bundle as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from vllm_recoverssm.checkpoint import (
    CheckpointConfig,
    CheckpointStore,
    RequestCheckpoint,
    StoreResult,
)

from .boundary import capture_request, check_restorable, layout_identity
from .request import Request
from .runtime_view import RuntimeView

logger = logging.getLogger(__name__)


class RuntimeCheckpoints:
    """One runtime's checkpoint store and the two calls the runtime makes into it."""

    def __init__(self, runtime: RuntimeView, config: CheckpointConfig) -> None:
        self.runtime = runtime
        self.store = CheckpointStore(config, layout_identity(runtime))
        self._looked_up: set[int] = set()

    def lookup(self, req: Request, min_tokens: int) -> RequestCheckpoint | None:
        """The checkpoint of the longest usable stored prefix of ``req``'s prompt.

        Only the first call for a request asks the store (a waiting request is retried
        every step); prefixes shorter than ``min_tokens`` are not worth a restore.
        """
        if req.rid in self._looked_up or req.has_images:
            return None
        self._looked_up.add(req.rid)
        stats = self.runtime.stats
        t0 = time.perf_counter()
        try:
            prompt = req.prompt
            while len(prompt) >= max(min_tokens, 1):
                hit = self.store.lookup(prompt, min_tokens=max(min_tokens, 1))
                if hit is None:
                    return None
                try:
                    check_restorable(self.runtime, req, hit.checkpoint)
                except ValueError as exc:
                    stats.checkpoint_rejected += 1
                    logger.warning(
                        "checkpoint of a %d-token prefix does not fit this runtime, "
                        "computing it instead: %s", hit.num_tokens, exc,
                    )
                    prompt = prompt[: hit.num_tokens - 1]
                    continue
                return hit.checkpoint
            return None
        finally:
            stats.checkpoint_seconds += time.perf_counter() - t0

    def forget(self, req: Request) -> None:
        """Drop the per-request lookup memory of a request that was admitted."""
        self._looked_up.discard(req.rid)

    def export(
        self,
        req: Request,
        boundary: str,
        linear: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    ) -> StoreResult:
        """Capture ``req`` at ``boundary`` and store it (see :func:`.boundary.capture_request`)."""
        t0 = time.perf_counter()
        checkpoint = capture_request(self.runtime, req, boundary, linear=linear)
        result = self.store.store(checkpoint)
        stats = self.runtime.stats
        stats.checkpoints_exported += int(result.stored)
        stats.checkpoint_seconds += time.perf_counter() - t0
        return result

    def close(self) -> None:
        """Release LMCache's backends."""
        self.store.close()
