"""The counters of one reference runtime's life."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RuntimeStats:
    """Counters of one runtime's life."""

    steps: int = 0
    decode_steps: int = 0
    graph_steps: int = 0
    graph_captures: int = 0
    """CUDA graphs captured: one per decode row count (capture size) the run reached."""
    mixed_steps: int = 0
    generated_tokens: int = 0
    proposed_drafts: int = 0
    accepted_drafts: int = 0
    accept_histogram: list[int] = field(default_factory=list)
    max_concurrent: int = 0
    peak_slots_per_request: int = 0
    wait_events: int = 0
    external_hits: int = 0
    restored_tokens: int = 0
    checkpoints_exported: int = 0
    checkpoint_rejected: int = 0
    checkpoint_seconds: float = 0.0
    prefill_tokens: int = 0
    boundaries_mid_step: int = 0
    deferred_rows: int = 0
    """Fused commit: decode rows whose records waited for the next verify."""
    seconds: float = 0.0
    decode_only_seconds: float = 0.0
    """Wall time of the steps that ran verify rows and no prompt rows, less the one that
    captured the CUDA graph."""
    decode_only_tokens: int = 0
    """Tokens those steps generated."""

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (0 when nothing was proposed)."""
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of :meth:`SpecRuntime.run` wall time."""
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of the steps without prompt rows: the work the two state
        modes differ in (prompt chunks run the same prefill in both)."""
        if not self.decode_only_seconds:
            return 0.0
        return self.decode_only_tokens / self.decode_only_seconds
