// The paged-attention kernels behind paged_attention.cpp (see there for the contract), templated
// on the K/V cache's element type T: float, or at::BFloat16 / at::Half when cache.kv_cache_dtype
// stores the cache narrower; every load widens to float32 and all arithmetic is float32.
#pragma once
#include <ATen/core/Tensor.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace attention_kernels {

constexpr int kQueryTile = 16;

// K/V elements: float32, or bfloat16 / float16 (cache.kv_cache_dtype), widened on load.
inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }

// Cache lines of T elements, for the prefetch loops.
template <typename T>
constexpr int64_t kLineElems = 64 / sizeof(T);
// How far ahead the decode kernel prefetches, in visits (blocks), into L2. At W-decode's shape
// (benchmarks/engine/kv_dtype_attention.py, builds alternating) 8 blocks ahead into L2, a few lines at a
// time, ran fp32 decode attention 1.10-1.26x faster than the next block whole into L1.
constexpr size_t kPrefetchVisits = 8;

template <int D, typename T>
inline float dot(const float* __restrict a, const T* __restrict b) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int d = 0; d < D; ++d) acc += a[d] * to_float(b[d]);
  return acc;
}

template <typename T>
inline float dot_dyn(const float* __restrict a, const T* __restrict b, int n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int d = 0; d < n; ++d) acc += a[d] * to_float(b[d]);
  return acc;
}

#ifdef BATCHINFER_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {  // bf16 is the high half of an fp32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline __m256 load8(const at::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
#endif
}
#endif

