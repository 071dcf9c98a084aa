// What the row (sampling.cpp) and column (sampling_columns.cpp) sampling kernels share, so that
// their top_p thresholds are the same code, hence the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace sampling {

constexpr int kBuckets = 64;  // binades of w for the top_p pre-selection

inline int binade(float w) {  // floor(-log2 w) for w in (0, 1], clamped to the last bucket
  int bits;
  std::memcpy(&bits, &w, sizeof bits);
  const int exponent = ((bits >> 23) & 0xff) - 127;
  return std::min(kBuckets - 1, std::max(0, -exponent));
}

// Threshold for top_p over the kept w (w >= floor_w) among w[0..n), in vocabulary order: the
// smallest kept value once the mass before it reaches p * total. Tokens below floor_w add nothing
// to any bucket, so a caller may pass only the kept ones (in the same order) and get the same bits.
inline float top_p_threshold(const float* w, int64_t n, float floor_w, double total, float p,
                             std::vector<float>& scratch) {
  double mass[kBuckets] = {0};
  for (int64_t j = 0; j < n; ++j)
    if (w[j] >= floor_w && w[j] > 0.f) mass[binade(w[j])] += w[j];
  const double goal = static_cast<double>(p) * total;
  double before = 0.0;
  int boundary = kBuckets - 1;
  for (int b = 0; b < kBuckets; ++b) {
    if (before + mass[b] >= goal) { boundary = b; break; }
    before += mass[b];
  }
  scratch.clear();
  for (int64_t j = 0; j < n; ++j)
    if (w[j] >= floor_w && w[j] > 0.f && binade(w[j]) == boundary) scratch.push_back(w[j]);
  std::sort(scratch.begin(), scratch.end(), std::greater<float>());
  float threshold = scratch.empty() ? floor_w : scratch.back();
  for (float value : scratch) {
    if (before >= goal) break;
    threshold = value;
    before += value;
  }
  return threshold;
}

}  // namespace sampling
