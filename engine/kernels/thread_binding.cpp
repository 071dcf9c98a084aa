// Pins torch's intra-op (OpenMP) threads one per CPU, as vLLM's CPU backend does
// (VLLM_CPU_OMP_THREADS_BIND); engine/cpu_binding.py decides which CPUs.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sched.h>

#include <atomic>

namespace {

// Thread i of the pool (i = at::get_thread_num()) goes to cpus[i]. Returns how many threads were
// pinned: fewer than cpus.size() when the runtime gave the region a smaller team. Must not be
// called inside a parallel region.
int64_t bind_threads(at::IntArrayRef cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  TORCH_CHECK(n == at::get_num_threads(), "bind_threads: one CPU per intra-op thread (",
              at::get_num_threads(), " threads, ", n, " CPUs given)");
  TORCH_CHECK(!at::in_parallel_region(), "bind_threads: called inside a parallel region");
  std::atomic<int64_t> pinned{0};
  std::atomic<int64_t> failed{0};
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    if (end - begin != 1 || begin != at::get_thread_num()) return;  // not one index per thread
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[begin]), &set);
    (sched_setaffinity(0, sizeof(set), &set) == 0 ? pinned : failed).fetch_add(1);
  });
  TORCH_CHECK(failed.load() == 0, "bind_threads: sched_setaffinity refused ", failed.load(),
              " of the CPUs ", cpus);
  return pinned.load();
}

}  // namespace

// No tensor argument to dispatch on: registered as a catch-all kernel.
TORCH_LIBRARY_FRAGMENT(batchinfer, m) { m.def("bind_threads(int[] cpus) -> int", &bind_threads); }
