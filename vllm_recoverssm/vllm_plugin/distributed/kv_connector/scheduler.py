"""The connector's scheduler side: which bundles exist, what to capture, what to restore.

It runs once, next to vLLM's scheduler (the engine-core process under ``vllm serve``),
and never touches bundle bytes. It keeps

* an index of complete bundles (a bundle counts when every tensor-parallel rank has
  published its part), fed by the workers' reports and, for a disk store, by the
  published-bundle listing read at start-up (:mod:`.index`);
* the bundles being written (a lookup that one of them would extend waits a few steps for
  it rather than restoring less: an offline ``LLM`` exports a finished turn only when the
  next ``generate`` call steps the engine);
* the bundles that failed to load (never offered again until re-published).

Per step it plans captures inside prefill chunks: every ``checkpoint_interval`` tokens
and after ``len(prompt) - 1`` tokens (vLLM always computes a prompt's last token, so that
is the longest state an exact prompt hit can use); at a request's end it exports the
response bundle from the request's blocks, which vLLM keeps until the workers say the copy
is taken. A hit is offered to vLLM as an asynchronous load, so a load that fails on any
rank makes vLLM compute the request from scratch (``kv_load_failure_policy="recompute"``)
and a restore is all or nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ....checkpoint.identity import prefix_digests
from ... import compat
from ...config import recovery_enabled
from .identity import layout_identity
from .index import other_layouts, read_entries, remove_entry
from .keys import LOGGER, BundleKey
from .metadata import (
    BlockIds,
    Capture,
    Export,
    Load,
    RecoverSSMConnectorMetadata,
    RecoverSSMWorkerMetadata,
)
from .settings import ConnectorSettings, checkpoint_interval

logger = logging.getLogger(LOGGER)

PENDING_SECONDS = 60.0
"""A capture not reported published or failed by then is forgotten."""
WAIT_SECONDS = 10.0
"""The longest a lookup waits for a bundle being written that would give a longer hit."""


def _block_ids(ids: Any) -> BlockIds:
    return tuple(tuple(int(b) for b in group) for group in ids)


_LAYOUT_FIELDS = {"tp_size": "tensor parallel {}", "num_speculative_tokens": "S = {}",
                  "mode": "mode {}", "layout_version": "page layout v{}"}
_EXTRA_FIELDS = {"vllm": "vLLM {}", "weights": "other weights", "vocab": "another vocabulary",
                 "kv_groups": "other KV-cache pages"}


def foreign_layouts(own: dict[str, Any], others: list[dict[str, Any]]) -> list[str]:
    """How each other layout of the same model and revision differs from ``own``, in
    words (``"tensor parallel 2 (here 1)"``); one line per distinct difference."""
    out: list[str] = []
    for other in others:
        if (other.get("model"), other.get("revision")) != (own["model"], own["revision"]):
            continue
        diffs = [f"{text.format(other.get(field))} (here {own[field]})"
                 for field, text in _LAYOUT_FIELDS.items() if other.get(field) != own[field]]
        if other.get("dtypes") != own["dtypes"]:
            diffs.append("other dtypes")
        found = other.get("extra")
        extra: dict[str, Any] = found if isinstance(found, dict) else {}
        for field, text in _EXTRA_FIELDS.items():
            if field == "kv_groups" and other.get("tp_size") != own["tp_size"]:
                continue  # other ranks hold other heads: their pages differ anyway
            if extra.get(field) != own["extra"].get(field):
                diffs.append(text.format(extra.get(field)) + (
                    f" (here {own['extra'].get(field)})" if "{}" in text else ""))
        line = ", ".join(diffs)
        if line and line not in out:
            out.append(line)
    return out


class SchedulerSide:
    """Bundle index, capture planning and restore offers (see the module docstring)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings,
                 block_ids: Callable[[str], Any]) -> None:
        self.settings = settings
        self.interval = checkpoint_interval(settings, vllm_config)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.recovery = recovery_enabled(vllm_config)
        self.v2 = compat.uses_v2_model_runner(vllm_config)
        """Runner V2: the workers cut a finished request's state at its end themselves
        (``ends``) and check each state's length before exporting it."""
        self.taps = not compat.platform_has_kda_kernels()
        """Whether the workers' KDA layers tap states inside a prefill chunk (the plugin's
        own prefill); with vLLM's kernels only chunk ends and responses are captured."""
        self._block_ids = block_ids
        self._identities = [
            layout_identity(vllm_config, kv_cache_config, r, self.tp_size, self.recovery)
            .digest() for r in range(self.tp_size)]
        self._index: dict[BundleKey, set[int]] = {}
        self._lengths: dict[int, int] = {}  # num_tokens -> keys known (index or pending)
        self._pending: dict[BundleKey, float] = {}
        self._rejected: set[BundleKey] = set()
        self._requests: dict[str, Any] = {}
        self._prompt_digests: dict[str, list[str]] = {}
        self._lookup_digests: dict[str, tuple[int, list[str]]] = {}
        self._sent_prompts: set[str] = set()
        self._offers: dict[str, tuple[int, BundleKey]] = {}
        self._loading: dict[str, BundleKey] = {}
        self._waits: dict[str, float] = {}
        self._loads: list[Load] = []
        self._exports: list[Export] = []
        self._max_model_len = int(vllm_config.model_config.max_model_len)
        self._last_step: dict[str, tuple[int, int | None]] = {}
        """Per request: tokens computed before its last step, and that step's limit."""
        self._skipped_kinds: set[str] = set()
        if settings.backend == "disk":
            assert settings.path is not None
            for rank, digest in enumerate(self._identities):
                for key in read_entries(settings.path, digest):
                    self._add_published(key, rank)
            complete = sum(1 for key in self._index if self._complete(key))
            if complete:
                logger.info("checkpoint store %s: %d complete bundle(s) listed",
                            settings.path, complete)
            own = layout_identity(vllm_config, kv_cache_config, 0, self.tp_size,
                                  self.recovery).model_dump()
            foreign = foreign_layouts(own, other_layouts(settings.path, set(self._identities)))
            if foreign:
                logger.warning(
                    "checkpoint store %s holds bundles of this model written for another "
                    "layout (%s); they are never restored here, so those prompts are "
                    "computed cold", settings.path, "; ".join(foreign))

    # -- the index --------------------------------------------------------------------------
    def _known(self, key: BundleKey) -> bool:
        return key in self._index or key in self._pending

    def _count(self, key: BundleKey, delta: int) -> None:
        count = self._lengths.get(key.num_tokens, 0) + delta
        if count > 0:
            self._lengths[key.num_tokens] = count
        else:
            self._lengths.pop(key.num_tokens, None)

    def _add_published(self, key: BundleKey, rank: int) -> None:
        if not self._known(key):
            self._count(key, 1)
        self._index.setdefault(key, set()).add(rank)
        if self._complete(key):
            self._pending.pop(key, None)

    def _add_pending(self, key: BundleKey) -> None:
        if not self._known(key):
            self._count(key, 1)
        self._pending[key] = time.monotonic() + PENDING_SECONDS

    def _drop(self, key: BundleKey) -> None:
        if self._known(key):
            self._count(key, -1)
        self._index.pop(key, None)
        self._pending.pop(key, None)

    def _complete(self, key: BundleKey) -> bool:
        return len(self._index.get(key, ())) >= self.tp_size and key not in self._rejected

    def _is_pending(self, key: BundleKey) -> bool:
        deadline = self._pending.get(key)
        if deadline is None:
            return False
        if deadline < time.monotonic():
            del self._pending[key]
            if not self._known(key):
                self._count(key, -1)
            return False
        return True

    def complete_bundles(self) -> list[BundleKey]:
        """Bundles every rank has published (for reports and tests)."""
        return sorted(key for key in self._index if self._complete(key))

    # -- requests -------------------------------------------------------------------------
    def eligible(self, request: Any) -> bool:
        """Whether a request may be exported and restored.

        Not: requests with images or other multimodal inputs (their placeholder token ids
        do not identify the content), prompt embeddings (no token ids), LoRA adapters or a
        cache salt (the key holds token ids only), pooling requests.
        """
        reason = None
        if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
            reason = "prompt embeddings"
        elif getattr(request, "mm_features", None):
            reason = "images or other multimodal inputs"
        elif getattr(request, "lora_request", None) is not None:
            reason = "a LoRA adapter"
        elif getattr(request, "cache_salt", None):
            reason = "a cache salt"
        elif getattr(request, "sampling_params", None) is None:
            reason = "pooling"
        if reason is None:
            return True
        if reason not in self._skipped_kinds:
            self._skipped_kinds.add(reason)
            logger.info("request-boundary checkpoints skip requests with %s", reason)
        return False

    def on_new_request(self, request: Any) -> None:
        """Track an eligible request from its arrival."""
        if self.eligible(request):
            self._requests[request.request_id] = request

    def _forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._prompt_digests.pop(req_id, None)
        self._lookup_digests.pop(req_id, None)
        self._offers.pop(req_id, None)
        self._waits.pop(req_id, None)
        self._last_step.pop(req_id, None)
        self._sent_prompts.discard(req_id)

    # -- restore ----------------------------------------------------------------------------
    def _digests_of(self, request: Any) -> list[str]:
        n = int(request.num_tokens)
        cached = self._lookup_digests.get(request.request_id)
        if cached is None or cached[0] != n:
            cached = (n, prefix_digests(list(request.all_token_ids)))
            self._lookup_digests[request.request_id] = cached
        return cached[1]

    def get_num_new_matched_tokens(self, request: Any, local: int) -> tuple[int | None, bool]:
        """The longest complete bundle beyond vLLM's own hit ``local``, at most
        ``num_tokens - 1`` tokens; None while a longer one is being written."""
        if request.request_id not in self._requests and not self.eligible(request):
            return 0, False
        limit = int(request.num_tokens) - 1
        lengths = sorted((n for n in self._lengths if local < n <= limit), reverse=True)
        if not lengths:
            return 0, False
        digests = self._digests_of(request)
        best: BundleKey | None = None
        waiting = False
        for n in lengths:
            key = BundleKey(n, digests[n - 1])
            if self._complete(key):
                best = key
                break
            if self._is_pending(key):
                waiting = True
        if waiting:
            first = self._waits.setdefault(request.request_id, time.monotonic())
            if time.monotonic() - first < WAIT_SECONDS:
                return None, False
        self._waits.pop(request.request_id, None)
        if best is None:
            return 0, False
        self._offers[request.request_id] = (local, best)
        return best.num_tokens - local, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        """Plan the load vLLM allocated blocks for (the second call, after it, is a no-op)."""
        if num_external <= 0:
            return
        req_id = request.request_id
        local, key = self._offers.pop(req_id, (0, BundleKey(0, "")))
        valid = local + num_external == key.num_tokens and key.num_tokens > 0
        if not valid:
            # vLLM asked for another length than offered: the load fails, vLLM recomputes.
            logger.warning("checkpoint restore of request %s: vLLM asked for %d tokens past "
                           "%d, not the offered bundle; computing it instead", req_id,
                           num_external, local)
        tokens = tuple(int(t) for t in request.all_token_ids[: key.num_tokens])
        exact = key.num_tokens == int(request.num_prompt_tokens) - 1
        self._loads.append(Load(req_id, key, tokens, _block_ids(blocks.get_block_ids()),
                                local, valid, exact))
        self._loading[req_id] = key

    # -- captures and exports ---------------------------------------------------------------
    def _plan(self, request: Any, nc: int, n: int) -> list[Capture]:
        total = int(request.num_prompt_tokens)
        if nc >= total or n <= 0:
            return []
        points: list[tuple[int, str]] = []
        step = self.interval
        end = min(nc + n, total)
        for p in range((nc // step + 1) * step, end + 1, step):
            if p < total - 1:
                points.append((p, "interval"))
        if nc <= total - 1 < nc + n and total >= 2:
            points.append((total - 1, "prompt"))
        if not points:
            return []
        digests = self._prompt_digests.get(request.request_id)
        if digests is None:
            digests = prefix_digests(list(request.prompt_token_ids))
            self._prompt_digests[request.request_id] = digests
        out = []
        for p, kind in points:
            offset = p - nc
            if 0 < offset < n and not self.taps:
                continue  # inside the chunk: no state tap on this platform (the state at
                # a chunk's start is the page's, read before the step)
            key = BundleKey(p, digests[p - 1])
            if self._complete(key) or self._is_pending(key):
                continue
            out.append(Capture(request.request_id, key, kind, offset, n))  # type: ignore[arg-type]
        return out

    def _limit(self, request: Any, num_drafts: int) -> int | None:
        """Tokens of this step that can count, when the window reaches past the request's
        output budget (vLLM then ends the request this step, cutting the rest)."""
        if num_drafts <= 0:
            return None
        budget = min(int(request.max_tokens) - int(request.num_output_tokens),
                     self._max_model_len - int(request.num_tokens))
        return max(budget, 1) if budget < num_drafts + 1 else None

    def _end(self, request: Any) -> int:
        """The most tokens the request can hold (prompt and output), by its budgets."""
        return min(int(request.num_prompt_tokens) + int(request.max_tokens),
                   self._max_model_len)

    def build_connector_meta(self, scheduler_output: Any) -> RecoverSSMConnectorMetadata:
        """This step's loads, exports and captures (before vLLM advances the requests)."""
        meta = RecoverSSMConnectorMetadata(loads=self._loads, exports=self._exports)
        self._loads, self._exports = [], []
        every = self.settings.capture_stage == "pre_commit"
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            nc = int(request.num_computed_tokens)
            if self.v2:
                # the host's count is an upper bound (drafts in flight count as accepted),
                # so every step that can reach the request's end is named
                end = self._end(request) - 1
                if nc + int(n) >= end:
                    meta.ends[req_id] = end
                    meta.block_ids[req_id] = _block_ids(self._block_ids(req_id))
                limit = None
            else:
                limit = self._limit(request, len(drafts.get(req_id, ())))
            if limit is not None:
                meta.limits[req_id] = limit
            self._last_step[req_id] = (nc, limit)
            captures = self._plan(request, nc, int(n))
            for capture in captures:
                self._add_pending(capture.key)
            meta.captures.extend(captures)
            if captures or every:
                meta.block_ids[req_id] = _block_ids(self._block_ids(req_id))
            if captures and req_id not in self._sent_prompts:
                meta.prompts[req_id] = tuple(int(t) for t in request.prompt_token_ids)
                self._sent_prompts.add(req_id)
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> bool:
        """Queue the response bundle of a request that ended normally; True keeps its
        blocks until the workers have copied them."""
        req_id = request.request_id
        tracked = self._requests.get(req_id) is not None
        last = self._last_step.get(req_id)
        self._forget(req_id)
        if not tracked:
            return False
        status = compat.RequestStatus
        if request.status not in (status.FINISHED_STOPPED, status.FINISHED_LENGTH_CAPPED):
            return False
        k = int(request.num_computed_tokens)
        if self.v2:
            # drafts in flight (asynchronous scheduling) are not computed tokens; the
            # workers cut the state at the request's end and check its length
            k = min(k - int(getattr(request, "num_output_placeholders", 0) or 0),
                    int(request.num_tokens) - 1)
        elif last is not None and last[1] is not None:
            # The workers kept the state after at most ``limit`` of the last step's tokens.
            k = min(k, last[0] + last[1])
        # A stop token inside accepted drafts cuts tokens the state already holds: the
        # state then covers more than ``num_tokens - 1`` tokens and matches no prefix.
        if k < 1 or k != int(request.num_tokens) - 1:
            return False
        tokens = tuple(int(t) for t in request.all_token_ids[:k])
        digests = prefix_digests(list(tokens))
        key = BundleKey(k, digests[-1])
        if self._complete(key) or self._is_pending(key):
            return False
        self._add_pending(key)
        self._exports.append(Export(req_id, key, tokens, _block_ids(block_ids)))
        return True

    # -- worker reports ---------------------------------------------------------------------
    def update_connector_output(self, output: Any) -> None:
        """Published and failed bundles, finished and failed loads of the last step."""
        report = output.kv_connector_worker_meta
        if isinstance(report, RecoverSSMWorkerMetadata):
            for k, digest, rank in report.published:
                key = BundleKey(k, digest)
                self._rejected.discard(key)
                self._add_published(key, rank)
            for k, digest, _rank in report.failed:
                failed = BundleKey(k, digest)
                if not self._complete(failed):
                    self._drop(failed)
        for req_id in output.failed_recving or ():
            lost = self._loading.pop(req_id, None)
            if lost is None or lost.num_tokens == 0:
                continue
            key = lost
            logger.warning("checkpoint of a %d-token prefix failed to load; request %s is "
                           "computed instead and the bundle is not offered again",
                           key.num_tokens, req_id)
            self._rejected.add(key)
            self._drop(key)
            if self.settings.backend == "disk":
                assert self.settings.path is not None
                for digest in self._identities:
                    remove_entry(self.settings.path, digest, key)
        for req_id in output.finished_recving or ():
            self._loading.pop(req_id, None)
