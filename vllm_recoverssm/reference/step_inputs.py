"""What one forward step of the reference model reads besides the weights.

A step is a flat, variable-length batch of tokens: the speculative decode rows first (each
exactly ``S+1`` tokens: the last sampled token and ``S`` drafts), then the prefill rows (a
chunk of a prompt, or one token of a non-speculative request). Attention layers read
:class:`AttentionInputs`; KDA layers read :class:`LinearInputs`, which says for each row
kind which state slots and conv windows the ops use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ..config.state_mode import STATE_MODES, StateMode

RECOVERY = StateMode.RECOVERY
FULL_STATE = StateMode.FULL_STATE
MODES = STATE_MODES


@dataclass
class AttentionInputs:
    """Paged-KV addressing for every token of the step.

    ``kv_slots[t]`` is the flat cache position (``page * block_size + offset``) where token
    ``t`` writes its key and value; ``block_tables[r]`` lists row ``r``'s KV pages (padded
    with the null page); token ``t`` attends to positions ``0..positions[t]`` of row
    ``row_of_token[t]``.
    """

    positions: torch.Tensor
    row_of_token: torch.Tensor
    kv_slots: torch.Tensor
    block_tables: torch.Tensor


@dataclass
class LinearInputs:
    """State addressing of the KDA layers for one step.

    Decode rows (the first ``num_decode_tokens`` tokens, ``S+1`` per row):

    * recovery: ``decode_state_indices`` ``[Nd]`` is each row's checkpoint slot (read only;
      records go to the scratch row of the same index), ``decode_conv_indices`` the slot
      whose conv window the step writes;
    * full state: ``decode_state_indices`` ``[Nd, S+1]`` are the row's state columns, the
      step starts from column ``num_accepted - 1`` and writes column ``t`` after token
      ``t``; the conv history is read at ``conv_offsets`` of ``decode_conv_indices``.

    Prefill rows continue from ``prefill_state_indices`` (state and conv history at offset
    0) and write their final state back there.

    Recovery with the fused commit also sets, per decode row: ``record_indices`` (the
    scratch row this step's records go to), ``prev_lens`` / ``prev_record_indices`` (the
    previous step's accepted tokens the verify commits first, and their row), and
    ``conv_offsets`` (the history sits at ``prev_lens - 1``, not yet compacted).
    """

    mode: str
    num_decode_tokens: int
    decode_query_start_loc: torch.Tensor
    decode_state_indices: torch.Tensor
    decode_conv_indices: torch.Tensor
    num_accepted: torch.Tensor | None
    conv_offsets: torch.Tensor | None
    prefill_query_start_loc: torch.Tensor
    prefill_state_indices: torch.Tensor
    record_indices: torch.Tensor | None = None
    prev_lens: torch.Tensor | None = None
    prev_record_indices: torch.Tensor | None = None

    @property
    def fused(self) -> bool:
        """Whether the decode rows verify with the fused commit."""
        return self.prev_lens is not None

    @property
    def num_decode_rows(self) -> int:
        """Speculative decode rows in the step."""
        return int(self.decode_query_start_loc.shape[0]) - 1

    @property
    def num_prefill_rows(self) -> int:
        """Prefill rows in the step."""
        return int(self.prefill_query_start_loc.shape[0]) - 1


Slice = tuple[str, int, int, tuple[int, ...]]
"""Where one named index tensor lies: ``(name, buffer, offset, shape)``."""


@dataclass(frozen=True)
class PackedIndices:
    """A step's index tensors as views of one device buffer per dtype.

    The host builds every index vector of a step; packing them makes one host-to-device
    copy per dtype instead of one per tensor, and lets a CUDA graph refill its static
    inputs with one device copy per dtype. Names are ``token_ids``,
    ``attention.<field>`` and ``linear.<field>``.
    """

    buffers: tuple[torch.Tensor, ...]
    layout: tuple[Slice, ...]

    def views(self) -> dict[str, torch.Tensor]:
        """Each named tensor, as a view of its buffer."""
        out = {}
        for name, buf, offset, shape in self.layout:
            size = math.prod(shape)
            out[name] = self.buffers[buf][offset:offset + size].view(shape)
        return out

    def clone(self) -> PackedIndices:
        """The same layout in new buffers (a CUDA graph's static inputs)."""
        return PackedIndices(tuple(b.clone() for b in self.buffers), self.layout)


@dataclass
class StepInputs:
    """Everything one forward step reads: token ids plus attention and KDA addressing.

    ``validate`` asks the ops to check their arguments (reads device values, so a CUDA-graph
    capture passes ``False`` after an eager step validated the same buffers); ``backend``
    is the ops' backend (``"auto"``: Triton on CUDA tensors, the reference elsewhere).
    ``packed``, when set, holds the buffers every index tensor is a view of.
    """

    token_ids: torch.Tensor
    attention: AttentionInputs
    linear: LinearInputs
    validate: bool = True
    backend: str = "auto"
    packed: PackedIndices | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens in the step."""
        return int(self.token_ids.shape[0])


def from_packed(
    packed: PackedIndices, mode: str, num_decode_tokens: int, *, validate: bool, backend: str
) -> StepInputs:
    """The step whose tensors are the views of ``packed``."""
    v = packed.views()
    attention = {f.name: v[f"attention.{f.name}"] for f in fields(AttentionInputs)}
    # the optional tensors (None in the other mode) are simply absent from the layout
    linear = {f.name: v.get(f"linear.{f.name}") for f in fields(LinearInputs)
              if f.name not in ("mode", "num_decode_tokens")}
    return StepInputs(
        token_ids=v["token_ids"], attention=AttentionInputs(**attention),
        linear=LinearInputs(mode=mode, num_decode_tokens=num_decode_tokens,
                            **linear),  # type: ignore[arg-type]
        validate=validate, backend=backend, packed=packed,
    )
