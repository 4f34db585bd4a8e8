"""CUDA-graph capture and replay of the decode step's forward pass.

A pure decode step (every row ``S+1`` tokens, padded with null rows to one of the runtime's
capture sizes) has fixed shapes, and with argument validation off none of its operations
reads a device value on the host, so the whole forward pass -- projections, short convs, the
Triton verify kernels, paged attention, MLPs -- is recorded once per capture size and
replayed. Between replays only the contents of the input buffers change (tokens, positions,
KV slots, block tables, state indices, ``num_accepted``, conv offsets, and with the fused
commit the record rows and pending counts). Acceptance, and the commit where it is not fused
into the next verify, run after the replay, outside the graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .step_inputs import AttentionInputs, LinearInputs, StepInputs, from_packed, tensor_fields

if TYPE_CHECKING:
    from .runtime import SpecRuntime


def _clone_inputs(inputs: StepInputs) -> StepInputs:
    if inputs.packed is not None:
        return from_packed(inputs.packed.clone(), inputs.linear.mode,
                           inputs.linear.num_decode_tokens, validate=False,
                           backend=inputs.backend)
    lin = inputs.linear
    attn = inputs.attention

    def c(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    return StepInputs(
        token_ids=inputs.token_ids.clone(),
        attention=AttentionInputs(
            positions=attn.positions.clone(), row_of_token=attn.row_of_token.clone(),
            kv_slots=attn.kv_slots.clone(), block_tables=attn.block_tables.clone(),
        ),
        linear=LinearInputs(
            mode=lin.mode, num_decode_tokens=lin.num_decode_tokens,
            decode_query_start_loc=lin.decode_query_start_loc.clone(),
            decode_state_indices=lin.decode_state_indices.clone(),
            decode_conv_indices=lin.decode_conv_indices.clone(),
            num_accepted=c(lin.num_accepted), conv_offsets=c(lin.conv_offsets),
            prefill_query_start_loc=lin.prefill_query_start_loc.clone(),
            prefill_state_indices=lin.prefill_state_indices.clone(),
            record_indices=c(lin.record_indices), prev_lens=c(lin.prev_lens),
            prev_record_indices=c(lin.prev_record_indices),
        ),
        validate=False,
        backend=inputs.backend,
    )


class DecodeGraph:
    """One captured decode forward pass for a fixed number of rows.

    Construction runs the step eagerly (which also compiles and warms up the kernels)
    and then records it, in the memory pool ``pool`` (a new one if ``None``; the runtime's
    graphs share the first one's :attr:`pool`, since only one replays at a time);
    :meth:`replay` returns the hidden states of later steps.
    """

    def __init__(self, runtime: SpecRuntime, first: StepInputs, pool: Any = None) -> None:
        if runtime.device.type != "cuda":
            raise ValueError(
                f"argument 'runtime': CUDA graphs need a CUDA device, the model is on "
                f"{runtime.device}"
            )
        if first.linear.num_prefill_rows:
            raise ValueError("argument 'first': only pure decode steps can be captured")
        self.runtime = runtime
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.static = _clone_inputs(first)
        self._buffers = tensor_fields(self.static)
        # The first step runs eagerly on a side stream (it also compiles and warms up every
        # kernel); it cannot be run twice, because each step moves the conv windows.
        main = torch.cuda.current_stream(runtime.device)
        side = torch.cuda.Stream(runtime.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self._pending_first: torch.Tensor | None = runtime.model(first, runtime.pools)
        main.wait_stream(side)
        torch.cuda.synchronize(runtime.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.output = runtime.model(self.static, runtime.pools)

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the step ``inputs`` (same shapes as captured)."""
        if self._pending_first is not None:
            # The capturing call already ran this step eagerly: hand back its result.
            out, self._pending_first = self._pending_first, None
            return out
        static = self.static.packed
        if (static is not None and inputs.packed is not None
                and inputs.packed.layout == static.layout):
            # same layout: one device copy per index dtype refills every input buffer
            for dst, packed in zip(static.buffers, inputs.packed.buffers, strict=True):
                dst.copy_(packed)
            self.graph.replay()
            return self.output.clone()
        new = tensor_fields(inputs)
        for name, buf in self._buffers.items():
            src = new.get(name)
            if src is None or src.shape != buf.shape:
                got = None if src is None else list(src.shape)
                raise ValueError(
                    f"argument 'inputs': {name} has shape {got}, the graph was captured with "
                    f"{list(buf.shape)}"
                )
            buf.copy_(src)
        self.graph.replay()
        return self.output.clone()
