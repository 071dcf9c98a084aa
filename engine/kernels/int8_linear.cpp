// int8 linears (W8A8): weights quantized once per output channel (symmetric, scale absmax / 127);
// activations at each call per token and per block of 64 input channels (the same, one scale per
// block: an outlier channel coarsens only its own block, as in DeepSeek-V3's fine-grained FP8
// recipe); the products summed in int32 by AVX512-VNNI's vpdpbusd (64 u8 x s8 products per
// instruction against 16 fp32 FMAs, a quarter of the weight bytes to stream).
//
// vpdpbusd multiplies unsigned by signed bytes, so a token's codes q in [-127, 127] go in as
// q + 128 and each block's sum takes back 128 x the block's weight sum of its column (`comp`,
// precomputed; exact in int32). y[m][n] = w_scale[n] x sum over blocks b of
// x_scale[m][b] x float(acc_b[m][n] - comp[b][n]) (+ bias), the blocks folded in order with one FMA
// each; the gate/up projection can write silu(gate) * up instead (kernels/simd.h's SiLU, the
// [M, 2 I] intermediate never stored), and a BERT feed-forward's first linear gelu(y) (simd.h's
// exact GELU: the length predictor's encoder, whose separate GELU pass cost ~9% of its time).
//
// Layout: panels of 16 output columns, each [K4][16][4] (K4 = Kp / 4 with Kp, K rounded up to a
// whole block, zeros past K), so a group of 4 k of a panel is one 64-byte load whose int32 lanes
// each hold 4 consecutive k of one column. A register tile is up to 6 rows x two panels: 12 int32
// block accumulators and 12 fp32 sums. Tasks are (panel pair, block of 48 rows).
//
// This file is built without -ffast-math (kernels/__init__.py's "exact" build): the quantization
// rounds as int8_linear.quantize_rows does in torch (a true 127 / absmax, then x times it), so
// tests compare codes bit for bit.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>

#include "simd.h"   // <immintrin.h> where the build targets AVX2 (the VNNI code below needs it)

namespace {

constexpr int64_t P = 16;      // output columns per panel
constexpr int64_t GROUP = 4;   // k values per int32 lane of vpdpbusd
constexpr int64_t BLOCK = 64;  // input channels per activation scale
constexpr int64_t STEPS = BLOCK / GROUP;  // vpdpbusd steps per block
constexpr int64_t ROWS = 48;   // rows per task
constexpr int64_t TILE = 6;    // rows per register tile

int64_t padded(int64_t K) { return (K + BLOCK - 1) / BLOCK * BLOCK; }

void check_packed(const at::Tensor& w_packed, const at::Tensor& w_scale, const at::Tensor& w_comp,
                  int64_t K, const char* op) {
  TORCH_CHECK(w_packed.dim() == 4 && w_packed.size(2) == P && w_packed.size(3) == GROUP &&
                  w_packed.scalar_type() == at::kChar,
              op, ": w_packed must be int8 [panels, Kp / 4, 16, 4]");
  TORCH_CHECK(w_packed.size(1) * GROUP == padded(K), op, ": w_packed was packed for another K");
  const int64_t N = w_packed.size(0) * P;
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == N, op,
              ": w_scale must be fp32 [N]");
  TORCH_CHECK(w_comp.scalar_type() == at::kInt && w_comp.dim() == 2 &&
                  w_comp.size(0) == padded(K) / BLOCK && w_comp.size(1) == N,
              op, ": w_comp must be int32 [Kp / 64, N]");
}

#if defined(BATCHINFER_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define BATCHINFER_VNNI 1

inline __mmask16 lanes_below(int64_t k, int64_t end) {
  return k + 16 <= end ? __mmask16(0xFFFF) : (k < end ? __mmask16((1u << (end - k)) - 1) : 0);
}

