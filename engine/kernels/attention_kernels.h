// The paged-attention kernels behind paged_attention.cpp (see there for the contract), templated
// on the K/V cache's element type T: float, or at::BFloat16 / at::Half when cache.kv_cache_dtype
// stores the cache narrower; every load widens to float32 and all arithmetic is float32, except
// decode rows over a bf16 cache where the CPU has AVX512-BF16 and no AMX (attention_bf16_dot.h).
#pragma once
#include <ATen/core/Tensor.h>

#include "simd.h"
#include "attention_bf16_dot.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// Into L1, a block's K and V rows of a head or of adjacent heads (`elems` elements each from
// `offset`): blocks are scattered and hardware prefetchers stop at page boundaries, so the
// kernels fetch the next block's rows while they compute on this one.
template <typename T>
inline void prefetch_head_block(const T* kc, const T* vc, int64_t offset, int64_t elems) {
  for (int64_t i = 0; i < elems; i += kLineElems<T>) {
    _mm_prefetch(reinterpret_cast<const char*>(kc + offset + i), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(vc + offset + i), _MM_HINT_T0);
  }
}

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
    if (b + 1 < num_blocks)
      prefetch_head_block(kc, vc, static_cast<int64_t>(table[b + 1]) * block_stride + kv_head * head_stride,
                          span);
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

// Decode (one query per sequence) for a set of sequences, all kv heads at once, in two passes
// instead of an online softmax: scores for every cached token first, one softmax per query head,
// then the V pass. The score pass visits the (sequence, block) pairs in physical block order, not
// sequence by sequence: sequences that grow in lockstep (a batch decoding together) get their
// blocks interleaved by the allocator, so physical order turns scattered 12 KB reads into long
// runs the hardware prefetcher follows, and is no worse when the blocks are scattered (on a
// 2-core AVX2 machine, 128 sequences at 139 tokens of context, 30 layers, KV from DRAM: 30.9 ms
// a step against attend_item_avx2's 46.4 ms on the lockstep layout, 55 ms for both on random
// blocks). The V pass sums each sequence's blocks in sequence order, so the output's bits do not
// depend on the blocks' placement (in physical order a bf16 model's greedy replies changed with
// the free list's order; sequence order cost 0-4% of the kernel's time on a Zen 4 EPYC, W-decode's
// lockstep layout). The per-thread scratch (scores and accumulators) is kept between calls.
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
  // Pass 2: acc[r] += p[r, t] * v_t, each sequence's blocks in their order in the sequence, so
  // that the sums (and the tokens after them) do not depend on where the allocator put the
  // blocks; the prefetch ahead covers the jumps between blocks.
  std::sort(visits.begin(), visits.end(), [](const Visit& a, const Visit& b) {
    return a.seq != b.seq ? a.seq < b.seq : a.index < b.index;
  });
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
