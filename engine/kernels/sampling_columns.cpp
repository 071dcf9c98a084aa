// Column-wise (transposed) versions of sampling.cpp's kernels, with bitwise the same results.
// logits_t is float32 [V, n]: row v is vocabulary token v, column b is sequence b (stride(1) == 1,
// any row stride >= n, e.g. a view of a wider buffer).
//
// apply_penalties_columns_: dense per-(token, sequence) state (seen / counts / present, [V, >= n]),
// 8 columns per AVX2 vector, vocabulary rows in parallel; per element apply_penalties_'s IEEE
// operations in its order: x / r or x * r, then x - (f * count + p * present).
//
// sample_columns: blocks of 8 columns, one AVX2 lane per column (each pass over V reads 32
// contiguous bytes per vocabulary row), blocks in parallel. A lane computes what sample_row does
// for its column: the same max / argmax comparisons; w by simd::exp for v < V - V % 8 (lane-wise:
// a value gives the same w in any lane) and std::exp for the tail; the k-th largest w (a value,
// whatever finds it); every double sum (totals, top_p binade masses, the draw) over the kept tokens
// in vocabulary order (sample_row's skipped tokens add nothing). logits_t is not written (the
// schema marks it (a!) so that callers treat it as scratch and a later version may reuse it).
//
// This needs the arithmetic as written in both files: kernels/__init__.py builds without
// -ffast-math (which reassociates sample_row's double sums into vector partial sums, turns x / r
// into x * (1 / r) and calls libmvec's expf) and with -ffp-contract=off (no FMA fusion).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "sampling_common.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace {

constexpr int kLanes = 8;
constexpr int64_t kAhead = 48;  // rows prefetched ahead in the column passes
constexpr float kInf = std::numeric_limits<float>::infinity();
#ifdef BATCHINFER_AVX2
constexpr bool kDense = true;  // columns without top_k / top_p: vector totals and draw scan
#else
constexpr bool kDense = false;  // the scalar build takes every column through its list
#endif

void check_columns(const at::Tensor& t, at::ScalarType type, int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK(t.scalar_type() == type && t.dim() == 2 && t.size(0) == rows && t.size(1) >= cols &&
              (t.size(1) <= 1 || t.stride(1) == 1) && (rows <= 1 || t.stride(0) >= cols),
              what, ": expected [V, >= n] with contiguous, non-overlapping rows of the right dtype");
}

at::Tensor per_column(const at::Tensor& t, at::ScalarType type, int64_t n, const char* what) {
  auto c = t.to(type).contiguous();
  TORCH_CHECK(c.numel() == n, what, ": one value per column");
  return c;
}