// Row x [K] -> q [Kp] and scales [Kp / 64]: per block, q = round(x * (127 / absmax)) + 128 (ties
// to even; 128, a zero, past K and for a NaN) and scale absmax / 127. A NaN makes its block's
// scale NaN, so the outputs it reaches are NaN as the fp32 linear's would be.
inline void quantize_row(const float* x, int64_t K, int64_t Kp, uint8_t* q, float* scales) {
  const __m512i offset = _mm512_set1_epi32(128);
  for (int64_t b = 0; b < Kp; b += BLOCK) {
    __m512 most = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = b; k < b + BLOCK; k += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(lanes_below(k, K), x + k);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      most = _mm512_max_ps(most, _mm512_abs_ps(v));
    }
    const float absmax = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(most);
    const __m512 inv = _mm512_set1_ps(absmax > 0.f ? 127.f / absmax : 0.f);
    for (int64_t k = b; k < b + BLOCK; k += 16) {
      const __m512 scaled = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes_below(k, K), x + k), inv);
      const __mmask16 ordered = _mm512_cmp_ps_mask(scaled, scaled, _CMP_ORD_Q);
      const __m512i code = _mm512_add_epi32(_mm512_maskz_cvtps_epi32(ordered, scaled), offset);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtusepi32_epi8(code));
    }
    scales[b / BLOCK] = absmax / 127.f;
  }
}

// acc += the u8 x s8 dot products of each int32 lane (vpdpbusd). As inline assembly: GCC 12's
// intrinsic copies the accumulator to a new register and back around every instruction.
inline void dot_add(__m512i& acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
}

inline __m512i broadcast_group(const uint8_t* q) {
  int32_t four;
  std::memcpy(&four, q, sizeof four);
  return _mm512_set1_epi32(four);
}

// sum += x_scale * float(acc - comp): one block folded into a row's fp32 sums.
inline __m512 fold(__m512 sum, __m512i acc, __m512i comp, float x_scale) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, comp)), _mm512_set1_ps(x_scale),
                         sum);
}

// silu(g) * u for 16 floats with the fp32 kernels' code (kernels/simd.h), one half at a time.
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m256 lo = simd::silu_mul(_mm512_castps512_ps256(g), _mm512_castps512_ps256(u));
  const __m256 hi = simd::silu_mul(_mm512_extractf32x8_ps(g, 1), _mm512_extractf32x8_ps(u, 1));
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// What a tile writes: y, silu(gate) * up (panel 0 a gate panel, panel 1 its up panel), or gelu(y).
enum Epilogue { kPlain, kSiluMul, kGelu };

struct Panels {           // what a tile reads of its one or two panels
  const int8_t* w[2];
  const float* scale[2];
  const int32_t* comp[2];  // block 0's row of comp at the panel's columns (the next block: + N)
  const float* bias[2];    // null: no bias
};

// One row's outputs of the tile's panels from its fp32 sums, through the epilogue.
template <int NP, Epilogue EPI>
inline void store_row(__m512 a, __m512 b, const Panels& p, float* y) {
  __m512 ya = _mm512_mul_ps(a, _mm512_loadu_ps(p.scale[0]));
  if (p.bias[0]) ya = _mm512_add_ps(ya, _mm512_loadu_ps(p.bias[0]));
  if constexpr (EPI == kGelu) ya = simd::gelu16(ya);
  if constexpr (NP == 2) {
    __m512 yb = _mm512_mul_ps(b, _mm512_loadu_ps(p.scale[1]));
    if (p.bias[1]) yb = _mm512_add_ps(yb, _mm512_loadu_ps(p.bias[1]));
    if constexpr (EPI == kSiluMul) {
      _mm512_storeu_ps(y, silu_mul(ya, yb));
    } else {
      if constexpr (EPI == kGelu) yb = simd::gelu16(yb);
      _mm512_storeu_ps(y, ya);
      _mm512_storeu_ps(y + P, yb);
    }
  } else {
    _mm512_storeu_ps(y, ya);
  }
}

