"""Fidelity of the committed states against float64: one window, and a 16-window drift.

Each method runs the same sequence of speculative windows on the same inputs (states
~ N(0, 0.1^2), activations ~ N(0, 1), weak decay: raw gates shifted by ``GATE_SHIFT``) with
the same random accepted counts (1..S+1 per request and window), and the state it holds
after each window is compared with the float64 reference run of the same sequence:

* ``recovery``: recovery verify, then commit of the accepted records;
* ``fused``: the fused verify (each window commits the previous window's records before
  verifying), with a standalone commit after the last window;
* ``ours_full`` / ``fla_full``: full-state verify (ours / fla-core's), which writes a state
  per token; the next window starts from column ``accepted - 1``.

The figure is the largest absolute difference over every state element, after the first
window and after the last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import ops
from . import peer as peer_mod
from .grid import LOWER_BOUND

GATE_SHIFT = -8.0  # raw gates ~ N(-8, 1): decays near 1, so errors accumulate over windows
WINDOWS = 16
METHODS = ("recovery", "fused", "ours_full", "fla_full")
ONE_WINDOW_LIMIT = 1e-6
DRIFT_LIMIT = 1.2  # x fla-core's 16-window error


def _window_inputs(T: int, H: int, K: int, act: torch.dtype, dev: torch.device,
                   gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    def rnd(*shape: int, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) + shift).to(act).to(dev)

    return rnd(T, H, K), rnd(T, H, K), rnd(T, H, K), rnd(T, H, K, shift=GATE_SHIFT), rnd(T, H)


def measure(device: torch.device, heads: int, head_dim: int, act: torch.dtype, num_spec: int,
            batch: int, backend: str, fla: peer_mod.FlaFwd | None, seed: int = 0,
            windows: int = WINDOWS) -> dict[str, Any]:
    """Max |state - float64| per method after window 1 and after ``windows`` windows."""
    H, K, W, B = heads, head_dim, num_spec + 1, batch
    gen = torch.Generator().manual_seed(seed + 7)
    A_log = (torch.randn(H, generator=gen) * 0.5).to(device)
    dt_bias = (torch.randn(H, K, generator=gen) * 0.5).to(device)
    s0 = (torch.randn(B, H, K, K, generator=gen) * 0.1).to(device)
    qsl = torch.arange(0, B * W + 1, W, dtype=torch.int32, device=device)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    cols = torch.arange(B * W, dtype=torch.int32, device=device).view(B, W)
    steps = [(_window_inputs(B * W, H, K, act, device, gen),
              torch.randint(1, W + 1, (B,), generator=gen, dtype=torch.int32).to(device))
             for _ in range(windows)]
    f64 = torch.float64
    lb, bk = LOWER_BOUND, backend

    ref = s0.double()
    ref_after: list[torch.Tensor] = []
    for x, acc in steps:
        c = torch.zeros(B, H, W, K, dtype=f64, device=device)
        kg = torch.zeros(B, H, W, 2 * K, dtype=f64, device=device)
        q, k, v, g, b = (t.to(f64) for t in x)
        ops.verify_recovery(q, k, v, g, b, A_log.double(), dt_bias.double(), ref, idx, qsl,
                            c, kg, lower_bound=lb, backend="reference")
        ops.commit(ref, c, kg, A_log.double(), dt_bias.double(), ops.CommitPlan(idx, acc),
                   lower_bound=lb, backend="reference")
        ref_after.append(ref.clone())

    def err(state: torch.Tensor, w: int) -> float:
        return float((state.double() - ref_after[w]).abs().max())

    def recovery() -> list[float]:
        s = s0.clone()
        out = []
        for w, (x, acc) in enumerate(steps):
            c = torch.zeros(B, H, W, K, device=device)
            kg = torch.zeros(B, H, W, 2 * K, dtype=act, device=device)
            q, k, v, g, b = x
            ops.verify_recovery(q, k, v, g, b, A_log, dt_bias, s, idx, qsl, c, kg,
                                lower_bound=lb, backend=bk)
            ops.commit(s, c, kg, A_log, dt_bias, ops.CommitPlan(idx, acc), lower_bound=lb,
                       backend=bk)
            out.append(err(s, w))
        return out

    def fused() -> list[float]:
        s = s0.clone()
        c = torch.zeros(2 * B, H, W, K, device=device)
        kg = torch.zeros(2 * B, H, W, 2 * K, dtype=act, device=device)
        prev = torch.zeros(B, dtype=torch.int32, device=device)
        out = []
        for w, (x, acc) in enumerate(steps):
            rows, prev_rows = idx + (w % 2) * B, idx + ((w + 1) % 2) * B
            q, k, v, g, b = x
            ops.verify_fused(q, k, v, g, b, A_log, dt_bias, s, idx, qsl, c, kg, prev,
                             lower_bound=lb, record_indices=rows,
                             prev_record_indices=prev_rows, backend=bk)
            prev = acc
            # the state this method holds after window w: the pending commit applied
            done = s.clone()
            ops.commit(done, c, kg, A_log, dt_bias, ops.CommitPlan(idx, acc), lower_bound=lb,
                       record_indices=rows, backend=bk)
            out.append(err(done, w))
        return out

    FullRun = Callable[[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor], object]

    def full(run: FullRun) -> list[float]:
        pool = torch.zeros(B * W, H, K, K, device=device)
        pool[cols[:, 0].long()] = s0
        nacc = torch.ones(B, dtype=torch.int32, device=device)
        out = []
        for w, (x, acc) in enumerate(steps):
            run(x, pool, nacc)
            nacc = acc
            last = pool[cols.long().gather(1, (acc.long() - 1)[:, None])[:, 0]]
            out.append(err(last, w))
        return out

    def ours_full(x: tuple[torch.Tensor, ...], pool: torch.Tensor,
                  nacc: torch.Tensor) -> object:
        q, k, v, g, b = x
        return ops.verify_full(q, k, v, g, b, A_log, dt_bias, pool, cols, nacc, qsl,
                               lower_bound=lb, backend=bk)

    runs: dict[str, Callable[[], list[float]]] = {
        "recovery": recovery, "fused": fused, "ours_full": lambda: full(ours_full)}
    if fla is not None:
        fwd = fla

        def fla_full(x: tuple[torch.Tensor, ...], pool: torch.Tensor,
                     nacc: torch.Tensor) -> object:
            q, k, v, g, b = x
            return peer_mod.fla_full_verify(fwd, q, k, v, g, b, A_log, dt_bias, pool, cols,
                                            nacc, qsl, lb)

        runs["fla_full"] = lambda: full(fla_full)
    result: dict[str, Any] = {"num_spec": num_spec, "batch": B, "windows": windows,
                              "gate_shift": GATE_SHIFT, "methods": {}}
    for name, fn in runs.items():
        errs = fn()
        result["methods"][name] = {"one_window": errs[0], "drift": errs[-1]}
    return result


def checks(fid: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's fidelity bounds for one measurement: committed state <= 1e-6 after one
    window, and the 16-window drift within 1.2x of fla-core's."""
    m = fid["methods"]
    out: list[dict[str, Any]] = []
    where = {"num_spec": fid["num_spec"], "batch": fid["batch"], "layers": 1}
    for name in ("recovery", "fused"):
        if name not in m:
            continue
        v = m[name]["one_window"]
        out.append({**where, "check": f"{name} state error, 1 window", "value": v,
                    "limit": ONE_WINDOW_LIMIT, "met": v <= ONE_WINDOW_LIMIT})
        if "fla_full" in m:
            ratio = m[name]["drift"] / m["fla_full"]["drift"]
            out.append({**where, "check": f"{name} / fla drift, {fid['windows']} windows",
                        "value": ratio, "limit": DRIFT_LIMIT, "met": ratio <= DRIFT_LIMIT})
    return out
