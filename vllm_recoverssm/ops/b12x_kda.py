"""b12x's CuTe KDA recovery kernels (SM12x) behind the arguments of our verify and commit.

b12x (``b12x.sequence.gdn_decode``, 1.5+) runs recovery verify with
``Caps.recover_speculative_state=True`` and the multi-layer commit with
``bind_kda_commit`` / ``run_kda_commit``. :class:`B12xKdaRecovery` owns the b12x plans and
bindings for one group of KDA layers and takes the tensors :func:`.api.verify_recovery` and
:func:`.api.commit` take, with these limits (each raises a clear error naming the
argument):

* heads of 128 (K = V = 128), BF16 activations and records' ``kg``, FP32 state, the
  lower-bounded gate (``lower_bound`` not None), float32 ``A_log`` / ``dt_bias``;
* records live at the checkpoint's slot: ``record_indices`` must be the state slots (the
  plugin passes exactly that) and the record pools have one row per state slot;
* commit: a row that commits no tokens stays where it is (no copy to another final slot),
  and a row with a null final slot exports no boundary either.

Records and math are meant to be the same on both sides (b12x's docstring and kernel
source): ``corrections`` holds FP32 ``sigmoid(beta) * (v - (S * decay) k^)`` and ``kg`` the
key before L2 normalisation and the gate before ``dt_bias`` (both BF16), at
``[slot, head, token, :]``; the recurrence is the one of :mod:`.reference` (same eps, scale
and gate). The CPU tests check our side against b12x's PyTorch oracle; the ``gpu`` tests
compare b12x's kernels with ours, including records written by one backend and committed
by the other. Run verify and commit on the same backend in a deployment all the same: the
cross-backend replay is a test of the shared format, not a supported configuration.
Our null slot is any negative index; b12x's is ``Caps.null_state_index``, set to -1, and
staged slots are clamped to it.

Inputs are copied into buffers the adapter owns (sized for ``max_seqs`` requests of S+1
tokens), so each binding is built once per layer and batch size and stays valid across
steps and CUDA-graph replays: b12x launches read the bound addresses only.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass
from types import ModuleType
from typing import Any

import torch

from .plan import CommitPlan
from .validation import (
    INDEX_DTYPES,
    check_index_range,
    check_inner_contiguous,
    check_num_spec,
    check_query_start_loc,
    check_tensor,
    check_token_inputs,
)

B12X_MODULE = "b12x.sequence.gdn_decode"
B12X_REQUIRED_API = (
    "Caps", "plan", "invocation_from_tensors", "bind_kda", "run_kda", "bind_kda_commit",
    "run_kda_commit",
)
"""The names of b12x's ``gdn_decode`` that :class:`B12xKdaRecovery` calls."""
B12X_REQUIRED_CAPS_FIELDS = (
    "recover_speculative_state", "null_state_index", "state_index_columns", "max_state_slots",
)
"""The ``Caps`` fields the recovery declaration depends on (``recover_speculative_state``
turns recovery on)."""

HEAD_DIM = 128
"""b12x's KDA kernels are built for 128-wide heads."""
NULL_INDEX = -1
"""The slot given to b12x as ``Caps.null_state_index``; our null is any negative slot."""
ACTIVATION_DTYPE = torch.bfloat16
STATE_DTYPE = torch.float32
PARAM_DTYPE = torch.float32


def b12x_recovery_api(module: ModuleType | None) -> bool:
    """Whether ``module`` (b12x's ``gdn_decode``; None when absent) has what we call.

    Checks the names of :data:`B12X_REQUIRED_API`, that ``Caps`` is a dataclass with the
    fields of :data:`B12X_REQUIRED_CAPS_FIELDS`, and that ``run_kda`` takes
    ``apply_output_norm`` (our verify returns the output before the gated norm).
    """
    if module is None or not all(hasattr(module, name) for name in B12X_REQUIRED_API):
        return False
    caps = module.Caps
    if not (isinstance(caps, type) and is_dataclass(caps)):
        return False
    if not set(B12X_REQUIRED_CAPS_FIELDS) <= {f.name for f in fields(caps)}:
        return False
    try:
        params = inspect.signature(module.run_kda).parameters
    except (TypeError, ValueError):
        return False
    return "apply_output_norm" in params


