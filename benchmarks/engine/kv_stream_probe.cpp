// benchmarks/engine/decode_floor.py's probe: how fast can this host's cores stream a decode step's K/V
// out of the paged cache, as the engine lays it out ([blocks, kv_heads, block_size, head_dim]
// per layer), while doing a given number of FMAs per vector loaded?
//
// fmas = 0 is a plain read. fmas = group is the least arithmetic exact attention does: every
// K vector meets each of the group's query heads once (q . k) and every V vector is scaled into
// each query head's output once (p * v), so any exact decode attention does at least that, plus
// softmax, reductions and stores that this probe leaves out. The split over threads and the
// visiting order are the decode kernel's (engine/kernels/attention_kernels.h): contiguous runs of
// sequences per thread, each thread's blocks in physical order, all K first, then all V.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kWidth = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
using Vec = __m256;
constexpr int kWidth = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vsum(Vec v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
}
#endif

constexpr int kMaxFmas = 8;

// One thread's share of one cache (K or V of one layer): F FMAs per vector, two accumulator sets
// so no FMA waits on the one before it.
template <int F>
float stream(const float* cache, const std::vector<std::pair<int, int>>& visits, int64_t block_stride,
             int64_t head_stride, int num_kv, int block_size, int head_dim, int tokens) {
  Vec acc[2][kMaxFmas];
  Vec plain[2] = {vzero(), vzero()};
  Vec q[kMaxFmas];
  for (int f = 0; f < kMaxFmas; ++f) {
    q[f] = vset(1e-3f * (f + 1));
    acc[0][f] = acc[1][f] = vzero();
  }
  for (const auto& [block, index] : visits) {
    const int n = std::min(block_size, tokens - index * block_size);
    const float* base = cache + static_cast<int64_t>(block) * block_stride;
    for (int h = 0; h < num_kv; ++h) {
      const float* rows = base + h * head_stride;
      const int64_t count = static_cast<int64_t>(n) * head_dim;
      for (int64_t j = 0; j < count; j += 2 * kWidth) {
        const Vec x0 = vload(rows + j), x1 = vload(rows + j + kWidth);
        if constexpr (F == 0) {
          plain[0] = vadd(plain[0], x0);
          plain[1] = vadd(plain[1], x1);
        } else {
          for (int f = 0; f < F; ++f) {
            acc[0][f] = vfma(x0, q[f], acc[0][f]);
            acc[1][f] = vfma(x1, q[f], acc[1][f]);
          }
        }
      }
    }
  }
  float sink = vsum(vadd(plain[0], plain[1]));
  for (int f = 0; f < F; ++f) sink += vsum(vadd(acc[0][f], acc[1][f]));
  return sink;
}

}  // namespace

// caches: per layer (K, V), each [blocks, kv_heads, block_size, head_dim] fp32 contiguous;
// tables: [seqs, blocks_per_seq] int32; every sequence attends `tokens` positions.
// -> a sum of what was read (so nothing is optimized away).
double kv_stream_probe(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                       const at::Tensor& tables, int64_t tokens, int64_t fmas) {
  TORCH_CHECK(fmas >= 0 && fmas <= kMaxFmas, "fmas must be 0..", kMaxFmas);
  TORCH_CHECK(keys.size() == values.size() && !keys.empty(), "one K and one V per layer");
  const auto t = tables.contiguous();
  const int seqs = t.size(0), per_seq = t.size(1);
  const int num_kv = keys[0].size(1), block_size = keys[0].size(2), head_dim = keys[0].size(3);
  TORCH_CHECK(head_dim % (2 * kWidth) == 0, "head_dim must be a multiple of ", 2 * kWidth);
  TORCH_CHECK(tokens >= 1 && tokens <= static_cast<int64_t>(per_seq) * block_size, "tokens out of the tables' range");
  const int64_t head_stride = static_cast<int64_t>(block_size) * head_dim;
  const int64_t block_stride = num_kv * head_stride;
  const int used_blocks = static_cast<int>((tokens + block_size - 1) / block_size);
  const int parts = std::max(1, std::min(at::get_num_threads(), seqs));
  std::vector<float> sinks(parts, 0.f);
  const int* tp = t.data_ptr<int>();
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int first = static_cast<int>(seqs * p / parts), last = static_cast<int>(seqs * (p + 1) / parts);
      std::vector<std::pair<int, int>> visits;
      for (int s = first; s < last; ++s)
        for (int b = 0; b < used_blocks; ++b) visits.push_back({tp[static_cast<int64_t>(s) * per_seq + b], b});
      std::sort(visits.begin(), visits.end());
      float sink = 0.f;
      for (size_t l = 0; l < keys.size(); ++l) {
        for (const at::Tensor* cache : {&keys[l], &values[l]}) {
          const float* c = cache->data_ptr<float>();
          switch (fmas) {
#define PROBE_CASE(F) \
  case F: sink += stream<F>(c, visits, block_stride, head_stride, num_kv, block_size, head_dim, tokens); break;
            PROBE_CASE(0) PROBE_CASE(1) PROBE_CASE(2) PROBE_CASE(3) PROBE_CASE(4)
            PROBE_CASE(5) PROBE_CASE(6) PROBE_CASE(7) PROBE_CASE(8)
#undef PROBE_CASE
          }
        }
      }
      sinks[p] = sink;
    }
  });
  double total = 0;
  for (float s : sinks) total += s;
  return total;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kv_stream_probe", &kv_stream_probe, "stream a decode step's K/V with F FMAs per vector");
}