// ---- penalties --------------------------------------------------------------------------------
void apply_penalties_columns_(at::Tensor& logits_t, const at::Tensor& seen, const at::Tensor& counts,
                              const at::Tensor& present, const at::Tensor& repetition,
                              const at::Tensor& frequency, const at::Tensor& presence) {
  TORCH_CHECK(logits_t.dim() == 2, "apply_penalties_columns_: logits_t must be [V, n]");
  const int64_t V = logits_t.size(0), n = logits_t.size(1);
  check_columns(logits_t, at::kFloat, V, n, "apply_penalties_columns_: logits_t");
  check_columns(seen, at::kByte, V, n, "apply_penalties_columns_: seen");
  check_columns(counts, at::kFloat, V, n, "apply_penalties_columns_: counts");
  check_columns(present, at::kFloat, V, n, "apply_penalties_columns_: present");
  const auto rep = per_column(repetition, at::kFloat, n, "apply_penalties_columns_: repetition");
  const auto freq = per_column(frequency, at::kFloat, n, "apply_penalties_columns_: frequency");
  const auto pres = per_column(presence, at::kFloat, n, "apply_penalties_columns_: presence");
  if (V == 0 || n == 0) return;
  float* lp = logits_t.data_ptr<float>();
  const uint8_t* sp = seen.data_ptr<uint8_t>();
  const float *cp = counts.data_ptr<float>(), *qp = present.data_ptr<float>();
  const float *rp = rep.data_ptr<float>(), *fp = freq.data_ptr<float>(), *pp = pres.data_ptr<float>();
  const int64_t ls = logits_t.stride(0), ss = seen.stride(0), cs = counts.stride(0), qs = present.stride(0);
  at::parallel_for(0, V, std::max<int64_t>(64, 65536 / n), [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      float* x = lp + v * ls;
      const uint8_t* s = sp + v * ss;
      const float *c = cp + v * cs, *q = qp + v * qs;
      int64_t j = 0;
#ifdef BATCHINFER_AVX2
      const __m256 zero = _mm256_setzero_ps();
      for (; j + kLanes <= n; j += kLanes) {
        uint64_t bits;
        std::memcpy(&bits, s + j, sizeof bits);
        if (bits == 0) continue;  // most rows: no column has seen this token
        const __m256i s8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + j)));
        const __m256 touched = _mm256_castsi256_ps(_mm256_cmpgt_epi32(s8, _mm256_setzero_si256()));
        const __m256 xv = _mm256_loadu_ps(x + j), r = _mm256_loadu_ps(rp + j);
        __m256 y = _mm256_blendv_ps(_mm256_mul_ps(xv, r), _mm256_div_ps(xv, r),
                                    _mm256_cmp_ps(xv, zero, _CMP_GT_OQ));
        const __m256 fc = _mm256_mul_ps(_mm256_loadu_ps(fp + j), _mm256_loadu_ps(c + j));
        const __m256 pq = _mm256_mul_ps(_mm256_loadu_ps(pp + j), _mm256_loadu_ps(q + j));
        y = _mm256_sub_ps(y, _mm256_add_ps(fc, pq));
        _mm256_storeu_ps(x + j, _mm256_blendv_ps(xv, y, touched));
      }
#endif
      for (; j < n; ++j) {
        if (!s[j]) continue;
        float xx = x[j];
        xx = xx > 0.f ? xx / rp[j] : xx * rp[j];
        xx -= fp[j] * c[j] + pp[j] * q[j];
        x[j] = xx;
      }
    }
  });
}

// ---- sampling ---------------------------------------------------------------------------------
// One column of a block. Columns with top_k or top_p keep a list of (token, w), vocabulary order,
// holding every token with w >= thr: thr is the min_p floor, raised (top_k) to the k-th largest w
// of the list whenever the list is full. thr never exceeds the column's k-th largest w, so the
// list ends up holding every token that sample_row keeps, and its k-th largest w is the column's.
// Columns with neither (dense) get their total in the exp pass and draw in a vector scan.
struct Lane {
  float floor = kInf, thr = kInf;
  int64_t k = 0, arg = 0, limit = 0;
  std::vector<float> val;
  std::vector<int32_t> idx;
};

float kth_largest(const std::vector<float>& val, int64_t k, std::vector<float>& scratch) {
  scratch.assign(val.begin(), val.end());
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
  return scratch[k - 1];
}

// Appends a kept candidate; true when thr rose (the list was pruned).
bool keep(Lane& L, int64_t v, float w, std::vector<float>& scratch) {
  L.val.push_back(w);
  L.idx.push_back(static_cast<int32_t>(v));
  if (L.k == 0 || static_cast<int64_t>(L.val.size()) < L.limit) return false;
  L.thr = kth_largest(L.val, L.k, scratch);
  size_t kept = 0;
  for (size_t i = 0; i < L.val.size(); ++i)
    if (L.val[i] >= L.thr) { L.val[kept] = L.val[i]; L.idx[kept++] = L.idx[i]; }
  L.val.resize(kept), L.idx.resize(kept);
  if (static_cast<int64_t>(kept) * 2 > L.limit) L.limit *= 2;  // many ties with the k-th value
  return true;
}

