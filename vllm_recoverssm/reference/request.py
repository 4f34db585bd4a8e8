"""One request's bookkeeping in the reference runtime (tokens, slots, pages, drafts)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    """A prompt being served.

    ``tokens`` is the prompt followed by the generated tokens; ``num_computed`` counts the
    tokens whose effect is committed into the linear state and the KV cache. In the decode
    phase exactly one token (the last sampled one) is not yet computed.

    Linear state, by mode:

    * recovery: ``run_slots`` = [checkpoint slot];
    * recovery + prefix caching (align): ``columns[j]`` is the slot of state block ``j``
      (the state after token ``(j+1)*B`` once complete; the running state sits in column
      ``(num_computed-1)//B``), at most two held at a time;
    * full state: ``run_slots`` = the ``S+1`` state columns; the latest state is column
      ``num_accepted - 1``, and the conv history sits at offset ``num_accepted - 1`` of
      column 0's window; with prefix caching ``boundary_slot`` receives block states.

    With the fused commit (recovery's default) the accepted tokens of a step
    are committed inside the next step's verify: ``pending`` of them wait in record row
    ``pending_row`` of the scratch, and the conv history sits at offset ``pending - 1``.

    ``restored_tokens`` prompt tokens came from a checkpoint (an external hit) and
    ``prefix_hit_tokens`` from the runtime's own prefix cache; ``has_images`` keeps the
    request out of the checkpoint store.
    """

    rid: int
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_accepted: int = 1
    pending: int = 0
    pending_row: int = -1
    run_slots: list[int] = field(default_factory=list)
    columns: dict[int, int] = field(default_factory=dict)
    boundary_slot: int = -1
    boundary_serial: int = 0
    slot_owners: list[Hashable] = field(default_factory=list)
    slots_reserved: int = 0
    pages: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    last_hidden: torch.Tensor | None = None
    last_logits: torch.Tensor | None = None
    accept_lengths: list[int] = field(default_factory=list)
    prefix_hit_tokens: int = 0
    restored_tokens: int = 0
    has_images: bool = False
    finished: bool = False

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def generated(self) -> list[int]:
        """Tokens produced after the prompt."""
        return self.tokens[len(self.prompt):]

    @property
    def in_prefill(self) -> bool:
        """Whether prompt tokens are still to be computed."""
        return self.num_computed < len(self.prompt)

    @property
    def remaining(self) -> int:
        """Tokens still to generate."""
        return self.max_new_tokens - len(self.generated)

    @property
    def done(self) -> bool:
        """Whether the response is complete."""
        return self.remaining <= 0
