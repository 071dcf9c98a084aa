// Bidirectional attention over packed sequences in bf16 dot products: the length predictor's BERT
// encoder (predictors/cls_encoder.py), whose 32-wide heads torch's fp32 SDPA ran at 95-116 GFLOP/s
// on a Zen 4 EPYC (this kernel: 250-280), over batches padded to their longest prompt (the padding
// written, masked and gathered back cost another ~6% of the encoder). Here each sequence's queries,
// keys and values are the linears' own [tokens, heads x D] rows, no padding anywhere: q_starts /
// k_starts (int64, [B + 1]) say where sequence b's rows are; its queries attend to all of its keys
// (none of another's). The last layer's [CLS]-only queries are one row a sequence (q_starts 0, 1, .., B).
//
// An item is (sequence, head, up to 64 query rows). Its keys are rounded to bf16 and transposed 16
// at a time once (lane t of word p: key t's dims 2p, 2p + 1; attention_bf16_prefill.h's layout) and
// its values interleaved in token pairs once, both shared by the item's rows. Eight query rows at a
// time: all their scores (one fp32 accumulator of D / 2 dot products per 16 keys), an exact softmax
// over the whole row (no online rescaling: the row is at most a few hundred keys), the weights
// rounded to bf16 and multiplied into the values, fp32 sums. The query (times the scale and log2 e:
// the scores are in log2 units, the softmax base 2) and the weights are rounded to bf16 as a bf16
// model's attention in transformers or vLLM rounds them. The last layer's one query a sequence
// still takes a block of eight rows' work (a few percent of the encoder's attention).
//
// Built only for CPUs with AVX512-BF16 and no AMX (attention_bf16_dot.h's condition, where
// vdpbf16ps runs at full rate); elsewhere encoder_attention_isa() says "none" and the encoder keeps
// torch's SDPA.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "attention_bf16_prefill.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdint>
#include <string>
#include <vector>