// The end of sample_row over a column's list: top_k floor, total, top_p, draw, fallbacks.
int64_t draw_list(Lane& L, float top_p, double u, std::vector<float>& scratch) {
  float floor_w = L.floor;
  if (L.k > 0 && static_cast<int64_t>(L.val.size()) >= L.k)  // else the k-th w is below the floor
    floor_w = std::max(floor_w, kth_largest(L.val, L.k, scratch));
  double total = 0.0;
  for (float w : L.val) if (w >= floor_w) total += w;
  if (top_p < 1.f) {
    floor_w = std::max(floor_w, sampling::top_p_threshold(
        L.val.data(), static_cast<int64_t>(L.val.size()), floor_w, total, top_p, scratch));
    total = 0.0;
    for (float w : L.val) if (w >= floor_w) total += w;
  }
  const double target = u * total;
  double acc = 0.0;
  int64_t last_kept = -1;
  for (size_t i = 0; i < L.val.size(); ++i) {
    if (L.val[i] < floor_w) continue;
    acc += L.val[i];
    last_kept = L.idx[i];
    if (acc >= target) return L.idx[i];
  }
  return last_kept >= 0 ? last_kept : L.arg;
}

#ifdef BATCHINFER_AVX2
inline __m256 tail_exp(__m256 z) {  // sample_row's scalar tail: std::exp per value
  alignas(32) float a[kLanes];
  _mm256_store_ps(a, z);
  for (float& x : a) x = std::exp(x);
  return _mm256_load_ps(a);
}

inline __m256 lane_mask(int bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits), bit), bit));
}
#endif

// Columns [b0, b0 + nl), nl <= 8; `base` points at column b0 of vocabulary row 0. Read only.
void sample_block(const float* base, int64_t ls, int64_t V, int nl, const float* T, const int64_t* K,
                  const float* P, const float* MP, const double* U, int64_t* out, Lane* lanes,
                  std::vector<float>& scratch) {
  alignas(32) float best[kLanes], mx[kLanes], inv[kLanes];
  [[maybe_unused]] alignas(32) float floor_w[kLanes], thr[kLanes];  // the vector passes' copies
  alignas(32) int32_t arg[kLanes];
  // Pass 1: max and first argmax (sample_row's max is argmax_row's best value: both keep the first
  // of equal values and skip NaN).
#ifdef BATCHINFER_AVX2
  const __m256i valid = _mm256_castps_si256(lane_mask((1 << nl) - 1));
  // Loads row v's 8 columns and prefetches a later row (rows are a stride apart, often a page).
  auto load = [&](int64_t v) {
    _mm_prefetch(reinterpret_cast<const char*>(base + std::min(v + kAhead, V - 1) * ls), _MM_HINT_T0);
    return nl == kLanes ? _mm256_loadu_ps(base + v * ls) : _mm256_maskload_ps(base + v * ls, valid);
  };
  __m256 vbest = _mm256_set1_ps(-kInf), varg = _mm256_setzero_ps();
  for (int64_t v = 0; v < V; ++v) {
    const __m256 x = load(v);
    const __m256 gt = _mm256_cmp_ps(x, vbest, _CMP_GT_OQ);
    vbest = _mm256_blendv_ps(vbest, x, gt);
    varg = _mm256_blendv_ps(varg, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(v))), gt);
  }
  _mm256_store_ps(best, vbest);
  _mm256_store_si256(reinterpret_cast<__m256i*>(arg), _mm256_castps_si256(varg));
#else
  std::fill(best, best + kLanes, -kInf), std::fill(arg, arg + kLanes, 0);
  for (int64_t v = 0; v < V; ++v)
    for (int l = 0; l < nl; ++l)
      if (base[v * ls + l] > best[l]) { best[l] = base[v * ls + l]; arg[l] = static_cast<int32_t>(v); }
