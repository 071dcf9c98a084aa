// y = x @ w^T over weights laid out in panels of 16 output columns, each panel [K][16]
// contiguous (w_blocked[p][k][c] = w[16 p + c][k]): the engine's fp32 linears on AVX2-only CPUs
// and FFN weights shared between replicas in shared memory (which cannot be oneDNN's opaque packed tensors). A
// panel is streamed once per 6 input rows with a 6 x 16 register tile (12 FMA accumulators, one
// broadcast input value and two panel vectors per k). Each output is one FMA chain over k in
// order, so a row's result does not depend on the batch it is in. While a panel's first row
// block computes, the next panel is prefetched (the op's prefetch=false turns it off): on one
// core of the EPYC the model's GEMMs ran 1.2-1.3x faster with it at 8-32 rows, on two threads 1.1x
// at 16-32 rows and 1.03x at 128 (benchmarks/engine/gemm_roofline.py --threads). Measured on the AVX2-only
// EPYC, SmolLM2's shapes, two threads: 1.2-1.4x oneDNN's packed GEMM at 16-256 rows, 1.07-1.2x
// at 512-2,048; on an AVX-512 host oneDNN was faster (this kernel, one thread, 12% slower at 16
// rows, 3% at 64).
//
// blocked_linear_silu_mul is the MLP's gate/up projection with SiLU-and-mul as its epilogue:
// weights of 2 I output rows (gate, then up) in panels, output silu(x @ gate^T) * (x @ up^T)
// [M, I]. Each task computes a tile of gate panel i and of up panel i and writes the product:
// the [M, 2 I] intermediate is never written, and the separate SiLU pass over it is gone. The
// same FMA chains and the same SiLU code as the two unfused ops, so the same bits.
//
// Where the build has AVX-512 (and the op's wide is not false) both ops run a wider tile,
// 12 rows x two panels (tile2 below): on an AVX-512 Xeon, two threads, SmolLM2's decode step took
// 117-120 ms at 128 rows against oneDNN's 136-137 and the AVX2 tile's 175-180. Same bits.
//
// The panels may also hold bf16 weights (x and y stay fp32): each panel vector is widened to fp32
// as it is loaded (exact: a bf16 is the upper half of an fp32), then the same FMA chains run. So
// the result is bitwise this kernel's over the weights rounded to bf16, the weights' bytes (and
// their DRAM stream) are halved, and no bf16 instruction is needed: the engine's bf16 linears on
// CPUs without native bf16 arithmetic, where oneDNN's bf16 GEMM is emulated (5x slower than fp32
// on an AVX-512 Xeon, ~300x on AVX2-only parts).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

#include "panel_prefetch.h"
#include "simd.h"

