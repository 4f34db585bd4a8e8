"""Random inputs for the KDA op tests (state ~ N(0, 0.1^2), activations ~ N(0, 1))."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SpecBatch:
    """One speculative step's inputs for N requests with H heads."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    raw_g: torch.Tensor
    raw_beta: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    query_start_loc: torch.Tensor
    query_lens: list[int]

    def tokens(self) -> tuple[torch.Tensor, ...]:
        """The token tensors in argument order (q, k, v, raw_g, raw_beta, A_log, dt_bias)."""
        return (self.q, self.k, self.v, self.raw_g, self.raw_beta, self.A_log, self.dt_bias)

    def to(self, dtype: torch.dtype) -> SpecBatch:
        """Same batch with activations cast to ``dtype`` (gate parameters stay float)."""
        return SpecBatch(
            self.q.to(dtype), self.k.to(dtype), self.v.to(dtype), self.raw_g.to(dtype),
            self.raw_beta.to(dtype), self.A_log, self.dt_bias, self.query_start_loc,
            self.query_lens,
        )


def make_batch(
    query_lens: list[int], H: int, K: int, V: int, *, device: str = "cpu",
    act_dtype: torch.dtype = torch.float32, seed: int = 0, gate_shift: float = 0.0,
) -> SpecBatch:
    """Random step inputs; ``gate_shift`` moves raw_g (very negative = weak decay)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(query_lens)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()),
                       dtype=torch.int32)
    b = SpecBatch(
        q=rnd(T, H, K), k=rnd(T, H, K), v=rnd(T, H, V), raw_g=rnd(T, H, K) + gate_shift,
        raw_beta=rnd(T, H), A_log=rnd(H) * 0.5, dt_bias=rnd(H, K) * 0.5,
        query_start_loc=qsl, query_lens=list(query_lens),
    )
    b = SpecBatch(*(t.to(device) if isinstance(t, torch.Tensor) else t
                    for t in (b.q, b.k, b.v, b.raw_g, b.raw_beta, b.A_log, b.dt_bias,
                              b.query_start_loc)), query_lens=b.query_lens)
    return b.to(act_dtype)


def make_state(slots: int, H: int, V: int, K: int, *, device: str = "cpu",
               seed: int = 1) -> torch.Tensor:
    """A state pool with entries ~ N(0, 0.1^2), float32."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, H, V, K, generator=gen) * 0.1).to(device)
