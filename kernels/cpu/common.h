// Shared helpers of the compiled CPU kernels of the Louver decode step (grid bound family):
// dtype loads, SIMD reductions and exps, the int8 / VNNI token-dot machinery, page terms and the
// int8 weight quantisation. Every op of the module only reads caller-owned inputs and writes
// caller-owned outputs.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// Machines without AVX-512 but with AVX2, FMA and F16C (AMD Zen 1-3, Intel Haswell to Alder
// Lake) get 8-lane versions of the step's hot loops; AVX-512 builds keep the 16-lane ones.
// The 8- and 16-lane twins stay separate functions rather than one lane-width template: they
// differ in more than the width (mask registers against movemask/blend, scalef against its
// two-factor emulation in exp_ps8, dpbusd against maddubs + widening in the scan), so a shared
// template would need a wrapper over every intrinsic; and a change to the 16-lane code can only
// be timed on an AVX-512 machine (the project's are AVX2 as often as not), which a paired A/B of
// both builds requires. Each twin is compiled at its level by tests/test_kernel_isa_builds.py.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOUVER_AVX2 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <type_traits>
#include <limits>
#include <vector>

namespace louver_cpu {

#if defined(__AVX512F__)
// 16 values of the KV dtype as fp32 lanes.
template <typename T>
inline __m512 load16_ps(const T* src) {
  alignas(64) float tmp[16];
  for (int i = 0; i < 16; ++i) tmp[i] = static_cast<float>(src[i]);
  return _mm512_load_ps(tmp);
}
inline __m512 load16_ps(const float* src) { return _mm512_loadu_ps(src); }
inline __m512 load16_ps(const c10::Half* src) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
inline __m512 load16_ps(const c10::BFloat16* src) {  // bf16 is the top half of fp32
  const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
}
#endif

#if defined(LOUVER_AVX2)
// 8 values of the KV dtype as fp32 lanes.
template <typename T>
inline __m256 load8_ps(const T* src) {
  alignas(32) float tmp[8];
  for (int i = 0; i < 8; ++i) tmp[i] = static_cast<float>(src[i]);
  return _mm256_load_ps(tmp);
}
inline __m256 load8_ps(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 load8_ps(const c10::Half* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
inline __m256 load8_ps(const c10::BFloat16* src) {  // bf16 is the top half of fp32
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

// Sum of the 8 lanes of v.
inline float hsum8_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// Convert n values of the KV dtype to fp32 (16 at a time with AVX-512, 8 with F16C).
template <typename T>
inline void load_f32(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void load_f32(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }

inline void load_f32(const c10::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16_ps(src + i));
#elif defined(LOUVER_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8_ps(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void load_f32(const c10::BFloat16* src, int64_t n, float* dst) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;  // bf16 is the top half of fp32
    float f;
    std::memcpy(&f, &word, sizeof(f));
    dst[i] = f;
  }
}

inline float dot(const float* a, const float* b, int n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {  // two chains and a tree reduction: the simd loop below ends in a serial
                      // chain of 15 scalar adds, which made the exact part's 2 × 256 × 9 dots
                      // the largest fixed cost of a step (~50 µs at batch 1)
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
      even = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), even);
      odd = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), odd);
    }
    if (i < n) even = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), even);
    return _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
  }
#elif defined(LOUVER_AVX2)
  if (n % 8 == 0) {  // the same with 8 lanes
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
      even = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), even);
      odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), odd);
    }
    if (i < n) even = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), even);
    return hsum8_ps(_mm256_add_ps(even, odd));
  }
#endif
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// y += a·x over n floats.
inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// numerics.dot_slack: absolute error bound of an fp32 sum of num_terms products whose absolute
// values sum to mag (the page terms' and the exact scores' slack).
inline float dot_slack(float mag, int64_t num_terms) {
  const float terms = static_cast<float>(num_terms + 8);
  return mag * (2.f * terms * 5.9604645e-08f) + terms * std::ldexp(1.0f, -130);
}

// Query terms of one page and KV head, for its G query heads (see louver_sgl/index/grid.py):
// token bound = off[g] + Σ_d w[g][d]·code_d; page bound pb[g]; both include the fp32 slack
// (same formula as numerics.dot_slack with num_terms = 2·D + 2). lo/sc/rad are fp32 rows [D].
// mag (optional) [G]: Σ_d |q_d|·(|lo_d| + 2^bits·|sc_d| + rad_d), at least Σ_d |q_d·k_d| for every key
// of the page (|k_d − center_d| <= rad_d): the magnitude its exact scores' slack is taken from.
inline void page_terms(const float* qk, const float* lo, const float* sc, const float* rad, int64_t G,
                       int64_t D, int64_t bits, float* w, float* off, float* pb, float* mag_out = nullptr) {
  const float levels = static_cast<float>(1 << bits);
#if defined(__AVX512F__)
  if (D % 16 == 0) {  // the loop below, 16 channels at a time (it is run once per page and KV head)
    const __m512 half = _mm512_set1_ps(0.5f), top = _mm512_set1_ps(levels - 0.5f), lev = _mm512_set1_ps(levels);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qk + g * D;
      __m512 o = _mm512_setzero_ps(), page = o, radius = o, mag = o;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 l = _mm512_loadu_ps(lo + d), s = _mm512_loadu_ps(sc + d), r = _mm512_loadu_ps(rad + d);
        const __m512 q = _mm512_loadu_ps(qg + d), qa = _mm512_abs_ps(q);
        _mm512_storeu_ps(w + g * D + d, _mm512_mul_ps(q, s));
        const __m512 low = _mm512_mul_ps(q, _mm512_fmadd_ps(half, s, l));
        const __m512 high = _mm512_mul_ps(q, _mm512_fmadd_ps(top, s, l));
        o = _mm512_add_ps(o, low);
        page = _mm512_add_ps(page, _mm512_max_ps(low, high));
        radius = _mm512_fmadd_ps(qa, r, radius);
        mag = _mm512_fmadd_ps(qa, _mm512_add_ps(_mm512_fmadd_ps(lev, _mm512_abs_ps(s), _mm512_abs_ps(l)), r), mag);
      }
      const float rsum = _mm512_reduce_add_ps(radius), msum = _mm512_reduce_add_ps(mag);
      if (mag_out) mag_out[g] = msum;
      const float slack = dot_slack(msum, 2 * D + 2);
      off[g] = _mm512_reduce_add_ps(o) + rsum + slack;
      pb[g] = _mm512_reduce_add_ps(page) + rsum + slack;
    }
    return;
  }
#elif defined(LOUVER_AVX2)
  if (D % 8 == 0) {  // the same with 8 lanes (the compiler took the loop below 4 lanes at a time, with
                     // a scalar tail of spills that cost more than the loop)
    const __m256 half = _mm256_set1_ps(0.5f), top = _mm256_set1_ps(levels - 0.5f), lev = _mm256_set1_ps(levels);
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qk + g * D;
      __m256 o = _mm256_setzero_ps(), page = o, radius = o, mag = o;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 l = _mm256_loadu_ps(lo + d), s = _mm256_loadu_ps(sc + d), r = _mm256_loadu_ps(rad + d);
        const __m256 q = _mm256_loadu_ps(qg + d), qa = _mm256_andnot_ps(sign, q);
        _mm256_storeu_ps(w + g * D + d, _mm256_mul_ps(q, s));
        const __m256 low = _mm256_mul_ps(q, _mm256_fmadd_ps(half, s, l));
        const __m256 high = _mm256_mul_ps(q, _mm256_fmadd_ps(top, s, l));
        o = _mm256_add_ps(o, low);
        page = _mm256_add_ps(page, _mm256_max_ps(low, high));
        radius = _mm256_fmadd_ps(qa, r, radius);
        const __m256 cell = _mm256_fmadd_ps(lev, _mm256_andnot_ps(sign, s), _mm256_andnot_ps(sign, l));
        mag = _mm256_fmadd_ps(qa, _mm256_add_ps(cell, r), mag);
      }
      const float rsum = hsum8_ps(radius), msum = hsum8_ps(mag);
      if (mag_out) mag_out[g] = msum;
      const float slack = dot_slack(msum, 2 * D + 2);
      off[g] = hsum8_ps(o) + rsum + slack;
      pb[g] = hsum8_ps(page) + rsum + slack;
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qk + g * D;
    float* wg = w + g * D;
    float o = 0.f, page = 0.f, radius = 0.f, mag = 0.f;
