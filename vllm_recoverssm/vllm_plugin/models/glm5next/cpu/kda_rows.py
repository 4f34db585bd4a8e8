"""GLM-5.3 KDA rows computed with the project's ops, from vLLM's GDN metadata.

vLLM's GDN metadata splits a step's requests into speculative rows (a verify window of
up to ``S+1`` tokens) and the rest (prompt chunks, and plain one-token decodes when no
speculation is configured). Each function here runs one kind of row for one layer and
returns the core-attention outputs ``[T, h, D]`` of its tokens; the layer scatters them
into its output. Where vLLM has its own KDA kernels (CUDA) only the recovery verify runs
here; on a platform without them (vLLM's CPU platform) every kind does, so GLM-5.3 can be
served there in both modes.

* :func:`prompt_rows` -- short conv + sequential KDA from each request's slot; rows with
  no prior state (a request's first chunk) start from zeros, as vLLM's kernels do.
* :func:`full_state_rows` -- vLLM's full-state speculative layout: ``S+1`` state columns
  per row, reading column ``num_accepted - 1`` and the conv history at that offset
  (:func:`vllm_recoverssm.ops.verify_full`, :func:`vllm_recoverssm.ops.conv_update`).
* :func:`recovery_rows` -- the checkpoint column only: conv at offset 0 and recovery
  verify, writing the update records into the layer's scratch rows (one per speculative
  row of the step, :func:`vllm_recoverssm.ops.verify_recovery`); under the fused commit,
  the previous step's pending records are replayed first, in the same launch
  (:func:`vllm_recoverssm.ops.verify_fused`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..... import ops
from ....distributed.kv_connector import taps as state_taps
from ....worker.state_layout import dim_first_conv, to_ops_slots


def _split_heads(layer: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h, d = layer.local_num_heads, layer.head_dim
    return tuple(t.reshape(-1, h, d).contiguous()
                 for t in x.split(layer.local_projection_size, dim=-1))


def _gate_inputs(layer: Any, raw_g: torch.Tensor, raw_beta: torch.Tensor) -> tuple[
    torch.Tensor, torch.Tensor
]:
    h, d = layer.local_num_heads, layer.head_dim
    return raw_g[0].reshape(-1, h, d).contiguous(), raw_beta[0].reshape(-1, h).contiguous()


def _gate_params(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    h, d = layer.local_num_heads, layer.head_dim
    return layer.A_log.reshape(h), layer.dt_bias.reshape(h, d)


def prompt_rows(layer: Any, meta: Any, qkv: torch.Tensor, raw_g: torch.Tensor,
                raw_beta: torch.Tensor) -> torch.Tensor:
    """The non-speculative rows of ``meta`` (prompt chunks, plain decodes).

    ``qkv`` ``[T, 3*h*D]`` holds exactly those rows' tokens in order (before the short
    conv), ``raw_g`` ``[1, T, h, D]`` and ``raw_beta`` ``[1, T, h]`` their raw gates. The
    final state and conv history of each row are written back to its slot. Rows with
    request-boundary state taps installed (:mod:`...distributed.kv_connector.taps`) also
    hand over their state at each tapped position.
    """
    qsl = meta.non_spec_query_start_loc
    rows = int(qsl.numel()) - 1
    qsl = qsl.to(torch.int32)
    slots = to_ops_slots(meta.non_spec_state_indices_tensor[:rows]).contiguous()
    conv_state, state = layer.kv_cache[0], layer.kv_cache[1]
    if meta.has_initial_state is not None:
        fresh = slots[(~meta.has_initial_state[:rows].bool()) & (slots >= 0)].long()
        if fresh.numel():
            # A request's first chunk must not see what the slot's previous owner left.
            state[fresh] = 0
            conv_state[fresh] = 0
    tapped = _usable_taps(layer, slots, qsl)
    history: dict[int, torch.Tensor] = {}
    with dim_first_conv(layer.conv_state_dim_first_view(conv_state), slots) as (conv, idx):
        hist_len = layer.merged_conv_weight().shape[1] - 1
        for row in tapped:
            history[row] = conv[int(idx[row]), :, :hist_len].clone()
        x = ops.conv_prefill(qkv.contiguous(), conv, layer.merged_conv_weight(),
                             layer.q_conv1d.bias, idx, qsl, activation="silu",
                             validate=False)
    q, k, v = _split_heads(layer, x)
    g, beta = _gate_inputs(layer, raw_g, raw_beta)
    a_log, dt_bias = _gate_params(layer)
    if not tapped:
        return ops.prefill(q, k, v, g, beta, a_log, dt_bias, state, slots, qsl,
                           layer.kda_lower_bound, out_dtype=qkv.dtype, validate=False)
    untapped = slots.clone()
    untapped[list(tapped)] = -1  # null rows: computed below, segment by segment
    out = ops.prefill(q, k, v, g, beta, a_log, dt_bias, state, untapped, qsl,
                      layer.kda_lower_bound, out_dtype=qkv.dtype, validate=False)
    bounds = qsl.tolist()
    for row, row_taps in tapped.items():
        start, end = bounds[row], bounds[row + 1]
        slot = int(slots[row])
        # The conv history after ``o`` row tokens is the window ending there.
        seq = torch.cat([history[row], qkv[start:end].t().to(history[row].dtype)], dim=1)
        done = 0
        for offset, key in sorted(zip(row_taps.offsets, row_taps.keys, strict=True)):
            if offset > done:
                _prefill_segment(layer, out, q, k, v, g, beta, a_log, dt_bias, state, slot,
                                 start + done, start + offset, qkv.dtype)
                done = offset
            state_taps.deliver(key, layer.prefix, seq[:, offset:offset + hist_len].clone(),
                               state[slot].clone())
        if done < end - start:
            _prefill_segment(layer, out, q, k, v, g, beta, a_log, dt_bias, state, slot,
                             start + done, end, qkv.dtype)
    return out


def _usable_taps(layer: Any, slots: torch.Tensor, qsl: torch.Tensor) -> dict[int, Any]:
    """Tapped rows whose length is the one the taps were planned for."""
    if not state_taps.active():
        return {}
    found = state_taps.row_taps(layer.prefix, slots.tolist())
    if not found:
        return {}
    bounds = qsl.tolist()
    return {row: taps for row, taps in found.items()
            if bounds[row + 1] - bounds[row] == taps.row_len}


def _prefill_segment(layer: Any, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, a_log: torch.Tensor,
                     dt_bias: torch.Tensor, state: torch.Tensor, slot: int, start: int, end: int,
                     out_dtype: torch.dtype) -> None:
    """Tokens ``start:end`` of one row, continuing from its slot (the same sequential
    arithmetic as one call over the whole row)."""
    piece = slice(start, end)
    one = torch.tensor([slot], dtype=torch.int32, device=state.device)
    qsl = torch.tensor([0, end - start], dtype=torch.int32, device=state.device)
    out[piece] = ops.prefill(q[piece], k[piece], v[piece], g[piece], beta[piece], a_log,
                             dt_bias, state, one, qsl, layer.kda_lower_bound,
                             out_dtype=out_dtype, validate=False)


def full_state_rows(layer: Any, meta: Any, qkv: torch.Tensor, raw_g: torch.Tensor,
                    raw_beta: torch.Tensor) -> torch.Tensor:
    """The speculative rows of ``meta`` in vLLM's full-state layout (recovery off)."""
    n = meta.num_spec_decodes
    columns = to_ops_slots(meta.spec_state_indices_tensor[:n]).contiguous()
    accepted = meta.num_accepted_tokens[:n].to(torch.int32).contiguous()
    qsl = meta.spec_query_start_loc[: n + 1].to(torch.int32).contiguous()
    conv_view = layer.conv_state_dim_first_view(layer.kv_cache[0])
    with dim_first_conv(conv_view, columns[:, 0].contiguous()) as (conv, idx):
        x = ops.conv_update(qkv.contiguous(), conv, layer.merged_conv_weight(),
                            layer.q_conv1d.bias, idx, qsl,
                            conv_offsets=(accepted - 1).contiguous(), activation="silu",
                            backend=layer.ops_backend)
    q, k, v = _split_heads(layer, x)
    g, beta = _gate_inputs(layer, raw_g, raw_beta)
    a_log, dt_bias = _gate_params(layer)
    return ops.verify_full(q, k, v, g, beta, a_log, dt_bias, layer.kv_cache[1], columns,
                           accepted, qsl, lower_bound=layer.kda_lower_bound,
                           backend=layer.ops_backend)


