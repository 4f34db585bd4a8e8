// Window verify for KDA speculative decoding on NVIDIA GPUs (SM80+), K = V = 128.
//
// The same computation as vllm_recoverssm/ops/triton_window.py (its docstring derives it):
// per request and head, the outputs and corrections of up to 8 tokens come from ONE
// product of the FP32 checkpoint with 16 probe vectors [A_t k^_t | A_t q^_t], taken on the
// tensor cores as three tf32 products (hi*lo, lo*hi, hi*hi: fp32-accurate), plus an 8x8
// unit-triangular solve that every row shares. No token waits on a reduction over K, so
// a block reads its rows of the state once, issues a few hundred tensor-core products
// and writes its records: the kernel is bound by memory.
//
// Layout of the product (mma.sync m16n8k8, tf32): a warp owns 16 or 32 state rows; the
// reduction index K is permuted so that each lane's A fragment for two k-steps is one
// contiguous float4 of its row, which the lane loads straight from global memory (the
// same permutation is applied to the probes, so the sum is unchanged). Accumulator
// lanes g (= lane / 4) and t (= lane % 4) hold keys and queries of tokens 2t and 2t+1.
//
// Modes: RECOVERY writes outputs and records; FULL (the full-state baseline) also
// rebuilds and writes the state after every token; FUSED first replays the previous
// step's accepted records into the rows in registers and writes the committed state back.
// State rebuilds use exactly the instructions of triton_math.apply_record (ex2.approx,
// div.full, sqrt.approx.ftz, explicit fma; the key norm summed in float64), so this
// kernel's committed states equal the Triton commit's bit for bit.

#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace recoverssm {

constexpr int kD = 128;        // head dim, K = V
constexpr int kTP = 8;         // token slots: S + 1 <= 8
constexpr int kNP = 16;        // probe columns: 8 keys, then 8 queries
constexpr int kEPad = kD + 16; // probe row stride in shared memory (conflict-free float4)
constexpr int kFPad = kD + 4;
constexpr int kThreads = 128;
constexpr float kLog2e = 1.44269504088896340736f;

enum Mode { kRecovery = 0, kFull = 1, kFused = 2 };

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  const void* beta;
  const float* A_log;
  const float* dt_bias;
  float* state;
  long long state_slot;
  const int* sidx;
  const int* nacc;
  const int* qsl;
  float* corr;
  long long corr_row;
  void* kg;
  long long kg_row;
  const int* ridx;
  const float* pcorr;
  long long pcorr_row;
  const void* pkg;
  long long pkg_row;
  const int* pridx;
  const int* plen;
  void* out;
  int H;
  int ncols;
  float lower_bound;
  float scale;
};

