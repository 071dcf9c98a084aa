// bf16 linears on CPUs with AVX512-BF16 (vdpbf16ps): y = x @ w^T with x and y in fp32, the
// weights in bf16 and the input rounded to bf16 (round to nearest even) once per call; the
// products are summed in fp32. vdpbf16ps takes 32 bf16 products a zmm per instruction against
// an fp32 FMA's 16, and the weights stream at half fp32's bytes.
//
// Layout: panels of 16 output columns, each [K2][16][2] (K2 = ceil(K / 2), a zero past K), so
// one k pair of a panel is one 64-byte line whose 32-bit lanes each hold (w[n][2g], w[n][2g + 1])
// of one column n; the input row's bf16 copy is read as the same pairs, one 32-bit broadcast each.
// A register tile is 6 rows x four panels (24 accumulators of the 32 zmm registers; a last group
// of 3, 2 or 1 panels takes 8, 12 or 12 rows); the threads split the (group, row) pairs evenly,
// group-major, in blocks of up to 48 rows, and a thread's first block of a group prefetches the
// next group when the thread runs that one too (panel_prefetch.h). Each output is one vdpbf16ps chain over the k pairs in
// order, so a row's result does not depend on the batch it is in, on the tile or on the threads.
//
// bf16_linear_silu_mul is the MLP's gate/up projection with SiLU-and-mul as its epilogue (gate
// panels, then up panels; output [M, I]), with the fp32 kernels' SiLU code (kernels/simd.h).
//
// Built into the "model" library (-ffast-math): the rounding to bf16 is the instruction's own
// (vcvtne2ps2bf16), which fast-math does not touch. Without AVX512-BF16 in the build the ops
// refuse (bf16_linear_isa() says "none"; the engine then takes oneDNN or the blocked kernel).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include <omp.h>

#include "panel_prefetch.h"
#include "simd.h"

// A namespace of its own inside the anonymous one: the model library compiles its sources as
// one translation unit (kernels/__init__.py), beside blocked_linear.cpp's P, tile, ...
namespace {
namespace bf16_dot {

constexpr int64_t P = 16;     // output columns per panel
constexpr int64_t ROWS = 48;  // rows per task: whole register tiles of 6, 8 or 12 rows

int64_t pairs_of(int64_t K) { return (K + 1) / 2; }

void check_operands(const at::Tensor& x, const at::Tensor& w_pairs, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": x must be fp32 [M, K]");
  TORCH_CHECK(w_pairs.dim() == 4 && w_pairs.size(2) == P && w_pairs.size(3) == 2 &&
                  w_pairs.scalar_type() == at::kBFloat16,
              op, ": w_pairs must be bf16 [panels, ceil(K / 2), 16, 2]");
  TORCH_CHECK(w_pairs.size(1) == pairs_of(x.size(1)), op, ": w_pairs was packed for another K");
}

#if defined(BATCHINFER_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__)
#define BATCHINFER_BF16DOT 1
using panels::LINE;
using panels::over_k_prefetching;
using panels::PanelPrefetch;

inline __mmask16 lanes_below(int64_t k, int64_t end) {
  return k + 16 <= end ? __mmask16(0xFFFF) : (k < end ? __mmask16((1u << (end - k)) - 1) : 0);
}

// Row x [K] fp32 -> out [2 K2] bf16, round to nearest even, zero past K.
inline void round_row(const float* x, int64_t K, int64_t K2, uint16_t* out) {
  const int64_t width = 2 * K2;
  for (int64_t k = 0; k < width; k += 32) {
    const __m512 lo = _mm512_maskz_loadu_ps(lanes_below(k, K), x + k);
    const __m512 hi = _mm512_maskz_loadu_ps(lanes_below(k + 16, K), x + k + 16);
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
    const int64_t left = width - k;
    const __mmask32 keep = left >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << left) - 1);
    _mm512_mask_storeu_epi16(out + k, keep, both);
  }
}

// acc += the bf16 pair products of each 32-bit lane.
inline __m512 dot_add(__m512 acc, __m512i x_pair, __m512i w_pairs) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(x_pair), reinterpret_cast<__m512bh>(w_pairs));
}

