// Fused element-wise CPU kernels for the decoder layer (and the length predictor's encoder:
// add_layer_norm): each replaces a chain of 3-8 torch ops (each a full pass over memory plus
// dispatch overhead) by one pass. Float32, contiguous rows.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace {

constexpr int64_t kRowGrain = 16;  // rows per task: small tensors stay on one thread

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, ": float32 only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": expected [rows, cols] with contiguous rows");
}

inline void norm_row(const float* __restrict in, const float* __restrict w, float* __restrict out,
                     int64_t n, float eps) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < n; ++i) sq += in[i] * in[i];
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (in[i] * inv);
}

// out = weight * x / rms(x)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * xs, wp, op + r * n, n, static_cast<float>(eps));
  });
  return out;
}

// residual += x; x = weight * residual / rms(residual)   (both in place)
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "fused_add_rms_norm");
  check_rows(residual, "fused_add_rms_norm");
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* xr = xp + r * xs;
      float* rr = rp + r * rs;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) rr[i] += xr[i];
      norm_row(rr, wp, xr, n, static_cast<float>(eps));
    }
  });
}

// LayerNorm(x + residual) with its weight and bias, [rows, cols]: a post-norm encoder layer's two
// residual steps (the length predictor's BERT, predictors/cls_encoder.py) in one pass, where torch's
// add and layer_norm took two; mean and variance over the row's sums, as layer_norm's.
at::Tensor add_layer_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                          const at::Tensor& bias, double eps) {
  check_rows(x, "add_layer_norm");
  check_rows(residual, "add_layer_norm");
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  TORCH_CHECK(residual.size(0) == rows && residual.size(1) == n, "add_layer_norm: x and residual differ in shape");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat &&
                  weight.numel() == n && bias.numel() == n,
              "add_layer_norm: weight and bias must be float32 [cols]");
  const auto wc = weight.contiguous(), bc = bias.contiguous();
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  const float* bp = bc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps), count = static_cast<float>(n);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = xp + r * xs;
      const float* rr = rp + r * rs;
      float* o = op + r * n;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        o[i] = xr[i] + rr[i];
        sum += o[i];
      }
      const float mean = sum / count;
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < n; ++i) sq += (o[i] - mean) * (o[i] - mean);
      const float inv = 1.f / std::sqrt(sq / count + feps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = (o[i] - mean) * inv * wp[i] + bp[i];
    }
  });
  return out;
}

// [rows, 2I] (gate | up) -> [rows, I] silu(gate) * up
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = at::empty({rows, width}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* g = gp + r * gs;
      const float* u = g + width;
      float* o = op + r * width;
      int64_t i = 0;
#ifdef BATCHINFER_AVX2
      for (; i + 8 <= width; i += 8)
        _mm256_storeu_ps(o + i, simd::silu_mul(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#endif
      for (; i < width; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// Rotate-half RoPE in place on the first `num_heads` heads of each row of qkv [T, heads*D].
void rotary_embedding(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t num_heads, int64_t head_dim) {
  check_rows(qkv, "rotary_embedding");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "rotary tables must be contiguous");
  const auto pos = positions.to(at::kLong).contiguous();
  const int64_t rows = qkv.size(0), rs = qkv.stride(0), half = head_dim / 2;
  float* qp = qkv.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* c = cp + pp[r] * half;
      const float* s = sp + pp[r] * half;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* x1 = qp + r * rs + h * head_dim;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], bb = x2[i];
          x1[i] = a * c[i] - bb * s[i];
          x2[i] = bb * c[i] + a * s[i];
        }
      }
    }
  });
}

// A K or V row into the cache: copied for a float32 cache, rounded to nearest even for bf16 / fp16
// (as torch's casts round).
inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <typename T>
void write_rows(const at::Tensor& k, const at::Tensor& v, at::Tensor& key_cache, at::Tensor& value_cache,
                const int64_t* bp, const int64_t* op) {
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2);
  const int64_t bs = key_cache.size(2);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  T* kc = key_cache.data_ptr<T>();
  T* vc = value_cache.data_ptr<T>();
  const int64_t cbs = key_cache.stride(0), chs = key_cache.stride(1);
  at::parallel_for(0, tokens, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t base = bp[t] * cbs + op[t] * dim;
      TORCH_CHECK(op[t] < bs, "slot offset out of range");
      for (int64_t h = 0; h < heads; ++h) {
        store_row(kc + base + h * chs, kp + t * k.stride(0) + h * k.stride(1), dim);
        store_row(vc + base + h * chs, vp + t * v.stride(0) + h * v.stride(1), dim);
      }
    }
  });
}

// key_cache[block, :, offset, :] = k[t]  (same for v), for every new token t, in the cache's dtype.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& key_cache, at::Tensor& value_cache,
              const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k/v rows must be contiguous");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "write_kv: float32 k/v only");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(),
              "write_kv: key and value caches of different dtypes");
  const auto blocks = slot_blocks.contiguous();
  const auto offsets = slot_offsets.contiguous();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  switch (key_cache.scalar_type()) {
    case at::kFloat: write_rows<float>(k, v, key_cache, value_cache, bp, op); break;
    case at::kBFloat16: write_rows<at::BFloat16>(k, v, key_cache, value_cache, bp, op); break;
    case at::kHalf: write_rows<at::Half>(k, v, key_cache, value_cache, bp, op); break;
    default: TORCH_CHECK(false, "write_kv: the KV cache must be float32, bfloat16 or float16, got ",
                         key_cache.scalar_type());
  }
}

// Row-wise argmax of [rows, cols] float32 (greedy sampling): one vectorized pass per row, rows in
// parallel. Ties resolve to the lowest index, like torch.argmax. NaN is treated as smallest.
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "argmax_rows");
  const int64_t rows = x.size(0), cols = x.size(1), xs = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = xp + r * xs;
      float best = -std::numeric_limits<float>::infinity();
      int64_t i = 0;
#ifdef BATCHINFER_AVX2
      __m256 vbest = _mm256_set1_ps(best);
      for (; i + 8 <= cols; i += 8) vbest = _mm256_max_ps(vbest, _mm256_loadu_ps(row + i));
      best = simd::hmax(vbest);
#endif
      for (; i < cols; ++i) best = std::max(best, row[i]);
      int64_t arg = 0;
      for (int64_t j = 0; j < cols; ++j)
        if (row[j] == best) { arg = j; break; }
      op[r] = arg;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("add_layer_norm(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int num_heads, "
        "int head_dim) -> ()");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_blocks, Tensor slot_offsets) -> ()");
}

TORCH_LIBRARY_IMPL(batchinfer, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("add_layer_norm", &add_layer_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("write_kv", &write_kv);
}
