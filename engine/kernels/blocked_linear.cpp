// y = x @ w^T over weights laid out in panels of 16 output columns, each panel [K][16]
// contiguous (w_blocked[p][k][c] = w[16 p + c][k]): the engine's fp32 linears on AVX2-only CPUs
// and SiDP's FFN weights in shared memory (which cannot be oneDNN's opaque packed tensors). A
// panel is streamed once per 6 input rows with a 6 x 16 register tile (12 FMA accumulators, one
// broadcast input value and two panel vectors per k). Each output is one FMA chain over k in
// order, so a row's result does not depend on the batch it is in. While a panel's first row
// block computes, the next panel is prefetched (BATCHINFER_GEMM_PREFETCH=0 turns it off): on one
// core of the EPYC the model's GEMMs ran 1.2-1.3x faster with it at 8-32 rows, on two threads 1.1x
// at 16-32 rows and 1.03x at 128 (benchmarks/gemm_roofline.py --threads). Measured on the AVX2-only
// EPYC, SmolLM2's shapes, two threads: 1.2-1.4x oneDNN's packed GEMM at 16-256 rows, 1.07-1.2x
// at 512-2,048; on an AVX-512 host oneDNN was faster (this kernel, one thread, 12% slower at 16
// rows, 3% at 64).
#include <torch/extension.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "simd.h"

namespace {

constexpr int64_t P = 16;     // panel width (output columns)
constexpr int64_t ROWS = 48;  // rows per task: 8 register tiles of 6
constexpr int64_t LINE = 64;  // bytes per cache line: one k step of a panel

#ifdef BATCHINFER_AVX2
template <int MB>
inline void tile(const float* __restrict x, const float* __restrict panel, float* __restrict y,
                 int64_t K, int64_t ldy, const char* prefetch, int64_t prefetch_lines) {
  __m256 a0[MB], a1[MB];
#pragma GCC unroll 16
  for (int j = 0; j < MB; ++j) { a0[j] = _mm256_setzero_ps(); a1[j] = _mm256_setzero_ps(); }
  // One prefetched line of the next panel every `every` steps of k, spread over the whole pass.
  const int64_t every = prefetch_lines > 0 ? (K + prefetch_lines - 1) / prefetch_lines : K + 1;
  int64_t issued = 0;
  for (int64_t k0 = 0; k0 < K; k0 += every) {
    if (issued < prefetch_lines) _mm_prefetch(prefetch + LINE * issued++, _MM_HINT_T0);
    const int64_t k1 = std::min(K, k0 + every);
    for (int64_t k = k0; k < k1; ++k) {
      const __m256 w0 = _mm256_loadu_ps(panel + k * P), w1 = _mm256_loadu_ps(panel + k * P + 8);
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) {
        const __m256 xb = _mm256_broadcast_ss(x + j * K + k);
        a0[j] = _mm256_fmadd_ps(xb, w0, a0[j]);
        a1[j] = _mm256_fmadd_ps(xb, w1, a1[j]);
      }
    }
  }
  while (issued < prefetch_lines) _mm_prefetch(prefetch + LINE * issued++, _MM_HINT_T0);
#pragma GCC unroll 16
  for (int j = 0; j < MB; ++j) {
    _mm256_storeu_ps(y + j * ldy, a0[j]);
    _mm256_storeu_ps(y + j * ldy + 8, a1[j]);
  }
}
#endif

torch::Tensor blocked_linear(const torch::Tensor& x, const torch::Tensor& w_blocked) {
  static const bool prefetch_next = [] {
    const char* env = std::getenv("BATCHINFER_GEMM_PREFETCH");
    return env == nullptr || std::string(env) != "0";
  }();
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
      // The panel's first row block streams the next panel (K lines) in from memory while it
      // computes, spread over its tiles. Without it a panel's first pass waits on DRAM and the
      // passes after it compute from cache: memory time plus compute time instead of the larger
      // (1.3x at 8-32 rows on one core of the EPYC). A block of one tile (<= 6 rows) has
      // nothing to overlap with: the hardware prefetcher streams it as well alone.
      const int64_t tiles = (end - m + 5) / 6;
      const bool ahead = prefetch_next && rb == 0 && tiles > 1 && p + 1 < panels;
      const char* next = reinterpret_cast<const char*>(wp + (p + 1) * K * P);
      int64_t t = 0;
      auto lines = [&](int64_t i) { return ahead ? (i + 1) * K / tiles - i * K / tiles : 0; };
      auto from = [&](int64_t i) { return next + LINE * (i * K / tiles); };
      for (; m + 6 <= end; m += 6, ++t)
        tile<6>(xp + m * K, panel, yb + m * N, K, N, from(t), lines(t));
      switch (end - m) {
        case 5: tile<5>(xp + m * K, panel, yb + m * N, K, N, from(t), lines(t)); break;
        case 4: tile<4>(xp + m * K, panel, yb + m * N, K, N, from(t), lines(t)); break;
        case 3: tile<3>(xp + m * K, panel, yb + m * N, K, N, from(t), lines(t)); break;
        case 2: tile<2>(xp + m * K, panel, yb + m * N, K, N, from(t), lines(t)); break;
        case 1: tile<1>(xp + m * K, panel, yb + m * N, K, N, from(t), lines(t)); break;
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
