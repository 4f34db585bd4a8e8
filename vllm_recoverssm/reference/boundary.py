"""Request-boundary capture and restore: a request's complete state as one checkpoint.

At a request boundary -- the end of the prompt (after the prompt's last prefill chunk, the
first token sampled) and the end of the response (after the last step) -- a runtime with a
checkpoint store exports the request (:mod:`.checkpointing`), then calls its
``on_boundary(runtime, request, boundary)`` hook. Both use :func:`capture_request`, which
returns a :class:`~vllm_recoverssm.checkpoint.RequestCheckpoint`:

* for every KDA layer ``layer.{i}``: ``state`` ``[H, V, K]`` (FP32) and ``conv``
  ``[3*H*D, Kc-1]`` (the conv history at zero speculative offset);
* for every attention layer ``layer.{i}``: ``keys`` and ``values`` ``[n, heads, dim]`` of the
  ``n`` computed tokens;
* ``draft``: ``hidden`` (the last computed token's hidden state, what the MTP drafter
  continues from); ``logits``: that token's logits, so an exact prompt hit needs no compute.

The order of operations differs by mode. Recovery: the step has already committed the
accepted records and compacted the conv history before the boundary (commit -> compact ->
capture), so the checkpoint slot is read as it is. Full state: the capture reads the state
at column ``num_accepted - 1`` and the conv history at offset ``num_accepted - 1``, and only
then compacts the request (state to column 0, history to offset 0). Either way the captured
state has zero speculative offset, and :func:`restore_request` resumes with
``num_accepted = 1`` in either mode. The recovery order is not a convention: a capture taken
before the commit would label the state after the previous step with the tokens after this
one (``RuntimeConfig.debug_capture_before_commit`` builds that wrong runtime, and a test
shows its bundles restore a wrong state).

A request that carried images is captured with ``has_images`` set, and the checkpoint store
refuses to export it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import torch

from vllm_recoverssm.checkpoint import LayoutIdentity, RequestCheckpoint

from .request import Request
from .runtime_view import RuntimeView
from .step_inputs import FULL_STATE

DRAFT_LAYER = "draft"


def layer_name(index: int) -> str:
    """Checkpoint name of model layer ``index``."""
    return f"layer.{index}"


LAYOUT_NAME = "reference-runtime"
LAYOUT_VERSION = 1


def layout_identity(runtime: RuntimeView) -> LayoutIdentity:
    """The checkpoint layout identity of ``runtime``: which bundles it may restore.

    The revision is a digest of the model config (sizes, dtype and weight seed), so a
    bundle is never restored into a model with other weights or shapes.
    """
    mc = runtime.model.config
    config_json = json.dumps(mc.to_dict(), sort_keys=True)
    act = mc.dtype
    return LayoutIdentity(
        model="recoverssm-reference",
        revision=hashlib.sha256(config_json.encode()).hexdigest()[:16],
        dtypes={"state": "float32", "conv": act, "kv": act, "hidden": act,
                "logits": "float32"},
        layout=LAYOUT_NAME,
        layout_version=LAYOUT_VERSION,
        tp_rank=0,
        tp_size=1,
        num_speculative_tokens=runtime.num_spec,
        mode=runtime.mode,  # type: ignore[arg-type]
    )


def _kv_index(req: Request, num_tokens: int, block_size: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(num_tokens)
    pages = torch.tensor(req.pages, dtype=torch.int64)[pos // block_size]
    return (pages * block_size + pos % block_size).to(device)


def capture_linear(runtime: RuntimeView, req: Request) -> dict[str, dict[str, torch.Tensor]]:
    """Copies of every KDA layer's ``state`` and ``conv`` history as the pools hold them now.

    Recovery reads the checkpoint slot (history at offset 0); full state reads column
    ``num_accepted - 1`` and the history at that offset. Only right after the step's commit
    and compaction (recovery) do these describe the request's computed tokens.
    """
    pools = runtime.pools
    hist = runtime.model.config.conv_kernel - 1
    if runtime.mode == FULL_STATE:
        state_slot = req.run_slots[req.num_accepted - 1]
        conv_slot, offset = req.run_slots[0], req.num_accepted - 1
    else:
        state_slot = conv_slot = runtime.running_state_slot(req)
        offset = 0
    return {
        layer_name(i): {
            "state": p.state[state_slot].clone(),
            "conv": p.conv[conv_slot, :, offset:offset + hist].clone(),
        }
        for i, p in pools.kda.items()
    }


def capture_request(
    runtime: RuntimeView,
    req: Request,
    boundary: str,
    *,
    linear: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> RequestCheckpoint:
    """The request's complete state after its computed tokens, at zero speculative offset.

    The runtime calls it at both request boundaries when it has a checkpoint store; an
    ``on_boundary`` hook may call it too (``boundary`` is ``"prompt"`` or ``"response"``).
    Full-state mode compacts the request after reading it (see the module docstring for
    the order). ``linear`` replaces the KDA tensors read now by ones read earlier with
    :func:`capture_linear`; only the negative-control runtime passes it.
    """
    if req.last_logits is None or req.last_hidden is None:
        raise ValueError(f"argument 'req': request {req.rid} has computed no token yet")
    pools = runtime.pools
    n = req.num_computed
    if linear is None:
        linear = capture_linear(runtime, req)
    layers = {name: dict(tensors) for name, tensors in linear.items()}
    kv_index = _kv_index(req, n, runtime.block_size, runtime.device)
    for i, a in pools.attention.items():
        heads, dim = a.keys.shape[2:]
        layers[layer_name(i)] = {
            "keys": a.keys.view(-1, heads, dim)[kv_index].clone(),
            "values": a.values.view(-1, heads, dim)[kv_index].clone(),
        }
    layers[DRAFT_LAYER] = {"hidden": req.last_hidden.clone()}
    checkpoint = RequestCheckpoint(
        tokens=tuple(req.tokens[:n]),
        layers=layers,
        logits=req.last_logits.clone(),
        boundary=boundary,  # type: ignore[arg-type]
        has_images=req.has_images,
        meta={"num_accepted": 1, "mode": runtime.mode},
    )
    runtime.compact_full_state(req)
    return checkpoint


def check_restorable(runtime: RuntimeView, req: Request, checkpoint: RequestCheckpoint) -> None:
    """``ValueError`` unless ``checkpoint`` is a prefix state of ``req`` for this model."""
    n = checkpoint.num_tokens
    if list(checkpoint.tokens) != req.prompt[:n]:
        raise ValueError(
            f"argument 'restore': the checkpoint's {n} tokens are not a prefix of the "
            f"{len(req.prompt)}-token prompt"
        )
    mc = runtime.model.config
    expected = {layer_name(i) for i in range(mc.num_layers)} | {DRAFT_LAYER}
    if set(checkpoint.layers) != expected:
        raise ValueError(
            f"argument 'restore': expected layers {sorted(expected)}, got "
            f"{sorted(checkpoint.layers)}"
        )
    H, D, C = mc.num_kda_heads, mc.kda_head_dim, mc.conv_channels
    Ha, Da = mc.num_attn_heads, mc.attn_head_dim
    pools = runtime.pools
    state_dt, conv_dt = pools.states[0].dtype, pools.convs[0].dtype
    kv_dt = next(iter(pools.attention.values())).keys.dtype if pools.attention else conv_dt
    specs: dict[tuple[str, str], tuple[tuple[int, ...], torch.dtype]] = {
        (DRAFT_LAYER, "hidden"): ((mc.hidden_size,), mc.torch_dtype),
    }
    for i in mc.kda_layers:
        specs[(layer_name(i), "state")] = ((H, D, D), state_dt)
        specs[(layer_name(i), "conv")] = ((C, mc.conv_kernel - 1), conv_dt)
    for i in mc.attention_layers:
        specs[(layer_name(i), "keys")] = ((n, Ha, Da), kv_dt)
        specs[(layer_name(i), "values")] = ((n, Ha, Da), kv_dt)
    for (lname, tname), (shape, dtype) in specs.items():
        tensor = checkpoint.layers[lname].get(tname)
        if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            got = None if tensor is None else f"{list(tensor.shape)} {tensor.dtype}"
            raise ValueError(
                f"argument 'restore': layer {lname!r} tensor {tname!r} expected shape "
                f"{list(shape)} {dtype}, got {got}"
            )
    if tuple(checkpoint.logits.shape) != (mc.vocab_size,) or (
        checkpoint.logits.dtype != torch.float32
    ):
        raise ValueError(
            f"argument 'restore': expected float32 logits of shape [{mc.vocab_size}], got "
            f"{list(checkpoint.logits.shape)} {checkpoint.logits.dtype}"
        )


def restore_request(runtime: RuntimeView, req: Request, checkpoint: RequestCheckpoint) -> None:
    """Write ``checkpoint`` into a just-admitted request's slot and KV pages.

    The runtime calls this on admission of a request queued with ``restore=`` or found in
    its checkpoint store: the request continues at token ``checkpoint.num_tokens`` with
    ``num_accepted = 1``, and the restored tokens count as an external hit (never as a hit
    of the runtime's own prefix cache). When the checkpoint covers the whole prompt, its
    logits give the first token and the request goes straight to decoding.
    """
    n = checkpoint.num_tokens
    dev = runtime.device
    slot = runtime.running_state_slot(req)
    for i, p in runtime.pools.kda.items():
        tensors = checkpoint.layers[layer_name(i)]
        p.state[slot].copy_(tensors["state"].to(dev))
        p.conv[slot].zero_()
        p.conv[slot, :, : runtime.model.config.conv_kernel - 1].copy_(tensors["conv"].to(dev))
    kv_index = _kv_index(req, n, runtime.block_size, dev)
    for i, a in runtime.pools.attention.items():
        tensors = checkpoint.layers[layer_name(i)]
        heads, dim = a.keys.shape[2:]
        a.keys.view(-1, heads, dim).index_copy_(0, kv_index, tensors["keys"].to(dev, a.keys.dtype))
        a.values.view(-1, heads, dim).index_copy_(
            0, kv_index, tensors["values"].to(dev, a.values.dtype)
        )
    req.num_computed = n
    req.num_accepted = 1
    req.restored_tokens = n
    runtime.stats.external_hits += 1
    req.last_hidden = checkpoint.layers[DRAFT_LAYER]["hidden"].to(dev)
    req.last_logits = checkpoint.logits.to(dev)
    runtime.stats.restored_tokens += n
    if n == len(req.prompt):
        req.tokens.append(int(req.last_logits.argmax()))
        runtime.stats.generated_tokens += 1
