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

from typing import Any

import torch

from .model import HybridModel
from .pools import ModelPools
from .step_inputs import Slice, StepInputs, from_packed

_WARM_UP_STREAMS: dict[int, torch.cuda.Stream] = {}


def _warm_up_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream on which every graph's eager first step runs, per device.

    torch keeps a cuBLAS workspace (32 MiB on Hopper) for every stream that ever ran a
    matmul, for the life of the process; a new stream per capture added one workspace per
    capture size to each runtime's footprint, and kept it after the runtime was gone.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _WARM_UP_STREAMS:
        _WARM_UP_STREAMS[index] = torch.cuda.Stream(index)
    return _WARM_UP_STREAMS[index]


class DecodeGraph:
    """One captured decode forward pass for a fixed number of rows.

    Construction runs ``model`` on ``first`` over ``pools`` eagerly (which also compiles
    and warms up the kernels) and then records it, in the memory pool ``pool`` (a new one
    if ``None``; the runtime's graphs share the first one's :attr:`pool`, since only one
    replays at a time); :meth:`replay` returns the hidden states of later steps.
    """

    def __init__(self, model: HybridModel, pools: ModelPools, first: StepInputs,
                 pool: Any = None) -> None:
        device = model.device
        if device.type != "cuda":
            raise ValueError(
                f"argument 'model': CUDA graphs need a CUDA device, the model is on {device}"
            )
        if first.linear.num_prefill_rows:
            raise ValueError("argument 'first': only pure decode steps can be captured")
        if first.packed is None:
            raise ValueError("argument 'first': a graph refills its inputs from packed "
                             "buffers; build the step with build_step_inputs")
        # No reference to the model or pools is kept: the runtime holds its graphs, and a
        # cycle would keep its state pools and the graphs' memory alive until a garbage
        # collection.
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self._static = first.packed.clone()
        self.static = from_packed(self._static, first.linear.mode,
                                  first.linear.num_decode_tokens, validate=False,
                                  backend=first.backend)
        # The first step runs eagerly on a side stream (it also compiles and warms up every
        # kernel); it cannot be run twice, because each step moves the conv windows.
        main = torch.cuda.current_stream(device)
        side = _warm_up_stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self._pending_first: torch.Tensor | None = model(first, pools)
        main.wait_stream(side)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.output = model(self.static, pools)

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the step ``inputs`` (same shapes as captured)."""
        if self._pending_first is not None:
            # The capturing call already ran this step eagerly: hand back its result.
            out, self._pending_first = self._pending_first, None
            return out
        if inputs.packed is None or inputs.packed.layout != self._static.layout:
            got = None if inputs.packed is None else _describe(inputs.packed.layout)
            raise ValueError(
                f"argument 'inputs': index tensors {got}, the graph was captured with "
                f"{_describe(self._static.layout)}"
            )
        # one device copy per index dtype refills every input buffer
        for dst, src in zip(self._static.buffers, inputs.packed.buffers, strict=True):
            dst.copy_(src)
        self.graph.replay()
        return self.output.clone()


def _describe(layout: tuple[Slice, ...]) -> str:
    return ", ".join(f"{name} {list(shape)}" for name, _, _, shape in layout)
