"""One grid point's tensors (inputs, state pools, records) and the measured ops as closures.

Every layer of a stack gets its own token inputs and gate parameters, so no layer finds
another layer's inputs in L2. State pools follow a memory budget:

* full-state pools hold ``S + 1`` slots per request (``[B*(S+1), H, V, K]`` per layer). At
  GLM-5.3 TP2 shapes a 34-layer stack at batch 256, S = 7 would need 136 GiB, so when the
  budget holds fewer than ``L`` pools the layers take turns over ``P`` distinct pools
  (layer ``l`` uses pool ``l % P``). This only happens when one pool is gigabytes, far
  larger than L2, and verify runs one launch per layer, so a layer never finds the
  previous user's data of its pool in L2: the timing stays honest. The output says so.
* recovery pools (one checkpoint per request plus a scratch row of records) are always
  distinct per layer, because the commit updates every layer in one launch and two
  layers sharing a pool there would share L2 lines. A point whose recovery pools do not
  fit is skipped, with a note.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import ops
from ..ops import api
from . import peer as peer_mod
from .accounting import OpShape
from .grid import LOWER_BOUND

Op = Callable[[], object]


@dataclass
class LayerInputs:
    """One layer's raw token inputs in the flat varlen layout."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    raw_g: torch.Tensor
    raw_beta: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes held by the inputs."""
        return sum(t.numel() * t.element_size()
                   for t in (self.q, self.k, self.v, self.raw_g, self.raw_beta))


@dataclass
class Step:
    """The inputs of one speculative decode step at one grid point."""

    shape: OpShape
    batch: int
    layers: int
    device: torch.device
    query_start_loc: torch.Tensor
    inputs: list[LayerInputs]
    A_log: torch.Tensor  # [L, H] fp32
    dt_bias: torch.Tensor  # [L, H, K] fp32
    backend: str

    @property
    def input_bytes(self) -> int:
        """Bytes of all layers' token inputs."""
        return sum(x.nbytes for x in self.inputs)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           gen: torch.Generator, std: float = 1.0) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32 if dtype != torch.float32 else dtype,
                    device=device)
    t.normal_(0.0, std, generator=gen)
    return t.to(dtype)


def make_step(shape: OpShape, batch: int, layers: int, act_dtype: torch.dtype,
              device: torch.device, backend: str, seed: int) -> Step:
    """Random inputs (activations ~ N(0, 1)) for ``batch`` requests of ``S+1`` tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T, H, K, V = batch * shape.tokens, shape.heads, shape.k, shape.v
    inputs = [
        LayerInputs(
            q=_randn((T, H, K), act_dtype, device, gen),
            k=_randn((T, H, K), act_dtype, device, gen),
            v=_randn((T, H, V), act_dtype, device, gen),
            raw_g=_randn((T, H, K), act_dtype, device, gen),
            raw_beta=_randn((T, H), act_dtype, device, gen),
        )
        for _ in range(layers)
    ]
    qsl = torch.arange(0, T + 1, shape.tokens, dtype=torch.int32, device=device)
    return Step(
        shape=shape, batch=batch, layers=layers, device=device, query_start_loc=qsl,
        inputs=inputs,
        A_log=_randn((layers, H), torch.float32, device, gen, 0.5),
        dt_bias=_randn((layers, H, K), torch.float32, device, gen, 0.5),
        backend=backend,
    )


def distinct_pools(per_layer_bytes: int, layers: int, budget_bytes: int) -> int:
    """How many distinct per-layer pools fit the budget (0 = not even one), at most ``layers``."""
    if per_layer_bytes <= 0:
        return layers
    return max(0, min(layers, budget_bytes // per_layer_bytes))


def full_pool_bytes(shape: OpShape, batch: int) -> int:
    """One layer's full-state pool: ``S + 1`` FP32 states per request."""
    return batch * shape.tokens * shape.heads * shape.state_per_head


def recovery_pool_bytes(shape: OpShape, batch: int) -> int:
    """One layer's recovery pool: one checkpoint per request plus two scratch rows of
    records (the fused verify reads one half and writes the other)."""
    records = batch * shape.heads * shape.tokens * shape.record_per_token
    return batch * shape.heads * shape.state_per_head + 2 * records


@dataclass
class FullPools:
    """Full-state pools and the step's full-state index table."""

    pools: list[torch.Tensor]
    state_indices: torch.Tensor  # [B, S+1]: request i owns slots i*(S+1) .. i*(S+1)+S
    num_accepted: torch.Tensor  # [B]: accepted count of the previous step, 1..S+1

    def pool(self, layer: int) -> torch.Tensor:
        """The pool that ``layer`` uses (pools are shared round-robin past the budget)."""
        return self.pools[layer % len(self.pools)]

    def bytes_per_request(self, batch: int, layers: int) -> int:
        """Allocated state bytes per request for ``layers`` layers (as an engine holds them)."""
        p = self.pools[0]
        return layers * p.numel() * p.element_size() // batch


