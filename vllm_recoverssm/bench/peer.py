"""The public peer: fla-core's full-state speculative KDA kernel, used when installed.

fla-core's public ``fused_recurrent_kda`` drops the speculative arguments, so the peer is
its ``fused_recurrent_kda_fwd`` with ``inplace_final_state=True`` and a ``[N, S+1]`` state
index table: it starts from column ``num_accepted - 1`` and writes one full state per
token, the same contract as :func:`vllm_recoverssm.ops.verify_full`. Normalisation of q
and k, the bounded gate and the beta sigmoid are computed inside the kernel from the same
raw inputs our kernels take; the state pool is V-first ``[slots, H, V, K]`` like ours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FlaFwd = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Peer:
    """fla-core's entry point, or why it is not available."""

    fwd: FlaFwd | None
    version: str | None
    reason: str

    @property
    def available(self) -> bool:
        """True when the peer can be timed."""
        return self.fwd is not None


def load_peer(device: torch.device, wanted: bool) -> Peer:
    """Import fla-core's kernel when asked for and usable on ``device``."""
    if not wanted:
        return Peer(None, None, "disabled (--no-peer)")
    if device.type != "cuda":
        return Peer(None, None, "needs a CUDA device")
    try:
        import fla  # type: ignore[import-not-found]
        from fla.ops.kda.fused_recurrent import (  # type: ignore[import-not-found]
            fused_recurrent_kda_fwd,
        )
    except Exception as exc:  # noqa: BLE001 - any import failure means "no peer column"
        return Peer(None, None, f"fla-core not importable ({type(exc).__name__}: {exc})")
    return Peer(fused_recurrent_kda_fwd, str(getattr(fla, "__version__", "?")), "fla-core")


def fla_full_verify(
    fwd: FlaFwd,
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
    raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, num_accepted: torch.Tensor,
    query_start_loc: torch.Tensor, lower_bound: float,
) -> torch.Tensor:
    """One layer's full-state verify through fla-core, on our flat varlen layout.

    Our tokens are ``[T, H, *]``; fla takes a batch of one sequence-packed row
    ``[1, T, H, *]`` with ``cu_seqlens``, which is a view of the same memory.
    """
    out, _ = fwd(
        q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=raw_g.unsqueeze(0),
        beta=raw_beta.unsqueeze(0), A_log=A_log, dt_bias=dt_bias,
        initial_state=state, scale=q.shape[-1] ** -0.5,
        inplace_final_state=True, state_v_first=True,
        cu_seqlens=query_start_loc, ssm_state_indices=state_indices,
        num_accepted_tokens=num_accepted,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound,
    )
    return out.squeeze(0)