namespace {

using panels::LINE;
using panels::over_k_prefetching;
using panels::PanelPrefetch;
constexpr int64_t P = 16;     // panel width (output columns)
constexpr int64_t ROWS = 48;  // rows per task: 8 register tiles of 6

#ifdef BATCHINFER_AVX2
// 8 panel weights at p as fp32 (bf16 widened exactly: shifted into the fp32's upper half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// Cache lines of one panel (K steps of 16 weights of type W; a bf16 step is half a line), rounded up.
template <typename W>
constexpr int64_t panel_lines(int64_t K) { return (K * P * int64_t(sizeof(W)) + LINE - 1) / LINE; }

template <int MB, typename W>
inline void tile(const float* __restrict x, const W* __restrict panel, float* __restrict y,
                 int64_t K, int64_t ldy, const char* prefetch, int64_t prefetch_lines) {
  __m256 a0[MB], a1[MB];
#pragma GCC unroll 16
  for (int j = 0; j < MB; ++j) { a0[j] = _mm256_setzero_ps(); a1[j] = _mm256_setzero_ps(); }
  over_k_prefetching(
      K, prefetch_lines, [&](int64_t i) { _mm_prefetch(prefetch + LINE * i, _MM_HINT_T0); },
      [&](int64_t k) {
        const __m256 w0 = load8(panel + k * P), w1 = load8(panel + k * P + 8);
#pragma GCC unroll 16
        for (int j = 0; j < MB; ++j) {
          const __m256 xb = _mm256_broadcast_ss(x + j * K + k);
          a0[j] = _mm256_fmadd_ps(xb, w0, a0[j]);
          a1[j] = _mm256_fmadd_ps(xb, w1, a1[j]);
        }
      });
#pragma GCC unroll 16
  for (int j = 0; j < MB; ++j) {
    _mm256_storeu_ps(y + j * ldy, a0[j]);
    _mm256_storeu_ps(y + j * ldy + 8, a1[j]);
  }
}

// tile<rows> for 1 <= rows <= 6.
template <typename W>
inline void tile_rows(int64_t rows, const float* x, const W* panel, float* y, int64_t K,
                      int64_t ldy, const char* prefetch, int64_t prefetch_lines) {
  switch (rows) {
    case 6: tile<6, W>(x, panel, y, K, ldy, prefetch, prefetch_lines); break;
    case 5: tile<5, W>(x, panel, y, K, ldy, prefetch, prefetch_lines); break;
    case 4: tile<4, W>(x, panel, y, K, ldy, prefetch, prefetch_lines); break;
    case 3: tile<3, W>(x, panel, y, K, ldy, prefetch, prefetch_lines); break;
    case 2: tile<2, W>(x, panel, y, K, ldy, prefetch, prefetch_lines); break;
    case 1: tile<1, W>(x, panel, y, K, ldy, prefetch, prefetch_lines); break;
    default: break;
  }
}

#ifdef __AVX512F__
#define BATCHINFER_AVX512 1
// 16 panel weights at p as fp32 (bf16 widened exactly, as load8).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The AVX-512 tile: two panels (a and b) x MB rows, one zmm accumulator per row and panel (up to
// 24 of the 32 registers), the input value broadcast from memory into each FMA. Per k step: two
// panel loads and MB broadcasts for 2 MB FMAs, against the AVX2 tile's 2 + 6 loads for 12 FMAs
// of half the width. Each output is still one FMA chain over k in order, so the bits are the AVX2
// tile's. SILU: the epilogue writes silu(a) * b (a is a gate panel, b its up panel) with the same
// SiLU code as the AVX2 paths; otherwise a and b are adjacent panels, written side by side.
template <int MB, bool SILU, typename W>
inline void tile2(const float* __restrict x, const W* __restrict pa, const W* __restrict pb,
                  float* __restrict y, int64_t K, int64_t ldy, const char* prefetch_a,
                  const char* prefetch_b, int64_t prefetch_lines) {
  __m512 a[MB], b[MB];
#pragma GCC unroll 16
  for (int j = 0; j < MB; ++j) { a[j] = _mm512_setzero_ps(); b[j] = _mm512_setzero_ps(); }
  over_k_prefetching(
      K, prefetch_lines,
      [&](int64_t i) {
        _mm_prefetch(prefetch_a + LINE * i, _MM_HINT_T0);
        _mm_prefetch(prefetch_b + LINE * i, _MM_HINT_T0);
      },
      [&](int64_t k) {
        const __m512 wa = load16(pa + k * P), wb = load16(pb + k * P);
#pragma GCC unroll 16
        for (int j = 0; j < MB; ++j) {
          const __m512 xb = _mm512_set1_ps(x[j * K + k]);
          a[j] = _mm512_fmadd_ps(xb, wa, a[j]);
          b[j] = _mm512_fmadd_ps(xb, wb, b[j]);
        }
      });
#pragma GCC unroll 16
  for (int j = 0; j < MB; ++j) {
    if constexpr (SILU) {
      alignas(64) float g[P], u[P];
      _mm512_store_ps(g, a[j]);
      _mm512_store_ps(u, b[j]);
      for (int64_t c = 0; c < P; c += 8)
        _mm256_storeu_ps(y + j * ldy + c, simd::silu_mul(_mm256_load_ps(g + c), _mm256_load_ps(u + c)));
    } else {
      _mm512_storeu_ps(y + j * ldy, a[j]);
      _mm512_storeu_ps(y + j * ldy + P, b[j]);
    }
  }
}

constexpr int64_t ROWS512 = 12;  // rows per AVX-512 tile; a task's ROWS are 4 of them

// tile2<rows> for 1 <= rows <= 12.
template <bool SILU, typename W>
inline void tile2_rows(int64_t rows, const float* x, const W* pa, const W* pb, float* y,
                       int64_t K, int64_t ldy, const char* pf_a, const char* pf_b, int64_t lines) {
  switch (rows) {
#define BATCHINFER_TILE2(R) \
    case R: tile2<R, SILU, W>(x, pa, pb, y, K, ldy, pf_a, pf_b, lines); break;
    BATCHINFER_TILE2(12) BATCHINFER_TILE2(11) BATCHINFER_TILE2(10) BATCHINFER_TILE2(9)
    BATCHINFER_TILE2(8) BATCHINFER_TILE2(7) BATCHINFER_TILE2(6) BATCHINFER_TILE2(5)
    BATCHINFER_TILE2(4) BATCHINFER_TILE2(3) BATCHINFER_TILE2(2) BATCHINFER_TILE2(1)
#undef BATCHINFER_TILE2
    default: break;
  }
}

// One task of either op on the AVX-512 path: rows [begin, end) against panels pa and pb, the
// first row block of a pair prefetching the next pair (pa_next, pb_next; null: none).
template <bool SILU, typename W>
inline void rows2(const float* xp, int64_t begin, int64_t end, const W* pa, const W* pb,
                  const W* pa_next, const W* pb_next, float* y, int64_t K, int64_t ldy) {
  const PanelPrefetch a_ahead(pa_next, panel_lines<W>(K), end - begin, true, ROWS512);
  const PanelPrefetch b_ahead(pb_next, panel_lines<W>(K), end - begin, true, ROWS512);
  for (int64_t m = begin, t = 0; m < end; m += ROWS512, ++t)
    tile2_rows<SILU, W>(std::min(ROWS512, end - m), xp + m * K, pa, pb, y + (m - begin) * ldy, K, ldy,
                     a_ahead.from(t), b_ahead.from(t), a_ahead.lines(t));
}

#endif
#endif

// x [M, K] fp32 and w_blocked [panels, K, 16] fp32 or bf16: what each op below checks first.
void check_operands(const at::Tensor& x, const at::Tensor& w_blocked, const char* op) {
  TORCH_CHECK(x.dim() == 2 && w_blocked.dim() == 3 && w_blocked.size(2) == P &&
                  w_blocked.size(1) == x.size(1),
              op, ": x [M, K] and w_blocked [panels, K, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be fp32");
  TORCH_CHECK(w_blocked.scalar_type() == at::kFloat || w_blocked.scalar_type() == at::kBFloat16,
              op, ": w_blocked must be fp32 or bf16");
}

#ifndef BATCHINFER_AVX2
// No AVX2: torch's matmul over the dense weight (bf16 widened first, so the same maths).
at::Tensor portable_linear(const at::Tensor& x, const at::Tensor& w_blocked) {
  const int64_t N = w_blocked.size(0) * P;
  return at::matmul(x, w_blocked.permute({1, 0, 2}).reshape({x.size(1), N}).to(at::kFloat));
}
#else
template <typename W>
void blocked_linear_into(const float* xp, const W* wp, float* yp, int64_t M, int64_t K,
                         int64_t panels, bool prefetch, bool wide) {
  const int64_t N = panels * P;
  // Tasks are (panel, block of ROWS rows), panel-major: a thread's consecutive tasks reuse one
  // panel from cache, and a layer with few panels (o_proj: 36) still spreads over many threads.
  const int64_t row_blocks = (M + ROWS - 1) / ROWS;
  int64_t first_panel = 0;  // panels before it went through the AVX-512 path
#ifdef BATCHINFER_AVX512
  if (wide) {
    const int64_t pairs = panels / 2;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t q = 0; q < pairs; ++q) {
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        const W* pa = wp + 2 * q * K * P;
        const int64_t begin = rb * ROWS, end = std::min(M, begin + ROWS);
        const bool first = prefetch && rb == 0 && q + 1 < pairs;
        rows2<false, W>(xp, begin, end, pa, pa + K * P, first ? pa + 2 * K * P : nullptr,
                        first ? pa + 3 * K * P : nullptr, yp + begin * N + 2 * q * P, K, N);
      }
    }
    first_panel = 2 * pairs;  // an odd panel count leaves the last one to the AVX2 tile
  }