// ---- the instructions Triton emits for triton_math.gate / unit / apply_record
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float div_full(float a, float b) {
  float y;
  asm("div.full.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}
__device__ __forceinline__ float sqrt_approx_ftz(float x) {
  float y;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float tl_exp(float x) { return ex2_approx(__fmul_rn(x, kLog2e)); }

// lower_bound * sigmoid(exp(A_log) * (raw_g + dt_bias))
__device__ __forceinline__ float log_decay(float raw_g, float a_coef, float dtb, float lb) {
  float x = __fadd_rn(raw_g, dtb);
  float e = tl_exp(__fmaf_rn(-a_coef, x, 0.0f));
  return __fmul_rn(div_full(1.0f, __fadd_rn(e, 1.0f)), lb);
}

// 1 / the key norm: the float64 sum of squares rounded once, plus eps, square-rooted
__device__ __forceinline__ float key_norm(double ss) {
  return sqrt_approx_ftz(__fadd_rn(__double2float_rn(ss), 1e-6f));
}

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 x) { *reinterpret_cast<float4*>(p) = x; }

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// tf32 split: hi keeps the top 19 bits, lo = x - hi exactly (the MMA drops lo's low bits)
__device__ __forceinline__ uint32_t tf32_hi(float x) { return __float_as_uint(x) & 0xffffe000u; }
__device__ __forceinline__ uint32_t tf32_lo(float x, uint32_t hi) {
  return __float_as_uint(__fsub_rn(x, __uint_as_float(hi)));
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// An A operand of two consecutive k-steps, split into tf32 hi / lo: rows g and g+8 as
// float4s (.x, .y: step 0 cols t, t+4; .z, .w: step 1).
struct SplitA {
  uint32_t hi[2][4], lo[2][4];
};
__device__ __forceinline__ SplitA split_a(float4 a_g, float4 a_g8) {
  const float av[2][4] = {{a_g.x, a_g8.x, a_g.y, a_g8.y}, {a_g.z, a_g8.z, a_g.w, a_g8.w}};
  SplitA r;
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      r.hi[s][i] = tf32_hi(av[s][i]);
      r.lo[s][i] = tf32_lo(av[s][i], r.hi[s][i]);
    }
  return r;
}

// An A operand already split (hi / lo float4s of rows g and g+8).
__device__ __forceinline__ SplitA split_pre(float4 hg, float4 lg, float4 hg8, float4 lg8) {
  const float hv[2][4] = {{hg.x, hg8.x, hg.y, hg8.y}, {hg.z, hg8.z, hg.w, hg8.w}};
  const float lv[2][4] = {{lg.x, lg8.x, lg.y, lg8.y}, {lg.z, lg8.z, lg.w, lg8.w}};
  SplitA r;
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      r.hi[s][i] = __float_as_uint(hv[s][i]);
      r.lo[s][i] = __float_as_uint(lv[s][i]);
    }
  return r;
}

// d += A * B over two k-steps in fp32-accurate tf32 (small terms first); B as hi / lo
// float4s of the same permuted k order.
__device__ __forceinline__ void mma_pair(float (&d)[4], const SplitA& a, float4 b_hi,
                                         float4 b_lo) {
  const uint32_t bh[2][2] = {{__float_as_uint(b_hi.x), __float_as_uint(b_hi.y)},
                             {__float_as_uint(b_hi.z), __float_as_uint(b_hi.w)}};
  const uint32_t bl[2][2] = {{__float_as_uint(b_lo.x), __float_as_uint(b_lo.y)},
                             {__float_as_uint(b_lo.z), __float_as_uint(b_lo.w)}};
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    mma_tf32(d, a.lo[s][0], a.lo[s][1], a.lo[s][2], a.lo[s][3], bh[s][0], bh[s][1]);
    mma_tf32(d, a.hi[s][0], a.hi[s][1], a.hi[s][2], a.hi[s][3], bl[s][0], bl[s][1]);
    mma_tf32(d, a.hi[s][0], a.hi[s][1], a.hi[s][2], a.hi[s][3], bh[s][0], bh[s][1]);
  }
}