// window > 0: each query sees only its last `window` keys (a sliding-window layer); softcap > 0:
// scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2). Both 0: plain causal.
// sinks (GPT-OSS; nullptr: none): a logit per query head that joins the softmax's denominator
// (exp(sink - max) added to the sum at the end) and takes no value.
template <int D, typename T>
void attend_item(const float* q, float* out, const T* kc, const T* vc, const int* table,
                 int num_q, int ctx, int group, int head_dim, int block_size, int64_t q_tok_stride,
                 int64_t q_head_stride, int64_t out_tok_stride, int64_t out_head_stride,
                 int64_t block_stride, float scale, int kv_head, int64_t head_stride,
                 int window = 0, float softcap = 0.f, const float* sinks = nullptr) {
  const int hd = D > 0 ? D : head_dim;
  const int rows = num_q * group;  // (query, head-in-group) pairs
  std::vector<float> acc(static_cast<size_t>(rows) * hd, 0.f);
  std::vector<float> m(rows, -std::numeric_limits<float>::infinity());
  std::vector<float> l(rows, 0.f);
  std::vector<float> s(static_cast<size_t>(rows) * block_size);
  std::vector<float> qs(static_cast<size_t>(rows) * hd);
  for (int j = 0; j < num_q; ++j)
    for (int g = 0; g < group; ++g) {
      const float* src = q + j * q_tok_stride + (kv_head * group + g) * q_head_stride;
      float* dst = qs.data() + (static_cast<size_t>(j) * group + g) * hd;
      for (int d = 0; d < hd; ++d) dst[d] = src[d] * scale;
    }
  const int last_pos = ctx + num_q - 1;  // the last query's position
  const int num_blocks = last_pos / block_size + 1;
  const int first_block = window > 0 ? std::max(0, ctx - window + 1) / block_size : 0;
  for (int b = first_block; b < num_blocks; ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * block_stride + kv_head * head_stride;
    const T* kb = kc + base;
    const T* vb = vc + base;
    const int start = b * block_size;
    const int n = std::min(block_size, last_pos + 1 - start);
    for (int r = 0; r < rows; ++r) {
      const int j = r / group;
      const int visible = std::min(n, ctx + j + 1 - start);  // causal limit for this query
      const int from = window > 0 ? std::max(0, ctx + j + 1 - window - start) : 0;  // window's
      float* sr = s.data() + static_cast<size_t>(r) * block_size;
      if (visible <= from) continue;
      const float* qr = qs.data() + static_cast<size_t>(r) * hd;
      float bmax = -std::numeric_limits<float>::infinity();
      for (int t = from; t < visible; ++t) {
        float v = D > 0 ? dot<D, T>(qr, kb + t * hd) : dot_dyn(qr, kb + t * hd, hd);
        if (softcap > 0.f) v = softcap * std::tanh(v / softcap);
        sr[t] = v;
        bmax = std::max(bmax, v);
      }
      const float new_m = std::max(m[r], bmax);
      const float correction = std::exp(m[r] - new_m);
      float bsum = 0.f;
#pragma omp simd reduction(+ : bsum)
      for (int t = from; t < visible; ++t) {
        const float p = std::exp(sr[t] - new_m);
        sr[t] = p;
        bsum += p;
      }
      l[r] = l[r] * correction + bsum;
      m[r] = new_m;
      float* ar = acc.data() + static_cast<size_t>(r) * hd;
      if (correction != 1.f) {
#pragma omp simd
        for (int d = 0; d < hd; ++d) ar[d] *= correction;
      }
      for (int t = from; t < visible; ++t) {
        const float p = sr[t];
        const T* vr = vb + t * hd;
#pragma omp simd
        for (int d = 0; d < hd; ++d) ar[d] += p * to_float(vr[d]);
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int j = r / group, g = r % group;
    float* dst = out + j * out_tok_stride + (kv_head * group + g) * out_head_stride;
    const float denom = sinks ? l[r] + std::exp(sinks[kv_head * group + g] - m[r]) : l[r];
    const float inv = 1.f / denom;
    const float* ar = acc.data() + static_cast<size_t>(r) * hd;
    for (int d = 0; d < hd; ++d) dst[d] = ar[d] * inv;
  }
}

#ifdef BATCHINFER_AVX2
// Same contract as attend_item, for kv heads [kv_head, kv_head + num_kv) at once: a block's heads
// are adjacent in memory, so each block is one contiguous read per K and V. D a multiple of 8.
// Scores for 8 tokens come out of one hsum8; softmax and V accumulation run 8 lanes at a time.
template <int D, typename T>
void attend_item_avx2(const float* q, float* out, const T* kc, const T* vc, const int* table,
                      int num_q, int ctx, int group, int block_size, int64_t q_tok_stride,
                      int64_t q_head_stride, int64_t out_tok_stride, int64_t out_head_stride,
                      int64_t block_stride, float scale, int kv_head, int num_kv, int64_t head_stride) {
  constexpr int C = D / 8;
  const int per_head = num_q * group;       // rows of one kv head: (query, head-in-group)
  const int rows = num_kv * per_head;
  std::vector<float> acc(static_cast<size_t>(rows) * D, 0.f);
  std::vector<float> m(rows, -std::numeric_limits<float>::infinity());
  std::vector<float> l(rows, 0.f);
  std::vector<float> qs(static_cast<size_t>(rows) * D);
  std::vector<float> s(static_cast<size_t>(block_size) + 8);
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int r = 0; r < rows; ++r) {
    const int h = kv_head + r / per_head, j = (r % per_head) / group, g = r % group;
    const float* src = q + j * q_tok_stride + (h * group + g) * q_head_stride;
    float* dst = qs.data() + static_cast<size_t>(r) * D;
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(src + 8 * c), vscale));
  }
  const int last_pos = ctx + num_q - 1;
  const int num_blocks = last_pos / block_size + 1;
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t span = static_cast<int64_t>(num_kv) * head_stride;  // floats of this item per block
  for (int b = 0; b < num_blocks; ++b) {
    const int64_t block_base = static_cast<int64_t>(table[b]) * block_stride + kv_head * head_stride;
    const int start = b * block_size;
    const int n = std::min(block_size, last_pos + 1 - start);
    if (b + 1 < num_blocks) {
      // Blocks are scattered, and hardware prefetchers stop at page boundaries: fetch the next
      // block's K and V while this one is computed.
      const int64_t next = static_cast<int64_t>(table[b + 1]) * block_stride + kv_head * head_stride;
      for (int64_t off = 0; off < span; off += kLineElems<T>) {
        _mm_prefetch(reinterpret_cast<const char*>(kc + next + off), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vc + next + off), _MM_HINT_T0);
      }
    }
    for (int r = 0; r < rows; ++r) {
      const int visible = std::min(n, ctx + (r % per_head) / group + 1 - start);
      if (visible <= 0) continue;
      const int64_t base = block_base + static_cast<int64_t>(r / per_head) * head_stride;
      const T* kb = kc + base;
      const T* vb = vc + base;
      const float* qr = qs.data() + static_cast<size_t>(r) * D;
      __m256 qv[C];
      for (int c = 0; c < C; ++c) qv[c] = _mm256_loadu_ps(qr + 8 * c);
      __m256 vmax = neg_inf;
      for (int t0 = 0; t0 < visible; t0 += 8) {
        __m256 a[8];
        for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
        const T* kr = kb + static_cast<int64_t>(t0) * D;
        if (t0 + 8 <= visible) {
          // Eight independent FMA chains (one per token) instead of one long chain per token.
          for (int c = 0; c < C; ++c)
            for (int u = 0; u < 8; ++u)
              a[u] = _mm256_fmadd_ps(qv[c], load8(kr + u * D + 8 * c), a[u]);
        } else {
          for (int u = 0; u < visible - t0; ++u)
            for (int c = 0; c < C; ++c)
              a[u] = _mm256_fmadd_ps(qv[c], load8(kr + u * D + 8 * c), a[u]);
        }
        __m256 sv = simd::hsum8(a);
        const int valid = visible - t0;
        if (valid < 8) {
          const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
          const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane));
          sv = _mm256_blendv_ps(neg_inf, sv, keep);
        }
        _mm256_storeu_ps(s.data() + t0, sv);
        vmax = _mm256_max_ps(vmax, sv);
      }
      const float new_m = std::max(m[r], simd::hmax(vmax));
      const float correction = std::exp(m[r] - new_m);
      const __m256 vm = _mm256_set1_ps(new_m);
      __m256 vsum = _mm256_setzero_ps();
      for (int t0 = 0; t0 < visible; t0 += 8) {
        const __m256 p = simd::exp(_mm256_sub_ps(_mm256_loadu_ps(s.data() + t0), vm));
        const int valid = visible - t0;
        __m256 pm = p;
        if (valid < 8) {
          const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
          pm = _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane)));
        }
        _mm256_storeu_ps(s.data() + t0, pm);
        vsum = _mm256_add_ps(vsum, pm);
      }
      l[r] = l[r] * correction + simd::hsum(vsum);
      m[r] = new_m;
      float* ar = acc.data() + static_cast<size_t>(r) * D;
      __m256 o[C];
      const __m256 corr = _mm256_set1_ps(correction);
      for (int c = 0; c < C; ++c) o[c] = _mm256_mul_ps(_mm256_loadu_ps(ar + 8 * c), corr);
      for (int t = 0; t < visible; ++t) {
        const __m256 p = _mm256_set1_ps(s[t]);
        const T* vr = vb + static_cast<int64_t>(t) * D;
        for (int c = 0; c < C; ++c) o[c] = _mm256_fmadd_ps(p, load8(vr + 8 * c), o[c]);
      }
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(ar + 8 * c, o[c]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int h = kv_head + r / per_head, j = (r % per_head) / group, g = r % group;
    float* dst = out + j * out_tok_stride + (h * group + g) * out_head_stride;
    const __m256 inv = _mm256_set1_ps(1.f / l[r]);
    const float* ar = acc.data() + static_cast<size_t>(r) * D;
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(ar + 8 * c), inv));
  }
}

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
      qp[c] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
          _mm512_mul_ps(_mm512_loadu_ps(qg + 32 * c + 16), vscale),
          _mm512_mul_ps(_mm512_loadu_ps(qg + 32 * c), vscale)));
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

