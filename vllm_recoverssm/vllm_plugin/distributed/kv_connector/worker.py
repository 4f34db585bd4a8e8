"""The connector's worker side: copies between pages and bundles, storage, restores.

One per tensor-parallel rank; it owns this rank's store (its part of every bundle).
Under vLLM's model runner V1 a step runs, in this order:

1. ``handle_preemptions`` (first thing of the step): export finished requests' response
   bundles from their held blocks (under the fused commit, after committing their last
   step's pending records), and install this step's state taps;
2. the forward, where the plugin's KDA layers hand over tapped states;
3. ``start_load_kv`` (after the forward; restored requests are not in the batch): under
   the fused commit, commit every pending record first; then read, check and write each
   restore, or report it failed;
4. sampling: the raw logits are kept (:func:`v1_runner.install_v1_sample_hook`), the recovery
   commit runs, then :meth:`WorkerSide.after_commit` records each request's sampled count
   and the logits row of its last token;
5. ``wait_for_save`` (after the drafter when speculation is on; without speculation the
   step's captures are finished in step 4 instead, since vLLM calls ``wait_for_save``
   before sampling then): build the step's prompt and interval bundles.

Under model runner V2 (vLLM's default on GPUs) the order is the same, with V2's hooks:
``handle_preemptions`` in its ``pre_forward``, the forward, sampling (the raw logits are
kept by :func:`v2_runner.install_v2_sample_hook`), the model state's commit and then its
boundary captures (:meth:`WorkerSide.after_step`: sampled counts, logits rows, and how
many tokens each state holds), the drafter, and ``start_load_kv`` then ``wait_for_save``
in its ``post_forward``.

So every capture sees committed state: a response export reads the block the commit wrote
(recovery: offset 0; full state: the accepted column and conv offset, vLLM's lazy layout),
and a prefill capture is a prefill row's own state, which no commit touches. Under runner V2
the worker also knows how many tokens each request's state holds after its last step, and
exports a response only when that is the bundle's length: with asynchronous scheduling vLLM
may run a step of a request that has already ended (drafts in flight are not accepted
tokens), and a stop token inside accepted drafts leaves a state longer than the tokens kept.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ....checkpoint import CheckpointStore, RequestCheckpoint
from ... import compat
from ...config import recovery_enabled
from ...patch import v1_runner, v2_runner
from ...worker.commit import (
    register_commit_limit,
    sampled_counts,
    settle_pending,
    settle_requests,
)
from ...worker.model_state import (
    NO_END,
    BoundaryCaptureStep,
    register_boundary_capture,
    register_state_ends,
)
from . import taps
from .identity import layout_identity
from .index import add_entry, write_layout
from .keys import LOGGER, BundleKey
from .metadata import (
    Capture,
    Export,
    Load,
    RecoverSSMConnectorMetadata,
    RecoverSSMWorkerMetadata,
)
from .pages import KdaSource, LayoutError, PageLayout
from .settings import ConnectorSettings
from .writer import BundleWriter

logger = logging.getLogger(LOGGER)

AFTER_COMMIT_ORDER = v1_runner.COMMIT_ORDER + 10
BEFORE_COMMIT_ORDER = v1_runner.COMMIT_ORDER - 10


@dataclass
class Sampled:
    """What a request's last step sampled: tokens (accepted drafts + 1), the logits row of
    its last sampled token (on the device), and the step."""

    step: int
    num_sampled: int | torch.Tensor
    logits: torch.Tensor
    state_len: int | torch.Tensor | None = None
    """Tokens the request's state holds after the step (-1: overwritten; None: not known,
    runner V1, whose commit limit keeps it right)."""
    state_column: int | torch.Tensor = 0
    """The block column holding the state (align mode: vLLM's running-state column)."""
    bias: int | torch.Tensor | None = None
    """Runner V2: the accepted state's column offset and conv offset from
    ``state_column`` (0 under recovery)."""


class StaleStateError(ValueError):
    """A request's state holds other tokens than its bundle would be keyed by."""


@dataclass
class WorkerStats:
    """Counters of one worker (this rank, this process)."""

    exported: dict[str, int] = field(default_factory=lambda: {"prompt": 0, "interval": 0,
                                                               "response": 0})
    export_failures: int = 0
    stale_exports: int = 0
    """Bundles not exported because the state held other tokens than planned: a response
    whose state had moved on (module docstring), a chunk end the step did not reach."""
    steps_past_end: int = 0
    """Runner V2: steps a request ran after its state reached its end (asynchronous
    scheduling); its export reads the state kept at the end."""
    published: int = 0
    restored: int = 0
    restored_tokens: int = 0
    load_failures: int = 0
    logits_checked: int = 0
    logits_argmax_equal: int = 0
    logits_max_abs_diff: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(self).items()}