def load_b12x_module() -> ModuleType:
    """Import b12x's ``gdn_decode`` and check its recovery API (ImportError otherwise)."""
    try:
        module = importlib.import_module(B12X_MODULE)
    except Exception as e:  # absent or broken: both mean the backend is unavailable
        raise ImportError(f"the b12x backend needs {B12X_MODULE} (pip install b12x): {e}") \
            from e
    if not b12x_recovery_api(module):
        raise ImportError(
            f"the installed {B12X_MODULE} lacks the KDA recovery API "
            f"({', '.join(B12X_REQUIRED_API)} and Caps.recover_speculative_state)"
        )
    return module


def stage_slots(out: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Copy ``slots`` into ``out`` with every negative (null) slot as :data:`NULL_INDEX`.

    b12x compares a slot with its null index for equality; our null is any negative value.
    Returns ``out``.
    """
    out.copy_(slots)
    return out.clamp_(min=NULL_INDEX)


class B12xStaging:
    """Device buffers the b12x bindings point at, sized for ``max_seqs`` rows of ``window``.

    The verify inputs are packed here the way b12x reads them (``mixed_qkv`` is q|k|v per
    token); commit metadata is converted to b12x's int32 fields.
    """

    def __init__(self, num_heads: int, window: int, max_seqs: int,
                 device: torch.device) -> None:
        self.num_heads, self.window, self.max_seqs = num_heads, window, max_seqs
        self.max_tokens = max_seqs * window
        H, D, T, N = num_heads, HEAD_DIM, self.max_tokens, max_seqs
        i32 = torch.int32
        # Buffers are created outside inference mode so that they stay writable in and
        # out of it (vLLM runs the model under inference mode).
        with torch.inference_mode(False):
            self.mixed_qkv = torch.zeros(T, 3 * H * D, dtype=ACTIVATION_DTYPE, device=device)
            self.raw_g = torch.zeros(T, H, D, dtype=ACTIVATION_DTYPE, device=device)
            self.raw_beta = torch.zeros(T, H, dtype=ACTIVATION_DTYPE, device=device)
            self.output = torch.zeros(T, H, D, dtype=ACTIVATION_DTYPE, device=device)
            self.norm_weight = torch.ones(D, dtype=ACTIVATION_DTYPE, device=device)
            self.query_start_loc = torch.zeros(N + 1, dtype=i32, device=device)
            self.num_accepted = torch.ones(N, dtype=i32, device=device)
            self.state_indices = torch.full((N,), NULL_INDEX, dtype=i32, device=device)
            # Each binding launches exactly its bound rows, so the live count can stay
            # at capacity and no step has to write it.
            self.num_seqs = torch.full((1,), N, dtype=i32, device=device)
            self.num_tokens = torch.full((1,), T, dtype=i32, device=device)
            self.commit_src = torch.full((N,), NULL_INDEX, dtype=i32, device=device)
            self.commit_lens = torch.zeros(N, dtype=i32, device=device)
            self.commit_final = torch.full((N,), NULL_INDEX, dtype=i32, device=device)
            self.commit_boundary = torch.full((N,), NULL_INDEX, dtype=i32, device=device)
            self.commit_boundary_lens = torch.zeros(N, dtype=i32, device=device)

    def token_capacity(self, num_rows: int) -> int:
        """Tokens a binding of ``num_rows`` requests covers (each has at most S+1)."""
        return min(self.max_tokens, num_rows * self.window)

    def verify_tensors(self, num_rows: int, state: torch.Tensor, corrections: torch.Tensor,
                       kg: torch.Tensor, A_log: torch.Tensor,
                       dt_bias: torch.Tensor) -> dict[str, torch.Tensor]:
        """The keyword tensors of ``bind_kda`` (all but scratch) for ``num_rows`` requests."""
        n, t = num_rows, self.token_capacity(num_rows)
        H, D = self.num_heads, HEAD_DIM
        mixed = self.mixed_qkv[:t]
        return dict(
            mixed_qkv=mixed, raw_g=self.raw_g[:t], raw_beta=self.raw_beta[:t],
            # z only feeds the gated norm, which recovery verify leaves to vLLM
            # (apply_output_norm=False); a read-only view of q saves a buffer.
            z=mixed[:, : H * D].unflatten(1, (H, D)),
            A_log=A_log, dt_bias=dt_bias, norm_weight=self.norm_weight,
            recurrent_state=state, query_start_loc=self.query_start_loc[: n + 1],
            num_accepted_tokens=self.num_accepted[:n],
            # b12x reads each request's checkpoint from state-index column zero.
            state_indices=self.state_indices[:n].unsqueeze(1),
            num_seqs=self.num_seqs, num_tokens=self.num_tokens, output=self.output[:t],
            correction_cache=corrections, kg_cache=kg,
        )

    def load_verify(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    raw_g: torch.Tensor, raw_beta: torch.Tensor, state_indices: torch.Tensor,
                    query_start_loc: torch.Tensor) -> int:
        """Copy one verify call's inputs in; returns the number of staged tokens.

        Only the first ``token_capacity(N)`` tokens can belong to a request; the staged
        output rows are zeroed so tokens of no request come out as zeros.
        """
        n = state_indices.shape[0]
        t = min(q.shape[0], self.token_capacity(n))
        torch.cat([x[:t].reshape(t, -1) for x in (q, k, v)], dim=1, out=self.mixed_qkv[:t])
        self.raw_g[:t].copy_(raw_g[:t])
        self.raw_beta[:t].copy_(raw_beta[:t])
        self.query_start_loc[: n + 1].copy_(query_start_loc)
        stage_slots(self.state_indices[:n], state_indices)
        self.output[:t].zero_()
        return t

    def load_commit(self, plan: CommitPlan) -> None:
        """Copy a commit plan in as b12x's fields (defaults: in place, no boundary)."""
        n = plan.num_rows
        src = stage_slots(self.commit_src[:n], plan.state_indices)
        self.commit_lens[:n].copy_(plan.commit_lens)
        final = self.commit_final[:n]
        if plan.final_indices is None:
            final.copy_(src)
        else:
            stage_slots(final, plan.final_indices)
        if plan.boundary_indices is None or plan.boundary_lens is None:
            self.commit_boundary[:n].fill_(NULL_INDEX)
            self.commit_boundary_lens[:n].zero_()
        else:
            stage_slots(self.commit_boundary[:n], plan.boundary_indices)
            self.commit_boundary_lens[:n].copy_(plan.boundary_lens)


@dataclass
class _Prepared:
    plan: Any
    scratch: torch.Tensor | tuple[torch.Tensor, ...]


@dataclass
class _CommitTables:
    pools: tuple[torch.Tensor, ...]  # kept so the addresses in the tables stay valid
    tensors: dict[str, torch.Tensor]


def _as_layers(name: str, x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out = [x] if isinstance(x, torch.Tensor) else list(x)
    if not out:
        raise ValueError(f"argument '{name}': expected at least one layer, got none")
    return out


def _key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    return t.data_ptr(), t.stride(0), tuple(t.shape)


class B12xKdaRecovery:
    """b12x recovery verify and commit for one group of KDA layers (see the module doc).

    ``num_heads`` is the local (per-rank) head count, ``num_spec`` the draft tokens S, and
    ``max_seqs`` the most speculative requests of one step. Plans are declared and
    prepared once per state-pool layout (the first call for a layout compiles b12x's
    kernels: make it before CUDA-graph capture); bindings once per layer and batch size.
    ``module`` is b12x's ``gdn_decode`` (imported on first use when None).

    Share one instance across the layers of a KV-cache group: its staging holds
    ``max_seqs * (S+1)`` tokens of q|k|v, gate and output in BF16, and the layers run one
    after another on one stream.
    """

    def __init__(self, *, num_heads: int, num_spec: int, max_seqs: int,
                 module: ModuleType | None = None) -> None:
        for name, value in (("num_heads", num_heads), ("max_seqs", max_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"argument '{name}': expected a positive int, got {value!r}")
        if isinstance(num_spec, bool) or not isinstance(num_spec, int):
            raise ValueError(f"argument 'num_spec': expected an int, got {num_spec!r}")
        check_num_spec("num_spec", num_spec + 1)
        if module is not None and not b12x_recovery_api(module):
            raise ValueError("argument 'module': lacks b12x's KDA recovery API")
        self.num_heads, self.window, self.max_seqs = num_heads, num_spec + 1, max_seqs
        self._module = module
        self._staging: dict[torch.device, B12xStaging] = {}
        self._plans: dict[tuple[Any, Any], _Prepared] = {}
        self._verify_bindings: dict[tuple[Any, ...], tuple[Any, B12xStaging]] = {}
        self._tables: dict[tuple[Any, ...], _CommitTables] = {}
        self._commit_bindings: dict[tuple[Any, ...], tuple[Any, B12xStaging]] = {}

    # -- b12x declarations ---------------------------------------------------------------
    @property
    def module(self) -> ModuleType:
        """b12x's ``gdn_decode`` module (imported on first use)."""
        if self._module is None:
            self._module = load_b12x_module()
        return self._module

    def staging(self, device: torch.device | str) -> B12xStaging:
        """The staging buffers on ``device`` (allocated on first use)."""
        dev = torch.device(device)
        if dev not in self._staging:
            self._staging[dev] = B12xStaging(self.num_heads, self.window, self.max_seqs, dev)
        return self._staging[dev]

    def caps(self, num_slots: int, device: torch.device | str) -> Any:
        """b12x ``Caps`` for a state pool of ``num_slots`` slots on CUDA ``device``."""
        return self.module.Caps(
            device=device, max_tokens=self.max_seqs * self.window, max_seqs=self.max_seqs,
            max_state_slots=num_slots, key_heads=self.num_heads, value_heads=self.num_heads,
            key_head_dim=HEAD_DIM, value_head_dim=HEAD_DIM, state_index_columns=self.window,
            model_dtype=ACTIVATION_DTYPE, state_dtype=STATE_DTYPE, gate_activation="sigmoid",
            qk_l2norm=True, null_state_index=NULL_INDEX, recover_speculative_state=True,
        )

    def declare(self, state: torch.Tensor, corrections: torch.Tensor, kg: torch.Tensor,
                A_log: torch.Tensor, dt_bias: torch.Tensor,
                device: torch.device | str | None = None) -> tuple[Any, Any, Any]:
        """``(caps, invocation, plan)`` for these pools and parameters (no compilation).

        ``device`` is the CUDA device the plan is for (default: the tensors'); b12x reads
        only dtypes, strides and alignments from the tensors, so they may live elsewhere.
        """
        caps, invocation = self._declaration(state, corrections, kg, A_log, dt_bias, device)
        return caps, invocation, self.module.plan(caps, invocation=invocation)

    def _declaration(self, state: torch.Tensor, corrections: torch.Tensor, kg: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor,
                     device: torch.device | str | None = None) -> tuple[Any, Any]:
        dev = state.device if device is None else torch.device(device)
        caps = self.caps(state.shape[0], dev)
        tensors = self.staging(state.device).verify_tensors(
            self.max_seqs, state, corrections, kg, A_log, dt_bias)
        return caps, self.module.invocation_from_tensors(caps, **tensors)

    def _prepared(self, state: torch.Tensor, corrections: torch.Tensor, kg: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor) -> _Prepared:
        # Layers whose pools share a layout (strides, alignment, slot count) share a plan.
        key = self._declaration(state, corrections, kg, A_log, dt_bias)
        if key not in self._plans:
            cap = torch.cuda.get_device_capability(state.device)
            if cap[0] != 12:
                raise ValueError(
                    f"argument 'state': b12x's recovery kernels need an SM12x GPU, "
                    f"{state.device} is SM{cap[0]}{cap[1]}"
                )
            caps, invocation = key
            plan = self.module.plan(caps, invocation=invocation)
            _prepare(plan, f"vllm_recoverssm.kda_recovery.{len(self._plans)}")
            specs = plan.memory_requirements().scratch
            scratch = tuple(torch.empty(s.shape, dtype=s.dtype, device=s.device)
                            for s in specs)
            self._plans[key] = _Prepared(plan, scratch[0] if len(scratch) == 1 else scratch)
        return self._plans[key]

    @property
    def binding_count(self) -> int:
        """Verify and commit bindings built so far (one per layer/pools and batch size)."""
        return len(self._verify_bindings) + len(self._commit_bindings)

    def reset(self) -> None:
        """Forget every plan, binding and buffer (e.g. after the KV cache is reallocated)."""
        self._staging.clear()
        self._plans.clear()
        self._verify_bindings.clear()
        self._tables.clear()
        self._commit_bindings.clear()

    # -- verify --------------------------------------------------------------------------
    def verify(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        raw_g: torch.Tensor,
        raw_beta: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        state: torch.Tensor,
        state_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        corrections: torch.Tensor,
        kg: torch.Tensor,
        *,
        lower_bound: float | None,
        record_indices: torch.Tensor | None,
        validate: bool = True,
    ) -> torch.Tensor:
        """:func:`.api.verify_recovery` on b12x's kernel; returns ``[T, H, V]`` BF16.

        The output is the recurrence output before the gated RMSNorm
        (``run_kda(..., apply_output_norm=False)``); tokens of no request are zeros.
        ``record_indices`` must be the state slots (b12x writes records there).
        """
        self._check_verify(q, k, v, raw_g, raw_beta, A_log, dt_bias, state, state_indices,
                           query_start_loc, corrections, kg, lower_bound, record_indices,
                           validate)
        assert lower_bound is not None
        T, H = q.shape[0], q.shape[1]
        N = state_indices.shape[0]
        if N == 0 or T == 0:
            return torch.zeros(T, H, HEAD_DIM, dtype=q.dtype, device=q.device)
        binding, stage = self._verify_binding(N, state, corrections, kg, A_log, dt_bias)
        t = stage.load_verify(q, k, v, raw_g, raw_beta, state_indices, query_start_loc)
        self.module.run_kda(binding, lower_bound=float(lower_bound), apply_output_norm=False)
        if t == T:
            return stage.output[:t].clone()
        out = torch.zeros(T, H, HEAD_DIM, dtype=q.dtype, device=q.device)
        out[:t].copy_(stage.output[:t])
        return out

    def _verify_binding(self, n: int, state: torch.Tensor, corrections: torch.Tensor,
                        kg: torch.Tensor, A_log: torch.Tensor,
                        dt_bias: torch.Tensor) -> tuple[Any, B12xStaging]:
        key = (n, _key(state), _key(corrections), _key(kg), A_log.data_ptr(),
               dt_bias.data_ptr())
        hit = self._verify_bindings.get(key)
        if hit is None:
            prepared = self._prepared(state, corrections, kg, A_log, dt_bias)
            stage = self.staging(state.device)
            binding = self.module.bind_kda(
                prepared.plan, scratch=prepared.scratch,
                **stage.verify_tensors(n, state, corrections, kg, A_log, dt_bias))
            hit = self._verify_bindings[key] = (binding, stage)
        return hit

    def _check_verify(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
        raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
        state: torch.Tensor, state_indices: torch.Tensor, query_start_loc: torch.Tensor,
        corrections: torch.Tensor, kg: torch.Tensor, lower_bound: float | None,
        record_indices: torch.Tensor | None, validate: bool,
    ) -> None:
        # Shapes, dtypes and devices are host metadata, so these checks always run;
        # validate=False skips only those that read device values.
        T, H, K, V = check_token_inputs(q, k, v, raw_g, raw_beta, A_log, dt_bias, state)
        self._check_geometry("q", H, K, V)
        check_tensor("q", q, dtypes=(ACTIVATION_DTYPE,))
        check_tensor("state", state, dtypes=(STATE_DTYPE,))
        check_tensor("A_log", A_log, dtypes=(PARAM_DTYPE,))
        check_tensor("dt_bias", dt_bias, dtypes=(PARAM_DTYPE,))
        _check_lower_bound(lower_bound)
        dev = state.device
        si = check_tensor("state_indices", state_indices, dtypes=INDEX_DTYPES, device=dev,
                          contiguous=True)
        if si.dim() != 1:
            raise ValueError(
                f"argument 'state_indices': expected shape [N] (one checkpoint slot per "
                f"request), got {list(si.shape)}"
            )
        N = si.shape[0]
        if N > self.max_seqs:
            raise ValueError(
                f"argument 'state_indices': {N} requests exceed this adapter's max_seqs "
                f"({self.max_seqs})"
            )
        self._check_records("corrections", "kg", corrections, kg, state)
        if record_indices is None:
            raise NotImplementedError(
                "argument 'record_indices': b12x writes each request's records at its "
                "checkpoint slot; pass record_indices=state_indices"
            )
        check_tensor("record_indices", record_indices, dtypes=INDEX_DTYPES, shape=[N],
                     device=dev, contiguous=True)
        if validate:
            check_index_range("state_indices", si, state.shape[0], True)
            check_query_start_loc(query_start_loc, N, T, self.window, dev)
            check_index_range("record_indices", record_indices, corrections.shape[0], True)
            _check_same_rows("record_indices", record_indices, si, si >= 0)
        else:
            check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES,
                         shape=[N + 1], device=dev, contiguous=True)
        if dev.type != "cuda":
            raise ValueError(
                f"argument 'state': b12x's kernels need CUDA tensors, got {dev.type} "
                "(use ops.verify_recovery elsewhere)"
            )

    def _check_geometry(self, name: str, H: int, K: int, V: int) -> None:
        if K != HEAD_DIM or V != HEAD_DIM:
            raise ValueError(
                f"argument '{name}': b12x's KDA kernels need {HEAD_DIM}-wide heads, got "
                f"K={K}, V={V}"
            )
        if H != self.num_heads:
            raise ValueError(
                f"argument '{name}': expected {self.num_heads} heads (this adapter's "
                f"num_heads), got {H}"
            )

    def _check_records(self, cname: str, kname: str, corrections: torch.Tensor,
                       kg: torch.Tensor, state: torch.Tensor) -> None:
        H, W = self.num_heads, self.window
        dev = state.device
        check_tensor(cname, corrections, dtypes=(STATE_DTYPE,), device=dev)
        if corrections.dim() != 4 or tuple(corrections.shape[1:]) != (H, W, HEAD_DIM):
            raise ValueError(
                f"argument '{cname}': expected shape [slots, {H}, {W}, {HEAD_DIM}] "
                f"(S+1 = {W} records per head), got {list(corrections.shape)}"
            )
        check_inner_contiguous(cname, corrections, 3)
        check_tensor(kname, kg, dtypes=(ACTIVATION_DTYPE,),
                     shape=[corrections.shape[0], H, W, 2 * HEAD_DIM], device=dev)
        check_inner_contiguous(kname, kg, 3)
        if corrections.shape[0] != state.shape[0]:
            raise NotImplementedError(
                f"argument '{cname}': b12x keeps records per state slot, so the record "
                f"pools need {state.shape[0]} rows like the state pool, got "
                f"{corrections.shape[0]}"
            )

    # -- commit --------------------------------------------------------------------------
    def commit(
        self,
        states: torch.Tensor | Sequence[torch.Tensor],
        corrections: torch.Tensor | Sequence[torch.Tensor],
        kg: torch.Tensor | Sequence[torch.Tensor],
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        plan: CommitPlan,
        *,
        lower_bound: float | None,
        record_indices: torch.Tensor | None,
        validate: bool = True,
    ) -> None:
        """:func:`.api.commit` on b12x's kernel: one launch for every layer, in place.

        ``A_log`` is ``[L, H]`` (or ``[H]`` for one layer) and ``dt_bias`` ``[L, H, K]``,
        float32 and contiguous. Align-mode boundaries are exported as ``plan`` says.
        ``record_indices`` must be the state slots on every row that commits tokens.
        """
        st = _as_layers("states", states)
        co = _as_layers("corrections", corrections)
        kgs = _as_layers("kg", kg)
        if A_log.dim() == 1:
            A_log = A_log[None]
        if dt_bias.dim() == 2:
            dt_bias = dt_bias[None]
        self._check_commit(st, co, kgs, A_log, dt_bias, plan, lower_bound, record_indices,
                           validate)
        assert lower_bound is not None
        n = plan.num_rows
        if n == 0:
            return
        binding, stage = self._commit_binding(n, st, co, kgs, A_log, dt_bias)
        stage.load_commit(plan)
        self.module.run_kda_commit(binding, lower_bound=float(lower_bound))

    def _commit_binding(self, n: int, st: list[torch.Tensor], co: list[torch.Tensor],
                        kgs: list[torch.Tensor], A_log: torch.Tensor,
                        dt_bias: torch.Tensor) -> tuple[Any, B12xStaging]:
        pools_key = tuple(_key(t) for t in (*st, *co, *kgs))
        key = (n, pools_key, A_log.data_ptr(), dt_bias.data_ptr())
        hit = self._commit_bindings.get(key)
        if hit is None:
            # Any plan of this pool layout carries the commit kernel.
            prepared = self._prepared(st[0], co[0], kgs[0], A_log[0], dt_bias[0])
            tables = self._commit_tables(pools_key, st, co, kgs)
            stage = self.staging(st[0].device)
            binding = self.module.bind_kda_commit(
                prepared.plan, scratch=prepared.scratch, **tables.tensors,
                A_log=A_log, dt_bias=dt_bias, state_indices=stage.commit_src[:n],
                commit_lens=stage.commit_lens[:n], final_state_indices=stage.commit_final[:n],
                boundary_state_indices=stage.commit_boundary[:n],
                boundary_recovery_lens=stage.commit_boundary_lens[:n],
            )
            hit = self._commit_bindings[key] = (binding, stage)
        return hit

    def _commit_tables(self, key: tuple[Any, ...], st: list[torch.Tensor],
                       co: list[torch.Tensor], kgs: list[torch.Tensor]) -> _CommitTables:
        if key not in self._tables:
            dev = st[0].device

            def table(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int64, device=dev)

            tensors: dict[str, torch.Tensor] = {}
            for name, pools in (("state", st), ("correction_cache", co), ("kg_cache", kgs)):
                # b12x's tables hold byte addresses and slot strides in elements.
                tensors[f"{name}_base_addrs"] = table([p.data_ptr() for p in pools])
                tensors[f"{name}_block_strides"] = table([p.stride(0) for p in pools])
            self._tables[key] = _CommitTables((*st, *co, *kgs), tensors)
        return self._tables[key]

    def _check_commit(
        self, st: list[torch.Tensor], co: list[torch.Tensor], kgs: list[torch.Tensor],
        A_log: torch.Tensor, dt_bias: torch.Tensor, plan: CommitPlan,
        lower_bound: float | None, record_indices: torch.Tensor | None, validate: bool,
    ) -> None:
        L = len(st)
        if len(co) != L or len(kgs) != L:
            raise ValueError(
                f"argument 'corrections'/'kg': expected {L} layers like 'states', got "
                f"{len(co)} and {len(kgs)}"
            )
        s0 = check_tensor("states[0]", st[0], dtypes=(STATE_DTYPE,))
        if s0.dim() != 4:
            raise ValueError(
                f"argument 'states[0]': expected shape [slots, H, V, K], got {list(s0.shape)}"
            )
        slots, H, V, K = s0.shape
        self._check_geometry("states[0]", H, K, V)
        dev = s0.device
        for i in range(L):
            check_tensor(f"states[{i}]", st[i], dtypes=(STATE_DTYPE,), shape=[slots, H, V, K],
                         device=dev)
            check_inner_contiguous(f"states[{i}]", st[i], 3)
            self._check_records(f"corrections[{i}]", f"kg[{i}]", co[i], kgs[i], st[i])
        check_tensor("A_log", A_log, dtypes=(PARAM_DTYPE,), shape=[L, H], device=dev,
                     contiguous=True)
        check_tensor("dt_bias", dt_bias, dtypes=(PARAM_DTYPE,), shape=[L, H, K], device=dev,
                     contiguous=True)
        _check_lower_bound(lower_bound)
        n = plan.num_rows
        if n > self.max_seqs:
            raise ValueError(
                f"argument 'plan': {n} rows exceed this adapter's max_seqs ({self.max_seqs})"
            )
        if record_indices is None:
            raise NotImplementedError(
                "argument 'record_indices': b12x reads each row's records at its checkpoint "
                "slot; pass the slots verify wrote (plan.state_indices on live rows)"
            )
        check_tensor("record_indices", record_indices, dtypes=INDEX_DTYPES, shape=[n],
                     device=dev, contiguous=True)
        if validate:
            plan.validate(slots, self.window, dev)
            check_index_range("record_indices", record_indices, slots, True)
            src, lens = plan.state_indices, plan.commit_lens
            live = (src >= 0) & (lens > 0)
            _check_same_rows("record_indices", record_indices, src, live)
            final = src if plan.final_indices is None else plan.final_indices
            moved = (src >= 0) & (lens == 0) & (final >= 0) & (final != src)
            if bool(moved.any()):
                raise NotImplementedError(
                    "argument 'plan.commit_lens': b12x leaves a row that commits no tokens "
                    "in place; rows with commit_len 0 and a final slot other than their "
                    f"source need a copy (rows {moved.nonzero().flatten().tolist()})"
                )
            if plan.boundary_indices is not None:
                lost = live & (final < 0) & (plan.boundary_indices >= 0)
                if bool(lost.any()):
                    raise NotImplementedError(
                        "argument 'plan.final_indices': b12x skips a row whose final slot is "
                        "null, boundary export included (rows "
                        f"{lost.nonzero().flatten().tolist()})"
                    )
        else:
            for name in ("state_indices", "commit_lens", "final_indices", "boundary_indices",
                         "boundary_lens"):
                t = getattr(plan, name)
                if t is not None:
                    check_tensor(f"plan.{name}", t, dtypes=INDEX_DTYPES, shape=[n],
                                 device=dev, contiguous=True)
        if dev.type != "cuda":
            raise ValueError(
                f"argument 'states': b12x's kernels need CUDA tensors, got {dev.type} "
                "(use ops.commit elsewhere)"
            )


def _check_lower_bound(lower_bound: float | None) -> None:
    if lower_bound is None:
        raise NotImplementedError(
            "argument 'lower_bound': b12x implements only the lower-bounded KDA gate "
            "(lower_bound * sigmoid(...)); got None (the softplus gate)"
        )
    if not lower_bound < 0:
        raise ValueError(
            f"argument 'lower_bound': expected a negative bound, got {lower_bound}"
        )


def _check_same_rows(name: str, got: torch.Tensor, want: torch.Tensor,
                     rows: torch.Tensor) -> None:
    bad = rows & (got.to(torch.int64) != want.to(torch.int64))
    if bool(bad.any()):
        raise NotImplementedError(
            f"argument '{name}': b12x keeps records at the checkpoint slot, so record rows "
            f"must equal the state slots; rows {bad.nonzero().flatten().tolist()} differ"
        )


def _prepare(plan: Any, name: str) -> None:
    """Compile ``plan`` with b12x's default configuration now, not at its first bind."""
    try:
        preparation = importlib.import_module("b12x.preparation")
    except ImportError:
        return
    prepare_default = getattr(preparation, "prepare_default", None)
    prepared_call = getattr(preparation, "PreparedCall", None)
    if prepare_default is None or prepared_call is None:
        return  # bind_kda then prepares the plan itself, with a warning
    prepare_default(plan.request(
        name=name, prepare_call=lambda state: prepared_call(run=lambda: None)))
