// All-reduce (sum) of a float32 tensor over the ranks of a tensor-parallel group on one host,
// through a buffer the ranks share (allocated by the controller, engine/runtime/shm_allreduce.py).
//
// Why not gloo: on a CPU host gloo's all-reduce goes through loopback TCP and costs 0.6-2 ms per
// call for the [rows, hidden] tensors of a decode step (benchmarks/engine/allreduce_cost.py), and a TP
// layer calls it twice. Through shared memory it is a copy, a flag and a sum.
//
// Buffer layout (float32 elements): a header of `world` counters (int64, one per 64-byte line),
// then two sets of `world` slots of `slot` floats. Call number g (per group, counted by every rank
// alike) uses set g % 2: each rank copies its chunk into its slot, publishes g in its counter,
// waits until every counter reaches g, and sums the slots in rank order, so every rank gets the
// same bits. Two sets make one counter per rank enough: a rank writing set g % 2 at call g has
// seen every peer publish g - 1, which a peer does only after it finished reading call g - 2.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <chrono>
#include <cstring>
#include <sched.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kCounterStride = 16;  // floats: one counter per 64-byte cache line

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

void wait_for_peers(int64_t* counters, int64_t world, int64_t rank, int64_t generation,
                    double timeout_s) {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < world; ++r) {
    if (r == rank) continue;
    int64_t* counter = counters + r * (kCounterStride / 2);
    for (int64_t spins = 0; __atomic_load_n(counter, __ATOMIC_ACQUIRE) < generation; ++spins) {
      if (spins < 4096) {
        cpu_relax();
        continue;
      }
      sched_yield();  // a rank shares its core with the worker's other threads
      if ((spins & 1023) == 0) {
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        TORCH_CHECK(waited < timeout_s, "shm_all_reduce: tensor-parallel rank ", r, " did not reach call ",
                    generation, " within ", timeout_s, " s");
      }
    }
  }
}

int64_t shm_all_reduce_(at::Tensor& t, const at::Tensor& buffer, int64_t rank, int64_t world,
                        int64_t generation, double timeout_s) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "shm_all_reduce: contiguous float32 only");
  TORCH_CHECK(buffer.scalar_type() == at::kFloat && buffer.is_contiguous(), "shm_all_reduce: float32 buffer");
  TORCH_CHECK(0 <= rank && rank < world, "shm_all_reduce: rank outside the group");
  const int64_t header = world * kCounterStride;
  const int64_t slot = (buffer.numel() - header) / (2 * world);
  TORCH_CHECK(slot >= 1024, "shm_all_reduce: buffer too small for ", world, " ranks");
  float* base = buffer.data_ptr<float>();
  auto* counters = reinterpret_cast<int64_t*>(base);
  float* slots = base + header;
  float* data = t.data_ptr<float>();
  const int64_t n = t.numel();
  for (int64_t off = 0; off < n; off += slot) {
    const int64_t len = std::min(slot, n - off);
    ++generation;
    float* set = slots + (generation & 1) * world * slot;
    std::memcpy(set + rank * slot, data + off, static_cast<size_t>(len) * sizeof(float));
    __atomic_store_n(counters + rank * (kCounterStride / 2), generation, __ATOMIC_RELEASE);
    wait_for_peers(counters, world, rank, generation, timeout_s);
    float* out = data + off;
    at::parallel_for(0, len, 16384, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        float acc = set[i];
        for (int64_t r = 1; r < world; ++r) acc += set[r * slot + i];
        out[i] = acc;
      }
    });
  }
  return generation;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer, m) {
  m.def("shm_all_reduce_(Tensor(a!) t, Tensor buffer, int rank, int world, int generation, "
        "float timeout_s) -> int");
}

TORCH_LIBRARY_IMPL(batchinfer, CPU, m) { m.impl("shm_all_reduce_", &shm_all_reduce_); }
