// y = x @ w^T over weights laid out in panels of 16 output columns, each panel [K][16]
// contiguous (w_blocked[p][k][c] = w[16 p + c][k]): the engine's fp32 linears on AVX2-only CPUs
// and SiDP's FFN weights in shared memory (which cannot be oneDNN's opaque packed tensors). A
// panel is streamed once per 6 input rows with a 6 x 16 register tile (12 FMA accumulators, one
// broadcast input value and two panel vectors per k). Each output is one FMA chain over k in
// order, so a row's result does not depend on the batch it is in. Measured on the AVX2-only
// EPYC, SmolLM2's shapes, two threads: 1.2-1.4x oneDNN's packed GEMM at 16-256 rows, 1.07-1.2x
// at 512-2,048; on an AVX-512 host oneDNN was faster (this kernel, one thread, 12% slower at 16
// rows, 3% at 64).
#include <torch/extension.h>

#include <algorithm>

#include "simd.h"

namespace {

constexpr int64_t P = 16;     // panel width (output columns)
constexpr int64_t ROWS = 48;  // rows per task: 8 register tiles of 6

#ifdef BATCHINFER_AVX2
template <int MB>
inline void tile(const float* __restrict x, const float* __restrict panel, float* __restrict y,
                 int64_t K, int64_t ldy) {
  __m256 a0[MB], a1[MB];
#pragma GCC unroll 16
  for (int j = 0; j < MB; ++j) { a0[j] = _mm256_setzero_ps(); a1[j] = _mm256_setzero_ps(); }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * P), w1 = _mm256_loadu_ps(panel + k * P + 8);
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) {
      const __m256 xb = _mm256_broadcast_ss(x + j * K + k);
      a0[j] = _mm256_fmadd_ps(xb, w0, a0[j]);
      a1[j] = _mm256_fmadd_ps(xb, w1, a1[j]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < MB; ++j) {
    _mm256_storeu_ps(y + j * ldy, a0[j]);
    _mm256_storeu_ps(y + j * ldy + 8, a1[j]);
  }
}
#endif

torch::Tensor blocked_linear(const torch::Tensor& x, const torch::Tensor& w_blocked) {
  TORCH_CHECK(x.dim() == 2 && w_blocked.dim() == 3 && w_blocked.size(2) == P &&
                  w_blocked.size(1) == x.size(1),
              "blocked_linear: x [M, K] and w_blocked [N / 16, K, 16]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w_blocked.scalar_type() == torch::kFloat,
              "blocked_linear: fp32 only");
  const int64_t panels = w_blocked.size(0), N = panels * P;
#ifndef BATCHINFER_AVX2
  return torch::matmul(x, w_blocked.permute({1, 0, 2}).reshape({x.size(1), N}));
#else
  const auto xc = x.contiguous();
  const auto wc = w_blocked.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto y = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Tasks are (panel, block of ROWS rows), panel-major: a thread's consecutive tasks reuse one
  // panel from cache, and a layer with few panels (o_proj: 36) still spreads over many threads.
  const int64_t row_blocks = (M + ROWS - 1) / ROWS;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const float* panel = wp + p * K * P;
      float* yb = yp + p * P;
      const int64_t end = std::min(M, (rb + 1) * ROWS);
      int64_t m = rb * ROWS;
      for (; m + 6 <= end; m += 6) tile<6>(xp + m * K, panel, yb + m * N, K, N);
      switch (end - m) {
        case 5: tile<5>(xp + m * K, panel, yb + m * N, K, N); break;
        case 4: tile<4>(xp + m * K, panel, yb + m * N, K, N); break;
        case 3: tile<3>(xp + m * K, panel, yb + m * N, K, N); break;
        case 2: tile<2>(xp + m * K, panel, yb + m * N, K, N); break;
        case 1: tile<1>(xp + m * K, panel, yb + m * N, K, N); break;
        default: break;
      }
    }
  }
  return y;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer, m) {
  m.def("blocked_linear(Tensor x, Tensor w_blocked) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchinfer, CPU, m) {
  m.impl("blocked_linear", &blocked_linear);
}