#pragma omp simd reduction(+ : o, page, radius, mag)
    for (int64_t d = 0; d < D; ++d) {
      const float l = lo[d], s = sc[d], r = rad[d], q = qg[d];
      wg[d] = q * s;
      o += q * (l + 0.5f * s);
      page += std::max(q * (l + 0.5f * s), q * (l + (levels - 0.5f) * s));
      radius += std::fabs(q) * r;
      mag += std::fabs(q) * (std::fabs(l) + levels * std::fabs(s) + r);
    }
    if (mag_out) mag_out[g] = mag;
    const float slack = dot_slack(mag, 2 * D + 2);
    off[g] = o + radius + slack;
    pb[g] = page + radius + slack;
  }
}

// Page codebook rows (lo, scale, radius) of one page and KV head as fp32 [3, D].
template <typename M>
inline void load_codebook(const M* lo, const M* sc, const M* rad, int64_t D, float* dst) {
  load_f32(lo, D, dst);
  load_f32(sc, D, dst + D);
  load_f32(rad, D, dst + 2 * D);
}

// Exact scores s = q·k enter lower bounds of Z as s − score_slack(mag, D), mag >= Σ_d |q_d·k_d|: the
// fp32 dot in any summation order errs by less (D + 2 terms; the two extra cover the rounding of
// mag itself and of the lowered reference below).
inline float score_slack(float mag, int64_t D) { return dot_slack(mag, D + 2); }

// ref + slack rounded up to fp32: σ·(s − lifted) is at most σ·(s − slack − ref), so masses taken
// relative to the lifted reference are lower bounds of the true keys' masses relative to ref.
inline float lifted_ref(float ref, float slack) {
  const double x = double(ref) + double(slack);
  const float r = static_cast<float>(x);
  return double(r) < x ? std::nextafter(r, INFINITY) : r;
}

// An upper bound of ‖x‖₂ from an fp32 sum of squares ss of n <= 4096 values (in any order): ss errs
// by less than 2^-10 relative, the sqrt and the products by an ulp each.
constexpr float kSquaresUp = 1.f + 0x1p-9f, kNormUp = 1.f + 0x1p-20f;
inline float norm_up(const float* x, int64_t n) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < n; ++d) ss += x[d] * x[d];
  return std::sqrt(ss * kSquaresUp) * kNormUp;
}

// The int8 weights' rule. Weights lie in ±127. Where 8-bit codes take the AVX2 block scan
// (dot_block16_avx2_8bit: builds with AVX2 but without AVX-512 VNNI), _mm256_maddubs_epi16 adds
// two code·weight products in int16 and the scan adds kLaneDwords such sums in int16 before they
// widen, so each int16 lane holds Σ code·wq over a lane group of 2·kLaneDwords channels
// (lane_group_max): exact for every code in [0, 255] while Σ_group |wq| <= 128 (255·128 < 2^15).
// quantize_weights makes the step at least max_group Σ|w| / int8_group_limit (125): rounding adds
// at most 0.5 per channel and fp32 at most a few ulps, so Σ|wq| <= 125·(1 + 2^-21) + 2 < 128. On the
// captured traces that step is 0.6-0.8 times the per-weight rule's it replaces (|wq| <= 63, one
// widening per dword): tighter bounds, and a quarter fewer multiplies. The torch specification takes
// the rule as ``Int8Rule`` (the ``int8_weight_rule`` op reports this build's).
#if defined(LOUVER_AVX2) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
constexpr bool kCodes8Maddubs = true;
#else
constexpr bool kCodes8Maddubs = false;
#endif
constexpr int kLaneDwords = 2;
constexpr int kInt8WeightLimit = 127;
inline float int8_group_limit(int64_t bits) { return kCodes8Maddubs && bits == 8 ? 125.f : 0.f; }

// The largest fp32 sum of |w| over a lane group (kLaneDwords = 2: channels 8b + 2p, 8b + 2p + 1,
// 8b + 2p + 4, 8b + 2p + 5 for block b and parity p, the channels one int16 lane of the block scan
// adds up), each summed as (|w_a| + |w_b|) + (|w_c| + |w_d|), the specification's order. D % 8 == 0.
inline float lane_group_max(const float* w, int64_t D) {
  static_assert(kLaneDwords == 2, "lane groups of two dwords");
  float top = 0.f;
  for (int64_t b = 0; b < D / 8; ++b)
    for (int p = 0; p < 2; ++p) {
      const float* x = w + 8 * b + 2 * p;
      top = std::max(top, (std::fabs(x[0]) + std::fabs(x[1])) + (std::fabs(x[4]) + std::fabs(x[5])));
    }
  return top;
}

// Integer form of one head's token weights: w_d ≈ step·wq_d with wq_d int8, so that
// Σ_d w_d·c_d <= step·Σ_d wq_d·c_d + err for every code vector c in [0, 2^bits − 1]^D. Codes are
// never negative, so err = (2^bits − 1)·Σ_d max(w_d − step·wq_d, 0): only channels rounded down can
// raise the sum (counting |w_d − step·wq_d| made the bound about twice as loose).
// The integer dot product is exact (|Σ| < 2^24), the fp32 product step·acc is covered by err's
// relative term, and a NaN/Inf weight makes err NaN (the token is then kept).
inline float quantize_weights(const float* w, int64_t D, int64_t bits, int8_t* wq, float* step,
                              float* mag_out = nullptr) {
  float top = 0.f;
#pragma omp simd reduction(max : top)
  for (int64_t d = 0; d < D; ++d) top = std::max(top, std::fabs(w[d]));
  if (!std::isfinite(top)) {
    std::fill(wq, wq + D, 0);
    *step = 0.f;
    return NAN;
  }
  const float limit = static_cast<float>(kInt8WeightLimit), group_limit = int8_group_limit(bits);
  const float s = std::max(top > 0.f ? top / limit : 1.f, group_limit > 0.f ? lane_group_max(w, D) / group_limit : 0.f);
  const float inv = 1.f / s;
  const float levels = static_cast<float>((1 << bits) - 1);
  float err = 0.f, mag = 0.f;
  int64_t d = 0;
#if defined(__AVX512F__)
  // 16 channels at a time (the scalar loop below does not vectorise: nearbyint and the int8 cast)
  const __m512 vs = _mm512_set1_ps(s), vinv = _mm512_set1_ps(inv), lim = _mm512_set1_ps(limit);
  __m512 verr = _mm512_setzero_ps(), vmag = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    const __m512 x = _mm512_loadu_ps(w + d);
    __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(x, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim), _mm512_min_ps(lim, r));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(wq + d), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
    const __m512 sr = _mm512_mul_ps(vs, r);
    verr = _mm512_add_ps(verr, _mm512_max_ps(_mm512_sub_ps(x, sr), _mm512_setzero_ps()));
    vmag = _mm512_add_ps(vmag, _mm512_abs_ps(sr));
  }
  err = _mm512_reduce_add_ps(verr);
  mag = _mm512_reduce_add_ps(vmag);
#elif defined(LOUVER_AVX2)
  // the same, 8 channels at a time
  const __m256 vs = _mm256_set1_ps(s), vinv = _mm256_set1_ps(inv), lim = _mm256_set1_ps(limit);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 verr = _mm256_setzero_ps(), vmag = _mm256_setzero_ps();
  for (; d + 8 <= D; d += 8) {
    const __m256 x = _mm256_loadu_ps(w + d);
    __m256 r = _mm256_round_ps(_mm256_mul_ps(x, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), lim), _mm256_min_ps(lim, r));
    const __m256i i32 = _mm256_cvtps_epi32(r);
    const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(wq + d), _mm_packs_epi16(i16, i16));
    const __m256 sr = _mm256_mul_ps(vs, r);
    verr = _mm256_add_ps(verr, _mm256_max_ps(_mm256_sub_ps(x, sr), _mm256_setzero_ps()));
    vmag = _mm256_add_ps(vmag, _mm256_andnot_ps(sign, sr));
  }
  err = hsum8_ps(verr);
  mag = hsum8_ps(vmag);
#endif
  for (; d < D; ++d) {
    const float r = std::max(-limit, std::min(limit, std::nearbyint(w[d] * inv)));
    wq[d] = static_cast<int8_t>(r);
    err += std::max(w[d] - s * r, 0.f);
    mag += std::fabs(s * r);
  }
  *step = s;
  if (mag_out) *mag_out = mag;
  // (1 + 2^-16) and the 2^-20 relative term cover fp32 rounding of err (summed in any order),
  // of s·wq and of step·acc.
  return levels * (err * (1.f + 1.52587890625e-05f) + mag * 9.5367431640625e-07f) + std::ldexp(1.0f, -126);
}