def make_full_pools(step: Step, num_pools: int, seed: int) -> FullPools:
    """``num_pools`` full-state pools with states ~ N(0, 0.1^2)."""
    s, B, dev = step.shape, step.batch, step.device
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    pools = []
    for _ in range(num_pools):
        p = torch.empty(B * s.tokens, s.heads, s.v, s.k, dtype=torch.float32, device=dev)
        pools.append(p.normal_(0.0, 0.1, generator=gen))
    sidx = torch.arange(B * s.tokens, dtype=torch.int32, device=dev).view(B, s.tokens)
    cpu_gen = torch.Generator().manual_seed(seed + 2)
    nacc = torch.randint(1, s.tokens + 1, (B,), generator=cpu_gen, dtype=torch.int32)
    return FullPools(pools, sidx.contiguous(), nacc.to(dev))


@dataclass
class RecoveryPools:
    """Per-layer checkpoint pools, scratch records, and the two commit plans."""

    states: list[torch.Tensor]
    corrections: list[torch.Tensor]
    kg: list[torch.Tensor]
    state_indices: torch.Tensor  # [B]
    plan_all: api.CommitPlan  # every token accepted
    plan_two: api.CommitPlan  # 2 tokens accepted

    def bytes_per_request(self, batch: int, layers: int) -> int:
        """Allocated checkpoint + record bytes per request for ``layers`` layers."""
        per_layer = sum(t.numel() * t.element_size()
                        for t in (self.states[0], self.corrections[0], self.kg[0]))
        return layers * per_layer // batch


def make_recovery_pools(step: Step, seed: int) -> RecoveryPools:
    """One checkpoint pool and one records scratch area per layer."""
    s, B, dev = step.shape, step.batch, step.device
    gen = torch.Generator(device=dev).manual_seed(seed + 3)
    act = step.inputs[0].q.dtype
    states, corrs, kgs = [], [], []
    for _ in range(step.layers):
        st = torch.empty(B, s.heads, s.v, s.k, dtype=torch.float32, device=dev)
        states.append(st.normal_(0.0, 0.1, generator=gen))
        corrs.append(torch.zeros(B, s.heads, s.tokens, s.v, dtype=torch.float32, device=dev))
        kgs.append(torch.zeros(B, s.heads, s.tokens, 2 * s.k, dtype=act, device=dev))
    sidx = torch.arange(B, dtype=torch.int32, device=dev)
    lens_all = torch.full((B,), s.tokens, dtype=torch.int32, device=dev)
    lens_two = torch.full((B,), 2, dtype=torch.int32, device=dev)
    return RecoveryPools(states, corrs, kgs, sidx, api.CommitPlan(sidx, lens_all),
                         api.CommitPlan(sidx, lens_two))


def _uses_triton(backend: str, device: torch.device) -> bool:
    return backend == "triton" or (backend == "auto" and device.type == "cuda")


def _commit_op(step: Step, rec: RecoveryPools, plan: api.CommitPlan) -> Op:
    """The multi-layer commit, validated once here and captured without validation.

    The kernel reads per-layer base addresses from small device tables. Built per call,
    they would be a host-to-device copy inside graph capture (not capturable); built once
    here, the captured launch reuses them, as an engine that commits into fixed pools would.
    """
    st, co, kg, a_log, dtb = rec.states, rec.corrections, rec.kg, step.A_log, step.dt_bias
    lb, backend = LOWER_BOUND, step.backend
    ops.commit(st, co, kg, a_log, dtb, plan, lower_bound=lb, backend=backend, validate=True)
    if _uses_triton(backend, step.device):
        from ..ops import triton_kda

        tables_cls = getattr(triton_kda, "CommitTables", None)
        if tables_cls is not None:
            tables = tables_cls(st, co, kg)
            if "tables" in inspect.signature(ops.commit).parameters:
                return lambda: ops.commit(  # type: ignore[call-arg]
                    st, co, kg, a_log, dtb, plan, lower_bound=lb, backend=backend,
                    validate=False, tables=tables)
            a_log, dtb = a_log.contiguous(), dtb.contiguous()
            return lambda: triton_kda.commit_triton(
                st, co, kg, a_log, dtb, plan, lb, None, tables=tables)
    return lambda: ops.commit(st, co, kg, a_log, dtb, plan, lower_bound=lb, backend=backend,
                              validate=False)


def _verify_layer(step: Step, rec: RecoveryPools, layer: int, validate: bool) -> torch.Tensor:
    x = step.inputs[layer]
    return ops.verify_recovery(
        x.q, x.k, x.v, x.raw_g, x.raw_beta, step.A_log[layer], step.dt_bias[layer],
        rec.states[layer], rec.state_indices, step.query_start_loc, rec.corrections[layer],
        rec.kg[layer], lower_bound=LOWER_BOUND, backend=step.backend, validate=validate,
    )


def _full_layer(step: Step, full: FullPools, layer: int, validate: bool) -> torch.Tensor:
    x = step.inputs[layer]
    return ops.verify_full(
        x.q, x.k, x.v, x.raw_g, x.raw_beta, step.A_log[layer], step.dt_bias[layer],
        full.pool(layer), full.state_indices, full.num_accepted, step.query_start_loc,
        lower_bound=LOWER_BOUND, backend=step.backend, validate=validate,
    )


