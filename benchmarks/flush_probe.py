"""Why fla-core slowed under a read flush: host gaps, clocks or L2 state."""
import statistics, sys, time, torch
from vllm_recoverssm.bench import workload as wl, accounting as acc
from vllm_recoverssm.bench.peer import load_peer

dev = torch.device("cuda")
peer = load_peer(dev, True)
MIB = 1 << 20
buf = torch.empty(256 * MIB // 4, dtype=torch.int32, device=dev)
acc_out = torch.zeros((), dtype=torch.int64, device=dev)

facc = torch.zeros((), dtype=torch.float32, device=dev)
def flush(mode, i):
    if mode.startswith("write"):
        buf.fill_(i & 0x7FFFFFFF)
    elif mode.startswith("readf"):
        torch.sum(buf.view(torch.float32), dim=0, out=facc)
    elif mode.startswith("read64"):
        torch.sum(buf, dim=0, dtype=torch.int64, out=acc_out)
    if mode.endswith("+gap"):
        torch.cuda._sleep(2_000_000)  # about 1 ms of one spinning thread before the op

def measure(op, mode, reps=50, warm=10):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(); op()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        op()
    torch.cuda.synchronize()
    for i in range(warm):
        flush(mode, i); g.replay()
    f0 = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    st = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(reps):
        f0[i].record(); flush(mode, i); st[i].record(); g.replay(); en[i].record()
    host = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    op_ms = statistics.median(s_.elapsed_time(e) for s_, e in zip(st, en))
    fl_ms = statistics.median(a.elapsed_time(b) for a, b in zip(f0, st))
    gap = statistics.median(en[i - 1].elapsed_time(f0[i]) for i in range(1, reps))
    del g
    return op_ms, fl_ms, gap, host

modes = ["write", "readf", "read64", "read64+gap", "readf+gap", "none"]
def run_point(S, B, L):
    shape = acc.OpShape(32, 128, 128, S, 2)
    step = wl.make_step(shape, B, L, torch.bfloat16, dev, "auto", 0)
    full = wl.make_full_pools(step, L, 0)
    ops = wl.full_ops(step, full, peer.fwd)
    rec = wl.make_recovery_pools(step, 0)
    rops = wl.recovery_ops(step, rec)
    sel = {"fla": ops["fla_full"], "ours_full": ops["ours_full"], "verify": rops["verify"],
           "total_all": rops["total_all"], "total_2": rops["total_2"], "fused_2": rops["fused_2"]}
    for rnd in range(2):
        for m in modes:
            for name, op in sel.items():
                o, f, g, h = measure(op, m)
                print(f"S={S} B={B} L={L} round={rnd} mode={m:10s} {name:10s} op={o*1e3:9.2f}us "
                      f"flush={f*1e3:8.2f}us gap={g*1e3:8.2f}us host/iter={h*1e3:8.2f}us", flush=True)
    del step, full, ops, rec, rops; torch.cuda.empty_cache()

def two_kernels():
    # a read of the verify's bytes, then a copy of the commit's: two streaming launches
    for tag, vb, cb in (("S3 all", 73.02, 132.0), ("S3 two", 73.02, 130.0),
                        ("S7 all", 82.03, 136.0), ("S7 two", 82.03, 130.0)):
        x = torch.ones(int(vb * MIB) // 4, device=dev); r = torch.zeros((), device=dev)
        a = torch.ones(int(cb * MIB / 2) // 4, device=dev); b = torch.empty_like(a)
        def op():
            torch.sum(x, dim=0, out=r); b.copy_(a)
        def op2():
            torch.sum(x, dim=0, out=r); torch.mul(a, 1.0, out=b)
        for m in ("write", "readf", "none"):
            print(f"two-kernels {tag} mode={m:6s} sum+copy={measure(op, m)[0]*1e3:8.2f}us "
                  f"sum+mul={measure(op2, m)[0]*1e3:8.2f}us", flush=True)
        del x, a, b

def read_tax():
    # a pure read (sum) and a copy of N MiB after each flush
    for n in (32, 64, 128, 256):
        x = torch.ones(n * MIB // 4, device=dev); y = torch.empty_like(x); r = torch.zeros((), device=dev)
        for m in ("write", "readf", "none"):
            o1 = measure(lambda: torch.sum(x, dim=0, out=r), m)[0]
            o2 = measure(lambda: y.copy_(x), m)[0]
            print(f"tax N={n}MiB mode={m:10s} read-sum={o1*1e3:8.2f}us copy={o2*1e3:8.2f}us", flush=True)
        del x, y

print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).L2_cache_size // MIB, "MiB L2", flush=True)
read_tax()
two_kernels()
for pt in [(3, 32, 1), (7, 1, 34), (7, 32, 1), (3, 1, 1), (7, 128, 1)]:
    run_point(*pt)
