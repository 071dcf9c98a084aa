// Streaming a GEMM's next weight panel into cache while the current one computes: shared by the
// panel kernels (blocked_linear.cpp's fp32/bf16-widening tiles, bf16_linear.cpp's vdpbf16ps
// tiles). Without it a panel's first pass waits on DRAM and the passes after it compute from
// cache: memory time plus compute time instead of the larger.
#pragma once
#include <algorithm>
#include <cstdint>

namespace panels {

constexpr int64_t LINE = 64;  // bytes per cache line

// A tile's pass over k: body(k) for k = 0 .. K - 1, and issue(i) for i = 0 .. lines - 1 (the
// i-th line of the next panel to prefetch) spread evenly over the pass.
template <typename Issue, typename Body>
inline void over_k_prefetching(int64_t K, int64_t lines, Issue issue, Body body) {
  const int64_t every = lines > 0 ? (K + lines - 1) / lines : K + 1;
  int64_t issued = 0;
  for (int64_t k0 = 0; k0 < K; k0 += every) {
    if (issued < lines) issue(issued++);
    const int64_t k1 = std::min(K, k0 + every);
    for (int64_t k = k0; k < k1; ++k) body(k);
  }
  while (issued < lines) issue(issued++);
}

// How a row block spreads the prefetch of the next panel (its panel_lines) over its tiles: the panel's
// first row block streams the next panel in from memory while it computes. A block of one tile (<= tile_rows) has nothing to overlap with: the
// hardware prefetcher streams it as well alone.
struct PanelPrefetch {
  const char* next;  // null: no prefetch for this row block
  int64_t total, tiles;  // the panel's cache lines; the row block's tiles
  PanelPrefetch(const void* next_panel, int64_t total_lines, int64_t rows, bool enabled,
                int64_t tile_rows = 6)
      : next(nullptr), total(total_lines), tiles((rows + tile_rows - 1) / tile_rows) {
    if (enabled && next_panel != nullptr && tiles > 1) next = static_cast<const char*>(next_panel);
  }
  int64_t lines(int64_t t) const { return next ? (t + 1) * total / tiles - t * total / tiles : 0; }
  const char* from(int64_t t) const { return next ? next + LINE * (t * total / tiles) : nullptr; }
};

}  // namespace panels