#if defined(__AVX512F__)
// load_codebook, page_terms and quantize_weights of one page and KV head in one pass per head, for
// D = 16·NV (NV <= 8) and no lane-group rule (int8_group_limit(bits) == 0: AVX-512 VNNI builds):
// the codebook rows are read once into registers for all G heads, and each head's weights w stay
// in registers from its page terms to their int8 form (the three calls stored and re-read them,
// took max |w| in a pass of its own, and were a quarter of a warm scan). The same fp32 operations
// in the same order as the three calls, so off (with quantize_weights' err added), pb, mag, step and
// wq are theirs bit for bit; a head with a NaN or infinite weight gets wq 0, step 0 and off NaN
// (quantize_weights' err is NaN there too; its tokens are then kept).
template <int NV, typename M>
inline void page_setup16(const float* qk, const M* lo, const M* sc, const M* rad, int64_t G, int64_t bits,
                         float* off, float* pb, float* mag_out, int8_t* wq, float* step) {
  static_assert(NV >= 1 && NV <= 8, "16 to 128 channels");
  constexpr int64_t D = 16 * NV;
  const float levels = static_cast<float>(1 << bits), codes_top = static_cast<float>((1 << bits) - 1);
  const __m512 half = _mm512_set1_ps(0.5f), top = _mm512_set1_ps(levels - 0.5f), lev = _mm512_set1_ps(levels);
  const __m512 lim = _mm512_set1_ps(static_cast<float>(kInt8WeightLimit)), zero = _mm512_setzero_ps();
  __m512 l[NV], s[NV], r[NV];
  for (int i = 0; i < NV; ++i) {
    l[i] = load16_ps(lo + 16 * i);
    s[i] = load16_ps(sc + 16 * i);
    r[i] = load16_ps(rad + 16 * i);
  }
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qk + g * D;
    __m512 w[NV], o = zero, page = zero, radius = zero, mag = zero, wmax = zero;
    __mmask16 bad = 0;  // lanes with a NaN or infinite weight
    for (int i = 0; i < NV; ++i) {
      const __m512 q = _mm512_loadu_ps(qg + 16 * i), qa = _mm512_abs_ps(q);
      w[i] = _mm512_mul_ps(q, s[i]);
      const __m512 low = _mm512_mul_ps(q, _mm512_fmadd_ps(half, s[i], l[i]));
      const __m512 high = _mm512_mul_ps(q, _mm512_fmadd_ps(top, s[i], l[i]));
      o = _mm512_add_ps(o, low);
      page = _mm512_add_ps(page, _mm512_max_ps(low, high));
      radius = _mm512_fmadd_ps(qa, r[i], radius);
      mag = _mm512_fmadd_ps(qa, _mm512_add_ps(_mm512_fmadd_ps(lev, _mm512_abs_ps(s[i]), _mm512_abs_ps(l[i])), r[i]), mag);
      const __m512 wa = _mm512_abs_ps(w[i]);
      wmax = _mm512_max_ps(wa, wmax);
      bad |= _mm512_cmp_ps_mask(wa, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);  // NaN or ±inf
    }
    const float rsum = _mm512_reduce_add_ps(radius), msum = _mm512_reduce_add_ps(mag);
    if (mag_out) mag_out[g] = msum;
    const float slack = dot_slack(msum, 2 * D + 2);
    off[g] = _mm512_reduce_add_ps(o) + rsum + slack;
    pb[g] = _mm512_reduce_add_ps(page) + rsum + slack;
    int8_t* wg = wq + g * D;
    if (bad) {
      std::fill(wg, wg + D, 0);
      step[g] = 0.f;
      off[g] += NAN;
      continue;
    }
    const float t = _mm512_reduce_max_ps(wmax);
    const float sg = t > 0.f ? t / static_cast<float>(kInt8WeightLimit) : 1.f;
    const __m512 vs = _mm512_set1_ps(sg), vinv = _mm512_set1_ps(1.f / sg);
    __m512 verr = zero, vmag = zero;
    for (int i = 0; i < NV; ++i) {
      __m512 x = _mm512_roundscale_ps(_mm512_mul_ps(w[i], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      x = _mm512_max_ps(_mm512_sub_ps(zero, lim), _mm512_min_ps(lim, x));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(wg + 16 * i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(x)));
      const __m512 sr = _mm512_mul_ps(vs, x);
      verr = _mm512_add_ps(verr, _mm512_max_ps(_mm512_sub_ps(w[i], sr), zero));
      vmag = _mm512_add_ps(vmag, _mm512_abs_ps(sr));
    }
    const float err = _mm512_reduce_add_ps(verr), wmag = _mm512_reduce_add_ps(vmag);
    step[g] = sg;
    off[g] += codes_top * (err * (1.f + 1.52587890625e-05f) + wmag * 9.5367431640625e-07f) + std::ldexp(1.0f, -126);
  }
}

// Whether page_setup serves D channels of ``bits``-bit codes (callers add: without residual weights).
inline bool page_setup_fits(int64_t D, int64_t bits) { return D % 16 == 0 && D <= 128 && int8_group_limit(bits) == 0.f; }

// page_setup16 for a run-time D (page_setup_fits).
template <typename M>
inline void page_setup(const float* qk, const M* lo, const M* sc, const M* rad, int64_t G, int64_t D, int64_t bits,
                       float* off, float* pb, float* mag_out, int8_t* wq, float* step) {
  switch (D / 16) {
    case 1: return page_setup16<1>(qk, lo, sc, rad, G, bits, off, pb, mag_out, wq, step);
    case 2: return page_setup16<2>(qk, lo, sc, rad, G, bits, off, pb, mag_out, wq, step);
    case 3: return page_setup16<3>(qk, lo, sc, rad, G, bits, off, pb, mag_out, wq, step);
    case 4: return page_setup16<4>(qk, lo, sc, rad, G, bits, off, pb, mag_out, wq, step);
    case 5: return page_setup16<5>(qk, lo, sc, rad, G, bits, off, pb, mag_out, wq, step);
    case 6: return page_setup16<6>(qk, lo, sc, rad, G, bits, off, pb, mag_out, wq, step);
    case 7: return page_setup16<7>(qk, lo, sc, rad, G, bits, off, pb, mag_out, wq, step);
    default: return page_setup16<8>(qk, lo, sc, rad, G, bits, off, pb, mag_out, wq, step);
  }
}
#else
inline bool page_setup_fits(int64_t, int64_t) { return false; }
template <typename M>  // never called: page_setup_fits is false without AVX-512
inline void page_setup(const float*, const M*, const M*, const M*, int64_t, int64_t, int64_t, float*, float*, float*,
                       int8_t*, float*) {}
#endif

// Residual int8 weights: w_d ≈ step·wq_d + step2·wq2_d, wq2 the int8 form of the fp32 residual r =
// w − step·wq (quantize_weights' step of r, about step / 250), so that for every code vector c in
// [0, 2^bits − 1]^D, Σ_d w_d·c_d <= step·Σ wq_d·c_d + step2·Σ wq2_d·c_d + err. err is
// quantize_weights' of r (its channels rounded down, the rounding of step2·wq2 and of step2·acc)
// plus (2^bits − 1)·2^-20·Σ|step·wq_d|: the fp32 residual differs from w − step·wq by at most
// 2^-23·(|step·wq_d| + |r_d|) per channel, and Σ|r_d| <= D·step/2 <= (D / 246)·Σ|step·wq_d| (the
// largest channel has |wq| = 127, or the largest lane group Σ|wq| >= 123: kInt8WeightLimit,
// int8_group_limit), at most 2.1·Σ|step·wq_d| for D <= 512: with step·acc and the one more
// addition (about 1.5·Σ|step·wq_d| more, in units of 2^-23 per code step) still within the
// term's 8.
// A second integer dot per token, against the first's 255 steps of rounding per channel: the
// bound's int8 slack shrinks about 250-fold. NaN/Inf weights make err NaN, as quantize_weights.
inline float quantize_weights_residual(const float* w, int64_t D, int64_t bits, int8_t* wq, int8_t* wq2,
                                       float* step, float* step2, float* r) {
  float mag = 0.f;
  const float first = quantize_weights(w, D, bits, wq, step, &mag);
  if (std::isnan(first)) {
    std::fill(wq2, wq2 + D, 0);
    *step2 = 0.f;
    return NAN;
  }
  const float s = *step;
  // one rounding (an explicit fma), whether or not the compiler would contract w − s·wq: the
  // torch specification rounds the exact residual once too
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) r[d] = std::fma(-s, static_cast<float>(wq[d]), w[d]);
  const float levels = static_cast<float>((1 << bits) - 1);
  return quantize_weights(r, D, bits, wq2, step2) + levels * mag * 9.5367431640625e-07f;
}