inline __m512i broadcast_pair(const uint16_t* q) {
  int32_t two;
  std::memcpy(&two, q, sizeof two);
  return _mm512_set1_epi32(two);
}

// MB rows x NP panels (w[0 .. NP - 1]) over K2 k pairs. SILU: w holds NP / 2 gate panels and
// then their up panels, and the tile writes silu(gate) * up (NP / 2 panels wide); otherwise the
// NP panels are adjacent, written side by side. next[p] (null: none) is the panel whose lines
// [0, prefetch_lines) this tile streams in while it computes.
template <int MB, int NP, bool SILU>
inline void tile(const uint16_t* __restrict xq, int64_t ldq, const uint16_t* const* panel,
                 float* __restrict y, int64_t ldy, int64_t K2, const char* const* next,
                 int64_t prefetch_lines) {
  const uint16_t* w[NP];
  const char* ahead[NP];
#pragma GCC unroll 4
  for (int p = 0; p < NP; ++p) { w[p] = panel[p]; ahead[p] = next[p]; }
  __m512 acc[MB][NP];
#pragma GCC unroll 16
  for (int j = 0; j < MB; ++j)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[j][p] = _mm512_setzero_ps();
  over_k_prefetching(
      K2, prefetch_lines,
      [&](int64_t i) {
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p)
          if (ahead[p] != nullptr) _mm_prefetch(ahead[p] + LINE * i, _MM_HINT_T0);
      },
      [&](int64_t g) {
        __m512i wv[NP];
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_si512(w[p] + g * 2 * P);
#pragma GCC unroll 16
        for (int j = 0; j < MB; ++j) {
          const __m512i xb = broadcast_pair(xq + j * ldq + 2 * g);
#pragma GCC unroll 4
          for (int p = 0; p < NP; ++p) acc[j][p] = dot_add(acc[j][p], xb, wv[p]);
        }
      });
#pragma GCC unroll 16
  for (int j = 0; j < MB; ++j) {
    if constexpr (SILU) {
#pragma GCC unroll 2
      for (int p = 0; p < NP / 2; ++p) {
        alignas(64) float g[P], u[P];
        _mm512_store_ps(g, acc[j][p]);
        _mm512_store_ps(u, acc[j][p + NP / 2]);
        for (int64_t c = 0; c < P; c += 8)
          _mm256_storeu_ps(y + j * ldy + p * P + c,
                           simd::silu_mul(_mm256_load_ps(g + c), _mm256_load_ps(u + c)));
      }
    } else {
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) _mm512_storeu_ps(y + j * ldy + p * P, acc[j][p]);
    }
  }
}

// Rows per register tile for NP panels: 24 accumulators of the 32 zmm registers, the rest for
// the panels' k pair and the broadcast input. Four panels (6 rows: 4 loads and 6 broadcasts per
// 24 dot products) measured ~95% of vdpbf16ps's rate in cache on a Zen 4 EPYC, 12 x 2 ~90%.
constexpr int64_t tile_rows_for(int NP) { return NP == 4 ? 6 : NP == 3 ? 8 : 12; }

template <int NP, bool SILU>
inline void tile_rows(int64_t rows, const uint16_t* xq, int64_t ldq, const uint16_t* const* panel,
                      float* y, int64_t ldy, int64_t K2, const char* const* next, int64_t lines) {
  switch (rows) {
#define BATCHINFER_BF16_TILE(R)                                                     \
    case R:                                                                         \
      if constexpr (R <= tile_rows_for(NP))                                         \
        tile<R, NP, SILU>(xq, ldq, panel, y, ldy, K2, next, lines);                  \
      break;
    BATCHINFER_BF16_TILE(12) BATCHINFER_BF16_TILE(11) BATCHINFER_BF16_TILE(10)
    BATCHINFER_BF16_TILE(9) BATCHINFER_BF16_TILE(8) BATCHINFER_BF16_TILE(7)
    BATCHINFER_BF16_TILE(6) BATCHINFER_BF16_TILE(5) BATCHINFER_BF16_TILE(4)
    BATCHINFER_BF16_TILE(3) BATCHINFER_BF16_TILE(2) BATCHINFER_BF16_TILE(1)
#undef BATCHINFER_BF16_TILE
    default: break;
  }
}