#endif
  if (first_panel == panels) return;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t p = first_panel; p < panels; ++p) {
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const W* panel = wp + p * K * P;
      const int64_t begin = rb * ROWS, end = std::min(M, begin + ROWS);
      const PanelPrefetch ahead(rb == 0 && p + 1 < panels ? panel + K * P : nullptr,
                                panel_lines<W>(K), end - begin, prefetch);
      for (int64_t m = begin, t = 0; m < end; m += 6, ++t)
        tile_rows<W>(std::min<int64_t>(6, end - m), xp + m * K, panel, yp + m * N + p * P, K, N,
                     ahead.from(t), ahead.lines(t));
    }
  }
}

template <typename W>
void blocked_linear_silu_mul_into(const float* xp, const W* wp, float* yp, int64_t M, int64_t K,
                                  int64_t pairs, bool prefetch, bool wide) {
  const int64_t I = pairs * P;
  const int64_t row_blocks = (M + ROWS - 1) / ROWS;
#ifdef BATCHINFER_AVX512
  if (wide) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t p = 0; p < pairs; ++p) {
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        const W* gate = wp + p * K * P;
        const W* up = wp + (pairs + p) * K * P;
        const int64_t begin = rb * ROWS, end = std::min(M, begin + ROWS);
        const bool first = prefetch && rb == 0 && p + 1 < pairs;
        rows2<true, W>(xp, begin, end, gate, up, first ? gate + K * P : nullptr,
                       first ? up + K * P : nullptr, yp + begin * I + p * P, K, I);
      }
    }
    return;
  }