// A token's bound from its two integer dots (quantize_weights_residual): (off + step·dot) +
// step2·dot2, in this order in every kernel that gates or bins with it.
inline float token_bound2(float off, float step, float step2, int32_t dot, int32_t dot2) {
  const float first = off + step * static_cast<float>(dot);
  return first + step2 * static_cast<float>(dot2);
}

// A token's int8 bound from its integer dot: off + step·dot. The attend pass gates with it and the
// certified threshold's histogram counts it: both must round it the same way.
inline float token_bound(float off, float step, int32_t dot) { return off + step * static_cast<float>(dot); }

#if defined(__AVX512F__)
// token_bound of 16 tokens, with the same fp32 operations.
inline __m512 token_bounds16(float off, float step, __m512i dots) {
  return _mm512_add_ps(_mm512_set1_ps(off), _mm512_mul_ps(_mm512_set1_ps(step), _mm512_cvtepi32_ps(dots)));
}

// token_bound2 of 16 tokens, with the same fp32 operations.
inline __m512 token_bounds16_2(float off, float step, float step2, __m512i dots, __m512i dots2) {
  return _mm512_add_ps(token_bounds16(off, step, dots), _mm512_mul_ps(_mm512_set1_ps(step2), _mm512_cvtepi32_ps(dots2)));
}
#endif

#if defined(LOUVER_AVX2)
// token_bound of 8 tokens, with the same fp32 operations as token_bounds16.
inline __m256 token_bounds8(float off, float step, __m256i dots) {
  return _mm256_add_ps(_mm256_set1_ps(off), _mm256_mul_ps(_mm256_set1_ps(step), _mm256_cvtepi32_ps(dots)));
}

// token_bound2 of 8 tokens, with the same fp32 operations.
inline __m256 token_bounds8_2(float off, float step, float step2, __m256i dots, __m256i dots2) {
  return _mm256_add_ps(token_bounds8(off, step, dots), _mm256_mul_ps(_mm256_set1_ps(step2), _mm256_cvtepi32_ps(dots2)));
}
#endif

#if defined(__AVX512F__)
constexpr bool kHaveAvx512 = true;
#else
constexpr bool kHaveAvx512 = false;
#endif
#if defined(LOUVER_AVX2)
constexpr bool kHaveAvx2 = true;
#else
constexpr bool kHaveAvx2 = false;
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHaveVnni = true;

// Token dot products with AVX-512 VNNI: 64 code bytes × 64 int8 weights per instruction.
// 4-bit codes are split into low and high nibbles without re-interleaving; ``nibble_order``
// orders the weights to match (per 64 channels: the even channels, then the odd ones).
inline void dot_token_vnni(const uint8_t* packed, int64_t bits, int64_t D, const int8_t* w,
                           int64_t G, int32_t* out) {
  __m512i acc[8];
  for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_setzero_si512();
  const __m256i nib = _mm256_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < D / 64; ++blk) {
    __m512i c;
    if (bits == 8) {
      c = _mm512_loadu_si512(packed + blk * 64);
    } else {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + blk * 32));
      const __m256i lo = _mm256_and_si256(x, nib);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), nib);
      c = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    for (int64_t g = 0; g < G; ++g)
      acc[g] = _mm512_dpbusd_epi32(acc[g], c, _mm512_loadu_si512(w + g * D + blk * 64));
  }
  for (int64_t g = 0; g < G; ++g) out[g] = _mm512_reduce_add_epi32(acc[g]);
}
// One 64-channel block of a token's codes as 64 bytes (4-bit: low nibbles, then high nibbles).
inline __m512i load_code_block(const uint8_t* packed, int64_t bits, int64_t blk) {
  if (bits == 8) return _mm512_loadu_si512(packed + blk * 64);
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + blk * 32));
  const __m256i lo = _mm256_and_si256(x, nib);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), nib);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// In-register transpose of 16 vectors of 16 dwords: lane t of col[j] = dword j of v[t] (64 shuffles).
inline void transpose16_epi32(const __m512i* v, __m512i* col) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: [v2i[4L], v2i+1[4L], v2i[4L+1], v2i+1[4L+1]] and the +2, +3 pair
    a[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + c], lane L: dword 4L + c of rows 4i .. 4i+3
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // col[4L + c] gathers lane L of b[c], b[4 + c], b[8 + c], b[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44), y1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    col[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    col[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    col[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    col[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// Integer dots of 16 consecutive tokens (rows ``stride`` bytes apart from ``first``) with the
// split weights of G heads: lane t of out[g] = Σ_d w_g[d]·c_t[d]. Each 64-channel block of the 16
// tokens is transposed once (lane t of col[j] = channels 4j .. 4j+3 of token t), so every head
// needs 16 VNNI steps against broadcast weight quads and no horizontal sums.
inline void dot_block16_vnni(const uint8_t* first, int64_t stride, int64_t bits, int64_t D, const int8_t* w,
                             int64_t G, __m512i* out) {
  for (int64_t g = 0; g < G; ++g) out[g] = _mm512_setzero_si512();
  __m512i v[16], col[16];
  for (int64_t blk = 0; blk < D / 64; ++blk) {
    for (int t = 0; t < 16; ++t) v[t] = load_code_block(first + t * stride, bits, blk);
    transpose16_epi32(v, col);
    for (int64_t g = 0; g < G; ++g) {
      // two local chains per head: int8 weights may alias out[], so accumulating there would
      // store and reload it after every step
      const int8_t* wb = w + g * D + blk * 64;
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
      for (int j = 0; j < 16; j += 2) {
        int32_t q0, q1;
        std::memcpy(&q0, wb + 4 * j, sizeof(q0));
        std::memcpy(&q1, wb + 4 * j + 4, sizeof(q1));
        even = _mm512_dpbusd_epi32(even, col[j], _mm512_set1_epi32(q0));
        odd = _mm512_dpbusd_epi32(odd, col[j + 1], _mm512_set1_epi32(q1));
      }
      out[g] = _mm512_add_epi32(out[g], _mm512_add_epi32(even, odd));
    }
  }
}

// dot_block16_vnni for 4-bit codes, with the weights in nibble_order block 8. A token's 64-channel
// block is 32 bytes, 8 dwords of packed nibbles; the 16 tokens' dwords are transposed while still
// packed (lane t of col[i] = dword i of token t; 32 shuffles, against 64 for the unpacked bytes),
// and each col[i] then splits into its low nibbles (channels 8i, 8i+2, 8i+4, 8i+6) and its high
// ones (8i+1, ..., 8i+7): the weight quads at 8i and 8i+4 of the block-8 order. The scan is
// compute-bound once its codes are in cache, and the transpose was its largest part.
inline void dot_block16_vnni4(const uint8_t* first, int64_t stride, int64_t D, const int8_t* w, int64_t G,
                              __m512i* out) {
  for (int64_t g = 0; g < G; ++g) out[g] = _mm512_setzero_si512();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  // qwords of two sources: [first's 128-bit lane 0, second's lane 0, first's lane 2, second's lane 2]
  // and the same with lanes 1 and 3
  const __m512i even_lanes = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i odd_lanes = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int64_t blk = 0; blk < D / 64; ++blk) {
    // r[i]: token i in the low 256 bits, token i + 8 in the high ones; 128-bit lanes
    // [t_i d0-3, t_i d4-7, t_i+8 d0-3, t_i+8 d4-7]
    __m512i r[8], a[8], b[8], col[8];
    for (int i = 0; i < 8; ++i) {
      const auto* lo_row = reinterpret_cast<const __m256i*>(first + i * stride + blk * 32);
      const auto* hi_row = reinterpret_cast<const __m256i*>(first + (i + 8) * stride + blk * 32);
      r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(lo_row)), _mm256_loadu_si256(hi_row), 1);
    }
    for (int i = 0; i < 4; ++i) {  // lane 0 of a[2i]: d0, d1 of tokens 2i, 2i+1; of a[2i+1]: d2, d3
      a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; ++h) {  // b[4h + c], lanes: [d_c, d_c+4 of tokens 4h .. 4h+3, the same of 4h+8 .. 4h+11]
      b[4 * h] = _mm512_unpacklo_epi64(a[4 * h], a[4 * h + 2]);
      b[4 * h + 1] = _mm512_unpackhi_epi64(a[4 * h], a[4 * h + 2]);
      b[4 * h + 2] = _mm512_unpacklo_epi64(a[4 * h + 1], a[4 * h + 3]);
      b[4 * h + 3] = _mm512_unpackhi_epi64(a[4 * h + 1], a[4 * h + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      col[c] = _mm512_permutex2var_epi64(b[c], even_lanes, b[4 + c]);
      col[4 + c] = _mm512_permutex2var_epi64(b[c], odd_lanes, b[4 + c]);
    }
    __m512i low[8], high[8];
    for (int i = 0; i < 8; ++i) {
      low[i] = _mm512_and_si512(col[i], nib);
      high[i] = _mm512_and_si512(_mm512_srli_epi16(col[i], 4), nib);
    }
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* wb = w + g * D + blk * 64;  // two local chains, as in dot_block16_vnni
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) {
        int32_t q0, q1;
        std::memcpy(&q0, wb + 8 * i, sizeof(q0));
        std::memcpy(&q1, wb + 8 * i + 4, sizeof(q1));
        even = _mm512_dpbusd_epi32(even, low[i], _mm512_set1_epi32(q0));
        odd = _mm512_dpbusd_epi32(odd, high[i], _mm512_set1_epi32(q1));
      }
      out[g] = _mm512_add_epi32(out[g], _mm512_add_epi32(even, odd));
    }
  }
}