// One task: rows [begin, end) against NP panels, prefetching the next task's (null: none). The
// rows split into as few tiles as the tile height allows, of sizes differing by at most one
// (32 rows at 6 a tile: 6, 6, 5, 5, 5, 5, not five of 6 and one of 2, which runs mostly loads).
template <int NP, bool SILU>
void rows_of(const uint16_t* xq, int64_t ldq, int64_t begin, int64_t end,
             const uint16_t* const* panel, const uint16_t* const* next_panel, float* y,
             int64_t ldy, int64_t K2) {
  constexpr int64_t tile = tile_rows_for(NP);
  const int64_t lines = K2 * 2 * P * 2 / LINE;  // a panel's k pair is one line
  const int64_t rows = end - begin, tiles = (rows + tile - 1) / tile;
  // every next panel is streamed on the same schedule: the first one's, offset
  const PanelPrefetch ahead(next_panel[0], lines, rows, true, tile);
  for (int64_t m = begin, t = 0; t < tiles; ++t) {
    const int64_t height = rows / tiles + (t < rows % tiles ? 1 : 0);
    const char* next[NP];
    for (int p = 0; p < NP; ++p)
      next[p] = ahead.next != nullptr && next_panel[p] != nullptr
                    ? reinterpret_cast<const char*>(next_panel[p]) + (ahead.from(t) - ahead.next)
                    : nullptr;
    tile_rows<NP, SILU>(height, xq + m * ldq, ldq, panel, y + (m - begin) * ldy, ldy, K2, next,
                        ahead.lines(t));
    m += height;
  }
}

// x [M, K] fp32 -> [M, 2 K2] bf16 (the kernel's copy of the input).
at::Tensor rounded_input(const at::Tensor& xc) {
  const int64_t M = xc.size(0), K = xc.size(1), K2 = pairs_of(K);
  auto xq = at::empty({M, 2 * K2}, xc.options().dtype(at::kBFloat16));
  const float* xp = xc.data_ptr<float>();
  auto* qp = reinterpret_cast<uint16_t*>(xq.data_ptr<at::BFloat16>());
#pragma omp parallel for schedule(static) if (M * K > 65536)
  for (int64_t m = 0; m < M; ++m) round_row(xp + m * K, K, K2, qp + m * 2 * K2);
  return xq;
}

// The panels of column group `group`: up to GROUP adjacent panels, or (SILU) up to GROUP / 2
// gate panels then their up panels (gate panel u's up panel is units + u). Returns how many.
constexpr int64_t GROUP = 4;
template <bool SILU>
int group_panels(const uint16_t* wp, int64_t panel_elems, int64_t units, int64_t group,
                 const uint16_t** out) {
  const int64_t per = SILU ? GROUP / 2 : GROUP, first = group * per;
  const int64_t count = std::min(per, units - first);
  for (int64_t i = 0; i < count; ++i) {
    out[i] = wp + (first + i) * panel_elems;
    if constexpr (SILU) out[count + i] = wp + (units + first + i) * panel_elems;
  }
  return int(SILU ? 2 * count : count);
}