#endif
  int sample_mask = 0, list_mask = 0;
  for (int l = 0; l < kLanes; ++l) {
    Lane& L = lanes[l];
    L.val.clear(); L.idx.clear();
    L.floor = L.thr = kInf; L.k = 0; L.arg = arg[l];
    mx[l] = inv[l] = 0.f;
    if (l < nl && !(T[l] <= 0.f) && std::isfinite(best[l])) {
      sample_mask |= 1 << l;
      mx[l] = best[l];
      inv[l] = 1.f / T[l];
      L.floor = std::max(MP[l], std::numeric_limits<float>::min());
      if (K[l] > 0 && K[l] < V) { L.k = K[l]; L.limit = std::max<int64_t>(2 * L.k, 4096); }
      if (L.k > 0 || P[l] < 1.f || !kDense) { list_mask |= 1 << l; L.thr = L.floor; }
    } else if (l < nl) {
      out[l] = arg[l];
    }
    floor_w[l] = L.floor; thr[l] = L.thr;
  }
  // Pass 2: w; dense totals; list candidates.
#ifdef BATCHINFER_AVX2
  const int dense_mask = sample_mask & ~list_mask;
  const int64_t simd_end = V - V % kLanes;  // sample_row: simd::exp below, std::exp from here on
  alignas(32) double tot[kLanes];
  const __m256 vmx = _mm256_load_ps(mx), vinv = _mm256_load_ps(inv), vfloor = _mm256_load_ps(floor_w);
  __m256 vthr = _mm256_load_ps(thr);
  __m256d tot_lo = _mm256_setzero_pd(), tot_hi = _mm256_setzero_pd();
  for (int64_t v = 0; v < V; ++v) {
    const __m256 z = _mm256_mul_ps(_mm256_sub_ps(load(v), vmx), vinv);
    const __m256 w = v < simd_end ? simd::exp(z) : tail_exp(z);
    if (dense_mask) {  // total += w where w >= floor; adding +0.0 elsewhere changes nothing
      const __m256 wk = _mm256_and_ps(w, _mm256_cmp_ps(w, vfloor, _CMP_GE_OQ));
      tot_lo = _mm256_add_pd(tot_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(wk)));
      tot_hi = _mm256_add_pd(tot_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(wk, 1)));
    }
    int m = _mm256_movemask_ps(_mm256_cmp_ps(w, vthr, _CMP_GE_OQ)) & list_mask;
    if (!m) continue;
    alignas(32) float wa[kLanes];
    _mm256_store_ps(wa, w);
    bool raised = false;
    for (; m; m &= m - 1) raised |= keep(lanes[__builtin_ctz(m)], v, wa[__builtin_ctz(m)], scratch);
    if (raised) {
      for (int l = 0; l < kLanes; ++l) thr[l] = lanes[l].thr;
      vthr = _mm256_load_ps(thr);
    }
  }
  _mm256_store_pd(tot, tot_lo);
  _mm256_store_pd(tot + 4, tot_hi);
#else
  for (int64_t v = 0; v < V; ++v)
    for (int l = 0; l < nl; ++l) {
      const float w = std::exp((base[v * ls + l] - mx[l]) * inv[l]);
      if ((list_mask >> l & 1) && w >= lanes[l].thr) keep(lanes[l], v, w, scratch);
    }
#endif
  for (int l = 0; l < nl; ++l)
    if (list_mask >> l & 1) out[l] = draw_list(lanes[l], P[l], U[l], scratch);
