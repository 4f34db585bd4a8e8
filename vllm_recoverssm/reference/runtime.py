"""The reference speculative-decoding loop: admission, chunked prefill, verify, accept, commit.

Each :meth:`SpecRuntime.step` runs one forward pass over a flat batch: the decode rows
(``S+1`` tokens each: the last sampled token and ``S`` drafts) followed by the prefill rows
(prompt chunks, or one token per step for non-speculative requests). After the pass:

* decode rows accept greedily (the longest draft prefix that matches the model's argmax,
  plus the model's next token);
* recovery mode commits exactly the accepted tokens' records into each checkpoint and
  moves the conv history to offset 0 (``ops.commit`` + ``ops.conv_compact`` with a commit
  plan from :mod:`vllm_recoverssm.state`); with the fused commit (the default) it only
  remembers them (with prefix caching, those of rows that stay inside their block): the
  next step's ``ops.verify_fused`` commits them into the checkpoint before verifying, in
  the same launch, and the next conv update
  reads the history where it lies; a request that finishes (a response boundary) is
  committed and compacted on its own first where a checkpoint store or a boundary hook
  reads its state (otherwise its last records are dropped with its slot). Full-state mode
  only remembers ``num_accepted``: the next verify starts from column ``num_accepted - 1``
  and reads the conv history at offset ``num_accepted - 1``;
* with prefix caching (align mode, block size ``B >= S+1``) the state after every ``B``
  tokens is kept, including a boundary crossed in the middle of a speculative step
  (recovery replays only the accepted tokens up to the boundary; full state copies the
  column of the boundary token with ``ops.capture_boundary``).

Requests wait when the state pool or the KV pages cannot hold them, and release every slot
and page when they finish. With a checkpoint store (``RuntimeConfig.checkpoint``) a request
is looked up on admission and restored from the longest stored prefix of its prompt, and is
exported at the end of its prompt and of its response (:mod:`.checkpointing`,
:mod:`.boundary`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_recoverssm import ops
from vllm_recoverssm.state import SlotAllocator, build_align_commit_plan, build_commit_plan

from .boundary import capture_linear, check_restorable, restore_request
from .checkpointing import RuntimeCheckpoints
from .cuda_graph import DecodeGraph
from .drafters import Drafter
from .kv_pages import PageAllocator
from .model import HybridModel
from .pools import ModelPools
from .prefix_cache import CacheEntry, PrefixCache
from .request import Request
from .runtime_config import RuntimeConfig
from .stats import RuntimeStats
from .step_builder import DecodeRow, PrefillRow, build_step_inputs
from .step_inputs import FULL_STATE, RECOVERY, StepInputs

if TYPE_CHECKING:
    from vllm_recoverssm.checkpoint import CheckpointStore, RequestCheckpoint


BoundaryHook = Callable[["SpecRuntime", Request, str], None]
"""Called as ``hook(runtime, request, boundary)`` with boundary ``"prompt"`` or ``"response"``."""

INDEX = torch.int32  # index dtype of the state ops


def _matched_prefix(drafts: Sequence[int], target: Sequence[int]) -> int:
    """How many leading drafts equal the model's argmax at their position."""
    n = 0
    for d, t in zip(drafts, target, strict=False):
        if d != t:
            break
        n += 1
    return n