// 8 consecutive activations as floats (one 16-byte load for bf16), zeros if not live
template <typename T> __device__ __forceinline__ void load8(const T* p, float (&x)[8], bool live);
template <> __device__ __forceinline__ void load8<float>(const float* p, float (&x)[8], bool live) {
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
  if (live) { a = ld4(p); b = ld4(p + 4); }
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}
template <> __device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16* p, float (&x)[8],
                                                                  bool live) {
  uint4 u = make_uint4(0u, 0u, 0u, 0u);
  if (live) u = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(w[i] << 16);
    x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
// 8 floats back to activations (exact: they were loaded from that dtype)
template <typename T> __device__ __forceinline__ void store8(T* p, const float (&x)[8]);
template <> __device__ __forceinline__ void store8<float>(float* p, const float (&x)[8]) {
  st4(p, make_float4(x[0], x[1], x[2], x[3]));
  st4(p + 4, make_float4(x[4], x[5], x[6], x[7]));
}
template <> __device__ __forceinline__ void store8<__nv_bfloat16>(__nv_bfloat16* p, const float (&x)[8]) {
  uint4 u;
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = (__float_as_uint(x[2 * i]) >> 16) | (__float_as_uint(x[2 * i + 1]) & 0xffff0000u);
  u.x = w[0]; u.y = w[1]; u.z = w[2]; u.w = w[3];
  *reinterpret_cast<uint4*>(p) = u;
}
__device__ __forceinline__ void st8(float* p, const float (&x)[8]) {
  st4(p, make_float4(x[0], x[1], x[2], x[3]));
  st4(p + 4, make_float4(x[4], x[5], x[6], x[7]));
}

// sums over the 16 lanes that share a token in the prologue (a fixed xor tree)
__device__ __forceinline__ float group16_sum(float x) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ double group16_sum(double x) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// One block: 4 warps, 16 * MT rows each, of one (request, head). The recovery verify
// asks for three blocks per SM (at most 168 registers): a block waits on memory and on
// short chains of dependent products, and more blocks in flight hide both.
template <int MODE, int MT, typename T>
__global__ void __launch_bounds__(kThreads, MODE == kRecovery ? 3 : 1) window_kernel(const Params p) {
  constexpr int kRows = 4 * 16 * MT;
  __shared__ __align__(16) float sE[2][kNP][kEPad];  // probes, tf32 hi / lo
  __shared__ __align__(16) float sF[kTP][kFPad];     // k^_t / A_t
  __shared__ __align__(16) float sKh[kTP][kD];       // FULL: k^_t; FUSED: previous k^_j
  __shared__ __align__(16) float sA[kTP][kD];        // their decays
  __shared__ __align__(16) float sG[kTP][kD];        // log-decays g_t
  __shared__ float sPart[4][kNP][kTP];                // couplings, one part per warp
  __shared__ float sCoup[kNP][kTP];
  __shared__ __align__(16) float sMinv[kTP][kTP];
  __shared__ __align__(16) float sQ[kTP][kTP];
  __shared__ float sB[kTP];

  const int n = blockIdx.y, h = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int H = p.H, W = p.ncols;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* g = static_cast<const T*>(p.g);
  const T* beta = static_cast<const T*>(p.beta);
  T* out = static_cast<T*>(p.out);

  // the slot is read before the first branch: a load a branch waits on costs a DRAM
  // latency with the L2 cold, and at a batch of one such chained latencies set the time
  const int start = p.qsl[n];
  const int qend = p.qsl[n + 1];
  long long slot;
  if (MODE == kFull) {
    // an empty row may carry no accepted count: clamped, its (unused) read stays in range
    slot = p.sidx[(long long)n * W + max(p.nacc[n], 1) - 1];
  } else {
    slot = p.sidx[n];
  }
  const int ntok = qend - start;
  if (MODE != kFused && ntok <= 0) return;
  const int row0 = blockIdx.x * kRows + warp * 16 * MT;  // this warp's first row
  if (slot < 0) {
    for (int i = tid; i < ntok * kRows; i += kThreads) {
      const int t = i / kRows, r = blockIdx.x * kRows + i % kRows;
      out[((long long)(start + t) * H + h) * kD + r] = from_f<T>(0.0f);
    }
    return;
  }
  float* sbase = p.state + slot * p.state_slot + (long long)h * kD * kD;

  // ---- the rows' state, straight into A-fragment order (issued first: the longest wait)
  float4 s[MT][2][8];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float* rp = sbase + (long long)(row0 + mt * 16 + hf * 8 + g8) * kD + 4 * t4;
#pragma unroll
      for (int m = 0; m < 8; ++m) s[mt][hf][m] = ld4(rp + 16 * m);
    }
  // v of tokens 2t4, 2t4+1 for the rows
  float vt[MT][2][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = 2 * t4 + e, r = row0 + mt * 16 + hf * 8 + g8;
        vt[mt][hf][e] = t < ntok ? to_f<T>(v[((long long)(start + t) * H + h) * kD + r]) : 0.0f;
      }
  int plen = 0;
  long long prow = n;
  float cprev[kTP][MT][2];
  if (MODE == kFused) {
    plen = p.plen[n];
    if (p.pridx != nullptr) prow = p.pridx[n];
#pragma unroll
    for (int j = 0; j < kTP; ++j)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int r = row0 + mt * 16 + hf * 8 + g8;
          cprev[j][mt][hf] =
              j < plen ? p.pcorr[prow * p.pcorr_row + ((long long)h * W + j) * kD + r] : 0.0f;
        }
  }
  long long rrow = n;
  if (MODE != kFull && p.ridx != nullptr) rrow = p.ridx[n];
  const bool has_rec = rrow >= 0;

  // ---- per head: thread (pt, pc) owns token pt's key, query and gate at columns
  // pc..pc+7 (16 threads per token, one 16-byte load each), so no work repeats per thread
  const int pt = tid >> 4, pc = (tid & 15) * 8;
  const bool plive = pt < ntok;
  const float a_coef = tl_exp(p.A_log[h]);
  float dtb[8], kx[8], qx[8], gx[8];
  {
    const float4 d0 = ld4(p.dt_bias + h * kD + pc), d1 = ld4(p.dt_bias + h * kD + pc + 4);
    dtb[0] = d0.x; dtb[1] = d0.y; dtb[2] = d0.z; dtb[3] = d0.w;
    dtb[4] = d1.x; dtb[5] = d1.y; dtb[6] = d1.z; dtb[7] = d1.w;
  }
  const long long poff = ((long long)(start + pt) * H + h) * kD + pc;
  load8<T>(k + poff, kx, plive);
  load8<T>(q + poff, qx, plive);
  load8<T>(g + poff, gx, plive);
  // beta and (fused) the previous records before the kg store below: the compiler cannot
  // move a load above a store that might alias it, and issued after it their latency
  // would stall the prologue's first barrier
  const float braw =
      tid < kTP && tid < ntok ? to_f<T>(beta[(long long)(start + tid) * H + h]) : 0.0f;
  float pk[8], pg[8];
  if (MODE == kFused) {
    const T* row = static_cast<const T*>(p.pkg) + prow * p.pkg_row + ((long long)h * W + pt) * 2 * kD + pc;
    load8<T>(row, pk, pt < plen);
    load8<T>(row + kD, pg, pt < plen);
  }
  if (MODE != kFull && has_rec && blockIdx.x == 0 && plive) {
    T* row = static_cast<T*>(p.kg) + rrow * p.kg_row + ((long long)h * W + pt) * 2 * kD + pc;
    store8<T>(row, kx);
    store8<T>(row + kD, gx);
  }
  float sk = 0.0f, sq = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    sk = fmaf(kx[i], kx[i], sk);
    sq = fmaf(qx[i], qx[i], sq);
  }
  sk = group16_sum(sk);
  sq = group16_sum(sq);
  const float ik = rsqrtf(sk + 1e-6f), iq = p.scale * rsqrtf(sq + 1e-6f);
  float gl[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) gl[i] = plive ? log_decay(gx[i], a_coef, dtb[i], p.lower_bound) : 0.0f;
  st4(&sG[pt][pc], make_float4(gl[0], gl[1], gl[2], gl[3]));
  st4(&sG[pt][pc + 4], make_float4(gl[4], gl[5], gl[6], gl[7]));
  if (MODE == kFull) {
    // the commit's key norm and decay, for rebuilding the states (bit for bit)
    double ss = 0.0;
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += (double)kx[i] * (double)kx[i];
    const float nrm = key_norm(group16_sum(ss));
    float kh[8], a[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      kh[i] = div_full(kx[i], nrm);
      a[i] = plive ? tl_exp(gl[i]) : 1.0f;
    }
    st8(&sKh[pt][pc], kh);
    st8(&sA[pt][pc], a);
  }
  if (MODE == kFused) {
    // the previous step's record pt: its key norm and decay (bit for bit as commit)
    const bool live = pt < plen;
    double ss = 0.0;
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += (double)pk[i] * (double)pk[i];
    const float nrm = key_norm(group16_sum(ss));
    float kh[8], a[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      kh[i] = div_full(pk[i], nrm);
      a[i] = live ? tl_exp(log_decay(pg[i], a_coef, dtb[i], p.lower_bound)) : 1.0f;
    }
    st8(&sKh[pt][pc], kh);
    st8(&sA[pt][pc], a);
  }
  if (tid < kTP) {
    const int t = tid;
    sB[t] = t < ntok ? 1.0f / (1.0f + __expf(-braw)) : 0.0f;
  }
  __syncthreads();
  {
    // cumulative log-decay of tokens 0..pt, summed in token order
    float G[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int u = 0; u < kTP; ++u) {
      if (u <= pt) {
        const float4 x0 = ld4(&sG[u][pc]), x1 = ld4(&sG[u][pc + 4]);
        G[0] += x0.x; G[1] += x0.y; G[2] += x0.z; G[3] += x0.w;
        G[4] += x1.x; G[5] += x1.y; G[6] += x1.z; G[7] += x1.w;
      }
    }
    float ekh[8], ekl[8], eqh[8], eql[8], fv[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float A = ex2_approx(G[i] * kLog2e), Ainv = ex2_approx(-G[i] * kLog2e);
      const float kh = kx[i] * ik, ek = A * kh, eq = A * (qx[i] * iq);
      const uint32_t hk = tf32_hi(ek), hq = tf32_hi(eq);
      ekh[i] = __uint_as_float(hk);
      ekl[i] = __uint_as_float(tf32_lo(ek, hk));
      eqh[i] = __uint_as_float(hq);
      eql[i] = __uint_as_float(tf32_lo(eq, hq));
      fv[i] = Ainv * kh;
    }
    st8(&sE[0][pt][pc], ekh);
    st8(&sE[1][pt][pc], ekl);
    st8(&sE[0][kTP + pt][pc], eqh);
    st8(&sE[1][kTP + pt][pc], eql);
    st8(&sF[pt][pc], fv);
  }
  __syncthreads();

  if (MODE == kFused) {
    // the deferred commit of the previous step: S = S * diag(a_j) + outer(c_j, k^_j)
#pragma unroll
    for (int j = 0; j < kTP; ++j) {
      if (j >= plen) break;  // uniform over the block; the unrolled body keeps cprev in registers
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const float4 kh = ld4(&sKh[j][16 * m + 4 * t4]);
        const float4 a = ld4(&sA[j][16 * m + 4 * t4]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const float c = cprev[j][mt][hf];
            float4& x = s[mt][hf][m];
            x.x = __fmaf_rn(c, kh.x, __fmul_rn(x.x, a.x));
            x.y = __fmaf_rn(c, kh.y, __fmul_rn(x.y, a.y));
            x.z = __fmaf_rn(c, kh.z, __fmul_rn(x.z, a.z));
            x.w = __fmaf_rn(c, kh.w, __fmul_rn(x.w, a.w));
          }
      }
    }
    if (plen > 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float* rp = sbase + (long long)(row0 + mt * 16 + hf * 8 + g8) * kD + 4 * t4;
#pragma unroll
          for (int m = 0; m < 8; ++m) st4(rp + 16 * m, s[mt][hf][m]);
        }
    }
    if (ntok <= 0) return;  // after the block's last barrier: safe
  }

  // ---- couplings coup[p][j] = probe_p . (k^_j / A_j) on the tensor cores, each warp
  // over a quarter of K; the parts are added in a fixed order
  {
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int mm = 0; mm < 2; ++mm) {
      const int c = 16 * (2 * warp + mm) + 4 * t4;
      const float4 ah_g = ld4(&sE[0][g8][c]), al_g = ld4(&sE[1][g8][c]);
      const float4 ah_g8 = ld4(&sE[0][g8 + 8][c]), al_g8 = ld4(&sE[1][g8 + 8][c]);
      const float4 f = ld4(&sF[g8][c]);
      const uint32_t fh[4] = {tf32_hi(f.x), tf32_hi(f.y), tf32_hi(f.z), tf32_hi(f.w)};
      const float4 fhi = make_float4(__uint_as_float(fh[0]), __uint_as_float(fh[1]),
                                     __uint_as_float(fh[2]), __uint_as_float(fh[3]));
      const float4 flo = make_float4(__uint_as_float(tf32_lo(f.x, fh[0])),
                                     __uint_as_float(tf32_lo(f.y, fh[1])),
                                     __uint_as_float(tf32_lo(f.z, fh[2])),
                                     __uint_as_float(tf32_lo(f.w, fh[3])));
      mma_pair(d, split_pre(ah_g, al_g, ah_g8, al_g8), fhi, flo);
    }
    sPart[warp][g8][2 * t4] = d[0];
    sPart[warp][g8][2 * t4 + 1] = d[1];
    sPart[warp][g8 + 8][2 * t4] = d[2];
    sPart[warp][g8 + 8][2 * t4 + 1] = d[3];
  }
  __syncthreads();
  {
    const int pp = tid >> 3, j = tid & 7;
    sCoup[pp][j] = (sPart[0][pp][j] + sPart[1][pp][j]) + (sPart[2][pp][j] + sPart[3][pp][j]);
  }
  __syncthreads();
  if (tid < kTP) {
    // column j of M^-1, M = I + diag(b) L (L: strictly lower key couplings), then Q = G M^-1
    const int j = tid;
    float x[kTP];
#pragma unroll
    for (int i = 0; i < kTP; ++i) {
      float acc = i == j ? 1.0f : 0.0f;
      const float bi = sB[i];
#pragma unroll
      for (int l = 0; l < i; ++l) acc -= bi * sCoup[i][l] * x[l];
      x[i] = acc;
      sMinv[i][j] = acc;
    }
#pragma unroll
    for (int t = 0; t < kTP; ++t) {
      float acc = 0.0f;
#pragma unroll
      for (int l = 0; l <= t; ++l) acc += sCoup[kTP + t][l] * x[l];
      sQ[t][j] = acc;
    }
  }
  __syncthreads();

  // ---- P = S [probes] for the rows
  // two accumulator sets (even and odd k-pairs) halve the chains of dependent products
  float acc2[2][MT][2][4];