#endif
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const W* gate = wp + p * K * P;
      const W* up = wp + (pairs + p) * K * P;
      const int64_t begin = rb * ROWS, end = std::min(M, begin + ROWS);
      const bool first = rb == 0 && p + 1 < pairs;
      const PanelPrefetch gate_ahead(first ? gate + K * P : nullptr, panel_lines<W>(K),
                                     end - begin, prefetch);
      const PanelPrefetch up_ahead(first ? up + K * P : nullptr, panel_lines<W>(K), end - begin,
                                   prefetch);
      alignas(32) float g[6 * P], u[6 * P];
      for (int64_t m = begin, t = 0; m < end; m += 6, ++t) {
        const int64_t rows = std::min<int64_t>(6, end - m);
        tile_rows<W>(rows, xp + m * K, gate, g, K, P, gate_ahead.from(t), gate_ahead.lines(t));
        tile_rows<W>(rows, xp + m * K, up, u, K, P, up_ahead.from(t), up_ahead.lines(t));
        for (int64_t j = 0; j < rows; ++j) {
          float* out = yp + (m + j) * I + p * P;
          for (int64_t c = 0; c < P; c += 8)
            _mm256_storeu_ps(out + c, simd::silu_mul(_mm256_load_ps(g + j * P + c),
                                                     _mm256_load_ps(u + j * P + c)));
        }
      }
    }
  }
}
#endif

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& w_blocked, bool prefetch,
                          bool wide) {
  check_operands(x, w_blocked, "blocked_linear");
#ifndef BATCHINFER_AVX2
  return portable_linear(x, w_blocked);
#else
  const auto xc = x.contiguous();
  const auto wc = w_blocked.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), panels = wc.size(0);
  auto y = at::empty({M, panels * P}, xc.options());
  if (wc.scalar_type() == at::kBFloat16)
    blocked_linear_into(xc.data_ptr<float>(), wc.data_ptr<c10::BFloat16>(), y.data_ptr<float>(),
                        M, K, panels, prefetch, wide);
  else
    blocked_linear_into(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), M, K,
                        panels, prefetch, wide);
  return y;
#endif
}

// silu(x @ gate^T) * (x @ up^T) over w_blocked [2 I / 16, K, 16] (gate panels, then up panels).
at::Tensor blocked_linear_silu_mul(const at::Tensor& x, const at::Tensor& w_blocked,
                                   bool prefetch, bool wide) {
  check_operands(x, w_blocked, "blocked_linear_silu_mul");
  TORCH_CHECK(w_blocked.size(0) % 2 == 0,
              "blocked_linear_silu_mul: an even number of panels (gate's, then up's)");
  const int64_t pairs = w_blocked.size(0) / 2, I = pairs * P;
#ifndef BATCHINFER_AVX2
  const auto gate_up = portable_linear(x, w_blocked);
  return at::silu(gate_up.narrow(1, 0, I)) * gate_up.narrow(1, I, I);
#else
  const auto xc = x.contiguous();
  const auto wc = w_blocked.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto y = at::empty({M, I}, xc.options());
  if (wc.scalar_type() == at::kBFloat16)
    blocked_linear_silu_mul_into(xc.data_ptr<float>(), wc.data_ptr<c10::BFloat16>(),
                                 y.data_ptr<float>(), M, K, pairs, prefetch, wide);
  else
    blocked_linear_silu_mul_into(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(),
                                 M, K, pairs, prefetch, wide);
  return y;
#endif
}

// Which tile the ops above run here: "avx512", "avx2" or "portable" (torch's matmul).
std::string blocked_linear_isa() {
#ifdef BATCHINFER_AVX512
  return "avx512";
#endif
#ifdef BATCHINFER_AVX2
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer, m) {
  m.def("blocked_linear_isa() -> str", &blocked_linear_isa);  // no tensors: no dispatch key
  // prefetch: the next panel's lines during this one's FMAs; wide: the AVX-512 tile where built
  // (false: the AVX2 tile). Both leave every result bitwise the same; they are there to measure.
  m.def("blocked_linear(Tensor x, Tensor w_blocked, bool prefetch=True, bool wide=True) -> Tensor");
  m.def("blocked_linear_silu_mul(Tensor x, Tensor w_blocked, bool prefetch=True, bool wide=True) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(batchinfer, CPU, m) {
  m.impl("blocked_linear", &blocked_linear);
  m.impl("blocked_linear_silu_mul", &blocked_linear_silu_mul);
}