// dot_block16_vnni / dot_block16_vnni4 for codes stored in the block16 layout (see Codes): the
// operand vectors are read as stored, 64 bytes each, with no transpose. ``cols``: the block's
// [bytes/4, 16, 4] bytes for one KV head; weights as for the transposing versions (8 bits:
// channel order; 4 bits: nibble_order block 8).
template <int BITS>
inline void dot_block16_cols(const uint8_t* cols, int64_t D, const int8_t* w, int64_t G, __m512i* out) {
  static_assert(BITS == 4 || BITS == 8, "VNNI blocks of 4- or 8-bit codes");
  constexpr int kWords = BITS == 4 ? 8 : 16;  // dwords per 64 channels
  for (int64_t g = 0; g < G; ++g) out[g] = _mm512_setzero_si512();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < D / 64; ++blk) {
    __m512i low[kWords], high[8];
    for (int i = 0; i < kWords; ++i) {
      const __m512i c = _mm512_loadu_si512(cols + (blk * kWords + i) * 64);
      if constexpr (BITS == 4) {
        low[i] = _mm512_and_si512(c, nib);
        high[i] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nib);
      } else {
        low[i] = c;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* wb = w + g * D + blk * 64;
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();  // two local chains
      for (int i = 0; i < 8; ++i) {
        int32_t q0, q1;
        std::memcpy(&q0, wb + 8 * i, sizeof(q0));
        std::memcpy(&q1, wb + 8 * i + 4, sizeof(q1));
        if constexpr (BITS == 4) {  // low nibbles: channels 8i, 8i+2, ..; high: 8i+1, ..
          even = _mm512_dpbusd_epi32(even, low[i], _mm512_set1_epi32(q0));
          odd = _mm512_dpbusd_epi32(odd, high[i], _mm512_set1_epi32(q1));
        } else {  // dwords 2i and 2i+1: channels 8i .. 8i+7
          even = _mm512_dpbusd_epi32(even, low[2 * i], _mm512_set1_epi32(q0));
          odd = _mm512_dpbusd_epi32(odd, low[2 * i + 1], _mm512_set1_epi32(q1));
        }
      }
      out[g] = _mm512_add_epi32(out[g], _mm512_add_epi32(even, odd));
    }
  }
}
#else
constexpr bool kHaveVnni = false;
inline void dot_token_vnni(const uint8_t*, int64_t, int64_t, const int8_t*, int64_t, int32_t*) {}
#endif

// Reorder one head's weights [D] to the channel order in which 4-bit codes are unpacked without
// re-interleaving: per ``block`` channels, the even channels (low nibbles), then the odd ones (high
// nibbles). Other widths keep channel order. dot_token_vnni / dot_block16_vnni use block 64 (int8
// weights) and dot_block16_vnni4 block 8.
template <typename T>
inline void nibble_order(const T* w, int64_t bits, int64_t D, int64_t block, T* out) {
  if (bits != 4) {
    std::copy(w, w + D, out);
    return;
  }
  const int64_t half = block / 2;
  for (int64_t blk = 0; blk < D / block; ++blk)
    for (int64_t j = 0; j < half; ++j) {
      out[blk * block + j] = w[blk * block + 2 * j];
      out[blk * block + half + j] = w[blk * block + 2 * j + 1];
    }
}

#if defined(__AVX512VBMI__)
// The byte permutation of nibble_order within 64 channels for ``block`` (8 or 64) dividing 64.
inline __m512i nibble_permutation(int block) {
  alignas(64) int8_t idx[64];
  for (int base = 0; base < 64; base += block)
    for (int j = 0; j < block / 2; ++j) {
      idx[base + j] = static_cast<int8_t>(base + 2 * j);
      idx[base + block / 2 + j] = static_cast<int8_t>(base + 2 * j + 1);
    }
  return _mm512_load_si512(idx);
}
#endif

// nibble_order of one head's int8 weights with block 64 or 8 (D a multiple of 64): one byte
// permutation per 64 channels (built once: this runs per page and head).
inline void nibble_order_int8(const int8_t* w, int64_t bits, int64_t D, int block, int8_t* out) {
#if defined(__AVX512VBMI__)
  if (bits == 4 && (block == 64 || block == 8)) {
    static const __m512i perm64 = nibble_permutation(64), perm8 = nibble_permutation(8);
    const __m512i perm = block == 64 ? perm64 : perm8;
    for (int64_t blk = 0; blk < D / 64; ++blk)
      _mm512_storeu_si512(out + blk * 64, _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(w + blk * 64)));
    return;
  }
#endif
  nibble_order(w, bits, D, block, out);
}

inline int32_t dot_u8s8(const uint8_t* c, const int8_t* w, int64_t D) {
  int32_t acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < D; ++d) acc += static_cast<int32_t>(c[d]) * static_cast<int32_t>(w[d]);
  return acc;
}

// The grid index's packed codes (louver_sgl/index/store.py): the "token" layout [slots, H_kv,
// bytes], or "block16" [slots/16, H_kv, bytes/4, 16, 4]: per 16 slots and KV head, dword j of the
// 16 tokens side by side, which is the VNNI scan's operand as stored (the transpose of 16 token
// rows was the largest part of the scan's work). A page (a multiple of 16 slots in block16) covers
// the same bytes in both layouts.
struct Codes {
  static constexpr int64_t kMaxBytes = 512;  // bytes per token and KV head (token() scratch)
  const uint8_t* data;
  int64_t h_kv, bytes;  // bytes per token and KV head
  bool block16;

  // The 16 tokens from slot ``first`` (a multiple of 16) of KV head k: block16, their [bytes/4,
  // 16, 4] bytes; token layout, the first token's row (rows h_kv·bytes apart).
  const uint8_t* block(int64_t first, int64_t k) const {
    return data + first * h_kv * bytes + k * (block16 ? 16 * bytes : bytes);
  }

  // One token's packed codes [bytes]: in place (token layout) or gathered into scratch.
  const uint8_t* token(int64_t slot, int64_t k, uint8_t* scratch) const {
    if (!block16) return data + (slot * h_kv + k) * bytes;
    const uint8_t* src = block(slot / 16 * 16, k) + slot % 16 * 4;
    for (int64_t j = 0; j < bytes / 4; ++j) std::memcpy(scratch + 4 * j, src + 64 * j, 4);
    return scratch;
  }
};

// The Codes view of a codes tensor (token layout [slots, H_kv, bytes] or block16 [slots/16, H_kv,
// bytes/4, 16, 4], uint8, contiguous).
inline Codes codes_view(const torch::Tensor& codes) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  const bool block16 = codes.dim() == 5;
  TORCH_CHECK(codes.dim() == 3 || (block16 && codes.size(3) == 16 && codes.size(4) == 4),
              "codes must be [slots, H_kv, bytes] or [slots/16, H_kv, bytes/4, 16, 4], got ", codes.sizes());
  const int64_t bytes = block16 ? 4 * codes.size(2) : codes.size(2);
  TORCH_CHECK(bytes <= Codes::kMaxBytes, "codes: at most ", Codes::kMaxBytes, " bytes per token and head");
  return Codes{codes.data_ptr<uint8_t>(), codes.size(1), bytes, block16};
}

