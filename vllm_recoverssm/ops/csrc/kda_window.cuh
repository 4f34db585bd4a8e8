// Window verify for KDA speculative decoding on NVIDIA GPUs (SM80+), K = V = 128.
//
// The same computation as vllm_recoverssm/ops/triton_window.py (its docstring derives it):
// per request and head, the outputs and corrections of up to TP = 8 tokens come from ONE
// product of the FP32 checkpoint with 2 TP probe vectors [A_t k^_t | A_t q^_t], taken on
// the tensor cores as three tf32 products (hi*lo, lo*hi, hi*hi: fp32-accurate), plus a
// TP x TP unit-triangular solve that every row shares. Windows of at most 4 tokens
// (S <= 3) take TP = 4: 8 probes, one n-tile, half the products and half the per-row
// solve. No token waits on a reduction over K, so a block reads its rows of the state
// once, issues a few hundred tensor-core products and writes its records.
//
// Layout of the product (mma.sync m16n8k8, tf32): a warp owns 16 or 32 state rows; the
// reduction index K is permuted so that each lane's A fragment for two k-steps is one
// contiguous float4 of its row, which the lane loads straight from global memory (the
// same permutation is applied to the probes, so the sum is unchanged). Accumulator
// lanes g (= lane / 4) and t (= lane % 4) hold keys and queries of tokens 2t and 2t+1
// (TP = 8: two n-tiles), or lanes t < 2 the keys and t >= 2 the queries of tokens
// 2(t % 2) and 2(t % 2) + 1 (TP = 4: one n-tile).
//
// Modes: RECOVERY writes outputs and records; FULL (the full-state baseline) also
// rebuilds and writes the state after every token; FUSED first replays the previous
// step's accepted records into the rows in registers and writes the committed state back.
// State rebuilds use exactly the instructions of triton_math.apply_record (ex2.approx,
// div.full, sqrt.approx.ftz, explicit fma; the key norm summed in float64), so this
// kernel's committed states equal the Triton commit's bit for bit.

#pragma once

#include "kda_math.cuh"