// Decode (one query per sequence) for a set of sequences, all kv heads at once, in two passes
// instead of an online softmax: scores for every cached token first, one softmax per query head,
// then the V pass. Each pass visits the (sequence, block) pairs in physical block order, not
// sequence by sequence: sequences that grow in lockstep (a batch decoding together) get their
// blocks interleaved by the allocator, so physical order turns scattered 12 KB reads into long
// runs the hardware prefetcher follows, and is no worse when the blocks are scattered (on a
// 2-core AVX2 machine, 128 sequences at 139 tokens of context, 30 layers, KV from DRAM: 30.9 ms
// a step against attend_item_avx2's 46.4 ms on the lockstep layout, 55 ms for both on random
// blocks). The per-thread scratch (scores and accumulators) is kept between calls.
// block_size and D multiples of 8.
struct DecodeSeq {
  const float* q;    // [heads, D] at q_head_stride
  float* out;        // [heads, D] at out_head_stride
  const int* table;  // block table
  int tokens;        // positions to attend: cached + this one
};

template <int D, typename T>
void attend_decode_avx2(const DecodeSeq* seqs, int count, const T* kc, const T* vc,
                        int group, int block_size, int64_t q_head_stride, int64_t out_head_stride,
                        int64_t block_stride, float scale, int num_kv, int64_t head_stride) {
  constexpr int C = D / 8;
  const int rows = num_kv * group;
  struct Visit { int block, seq, index; };
  thread_local std::vector<Visit> visits;
  thread_local std::vector<size_t> offsets;  // each sequence's scores [rows, padded] then acc [rows, D]
  thread_local std::vector<float> scratch;
  // A narrow cache's rows of one (block, head), widened once and then read by every query head
  // of the group from L1: the conversion is paid once per element, not once per query head.
  thread_local std::vector<float> wide;
  wide.resize(static_cast<size_t>(block_size) * D);
  thread_local std::vector<uint16_t> pairs;  // bf16_dot_accumulate's interleaved value rows
  if constexpr (kBf16Dot<T>) pairs.resize(static_cast<size_t>(block_size + 1) * D);
  auto widened = [&](const T* rows, int n) -> const float* {
    if constexpr (std::is_same_v<T, float>) {
      return rows;
    } else {
      for (int64_t i = 0; i < static_cast<int64_t>(n) * D; i += 8) _mm256_storeu_ps(wide.data() + i, load8(rows + i));
      return wide.data();
    }
  };
  visits.clear();
  offsets.resize(count + 1);
  offsets[0] = 0;
  for (int i = 0; i < count; ++i) {
    const int padded = (seqs[i].tokens + 7) & ~7;
    offsets[i + 1] = offsets[i] + static_cast<size_t>(rows) * (padded + D);
    const int num_blocks = (seqs[i].tokens + block_size - 1) / block_size;
    for (int b = 0; b < num_blocks; ++b) visits.push_back({seqs[i].table[b], i, b});
  }
  std::sort(visits.begin(), visits.end(), [](const Visit& a, const Visit& b) { return a.block < b.block; });
  scratch.resize(offsets[count]);
  const int64_t span = static_cast<int64_t>(num_kv) * head_stride;  // floats of one block, all heads
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 vscale = _mm256_set1_ps(scale);
  auto scores_of = [&](int i) { return scratch.data() + offsets[i]; };
  auto padded_of = [&](int i) { return (seqs[i].tokens + 7) & ~7; };
  auto acc_of = [&](int i) { return scores_of(i) + static_cast<size_t>(rows) * padded_of(i); };
  // The block kPrefetchVisits visits ahead, into L2 a few lines at a time from inside the compute
  // loops (all ~200 lines in one burst at the start of a visit wait on the fill buffers).
  const int64_t span_lines = (span + kLineElems<T> - 1) / kLineElems<T>;
  const char* pf_next = nullptr;
  int64_t pf_left = 0, pf_step = 0;
  auto prefetch_start = [&](const T* cache, size_t v, int64_t calls) {
    pf_left = v < visits.size() ? span_lines : 0;
    if (pf_left) pf_next = reinterpret_cast<const char*>(cache + static_cast<int64_t>(visits[v].block) * block_stride);
    pf_step = (span_lines + calls - 1) / std::max<int64_t>(1, calls);
  };
  auto prefetch_some = [&]() {
    for (int64_t i = 0; i < pf_step && pf_left > 0; ++i, --pf_left, pf_next += 64)
      _mm_prefetch(pf_next, _MM_HINT_T1);
  };
  auto prefetch_rest = [&]() {
    for (; pf_left > 0; --pf_left, pf_next += 64) _mm_prefetch(pf_next, _MM_HINT_T1);
  };
  // Pass 1: scores[r, t] = scale * q_r . k_t
  for (size_t v = 0; v < visits.size(); ++v) {
    const DecodeSeq& sq = seqs[visits[v].seq];
    const int start = visits[v].index * block_size;
    const int n = std::min(block_size, sq.tokens - start);
    prefetch_start(kc, v + kPrefetchVisits, static_cast<int64_t>(num_kv) * group * ((n + 7) / 8));
    const int padded = padded_of(visits[v].seq);
    float* scores = scores_of(visits[v].seq);
    const T* block = kc + static_cast<int64_t>(visits[v].block) * block_stride;
    for (int h = 0; h < num_kv; ++h) {
#ifdef BATCHINFER_BF16_ATTENTION
      if constexpr (kBf16Dot<T>) {
        bf16_dot_scores<D>(block + h * head_stride, n, sq.q + h * group * q_head_stride,
                           q_head_stride, group, scale,
                           scores + static_cast<size_t>(h * group) * padded + start, padded,
                           std::min(padded - start, block_size), prefetch_some);
        continue;
      }
#endif
      const float* kb = widened(block + h * head_stride, n);
      for (int g = 0; g < group; ++g) {
        const int r = h * group + g;
        const float* qr = sq.q + r * q_head_stride;
        __m256 qv[C];
        for (int c = 0; c < C; ++c) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(qr + 8 * c), vscale);
        float* sr = scores + static_cast<size_t>(r) * padded + start;
        for (int t0 = 0; t0 < n; t0 += 8) {
          prefetch_some();
          __m256 a[8];
          for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
          const float* kr = kb + static_cast<int64_t>(t0) * D;
          const int valid = std::min(8, n - t0);
          if (valid == 8) {
            for (int c = 0; c < C; ++c)
              for (int u = 0; u < 8; ++u)
                a[u] = _mm256_fmadd_ps(qv[c], load8(kr + u * D + 8 * c), a[u]);
          } else {
            for (int u = 0; u < valid; ++u)
              for (int c = 0; c < C; ++c)
                a[u] = _mm256_fmadd_ps(qv[c], load8(kr + u * D + 8 * c), a[u]);
          }
          __m256 sv = simd::hsum8(a);
          if (valid < 8)
            sv = _mm256_blendv_ps(neg_inf, sv, _mm256_castsi256_ps(
                _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane)));
          _mm256_storeu_ps(sr + t0, sv);
        }
      }
    }
    prefetch_rest();
  }
  // Softmax per row: p = exp(s - max); 1 / sum is applied to the output at the end.
  thread_local std::vector<float> inv_sum;
  inv_sum.resize(static_cast<size_t>(count) * rows);
  for (int i = 0; i < count; ++i) {
    const int padded = padded_of(i), tokens = seqs[i].tokens;
    float* scores = scores_of(i);
    for (int r = 0; r < rows; ++r) {
      float* sr = scores + static_cast<size_t>(r) * padded;
      __m256 vmax = neg_inf;
      for (int t0 = 0; t0 < padded; t0 += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sr + t0));
      const __m256 vm = _mm256_set1_ps(simd::hmax(vmax));
      __m256 vsum = _mm256_setzero_ps();
      for (int t0 = 0; t0 < padded; t0 += 8) {
        __m256 p = simd::exp(_mm256_sub_ps(_mm256_loadu_ps(sr + t0), vm));
        const int valid = tokens - t0;
        if (valid < 8)
          p = _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane)));
        _mm256_storeu_ps(sr + t0, p);
        vsum = _mm256_add_ps(vsum, p);
      }
      inv_sum[static_cast<size_t>(i) * rows + r] = 1.f / simd::hsum(vsum);
    }
    std::fill(acc_of(i), acc_of(i) + static_cast<size_t>(rows) * D, 0.f);
  }
  // Pass 2: acc[r] += p[r, t] * v_t
  for (size_t v = 0; v < visits.size(); ++v) {
    const DecodeSeq& sq = seqs[visits[v].seq];
    const int start = visits[v].index * block_size;
    const int n = std::min(block_size, sq.tokens - start);
    prefetch_start(vc, v + kPrefetchVisits, static_cast<int64_t>(num_kv) * group * ((n + 3) / 4));
    const int padded = padded_of(visits[v].seq);
    const float* scores = scores_of(visits[v].seq);
    float* acc = acc_of(visits[v].seq);
    const T* block = vc + static_cast<int64_t>(visits[v].block) * block_stride;
    for (int h = 0; h < num_kv; ++h) {
#ifdef BATCHINFER_BF16_ATTENTION
      if constexpr (kBf16Dot<T>) {
        bf16_dot_accumulate<D>(block + h * head_stride, n,
                               scores + static_cast<size_t>(h * group) * padded + start, padded,
                               group, acc + static_cast<size_t>(h * group) * D, pairs.data(),
                               prefetch_some);
        continue;
      }
#endif
      const float* vb = widened(block + h * head_stride, n);
      for (int g = 0; g < group; ++g) {
        const int r = h * group + g;
        const float* pr = scores + static_cast<size_t>(r) * padded + start;
        float* ar = acc + static_cast<size_t>(r) * D;
        __m256 o[C];
        for (int c = 0; c < C; ++c) o[c] = _mm256_loadu_ps(ar + 8 * c);
        for (int t = 0; t < n; ++t) {
          if ((t & 3) == 0) prefetch_some();
          const __m256 p = _mm256_broadcast_ss(pr + t);
          const float* vr = vb + static_cast<int64_t>(t) * D;
          for (int c = 0; c < C; ++c) o[c] = _mm256_fmadd_ps(p, load8(vr + 8 * c), o[c]);
        }
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(ar + 8 * c, o[c]);
      }
    }
    prefetch_rest();
  }
  for (int i = 0; i < count; ++i) {
    const float* acc = acc_of(i);
    for (int r = 0; r < rows; ++r) {
      float* dst = seqs[i].out + r * out_head_stride;
      const float* ar = acc + static_cast<size_t>(r) * D;
#ifdef BATCHINFER_BF16_ATTENTION
      if constexpr (kBf16Dot<T>) {
        bf16_dot_output<D>(ar, dst, inv_sum[static_cast<size_t>(i) * rows + r]);
        continue;
      }
#endif
      const __m256 inv = _mm256_set1_ps(inv_sum[static_cast<size_t>(i) * rows + r]);
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(ar + 8 * c), inv));
    }
  }
}
#endif

}  // namespace attention_kernels