def recovery_rows(layer: Any, meta: Any, qkv: torch.Tensor, raw_g: torch.Tensor,
                  raw_beta: torch.Tensor) -> torch.Tensor:
    """Conv update at offset 0 and recovery verify of the speculative rows of ``meta``.

    The checkpoint is read, never written; speculative row ``i``'s records go to scratch
    row ``meta.record_rows()[i]``, where the commit after sampling reads them. Under the
    fused commit (``meta.prev_lens`` set) each row first replays its pending records into
    the checkpoint and writes it back, in the same launch.
    """
    conv_state, state = layer.kv_cache[0], layer.kv_cache[1]
    corrections, kg = layer.recovery_records()
    # The checks that read device values would sync the host every layer and step;
    # vLLM's metadata is trusted on the GPU, checked everywhere else.
    check = not qkv.is_cuda
    n = meta.num_spec_decodes
    slots = meta.spec_slots().contiguous()
    rows = meta.record_rows()
    qsl = meta.spec_query_start_loc[: n + 1].to(torch.int32).contiguous()
    prev_lens = meta.prev_lens
    # Under the fused commit the conv history of a row with pending records still sits
    # at offset ``pending - 1`` (not compacted), as in vLLM's full-state layout.
    offsets = None if prev_lens is None else (prev_lens - 1).clamp(min=0).contiguous()
    with dim_first_conv(layer.conv_state_dim_first_view(conv_state), slots) as (conv, idx):
        x = ops.conv_update(qkv.contiguous(), conv, layer.merged_conv_weight(),
                            layer.q_conv1d.bias, idx, qsl, conv_offsets=offsets,
                            activation="silu", backend=layer.ops_backend, validate=check)
    q, k, v = _split_heads(layer, x)
    g, beta = _gate_inputs(layer, raw_g, raw_beta)
    if prev_lens is not None:
        a_log, dt_bias = _gate_params(layer)
        return ops.verify_fused(
            q, k, v, g, beta, a_log, dt_bias, state, slots, qsl, corrections, kg,
            prev_lens, lower_bound=layer.kda_lower_bound, record_indices=rows,
            prev_record_indices=meta.prev_record_rows, backend=layer.ops_backend,
            validate=check,
        )
    a_log, dt_bias = _gate_params(layer)
    return ops.verify_recovery(
        q, k, v, g, beta, a_log, dt_bias, state, slots, qsl, corrections, kg,
        lower_bound=layer.kda_lower_bound, record_indices=rows, backend=layer.ops_backend,
        validate=check,
    )
