// Small AVX2 helpers shared by the CPU kernels (compiled only when the build targets AVX2+FMA).
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BATCHINFER_AVX2 1

namespace simd {

// e^x for 8 floats: x = n*ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial, 2^n through the
// exponent bits. Relative error ~1e-7 over the clamped range; inputs below -87 give ~0.
inline __m256 exp(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
  r = _mm256_fnmadd_ps(n, ln2_lo, r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// silu(g) * u for 8 floats: g / (1 + e^-g) * u. kernels/fused_ops.cpp's silu_and_mul and the
// fused gate/up GEMM (kernels/blocked_linear.cpp) share it, so their results are the same bits.
inline __m256 silu_mul(__m256 g, __m256 u) {
  const __m256 e = exp(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight horizontal sums at once: lane t of the result is the sum of the lanes of a[t].
inline __m256 hsum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23);
  const __m256 s4567 = _mm256_hadd_ps(s45, s67);
  // lanes: [0..3 low halves of 0123 | 4..7 low of 4567 | high halves]
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

#ifdef __AVX512F__
// e^x for 16 floats: exp's reduction and polynomial, 2^n by scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365478515625f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// BERT's exact GELU for 16 floats, x / 2 (1 + erf(x / sqrt 2)), with erf as torch's vectorized CPU
// erf computes it (Abramowitz and Stegun 7.1.26: 1 - t (a1 + .. + a5 t^4) e^-z^2, t = 1 / (1 + p z),
// z = |x| / sqrt 2; absolute error below 1.5e-7), so a fused GELU stays within rounding of F.gelu.
// t by rcp14 and one Newton step (~1e-8 relative) rather than a division, which bounded the
// epilogue it runs in.
inline __m512 gelu16(__m512 x) {
  const __m512 half_x = _mm512_mul_ps(x, _mm512_set1_ps(0.5f));
  const __m512 scaled = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));
  // |x| / sqrt 2 capped at 10, where erf is 1 in fp32 (+inf gives +inf; -inf gives NaN, as F.gelu
  // does: -inf x 0.5 x (1 + erf) is -inf x 0)
  const __m512 z = _mm512_min_ps(_mm512_abs_ps(scaled), _mm512_set1_ps(10.f));
  const __m512 d = _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), z, _mm512_set1_ps(1.f));
  __m512 t = _mm512_rcp14_ps(d);
  t = _mm512_mul_ps(t, _mm512_fnmadd_ps(d, t, _mm512_set1_ps(2.f)));
  __m512 r = _mm512_set1_ps(1.061405429f);
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(-1.453152027f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(1.421413741f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(-0.284496736f));
  r = _mm512_fmadd_ps(r, t, _mm512_set1_ps(0.254829592f));
  r = _mm512_mul_ps(r, t);
  const __m512 e = exp16(_mm512_mul_ps(z, _mm512_sub_ps(_mm512_setzero_ps(), z)));
  const __m512 erf_abs = _mm512_fnmadd_ps(r, e, _mm512_set1_ps(1.f));
  const __m512 erf = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(   // |erf| with x's sign
      _mm512_castps_si512(erf_abs), _mm512_castps_si512(scaled), _mm512_set1_epi32(0x7fffffff), 0xe4));
  return _mm512_fmadd_ps(half_x, erf, half_x);
}
#endif

}  // namespace simd
#endif
