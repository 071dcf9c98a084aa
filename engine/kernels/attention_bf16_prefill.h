// Prefill rows (a tile of a sequence's queries) over a bf16 K/V cache in bf16 dot products, on the
// CPUs the decode kernel's bf16 path serves (attention_bf16_dot.h: AVX512-BF16, no AMX). The fp32
// kernel (attend_item_avx2) widens each key once per query row and reduces every 8 scores through
// a horizontal sum: on a Zen 4 EPYC a ShareGPT prefill's attention over the bf16 cache ran at
// ~57 GFLOP/s that way, an eighth of what vdpbf16ps does. Here a 16-token slice of a block is
// transposed once (lane t of word p: key t's dims 2p, 2p + 1), and each query row's 16 scores are
// one accumulator of D / 2 dot products with the row's bf16 pairs broadcast; the softmax weights
// (16 to a register) are rounded to bf16 and multiply the slice's values, interleaved in token
// pairs once and shared by every row. Online softmax per row in fp32, as the widening kernel; the
// query (times the scale) and the weights are rounded to bf16, as the decode path and a bf16
// model's attention in transformers or vLLM do.
#pragma once
#include "attention_bf16_dot.h"
#include "attention_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace attention_kernels {

#ifdef BATCHINFER_BF16_ATTENTION

using simd::exp16;  // e^x for 16 floats (simd.h)

// A 16 x 16 matrix of 32-bit words, row i in r[i], transposed in place: r[j] lane i = old r[i] lane j.
inline void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: interleave rows i, i + 1
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + c] lane L: column 4L + c of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)    // 128-bit lanes: columns c and c + 8 of rows h .. h + 7
    for (int c = 0; c < 4; ++c) {
      t[h + c] = _mm512_shuffle_i32x4(r[h + c], r[h + 4 + c], 0x88);
      t[h + 4 + c] = _mm512_shuffle_i32x4(r[h + c], r[h + 4 + c], 0xdd);
    }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
  }
}

