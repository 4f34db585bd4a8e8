"""Settings of the reference runtime: mode, speculation, pools, prefix caching, checkpoints."""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_recoverssm.checkpoint import CheckpointConfig
from vllm_recoverssm.ops import BACKENDS

from .step_inputs import FULL_STATE, MODES, RECOVERY


def slots_per_request(mode: str, num_spec: int, prefix_caching: bool) -> int:
    """State-pool slots one running request holds at most.

    Recovery keeps one checkpoint (align mode: the running block and the next one); full
    state keeps ``S+1`` speculative columns (align mode: plus one boundary slot).
    """
    if mode not in MODES:
        raise ValueError(f"argument 'mode': expected one of {MODES}, got {mode!r}")
    base = 1 if mode == RECOVERY else num_spec + 1
    return base + (1 if prefix_caching else 0)


@dataclass(frozen=True)
class RuntimeConfig:
    """How the runtime schedules requests and sizes its pools.

    ``max_running`` requests run at once (it is also the number of record scratch rows);
    ``max_model_len`` bounds prompt + response + ``S`` positions; ``max_prefill_tokens``
    is the prompt-token budget of one step (longer prompts are prefilled in chunks).
    ``block_size`` is the KV page size and, with ``prefix_caching``, the state block size
    ``B`` (align mode, ``B >= S+1``). ``num_slots`` / ``num_pages`` default to enough for
    ``max_running`` requests plus ``max_cached_blocks`` cached blocks; smaller pools make
    requests wait. ``cuda_graph`` replays pure decode steps from CUDA graphs, one per
    capture size (:attr:`graph_sizes`, like vLLM's ``cudagraph_capture_sizes``): a step of
    ``n`` rows is padded to the smallest size that holds it; ``pad_decode_rows`` pads eager
    decode steps the same way.
    ``backend`` picks the state ops' implementation (``"auto"``: Triton kernels on CUDA
    tensors, the PyTorch reference elsewhere; ``"triton"`` on a CPU needs
    ``TRITON_INTERPRET=1``). ``checkpoint`` gives the runtime a checkpoint store (LMCache
    RAM or disk, built and checked when the runtime is built): every request looks it up on
    admission and is exported at the end of its prompt and of its response.
    ``fused_commit`` (recovery) commits a step's accepted tokens inside the next step's
    verify (:func:`vllm_recoverssm.ops.verify_fused`) and folds the conv compaction into
    the next conv update's read offset; a request leaving the batch or reaching a request
    boundary is committed on its own first. With prefix caching, a row whose accepted
    tokens reach a block's end, or that starts a new block, commits right after the step
    (the block becomes a cached prefix). It needs a second row of record scratch per
    request (the fused verify reads one and writes the other).
    ``debug_commit_shift`` commits that many tokens more than accepted (recovery only) and
    ``debug_capture_before_commit`` reads the linear state of a response-boundary export
    before the step's commit (recovery with a checkpoint store only): deliberately wrong
    runtimes, used only by the negative-control tests.
    """

    mode: str = RECOVERY
    num_spec: int = 3
    max_running: int = 8
    max_model_len: int = 256
    max_prefill_tokens: int = 64
    block_size: int = 16
    prefix_caching: bool = False
    max_cached_blocks: int = 32
    num_slots: int | None = None
    num_pages: int | None = None
    cuda_graph: bool = False
    pad_decode_rows: bool = False
    backend: str = "auto"
    checkpoint: CheckpointConfig | None = None
    fused_commit: bool = True
    debug_commit_shift: int = 0
    debug_capture_before_commit: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"argument 'mode': expected one of {MODES}, got {self.mode!r}")
        if not 1 <= self.num_spec <= 7:
            raise ValueError(f"argument 'num_spec': expected 1..7, got {self.num_spec}")
        for name in ("max_running", "max_model_len", "max_prefill_tokens", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"argument '{name}': expected a positive int, got {value!r}")
        if self.prefix_caching and self.block_size < self.num_spec + 1:
            raise ValueError(
                f"argument 'block_size': prefix caching (align mode) needs block_size >= S+1 "
                f"= {self.num_spec + 1}, got {self.block_size}"
            )
        if self.max_cached_blocks < 0:
            raise ValueError(
                f"argument 'max_cached_blocks': expected >= 0, got {self.max_cached_blocks}"
            )
        if self.num_slots is not None and self.num_slots < self.slots_per_request:
            raise ValueError(
                f"argument 'num_slots': a request needs {self.slots_per_request} slots in "
                f"{self.mode} mode, got {self.num_slots}"
            )
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"argument 'num_pages': expected >= 2, got {self.num_pages}")
        if not isinstance(self.fused_commit, bool):
            raise ValueError(
                f"argument 'fused_commit': expected a bool, got {type(self.fused_commit).__name__}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"argument 'backend': expected one of {BACKENDS}, got {self.backend!r}"
            )
        if self.debug_commit_shift and self.mode == FULL_STATE:
            raise ValueError(
                "argument 'debug_commit_shift': only recovery mode commits; full-state mode "
                "has nothing to shift"
            )
        if self.checkpoint is not None and not isinstance(self.checkpoint, CheckpointConfig):
            raise ValueError(
                f"argument 'checkpoint': expected a CheckpointConfig or None, got "
                f"{type(self.checkpoint).__name__}"
            )
        if self.debug_capture_before_commit and (
            self.mode == FULL_STATE or self.checkpoint is None
        ):
            raise ValueError(
                "argument 'debug_capture_before_commit': only a recovery-mode runtime with a "
                "checkpoint store exports after a commit"
            )

    @property
    def fused(self) -> bool:
        """Whether steps commit inside the next verify (recovery)."""
        return self.mode == RECOVERY and self.fused_commit

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """Decode row counts the CUDA graphs are captured for: powers of two below
        ``max_running``, then ``max_running`` itself."""
        sizes = []
        n = 1
        while n < self.max_running:
            sizes.append(n)
            n *= 2
        return (*sizes, self.max_running)

    def graph_rows(self, num_rows: int) -> int:
        """The capture size a decode step of ``num_rows`` rows is padded to."""
        if not 1 <= num_rows <= self.max_running:
            raise ValueError(
                f"argument 'num_rows': expected 1..{self.max_running} decode rows, got "
                f"{num_rows}"
            )
        return next(n for n in self.graph_sizes if n >= num_rows)

    @property
    def record_rows(self) -> int:
        """Rows of record scratch: one per running request, two with the fused commit."""
        return self.max_running * (2 if self.fused else 1)

    @property
    def slots_per_request(self) -> int:
        """Slots one running request holds at most in this mode."""
        return slots_per_request(self.mode, self.num_spec, self.prefix_caching)

    @property
    def pages_per_request(self) -> int:
        """KV pages that cover ``max_model_len`` positions (the block-table width)."""
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def cached_blocks(self) -> int:
        """Cache capacity in blocks (0 without prefix caching)."""
        return self.max_cached_blocks if self.prefix_caching else 0

    @property
    def total_slots(self) -> int:
        """Slots in the state pool."""
        if self.num_slots is not None:
            return self.num_slots
        return self.max_running * self.slots_per_request + self.cached_blocks

    @property
    def total_pages(self) -> int:
        """KV pages in each attention layer's cache, the null page included."""
        if self.num_pages is not None:
            return self.num_pages
        return 1 + self.max_running * self.pages_per_request + self.cached_blocks
