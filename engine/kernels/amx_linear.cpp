// bf16 linears on CPUs with AMX (Intel Sapphire Rapids and later): y = x @ w^T with x and y in
// fp32, the weights in bf16, the input rounded to bf16 (round to nearest even) once per call and
// the products summed in fp32 by the tile unit's TDPBF16PS: one instruction multiplies a 16 x 32
// bf16 tile of the input by a 32 x 16 tile of weights into a 16 x 16 fp32 tile, 16 k pairs deep.
// On the project's AMX Xeon that unit ran ~870 GFLOP/s a core against ~160 for fp32 FMAs, and
// AVX512-BF16's vdpbf16ps ran at half the fp32 FMA rate (which is why kernels/bf16_linear.cpp is
// not taken there).
//
// Layout: the weights are kernels/bf16_linear.cpp's panels of 16 output columns, [K2][16][2] bf16
// each, with K padded to a multiple of 32 (zeros): 16 k pairs of one panel are one B tile, 16
// rows of 64 bytes, contiguous. The input's bf16 copy is tile-contiguous, [Mp/16][Kp/32][16][32]
// (rows padded to 16, columns to 32, zeros), rounded in the same parallel region as the GEMM.
// A task is (row block, panel pair): for each 32 (or 16) rows it keeps four (two) C tiles, rows
// x two panels, over the k steps in order, stores them to a small buffer and writes
// the rows that exist, adding the bias or (gate/up) taking silu(gate) * up (kernels/simd.h's
// code, as the other kernels). Each output is one TDPBF16PS chain over the k pairs in order, so a
// row's result does not depend on the batch it is in, on the tiles or on the threads.
//
// The tile state is per thread: each OpenMP thread loads the tile configuration before its first
// task and releases the tiles after its last. Linux hands AMX's tile data to a process only after
// arch_prctl(ARCH_REQ_XCOMP_PERM); amx_bf16_isa() asks once and says "none" if refused, and the
// engine then takes oneDNN.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "simd.h"

#if defined(BATCHINFER_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define BATCHINFER_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

// A namespace of its own inside the anonymous one: the model library compiles its sources as
// one translation unit (kernels/__init__.py).
namespace {
namespace amx_bf16 {

constexpr int64_t P = 16;          // output columns per panel: one tile's 16 fp32 columns
constexpr int64_t KSTEP = 32;      // k per tile step: 16 pairs
constexpr int64_t ROW_BLOCK = 128; // rows per task: the input block a thread keeps in L2

int64_t padded(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

void check_operands(const at::Tensor& x, const at::Tensor& w_pairs, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": x must be fp32 [M, K]");
  TORCH_CHECK(w_pairs.dim() == 4 && w_pairs.size(2) == P && w_pairs.size(3) == 2 &&
                  w_pairs.scalar_type() == at::kBFloat16,
              op, ": w_pairs must be bf16 [panels, Kp / 2, 16, 2] (Kp: K padded to 32)");
  TORCH_CHECK(2 * w_pairs.size(1) == padded(x.size(1), KSTEP), op,
              ": w_pairs was packed for another K (its k must be padded to a multiple of 32)");
}

#ifdef BATCHINFER_AMX
constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr int XFEATURE_XTILEDATA = 18;

bool tiles_permitted() {
  static const bool permitted =
      syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return permitted;
}

// Palette 1, eight tiles of 16 rows x 64 bytes: tmm0-3 the C tiles (fp32 16 x 16), tmm4-5 the
// input's (bf16 16 x 32), tmm6-7 the weights' (16 k pairs x 16 columns x 2).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) { bytes_per_row[t] = 64; rows[t] = 16; }
  }
};

// GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of the 64 (its asm operand is a
// pointer's worth), which lets the compiler drop the stores that build the rest; this operand is
// the whole configuration. Its _tile_loadd names no memory at all: tiles_read_memory() before a
// kernel's loads keeps every earlier store of this thread ahead of them.
inline void load_tile_config(const TileConfig& config) {
  __asm__ volatile("ldtilecfg %0" ::"m"(config));
}

inline void tiles_read_memory() { __asm__ volatile("" ::: "memory"); }

inline __mmask16 lanes_below(int64_t k, int64_t end) {
  return k + 16 <= end ? __mmask16(0xFFFF) : (k < end ? __mmask16((1u << (end - k)) - 1) : 0);
}

// The input's bf16 copy is laid out tile by tile: [Mp / 16][Kp / 32][16][32], so each A tile is
// one contiguous KiB and a 16-row block's tiles follow each other over k (a plain [Mp, Kp] copy
// read at a row stride of 2 Kp bytes measured ~2x slower on the K = 1536 projection).
inline uint16_t* a_tile(uint16_t* xq, int64_t Kp, int64_t m, int64_t k) {
  return xq + (m / 16) * 16 * Kp + k * 16;
}

