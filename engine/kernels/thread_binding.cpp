// Pins torch's intra-op (OpenMP) threads one per CPU, as vLLM's CPU backend does
// (VLLM_CPU_OMP_THREADS_BIND); engine/cpu_binding.py decides which CPUs.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sched.h>

#include <atomic>
#include <vector>

namespace {

// Thread i of the pool (i = at::get_thread_num()) goes to cpus[i]; a negative entry leaves that
// thread as it is. Returns how many threads were pinned. Must not be called inside a parallel
// region: it needs a team of exactly one thread per entry.
int64_t bind_threads(at::IntArrayRef cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  TORCH_CHECK(n == at::get_num_threads(), "bind_threads: one CPU per intra-op thread (",
              at::get_num_threads(), " threads, ", n, " CPUs given)");
  TORCH_CHECK(!at::in_parallel_region(), "bind_threads: called inside a parallel region");
  std::vector<int64_t> wanted(cpus.begin(), cpus.end());
  std::atomic<int64_t> pinned{0};
  std::atomic<int64_t> failed{0};
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t cpu = wanted[at::get_thread_num()];
      if (cpu < 0) continue;
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpu), &set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0)
        pinned.fetch_add(1);
      else
        failed.fetch_add(1);
    }
  });
  TORCH_CHECK(failed.load() == 0, "bind_threads: sched_setaffinity refused ", failed.load(),
              " of the CPUs ", cpus);
  return pinned.load();
}

}  // namespace

// No tensor argument to dispatch on: registered as a catch-all kernel.
TORCH_LIBRARY_FRAGMENT(batchinfer, m) { m.def("bind_threads(int[] cpus) -> int", &bind_threads); }