#pragma unroll
  for (int par = 0; par < 2; ++par)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc2[par][mt][nt][e] = 0.0f;
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    const int c = 16 * m + 4 * t4;
    const float4 bh0 = ld4(&sE[0][g8][c]), bl0 = ld4(&sE[1][g8][c]);
    const float4 bh1 = ld4(&sE[0][kTP + g8][c]), bl1 = ld4(&sE[1][kTP + g8][c]);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const SplitA a = split_a(s[mt][0][m], s[mt][1][m]);
      mma_pair(acc2[m & 1][mt][0], a, bh0, bl0);
      mma_pair(acc2[m & 1][mt][1], a, bh1, bl1);
    }
  }
  float acc[MT][2][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = acc2[0][mt][nt][e] + acc2[1][mt][nt][e];

  // ---- the solve, per row: c = M^-1 r and o = p_q + Q r with r_t = b_t (v_t - p_k)
  float mi[2][kTP], qm[2][kTP];
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int j = 0; j < kTP; ++j) {
      mi[e][j] = sMinv[2 * t4 + e][j];
      qm[e][j] = sQ[2 * t4 + e][j];
    }
  const float b0 = sB[2 * t4], b1 = sB[2 * t4 + 1];
  float cfull[MT][2][kTP];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = row0 + mt * 16 + hf * 8 + g8;
      const float ra = b0 * (vt[mt][hf][0] - acc[mt][0][2 * hf]);
      const float rb = b1 * (vt[mt][hf][1] - acc[mt][0][2 * hf + 1]);
      float rv[kTP];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        rv[2 * u] = __shfl_sync(0xffffffffu, ra, (lane & ~3) | u);
        rv[2 * u + 1] = __shfl_sync(0xffffffffu, rb, (lane & ~3) | u);
      }
      float c[2], o[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float cs = 0.0f, os = acc[mt][1][2 * hf + e];
#pragma unroll
        for (int j = 0; j < kTP; ++j) {
          cs = fmaf(mi[e][j], rv[j], cs);
          os = fmaf(qm[e][j], rv[j], os);
        }
        c[e] = cs;
        o[e] = os;
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = 2 * t4 + e;
        if (t < ntok) {
          out[((long long)(start + t) * H + h) * kD + r] = from_f<T>(o[e]);
          if (MODE != kFull && has_rec)
            p.corr[rrow * p.corr_row + ((long long)h * W + t) * kD + r] = c[e];
        }
      }
      if (MODE == kFull) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          cfull[mt][hf][2 * u] = __shfl_sync(0xffffffffu, c[0], (lane & ~3) | u);
          cfull[mt][hf][2 * u + 1] = __shfl_sync(0xffffffffu, c[1], (lane & ~3) | u);
        }
      }
    }

  if (MODE == kFull) {
    // the state after every token, rebuilt as commit does, into its column
    for (int t = 0; t < ntok; ++t) {
      const long long dst = p.sidx[(long long)n * W + t];
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const float4 kh = ld4(&sKh[t][16 * m + 4 * t4]);
        const float4 a = ld4(&sA[t][16 * m + 4 * t4]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            float cv = 0.0f;
#pragma unroll
            for (int u = 0; u < kTP; ++u) cv = u == t ? cfull[mt][hf][u] : cv;
            float4& x = s[mt][hf][m];
            x.x = __fmaf_rn(cv, kh.x, __fmul_rn(x.x, a.x));
            x.y = __fmaf_rn(cv, kh.y, __fmul_rn(x.y, a.y));
            x.z = __fmaf_rn(cv, kh.z, __fmul_rn(x.z, a.z));
            x.w = __fmaf_rn(cv, kh.w, __fmul_rn(x.w, a.w));
          }
      }
      if (dst >= 0) {
        float* dbase = p.state + dst * p.state_slot + (long long)h * kD * kD;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            float* rp = dbase + (long long)(row0 + mt * 16 + hf * 8 + g8) * kD + 4 * t4;
#pragma unroll
            for (int m = 0; m < 8; ++m) st4(rp + 16 * m, s[mt][hf][m]);
          }
      }
    }
  }
}