class WorkerSide:
    """Captures, exports and restores of one rank (see the module docstring)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any,
                 settings: ConnectorSettings) -> None:
        self.v2 = compat.uses_v2_model_runner(vllm_config)
        if self.v2 and settings.capture_stage == "pre_commit":
            raise LayoutError("the test-only pre_commit capture stage runs under runner V1")
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.settings = settings
        self.rank, self.size = compat.tensor_parallel_rank_size()
        self.recovery = recovery_enabled(vllm_config)
        self.speculative = vllm_config.speculative_config is not None
        cache = vllm_config.cache_config
        self.align_block = (int(cache.mamba_block_size) if cache.enable_prefix_caching
                            and cache.mamba_cache_mode == "align" else 0)
        """Align mode: the state block size (a request's state after ``n`` tokens lives in
        block column ``(n - 1) // align_block``); 0 otherwise (column 0)."""
        self.identity = layout_identity(vllm_config, kv_cache_config, self.rank, self.size,
                                        self.recovery)
        self._identity_digest = self.identity.digest()
        self.store = CheckpointStore(settings.checkpoint_config(), self.identity)
        self.writer = BundleWriter(
            self.store, self._list_published if settings.backend == "disk" else None)
        if settings.backend == "disk":
            assert settings.path is not None
            write_layout(settings.path, self._identity_digest, self.identity.model_dump())
        self.layout: PageLayout | None = None
        self.stats = WorkerStats()
        self._layers = compat.layer_table(vllm_config)
        self._step = 0
        self._meta = RecoverSSMConnectorMetadata()
        self._captures: list[Capture] = []
        self._prompts: dict[str, tuple[int, ...]] = {}
        self._last: dict[str, Sampled] = {}
        self._before: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self._expect_logits: dict[str, torch.Tensor] = {}
        self._sending: set[str] = set()
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self._failed_keys: list[BundleKey] = []
        self._logits: torch.Tensor | None = None
        self._spec_meta: Any = None
        self._at_end: dict[str, tuple[int, dict[str, dict[str, torch.Tensor]]]] = {}
        """Runner V2: a request's state read in the step it reached its end (its length,
        its KDA tensors): a later step of it (asynchronous scheduling) may write over it."""
        self._at_start: dict[BundleKey, dict[str, dict[str, torch.Tensor]]] = {}
        """This step's captures at a row's first token, read before the forward."""
        self._logit_starts: torch.Tensor | None = None
        if self.v2:
            register_state_ends(self.state_ends)
            register_boundary_capture(self.after_step)
            v2_runner.install_v2_sample_hook(self.after_sampling)
            return
        register_commit_limit(self.commit_limit)
        v1_runner.install_v1_sample_hook(self.before_sampling)
        v1_runner.install_v1_after_sampling_hook(self.after_commit, AFTER_COMMIT_ORDER)
        if settings.capture_stage == "pre_commit":
            if not self.recovery:
                raise LayoutError("the test-only pre_commit capture stage is for recovery")
            v1_runner.install_v1_after_sampling_hook(self.before_commit, BEFORE_COMMIT_ORDER)

    def _list_published(self, key: BundleKey) -> None:
        assert self.settings.path is not None
        add_entry(self.settings.path, self._identity_digest, key)

    def _mine(self, runner: Any) -> bool:
        return self.layout is not None and compat.layer_table(runner) is self._layers

    # -- set-up -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Resolve every KV-cache group to its layers and tensors."""
        self.layout = PageLayout(self.kv_cache_config, kv_caches, self._layers)
        taps.set_layer_groups(self.layout.layer_groups)

    # -- step start: exports and taps -------------------------------------------------------
    def handle_preemptions(self, meta: Any) -> None:
        """Export finished requests from their held blocks; install this step's taps."""
        if not isinstance(meta, RecoverSSMConnectorMetadata) or self.layout is None:
            return
        self._step += 1
        self._meta = meta
        self._prompts.update(meta.prompts)
        if self.recovery and meta.exports:
            # the fused commit defers a step's records into the request's next verify,
            # which a finished request never runs: commit them before reading the state
            settle_requests(self._layers, {export.req_id for export in meta.exports})
        for export in meta.exports:
            self._export(export)
        self._captures = list(meta.captures)
        self._at_start = {}
        planned: dict[tuple[int, int], taps.RowTaps] = {}
        for capture in self._captures:
            if capture.offset >= capture.chunk_len:
                continue  # the chunk's end: read from the page after the forward
            if capture.offset and self.layout.ring_groups:
                continue  # no exact ring inside a chunk (pages.py): _capture says so
            ids = meta.block_ids[capture.req_id]
            # align mode: vLLM moved the row's state into the block of the chunk's end
            # before the forward, and the row computes there
            column = self._column(capture.key.num_tokens - capture.offset + capture.chunk_len)
            if capture.offset == 0:
                # the state the row starts from is the page's now, whichever path the row
                # takes (a one-token last chunk may run as a decode row, with no taps)
                try:
                    self._at_start[capture.key] = self.layout.read_kda(
                        self._kda_source(ids, 0, column))
                except Exception as exc:
                    logger.warning("%s checkpoint of %d tokens: the state is unreadable "
                                   "(%s)", capture.kind, capture.key.num_tokens, exc)
                continue
            for g in self.layout.kda_groups:
                slot = int(ids[g][column])
                old = planned.get((g, slot))
                offsets = (old.offsets if old else ()) + (capture.offset,)
                keys = (old.keys if old else ()) + (capture.key,)
                planned[(g, slot)] = taps.RowTaps(offsets, keys, capture.chunk_len)
        taps.install(planned)

    def _check_computed(self, req_id: str, num_tokens: int) -> None:
        """Raise :class:`StaleStateError` unless the state after this step holds exactly
        ``num_tokens`` tokens (runner V2 counts them; V1 computes what was scheduled).

        A chunk-end capture is planned from what the scheduler sent; a step that computed
        another count (vLLM merging a prompt's last block into a speculative step,
        LMCache#4984) leaves a state of other tokens, which must not be stored under
        these."""
        last = self._last.get(req_id)
        if last is None or last.step != self._step or last.state_len is None:
            return
        held = int(last.state_len)
        if held != num_tokens:
            raise StaleStateError(f"its state holds {held} tokens after the step, not the "
                                  f"{num_tokens} the bundle is for")

    def _column(self, num_tokens: int) -> int:
        """The block column of a state after ``num_tokens`` tokens (align mode), else 0."""
        return (num_tokens - 1) // self.align_block if self.align_block else 0

    def _kda_source(self, block_ids: Any, bias: int, column: int = 0) -> KdaSource:
        assert self.layout is not None
        per_group = {}
        for g in self.layout.kda_groups:
            ids = block_ids[g]
            at = column + bias
            if len(ids) <= at or 0 in (ids[column], ids[at]):
                raise ValueError(f"group {g}: no state block at column {at} ({list(ids)})")
            per_group[g] = (int(ids[column]), bias, int(ids[at]))
        return KdaSource(per_group, self.layout.ring_blocks(block_ids))

    def _export(self, export: Export) -> None:
        assert self.layout is not None
        try:
            last = self._last.get(export.req_id)
            at_end = self._at_end.pop(export.req_id, None)
            held = None if last is None or last.state_len is None else int(last.state_len)
            if at_end is not None and at_end[0] == export.key.num_tokens:
                held = at_end[0]
            else:
                at_end = None
            if held is not None and held != export.key.num_tokens:
                raise StaleStateError(
                    f"its state holds {held} tokens, not the {export.key.num_tokens} the "
                    "bundle is for" if held >= 0 else
                    "a step past its end wrote over its state")
            if at_end is not None:
                kda, bias = at_end[1], 0
            elif last is not None and last.bias is not None:  # runner V2
                bias = int(last.bias)
                source = self._kda_source(export.block_ids, bias, int(last.state_column))
                kda = self.layout.read_kda(source)
            elif self.settings.capture_stage == "pre_commit" and export.req_id in self._before:
                kda = self._before[export.req_id]  # deliberately wrong: before the commit
                bias = 0
            else:
                # Recovery committed and compacted: offset 0. Full state keeps vLLM's lazy
                # layout: the accepted column and the conv window at that offset.
                bias = 0 if self.recovery or last is None else max(int(last.num_sampled) - 1,
                                                                    0)
                kda = self.layout.read_kda(self._kda_source(export.block_ids, bias))
            attention = self.layout.read_attention(export.block_ids, export.key.num_tokens)
            logits = (last.logits.to("cpu", torch.float32, copy=True) if last is not None
                      else torch.empty(0, dtype=torch.float32))
            checkpoint = RequestCheckpoint(
                tokens=export.tokens, layers={**kda, **_kv(attention)}, logits=logits,
                boundary="response",
                meta={"kind": "response", "logits_after": export.key.num_tokens,
                      "bias_at_capture": bias})
            self.writer.submit(export.key, checkpoint)
            self.stats.exported["response"] += 1
        except StaleStateError as exc:  # asynchronous scheduling, a stop token in drafts
            logger.info("response checkpoint of request %s not exported: %s",
                        export.req_id, exc)
            self.stats.stale_exports += 1
            self._failed_keys.append(export.key)
        except Exception as exc:  # a lost export is a future miss, never a failed step
            logger.warning("response checkpoint of request %s not exported: %s",
                           export.req_id, exc)
            self.stats.export_failures += 1
            self._failed_keys.append(export.key)
        finally:
            # vLLM may free the blocks now: everything needed is copied off them.
            self._sending.add(export.req_id)
            self._before.pop(export.req_id, None)

    # -- restores -----------------------------------------------------------------------------
    def start_load_kv(self) -> None:
        """Restore every planned load whole, or report it failed (vLLM then recomputes)."""
        if self.recovery and self._meta.loads:
            # a slot may hold a finished request's pending records (fused commit) that the
            # next build would otherwise replay onto the restored state
            settle_pending(self._layers)
        for load in self._meta.loads:
            self._load(load)
        self._meta.loads = []

    def _load(self, load: Load) -> None:
        assert self.layout is not None
        self._recving.add(load.req_id)
        reason = ""
        try:
            if not load.valid:
                raise ValueError("no bundle matches the tokens vLLM asked for")
            hit = self.store.lookup(load.tokens, min_tokens=load.key.num_tokens)
            if hit is None:
                raise ValueError("the store has no usable bundle (missing, evicted, corrupt "
                                 "or of another layout; see the warning above)")
            checkpoint = hit.checkpoint
            if checkpoint.tokens != load.tokens:
                raise ValueError("the bundle is for other tokens")
            layers = checkpoint.layers
            self.layout.check(layers, load.key.num_tokens)
            column = self._column(load.key.num_tokens)
            self.layout.kda_destination_check(load.block_ids, column)
            self.layout.write(layers, load.block_ids, load.key.num_tokens, load.local_tokens,
                              column)
        except Exception as exc:
            reason = str(exc)
        if reason:
            logger.warning("checkpoint of a %d-token prefix not restored for request %s "
                           "(it is computed instead): %s", load.key.num_tokens, load.req_id,
                           reason)
            self.stats.load_failures += 1
            self._failed.add(load.req_id)
            return
        self.stats.restored += 1
        self.stats.restored_tokens += load.key.num_tokens - load.local_tokens
        # Only an exact prompt's stored logits are the engine's next ones: a longer prompt
        # computes past the bundle before it samples.
        if (load.exact_prompt and checkpoint.meta.get("kind") == "prompt"
                and checkpoint.logits.numel()):
            self._expect_logits[load.req_id] = checkpoint.logits

    # -- sampling hooks (runner V1) -------------------------------------------------------------
    def before_sampling(self, runner: Any, logits: Any, spec_decode_metadata: Any) -> None:
        """Keep this step's raw logits (sampling may transform them in place)."""
        if not self._mine(runner) or logits is None:
            return
        self._logits = logits.detach().clone()
        self._spec_meta = spec_decode_metadata

    def _rows(self, counts: list[int]) -> list[int]:
        meta = self._spec_meta
        if meta is None:
            return list(range(len(counts)))
        drafts = list(meta.num_draft_tokens)
        targets = meta.target_logits_indices.tolist()
        bonus = meta.bonus_logits_indices.tolist()
        rows, start = [], 0
        for i, n in enumerate(counts):
            last = max(n, 1) - 1
            rows.append(targets[start + last] if last < drafts[i] else bonus[i])
            start += drafts[i]
        return rows

    def _row_limits(self, runner: Any, counts: list[int]) -> list[int]:
        limits = self._meta.limits
        req_ids = compat.batch_request_ids(runner.input_batch)[: len(counts)]
        return [min(n, limits.get(r, n)) if r is not None else n
                for r, n in zip(req_ids, counts, strict=True)]

    def commit_limit(self, runner: Any, num_sampled: torch.Tensor) -> torch.Tensor:
        """The recovery commit's count per row: a request that ends this step commits only
        the tokens vLLM keeps, so its page holds the state its response bundle needs."""
        if not self._mine(runner) or not self._meta.limits:
            return num_sampled
        limited = self._row_limits(runner, num_sampled.tolist())
        return torch.tensor(limited, dtype=num_sampled.dtype, device=num_sampled.device)

    def before_commit(self, runner: Any, sampled_token_ids: torch.Tensor) -> None:
        """Test-only wrong order: snapshot every request's state before the commit."""
        if not self._mine(runner):
            return
        assert self.layout is not None
        for req_id in compat.batch_request_ids(runner.input_batch)[: sampled_token_ids.shape[0]]:
            ids = self._meta.block_ids.get(req_id) if req_id is not None else None
            if req_id is not None and ids is not None:
                self._before[req_id] = self.layout.read_kda(self._kda_source(ids, 0))

    def after_commit(self, runner: Any, sampled_token_ids: torch.Tensor) -> None:
        """Record each request's sampled count and last-token logits; without speculation,
        finish the step's captures (vLLM's ``wait_for_save`` ran before sampling)."""
        if not self._mine(runner) or self._logits is None:
            return
        counts = self._row_limits(runner, sampled_counts(sampled_token_ids).tolist())
        rows = self._rows(counts)
        req_ids = compat.batch_request_ids(runner.input_batch)[: len(counts)]
        for i, req_id in enumerate(req_ids):
            if req_id is None:
                continue
            row = self._logits[rows[i]].clone()  # not a view: the step's logits go
            self._last[req_id] = Sampled(self._step, int(counts[i]), row)
            expected = self._expect_logits.pop(req_id, None)
            if expected is not None:
                self._check_logits(expected, row)
        self._logits, self._spec_meta = None, None
        if not self.speculative:
            self.finish_captures()

    def _check_logits(self, stored: torch.Tensor, computed: torch.Tensor) -> None:
        computed = computed.to("cpu", torch.float32)
        if stored.shape != computed.shape:
            return
        diff = float((stored - computed).abs().max())
        self.stats.logits_checked += 1
        self.stats.logits_max_abs_diff = max(self.stats.logits_max_abs_diff, diff)
        if int(stored.argmax()) == int(computed.argmax()):
            self.stats.logits_argmax_equal += 1
            logger.info("restored prompt: the engine's first-token logits match the stored "
                        "ones (same token, max abs difference %.3g)", diff)
        else:
            logger.warning("restored prompt: the stored first-token logits pick another "
                           "token than the engine's (max abs difference %.3g)", diff)

    # -- sampling hooks (runner V2) -------------------------------------------------------------
    def after_sampling(self, runner: Any, logits: torch.Tensor | None, input_batch: Any) -> None:
        """Keep the step's raw logits (a copy) and where each batch row's rows start."""
        if compat.layer_table(runner) is not self._layers or self.layout is None:
            return
        self._logits = logits
        self._logit_starts = (None if logits is None
                              else input_batch.cu_num_logits[: input_batch.num_reqs])

    def state_ends(self, layers: dict[str, Any], req_ids: list[str | None]) -> list[int] | None:
        """Per batch row, the most tokens its request's state may hold (its end)."""
        ends = self._meta.ends
        if layers is not self._layers or not ends:
            return None
        return [ends.get(r, NO_END) if r is not None else NO_END for r in req_ids]

    def after_step(self, step: BoundaryCaptureStep) -> None:
        """After the model state's commit: each request's sampled count, the logits row of
        its last kept token (empty where the runner computed none here) and its state's
        length; the device is read only for rows that may reach their end."""
        if step.layers is not self._layers or self.layout is None:
            return
        logits, starts = self._logits, self._logit_starts
        self._logits, self._logit_starts = None, None
        rows: torch.Tensor | None = None
        if logits is not None and starts is not None:
            last_rows = (starts.to(torch.int64)
                         + (step.num_sampled.to(torch.int64) - 1).clamp(min=0))
            rows = logits[last_rows.clamp(max=logits.shape[0] - 1)]
        no_logits = torch.empty(0, dtype=torch.float32)
        ends = self._meta.ends
        for i, req_id in enumerate(step.req_ids):
            if req_id is None:
                continue
            end = ends.get(req_id)
            if end is not None and req_id in self._at_end:
                self.stats.steps_past_end += 1
            elif end is not None and int(step.state_len[i]) == end:
                # the request ends here: keep its state before any later step can run
                ids = self._meta.block_ids.get(req_id)
                if ids is not None:
                    source = self._kda_source(ids, int(step.bias[i]),
                                              int(step.state_column[i]))
                    self._at_end[req_id] = (end, self.layout.read_kda(source))
            row = rows[i] if rows is not None else no_logits
            self._last[req_id] = Sampled(self._step, step.num_sampled[i], row,
                                         step.state_len[i], step.state_column[i],
                                         step.bias[i])
            expected = self._expect_logits.pop(req_id, None)
            if expected is not None:
                self._check_logits(expected, row)

    # -- captures ------------------------------------------------------------------------------
    def wait_for_save(self) -> None:
        """With speculation or under runner V2, the step's last hook (after commit and
        drafter): captures."""
        if self.speculative or self.v2:
            self.finish_captures()

    def finish_captures(self) -> None:
        """Turn this step's planned captures into bundles and queue them for the store."""
        captures, self._captures = self._captures, []
        tapped = taps.collect()
        for capture in captures:
            try:
                self._capture(capture, tapped)
            except StaleStateError as exc:
                logger.info("%s checkpoint of %d tokens not exported: %s", capture.kind,
                            capture.key.num_tokens, exc)
                self.stats.stale_exports += 1
                self._failed_keys.append(capture.key)
            except Exception as exc:
                logger.warning("%s checkpoint of %d tokens not exported: %s", capture.kind,
                               capture.key.num_tokens, exc)
                self.stats.export_failures += 1
                self._failed_keys.append(capture.key)

    def _capture(self, capture: Capture, tapped: dict[BundleKey, taps.TappedState]) -> None:
        assert self.layout is not None
        ids = self._meta.block_ids[capture.req_id]
        k = capture.key.num_tokens
        if capture.offset >= capture.chunk_len:
            self._check_computed(capture.req_id, k)
            kda = self.layout.read_kda(self._kda_source(ids, 0, self._column(k)))
        elif capture.offset == 0:
            if capture.key not in self._at_start:
                raise ValueError("its state was not readable before the step")
            kda = self._at_start.pop(capture.key)
        elif self.layout.ring_groups:
            raise ValueError("a state inside a prompt chunk: the indexer's tail ring "
                             "already holds the chunk's later keys")
        else:
            got = tapped.get(capture.key, {})
            missing = [layer.name for layer in self.layout.kda if layer.name not in got]
            if missing:
                raise ValueError(f"no state tap from {len(missing)} KDA layer(s), e.g. "
                                 f"{missing[0]} (the chunk was not computed as planned)")
            kda = {name: {n: t.to("cpu") for n, t in tensors.items()}
                   for name, tensors in got.items()}
        logits = torch.empty(0, dtype=torch.float32)
        meta: dict[str, int | str] = {"kind": capture.kind, "logits_after": 0,
                                      "bias_at_capture": 0}
        if capture.kind == "prompt":
            last = self._last.get(capture.req_id)
            if last is None or last.step != self._step:
                raise ValueError("the step sampled no first token for the request")
            logits = last.logits.to("cpu", torch.float32, copy=True)
            meta["logits_after"] = k + 1
        prompt = self._prompts[capture.req_id]
        attention = self.layout.read_attention(ids, k)
        checkpoint = RequestCheckpoint(tokens=prompt[:k], layers={**kda, **_kv(attention)},
                                       logits=logits, boundary="prompt", meta=meta)
        self.writer.submit(capture.key, checkpoint)
        self.stats.exported[capture.kind] += 1

    # -- step end ------------------------------------------------------------------------------
    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Exports copied off their blocks, loads done (and which of them failed)."""
        for req_id in finished_req_ids:
            self._prompts.pop(req_id, None)
            self._last.pop(req_id, None)
            self._before.pop(req_id, None)
            self._expect_logits.pop(req_id, None)
            self._at_end.pop(req_id, None)
        out = compat.KVConnectorTransferResults(
            finished_sending=self._sending, finished_recving=self._recving,
            failed_recving=self._failed)
        self._sending, self._recving, self._failed = set(), set(), set()
        return out

    def build_connector_worker_meta(self) -> RecoverSSMWorkerMetadata | None:
        """The bundles this rank published or failed to store since the last step."""
        published: list[tuple[int, str, int]] = []
        failed = [(key.num_tokens, key.digest, self.rank) for key in self._failed_keys]
        self._failed_keys = []
        for result in self.writer.results():
            entry = (result.key.num_tokens, result.key.digest, self.rank)
            if result.published:
                published.append(entry)
                self.stats.published += 1
            else:
                failed.append(entry)
                self.stats.export_failures += 1
        if not published and not failed:
            return None
        return RecoverSSMWorkerMetadata(published=published, failed=failed)

    def shutdown(self) -> None:
        """Write what is queued, then release the store."""
        self.writer.close()
        self.store.close()


def _kv(attention: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {"kv": t} for name, t in attention.items()}