// Row m of x [K] fp32 -> its rows of the tiles, round to nearest even, zero past K.
inline void round_row(const float* x, int64_t K, int64_t Kp, int64_t m, uint16_t* xq) {
  for (int64_t k = 0; k < Kp; k += KSTEP) {
    const __m512 lo = _mm512_maskz_loadu_ps(lanes_below(k, K), x + k);
    const __m512 hi = _mm512_maskz_loadu_ps(lanes_below(k + 16, K), x + k + 16);
    _mm512_storeu_si512(a_tile(xq, Kp, m, k) + (m % 16) * KSTEP,
                        reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
}

// The rows [m, m + rows) that exist (rows <= 32) out of the C tiles' buffer c ([32][2 P]):
// panels side by side (width 2 P, or P for a lone last panel) plus the bias, or silu(gate) * up.
template <bool SILU>
inline void write_rows(const float* c, int64_t rows, int64_t width, const float* bias,
                       float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = c + r * 2 * P;
    float* dst = y + r * ldy;
    if constexpr (SILU) {
      for (int64_t j = 0; j < P; j += 8)
        _mm256_storeu_ps(dst + j, simd::silu_mul(_mm256_loadu_ps(src + j), _mm256_loadu_ps(src + P + j)));
    } else {
      for (int64_t j = 0; j < width; j += P) {
        __m512 v = _mm512_loadu_ps(src + j);
        if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
        _mm512_storeu_ps(dst + j, v);
      }
    }
  }
}

// 32 input rows (two 16-row blocks of A tiles, the first at xq) x panels a and b: four C tiles
// over the k steps in order, stored to c [32][2 P].
inline void tile_32x2(const uint16_t* xq, int64_t Kp, const uint16_t* pa, const uint16_t* pb,
                      float* c) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t k = 0; k < Kp; k += KSTEP) {
    _tile_loadd(4, xq + k * 16, 64);
    _tile_loadd(5, xq + 16 * Kp + k * 16, 64);
    _tile_loadd(6, pa + k * P, 64);   // k pairs k/2 .. k/2 + 15 of the panel: 16 lines
    _tile_loadd(7, pb + k * P, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 2 * P * 4);
  _tile_stored(1, c + P, 2 * P * 4);
  _tile_stored(2, c + 16 * 2 * P, 2 * P * 4);
  _tile_stored(3, c + 16 * 2 * P + P, 2 * P * 4);
}

// 16 input rows x panels a and b: two C tiles.
inline void tile_16x2(const uint16_t* xq, int64_t Kp, const uint16_t* pa, const uint16_t* pb,
                      float* c) {
  _tile_zero(0); _tile_zero(1);
  for (int64_t k = 0; k < Kp; k += KSTEP) {
    _tile_loadd(4, xq + k * 16, 64);
    _tile_loadd(6, pa + k * P, 64);
    _tile_loadd(7, pb + k * P, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, c, 2 * P * 4);
  _tile_stored(1, c + P, 2 * P * 4);
}

// Rounds x [M, K] into xq's tiles (the padding zero), then runs the tasks, in one parallel
// region: row blocks x `pairs` panel pairs, pair t being panels (first(t), second(t)); second < 0:
// a lone last panel (its partner is computed over the same panel and not written).
template <bool SILU, typename First, typename Second>
void run(const float* x, int64_t K, uint16_t* xq, int64_t Kp, const uint16_t* wp,
         const float* bias, float* yp, int64_t M, int64_t pairs, int64_t ldy, First first,
         Second second, int64_t out_cols) {
  const int64_t panel = Kp * P;   // bf16 elements of one panel
  const int64_t row_blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
  const int64_t Mp = padded(M, 16);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < Mp; ++m) {
      if (m < M) {
        round_row(x + m * K, K, Kp, m, xq);
      } else {
        for (int64_t k = 0; k < Kp; k += KSTEP)
          std::memset(a_tile(xq, Kp, m, k) + (m % 16) * KSTEP, 0, KSTEP * sizeof(uint16_t));
      }
    }
    const TileConfig config;
    load_tile_config(config);
    tiles_read_memory();
    alignas(64) float c[32 * 2 * P];
#pragma omp for collapse(2) schedule(static)
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      for (int64_t t = 0; t < pairs; ++t) {
        const uint16_t* pa = wp + first(t) * panel;
        const bool lone = second(t) < 0;
        const uint16_t* pb = lone ? pa : wp + second(t) * panel;
        const int64_t width = lone ? P : 2 * P;
        const float* b = bias == nullptr ? nullptr : bias + t * out_cols;
        const int64_t end = std::min(M, (rb + 1) * ROW_BLOCK);
        for (int64_t m = rb * ROW_BLOCK; m < end; m += 32) {
          const int64_t rows = std::min<int64_t>(32, end - m);
          if (rows > 16) tile_32x2(a_tile(xq, Kp, m, 0), Kp, pa, pb, c);
          else tile_16x2(a_tile(xq, Kp, m, 0), Kp, pa, pb, c);
          write_rows<SILU>(c, rows, width, b, yp + m * ldy + t * out_cols, ldy);
        }
      }
    }
    _tile_release();
  }
}
#endif