// Runs the column groups over `units` panels (SILU: gate/up panel pairs) x the M rows. Each
// thread takes an equal share of the (group, row) pairs in group-major order, so a layer with
// an odd number of groups (SmolLM2's o and down projections: 9) still splits evenly, in row
// blocks of ROWS; a thread's first row block of a group prefetches the next group's panels when
// the thread runs that group too.
template <bool SILU>
void run(const uint16_t* xq, int64_t ldq, const uint16_t* wp, float* yp, int64_t M, int64_t K2,
         int64_t units, int64_t ldy) {
  const int64_t panel_elems = K2 * 2 * P;
  const int64_t per = SILU ? GROUP / 2 : GROUP;
  const int64_t groups = (units + per - 1) / per;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t total = groups * M, last = total * (me + 1) / threads;
    for (int64_t pos = total * me / threads; pos < last;) {
      const int64_t t = pos / M, from = pos % M, to = std::min(M, from + (last - pos));
      const uint16_t* panel[GROUP] = {};
      const int np = group_panels<SILU>(wp, panel_elems, units, t, panel);
      for (int64_t begin = from; begin < to; begin += ROWS) {
        const int64_t end = std::min(to, begin + ROWS);
        const uint16_t* next[GROUP] = {};
        if (begin == from && t + 1 < groups && (t + 1) * M < last)
          group_panels<SILU>(wp, panel_elems, units, t + 1, next);
        float* y = yp + begin * ldy + t * per * P;
        switch (np) {
          case 4: rows_of<4, SILU>(xq, ldq, begin, end, panel, next, y, ldy, K2); break;
          case 2: rows_of<2, SILU>(xq, ldq, begin, end, panel, next, y, ldy, K2); break;
          case 3: if constexpr (!SILU) rows_of<3, false>(xq, ldq, begin, end, panel, next, y, ldy, K2); break;
          case 1: if constexpr (!SILU) rows_of<1, false>(xq, ldq, begin, end, panel, next, y, ldy, K2); break;
          default: break;
        }
      }
      pos += to - from;
    }
  }
}
#endif

// y = x @ w^T, [M, N], N = 16 x panels.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w_pairs) {
  check_operands(x, w_pairs, "bf16_linear");
#ifndef BATCHINFER_BF16DOT
  TORCH_CHECK(false, "bf16_linear needs AVX512-BF16 (this build has no avx512_bf16)");
#else
  const auto xc = x.contiguous();
  const auto wc = w_pairs.contiguous();
  const int64_t M = xc.size(0), K2 = wc.size(1), panels = wc.size(0), N = panels * P;
  const auto xq = rounded_input(xc);
  auto y = at::empty({M, N}, xc.options());
  run<false>(reinterpret_cast<const uint16_t*>(xq.data_ptr<at::BFloat16>()), 2 * K2,
             reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()), y.data_ptr<float>(),
             M, K2, panels, N);
  return y;
#endif
}

// silu(x @ gate^T) * (x @ up^T), [M, I], over w_pairs of 2 I / 16 panels (gate's, then up's).
at::Tensor bf16_linear_silu_mul(const at::Tensor& x, const at::Tensor& w_pairs) {
  check_operands(x, w_pairs, "bf16_linear_silu_mul");
  TORCH_CHECK(w_pairs.size(0) % 2 == 0,
              "bf16_linear_silu_mul: an even number of panels (gate's, then up's)");
#ifndef BATCHINFER_BF16DOT
  TORCH_CHECK(false, "bf16_linear_silu_mul needs AVX512-BF16 (this build has no avx512_bf16)");
#else
  const auto xc = x.contiguous();
  const auto wc = w_pairs.contiguous();
  const int64_t M = xc.size(0), K2 = wc.size(1), pairs = wc.size(0) / 2, I = pairs * P;
  const auto xq = rounded_input(xc);
  auto y = at::empty({M, I}, xc.options());
  run<true>(reinterpret_cast<const uint16_t*>(xq.data_ptr<at::BFloat16>()), 2 * K2,
            reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()), y.data_ptr<float>(),
            M, K2, pairs, I);
  return y;
#endif
}

// Whether this build has the kernels ("avx512_bf16") or not ("none").
std::string bf16_linear_isa() {
#ifdef BATCHINFER_BF16DOT
  return "avx512_bf16";
#else
  return "none";
#endif
}

}  // namespace bf16_dot
}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer, m) {
  m.def("bf16_linear_isa() -> str", &bf16_dot::bf16_linear_isa);
  m.def("bf16_linear(Tensor x, Tensor w_pairs) -> Tensor");
  m.def("bf16_linear_silu_mul(Tensor x, Tensor w_pairs) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchinfer, CPU, m) {
  m.impl("bf16_linear", &bf16_dot::bf16_linear);
  m.impl("bf16_linear_silu_mul", &bf16_dot::bf16_linear_silu_mul);
}
