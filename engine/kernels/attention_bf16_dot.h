// The decode kernel's inner loops over a bf16 K/V cache in bf16 dot products (attention_kernels.h's
// attend_decode_avx2 calls them where kBf16Dot<T>): built only for CPUs with AVX512-BF16 and no AMX.
#pragma once
#include <ATen/core/Tensor.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace attention_kernels {

// bf16 dot products for the decode kernel over a bf16 cache, on CPUs with AVX512-BF16 and no AMX
// (on the AMX Xeon vdpbf16ps ran at half the fp32 FMA rate): K and V are read as stored, never
// widened. The query (times the scale) and the softmax weights are rounded to bf16 and the products
// summed in fp32, as a bf16 model's attention does in transformers or vLLM; the fp32-weight
// caches and every other CPU keep the fp32 arithmetic above. Over W-decode's shape the widening
// and the fp32 FMAs, not the K/V bytes, bounded the bf16-cache kernel on a Zen 4 EPYC.
#if defined(BATCHINFER_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#define BATCHINFER_BF16_ATTENTION 1

template <typename T>
constexpr bool kBf16Dot = std::is_same_v<T, at::BFloat16>;

// Lane t of the result: the sum of a[t]'s 16 lanes (a transpose-and-add tree).
inline __m512 hsum16(const __m512* a) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit chunk: (a0+a2, b0+b2, a1+a3, b1+b3)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int j = 0; j < 4; ++j)  // per chunk: the chunk's sums of a[4j], .., a[4j + 3]
    x[j] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// 32 floats times `scale` -> one zmm of 32 bf16 (element i in half-word i): a row's bf16 pairs.
inline __m512i bf16x32(const float* x, __m512 scale) {
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + 16), scale),
                                                       _mm512_mul_ps(_mm512_loadu_ps(x), scale)));
}

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// Scores of a kv head's `group` query rows (row g at q + g q_stride) against one block's n keys
// (bf16 [n, D]): row g's into sr + g s_stride, -inf past n up to `limit` (the scores' padding in
// the last block; the block's own width in the others, whose neighbours may be written already).
template <int D, typename Some>
void bf16_dot_scores(const at::BFloat16* keys, int n, const float* q, int64_t q_stride,
                     int group, float scale, float* sr, int64_t s_stride, int limit, Some&& some) {
  constexpr int C = D / 32;  // 32 bf16 (16 pairs) a zmm
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const uint16_t* kr = reinterpret_cast<const uint16_t*>(keys);
  for (int g = 0; g < group; ++g) {
    const float* qg = q + g * q_stride;
    __m512i qp[C];
    for (int c = 0; c < C; ++c)
      qp[c] = bf16x32(qg + 32 * c, vscale);
    float* row = sr + g * s_stride;
    for (int t0 = 0; t0 < n; t0 += 16) {
      some();
      some();
      const int valid = std::min(16, n - t0);
      __m512 a[16];
      if (valid == 16) {
        for (int u = 0; u < 16; ++u) {
          a[u] = _mm512_setzero_ps();
          for (int c = 0; c < C; ++c)
            a[u] = dot_pairs(a[u], qp[c], _mm512_loadu_si512(kr + (t0 + u) * D + 32 * c));
        }
      } else {
        for (int u = 0; u < 16; ++u) a[u] = _mm512_setzero_ps();
        for (int u = 0; u < valid; ++u)
          for (int c = 0; c < C; ++c)
            a[u] = dot_pairs(a[u], qp[c], _mm512_loadu_si512(kr + (t0 + u) * D + 32 * c));
      }
      const __mmask16 keep = valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
      const int width = std::min(16, limit - t0);
      _mm512_mask_storeu_ps(row + t0, width >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1),
                            _mm512_mask_blend_ps(keep, neg_inf, hsum16(a)));
    }
  }
}

// acc (row g at acc + g D) += p . V over one block's n values (bf16 [n, D]) for a kv head's
// `group` rows of softmax weights (row g at p + g p_stride). Tokens go in pairs: rows t and t + 1
// interleaved once per block into `pairs` (then shared by the group), so acc holds each 32-wide
// chunk of d as [d 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31]: bf16_dot_output restores
// the order.
template <int D, typename Some>
void bf16_dot_accumulate(const at::BFloat16* values, int n, const float* p, int64_t p_stride,
                         int group, float* acc, uint16_t* pairs, Some&& some) {
  constexpr int C = D / 32;
  const uint16_t* vr = reinterpret_cast<const uint16_t*>(values);
  const int npairs = (n + 1) / 2;
  for (int j = 0; j < npairs; ++j)
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(vr + 2 * j * D + 32 * c);
      const __m512i b = 2 * j + 1 < n ? _mm512_loadu_si512(vr + (2 * j + 1) * D + 32 * c)
                                      : _mm512_setzero_si512();
      _mm512_storeu_si512(pairs + (j * C + c) * 64, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(pairs + (j * C + c) * 64 + 32, _mm512_unpackhi_epi16(a, b));
    }
  thread_local std::vector<uint16_t> row_weights;  // a row's weights of this block in bf16
  row_weights.resize(static_cast<size_t>((n + 15) & ~15));
  uint16_t* weights = row_weights.data();
  for (int g = 0; g < group; ++g) {
    const float* pg = p + g * p_stride;
    for (int t0 = 0; t0 < n; t0 += 16) {
      const int valid = std::min(16, n - t0);
      const __m512 w = _mm512_maskz_loadu_ps(valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1),
                                             pg + t0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + t0),   // zeros past n
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(w)));
    }
    float* ag = acc + g * D;
    __m512 o[2 * C];
    for (int m = 0; m < 2 * C; ++m) o[m] = _mm512_loadu_ps(ag + 16 * m);
    for (int j = 0; j < npairs; ++j) {
      if ((j & 1) == 0) some();
      int32_t two;
      std::memcpy(&two, weights + 2 * j, sizeof two);
      const __m512i pp = _mm512_set1_epi32(two);
      for (int c = 0; c < C; ++c) {
        o[2 * c] = dot_pairs(o[2 * c], pp, _mm512_loadu_si512(pairs + (j * C + c) * 64));
        o[2 * c + 1] = dot_pairs(o[2 * c + 1], pp, _mm512_loadu_si512(pairs + (j * C + c) * 64 + 32));
      }
    }
    for (int m = 0; m < 2 * C; ++m) _mm512_storeu_ps(ag + 16 * m, o[m]);
  }
}

// dst[0 .. D) = acc (bf16_dot_accumulate's order) * inv, in d order.
template <int D>
inline void bf16_dot_output(const float* acc, float* dst, float inv) {
  const __m512 scale = _mm512_set1_ps(inv);
  for (int c = 0; c < D / 32; ++c) {
    const __m512 lo = _mm512_loadu_ps(acc + 32 * c), hi = _mm512_loadu_ps(acc + 32 * c + 16);
    const __m512 first = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));   // lo0 lo1 hi0 hi1
    const __m512 second = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));  // lo2 lo3 hi2 hi3
    _mm512_storeu_ps(dst + 32 * c, _mm512_mul_ps(_mm512_shuffle_f32x4(first, first, _MM_SHUFFLE(3, 1, 2, 0)), scale));
    _mm512_storeu_ps(dst + 32 * c + 16, _mm512_mul_ps(_mm512_shuffle_f32x4(second, second, _MM_SHUFFLE(3, 1, 2, 0)), scale));
  }
}
#else
template <typename T>
constexpr bool kBf16Dot = false;
#endif

}  // namespace attention_kernels