namespace {

#ifdef BATCHINFER_BF16_ATTENTION
using attention_kernels::bf16_dot_output;
using attention_kernels::bf16x32;
using attention_kernels::dot_pairs;
using attention_kernels::transpose16x16;

constexpr int kRows = 8;      // query rows whose scores are computed together
constexpr int kItemRows = 64;  // query rows an item takes

// 2^x for 16 floats x <= 0 (scores less their row's maximum, in log2 units): 2^n by scalef (0 below
// the fp32 range), 2^r for r in [-1/2, 1/2] by its degree-5 Taylor polynomial (relative error
// below 3e-6, far under the bf16 rounding of the weights it makes). Inputs below -125 are taken
// as -125 (a weight of 2^-125 against the row's largest, 1), so no result is subnormal, which can
// be slow on some CPUs (Zen 4 measured no slower).
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// What a thread keeps between items (grown, never shrunk).
struct Scratch {
  std::vector<uint32_t> keys;     // [slices][W][16]: a slice's word p of its 16 keys
  std::vector<uint32_t> values;   // [pairs][2C][16]: two tokens' values interleaved
  std::vector<float> scores;      // [kRows][slices x 16]
  std::vector<uint32_t> weights;  // [kRows][slices x 8]: the softmax weights in bf16 pairs
};

// One item: nq query rows (q, row stride ldq, this head's D columns) against the sequence's nk keys
// and values (k, v: row stride ldk, this head's columns); out rows at stride ldo.
template <int D>
void attend(const float* q, int64_t ldq, const float* k, const float* v, int64_t ldk, float* out,
            int64_t ldo, int nq, int nk, float scale, Scratch& s) {
  constexpr int W = D / 2;      // 32-bit words (bf16 pairs) of a row
  constexpr int C = D / 32;     // zmm of a bf16 row
  constexpr int R = 8 / C;      // rows whose outputs accumulate together (16 accumulators)
  const int slices = (nk + 15) / 16;
  const int pairs = (nk + 1) / 2;
  const int width = slices * 16;
  s.keys.resize(static_cast<size_t>(slices) * W * 16);
  s.values.resize(static_cast<size_t>(slices) * 8 * 2 * C * 16);
  s.scores.resize(static_cast<size_t>(kRows) * width);
  s.weights.resize(static_cast<size_t>(kRows) * width / 2);
  uint32_t* const kt = s.keys.data();
  uint32_t* const vp = s.values.data();
  float* const sc = s.scores.data();
  uint32_t* const pw = s.weights.data();
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512i zero = _mm512_setzero_si512();

  for (int sl = 0; sl < slices; ++sl)
    for (int c = 0; c < C; ++c) {
      __m512i part[16];
      for (int t = 0; t < 16; ++t) {
        const int key = 16 * sl + t;
        part[t] = key < nk ? bf16x32(k + key * ldk + 32 * c, one) : zero;
      }
      transpose16x16(part);
      for (int p = 0; p < 16; ++p)
        _mm512_storeu_si512(kt + (static_cast<size_t>(sl) * W + 16 * c + p) * 16, part[p]);
    }
  for (int j = 0; j < slices * 8; ++j)  // past nk: zeros, whose weights are zero too
    for (int c = 0; c < C; ++c) {
      const __m512i a = 2 * j < nk ? bf16x32(v + (2 * j) * ldk + 32 * c, one) : zero;
      const __m512i b = 2 * j + 1 < nk ? bf16x32(v + (2 * j + 1) * ldk + 32 * c, one) : zero;
      _mm512_storeu_si512(vp + ((static_cast<size_t>(j) * C + c) * 2) * 16, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(vp + ((static_cast<size_t>(j) * C + c) * 2 + 1) * 16, _mm512_unpackhi_epi16(a, b));
    }

  const int tail = nk - 16 * (slices - 1);  // keys in the last slice
  const __mmask16 tail_keys = tail >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << tail) - 1);
  const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f);  // scores in log2 units
  const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
  alignas(64) uint32_t qw[kRows * W];
  alignas(64) float row_sum[kRows];
  for (int r0 = 0; r0 < nq; r0 += kRows) {
    const int rows = std::min(kRows, nq - r0);
    for (int i = 0; i < kRows; ++i)
      for (int c = 0; c < C; ++c)
        _mm512_store_si512(qw + i * W + 16 * c,
                           i < rows ? bf16x32(q + (r0 + i) * ldq + 32 * c, vscale) : zero);
    __m512 most[kRows];  // each row's running maximum, lane by lane
    for (int i = 0; i < kRows; ++i) most[i] = lowest;
    for (int sl = 0; sl < slices; ++sl) {
      __m512 acc[kRows];
      for (int i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
      const uint32_t* ks = kt + static_cast<size_t>(sl) * W * 16;
      for (int p = 0; p < W; ++p) {
        const __m512i kw = _mm512_loadu_si512(ks + p * 16);
        for (int i = 0; i < kRows; ++i)
          acc[i] = dot_pairs(acc[i], _mm512_set1_epi32(static_cast<int>(qw[i * W + p])), kw);
      }
      const __mmask16 keys = sl + 1 < slices ? __mmask16(0xFFFF) : tail_keys;
      for (int i = 0; i < kRows; ++i) {
        most[i] = _mm512_mask_max_ps(most[i], keys, most[i], acc[i]);
        _mm512_storeu_ps(sc + i * width + 16 * sl, acc[i]);
      }
    }
    for (int i = 0; i < rows; ++i) {  // the softmax over the row; keys past nk weigh zero
      const float* row = sc + i * width;
      const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(most[i]));
      __m512 sum = _mm512_setzero_ps();
      for (int sl = 0; sl < slices; ++sl) {
        __m512 e = exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + 16 * sl), top));
        if (sl + 1 == slices) e = _mm512_maskz_mov_ps(tail_keys, e);
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + i * (width / 2) + 8 * sl),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
      }
      row_sum[i] = _mm512_reduce_add_ps(sum);
    }
    for (int g = 0; g < rows; g += R) {  // R rows' outputs, two weights a dot product
      __m512 o[R][2 * C];
      for (int i = 0; i < R; ++i)
        for (int m = 0; m < 2 * C; ++m) o[i][m] = _mm512_setzero_ps();
      const int here = std::min(R, rows - g);
      for (int j = 0; j < pairs; ++j) {
        const uint32_t* vj = vp + static_cast<size_t>(j) * 2 * C * 16;
        for (int i = 0; i < R; ++i) {  // rows past `here`: stale weights, never written out
          const __m512i w = _mm512_set1_epi32(static_cast<int>(pw[(g + i) * (width / 2) + j]));
          for (int m = 0; m < 2 * C; ++m) o[i][m] = dot_pairs(o[i][m], w, _mm512_loadu_si512(vj + m * 16));
        }
      }
      for (int i = 0; i < here; ++i) {
        alignas(64) float acc[D];
        for (int m = 0; m < 2 * C; ++m) _mm512_store_ps(acc + 16 * m, o[i][m]);
        bf16_dot_output<D>(acc, out + (r0 + g + i) * ldo, 1.f / row_sum[g + i]);
      }
    }
  }
}
#endif

