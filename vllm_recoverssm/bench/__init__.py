"""Decode-step benchmark of the state operations (``recoverssm bench``).

Modules, one job each: :mod:`grid` (what to measure), :mod:`accounting` (unique bytes per
op and state bytes per request), :mod:`timing` (CUDA-graph replays after an L2 flush, or
eager calls in smoke mode), :mod:`peer` (fla-core's full-state kernel), :mod:`workload`
(tensors and op closures of one grid point), :mod:`runner` (the run), :mod:`report`
(tables, targets, JSON), :mod:`plot` (PNG) and :mod:`progress` (stderr progress bar).
"""