// Unpack the codes of the P slots from ``first`` (KV head k) into bytes [P, D].
inline void unpack_page(const Codes& codes, int64_t first, int64_t k, int64_t bits, int64_t P, int64_t D,
                        uint8_t* dst) {
  uint8_t scratch[Codes::kMaxBytes];
  for (int64_t p = 0; p < P; ++p) {
    const uint8_t* in = codes.token(first + p, k, scratch);
    uint8_t* out = dst + p * D;
    if (bits == 8) {
      std::copy(in, in + D, out);
    } else if (bits == 4) {
      for (int64_t j = 0; j < D / 2; ++j) {
        out[2 * j] = in[j] & 0xF;
        out[2 * j + 1] = in[j] >> 4;
      }
    } else {
      for (int64_t j = 0; j < D / 4; ++j) {
        const uint8_t b = in[j];
        out[4 * j] = b & 3;
        out[4 * j + 1] = (b >> 2) & 3;
        out[4 * j + 2] = (b >> 4) & 3;
        out[4 * j + 3] = b >> 6;
      }
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The integer dots [G] (16 lanes each) of the 16 tokens from slot ``first`` of KV head k, in
// either layout: wsplit (nibble_order block 64) for 8-bit codes, wsplit8 (block 8) for 4-bit.
inline void dot_block16(const Codes& codes, int64_t first, int64_t k, int64_t bits, int64_t D,
                        const int8_t* wsplit, const int8_t* wsplit8, int64_t G, __m512i* dots) {
  const uint8_t* block = codes.block(first, k);
  if (codes.block16) {
    if (bits == 4) {
      dot_block16_cols<4>(block, D, wsplit8, G, dots);
    } else {
      dot_block16_cols<8>(block, D, wsplit, G, dots);
    }
  } else if (bits == 4) {
    dot_block16_vnni4(block, codes.h_kv * codes.bytes, D, wsplit8, G, dots);
  } else {
    dot_block16_vnni(block, codes.h_kv * codes.bytes, bits, D, wsplit, G, dots);
  }
}
#endif


// f(std::integral_constant<int, n>{}) for a head count n of 1..8 (larger counts run as 8: callers
// guarantee n <= 8): loops over heads with a compile-time count keep their per-head accumulators
// in registers, where a run-time count left them on the stack.
template <typename F>
inline void with_heads(int64_t n, F&& f) {
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

#if defined(LOUVER_AVX2)
// Weight quad q of w (4 int8 weights, one dword) in all 8 lanes: a vpbroadcastd from memory, a load
// (the scan's weight operands need no per-page buffer).
inline __m256i broadcast_quad(const int8_t* w, int64_t q) {
  int32_t quad;
  std::memcpy(&quad, w + 4 * q, sizeof(quad));
  return _mm256_set1_epi32(quad);
}

// The integer dots of the 16 tokens of a block16 block of 4-bit codes (``cols``: [bytes/4, 16, 4]
// for one KV head) with G heads' int8 weights in nibble_order block 8 (``w`` [G, D]), as
// dot_block16_cols<4> computes them with VNNI: out[g·16 + t] for token t. Per dword of channels,
// _mm256_maddubs_epi16 multiplies 8 tokens' codes by the broadcast weight quad and adds adjacent pairs into int16;
// |code·w| <= 15·127, so 8 dwords' pair sums stay below 2^15 (no saturation) before they widen to
// int32 (one chain for the low nibbles, one for the high ones).
inline void dot_block16_avx2_4bit(const uint8_t* cols, int64_t D, const int8_t* w, int64_t G, int32_t* out) {
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {  // tokens 8h .. 8h+7: the low or high 32 bytes of each dword row
    __m256i acc[8];
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm256_setzero_si256();
    for (int64_t blk = 0; blk < D / 64; ++blk) {
      __m256i low[8], high[8];
      for (int i = 0; i < 8; ++i) {
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cols + (blk * 8 + i) * 64 + 32 * h));
        low[i] = _mm256_and_si256(c, nib);
        high[i] = _mm256_and_si256(_mm256_srli_epi16(c, 4), nib);
      }
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* wg = w + g * D + blk * 64;
        __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
        for (int i = 0; i < 8; ++i) {
          even = _mm256_add_epi16(even, _mm256_maddubs_epi16(low[i], broadcast_quad(wg, 2 * i)));
          odd = _mm256_add_epi16(odd, _mm256_maddubs_epi16(high[i], broadcast_quad(wg, 2 * i + 1)));
        }
        acc[g] = _mm256_add_epi32(acc[g], _mm256_add_epi32(_mm256_madd_epi16(even, ones), _mm256_madd_epi16(odd, ones)));
      }
    }
    for (int64_t g = 0; g < G; ++g) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * 16 + 8 * h), acc[g]);
  }
}


// The integer dots of the 16 tokens of a block16 block of 8-bit codes (``cols``: [D/4, 16, 4] for
// one KV head) with G heads' int8 weights in channel order (``w`` [G, D], each quad broadcast as
// it is read): out[g·16 + t] for token t, as dot_block16_cols<8> computes them with VNNI.
// Per dword of channels, _mm256_maddubs_epi16 multiplies 8 tokens' codes by the weight quad and adds
// adjacent pairs into int16; the sums of kLaneDwords dwords add up in int16 and then widen to
// int32, exact under the lane groups' rule (int8_group_limit: Σ_group |wq| <= 128, 255·128 < 2^15).
// One widening (_mm256_madd_epi16, on the multiply port with the maddubs) per two dwords instead of
// one per dword: a quarter fewer multiplies, which bound this loop.
//
// NH (the weight rows) is a template argument so that the accumulators live in registers (with a
// run-time count they went through the stack, a load and a store per dword and head). Up to 4
// rows both 8-token halves share each weight load (2·NH accumulators); more rows take the halves
// one after the other.
template <int NH>
inline void dot_block16_avx2_8bit_rows(const uint8_t* cols, int64_t D, const int8_t* wt, int32_t* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr int kHalves = NH <= 4 ? 2 : 1;  // halves per pass over the channels
  for (int h0 = 0; h0 < 2; h0 += kHalves) {  // tokens 8h .. 8h+7: the low or high 32 bytes of each dword row
    __m256i acc[kHalves][NH];
    for (int h = 0; h < kHalves; ++h)
      for (int g = 0; g < NH; ++g) acc[h][g] = _mm256_setzero_si256();
    for (int64_t j = 0; j < D / 4; j += kLaneDwords) {
      __m256i c[kLaneDwords][kHalves];
      for (int i = 0; i < kLaneDwords; ++i)
        for (int h = 0; h < kHalves; ++h)
          c[i][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cols + (j + i) * 64 + 32 * (h0 + h)));
      for (int g = 0; g < NH; ++g) {
        __m256i w[kLaneDwords];
        for (int i = 0; i < kLaneDwords; ++i) w[i] = broadcast_quad(wt + g * D, j + i);
        for (int h = 0; h < kHalves; ++h) {
          __m256i lanes = _mm256_maddubs_epi16(c[0][h], w[0]);
          for (int i = 1; i < kLaneDwords; ++i) lanes = _mm256_add_epi16(lanes, _mm256_maddubs_epi16(c[i][h], w[i]));
          acc[h][g] = _mm256_add_epi32(acc[h][g], _mm256_madd_epi16(lanes, ones));
        }
      }
    }
    for (int h = 0; h < kHalves; ++h)
      for (int g = 0; g < NH; ++g)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * 16 + 8 * (h0 + h)), acc[h][g]);
  }
}

// dot_block16_avx2_8bit_rows for G weight rows (1..8: the heads, or twice them with residual weights).
inline void dot_block16_avx2_8bit(const uint8_t* cols, int64_t D, const int8_t* w, int64_t G, int32_t* out) {
  with_heads(G, [&](auto nh) { dot_block16_avx2_8bit_rows<decltype(nh)::value>(cols, D, w, out); });
}

// The 8-lane scan's integer dots of one block16 block, for the code width (avx2_block_scan): ``w``
// [G, D] int8, in channel order for 8 bits, in nibble_order block 8 for 4.
inline void dot_block16_avx2(const uint8_t* cols, int64_t bits, int64_t D, const int8_t* w, int64_t G, int32_t* out) {
  if (bits == 8) {
    dot_block16_avx2_8bit(cols, D, w, G, out);
  } else {
    dot_block16_avx2_4bit(cols, D, w, G, out);
  }
}

#endif

// Whether a page's codes take the 8-lane scan (AVX2 builds): block16 codes of 4 bits, or of 8
// without VNNI, D a multiple of 64, at most 8 heads per group. The attend pass and the certified
// passes decide alike, so that both bound a token with the same operations.
inline bool avx2_block_scan(const Codes& codes, int64_t bits, int64_t D, int64_t G) {
  return kHaveAvx2 && codes.block16 && (bits == 4 || (bits == 8 && kCodes8Maddubs)) && D % 64 == 0 && G <= 8;
}

// Bound on exp_ps16's relative error wherever e^x is a normal fp32 (checked by a test).
constexpr double kExpPs16RelError = 0x1p-22;

