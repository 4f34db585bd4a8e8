// Device helpers shared by the window verify (kda_window.cuh) and the commit
// (kda_commit.cu): the instructions Triton emits for the gate, the key norm and the
// state update, so that every kernel's committed states equal the Triton commit's bit for
// bit, and the 4- or 8-wide activation loads and stores.

#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace recoverssm {

constexpr int kD = 128;  // head dim, K = V
constexpr float kLog2e = 1.44269504088896340736f;

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

// triton_math.apply_record's update of four entries of one state row: x * a + c * k^
__device__ __forceinline__ void apply_update(float4& x, float c, float4 kh, float4 a) {
  x.x = __fmaf_rn(c, kh.x, __fmul_rn(x.x, a.x));
  x.y = __fmaf_rn(c, kh.y, __fmul_rn(x.y, a.y));
  x.z = __fmaf_rn(c, kh.z, __fmul_rn(x.z, a.z));
  x.w = __fmaf_rn(c, kh.w, __fmul_rn(x.w, a.w));
}

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 x) { *reinterpret_cast<float4*>(p) = x; }

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// N = 4 or 8 consecutive activations as floats (one 8- or 16-byte load for bf16), zeros
// if not live
template <typename T, int N> struct VecIO;
template <int N> struct VecIO<float, N> {
  static __device__ __forceinline__ void load(const float* p, float (&x)[N], bool live) {
    float4 a[N / 4];
#pragma unroll
    for (int i = 0; i < N / 4; ++i) a[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (live) {
#pragma unroll
      for (int i = 0; i < N / 4; ++i) a[i] = ld4(p + 4 * i);
    }
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      x[4 * i] = a[i].x; x[4 * i + 1] = a[i].y; x[4 * i + 2] = a[i].z; x[4 * i + 3] = a[i].w;
    }
  }
  static __device__ __forceinline__ void store(float* p, const float (&x)[N]) {
#pragma unroll
    for (int i = 0; i < N; i += 4) st4(p + i, make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]));
  }
};
template <int N> struct VecIO<__nv_bfloat16, N> {
  static_assert(N == 4 || N == 8, "4 or 8 bf16 values per access");
  static __device__ __forceinline__ void load(const __nv_bfloat16* p, float (&x)[N], bool live) {
    uint32_t w[N / 2];
    if constexpr (N == 8) {
      uint4 u = make_uint4(0u, 0u, 0u, 0u);
      if (live) u = *reinterpret_cast<const uint4*>(p);
      w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w;
    } else {
      uint2 u = make_uint2(0u, 0u);
      if (live) u = *reinterpret_cast<const uint2*>(p);
      w[0] = u.x; w[1] = u.y;
    }
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  // exact: the floats were loaded from bf16
  static __device__ __forceinline__ void store(__nv_bfloat16* p, const float (&x)[N]) {
    uint32_t w[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i)
      w[i] = (__float_as_uint(x[2 * i]) >> 16) | (__float_as_uint(x[2 * i + 1]) & 0xffff0000u);
    if constexpr (N == 8) {
      *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    }
  }
};

// sums over the L lanes (16 or 32) that share a token in the prologue (a fixed xor tree)
template <int L, typename F> __device__ __forceinline__ F group_sum(F x) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// the L2 norm of a vector spread over the L lanes of a group, PC columns each
// (triton_math.unit: the float64 sum of squares; every lane of the group must call it)
template <int L, int PC>
__device__ __forceinline__ float group_key_norm(const float (&x)[PC]) {
  double ss = 0.0;
#pragma unroll
  for (int i = 0; i < PC; ++i) ss += (double)x[i] * (double)x[i];
  return key_norm(group_sum<L>(ss));
}

// a record's unit key and decay at this lane's PC columns (the commit's bits: decay 1 where
// not live), stored to kh_out and a_out; every lane of the group must call it
template <int L, int PC>
__device__ __forceinline__ void store_record_update(const float (&k)[PC], const float (&g)[PC],
                                                    const float (&dtb)[PC], float a_coef,
                                                    float lb, bool live, float* kh_out,
                                                    float* a_out) {
  const float nrm = group_key_norm<L>(k);
  float kh[PC], a[PC];
#pragma unroll
  for (int i = 0; i < PC; ++i) {
    kh[i] = div_full(k[i], nrm);
    a[i] = live ? tl_exp(log_decay(g[i], a_coef, dtb[i], lb)) : 1.0f;
  }
  VecIO<float, PC>::store(kh_out, kh);
  VecIO<float, PC>::store(a_out, a);
}

}  // namespace recoverssm
