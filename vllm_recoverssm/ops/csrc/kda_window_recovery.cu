// Recovery-mode launches of the window verify (see kda_window.cuh).

#include "kda_window.cuh"

namespace recoverssm {

cudaError_t launch_recovery(const Params& p, int act_dtype, int rows_per_warp, int N,
                        cudaStream_t s) {
  return launch_mode<kRecovery>(p, act_dtype, rows_per_warp, N, s);
}

}  // namespace recoverssm