// MB rows (<= 6) x NP panels: per block of 64 k, int32 sums by vpdpbusd, folded into fp32 sums;
// then the epilogue. The accumulators are named variables, not arrays: with arrays GCC kept them
// on the stack around the inline assembly.
template <int MB, int NP, Epilogue EPI>
inline void tile(const uint8_t* q, int64_t ldq, const float* x_scale, int64_t blocks,
                 const Panels& p, int64_t N, float* y, int64_t ldy) {
  static_assert(MB >= 1 && MB <= TILE, "a tile has 1 to 6 rows");
#define INT8_SUM(j) __m512 sa##j = _mm512_setzero_ps(), sb##j = _mm512_setzero_ps();
  INT8_SUM(0) INT8_SUM(1) INT8_SUM(2) INT8_SUM(3) INT8_SUM(4)
  INT8_SUM(5)
#undef INT8_SUM
  const int8_t* wa = p.w[0];
  const int8_t* wb = NP == 2 ? p.w[1] : p.w[0];
  for (int64_t blk = 0; blk < blocks; ++blk) {
#define INT8_ACC(j) __m512i a##j = _mm512_setzero_si512(), b##j = _mm512_setzero_si512();
    INT8_ACC(0) INT8_ACC(1) INT8_ACC(2) INT8_ACC(3) INT8_ACC(4)
    INT8_ACC(5)
#undef INT8_ACC
    const int64_t g0 = blk * STEPS;
#pragma GCC unroll 16
    for (int64_t g = g0; g < g0 + STEPS; ++g) {
      const __m512i va = _mm512_loadu_si512(wa + g * P * GROUP);
      const __m512i vb = NP == 2 ? _mm512_loadu_si512(wb + g * P * GROUP) : va;
#define INT8_STEP(j)                                          \
      if constexpr (MB > j) {                                       \
        const __m512i xb = broadcast_group(q + j * ldq + g * GROUP);  \
        dot_add(a##j, xb, va);                                      \
        if constexpr (NP == 2) dot_add(b##j, xb, vb);               \
      }
      INT8_STEP(0) INT8_STEP(1) INT8_STEP(2) INT8_STEP(3)
      INT8_STEP(4) INT8_STEP(5)
#undef INT8_STEP
    }
    const __m512i ca = _mm512_loadu_si512(p.comp[0] + blk * N);
    const __m512i cb = NP == 2 ? _mm512_loadu_si512(p.comp[1] + blk * N) : ca;
#define INT8_FOLD(j)                                              \
    if constexpr (MB > j) {                                             \
      sa##j = fold(sa##j, a##j, ca, x_scale[j * blocks + blk]);         \
      if constexpr (NP == 2) sb##j = fold(sb##j, b##j, cb, x_scale[j * blocks + blk]); \
    }
    INT8_FOLD(0) INT8_FOLD(1) INT8_FOLD(2) INT8_FOLD(3)
    INT8_FOLD(4) INT8_FOLD(5)
#undef INT8_FOLD
  }
#define INT8_OUT(j) \
  if constexpr (MB > j) store_row<NP, EPI>(sa##j, sb##j, p, y + j * ldy);
  INT8_OUT(0) INT8_OUT(1) INT8_OUT(2) INT8_OUT(3) INT8_OUT(4)
  INT8_OUT(5)
#undef INT8_OUT
}

template <int NP, Epilogue EPI>
inline void rows_of(int64_t begin, int64_t end, const uint8_t* q, int64_t ldq, const float* x_scale,
                    int64_t blocks, const Panels& p, int64_t N, float* y, int64_t ldy) {
  for (int64_t m = begin; m < end; m += TILE) {
    const uint8_t* qm = q + m * ldq;
    const float* sm = x_scale + m * blocks;
    float* ym = y + m * ldy;
    switch (std::min(TILE, end - m)) {
      case 6: tile<6, NP, EPI>(qm, ldq, sm, blocks, p, N, ym, ldy); break;
      case 5: tile<5, NP, EPI>(qm, ldq, sm, blocks, p, N, ym, ldy); break;
      case 4: tile<4, NP, EPI>(qm, ldq, sm, blocks, p, N, ym, ldy); break;
      case 3: tile<3, NP, EPI>(qm, ldq, sm, blocks, p, N, ym, ldy); break;
      case 2: tile<2, NP, EPI>(qm, ldq, sm, blocks, p, N, ym, ldy); break;
      case 1: tile<1, NP, EPI>(qm, ldq, sm, blocks, p, N, ym, ldy); break;
      default: break;
    }
  }
}

Panels panels_at(const int8_t* w, const float* scale, const int32_t* comp, const float* bias,
                 int64_t K4, int64_t first, int64_t second) {
  Panels p{};
  const int64_t at[2] = {first, second};
  for (int n = 0; n < 2; ++n) {
    if (at[n] < 0) continue;
    p.w[n] = w + at[n] * K4 * P * GROUP;
    p.scale[n] = scale + at[n] * P;
    p.comp[n] = comp + at[n] * P;
    p.bias[n] = bias ? bias + at[n] * P : nullptr;
  }
  return p;
}
#endif

// x [M, K] fp32 -> (codes [M, Kp] uint8, scales [M, Kp / 64] fp32), Kp = K rounded up to 64.
std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_quantize_rows: x must be fp32 [M, K]");
#ifndef BATCHINFER_VNNI
  TORCH_CHECK(false, "int8 linears need AVX512-VNNI (this build has no avx512_vnni)");
#else
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), Kp = padded(K), blocks = Kp / BLOCK;
  auto q = at::empty({M, Kp}, xc.options().dtype(at::kByte));
  auto scale = at::empty({M, blocks}, xc.options());
  const float* xp = xc.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
#pragma omp parallel for schedule(static) if (M * K > 65536)
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, Kp, qp + m * Kp, sp + m * blocks);
  return {q, scale};
#endif
}