template <int MODE, int MT, typename T>
cudaError_t launch_typed(const Params& p, int N, cudaStream_t stream) {
  const dim3 grid(kD / (64 * MT), N, p.H);
  window_kernel<MODE, MT, T><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// One mode's launches for bfloat16 (act_dtype 0) or float32 (2) activations and 16 or 32
// rows per warp; each mode is compiled in its own file so that the builds run in parallel.
template <int MODE>
cudaError_t launch_mode(const Params& p, int act_dtype, int rows_per_warp, int N,
                        cudaStream_t s) {
  if (act_dtype == 0)
    return rows_per_warp == 32 ? launch_typed<MODE, 2, __nv_bfloat16>(p, N, s)
                               : launch_typed<MODE, 1, __nv_bfloat16>(p, N, s);
  return rows_per_warp == 32 ? launch_typed<MODE, 2, float>(p, N, s)
                             : launch_typed<MODE, 1, float>(p, N, s);
}

cudaError_t launch_recovery(const Params& p, int act_dtype, int rows_per_warp, int N,
                            cudaStream_t s);
cudaError_t launch_full(const Params& p, int act_dtype, int rows_per_warp, int N,
                        cudaStream_t s);
cudaError_t launch_fused(const Params& p, int act_dtype, int rows_per_warp, int N,
                         cudaStream_t s);

}  // namespace recoverssm