// Relative safety of masses Σ e^{σ(s − ref)} summed from exp_ps16 in 16-lane blocks (exp_sum_low16,
// exp_sum_high16): exp_ps16's error (below kExpPs16RelError = 2^-22), x = σ(s − ref) with up to
// three fp32 roundings (σ to fp32, the difference, the product; |x| <= 88: below 1.6e-5), a sum of
// 16 positive terms (below 15u = 9e-7): in all below 1.7e-5 < 2^-15. Block sums add up in fp64.
constexpr double kMassUp = 1.0 + 0x1p-15, kMassDown = 1.0 - 0x1p-15;

// exp_up16 / exp_up8: e^x from above, within 0.83 %, for the masses of dropped tokens, of which
// there are many and whose bound may be loose by a little, where exp_ps16's 20-odd operations per
// vector were most of the scan's own time. With y = x·log2(e) + 2^-12, n = ⌊y⌋ and f = y − n,
// 2^y = 2^n·2^f ≤ 2^n·(1 + f − a·f·(1 − f)) for a <= 1 − ln 2 = 0.3069 (the chord 1 + f minus a
// bend that vanishes at both ends; at a = 0.3 the polynomial exceeds 2^f by at most 0.81 %). The
// 2^-12 in y (a factor 1 + 1.7e-4) covers the fp32 roundings of y (|x| <= 88: under 1.2e-5), of
// the polynomial (two fused multiply-adds: under 2.4e-7) and of x = σ(u − ref) itself (under
// 1.6e-5 in x), so a result bounds e^x for the exact x; 2^n·p is exact (n in [−126, 126] for x in
// [−87, 88]). checks.cpp's exp_up_ratio measures every fp32 x against fp64.
constexpr float kExpUpBend = 0.3f, kExpUpMargin = 0x1p-12f, kLog2e = 1.44269504088896341f;

// kMassUp times the fp64 sum of a page's 16 fp32 lanes of dropped masses, each lane an fp32 sum
// of at most 16 exp_up terms (one token of each 16-token block: pages of at most 256 slots,
// LouverConfig's limit), bounds the sum of their terms (15u per lane, as for 16-lane blocks above;
// the fp64 adds of positive terms err by 15·2^-53).
inline double lane_mass(const float* lanes) {
  double sum = 0.0;
  for (int i = 0; i < 16; ++i) sum += double(lanes[i]);
  return sum * kMassUp;
}

#if defined(__AVX512F__)

// Lane t of the result is the sum of the 16 lanes of v[t].
// v[t] = the 16-lane products of q [D] and staged fp32 row t of rows [16, D], summed over the
// channel blocks in order (lane_sums16_ps(v) then holds the 16 dot products). Channel blocks
// outer: the 16 FMA chains are independent.
inline void staged_products16(const float* rows, const float* q, int64_t D, __m512* v) {
  for (int t = 0; t < 16; ++t) v[t] = _mm512_setzero_ps();
  for (int64_t j = 0; j < D; j += 16) {
    const __m512 qj = _mm512_loadu_ps(q + j);
    for (int t = 0; t < 16; ++t) v[t] = _mm512_fmadd_ps(_mm512_loadu_ps(rows + t * D + j), qj, v[t]);
  }
}

inline __m512 lane_sums16_ps(const __m512* v) {
  __m512 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(s1[2 * i]), b = _mm512_castps_pd(s1[2 * i + 1]);
    s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], 0x88), _mm512_shuffle_f32x4(s3[0], s3[1], 0xDD));
}

// norm_up of 16 staged fp32 rows [16, D] (D a multiple of 16) into out[16], the sums of squares
// reduced by the transposing add tree as the scores are.
inline void norms_up16(const float* rows, int64_t D, float* out) {
  __m512 v[16];
  for (int t = 0; t < 16; ++t) v[t] = _mm512_setzero_ps();
  for (int64_t j = 0; j < D; j += 16)
    for (int t = 0; t < 16; ++t) {
      const __m512 x = _mm512_loadu_ps(rows + t * D + j);
      v[t] = _mm512_fmadd_ps(x, x, v[t]);
    }
  const __m512 ss = _mm512_mul_ps(lane_sums16_ps(v), _mm512_set1_ps(kSquaresUp));
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_sqrt_ps(ss), _mm512_set1_ps(kNormUp)));
}

// e^x for 16 floats (softmax weights and the candidate masses): relative error below
// kExpPs16RelError wherever e^x is a normal fp32 (x in [−87.3, 88]; tests check every fp32 input
// there against fp64); x below −104 gives 0, NaN stays NaN. Cephes' two-part ln2, Taylor
// polynomial to r^7 (truncation < 2^-24).
inline __m512 exp_ps16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));  // NaN propagates
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  constexpr float inv_fact[8] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};
  __m512 p = _mm512_set1_ps(inv_fact[7]);
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(inv_fact[i]));
  return _mm512_scalef_ps(p, k);
}


// Σ e^{x} over the valid lanes, rounded so that kMassDown times it is a lower bound: lanes with x
// below −87 (subnormal e^x) or NaN count 0, x above 80 counts e^80.
inline float exp_sum_low16(__m512 x, __mmask16 valid) {
  const __mmask16 counted = valid & _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  return _mm512_mask_reduce_add_ps(counted, exp_ps16(_mm512_min_ps(x, _mm512_set1_ps(80.f))));
}

// Σ e^{x} over the valid lanes, such that kMassUp times it is an upper bound: x below −87 counts
// e^−87, NaN or x above 88 counts +inf.
inline float exp_sum_high16(__m512 x, __mmask16 valid) {
  const __mmask16 huge = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.f), _CMP_NLE_UQ);
  const __m512 e = _mm512_mask_mov_ps(exp_ps16(_mm512_max_ps(x, _mm512_set1_ps(-87.f))), huge, _mm512_set1_ps(INFINITY));
  return _mm512_mask_reduce_add_ps(valid, e);
}

// e^x from above for 16 floats (see kExpUpBend): x below −87 gives e^−87, NaN or x above 88 +inf.
inline __m512 exp_up16(__m512 x) {
  const __mmask16 huge = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.f), _CMP_NLE_UQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 y = _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(kExpUpMargin));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  const __m512 bend = _mm512_fmadd_ps(f, _mm512_set1_ps(kExpUpBend), _mm512_set1_ps(1.f - kExpUpBend));
  const __m512 p = _mm512_fmadd_ps(f, bend, _mm512_set1_ps(1.f));
  return _mm512_mask_mov_ps(_mm512_scalef_ps(p, n), huge, _mm512_set1_ps(INFINITY));
}

// n values src[i·stride] into 16-lane vectors (lanes past n are 0, masked by the caller).
inline __m512 gather16(const float* src, int64_t stride, int64_t n) {
  if (stride * 15 > INT32_MAX) {
    alignas(64) float tmp[16] = {};
    for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) tmp[i] = src[i * stride];
    return _mm512_load_ps(tmp);
  }
  // a hardware gather: 16 scalar stores read back as one vector stalled on store forwarding
  const __m512i idx = _mm512_mullo_epi32(_mm512_set1_epi32(static_cast<int32_t>(stride)),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __mmask16 valid = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, idx, src, 4);
}

// Largest of n scores src[i·stride] (−inf if n = 0; NaN if any is NaN, as torch's amax).
inline float strided_max(const float* src, int64_t stride, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t nb = std::min<int64_t>(16, n - i);
    const __mmask16 valid = nb == 16 ? __mmask16(0xFFFF) : __mmask16((1u << nb) - 1);
    const __m512 x = gather16(src + i * stride, stride, nb);
    nan |= _mm512_mask_cmp_ps_mask(valid, x, x, _CMP_UNORD_Q);
    m = _mm512_mask_max_ps(m, valid, m, x);
  }
  return nan ? NAN : _mm512_reduce_max_ps(m);
}

// A lower bound of Σ_i e^{σ(s_i − r)} over n scores s_i = src[i·stride] (kMassDown applied).
inline double mass_lower(const float* src, int64_t stride, int64_t n, float sigma, float r) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t nb = std::min<int64_t>(16, n - i);
    const __m512 x = _mm512_mul_ps(_mm512_set1_ps(sigma), _mm512_sub_ps(gather16(src + i * stride, stride, nb), _mm512_set1_ps(r)));
    sum += double(exp_sum_low16(x, nb == 16 ? __mmask16(0xFFFF) : __mmask16((1u << nb) - 1)));
  }
  return sum * kMassDown;
}

#endif

#if defined(LOUVER_AVX2)
// All-ones in lane i where bit i of ``bits`` is set (bits above 7 ignored).
inline __m256 lane_mask8(uint32_t bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int32_t>(bits)), sel), sel));
}