// attend_item_avx2's contract (kv heads [kv_head, kv_head + num_kv), num_q queries from position
// ctx, plain causal) over a bf16 cache. D 64 or 128.
template <int D>
void attend_prefill_bf16(const float* q, float* out, const at::BFloat16* kc, const at::BFloat16* vc,
                         const int* table, int num_q, int ctx, int group, int block_size,
                         int64_t q_tok_stride, int64_t q_head_stride, int64_t out_tok_stride,
                         int64_t out_head_stride, int64_t block_stride, float scale, int kv_head,
                         int num_kv, int64_t head_stride) {
  constexpr int W = D / 2;   // 32-bit words (bf16 pairs) of a row
  constexpr int C = D / 32;  // zmm of a bf16 row
  constexpr int kRows = 8;   // query rows a score pass keeps in flight
  const int rows = num_q * group;
  const int padded_rows = (rows + kRows - 1) / kRows * kRows;
  thread_local std::vector<uint32_t> qw;    // [padded_rows, W] the scaled query rows' bf16 pairs
  thread_local std::vector<float> acc;      // [rows, D] in bf16_dot_accumulate's order
  thread_local std::vector<float> m, l;
  thread_local std::vector<uint32_t> pw;    // [rows, 8] a row's 16 weights of the slice in bf16
  thread_local std::vector<int> visible;    // [rows] keys of the slice a row sees
  qw.assign(static_cast<size_t>(padded_rows) * W, 0u);
  acc.resize(static_cast<size_t>(rows) * D);
  m.resize(rows);
  l.resize(rows);
  pw.resize(static_cast<size_t>(rows) * 8);
  visible.resize(rows);
  // the thread-locals' storage, looked up once (in a shared library each use may cost a call)
  uint32_t* const q_words = qw.data();
  float* const accs = acc.data();
  float* const ms = m.data();
  float* const ls = l.data();
  uint32_t* const pws = pw.data();
  int* const vis = visible.data();
  __m512i kt[W];           // the slice's keys, transposed
  __m512i vp[8 * 2 * C];   // the slice's values, token pairs interleaved
  alignas(64) float scores[kRows][16];
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int last_pos = ctx + num_q - 1;
  const int num_blocks = last_pos / block_size + 1;
  for (int h = kv_head; h < kv_head + num_kv; ++h) {
    for (int r = 0; r < rows; ++r) {  // row r: query r / group, head h * group + r % group
      const float* src = q + (r / group) * q_tok_stride + (h * group + r % group) * q_head_stride;
      for (int c = 0; c < C; ++c)
        _mm512_storeu_si512(q_words + static_cast<size_t>(r) * W + 16 * c, bf16x32(src + 32 * c, vscale));
    }
    std::fill(accs, accs + static_cast<size_t>(rows) * D, 0.f);
    std::fill(ms, ms + rows, -std::numeric_limits<float>::infinity());
    std::fill(ls, ls + rows, 0.f);
    for (int b = 0; b < num_blocks; ++b) {
      const int64_t base = static_cast<int64_t>(table[b]) * block_stride + h * head_stride;
      const uint16_t* kb = reinterpret_cast<const uint16_t*>(kc + base);
      const uint16_t* vb = reinterpret_cast<const uint16_t*>(vc + base);
      const int in_block = std::min(block_size, last_pos + 1 - b * block_size);
      if (b + 1 < num_blocks)  // the next block's rows of this head (attention_kernels.h)
        prefetch_head_block(kc, vc, static_cast<int64_t>(table[b + 1]) * block_stride + h * head_stride,
                            static_cast<int64_t>(block_size) * D);
      for (int t0 = 0; t0 < in_block; t0 += 16) {
        const int n = std::min(16, in_block - t0);
        const int first_key = b * block_size + t0;
        for (int c = 0; c < C; ++c) {  // words [16c, 16c + 16) of each key, transposed
          __m512i* part = kt + 16 * c;
          for (int t = 0; t < 16; ++t)
            part[t] = t < n ? _mm512_loadu_si512(kb + (t0 + t) * D + 32 * c) : _mm512_setzero_si512();
          transpose16x16(part);
        }
        for (int j = 0; j < 8; ++j)     // past n the values are zeros, never the cache's leftovers
          for (int c = 0; c < C; ++c) {
            const int t = t0 + 2 * j;
            const __m512i a = 2 * j < n ? _mm512_loadu_si512(vb + t * D + 32 * c) : _mm512_setzero_si512();
            const __m512i z = 2 * j + 1 < n ? _mm512_loadu_si512(vb + (t + 1) * D + 32 * c)
                                            : _mm512_setzero_si512();
            vp[(j * C + c) * 2] = _mm512_unpacklo_epi16(a, z);
            vp[(j * C + c) * 2 + 1] = _mm512_unpackhi_epi16(a, z);
          }
        for (int r0 = 0; r0 < rows; r0 += kRows) {
          // Scores of kRows rows: one accumulator each, the row's pair p broadcast against word p.
          __m512 s[kRows];
          for (int i = 0; i < kRows; ++i) s[i] = _mm512_setzero_ps();
          const uint32_t* qr = q_words + static_cast<size_t>(r0) * W;
          for (int p = 0; p < W; ++p)
            for (int i = 0; i < kRows; ++i)
              s[i] = dot_pairs(s[i], _mm512_set1_epi32(static_cast<int>(qr[i * W + p])), kt[p]);
          for (int i = 0; i < kRows; ++i) _mm512_store_ps(scores[i], s[i]);
          for (int i = 0; i < kRows && r0 + i < rows; ++i) {
            const int r = r0 + i;
            const int see = std::min(n, ctx + r / group + 1 - first_key);  // causal
            vis[r] = see;
            if (see <= 0) continue;
            const __mmask16 keep = see >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << see) - 1);
            const __m512 sv = _mm512_mask_blend_ps(keep, neg_inf, _mm512_load_ps(scores[i]));
            const float new_m = std::max(ms[r], _mm512_reduce_max_ps(sv));
            const float correction = std::exp(ms[r] - new_m);
            const __m512 p = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(new_m))));
            ls[r] = ls[r] * correction + _mm512_reduce_add_ps(p);
            ms[r] = new_m;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pws + static_cast<size_t>(r) * 8),
                                reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
            if (correction != 1.f) {
              float* ar = accs + static_cast<size_t>(r) * D;
              const __m512 cv = _mm512_set1_ps(correction);
              for (int k = 0; k < D; k += 16) _mm512_storeu_ps(ar + k, _mm512_mul_ps(_mm512_loadu_ps(ar + k), cv));
            }
          }
        }
        for (int r = 0; r < rows; ++r) {  // acc[r] += p[r] . V, two bf16 weights a dot product
          if (vis[r] <= 0) continue;
          // only the pairs the row sees: later keys of the tile have zero weights, but a value
          // there that is not finite must not reach it (the row's odd last key pairs with one)
          const int npairs = (vis[r] + 1) / 2;
          float* ar = accs + static_cast<size_t>(r) * D;
          const uint32_t* wr = pws + static_cast<size_t>(r) * 8;
          __m512 o[2 * C];
          for (int k = 0; k < 2 * C; ++k) o[k] = _mm512_loadu_ps(ar + 16 * k);
          for (int j = 0; j < npairs; ++j) {
            const __m512i w = _mm512_set1_epi32(static_cast<int>(wr[j]));
            for (int k = 0; k < 2 * C; ++k) o[k] = dot_pairs(o[k], w, vp[j * 2 * C + k]);
          }
          for (int k = 0; k < 2 * C; ++k) _mm512_storeu_ps(ar + 16 * k, o[k]);
        }
      }
    }
    for (int r = 0; r < rows; ++r)
      bf16_dot_output<D>(accs + static_cast<size_t>(r) * D,
                         out + (r / group) * out_tok_stride + (h * group + r % group) * out_head_stride,
                         1.f / ls[r]);
  }
}

#endif

}  // namespace attention_kernels
