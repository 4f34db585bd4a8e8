// C entry point of the window verify (called through ctypes: no PyTorch headers, so the
// extension builds in seconds and does not depend on the PyTorch version).

#include "kda_window.cuh"

// mode: 0 recovery, 1 full state, 2 fused; act_dtype: 0 bfloat16, 2 float32; rows_per_warp:
// 16 or 32 (a block covers 64 or 128 rows of one head). Returns a cudaError_t.
extern "C" int recoverssm_window_launch(
    int mode, int act_dtype, int rows_per_warp, int N, int H, int ncols, float lower_bound,
    float scale, const void* q, const void* k, const void* v, const void* g, const void* beta,
    const float* A_log, const float* dt_bias, float* state, long long state_slot,
    const int* sidx, const int* nacc, const int* qsl, float* corr, long long corr_row,
    void* kg, long long kg_row, const int* ridx, const float* pcorr, long long pcorr_row,
    const void* pkg, long long pkg_row, const int* pridx, const int* plen, void* out,
    void* stream) {
  using namespace recoverssm;
  if (mode < 0 || mode > 2 || (act_dtype != 0 && act_dtype != 2) ||
      (rows_per_warp != 16 && rows_per_warp != 32) || ncols < 1 || ncols > kTP || N <= 0)
    return static_cast<int>(cudaErrorInvalidValue);
  const Params p{q, k, v, g, beta, A_log, dt_bias, state, state_slot, sidx, nacc, qsl,
                 corr, corr_row, kg, kg_row, ridx, pcorr, pcorr_row, pkg, pkg_row, pridx,
                 plen, out, H, ncols, lower_bound, scale};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (mode) {
    case 0: return static_cast<int>(launch_recovery(p, act_dtype, rows_per_warp, N, s));
    case 1: return static_cast<int>(launch_full(p, act_dtype, rows_per_warp, N, s));
    default: return static_cast<int>(launch_fused(p, act_dtype, rows_per_warp, N, s));
  }
}