namespace recoverssm {

constexpr int kTP = 8;         // token slots: S + 1 <= 8
constexpr int kNP = 16;        // probe columns: 8 keys, then 8 queries
constexpr int kHalfCols = 4;   // windows up to this wide take TP = 4 (cuda_window.HALF_WIDTH_COLS)
constexpr int kEPad = kD + 16; // probe row stride in shared memory (conflict-free float4)
constexpr int kFPad = kD + 4;
constexpr int kThreads = 128;

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

// Blocks per SM that an instantiation asks the compiler to fit (its register bound). A
// block waits on memory and on short chains of dependent products, and more blocks in
// flight hide both. The recovery verify streams its rows (kRecoveryDepth), which frees
// the registers for four 32-row blocks (128 registers) or five 16-row ones (96), for a
// few dozen spilled bytes (`recoverssm kernel-resources` prints them per compiler and
// architecture; tests/ops/test_cuda_resources.py holds every kernel to its budget). The
// fused verify of a half-width window at 16 rows per warp asks for four: at 126
// registers it spills nothing. The other fused and full-state instantiations ask for
// none: at 16 rows three of their blocks fit an SM as compiled, and at 32 rows a bound
// of three spilled and was 40% slower (docs/bench/h200-2026-12-01-verify-profile.md).
//
// Each bound, and kRecoveryDepth, can be replaced at build time for a tuning sweep
// (RECOVERSSM_<name>, set through cuda_window.DEFINES_ENV; cuda_window.TUNING_DEFINES
// lists the names and their ranges; the defaults are here).
#ifndef RECOVERSSM_RECOVERY_BLOCKS_16
#define RECOVERSSM_RECOVERY_BLOCKS_16 5
#endif
#ifndef RECOVERSSM_RECOVERY_BLOCKS_32
#define RECOVERSSM_RECOVERY_BLOCKS_32 4
#endif
#ifndef RECOVERSSM_FUSED_BLOCKS_16_TP4
#define RECOVERSSM_FUSED_BLOCKS_16_TP4 4
#endif
#ifndef RECOVERSSM_FUSED_BLOCKS_16_TP8
#define RECOVERSSM_FUSED_BLOCKS_16_TP8 1
#endif
#ifndef RECOVERSSM_FUSED_BLOCKS_32
#define RECOVERSSM_FUSED_BLOCKS_32 1
#endif
#ifndef RECOVERSSM_FULL_BLOCKS_16
#define RECOVERSSM_FULL_BLOCKS_16 1
#endif
#ifndef RECOVERSSM_FULL_BLOCKS_32
#define RECOVERSSM_FULL_BLOCKS_32 1
#endif
#ifndef RECOVERSSM_RECOVERY_DEPTH
#define RECOVERSSM_RECOVERY_DEPTH 4
#endif

constexpr int min_blocks_per_sm(int mode, int mt, int tp) {
  if (mode == kRecovery) return mt == 2 ? RECOVERSSM_RECOVERY_BLOCKS_32 : RECOVERSSM_RECOVERY_BLOCKS_16;
  if (mode == kFused) {
    if (mt == 2) return RECOVERSSM_FUSED_BLOCKS_32;
    return tp == 4 ? RECOVERSSM_FUSED_BLOCKS_16_TP4 : RECOVERSSM_FUSED_BLOCKS_16_TP8;
  }
  return mt == 2 ? RECOVERSSM_FULL_BLOCKS_32 : RECOVERSSM_FULL_BLOCKS_16;
}

// k-steps of state rows a recovery warp has in flight ahead of the product: it loads four
// before the prologue and the rest as the product goes, so it holds half its rows at a
// time. The fused and full-state verifies hold every row anyway (the replay before the
// product, the rebuild after it), and load them all at once.
constexpr int kRecoveryDepth = RECOVERSSM_RECOVERY_DEPTH;
static_assert(kRecoveryDepth >= 1 && kRecoveryDepth <= 8, "RECOVERSSM_RECOVERY_DEPTH: 1..8");

// One block: 4 warps, 16 * MT rows each, of one (request, head); TP (4 or 8) token slots,
// so a window of at most four tokens takes half the products.
template <int MODE, int MT, int TP, typename T>
__global__ void __launch_bounds__(kThreads, min_blocks_per_sm(MODE, MT, TP)) window_kernel(const Params p) {
  static_assert(TP == 4 || TP == 8, "4 or 8 token slots");
  constexpr int kRows = 4 * 16 * MT;
  constexpr int NP = 2 * TP;           // live probe columns: TP keys, then TP queries
  constexpr int NT = NP / 8;           // n-tiles of the main product
  constexpr int PL = kD / TP;          // prologue lanes per token
  constexpr int PC = TP;               // prologue columns per thread
  // the coupling product is one m16n8 tile: 16 probe rows by 8 token columns, so those
  // buffers keep 16 and 8 rows whatever TP (rows past NP and TP are never read back)
  __shared__ __align__(16) float sE[2][kNP][kEPad];  // probes, tf32 hi / lo
  __shared__ __align__(16) float sF[kTP][kFPad];     // k^_t / A_t
  __shared__ __align__(16) float sKh[TP][kD];        // FULL: k^_t; FUSED: previous k^_j
  __shared__ __align__(16) float sA[TP][kD];         // their decays
  __shared__ __align__(16) float sG[TP][kD];         // log-decays g_t
  __shared__ float sPart[4][kNP][kTP];                // couplings, one part per warp
  __shared__ float sCoup[kNP][kTP];
  __shared__ __align__(16) float sMinv[TP][TP];
  __shared__ __align__(16) float sQ[TP][TP];
  __shared__ float sB[kTP];

  const int h = blockIdx.y, n = blockIdx.z;
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

  // ---- the rows' state, straight into A-fragment order; the recovery verify issues its
  // first kRecoveryDepth k-steps up front and the rest in the product
  float4 s[MT][2][8];
  constexpr int kDepth = MODE == kRecovery ? kRecoveryDepth : 8;
  auto load_step = [&](int m) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        s[mt][hf][m] = ld4(sbase + (long long)(row0 + mt * 16 + hf * 8 + g8) * kD + 4 * t4 + 16 * m);
  };
  // Up front means after the per-head loads (k, q, g, beta, v, previous records), so that
  // the prologue, which waits on them alone, overlaps the rows' flight. The fused verify
  // of windows longer than kHalfCols issues its rows first instead: holding every row and
  // the replay's records in 239-254 registers, it was 3-6% slower the other way round
  // (docs/bench/h200-2026-12-01-verify-profile.md).
  constexpr bool kHeadLoadsFirst = MODE != kFused || TP == 4;
  if (!kHeadLoadsFirst) {
#pragma unroll
    for (int m = 0; m < kDepth; ++m) load_step(m);
  }
  // v of tokens 2t4, 2t4+1 for the rows (with TP = 4, lanes t4 >= 2 hold queries: no v)
  float vt[MT][2][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = 2 * t4 + e, r = row0 + mt * 16 + hf * 8 + g8;
        vt[mt][hf][e] = t < ntok && t < TP ? to_f<T>(v[((long long)(start + t) * H + h) * kD + r]) : 0.0f;
      }
  int plen = 0;
  long long prow = n;
  float cprev[TP][MT][2];
  if (MODE == kFused) {
    plen = p.plen[n];
    if (p.pridx != nullptr) prow = p.pridx[n];
#pragma unroll
    for (int j = 0; j < TP; ++j)
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
  // pc..pc+PC-1 (PL threads per token, one load each), so no work repeats per thread
  const int pt = tid >> (TP == 8 ? 4 : 5), pc = (tid & (PL - 1)) * PC;
  const bool plive = pt < ntok;
  const float a_coef = tl_exp(p.A_log[h]);
  float dtb[PC], kx[PC], qx[PC], gx[PC];
  VecIO<float, PC>::load(p.dt_bias + h * kD + pc, dtb, true);
  const long long poff = ((long long)(start + pt) * H + h) * kD + pc;
  VecIO<T, PC>::load(k + poff, kx, plive);
  VecIO<T, PC>::load(q + poff, qx, plive);
  VecIO<T, PC>::load(g + poff, gx, plive);
  // beta and (fused) the previous records before the kg store below: the compiler cannot
  // move a load above a store that might alias it, and issued after it their latency
  // would stall the prologue's first barrier
  const float braw =
      tid < kTP && tid < ntok ? to_f<T>(beta[(long long)(start + tid) * H + h]) : 0.0f;
  float pk[PC], pg[PC];
  if (MODE == kFused) {
    const T* row = static_cast<const T*>(p.pkg) + prow * p.pkg_row + ((long long)h * W + pt) * 2 * kD + pc;
    VecIO<T, PC>::load(row, pk, pt < plen);
    VecIO<T, PC>::load(row + kD, pg, pt < plen);
  }
  if (kHeadLoadsFirst) {
#pragma unroll
    for (int m = 0; m < kDepth; ++m) load_step(m);
  }
  if (MODE != kFull && has_rec && blockIdx.x == 0 && plive) {
    T* row = static_cast<T*>(p.kg) + rrow * p.kg_row + ((long long)h * W + pt) * 2 * kD + pc;
    VecIO<T, PC>::store(row, kx);
    VecIO<T, PC>::store(row + kD, gx);
  }
  float sk = 0.0f, sq = 0.0f;
#pragma unroll
  for (int i = 0; i < PC; ++i) {
    sk = fmaf(kx[i], kx[i], sk);
    sq = fmaf(qx[i], qx[i], sq);
  }
  sk = group_sum<PL>(sk);
  sq = group_sum<PL>(sq);
  const float ik = rsqrtf(sk + 1e-6f), iq = p.scale * rsqrtf(sq + 1e-6f);
  float gl[PC];
#pragma unroll
  for (int i = 0; i < PC; ++i) gl[i] = plive ? log_decay(gx[i], a_coef, dtb[i], p.lower_bound) : 0.0f;
  VecIO<float, PC>::store(&sG[pt][pc], gl);
  if (MODE == kFull) {
    // the commit's key norm and decay, for rebuilding the states (bit for bit)
    const float nrm = group_key_norm<PL>(kx);
    float kh[PC], a[PC];
#pragma unroll
    for (int i = 0; i < PC; ++i) {
      kh[i] = div_full(kx[i], nrm);
      a[i] = plive ? tl_exp(gl[i]) : 1.0f;
    }
    VecIO<float, PC>::store(&sKh[pt][pc], kh);
    VecIO<float, PC>::store(&sA[pt][pc], a);
  }
  if (MODE == kFused) {
    // the previous step's record pt: its key norm and decay (bit for bit as commit)
    store_record_update<PL>(pk, pg, dtb, a_coef, p.lower_bound, pt < plen, &sKh[pt][pc],
                            &sA[pt][pc]);
  }
  if (tid < kTP) {
    const int t = tid;
    sB[t] = t < ntok ? 1.0f / (1.0f + __expf(-braw)) : 0.0f;
  }
  __syncthreads();
  {
    // cumulative log-decay of tokens 0..pt, summed in token order
    float G[PC];
#pragma unroll
    for (int i = 0; i < PC; ++i) G[i] = 0.0f;
#pragma unroll
    for (int u = 0; u < TP; ++u) {
      if (u <= pt) {
        float4 x[PC / 4];
#pragma unroll
        for (int i = 0; i < PC / 4; ++i) x[i] = ld4(&sG[u][pc + 4 * i]);
#pragma unroll
        for (int i = 0; i < PC / 4; ++i) {
          G[4 * i] += x[i].x; G[4 * i + 1] += x[i].y; G[4 * i + 2] += x[i].z; G[4 * i + 3] += x[i].w;
        }
      }
    }
    float ekh[PC], ekl[PC], eqh[PC], eql[PC], fv[PC];
#pragma unroll
    for (int i = 0; i < PC; ++i) {
      const float A = ex2_approx(G[i] * kLog2e), Ainv = ex2_approx(-G[i] * kLog2e);
      const float kh = kx[i] * ik, ek = A * kh, eq = A * (qx[i] * iq);
      const uint32_t hk = tf32_hi(ek), hq = tf32_hi(eq);
      ekh[i] = __uint_as_float(hk);
      ekl[i] = __uint_as_float(tf32_lo(ek, hk));
      eqh[i] = __uint_as_float(hq);
      eql[i] = __uint_as_float(tf32_lo(eq, hq));
      fv[i] = Ainv * kh;
    }
    VecIO<float, PC>::store(&sE[0][pt][pc], ekh);
    VecIO<float, PC>::store(&sE[1][pt][pc], ekl);
    VecIO<float, PC>::store(&sE[0][TP + pt][pc], eqh);
    VecIO<float, PC>::store(&sE[1][TP + pt][pc], eql);
    VecIO<float, PC>::store(&sF[pt][pc], fv);
  }
  __syncthreads();

  if (MODE == kFused) {
    // the deferred commit of the previous step: S = S * diag(a_j) + outer(c_j, k^_j)
#pragma unroll
    for (int j = 0; j < TP; ++j) {
      if (j >= plen) break;  // uniform over the block; the unrolled body keeps cprev in registers
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const float4 kh = ld4(&sKh[j][16 * m + 4 * t4]);
        const float4 a = ld4(&sA[j][16 * m + 4 * t4]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) apply_update(s[mt][hf][m], cprev[j][mt][hf], kh, a);
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
  if (tid < TP) {
    // column j of M^-1, M = I + diag(b) L (L: strictly lower key couplings), then Q = G M^-1
    const int j = tid;
    float x[TP];
#pragma unroll
    for (int i = 0; i < TP; ++i) {
      float acc = i == j ? 1.0f : 0.0f;
      const float bi = sB[i];
#pragma unroll
      for (int l = 0; l < i; ++l) acc -= bi * sCoup[i][l] * x[l];
      x[i] = acc;
      sMinv[i][j] = acc;
    }
#pragma unroll
    for (int t = 0; t < TP; ++t) {
      float acc = 0.0f;
#pragma unroll
      for (int l = 0; l <= t; ++l) acc += sCoup[TP + t][l] * x[l];
      sQ[t][j] = acc;
    }
  }
  __syncthreads();

  // ---- P = S [probes] for the rows: n-tile nt holds probe columns 8 nt .. 8 nt + 7, so
  // with TP = 8 lanes t4 hold keys (tile 0) and queries (tile 1) of tokens 2t4, 2t4+1;
  // with TP = 4 one tile holds them all: lanes t4 < 2 keys, t4 >= 2 queries
  // two accumulator sets (even and odd k-pairs) halve the chains of dependent products
  float acc2[2][MT][NT][4];
#pragma unroll
  for (int par = 0; par < 2; ++par)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc2[par][mt][nt][e] = 0.0f;
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    if (m + kDepth < 8) load_step(m + kDepth);
    const int c = 16 * m + 4 * t4;
    float4 bh[NT], bl[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      bh[nt] = ld4(&sE[0][8 * nt + g8][c]);
      bl[nt] = ld4(&sE[1][8 * nt + g8][c]);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const SplitA a = split_a(s[mt][0][m], s[mt][1][m]);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma_pair(acc2[m & 1][mt][nt], a, bh[nt], bl[nt]);
    }
  }
  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = acc2[0][mt][nt][e] + acc2[1][mt][nt][e];

  // ---- the solve, per row: c = M^-1 r and o = p_q + Q r with r_t = b_t (v_t - p_k)
  // the tokens this lane's key (and query) columns belong to
  constexpr int NE = TP == 8 ? 2 : 1;  // outputs per column pair: c and o, or one of them
  const bool qlane = TP == 4 && t4 >= 2;
  const int tl0 = TP == 8 ? 2 * t4 : 2 * (t4 & 1);
  float wc[2][TP], wq[2][TP];
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int j = 0; j < TP; ++j) {
      if (TP == 8) {
        wc[e][j] = sMinv[tl0 + e][j];
        wq[e][j] = sQ[tl0 + e][j];
      } else {
        wc[e][j] = qlane ? sQ[tl0 + e][j] : sMinv[tl0 + e][j];
        wq[e][j] = 0.0f;
      }
    }
  const float b0 = sB[2 * t4], b1 = sB[2 * t4 + 1];
  float cfull[MT][2][TP];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = row0 + mt * 16 + hf * 8 + g8;
      const float ra = b0 * (vt[mt][hf][0] - acc[mt][0][2 * hf]);
      const float rb = b1 * (vt[mt][hf][1] - acc[mt][0][2 * hf + 1]);
      float rv[TP];
#pragma unroll
      for (int u = 0; u < TP / 2; ++u) {
        rv[2 * u] = __shfl_sync(0xffffffffu, ra, (lane & ~3) | u);
        rv[2 * u + 1] = __shfl_sync(0xffffffffu, rb, (lane & ~3) | u);
      }
      // TP = 8: c[e] the correction, o[e] the output of token tl0 + e; TP = 4: c[e] is
      // the correction (key lanes) or the output (query lanes) of token tl0 + e
      float c[2], o[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float cs = qlane ? acc[mt][0][2 * hf + e] : 0.0f;
        float os = acc[mt][NT - 1][2 * hf + e];
#pragma unroll
        for (int j = 0; j < TP; ++j) {
          cs = fmaf(wc[e][j], rv[j], cs);
          if (NE == 2) os = fmaf(wq[e][j], rv[j], os);
        }
        c[e] = cs;
        o[e] = os;
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = tl0 + e;
        if (t < ntok) {
          if (TP == 8 || qlane) out[((long long)(start + t) * H + h) * kD + r] = from_f<T>(TP == 8 ? o[e] : c[e]);
          if (MODE != kFull && has_rec && !qlane)
            p.corr[rrow * p.corr_row + ((long long)h * W + t) * kD + r] = c[e];
        }
      }
      if (MODE == kFull) {
#pragma unroll
        for (int u = 0; u < TP / 2; ++u) {
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
            for (int u = 0; u < TP; ++u) cv = u == t ? cfull[mt][hf][u] : cv;
            apply_update(s[mt][hf][m], cv, kh, a);
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

template <int MODE, int MT, int TP, typename T>
cudaError_t launch_typed(const Params& p, int N, cudaStream_t stream) {
  // Heads before requests: the blocks resident at once then cover a few whole requests,
  // whose states (one request's heads are contiguous) and activations they read in address
  // order. On an H100 the verify took 0.92-0.98 of the time of requests first from a batch of
  // 128 (docs/bench/h100-2026-12-06-grid-order.txt).
  const dim3 grid(kD / (64 * MT), p.H, N);
  window_kernel<MODE, MT, TP, T><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <int MODE, typename T>
cudaError_t launch_rows(const Params& p, int rows_per_warp, int N, cudaStream_t s) {
  // a window of at most kHalfCols columns (S <= 3) takes the half-width product
  if (p.ncols <= kHalfCols)
    return rows_per_warp == 32 ? launch_typed<MODE, 2, 4, T>(p, N, s)
                               : launch_typed<MODE, 1, 4, T>(p, N, s);
  return rows_per_warp == 32 ? launch_typed<MODE, 2, 8, T>(p, N, s)
                             : launch_typed<MODE, 1, 8, T>(p, N, s);
}

// One mode's launches for bfloat16 (act_dtype 0) or float32 (2) activations, 16 or 32
// rows per warp and 4 or 8 token slots; each mode is compiled in its own file so that the
// builds run in parallel.
template <int MODE>
cudaError_t launch_mode(const Params& p, int act_dtype, int rows_per_warp, int N,
                        cudaStream_t s) {
  if (act_dtype == 0) return launch_rows<MODE, __nv_bfloat16>(p, rows_per_warp, N, s);
  return launch_rows<MODE, float>(p, rows_per_warp, N, s);
}

cudaError_t launch_recovery(const Params& p, int act_dtype, int rows_per_warp, int N,
                            cudaStream_t s);
cudaError_t launch_full(const Params& p, int act_dtype, int rows_per_warp, int N,
                        cudaStream_t s);
cudaError_t launch_fused(const Params& p, int act_dtype, int rows_per_warp, int N,
                         cudaStream_t s);

}  // namespace recoverssm