void check_tiles() {
#ifndef BATCHINFER_AMX
  TORCH_CHECK(false, "amx_linear needs AMX-BF16 (this build has no amx_bf16)");
#else
  TORCH_CHECK(tiles_permitted(), "amx_linear: Linux refused AMX tile data to this process "
              "(arch_prctl ARCH_REQ_XCOMP_PERM)");
#endif
}

// y = x @ w^T (+ bias), [M, N], N = 16 x panels.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& w_pairs,
                      const std::optional<at::Tensor>& bias) {
  check_operands(x, w_pairs, "amx_linear");
  check_tiles();
  const int64_t panels = w_pairs.size(0), N = panels * P;
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == N),
              "amx_linear: bias must be fp32 [N]");
#ifdef BATCHINFER_AMX
  const auto xc = x.contiguous();
  const auto wc = w_pairs.contiguous();
  const auto bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t M = xc.size(0), Kp = 2 * wc.size(1);
  auto y = at::empty({M, N}, xc.options());
  if (M == 0) return y;
  auto xq = at::empty({padded(M, 16), Kp}, xc.options().dtype(at::kBFloat16));
  run<false>(xc.data_ptr<float>(), xc.size(1), reinterpret_cast<uint16_t*>(xq.data_ptr<at::BFloat16>()),
             Kp, reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()),
             bc.defined() ? bc.data_ptr<float>() : nullptr, y.data_ptr<float>(), M,
             (panels + 1) / 2, N, [](int64_t t) { return 2 * t; },
             [panels](int64_t t) { return 2 * t + 1 < panels ? 2 * t + 1 : int64_t(-1); }, 2 * P);
  return y;
#else
  return at::Tensor();
#endif
}

// silu(x @ gate^T) * (x @ up^T), [M, I], over w_pairs of 2 I / 16 panels (gate's, then up's).
at::Tensor amx_linear_silu_mul(const at::Tensor& x, const at::Tensor& w_pairs) {
  check_operands(x, w_pairs, "amx_linear_silu_mul");
  TORCH_CHECK(w_pairs.size(0) % 2 == 0,
              "amx_linear_silu_mul: an even number of panels (gate's, then up's)");
  check_tiles();
#ifdef BATCHINFER_AMX
  const auto xc = x.contiguous();
  const auto wc = w_pairs.contiguous();
  const int64_t M = xc.size(0), Kp = 2 * wc.size(1), pairs = wc.size(0) / 2, I = pairs * P;
  auto y = at::empty({M, I}, xc.options());
  if (M == 0) return y;
  auto xq = at::empty({padded(M, 16), Kp}, xc.options().dtype(at::kBFloat16));
  run<true>(xc.data_ptr<float>(), xc.size(1), reinterpret_cast<uint16_t*>(xq.data_ptr<at::BFloat16>()),
            Kp, reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()), nullptr,
            y.data_ptr<float>(), M, pairs, I, [](int64_t t) { return t; },
            [pairs](int64_t t) { return pairs + t; }, P);
  return y;
#else
  return at::Tensor();
#endif
}

// "amx_bf16" where this build has the kernels and Linux grants the tiles, else "none".
std::string amx_bf16_isa() {
#ifdef BATCHINFER_AMX
  return tiles_permitted() ? "amx_bf16" : "none";
#else
  return "none";
#endif
}

}  // namespace amx_bf16
}  // namespace

TORCH_LIBRARY_FRAGMENT(batchinfer, m) {
  m.def("amx_bf16_isa() -> str", &amx_bf16::amx_bf16_isa);
  m.def("amx_linear(Tensor x, Tensor w_pairs, Tensor? bias) -> Tensor");
  m.def("amx_linear_silu_mul(Tensor x, Tensor w_pairs) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchinfer, CPU, m) {
  m.impl("amx_linear", &amx_bf16::amx_linear);
  m.impl("amx_linear_silu_mul", &amx_bf16::amx_linear_silu_mul);
}