class SpecRuntime:
    """Serves requests on a :class:`HybridModel` with speculative decoding.

    ``drafter=None`` decodes without speculation (one token per step through the prefill
    path): the plain greedy reference the speculative modes must reproduce. With
    ``config.checkpoint`` set, building the runtime builds its checkpoint store (and raises
    ``CheckpointConfigError`` if LMCache is missing or misconfigured); :meth:`close`
    releases it.
    """

    def __init__(
        self,
        model: HybridModel,
        config: RuntimeConfig,
        drafter: Drafter | None = None,
        *,
        on_boundary: BoundaryHook | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.drafter = drafter
        self.on_boundary = on_boundary
        self.device = model.device
        mc = model.config
        self.num_spec = config.num_spec
        self.block_size = config.block_size
        self.pools = ModelPools(
            mc, mode=config.mode, num_spec=config.num_spec, num_slots=config.total_slots,
            record_rows=config.record_rows, num_pages=config.total_pages,
            block_size=config.block_size, device=self.device,
        )
        self.slots = SlotAllocator(config.total_slots)
        self.pages = PageAllocator(config.total_pages)
        self.cache = PrefixCache(config.block_size, config.cached_blocks, self.slots,
                                 self.pages)
        kda = model.kda_mixers()
        self._A_log = torch.stack([m.A_log for m in kda]).float().contiguous()
        self._dt_bias = torch.stack([m.dt_bias for m in kda]).float().contiguous()
        self._commit_tables: Any = None  # the commit kernel's address tables, built once
        self._parity = 0  # fused commit: which half of the record scratch this step writes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self._restores: dict[int, RequestCheckpoint] = {}
        self._next_rid = 0
        self.stats = RuntimeStats(accept_histogram=[0] * (config.num_spec + 1))
        self._graphs: dict[int, DecodeGraph] = {}  # by captured decode row count
        self._graph_pool: Any = None  # one memory pool shared by all of them
        # linear state read before the commit (negative-control runtime only), by request
        self._early_linear: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        self.checkpoints: RuntimeCheckpoints | None = None
        if config.checkpoint is not None:
            self.checkpoints = RuntimeCheckpoints(self, config.checkpoint)

    @property
    def checkpoint_store(self) -> CheckpointStore | None:
        """The runtime's checkpoint store, if ``config.checkpoint`` is set."""
        return self.checkpoints.store if self.checkpoints is not None else None

    def close(self) -> None:
        """Release the checkpoint store (if any); the runtime cannot export afterwards."""
        if self.checkpoints is not None:
            self.checkpoints.close()
            self.checkpoints = None

    def __enter__(self) -> SpecRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ requests

    @property
    def mode(self) -> str:
        """``"recovery"`` or ``"full_state"``."""
        return self.config.mode

    @property
    def speculative(self) -> bool:
        """Whether decode steps verify drafts."""
        return self.drafter is not None

    def add_request(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        restore: RequestCheckpoint | None = None,
        has_images: bool = False,
    ) -> Request:
        """Queue a request; it runs when its slots and pages fit.

        ``restore`` resumes from a checkpoint whose tokens are a prefix of ``prompt`` (see
        :func:`.boundary.restore_request`); a checkpoint of the whole prompt needs no
        prefill at all (its logits give the first token). ``has_images`` marks a request
        that carried images: it is never exported to, nor restored from, the checkpoint
        store.
        """
        prompt = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("argument 'prompt': expected at least one token, got none")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"argument 'prompt': token ids {bad[:5]} are outside 0..{vocab - 1}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or (
            max_new_tokens < 1
        ):
            raise ValueError(
                f"argument 'max_new_tokens': expected a positive int, got {max_new_tokens!r}"
            )
        need = len(prompt) + max_new_tokens + self.num_spec
        if need > self.config.max_model_len:
            raise ValueError(
                f"argument 'prompt': {len(prompt)} prompt + {max_new_tokens} new + "
                f"{self.num_spec} draft positions = {need} exceed max_model_len "
                f"{self.config.max_model_len}"
            )
        if self._pages_needed(len(prompt), max_new_tokens) > self.pages.capacity:
            raise ValueError(
                f"argument 'max_new_tokens': the request needs "
                f"{self._pages_needed(len(prompt), max_new_tokens)} KV pages, the pool has "
                f"{self.pages.capacity}"
            )
        if not isinstance(has_images, bool):
            raise ValueError(
                f"argument 'has_images': expected a bool, got {type(has_images).__name__}"
            )
        req = Request(rid=self._next_rid, prompt=prompt, max_new_tokens=max_new_tokens,
                      has_images=has_images)
        self._next_rid += 1
        if restore is not None:
            check_restorable(self, req, restore)
            self._restores[req.rid] = restore
        self.waiting.append(req)
        return req

    def _pages_needed(self, prompt_len: int, max_new: int) -> int:
        return math.ceil((prompt_len + max_new + self.num_spec) / self.block_size)

    # ------------------------------------------------------------------ slots

    def _acquire(self, req: Request, owner: Hashable, count: int) -> list[int]:
        got = self.slots.acquire(owner, count)
        req.slot_owners.append(owner)
        held = sum(len(self.slots.owned(o)) for o in req.slot_owners)
        self.stats.peak_slots_per_request = max(self.stats.peak_slots_per_request, held)
        return got

    def _slots_held(self, req: Request) -> int:
        held = len(req.run_slots) + len(req.columns)
        return held + (1 if req.boundary_slot >= 0 else 0)

    def _outstanding(self) -> int:
        """Slots promised to running requests but not yet acquired by them."""
        return sum(r.slots_reserved - self._slots_held(r) for r in self.running)

    def _make_room(
        self, need_slots: int, need_pages: int, protect: tuple[int, ...] | None = None
    ) -> bool:
        """Evict cache entries (never ``protect``) until the request fits; True if it does."""

        def fits() -> bool:
            free_slots = self.slots.num_free - self._outstanding()
            return free_slots >= need_slots and self.pages.num_free >= need_pages

        while not fits():
            if not self._evict_except(protect):
                return False
        return True

    def _evict_except(self, protect: tuple[int, ...] | None) -> bool:
        if protect is None or not self.cache.contains(protect):
            return self.cache.evict_one()
        # The protected entry was just looked up, so it is the most recently used: the LRU
        # one is another entry unless it is the only one left.
        if len(self.cache) <= 1:
            return False
        return self.cache.evict_one()

    def _keep_reservations(self) -> None:
        """After the cache took over a request's slot, free cache slots it still owes."""
        while self.slots.num_free < self._outstanding() and self.cache.evict_one():
            pass

    # ------------------------------------------------------------------ admission

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            if not self._try_admit(req):
                self.stats.wait_events += 1
                break
            self.waiting.popleft()
            self.running.append(req)
        self.stats.max_concurrent = max(self.stats.max_concurrent, len(self.running))

    def _try_admit(self, req: Request) -> bool:
        need_slots = self.config.slots_per_request
        total_pages = self._pages_needed(len(req.prompt), req.max_new_tokens)
        restore = self._restores.get(req.rid)
        entry: CacheEntry | None = None
        if restore is None and self.config.prefix_caching:
            entry = self.cache.find(req.prompt, len(req.prompt) - 1)
        if restore is None and self.checkpoints is not None:
            # External hits only where they reach past the runtime's own cache.
            local = entry.num_tokens if entry is not None else 0
            restore = self.checkpoints.lookup(req, min_tokens=local + 1)
            if restore is not None:
                self._restores[req.rid] = restore
                entry = None
        if entry is not None:
            hit_pages = entry.num_tokens // self.block_size
            key = tuple(req.prompt[: entry.num_tokens])
            if not self._make_room(need_slots, total_pages - hit_pages, protect=key):
                entry = None  # keeping the block would not leave room: admit cold
        if entry is None and not self._make_room(need_slots, total_pages):
            return False
        if self.config.prefix_caching and restore is None:
            self.cache.record_lookup(entry)
        if restore is not None:
            self._allocate(req, total_pages, start=restore.num_tokens)
            restore_request(self, req, restore)
            del self._restores[req.rid]
            if self.checkpoints is not None:
                self.checkpoints.forget(req)
        elif entry is not None:
            self.pages.share(list(entry.pages))
            req.pages = list(entry.pages)
            req.prefix_hit_tokens = entry.num_tokens
            first = self._allocate(req, total_pages, start=entry.num_tokens)
            self.pools.copy_slot(entry.slot, first)
        else:
            first = self._allocate(req, total_pages, start=0)
            self.pools.clear_slot(first)
        return True

    def _allocate(self, req: Request, total_pages: int, start: int) -> int:
        """Give an admitted request its slots and pages; returns its running-state slot.

        ``start`` tokens are already known (a prefix-cache hit or a restore); the caller
        fills the running-state slot.
        """
        cfg = self.config
        req.slots_reserved = cfg.slots_per_request
        req.pages += self.pages.allocate(total_pages - len(req.pages))
        if cfg.mode == FULL_STATE:
            req.run_slots = self._acquire(req, (req.rid, "run"), cfg.num_spec + 1)
            if cfg.prefix_caching:
                req.boundary_slot = self._acquire(req, (req.rid, "boundary", 0), 1)[0]
        elif cfg.prefix_caching:
            col = max(start - 1, 0) // self.block_size
            req.columns[col] = self._acquire(req, (req.rid, "col", col), 1)[0]
        else:
            req.run_slots = self._acquire(req, (req.rid, "run"), 1)
        req.num_computed = start
        req.num_accepted = 1
        return self.running_state_slot(req)

    def running_state_slot(self, req: Request) -> int:
        """Slot that holds the request's committed state at zero speculative offset.

        Recovery: the checkpoint (align mode: column ``(num_computed-1)//B``). Full state:
        column 0, valid only while ``num_accepted == 1`` (after prefill, a restore or
        :meth:`compact_full_state`).
        """
        if self.mode == RECOVERY and self.config.prefix_caching:
            return req.columns[max(req.num_computed - 1, 0) // self.block_size]
        return req.run_slots[0]

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> tuple[list[Request], list[tuple[Request, int, int]]]:
        decode: list[Request] = []
        prefill: list[tuple[Request, int, int]] = []
        budget = self.config.max_prefill_tokens
        B = self.block_size
        for r in self.running:
            if r.in_prefill:
                if budget <= 0:
                    continue
                start = r.num_computed
                end = min(len(r.prompt), start + budget)
                if self.config.prefix_caching:
                    end = min(end, (start // B + 1) * B)  # stop at the block boundary
                prefill.append((r, start, end))
                budget -= end - start
            elif self.speculative:
                decode.append(r)
            else:
                prefill.append((r, r.num_computed, r.num_computed + 1))
        return decode, prefill

    def _prefill_slot(self, req: Request, start: int) -> int:
        """Slot the prefill of ``tokens[start:...]`` continues from and writes to."""
        if not (self.mode == RECOVERY and self.config.prefix_caching):
            return req.run_slots[0]
        B = self.block_size
        col = start // B
        if col not in req.columns:
            req.columns[col] = self._acquire(req, (req.rid, "col", col), 1)[0]
        src_col = max(start - 1, 0) // B
        if col != src_col:
            # A new block starts: continue from a copy, the completed block stays as it is.
            self.pools.copy_slot(req.columns[src_col], req.columns[col])
        return req.columns[col]

    def _decode_row(self, req: Request) -> DecodeRow:
        """Slots one decode row reads and writes (acquiring align-mode columns as needed)."""
        S, B, nc = self.num_spec, self.block_size, req.num_computed
        if self.mode == FULL_STATE:
            return DecodeRow(req, list(req.run_slots), req.run_slots[0], [])
        if not self.config.prefix_caching:
            return DecodeRow(req, req.run_slots[0], req.run_slots[0], [])
        src = req.columns[(nc - 1) // B]
        col = nc // B
        if col not in req.columns:
            req.columns[col] = self._acquire(req, (req.rid, "col", col), 1)[0]
        if col != (nc - 1) // B:
            # The step starts a new block: its conv window goes to the new column so that
            # the completed block keeps its history (it becomes a cached prefix block).
            hist = self.model.config.conv_kernel - 1
            for conv in self.pools.convs:
                conv[req.columns[col], :, :hist].copy_(conv[src, :, :hist])
        if nc + S + 1 > (col + 1) * B and col + 1 not in req.columns:
            req.columns[col + 1] = self._acquire(req, (req.rid, "col", col + 1), 1)[0]
        width = max(req.columns) + 1
        table = [req.columns.get(j, -1) for j in range(width)]
        return DecodeRow(req, src, req.columns[col], table)

    # ------------------------------------------------------------------ the step

    def step(self) -> bool:
        """Admit, run one forward pass, accept and commit. False when nothing is left."""
        started = time.perf_counter()
        generated = self.stats.generated_tokens
        self._admit()
        self._finish_done()  # a restored prompt with one token to generate is done already
        if not self.running:
            if self.waiting:
                raise RuntimeError(
                    f"request {self.waiting[0].rid} cannot be admitted into an idle runtime: "
                    "the state pool or KV pages are too small for it"
                )
            return False
        decode, prefill = self._schedule()
        drafts = (
            self.drafter.propose(self.model, decode, self.num_spec)
            if decode and self.drafter is not None else []
        )
        for r, d in zip(decode, drafts, strict=True):
            r.drafts = [int(t) for t in d]
        fused_rows = None
        if self.config.fused:
            # records still pending from a step this request did not follow are committed
            # first; the rest are committed by this step's verify
            scheduled = {id(r) for r in decode}
            self._flush([r for r in self.running if r.pending and id(r) not in scheduled])
            fused_rows = self._parity * self.config.max_running
        decode_rows = [self._decode_row(r) for r in decode]
        prefill_rows = [PrefillRow(r, s, e, self._prefill_slot(r, s)) for r, s, e in prefill]
        pure_decode = bool(decode_rows) and not prefill_rows
        graph = self.config.cuda_graph and pure_decode
        if pure_decode and (graph or self.config.pad_decode_rows):
            num_rows = self.config.graph_rows(len(decode_rows))
        else:
            num_rows = len(decode_rows)
        with torch.inference_mode():
            step_inputs = build_step_inputs(
                self.mode, decode_rows, prefill_rows, num_rows, num_spec=self.num_spec,
                block_size=self.block_size, pages_per_request=self.config.pages_per_request,
                device=self.device, backend=self.config.backend, fused_rows=fused_rows,
                # the runtime builds these rows itself: on a GPU the op checks that read
                # device values would stall every layer of every eager step (as in _commit);
                # elsewhere they keep the tests strict
                validate=self.device.type != "cuda",
            )
            captures = False
            if graph:
                captures = num_rows not in self._graphs
                hidden = self._graph_forward(num_rows, step_inputs)
                self.stats.graph_steps += 1
            else:
                hidden = self.model(step_inputs, self.pools)
            self._after_decode(decode_rows, hidden)
            self._after_prefill(prefill_rows, hidden, num_rows * (self.num_spec + 1))
        self.stats.steps += 1
        self.stats.decode_steps += bool(decode_rows)
        self.stats.mixed_steps += bool(decode_rows and prefill_rows)
        self._finish_done()
        if decode_rows and not prefill_rows and not captures:
            # acceptance read the step's tokens back to the host, so the GPU work is done;
            # the step that captures the graph is start-up work (vLLM captures before
            # serving) and would weigh a one-off cost into a handful of timed steps
            self.stats.decode_only_seconds += time.perf_counter() - started
            self.stats.decode_only_tokens += self.stats.generated_tokens - generated
        return True

    def run(self, progress: Callable[[int, int], None] | None = None) -> list[Request]:
        """Step until every queued request is finished; returns them in submission order.

        ``progress(done_tokens, total_tokens)`` is called after each step.
        """
        batch = [*self.running, *self.waiting]
        total = sum(r.max_new_tokens for r in batch)
        started = time.perf_counter()
        while self.step():
            if progress is not None:
                progress(sum(len(r.generated) for r in batch), total)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.seconds += time.perf_counter() - started
        return sorted(batch, key=lambda r: r.rid)

    def _graph_forward(self, num_rows: int, step_inputs: StepInputs) -> torch.Tensor:
        graph = self._graphs.get(num_rows)
        if graph is None:
            graph = self._graphs[num_rows] = DecodeGraph(self.model, self.pools, step_inputs,
                                                         self._graph_pool)
            self.stats.graph_captures += 1
            self._graph_pool = graph.pool
        return graph.replay(step_inputs)

    # ------------------------------------------------------------------ after the pass

    def _after_decode(self, rows: list[DecodeRow], hidden: torch.Tensor) -> None:
        if not rows:
            return
        S = self.num_spec
        W = S + 1
        n = len(rows)
        h = hidden[: n * W]
        logits = self.model.logits(h)
        # one read-back per step: acceptance runs on the host, where the drafts are
        tgt = logits.argmax(-1).view(n, W).tolist()
        rooms = [d.request.remaining - 1 for d in rows]
        acc = [min(_matched_prefix(d.request.drafts, t), room)
               for d, t, room in zip(rows, tgt, rooms, strict=True)]
        num_accepted = [a + 1 for a in acc]
        crossed: list[tuple[Request, int]] = []
        if self.mode == RECOVERY:
            if self.config.debug_capture_before_commit:
                self._capture_before_commit(rows)
            if self.config.fused:
                keep = self._deferrable(rows, num_accepted)
                if not all(keep):
                    self._commit(rows, num_accepted, skip=keep,
                                 record_base=self._parity * self.config.max_running)
                self._defer_commit(rows, num_accepted, keep)
            else:
                self._commit(rows, num_accepted)
        elif self.config.prefix_caching:
            crossed = self._capture_full_state_boundaries(rows, num_accepted)
        # the last accepted position of every row, gathered in one launch each
        last = torch.tensor([i * W + a for i, a in enumerate(acc)], device=self.device)
        last_hidden, last_logits = h[last], logits[last]
        for i, (row, a) in enumerate(zip(rows, acc, strict=True)):
            r = row.request
            new = [*r.drafts[:a], tgt[i][a]]
            r.tokens.extend(new)
            r.num_computed += a + 1
            r.last_hidden = last_hidden[i]
            r.last_logits = last_logits[i]
            r.accept_lengths.append(a)
            if self.mode == FULL_STATE:
                r.num_accepted = a + 1
            self.stats.accept_histogram[a] += 1
            self.stats.accepted_drafts += a
            self.stats.proposed_drafts += min(S, rooms[i])
            self.stats.generated_tokens += len(new)
            r.drafts = []
        for req, num_tokens in crossed:
            self._cache_boundary_slot(req, num_tokens)
        if self.config.prefix_caching:
            for row in rows:
                self._retire_blocks(row.request)

    def _capture_before_commit(self, rows: list[DecodeRow]) -> None:
        """Negative control: read the linear state of rows that may finish, before the commit.

        A response-boundary export then pairs the state before this step with the tokens
        after it: the wrong order the capture-order test shows restores a wrong state.
        """
        for row in rows:
            r = row.request
            if r.remaining <= self.num_spec + 1:  # may finish in this step
                self._early_linear[r.rid] = capture_linear(self, r)

    def _commit_counts(self, num_accepted: list[int]) -> list[int]:
        shift = self.config.debug_commit_shift
        return [min(max(n + shift, 0), self.num_spec + 1) for n in num_accepted]

    def _deferrable(self, rows: list[DecodeRow], num_accepted: list[int]) -> list[bool]:
        """Fused commit: which rows' records may wait for the next verify. Without prefix
        caching every row's; in align mode a row whose accepted tokens reach its block's
        end (the block becomes a cached prefix) or whose step started a new block (verify
        read the checkpoint from the completed block) commits now."""
        if not self.config.prefix_caching:
            return [True] * len(rows)
        B = self.block_size
        return [nc % B != 0 and nc + n < (nc // B + 1) * B
                for nc, n in zip((d.request.num_computed for d in rows),
                                 self._commit_counts(num_accepted), strict=True)]

    def _defer_commit(self, rows: list[DecodeRow], num_accepted: list[int],
                      keep: list[bool]) -> None:
        """Fused commit: the accepted records of the rows ``keep`` names wait for the next
        step's verify (the others were committed)."""
        base = self._parity * self.config.max_running
        for i, (row, n, k) in enumerate(zip(rows, self._commit_counts(num_accepted), keep,
                                            strict=True)):
            row.request.pending = int(n) if k else 0
            row.request.pending_row = base + i if k else -1
            self.stats.deferred_rows += k
        self._parity ^= 1

    def _flush(self, reqs: list[Request]) -> None:
        """Commit and compact the pending records of ``reqs`` on their own (fused commit).

        A request reaching its response boundary, or leaving the decode batch, needs its
        accepted state in the checkpoint before anything reads it. One launch commits all
        layers of all the given requests, one more compacts their conv windows.
        """
        reqs = [r for r in reqs if r.pending]
        if not reqs:
            return
        dev, backend = self.device, self.config.backend
        check = dev.type != "cuda"  # plans the runtime built itself (see _commit)
        plan = ops.CommitPlan(
            state_indices=torch.tensor([self.running_state_slot(r) for r in reqs], dtype=INDEX,
                                       device=dev),
            commit_lens=torch.tensor([r.pending for r in reqs], dtype=INDEX, device=dev),
        )
        rows = torch.tensor([r.pending_row for r in reqs], dtype=INDEX, device=dev)
        if self._commit_tables is None and dev.type == "cuda" and backend != "reference":
            self._commit_tables = ops.commit_tables(self.pools.states, self.pools.corrections,
                                                    self.pools.kgs)
        ops.commit(self.pools.states, self.pools.corrections, self.pools.kgs, self._A_log,
                   self._dt_bias, plan, lower_bound=self.model.config.lower_bound,
                   record_indices=rows, backend=backend, validate=check,
                   tables=self._commit_tables)
        ops.conv_compact(self.pools.convs, plan, kernel_width=self.model.config.conv_kernel,
                         backend=backend, validate=check)
        for r in reqs:
            r.pending = 0
            r.pending_row = -1

    def _commit(self, rows: list[DecodeRow], num_accepted: list[int],
                skip: list[bool] | None = None, record_base: int | None = None) -> None:
        """Recovery: replay the accepted records into the checkpoints, then compact conv.

        ``skip`` (align mode, fused commit): rows left null, whose records wait for the
        next verify; ``record_base``: the records of row ``i`` sit in scratch row
        ``record_base + i`` (default ``i``)."""
        S, dev = self.num_spec, self.device
        n = len(rows)
        skipped = [False] * n if skip is None else skip
        # The runtime builds these plans itself; on a GPU the checks that read device
        # values would stall the host every step, elsewhere they keep the tests strict.
        check = dev.type != "cuda"
        commit_counts = torch.tensor(self._commit_counts(num_accepted), dtype=INDEX, device=dev)
        query_lens = torch.full((n,), S + 1, dtype=INDEX, device=dev)
        if self.config.prefix_caching:
            width = max(len(d.column_row) for d in rows)
            # a skipped row gets a null table row: its plan row is null
            table = torch.tensor([([-1] * width if k else d.column_row
                                   + [-1] * (width - len(d.column_row)))
                                  for d, k in zip(rows, skipped, strict=True)],
                                 dtype=INDEX, device=dev)
            computed = torch.tensor([d.request.num_computed for d in rows], dtype=INDEX,
                                    device=dev)
            plan = build_align_commit_plan(table, computed, query_lens, commit_counts,
                                           self.block_size, num_spec=S, validate=check)
            conv_plan = ops.CommitPlan(
                state_indices=torch.tensor([-1 if k else d.conv
                                            for d, k in zip(rows, skipped, strict=True)],
                                           dtype=INDEX, device=dev),
                commit_lens=plan.commit_lens, final_indices=plan.final_indices,
                boundary_indices=plan.boundary_indices, boundary_lens=plan.boundary_lens,
            )
        else:
            slots = torch.tensor([d.state for d in rows], dtype=INDEX, device=dev)
            plan = build_commit_plan(slots, commit_counts, query_lens, num_spec=S,
                                     validate=check)
            conv_plan = plan
        backend = self.config.backend
        if self._commit_tables is None and dev.type == "cuda" and backend != "reference":
            self._commit_tables = ops.commit_tables(self.pools.states, self.pools.corrections,
                                                    self.pools.kgs)
        records = None if record_base is None else torch.arange(
            record_base, record_base + n, dtype=INDEX, device=dev)
        ops.commit(self.pools.states, self.pools.corrections, self.pools.kgs, self._A_log,
                   self._dt_bias, plan, lower_bound=self.model.config.lower_bound,
                   record_indices=records, backend=backend, validate=check,
                   tables=self._commit_tables)
        ops.conv_compact(self.pools.convs, conv_plan,
                         kernel_width=self.model.config.conv_kernel, backend=backend,
                         validate=check)
        if plan.boundary_indices is not None and plan.boundary_lens is not None:
            inside = (plan.boundary_indices >= 0) & (plan.boundary_lens < plan.commit_lens)
            self.stats.boundaries_mid_step += int(inside.sum())

    def _capture_full_state_boundaries(
        self, rows: list[DecodeRow], num_accepted: list[int]
    ) -> list[tuple[Request, int]]:
        """Full state, align mode: copy the column of a crossed block boundary.

        Returns the requests that crossed one, with the token count at the boundary.
        """
        B = self.block_size
        bidx, blen, crossed = [], [], []
        for d, a in zip(rows, num_accepted, strict=True):
            nc = d.request.num_computed
            nxt = (nc // B + 1) * B
            if nc + a >= nxt:
                self.stats.boundaries_mid_step += nxt - nc < a
                bidx.append(d.request.boundary_slot)
                blen.append(nxt - nc)
                crossed.append((d.request, nxt))
            else:
                bidx.append(-1)
                blen.append(0)
        if not crossed:
            return crossed
        dev = self.device
        columns = torch.tensor([d.state for d in rows], dtype=INDEX, device=dev)
        b_idx = torch.tensor(bidx, dtype=INDEX, device=dev)
        b_len = torch.tensor(blen, dtype=INDEX, device=dev)
        for state, conv in zip(self.pools.states, self.pools.convs, strict=True):
            ops.capture_boundary(state, conv, columns, b_idx, b_len)
        return crossed

    def _cache_boundary_slot(self, req: Request, num_tokens: int) -> None:
        """Full state: hand the filled boundary slot to the cache and take a fresh one."""
        owner = (req.rid, "boundary", req.boundary_serial)
        pages = req.pages[: num_tokens // self.block_size]
        if not self.cache.insert(req.tokens[:num_tokens], owner, req.boundary_slot, pages):
            self.slots.release(owner)
        req.slot_owners.remove(owner)
        req.boundary_slot = -1
        self._keep_reservations()
        req.boundary_serial += 1
        owner = (req.rid, "boundary", req.boundary_serial)
        req.boundary_slot = self._acquire(req, owner, 1)[0]

    def _retire_blocks(self, req: Request, final: bool = False) -> None:
        """Recovery, align mode: completed columns the request no longer reads go to the cache.

        A column ``j`` is complete once ``num_computed >= (j+1)*B``; it is still read while
        it holds the running state (``j == (num_computed-1)//B``), unless ``final``.
        """
        if self.mode != RECOVERY:
            return
        B = self.block_size
        running = (req.num_computed - 1) // B
        for col in sorted(req.columns):
            if col >= running and not final:
                continue
            slot = req.columns.pop(col)
            owner = (req.rid, "col", col)
            complete = (col + 1) * B <= req.num_computed
            pages = req.pages[: col + 1]
            if not (complete and self.cache.insert(req.tokens[: (col + 1) * B], owner, slot,
                                                    pages)):
                self.slots.release(owner)
            req.slot_owners.remove(owner)
        self._keep_reservations()

    def _after_prefill(self, rows: list[PrefillRow], hidden: torch.Tensor, offset: int) -> None:
        B = self.block_size
        last = []
        pos = offset
        for p in rows:
            pos += p.end - p.start
            last.append(pos - 1)
        sample = [i for i, p in enumerate(rows) if p.end == len(p.request.tokens)]
        if sample:
            h = hidden[torch.tensor([last[i] for i in sample], device=self.device)]
            logits = self.model.logits(h)
            tokens = logits.argmax(-1).tolist()
        for p in rows:
            self.stats.prefill_tokens += max(0, min(p.end, len(p.request.prompt)) - p.start)
            p.request.num_computed = p.end
        for j, i in enumerate(sample):
            r = rows[i].request
            prompt_done = len(r.tokens) == len(r.prompt)
            r.tokens.append(int(tokens[j]))
            r.last_hidden = h[j].clone()
            r.last_logits = logits[j].clone()
            self.stats.generated_tokens += 1
            if prompt_done:
                self._at_boundary(r, "prompt")
        if self.config.prefix_caching:
            for p in rows:
                r = p.request
                if self.mode == FULL_STATE and p.end % B == 0:
                    self.pools.copy_slot(r.run_slots[0], r.boundary_slot)
                    self._cache_boundary_slot(r, p.end)
                else:
                    self._retire_blocks(r)

    # ------------------------------------------------------------------ finishing

    def compact_full_state(self, req: Request) -> None:
        """Full state: move the latest state to column 0 and the conv history to offset 0.

        Afterwards ``num_accepted == 1``: the request has zero speculative offset, like a
        recovery checkpoint. Used after a request-boundary capture.
        """
        if self.mode != FULL_STATE or req.num_accepted == 1:
            return
        col = req.run_slots[req.num_accepted - 1]
        for state in self.pools.states:
            state[req.run_slots[0]].copy_(state[col])
        dev = self.device
        plan = ops.CommitPlan(
            state_indices=torch.tensor([req.run_slots[0]], dtype=INDEX, device=dev),
            commit_lens=torch.tensor([req.num_accepted], dtype=INDEX, device=dev),
        )
        ops.conv_compact(self.pools.convs, plan, kernel_width=self.model.config.conv_kernel,
                         backend=self.config.backend)
        req.num_accepted = 1

    def _at_boundary(self, req: Request, boundary: str) -> None:
        """End of the prompt or of the response: export to the store, then the user's hook.

        Recovery has committed and compacted the accepted tokens already (the step did), so
        the export reads the state as it is; full state captures the accepted column and
        then compacts, after which a hook's own capture reads the same state at column 0.
        """
        if self.checkpoints is not None:
            linear = self._early_linear.pop(req.rid, None) if boundary == "response" else None
            self.checkpoints.export(req, boundary, linear=linear)
        if self.on_boundary is not None:
            self.on_boundary(self, req, boundary)

    def _finish_done(self) -> None:
        done = [r for r in self.running if r.done]
        if self.checkpoints is not None or self.on_boundary is not None:
            self._flush(done)  # commit before the response-boundary capture
        else:
            # nothing reads a finished request's state (its slot is released below), so its
            # last records are dropped, as the full-state columns past the accepted one are
            for r in done:
                r.pending, r.pending_row = 0, -1
        for r in done:
            self._at_boundary(r, "response")
            if self.config.prefix_caching and self.mode == RECOVERY:
                self._retire_blocks(r, final=True)
            self._release(r)
            self.running.remove(r)
            r.finished = True
            self.finished.append(r)

    def _release(self, req: Request) -> None:
        for owner in req.slot_owners:
            self.slots.release(owner)
        req.slot_owners.clear()
        req.run_slots.clear()
        req.columns.clear()
        req.boundary_slot = -1
        req.slots_reserved = 0
        self.pages.drop(req.pages)
        req.pages = []