// q [Tq, H x D], k and v [Tk, H x D] fp32 (unit stride within a row) -> [Tq, H x D].
at::Tensor encoder_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& q_starts, const at::Tensor& k_starts, int64_t heads,
                             double scale) {
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && v.dim() == 2, "encoder_attention: q, k, v must be 2-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "encoder_attention: q, k, v must be float32");
  TORCH_CHECK(q.stride(1) == 1 && k.stride(1) == 1 && v.stride(1) == 1,
              "encoder_attention: rows must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && k.stride(0) == v.stride(0) && q.size(1) == k.size(1),
              "encoder_attention: k and v must match, and q's width theirs");
  TORCH_CHECK(heads > 0 && q.size(1) % heads == 0, "encoder_attention: width not a multiple of heads");
  const int64_t D = q.size(1) / heads;
  TORCH_CHECK(D == 32 || D == 64, "encoder_attention: head size 32 or 64, got ", D);
  TORCH_CHECK(q_starts.scalar_type() == at::kLong && k_starts.scalar_type() == at::kLong &&
                  q_starts.dim() == 1 && q_starts.sizes() == k_starts.sizes() && q_starts.numel() >= 1,
              "encoder_attention: q_starts and k_starts must be int64 [B + 1]");
  const auto qs = q_starts.contiguous(), ks = k_starts.contiguous();
  const int64_t* qsp = qs.data_ptr<int64_t>();
  const int64_t* ksp = ks.data_ptr<int64_t>();
  const int64_t B = qs.numel() - 1;
  TORCH_CHECK(qsp[0] == 0 && ksp[0] == 0 && qsp[B] == q.size(0) && ksp[B] == k.size(0),
              "encoder_attention: starts must run from 0 to the row counts");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(qsp[b + 1] >= qsp[b] && ksp[b + 1] >= ksp[b] &&
                    (qsp[b + 1] == qsp[b] || ksp[b + 1] > ksp[b]) && ksp[b + 1] - ksp[b] <= (1 << 24),
                "encoder_attention: sequence ", b, " has decreasing starts, queries without keys or "
                "over 2^24 keys");
  auto out = at::empty({q.size(0), q.size(1)}, q.options());
#ifndef BATCHINFER_BF16_ATTENTION
  TORCH_CHECK(false, "encoder_attention needs AVX512-BF16 without AMX (this build: none)");
#else
  struct Item {
    int64_t seq, head, first, rows;
  };
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = 0; r < qsp[b + 1] - qsp[b]; r += kItemRows)
        items.push_back({b, h, r, std::min<int64_t>(kItemRows, qsp[b + 1] - qsp[b] - r)});
  auto cost = [&](const Item& it) { return it.rows * (ksp[it.seq + 1] - ksp[it.seq] + 16); };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vpp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldq = q.stride(0), ldk = k.stride(0), ldo = out.stride(0);
  const float fscale = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local Scratch scratch;
    for (int64_t taken = next++; taken < static_cast<int64_t>(items.size()); taken = next++) {
      const Item& it = items[taken];
      const int64_t row = qsp[it.seq] + it.first, key = ksp[it.seq];
      const int nk = static_cast<int>(ksp[it.seq + 1] - key);
      const int64_t col = it.head * D;
      if (D == 32)
        attend<32>(qp + row * ldq + col, ldq, kp + key * ldk + col, vpp + key * ldk + col, ldk,
                   op + row * ldo + col, ldo, static_cast<int>(it.rows), nk, fscale, scratch);
      else
        attend<64>(qp + row * ldq + col, ldq, kp + key * ldk + col, vpp + key * ldk + col, ldk,
                   op + row * ldo + col, ldo, static_cast<int>(it.rows), nk, fscale, scratch);
    }
  });
#endif
  return out;
}

// "avx512_bf16" where this build has the kernel, else "none".
std::string encoder_attention_isa() {
#ifdef BATCHINFER_BF16_ATTENTION
  return "avx512_bf16";
#else
  return "none";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer, m) {
  m.def("encoder_attention_isa() -> str", &encoder_attention_isa);
  m.def("encoder_attention(Tensor q, Tensor k, Tensor v, Tensor q_starts, Tensor k_starts, int heads, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchinfer, CPU, m) {
  m.impl("encoder_attention", &encoder_attention);
}