// Lane t of the result is the sum of the 8 lanes of v[t].
inline __m256 lane_sums8_ps(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// exp_ps16 for 8 floats, with the same operations and results: scalef's single rounding of p·2^k
// is reproduced by two power-of-two factors 2^⌊k/2⌋ and 2^(k − ⌊k/2⌋), both normal for k in
// [−150, 127], of which the first product is exact.
inline __m256 exp_ps8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-104.f), x));  // NaN propagates
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  constexpr float inv_fact[8] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};
  __m256 p = _mm256_set1_ps(inv_fact[7]);
  for (int i = 6; i >= 0; --i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(inv_fact[i]));
  const __m256i ki = _mm256_cvtps_epi32(k);  // NaN lanes: any factor, p is NaN
  const __m256i k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

// exp_up16 for 8 lanes: 2^n·p from p's bits plus n in the exponent field.
inline __m256 exp_up8(__m256 x) {
  const __m256 huge = _mm256_cmp_ps(x, _mm256_set1_ps(88.f), _CMP_NLE_UQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 y = _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(kExpUpMargin));
  const __m256 n = _mm256_floor_ps(y);
  const __m256 f = _mm256_sub_ps(y, n);
  const __m256 bend = _mm256_fmadd_ps(f, _mm256_set1_ps(kExpUpBend), _mm256_set1_ps(1.f - kExpUpBend));
  const __m256 p = _mm256_fmadd_ps(f, bend, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  return _mm256_blendv_ps(_mm256_castsi256_ps(e), _mm256_set1_ps(INFINITY), huge);
}

// exp_sum_low16 / exp_sum_high16 for 8 lanes (``valid``: the lanes counted, bit i for lane i).
inline float exp_sum_low8(__m256 x, uint32_t valid) {
  const uint32_t counted = valid & static_cast<uint32_t>(
                                       _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ)));
  alignas(32) float e[8];
  _mm256_store_ps(e, exp_ps8(_mm256_min_ps(x, _mm256_set1_ps(80.f))));
  float sum = 0.f;
  for (uint32_t m = counted; m; m &= m - 1) sum += e[__builtin_ctz(m)];
  return sum;
}

inline float exp_sum_high8(__m256 x, uint32_t valid) {
  const __m256 huge = _mm256_cmp_ps(x, _mm256_set1_ps(88.f), _CMP_NLE_UQ);
  alignas(32) float e[8];
  _mm256_store_ps(e, _mm256_blendv_ps(exp_ps8(_mm256_max_ps(x, _mm256_set1_ps(-87.f))), _mm256_set1_ps(INFINITY), huge));
  float sum = 0.f;
  for (uint32_t m = valid; m; m &= m - 1) sum += e[__builtin_ctz(m)];
  return sum;
}

// n values src[i·stride] into 8-lane vectors (lanes past n are 0, masked by the caller).
inline __m256 gather8(const float* src, int64_t stride, int64_t n) {
  alignas(32) float tmp[8] = {};
  for (int64_t i = 0; i < std::min<int64_t>(n, 8); ++i) tmp[i] = src[i * stride];
  return _mm256_load_ps(tmp);
}

// mass_lower (below) for 8-lane builds.
inline double mass_lower(const float* src, int64_t stride, int64_t n, float sigma, float r) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t nb = std::min<int64_t>(8, n - i);
    const __m256 x = _mm256_mul_ps(_mm256_set1_ps(sigma), _mm256_sub_ps(gather8(src + i * stride, stride, nb), _mm256_set1_ps(r)));
    sum += double(exp_sum_low8(x, (1u << nb) - 1));
  }
  return sum * kMassDown;
}
#endif

inline void prefetch_bytes(const void* start, int64_t n) {
  const char* p = static_cast<const char*>(start);
  for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// The same into L2 only: for the next page's codes, a page of work ahead. Into L1 they competed
// with the current page's candidate rows for the few L1 miss buffers (5-8 % slower cold steps).
inline void prefetch_bytes_l2(const void* start, int64_t n) {
  const char* p = static_cast<const char*>(start);
  for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(p + b, 0, 1);
}

// [start, end) of each request's rows in a request-sorted row list req [n] -> bounds [B + 1].
inline std::vector<int64_t> request_bounds(const int64_t* req, int64_t n, int64_t B) {
  std::vector<int64_t> bounds(B + 1, n);
  int64_t r = 0;
  for (int64_t i = 0; i <= n; ++i) {
    const int64_t cur = i < n ? req[i] : B;
    while (r <= cur && r <= B) bounds[r++] = i;
  }
  return bounds;
}

#if defined(__AVX512F__)
// acc [G, DV] += Σ_i weight(j, i)·row(i) over n rows of KV type (DV a multiple of 64): the sums of
// up to 4 heads × 64 channels stay in 16 registers over all rows, instead of a load and store per
// row and head. skip_zero: a zero weight adds nothing (not even 0·inf). Rows are fetched ``ahead``
// rows early.
template <typename KV, typename Row, typename Weight>
inline void accumulate_rows(const Row& row, const Weight& weight, int64_t n, int64_t G, int64_t DV, float* acc,
                            bool skip_zero, int64_t ahead) {
  const int64_t row_bytes = DV * static_cast<int64_t>(sizeof(KV));
  for (int64_t i = 0; i < std::min(n, ahead); ++i) prefetch_bytes(row(i), row_bytes);
  for (int64_t g0 = 0; g0 < G; g0 += 4)
    for (int64_t d0 = 0; d0 < DV; d0 += 64) {
      const int64_t ng = std::min<int64_t>(4, G - g0);
      const bool first_pass = g0 == 0 && d0 == 0;
      __m512 r[4][4];
      for (int64_t j = 0; j < ng; ++j)
        for (int c = 0; c < 4; ++c) r[j][c] = _mm512_loadu_ps(acc + (g0 + j) * DV + d0 + 16 * c);
      for (int64_t i = 0; i < n; ++i) {
        if (first_pass && i + ahead < n) prefetch_bytes(row(i + ahead), row_bytes);
        const KV* v = row(i) + d0;
        const __m512 x[4] = {load16_ps(v), load16_ps(v + 16), load16_ps(v + 32), load16_ps(v + 48)};
        for (int64_t j = 0; j < ng; ++j) {
          const float e = weight(g0 + j, i);
          const __mmask16 on = !skip_zero || e != 0.f ? __mmask16(0xFFFF) : __mmask16(0);
          const __m512 ev = _mm512_set1_ps(e);
          for (int c = 0; c < 4; ++c) r[j][c] = _mm512_mask3_fmadd_ps(ev, x[c], r[j][c], on);
        }
      }
      for (int64_t j = 0; j < ng; ++j)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + (g0 + j) * DV + d0 + 16 * c, r[j][c]);
    }
}
#endif

#if defined(LOUVER_AVX2)
// accumulate_rows with 8 lanes (DV a multiple of 32): the sums of up to 3 heads × 32 channels stay
// in 12 registers over all rows.
template <typename KV, typename Row, typename Weight>
inline void accumulate_rows(const Row& row, const Weight& weight, int64_t n, int64_t G, int64_t DV, float* acc,
                            bool skip_zero, int64_t ahead) {
  const int64_t row_bytes = DV * static_cast<int64_t>(sizeof(KV));
  for (int64_t i = 0; i < std::min(n, ahead); ++i) prefetch_bytes(row(i), row_bytes);
  for (int64_t g0 = 0; g0 < G; g0 += 3)
    for (int64_t d0 = 0; d0 < DV; d0 += 32) {
      const int64_t ng = std::min<int64_t>(3, G - g0);
      const bool first_pass = g0 == 0 && d0 == 0;
      __m256 r[3][4];
      for (int64_t j = 0; j < ng; ++j)
        for (int c = 0; c < 4; ++c) r[j][c] = _mm256_loadu_ps(acc + (g0 + j) * DV + d0 + 8 * c);
      for (int64_t i = 0; i < n; ++i) {
        if (first_pass && i + ahead < n) prefetch_bytes(row(i + ahead), row_bytes);
        const KV* v = row(i) + d0;
        const __m256 x[4] = {load8_ps(v), load8_ps(v + 8), load8_ps(v + 16), load8_ps(v + 24)};
        for (int64_t j = 0; j < ng; ++j) {
          const float e = weight(g0 + j, i);
          if (skip_zero && e == 0.f) continue;
          const __m256 ev = _mm256_set1_ps(e);
          for (int c = 0; c < 4; ++c) r[j][c] = _mm256_fmadd_ps(ev, x[c], r[j][c]);
        }
      }
      for (int64_t j = 0; j < ng; ++j)
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + (g0 + j) * DV + d0 + 8 * c, r[j][c]);
    }
}
#endif

}  // namespace louver_cpu
