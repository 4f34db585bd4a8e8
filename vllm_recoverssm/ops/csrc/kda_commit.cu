// Commit of the accepted tokens into the FP32 checkpoints of every layer in one launch
// (NVIDIA GPUs, K = V = 128): the CUDA twin of triton_kda._commit_kernel, meant to give
// its bits (tests/ops/test_kernels.py compares them on a GPU).
//
// A block owns 4 * RPT rows of one (request, layer, head). Its threads first issue the
// loads of their rows, then the block turns the records into unit keys and decays once
// for all its rows and tokens (16 threads per token, in parallel, where the Triton commit
// repeats it per program and token: a suspect for its 71-76% of the roof at 8 accepted
// tokens against 91-93% at 2). Each warp then owns whole rows (lane l: columns 4l .. 4l + 3) and
// replays the tokens on them, rows loaded in one burst, so a request's rows stream at
// full width while other blocks compute.

#include "kda_math.cuh"

namespace recoverssm {

constexpr int kCommitThreads = 128;
constexpr int kCommitTokens = 8;  // records per request: S + 1 <= 8

struct CommitParams {
  const long long* state_tab;  // per layer: base address and slot stride (elements)
  const long long* state_stride;
  const long long* corr_tab;
  const long long* corr_stride;
  const long long* kg_tab;
  const long long* kg_stride;
  const float* A_log;    // [L, H]
  const float* dt_bias;  // [L, H, K]
  const int* sidx;
  const int* clen;
  const int* fidx;  // may be null: in place
  const int* bidx;  // may be null: no boundary
  const int* blen;
  const int* ridx;  // may be null: record row n
  int H;
  int ncols;
  float lower_bound;
};

template <typename T, int RPT>
__global__ void __launch_bounds__(kCommitThreads) commit_kernel(const CommitParams p) {
  constexpr int kRows = 4 * RPT;
  constexpr int PC = kD / 16;  // prologue columns per thread: 16 threads per token
  __shared__ __align__(16) float sKh[kCommitTokens][kD];
  __shared__ __align__(16) float sA[kCommitTokens][kD];
  __shared__ float sC[kCommitTokens][kRows];

  const int lh = blockIdx.y, n = blockIdx.z;
  const int layer = lh / p.H, h = lh % p.H, W = p.ncols;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row0 = blockIdx.x * kRows;
  // every index and table entry before the first branch (a load a branch waits on costs
  // a DRAM latency with the L2 cold)
  const long long src = p.sidx[n];
  const int clen = min(p.clen[n], p.ncols);  // as the Triton commit's unrolled loop
  const long long dst = p.fidx != nullptr ? (long long)p.fidx[n] : src;
  const long long bslot = p.bidx != nullptr ? (long long)p.bidx[n] : -1;
  const int blen = p.bidx != nullptr ? p.blen[n] : 0;
  const long long rrow = p.ridx != nullptr ? (long long)p.ridx[n] : (long long)n;
  float* state = reinterpret_cast<float*>(p.state_tab[layer]);
  const long long s_stride = p.state_stride[layer];
  const float* corr = reinterpret_cast<const float*>(p.corr_tab[layer]);
  const long long c_stride = p.corr_stride[layer];
  const T* kg = reinterpret_cast<const T*>(p.kg_tab[layer]);
  const long long kg_stride = p.kg_stride[layer];
  if (src < 0 || (clen == 0 && dst == src)) return;

  // ---- this warp's rows (RPT of them, one float4 of each per lane), all in flight now
  const long long head = (long long)h * kD * kD;
  float4 s[RPT];
#pragma unroll
  for (int i = 0; i < RPT; ++i)
    s[i] = ld4(state + src * s_stride + head + (long long)(row0 + warp * RPT + i) * kD + 4 * lane);

  // ---- per block: record pt's unit key and decay at columns pc .. pc + PC - 1
  {
    const int pt = tid >> 4, pc = (tid & 15) * PC;
    const bool live = pt < clen;
    const long long lhh = (long long)layer * p.H + h;
    float kx[PC], gx[PC], dtb[PC];
    const T* rec = kg + rrow * kg_stride + ((long long)h * W + pt) * 2 * kD + pc;
    VecIO<T, PC>::load(rec, kx, live);
    VecIO<T, PC>::load(rec + kD, gx, live);
    VecIO<float, PC>::load(p.dt_bias + lhh * kD + pc, dtb, true);
    const float a_coef = tl_exp(p.A_log[lhh]);
    store_record_update<16>(kx, gx, dtb, a_coef, p.lower_bound, live, &sKh[pt][pc],
                            &sA[pt][pc]);
  }
  for (int i = tid; i < kCommitTokens * kRows; i += kCommitThreads) {
    const int t = i / kRows, r = i % kRows;
    sC[t][r] = t < clen ? corr[rrow * c_stride + ((long long)h * W + t) * kD + row0 + r] : 0.0f;
  }
  __syncthreads();

  // ---- the replay, token by token, as triton_kda._apply_token
  auto store_rows = [&](long long slot) {
    float* base = state + slot * s_stride + head;
#pragma unroll
    for (int i = 0; i < RPT; ++i)
      st4(base + (long long)(row0 + warp * RPT + i) * kD + 4 * lane, s[i]);
  };
#pragma unroll
  for (int t = 0; t < kCommitTokens; ++t) {
    if (t >= clen) break;  // uniform over the block
    const float4 kh = ld4(&sKh[t][4 * lane]);
    const float4 a = ld4(&sA[t][4 * lane]);
#pragma unroll
    for (int i = 0; i < RPT; ++i) apply_update(s[i], sC[t][warp * RPT + i], kh, a);
    if (bslot >= 0 && t + 1 == blen) store_rows(bslot);
  }
  if (dst >= 0) store_rows(dst);
}

template <typename T, int RPT>
cudaError_t commit_typed(const CommitParams& p, int N, int L, cudaStream_t s) {
  // heads (of every layer) before requests, as the verify (kda_window.cuh, launch_typed)
  const dim3 grid(kD / (4 * RPT), L * p.H, N);
  commit_kernel<T, RPT><<<grid, kCommitThreads, 0, s>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t commit_rows(const CommitParams& p, int rows_per_block, int N, int L,
                        cudaStream_t s) {
  switch (rows_per_block) {
    case 16: return commit_typed<T, 4>(p, N, L, s);
    case 32: return commit_typed<T, 8>(p, N, L, s);
    default: return commit_typed<T, 16>(p, N, L, s);
  }
}

}  // namespace recoverssm

// act_dtype: 0 bfloat16, 2 float32 records; rows_per_block: 16, 32 or 64. Returns a
// cudaError_t.
extern "C" int recoverssm_commit_launch(
    int act_dtype, int rows_per_block, int N, int L, int H, int ncols, float lower_bound,
    const long long* state_tab, const long long* state_stride, const long long* corr_tab,
    const long long* corr_stride, const long long* kg_tab, const long long* kg_stride,
    const float* A_log, const float* dt_bias, const int* sidx, const int* clen,
    const int* fidx, const int* bidx, const int* blen, const int* ridx, void* stream) {
  using namespace recoverssm;
  if ((act_dtype != 0 && act_dtype != 2) ||
      (rows_per_block != 16 && rows_per_block != 32 && rows_per_block != 64) || N <= 0 ||
      L <= 0 || H <= 0 || ncols < 1 || ncols > kCommitTokens || (bidx == nullptr) != (blen == nullptr))
    return static_cast<int>(cudaErrorInvalidValue);
  const CommitParams p{state_tab, state_stride, corr_tab, corr_stride, kg_tab, kg_stride,
                       A_log, dt_bias, sidx, clen, fidx, bidx, blen, ridx, H, ncols,
                       lower_bound};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (act_dtype == 0) return static_cast<int>(commit_rows<__nv_bfloat16>(p, rows_per_block, N, L, s));
  return static_cast<int>(commit_rows<float>(p, rows_per_block, N, L, s));
}