#ifdef BATCHINFER_AVX2
  if (!dense_mask) return;  // (the lists' columns are drawn above)
  // Pass 3 (dense columns): the inverse-CDF scan, w recomputed (the same operations, the same w).
  alignas(32) double target[kLanes];
  for (int l = 0; l < kLanes; ++l) target[l] = U[l < nl ? l : 0] * tot[l];
  int done = ~dense_mask & 0xff;
  const __m256d tg_lo = _mm256_load_pd(target), tg_hi = _mm256_load_pd(target + 4);
  __m256d acc_lo = _mm256_setzero_pd(), acc_hi = _mm256_setzero_pd();
  __m256 last = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  const __m256 dense = lane_mask(dense_mask);
  for (int64_t v = 0; v < V && done != 0xff; ++v) {
    const __m256 z = _mm256_mul_ps(_mm256_sub_ps(load(v), vmx), vinv);
    const __m256 w = v < simd_end ? simd::exp(z) : tail_exp(z);
    const __m256 kept = _mm256_and_ps(_mm256_cmp_ps(w, vfloor, _CMP_NLT_UQ), dense);  // !(w < floor)
    const __m256 wk = _mm256_and_ps(w, kept);
    acc_lo = _mm256_add_pd(acc_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(wk)));
    acc_hi = _mm256_add_pd(acc_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(wk, 1)));
    last = _mm256_blendv_ps(last, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(v))), kept);
    const int reached = (_mm256_movemask_pd(_mm256_cmp_pd(acc_lo, tg_lo, _CMP_GE_OQ)) |
                         _mm256_movemask_pd(_mm256_cmp_pd(acc_hi, tg_hi, _CMP_GE_OQ)) << 4) &
                        _mm256_movemask_ps(kept);
    for (int m = reached & ~done; m; m &= m - 1) out[__builtin_ctz(m)] = v;
    done |= reached;
  }
  alignas(32) int32_t last_kept[kLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(last_kept), _mm256_castps_si256(last));
  for (int l = 0; l < nl; ++l)
    if (!(done >> l & 1)) out[l] = last_kept[l] >= 0 ? last_kept[l] : lanes[l].arg;
#endif
}

at::Tensor sample_columns(at::Tensor& logits_t, const at::Tensor& temperature, const at::Tensor& top_k,
                          const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniform) {
  TORCH_CHECK(logits_t.dim() == 2, "sample_columns: logits_t must be float32 [V, n]");
  const int64_t V = logits_t.size(0), n = logits_t.size(1);
  check_columns(logits_t, at::kFloat, V, n, "sample_columns: logits_t");
  TORCH_CHECK(V > 0 && V < std::numeric_limits<int32_t>::max(), "sample_columns: vocabulary size");
  const auto t = per_column(temperature, at::kFloat, n, "sample_columns: temperature");
  const auto k = per_column(top_k, at::kLong, n, "sample_columns: top_k");
  const auto p = per_column(top_p, at::kFloat, n, "sample_columns: top_p");
  const auto m = per_column(min_p, at::kFloat, n, "sample_columns: min_p");
  const auto u = per_column(uniform, at::kDouble, n, "sample_columns: uniform");
  auto out = at::empty({n}, logits_t.options().dtype(at::kLong));
  const float* lp = logits_t.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t ls = logits_t.stride(0), blocks = (n + kLanes - 1) / kLanes;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    Lane lanes[kLanes];
    std::vector<float> scratch;
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t b0 = blk * kLanes;
      sample_block(lp + b0, ls, V, static_cast<int>(std::min<int64_t>(kLanes, n - b0)), t.data_ptr<float>() + b0,
                   k.data_ptr<int64_t>() + b0, p.data_ptr<float>() + b0, m.data_ptr<float>() + b0,
                   u.data_ptr<double>() + b0, op + b0, lanes, scratch);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer, m) {
  m.def("sample_columns(Tensor(a!) logits_t, Tensor temperature, Tensor top_k, Tensor top_p, "
        "Tensor min_p, Tensor uniform) -> Tensor");
  m.def("apply_penalties_columns_(Tensor(a!) logits_t, Tensor seen, Tensor counts, Tensor present, "
        "Tensor repetition, Tensor frequency, Tensor presence) -> ()");
}

TORCH_LIBRARY_IMPL(batchinfer, CPU, m) {
  m.impl("sample_columns", &sample_columns);
  m.impl("apply_penalties_columns_", &apply_penalties_columns_);
}