// y = x @ w^T through the int8 codes, [M, N] (silu_mul: [M, N / 2], gate panels then up panels;
// gelu: gelu(y)).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& w_scale,
                       const at::Tensor& w_comp, const c10::optional<at::Tensor>& bias, bool silu_mul,
                       bool gelu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_linear: x must be fp32 [M, K]");
  check_packed(w_packed, w_scale, w_comp, x.size(1), "int8_linear");
  const int64_t panels = w_packed.size(0), N = panels * P;
  TORCH_CHECK(!(silu_mul && gelu), "int8_linear: silu_mul or gelu, not both");
  TORCH_CHECK(!silu_mul || panels % 2 == 0, "int8_linear: silu_mul needs an even number of panels");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == N),
              "int8_linear: bias must be fp32 [N]");
#ifndef BATCHINFER_VNNI
  TORCH_CHECK(false, "int8 linears need AVX512-VNNI (this build has no avx512_vnni)");
#else
  const auto [q, x_scale] = int8_quantize_rows(x);
  const int64_t M = x.size(0), K4 = w_packed.size(1), ldq = q.size(1), blocks = x_scale.size(1);
  const auto wc = w_packed.contiguous();
  const auto sc = w_scale.contiguous();
  const auto cc = w_comp.contiguous();
  at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  const int32_t* cp = cc.data_ptr<int32_t>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* xs = x_scale.data_ptr<float>();
  const int64_t width = silu_mul ? N / 2 : N;
  auto y = at::empty({M, width}, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t row_blocks = (M + ROWS - 1) / ROWS;
  // tasks: (pair of panels, block of rows), pair-major so consecutive tasks reuse the panels
  const int64_t pairs = silu_mul ? panels / 2 : (panels + 1) / 2;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t t = 0; t < pairs; ++t) {
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const int64_t begin = rb * ROWS, end = std::min(M, begin + ROWS);
      if (silu_mul) {
        const Panels p = panels_at(wp, sp, cp, bp, K4, t, panels / 2 + t);
        rows_of<2, kSiluMul>(begin, end, qp, ldq, xs, blocks, p, N, yp + t * P, width);
      } else if (2 * t + 1 < panels) {
        const Panels p = panels_at(wp, sp, cp, bp, K4, 2 * t, 2 * t + 1);
        if (gelu)
          rows_of<2, kGelu>(begin, end, qp, ldq, xs, blocks, p, N, yp + 2 * t * P, width);
        else
          rows_of<2, kPlain>(begin, end, qp, ldq, xs, blocks, p, N, yp + 2 * t * P, width);
      } else {
        const Panels p = panels_at(wp, sp, cp, bp, K4, 2 * t, -1);
        if (gelu)
          rows_of<1, kGelu>(begin, end, qp, ldq, xs, blocks, p, N, yp + 2 * t * P, width);
        else
          rows_of<1, kPlain>(begin, end, qp, ldq, xs, blocks, p, N, yp + 2 * t * P, width);
      }
    }
  }
  return y;
#endif
}

// Whether this build has the int8 kernels ("avx512_vnni") or not ("none").
std::string int8_linear_isa() {
#ifdef BATCHINFER_VNNI
  return "avx512_vnni";
#else
  return "none";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer, m) {
  m.def("int8_linear_isa() -> str", &int8_linear_isa);
  m.def("int8_quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("int8_linear(Tensor x, Tensor w_packed, Tensor w_scale, Tensor w_comp, Tensor? bias=None, "
        "bool silu_mul=False, bool gelu=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchinfer, CPU, m) {
  m.impl("int8_quantize_rows", &int8_quantize_rows);
  m.impl("int8_linear", &int8_linear);
}