def _fla_layer(step: Step, full: FullPools, fwd: peer_mod.FlaFwd, layer: int) -> torch.Tensor:
    x = step.inputs[layer]
    return peer_mod.fla_full_verify(
        fwd, x.q, x.k, x.v, x.raw_g, x.raw_beta, step.A_log[layer], step.dt_bias[layer],
        full.pool(layer), full.state_indices, full.num_accepted, step.query_start_loc,
        LOWER_BOUND,
    )


def full_ops(step: Step, full: FullPools, fla: peer_mod.FlaFwd | None) -> dict[str, Op]:
    """Full-state verify over every layer: ours, and fla-core's when given."""
    for layer in range(step.layers):
        _full_layer(step, full, layer, validate=True)

    def ours() -> None:
        for layer in range(step.layers):
            _full_layer(step, full, layer, validate=False)

    out: dict[str, Op] = {"ours_full": ours}
    if fla is not None:
        fwd = fla

        def peer() -> None:
            for layer in range(step.layers):
                _fla_layer(step, full, fwd, layer)

        out["fla_full"] = peer
    return out


def _fused_layer(step: Step, rec: RecoveryPools, prev: list[tuple[torch.Tensor, torch.Tensor]],
                 prev_lens: torch.Tensor, layer: int, validate: bool) -> torch.Tensor:
    x = step.inputs[layer]
    pc, pk = prev[layer]
    return ops.verify_fused(
        x.q, x.k, x.v, x.raw_g, x.raw_beta, step.A_log[layer], step.dt_bias[layer],
        rec.states[layer], rec.state_indices, step.query_start_loc, rec.corrections[layer],
        rec.kg[layer], prev_lens, lower_bound=LOWER_BOUND, prev_corrections=pc, prev_kg=pk,
        backend=step.backend, validate=validate,
    )


def _fused_op(step: Step, rec: RecoveryPools, prev: list[tuple[torch.Tensor, torch.Tensor]],
              accepted: int) -> Op:
    """The fused verify of every layer after ``accepted`` pending tokens per request.

    The previous step's records sit in their own pools (the other half of a double
    buffer), so every replay commits the same records and verifies the same window.
    """
    lens = torch.full((step.batch,), accepted, dtype=torch.int32, device=step.device)
    for layer in range(step.layers):
        _fused_layer(step, rec, prev, lens, layer, validate=True)

    def op() -> None:
        for layer in range(step.layers):
            _fused_layer(step, rec, prev, lens, layer, validate=False)

    return op


def recovery_ops(step: Step, rec: RecoveryPools) -> dict[str, Op]:
    """Recovery verify, commit (all / 2 accepted), verify + commit and the fused verify
    (the previous step's all / 2 accepted records committed inside it) over every layer."""
    for layer in range(step.layers):  # validates, and fills the records the commits replay
        _verify_layer(step, rec, layer, validate=True)
    prev = [(c.clone(), k.clone()) for c, k in zip(rec.corrections, rec.kg, strict=True)]

    def verify() -> None:
        for layer in range(step.layers):
            _verify_layer(step, rec, layer, validate=False)

    commit_all = _commit_op(step, rec, rec.plan_all)
    commit_two = _commit_op(step, rec, rec.plan_two)

    def total_all() -> None:
        verify()
        commit_all()

    def total_two() -> None:
        verify()
        commit_two()

    return {"verify": verify, "commit_all": commit_all, "commit_2": commit_two,
            "total_all": total_all, "total_2": total_two,
            "fused_all": _fused_op(step, rec, prev, step.shape.tokens),
            "fused_2": _fused_op(step, rec, prev, 2)}


def peer_agreement(step: Step, full: FullPools, fla: peer_mod.FlaFwd) -> dict[str, float]:
    """Max abs difference of outputs and written states, ours vs fla-core, layer 0.

    Guards the peer's wiring: the same contract on the same inputs must agree to
    rounding (the two normalise with slightly different arithmetic).
    """
    pool = full.pool(0)
    a, b = pool.clone(), pool.clone()
    x = step.inputs[0]
    o_ours = ops.verify_full(
        x.q, x.k, x.v, x.raw_g, x.raw_beta, step.A_log[0], step.dt_bias[0], a,
        full.state_indices, full.num_accepted, step.query_start_loc,
        lower_bound=LOWER_BOUND, backend=step.backend,
    )
    o_fla = peer_mod.fla_full_verify(
        fla, x.q, x.k, x.v, x.raw_g, x.raw_beta, step.A_log[0], step.dt_bias[0], b,
        full.state_indices, full.num_accepted, step.query_start_loc, LOWER_BOUND,
    )
    return {
        "max_abs_out": float((o_ours.float() - o_fla.float()).abs().max()),
        "max_abs_state": float((a - b).abs().max()),
        "max_abs_out_ref": float(o_ours.float().abs().max()),
    }
