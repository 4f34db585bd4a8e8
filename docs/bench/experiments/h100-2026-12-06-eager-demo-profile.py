"""Where the demo's decode time goes with the eager commit (S = 3, 64 requests, glm-tp2).

Runs ``run_demo`` under torch.profiler (CUDA activity) with the eager commit and prints the
GPU time of the KDA kernels of each mode (full-state verify; recovery verify, commit and
conv compaction), the rest of the GPU time, and the demo's own decode tokens/s.
Usage: python docs/bench/experiments/h100-2026-12-06-eager-demo-profile.py [fused]
"""

import sys
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile

from vllm_recoverssm.reference.demo import DemoOptions, run_demo

fused = "fused" in sys.argv[1:]
opts = DemoOptions(device="cuda", model="glm-tp2", dtype="float32", num_spec=3,
                   num_requests=64, repeat=1, fused_commit=fused)
run_demo(opts)  # warm-up: compiles kernels, tunes
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    report = run_demo(opts)
totals: dict[str, float] = defaultdict(float)
counts: dict[str, int] = defaultdict(int)
for e in prof.key_averages():
    if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
        totals[e.key] += e.self_device_time_total
        counts[e.key] += e.count
all_us = sum(totals.values())
print(f"commit fused={fused}; GPU kernel time in the profiled run: {all_us / 1e3:.1f} ms")
for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:25]:
    print(f"{v / 1e3:9.2f} ms {counts[k]:7d}x  {k[:110]}")
for name, m in report.modes.items():
    print(name, "decode tok/s", round(m.decode_tokens_per_second, 1), "seconds",
          round(m.seconds, 3), "steps", m.steps, "graph steps", m.graph_steps)
