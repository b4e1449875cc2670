// Fused CPU kernels of the Louver decode step for the grid bound family.
//
// grid_bounds: page and token upper bounds of a batch of pages straight from the queries (page
//   terms, then unpack b-bit codes + G dot products in one pass over the packed codes; the torch
//   reference materialises float codes instead). Certified steps need all of them to choose T.
// grid_sparse_attend: for every (request, KV head, chunk of pages): page bounds, token bounds,
//   candidate gate (page and token bound >= T for any head of the GQA group), exact scores from the
//   candidate's key, value gate, online softmax with V read only for attended rows, and the
//   dropped-mass accounting. Partial softmax states per chunk are merged by the caller (split-K),
//   so both cores stay busy even at batch 1.
// Both kernels only read caller-owned inputs and write caller-owned outputs.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <functional>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Convert n values of the KV dtype to fp32 (16 at a time with AVX-512 where it applies).
template <typename T>
inline void load_f32(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void load_f32(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }

inline void load_f32(const c10::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
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

// Unpack one token's packed codes [bytes] into floats [dim].
inline void unpack_row(const uint8_t* src, int bits, int dim, float* dst) {
  if (bits == 8) {
    for (int d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
  } else if (bits == 4) {
    for (int j = 0; j < dim / 2; ++j) {
      dst[2 * j] = static_cast<float>(src[j] & 0xF);
      dst[2 * j + 1] = static_cast<float>(src[j] >> 4);
    }
  } else {  // 2 bits
    for (int j = 0; j < dim / 4; ++j) {
      const uint8_t b = src[j];
      dst[4 * j] = static_cast<float>(b & 3);
      dst[4 * j + 1] = static_cast<float>((b >> 2) & 3);
      dst[4 * j + 2] = static_cast<float>((b >> 4) & 3);
      dst[4 * j + 3] = static_cast<float>(b >> 6);
    }
  }
}

inline float dot(const float* a, const float* b, int n) {
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

// Query terms of one page and KV head, for its G query heads (see louver_sgl/index/grid.py):
// token bound = off[g] + Σ_d w[g][d]·code_d; page bound pb[g]; both include the fp32 slack
// (same formula as numerics.dot_slack with num_terms = 2·D + 2). lo/sc/rad are fp32 rows [D].
inline void page_terms(const float* qk, const float* lo, const float* sc, const float* rad, int64_t G,
                       int64_t D, int64_t bits, float* w, float* off, float* pb) {
  const float levels = static_cast<float>(1 << bits);
  const float terms = static_cast<float>(2 * D + 2 + 8);
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
    const float slack = mag * (2.f * terms * 5.9604645e-08f) + terms * std::ldexp(1.0f, -130);
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

// Integer form of one head's token weights: w_d ≈ step·wq_d with wq_d int8, so that
// Σ_d w_d·c_d <= step·Σ_d wq_d·c_d + err for every code vector c in [0, 2^bits − 1]^D.
// The integer dot product is exact (|Σ| < 2^24), the fp32 product step·acc is covered by err's
// relative term, and a NaN/Inf weight makes err NaN (the token is then kept).
inline float quantize_weights(const float* w, int64_t D, int64_t bits, int8_t* wq, float* step) {
  float top = 0.f;
#pragma omp simd reduction(max : top)
  for (int64_t d = 0; d < D; ++d) top = std::max(top, std::fabs(w[d]));
  if (!std::isfinite(top)) {
    std::fill(wq, wq + D, 0);
    *step = 0.f;
    return NAN;
  }
  const float s = top > 0.f ? top / 127.f : 1.f;
  const float inv = 1.f / s;
  const float levels = static_cast<float>((1 << bits) - 1);
  float err = 0.f, mag = 0.f;
  int64_t d = 0;
#if defined(__AVX512F__)
  // 16 channels at a time (the scalar loop below does not vectorise: nearbyint and the int8 cast)
  const __m512 vs = _mm512_set1_ps(s), vinv = _mm512_set1_ps(inv), lim = _mm512_set1_ps(127.f);
  __m512 verr = _mm512_setzero_ps(), vmag = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    const __m512 x = _mm512_loadu_ps(w + d);
    __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(x, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim), _mm512_min_ps(lim, r));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(wq + d), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
    const __m512 sr = _mm512_mul_ps(vs, r);
    verr = _mm512_add_ps(verr, _mm512_abs_ps(_mm512_sub_ps(x, sr)));
    vmag = _mm512_add_ps(vmag, _mm512_abs_ps(sr));
  }
  err = _mm512_reduce_add_ps(verr);
  mag = _mm512_reduce_add_ps(vmag);
#endif
  for (; d < D; ++d) {
    const float r = std::max(-127.f, std::min(127.f, std::nearbyint(w[d] * inv)));
    wq[d] = static_cast<int8_t>(r);
    err += std::fabs(w[d] - s * r);
    mag += std::fabs(s * r);
  }
  *step = s;
  // (1 + 2^-16) and the 2^-20 relative term cover fp32 rounding of err (summed in any order),
  // of s·wq and of step·acc.
  return levels * (err * (1.f + 1.52587890625e-05f) + mag * 9.5367431640625e-07f) + std::ldexp(1.0f, -126);
}

#if defined(__AVX512F__)
constexpr bool kHaveAvx512 = true;
#else
constexpr bool kHaveAvx512 = false;
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
      const int8_t* wb = w + g * D + blk * 64;
      for (int j = 0; j < 16; ++j) {
        int32_t quad;
        std::memcpy(&quad, wb + 4 * j, sizeof(quad));
        out[g] = _mm512_dpbusd_epi32(out[g], col[j], _mm512_set1_epi32(quad));
      }
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
// weights), code_floats16 uses block 32 (fp32 weights).
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

inline int32_t dot_u8s8(const uint8_t* c, const int8_t* w, int64_t D) {
  int32_t acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < D; ++d) acc += static_cast<int32_t>(c[d]) * static_cast<int32_t>(w[d]);
  return acc;
}

// Unpack the codes of P consecutive slots [P, H_kv, bytes] (KV head k) into bytes [P, D].
inline void unpack_page(const uint8_t* src, int64_t h_kv, int64_t k, int64_t bytes, int64_t bits,
                        int64_t P, int64_t D, uint8_t* dst) {
  for (int64_t p = 0; p < P; ++p) {
    const uint8_t* in = src + (p * h_kv + k) * bytes;
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

}  // namespace

#if defined(__AVX512F__)
namespace {

// Lane t of the result is the sum of the 16 lanes of v[t] (fp32 version of lane_sums16).
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

// e^x for 8 doubles with relative error below 1e-15: k = round(x/ln2), r = x − k·ln2 (Cody-Waite
// with FMA, |r| <= 0.35), Taylor polynomial to r^13 (truncation < 1e-17), times 2^k. x is clamped
// to [−700, 700]; NaN gives e^700 (an upper bound, as rel_mass does).
inline __m512d exp_pd8(__m512d x) {
  x = _mm512_max_pd(_mm512_min_pd(x, _mm512_set1_pd(700.0)), _mm512_set1_pd(-700.0));  // NaN -> 700
  const __m512d k = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(1.4426950408889634)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512d r = _mm512_fnmadd_pd(k, _mm512_set1_pd(6.93147180369123816490e-01), x);
  r = _mm512_fnmadd_pd(k, _mm512_set1_pd(1.90821492927058770002e-10), r);
  constexpr double inv_fact[14] = {1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040,
                                   1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800,
                                   1.0 / 479001600, 1.0 / 6227020800};
  __m512d p = _mm512_set1_pd(inv_fact[13]);
  for (int i = 12; i >= 0; --i) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(inv_fact[i]));
  return _mm512_scalef_pd(p, k);
}

// e^x for 16 floats, for softmax weights (no bound depends on it): a few ulp; x below −104 gives
// 0, NaN stays NaN. Cephes' two-part ln2, Taylor polynomial to r^7 (truncation < 2^-24).
inline __m512 exp_ps16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));  // NaN propagates
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  constexpr float inv_fact[8] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};
  __m512 p = _mm512_set1_ps(inv_fact[7]);
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(inv_fact[i]));
  return _mm512_scalef_ps(p, k);
}

// Codes of one token as fp32, 16 channels (group j of the nibble_order) at a time.
inline __m512 code_floats16(const uint8_t* packed, int64_t bits, int64_t j) {
  if (bits == 8)
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + 16 * j))));
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + 16 * (j / 2)));
  const __m128i nib = j % 2 ? _mm_srli_epi16(x, 4) : x;
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(nib, _mm_set1_epi8(0x0F))));
}

// fp32 token bounds off[g] + Σ_d w_g[d]·c_t[d] of 16 consecutive tokens (rows ``stride`` bytes apart
// from ``first``); dst[t·dst_stride + g]. codes16 [16, D] is scratch. The summation order differs
// from the per-token loop; the slack in off covers fp32 rounding of the sum in any order.
inline void bounds_block16(const uint8_t* first, int64_t stride, int64_t bits, int64_t D, const float* wr,
                           const float* off, int64_t G, float* codes16, float* dst, int64_t dst_stride) {
  for (int t = 0; t < 16; ++t)
    for (int64_t j = 0; j < D / 16; ++j) _mm512_storeu_ps(codes16 + t * D + 16 * j, code_floats16(first + t * stride, bits, j));
  __m512 v[16];
  alignas(64) float sums[16];
  for (int64_t g = 0; g < G; ++g) {
    for (int t = 0; t < 16; ++t) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < D / 16; ++j)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(codes16 + t * D + 16 * j), _mm512_loadu_ps(wr + g * D + 16 * j), acc);
      v[t] = acc;
    }
    _mm512_store_ps(sums, lane_sums16_ps(v));
    for (int t = 0; t < 16; ++t) dst[t * dst_stride + g] = off[g] + sums[t];
  }
}

}  // namespace
#endif

// Page and token upper bounds of a batch of pages, straight from the queries.
// q [B, H_q, D] f32; page_ids, page_req [n] i64; lo/scale/radius [pages, H_kv, D] (KV dtype);
// codes [slots, H_kv, bytes] u8 -> tok [n, P, H_kv, G] f32, pb [n, H_kv, G] f32.
void grid_bounds(torch::Tensor q, torch::Tensor page_ids, torch::Tensor page_req, torch::Tensor lo,
                 torch::Tensor scale, torch::Tensor radius, torch::Tensor codes, int64_t bits,
                 int64_t page_size, torch::Tensor tok, torch::Tensor pb) {
  const int64_t n = page_ids.size(0), h_kv = lo.size(1), D = lo.size(2);
  const int64_t h_q = q.size(1), G = h_q / h_kv, bytes = codes.size(2);
  const float* qp = q.data_ptr<float>();
  const int64_t* pid = page_ids.data_ptr<int64_t>();
  const int64_t* preq = page_req.data_ptr<int64_t>();
  const uint8_t* c = codes.data_ptr<uint8_t>();
  float* tp = tok.data_ptr<float>();
  float* pbp = pb.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lo.scalar_type(), "grid_bounds", [&] {
    const scalar_t* lp = lo.data_ptr<scalar_t>();
    const scalar_t* sp = scale.data_ptr<scalar_t>();
    const scalar_t* rp = radius.data_ptr<scalar_t>();
    at::parallel_for(0, n * h_kv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> row(D), w(G * D), wr(G * D), off(G), book(3 * D), codes16(16 * D);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / h_kv, k = task % h_kv, meta = (pid[i] * h_kv + k) * D;
        load_codebook(lp + meta, sp + meta, rp + meta, D, book.data());
        page_terms(qp + (preq[i] * h_q + k * G) * D, book.data(), book.data() + D, book.data() + 2 * D,
                   G, D, bits, w.data(), off.data(), pbp + (i * h_kv + k) * G);
        int64_t p = 0;
#if defined(__AVX512F__)
        if (bits == 8 || bits == 4) {
          for (int64_t g = 0; g < G; ++g) nibble_order(w.data() + g * D, bits, D, 32, wr.data() + g * D);
          for (; p + 16 <= page_size; p += 16)
            bounds_block16(c + ((pid[i] * page_size + p) * h_kv + k) * bytes, h_kv * bytes, bits, D, wr.data(),
                           off.data(), G, codes16.data(), tp + ((i * page_size + p) * h_kv + k) * G, h_kv * G);
        }
#endif
        for (; p < page_size; ++p) {
          const int64_t slot = pid[i] * page_size + p;
          unpack_row(c + (slot * h_kv + k) * bytes, static_cast<int>(bits), static_cast<int>(D), row.data());
          float* dst = tp + ((i * page_size + p) * h_kv + k) * G;
          for (int64_t g = 0; g < G; ++g) dst[g] = off[g] + dot(row.data(), w.data() + g * D, static_cast<int>(D));
        }
      }
    });
  });
}

namespace {

inline void prefetch_bytes(const void* start, int64_t n) {
  const char* p = static_cast<const char*>(start);
  for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(p + b, 0, 3);
}

struct AttendArgs {
  const float* q;          // [B, H_q, D]
  const uint8_t* codes;    // [slots, H_kv, bytes]
  const int64_t* page_ids; // [NP] grouped by request
  const int64_t* chunk_req;    // [NC] request of each chunk
  const int64_t* chunk_begin;  // [NC] first page row
  const int64_t* chunk_end;    // [NC] one past the last page row
  const float* t;          // [B, H_q] threshold for page and token bounds
  const float* t_gate;     // [B, H_q] value gate threshold (-inf: attend every candidate)
  const float* ref;        // [B, H_q] reference score of the mass accounting
  float sigma;
  int64_t h_q, h_kv, groups, dim, dim_v, bytes, page_size, bits;
};

// Accounting per head, relative to exp(σ·(s − ref)) in fp64: mass[0] index-dropped keys (skipped
// pages count P·e^{σ(pb − ref)}, kept pages their tokens below T), mass[1] value-gated candidates
// (exact score below the gate threshold; an upper bound), mass[2] every union candidate (a lower
// bound: it only enlarges the softmax denominator's lower bound).
struct HeadState {
  float m = -INFINITY, l = 0.f;
  int64_t attended = 0, skipped = 0;
  double mass[3] = {0.0, 0.0, 0.0};
};

inline double rel_mass(float sigma, float x, float ref) {
  return std::exp(std::min(700.0, double(sigma) * (double(x) - double(ref))));
}

// Relative safety of masses summed from exp_pd8 (error < 1e-15 per term).
constexpr double kMassUp = 1.0 + 0x1p-40, kMassDown = 1.0 - 0x1p-40;

template <typename KV>
struct ChunkRunner {
  const AttendArgs& a;
  const KV *kc, *vc, *lo, *sc, *rad;
  int64_t b, k, head0;
  bool open = false, vector_scores;
  std::vector<float> buf, acc, w, off, pb, step, drop_max, book, rows16, score, weight;
  std::vector<int8_t> wq, wsplit;
  std::vector<int32_t> idot;
  std::vector<uint8_t> page_codes;
  std::vector<uint16_t> attend_bits, need_bits;  // per 16-candidate block: [G][blocks], [blocks]
  std::vector<int64_t> drop_count, cand_slot;
  std::vector<char> keep_page;
  std::vector<HeadState> st;
  int64_t n_cand = 0, n_union = 0, n_values = 0, n_pages_read = 0;

  ChunkRunner(const AttendArgs& args, const KV* kc_, const KV* vc_, const KV* lo_, const KV* sc_,
              const KV* rad_, int64_t chunk, int64_t kv_head)
      : a(args), kc(kc_), vc(vc_), lo(lo_), sc(sc_), rad(rad_), b(args.chunk_req[chunk]), k(kv_head),
        head0(args.chunk_req[chunk] * args.h_q + kv_head * args.groups),
        vector_scores(kHaveAvx512 && args.dim % 16 == 0 && args.dim_v % 16 == 0),
        buf(std::max(args.dim, args.dim_v)), acc(args.groups * args.dim_v, 0.f), w(args.groups * args.dim),
        off(args.groups), pb(args.groups), step(args.groups), drop_max(args.groups), book(3 * args.dim),
        rows16(16 * args.dim), score(args.groups * padded(args.page_size)),
        weight(args.groups * padded(args.page_size)), wq(args.groups * args.dim), wsplit(args.groups * args.dim),
        idot(args.groups), page_codes(args.page_size * args.dim),
        attend_bits(args.groups * padded(args.page_size) / 16), need_bits(padded(args.page_size) / 16),
        drop_count(args.groups), cand_slot(args.page_size), keep_page(args.groups), st(args.groups) {}

  static int64_t padded(int64_t n) { return (n + 15) / 16 * 16; }

  // Page bounds of page row i; if some head of the group keeps the page, its token weights are
  // quantised and the page is open for scanning. Returns whether it is open.
  bool open_page(int64_t i) {
    const int64_t G = a.groups, D = a.dim, meta = (a.page_ids[i] * a.h_kv + k) * D;
    load_codebook(lo + meta, sc + meta, rad + meta, D, book.data());
    page_terms(a.q + head0 * D, book.data(), book.data() + D, book.data() + 2 * D, G, D, a.bits, w.data(),
               off.data(), pb.data());
    open = false;
    for (int64_t g = 0; g < G; ++g) {
      keep_page[g] = !(pb[g] < a.t[head0 + g]);  // NaN keeps
      if (!keep_page[g]) {
        st[g].skipped += 1;
        st[g].mass[0] += double(a.page_size) * rel_mass(a.sigma, pb[g], a.ref[head0 + g]);
      }
      open |= keep_page[g];
    }
    if (!open) return false;
    ++n_pages_read;
    n_cand = 0;
    for (int64_t g = 0; g < G; ++g) {
      if (keep_page[g]) off[g] += quantize_weights(w.data() + g * D, D, a.bits, wq.data() + g * D, &step[g]);
      drop_count[g] = 0;
      drop_max[g] = -INFINITY;
    }
    if (vnni_scan()) {
      for (int64_t g = 0; g < G; ++g) nibble_order(wq.data() + g * D, a.bits, D, 64, wsplit.data() + g * D);
    }
    return true;
  }

  bool vnni_scan() const { return kHaveVnni && a.dim % 64 == 0 && (a.bits == 4 || a.bits == 8) && a.groups <= 8; }

  // Token bounds of the open page's tokens p .. p+15 (int8 weights against byte codes, VNNI), then
  // the candidate gate. Dropped tokens are accounted per head by count and largest bound:
  // n·e^{σ(max u − ref)} bounds their mass with one exp per page.
  void scan_block16(int64_t first, int64_t p) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const int64_t G = a.groups, stride = a.h_kv * a.bytes;
    __m512i dots[8];
    dot_block16_vnni(a.codes + ((first + p) * a.h_kv + k) * a.bytes, stride, a.bits, a.dim, wsplit.data(), G, dots);
    uint32_t cand = 0;
    for (int64_t g = 0; g < G; ++g) {
      if (!keep_page[g]) continue;
      // off + step·acc with the same fp32 operations (and rounding) as the per-token loop
      const __m512 ub = _mm512_add_ps(_mm512_set1_ps(off[g]),
                                      _mm512_mul_ps(_mm512_set1_ps(step[g]), _mm512_cvtepi32_ps(dots[g])));
      const __mmask16 drop = _mm512_cmp_ps_mask(ub, _mm512_set1_ps(a.t[head0 + g]), _CMP_LT_OQ);  // NaN keeps
      if (drop) {
        drop_count[g] += __builtin_popcount(static_cast<uint32_t>(drop));
        drop_max[g] = std::max(drop_max[g], _mm512_mask_reduce_max_ps(drop, ub));
      }
      cand |= static_cast<uint32_t>(static_cast<uint16_t>(~drop));
    }
    for (; cand; cand &= cand - 1) add_candidate(first + p + __builtin_ctz(cand));
#else
    (void)first;
    (void)p;
#endif
  }

  // The same bounds and gate for tokens p .. P−1, one token at a time (pages not a multiple of 16,
  // or no VNNI / a D that is not a multiple of 64).
  void scan_tokens(int64_t first, int64_t p) {
    const int64_t G = a.groups, D = a.dim, P = a.page_size;
    const bool vnni = vnni_scan();
    if (!vnni && p < P)
      unpack_page(a.codes + first * a.h_kv * a.bytes, a.h_kv, k, a.bytes, a.bits, P, D, page_codes.data());
    for (; p < P; ++p) {
      if (vnni) {
        dot_token_vnni(a.codes + ((first + p) * a.h_kv + k) * a.bytes, a.bits, D, wsplit.data(), G, idot.data());
      } else {
        for (int64_t g = 0; g < G; ++g) idot[g] = dot_u8s8(page_codes.data() + p * D, wq.data() + g * D, D);
      }
      bool cand = false;
      for (int64_t g = 0; g < G; ++g) {
        if (!keep_page[g]) continue;
        const float ub = off[g] + step[g] * static_cast<float>(idot[g]);
        if (ub < a.t[head0 + g]) {
          ++drop_count[g];
          drop_max[g] = std::max(drop_max[g], ub);
        } else {
          cand = true;  // NaN keeps
        }
      }
      if (cand) add_candidate(first + p);
    }
  }

  // Candidates are gathered first and their K rows prefetched, so that the random row reads
  // overlap instead of stalling one by one.
  void add_candidate(int64_t slot) {
    cand_slot[n_cand++] = slot;
    prefetch_row(kc + (slot * a.h_kv + k) * a.dim, a.dim);
  }

  static void prefetch_row(const KV* row, int64_t n) { prefetch_bytes(row, n * static_cast<int64_t>(sizeof(KV))); }

  // After the scan of an open page: dropped-mass accounting, exact scores of the candidates
  // (keys first), the value gate, then V only for the rows some head attends.
  void finish_page() {
    const int64_t G = a.groups;
    for (int64_t g = 0; g < G; ++g)
      if (drop_count[g]) st[g].mass[0] += double(drop_count[g]) * rel_mass(a.sigma, drop_max[g], a.ref[head0 + g]);
    if (n_cand == 0) return;
    n_union += n_cand;
    if (vector_scores) {
      score_candidates16();
    } else {
      score_candidates();
    }
    attend_candidates();
  }

  // Exact scores of the candidates [G, n_cand] in ``score``, attend/need flags and the masses
  // of the candidates (per token; the reference for the vector version below).
  void score_candidates() {
    const int64_t G = a.groups, D = a.dim, P16 = padded(a.page_size);
    std::fill(attend_bits.begin(), attend_bits.end(), 0);
    std::fill(need_bits.begin(), need_bits.end(), 0);
    for (int64_t c = 0; c < n_cand; ++c) {
      load_f32(kc + (cand_slot[c] * a.h_kv + k) * D, D, buf.data());
      for (int64_t g = 0; g < G; ++g) {
        const float s = dot(buf.data(), a.q + (head0 + g) * D, static_cast<int>(D));
        score[g * P16 + c] = s;
        const double e = rel_mass(a.sigma, s, a.ref[head0 + g]);
        const bool attend = !(s < a.t_gate[head0 + g]);
        st[g].mass[2] += e;
        if (!attend) st[g].mass[1] += e;
        if (attend) {
          attend_bits[g * (P16 / 16) + c / 16] |= uint16_t(1u << (c % 16));
          need_bits[c / 16] |= uint16_t(1u << (c % 16));
        }
      }
    }
  }

  // score_candidates for 16 candidates at a time: K rows to fp32 scratch, G·16 FMA rows reduced
  // by the transposing add tree, masses with the 8-lane fp64 exp (bounded by kMassUp/kMassDown).
  void score_candidates16() {
#if defined(__AVX512F__)
    const int64_t G = a.groups, D = a.dim, P16 = padded(a.page_size);
    for (int64_t c0 = 0; c0 < n_cand; c0 += 16) {
      const int64_t nb = std::min<int64_t>(16, n_cand - c0);
      const __mmask16 valid = nb == 16 ? __mmask16(0xFFFF) : __mmask16((1u << nb) - 1);
      for (int64_t t = 0; t < nb; ++t) load_f32(kc + (cand_slot[c0 + t] * a.h_kv + k) * D, D, rows16.data() + t * D);
      uint16_t need = 0;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = a.q + (head0 + g) * D;
        __m512 v[16];
        for (int64_t t = 0; t < 16; ++t) {
          __m512 sum = _mm512_setzero_ps();
          if (t < nb)
            for (int64_t j = 0; j < D; j += 16)
              sum = _mm512_fmadd_ps(_mm512_loadu_ps(rows16.data() + t * D + j), _mm512_loadu_ps(qg + j), sum);
          v[t] = sum;
        }
        const __m512 s = lane_sums16_ps(v);
        _mm512_storeu_ps(score.data() + g * P16 + c0, s);
        const __mmask16 attend = valid & ~_mm512_cmp_ps_mask(s, _mm512_set1_ps(a.t_gate[head0 + g]), _CMP_LT_OQ);
        attend_bits[g * (P16 / 16) + c0 / 16] = attend;
        need |= attend;
        add_masses(s, valid, attend, st[g], a.ref[head0 + g]);
      }
      need_bits[c0 / 16] = need;
      for (uint32_t bits = need; bits; bits &= bits - 1)
        prefetch_row(vc + (cand_slot[c0 + __builtin_ctz(bits)] * a.h_kv + k) * a.dim_v, a.dim_v);
    }
#endif
  }

#if defined(__AVX512F__)
  // mass[2] += Σ e^{σ(s − ref)} over valid lanes (rounded down; lanes below e^-700 and NaN count
  // 0), mass[1] += the same over valid lanes not attended (rounded up; exponents clamp at −700).
  void add_masses(__m512 s, __mmask16 valid, __mmask16 attend, HeadState& h, float ref) const {
    const __m512d sig = _mm512_set1_pd(a.sigma), r = _mm512_set1_pd(ref), floor = _mm512_set1_pd(-700.0);
    const __m512d halves[2] = {_mm512_cvtps_pd(_mm512_castps512_ps256(s)),
                               _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)))};
    double all = 0.0, gated = 0.0;
    for (int half = 0; half < 2; ++half) {
      const __m512d x = _mm512_mul_pd(sig, _mm512_sub_pd(halves[half], r));
      const __m512d e = exp_pd8(x);
      const __mmask8 ok = static_cast<__mmask8>(valid >> (8 * half)) & _mm512_cmp_pd_mask(x, floor, _CMP_GE_OQ);
      const __mmask8 drop = static_cast<__mmask8>((valid & ~attend) >> (8 * half));
      all += _mm512_mask_reduce_add_pd(ok, e);
      gated += _mm512_mask_reduce_add_pd(drop, e);
    }
    h.mass[2] += all * kMassDown;
    h.mass[1] += gated * kMassUp;
  }
#endif

  // Online softmax over the page's attended candidates: one rescale per head and page to the
  // page's largest score, then each needed V row is read once for all heads of the group.
  void attend_candidates() {
    const int64_t G = a.groups, DV = a.dim_v, P16 = padded(a.page_size), blocks = (n_cand + 15) / 16;
    for (int64_t g = 0; g < G; ++g) {
      HeadState& h = st[g];
      const float* sg = score.data() + g * P16;
      const uint16_t* ab = attend_bits.data() + g * (P16 / 16);
      float top = -INFINITY;
      int64_t count = 0;
      for (int64_t c = 0; c < n_cand; ++c)
        if (ab[c / 16] >> (c % 16) & 1) {
          ++count;
          top = std::max(top, a.sigma * sg[c]);  // NaN scores do not move the maximum
        }
      float* wg = weight.data() + g * P16;
      if (count == 0) {
        std::fill(wg, wg + n_cand, 0.f);
        continue;
      }
      h.attended += count;
      if (top > h.m) {  // rescale the running sum to the new maximum
        const float scale = std::exp(h.m - top);
        h.l *= scale;
        float* ag = acc.data() + g * DV;
        for (int64_t d = 0; d < DV; ++d) ag[d] *= scale;
        h.m = top;
      }
      page_weights(sg, ab, blocks, h, wg);
    }
    for (int64_t c = 0; c < n_cand; ++c) {
      if (!(need_bits[c / 16] >> (c % 16) & 1)) continue;
      ++n_values;
      load_f32(vc + (cand_slot[c] * a.h_kv + k) * DV, DV, buf.data());
      for (int64_t g = 0; g < G; ++g) {
        const float e = weight[g * P16 + c];
        if (e != 0.f) axpy(acc.data() + g * DV, e, buf.data(), DV);
      }
    }
  }

  // Softmax weights e^{σ·s − m} of one head's candidates (0 where not attended) into wg; adds
  // them to h.l.
  void page_weights(const float* sg, const uint16_t* ab, int64_t blocks, HeadState& h, float* wg) const {
#if defined(__AVX512F__)
    if (vector_scores) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(a.sigma), _mm512_loadu_ps(sg + 16 * blk)),
                                       _mm512_set1_ps(h.m));
        const __m512 e = _mm512_maskz_mov_ps(ab[blk], exp_ps16(x));
        _mm512_storeu_ps(wg + 16 * blk, e);
        sum = _mm512_add_ps(sum, e);
      }
      h.l += _mm512_reduce_add_ps(sum);
      return;
    }
#endif
    for (int64_t c = 0; c < blocks * 16; ++c) {
      const bool on = c < n_cand && (ab[c / 16] >> (c % 16) & 1);
      wg[c] = on ? std::exp(a.sigma * sg[c] - h.m) : 0.f;
      h.l += wg[c];
    }
  }

  void write(float* m_out, float* l_out, float* o_out, int64_t* counts, double* mass_out) const {
    const int64_t G = a.groups, DV = a.dim_v;
    for (int64_t g = 0; g < G; ++g) {
      m_out[g] = st[g].m;
      l_out[g] = st[g].l;
      for (int64_t d = 0; d < DV; ++d) o_out[g * DV + d] = acc[g * DV + d];
      counts[g] = st[g].attended;
      counts[G + g] = st[g].skipped;
      for (int j = 0; j < 3; ++j) mass_out[g * 3 + j] = st[g].mass[j];
    }
    counts[2 * G] = n_union;
    counts[2 * G + 1] = n_values;
    counts[2 * G + 2] = n_pages_read;
  }
};

// One chunk of pages for all KV heads. A page's codes for all heads are one contiguous block
// [P, H_kv, bytes]; the scan walks it in 16-token blocks with every open head per block, so the
// block streams from memory once and in order, while the same block of the next page is
// prefetched.
template <typename KV>
void run_chunk(std::vector<ChunkRunner<KV>>& runners, const AttendArgs& a, int64_t c) {
  const int64_t P = a.page_size, page_block = P * a.h_kv * a.bytes, block16 = 16 * a.h_kv * a.bytes;
  const bool vnni = runners[0].vnni_scan();
  for (int64_t i = a.chunk_begin[c]; i < a.chunk_end[c]; ++i) {
    const uint8_t* next = i + 1 < a.chunk_end[c] ? a.codes + a.page_ids[i + 1] * page_block : nullptr;
    bool any = false;
    for (auto& r : runners) any |= r.open_page(i);
    if (!any) continue;
    const int64_t first = a.page_ids[i] * P;
    int64_t p = 0;
    if (vnni) {
      for (; p + 16 <= P; p += 16) {
        if (next) prefetch_bytes(next + p / 16 * block16, block16);
        for (auto& r : runners)
          if (r.open) r.scan_block16(first, p);
      }
    } else if (next) {
      prefetch_bytes(next, page_block);
    }
    for (auto& r : runners)
      if (r.open) {
        r.scan_tokens(first, p);
        r.finish_page();
      }
  }
}

}  // namespace

// Outputs per (chunk, KV head): m, l [NC, H_kv, G] f32 (m in σ·score units), o [NC, H_kv, G, D_v]
// f32 (unnormalised), counts [NC, H_kv, 2G + 3] i64 (attended per head, pages skipped per head,
// union candidates, values read, pages read), mass [NC, H_kv, G, 3] f64 (see HeadState).
void grid_sparse_attend(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor lo, torch::Tensor scale, torch::Tensor radius,
                        torch::Tensor codes, torch::Tensor page_ids, torch::Tensor chunk_req,
                        torch::Tensor chunk_begin, torch::Tensor chunk_end, torch::Tensor t,
                        torch::Tensor t_gate, torch::Tensor ref, double sigma, int64_t bits,
                        int64_t page_size, torch::Tensor m_out, torch::Tensor l_out,
                        torch::Tensor o_out, torch::Tensor counts, torch::Tensor mass) {
  TORCH_CHECK(lo.scalar_type() == k_cache.scalar_type(), "index codebooks must use the KV dtype");
  AttendArgs a{q.data_ptr<float>(), codes.data_ptr<uint8_t>(), page_ids.data_ptr<int64_t>(),
               chunk_req.data_ptr<int64_t>(), chunk_begin.data_ptr<int64_t>(),
               chunk_end.data_ptr<int64_t>(), t.data_ptr<float>(), t_gate.data_ptr<float>(),
               ref.data_ptr<float>(), static_cast<float>(sigma), q.size(1), k_cache.size(1),
               q.size(1) / k_cache.size(1), q.size(2), v_cache.size(2), codes.size(2), page_size, bits};
  const int64_t n_chunks = chunk_req.size(0), G = a.groups;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "grid_sparse_attend", [&] {
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const scalar_t* lp = lo.data_ptr<scalar_t>();
    const scalar_t* sp = scale.data_ptr<scalar_t>();
    const scalar_t* rp = radius.data_ptr<scalar_t>();
    // Tasks are taken from a shared counter, not split statically: their costs differ (the
    // candidate count varies along the context), and a static split left one core idle for a
    // large part of a batch-1 step.
    std::atomic<int64_t> next{0};
    at::parallel_for(0, n_chunks, 1, [&](int64_t, int64_t) {
      for (int64_t c = next++; c < n_chunks; c = next++) {
        std::vector<ChunkRunner<scalar_t>> runners;
        runners.reserve(a.h_kv);
        for (int64_t k = 0; k < a.h_kv; ++k) runners.emplace_back(a, kc, vc, lp, sp, rp, c, k);
        run_chunk(runners, a, c);
        for (int64_t k = 0; k < a.h_kv; ++k) {
          const int64_t task = c * a.h_kv + k, base = task * G;
          runners[k].write(m_out.data_ptr<float>() + base, l_out.data_ptr<float>() + base,
                           o_out.data_ptr<float>() + base * a.dim_v,
                           counts.data_ptr<int64_t>() + task * (2 * G + 3), mass.data_ptr<double>() + base * 3);
        }
      }
    });
  });
}

// ----- certified threshold: histogram over the fixed levels, and the exact recount ----------------
// Levels (louver_sgl/decode/threshold.py): edge j = kEdgeLow + kEdgeStep·j, j < kEdgeCount, in units
// of σ·(T − ref). A unit's bin is the number of edges <= its x = σ·(bound − ref) (NaN: past the end).
constexpr double kEdgeLow = -48.0, kEdgeStep = 0.25;
constexpr int64_t kEdgeCount = 257;

inline int64_t edge_bin(double x) {
  if (std::isnan(x)) return kEdgeCount;
  if (x < kEdgeLow) return 0;
  const double j = std::floor((x - kEdgeLow) / kEdgeStep);
  return j >= kEdgeCount - 1 ? kEdgeCount : static_cast<int64_t>(j) + 1;
}

// Page slices per head for the certified passes: enough (head, slice) tasks for every thread to
// get several, so that one head with more work does not leave a core idle.
inline int64_t page_slices(int64_t n_pages, int64_t heads) {
  const int64_t want = (4 * at::get_num_threads() + heads - 1) / heads;
  return std::max<int64_t>(1, std::min<int64_t>(n_pages, want));
}

// Upper bound of e^x: glibc's expf is within 1 ulp, so scaling by (1 + 2^-21) rounds up.
inline double exp_up(double x) {
  if (x > 80.0) return std::exp(std::min(x, 700.0)) * (1.0 + 1e-12);
  return static_cast<double>(std::exp(static_cast<float>(x))) * (1.0 + 4.76837158203125e-07);
}

// hist [B, H_q, kEdgeCount + 2] f64 (zeroed by the caller): pages add P·e^{x_page} at their bin,
// tokens e^{x_tok} over [bin_tok, bin_page) as a +/- pair (see filter._certified_mass).
// tok [NP, P, H_q], pb [NP, H_q] f32; page_req [NP] i64; ref [B, H_q] f32.
void certified_hist(torch::Tensor tok, torch::Tensor pb, torch::Tensor page_req, torch::Tensor ref,
                    double sigma, torch::Tensor hist) {
  const int64_t n = tok.size(0), P = tok.size(1), H = tok.size(2), W = kEdgeCount + 2;
  const float* tp = tok.data_ptr<float>();
  const float* pp = pb.data_ptr<float>();
  const int64_t* req = page_req.data_ptr<int64_t>();
  const float* rp = ref.data_ptr<float>();
  const int64_t rows = hist.size(0) * H, S = page_slices(n, H);
  std::vector<double> part(S * rows * W, 0.0);  // one histogram per page slice, summed below
  at::parallel_for(0, H * S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % H, slice = task / H;
      for (int64_t i = slice * n / S; i < (slice + 1) * n / S; ++i) {
        const double r = rp[req[i] * H + h];
        const float page = pp[i * H + h];
        const double xp = sigma * (double(page) - r);
        const int64_t bp = edge_bin(xp);
        double* row = part.data() + (slice * rows + req[i] * H + h) * W;
        if (!std::isnan(xp)) row[bp] += double(P) * exp_up(xp);
        for (int64_t p = 0; p < P; ++p) {
          const float u = std::min(tp[(i * P + p) * H + h], page);  // NaN page keeps NaN
          const double xu = sigma * (double(u) - r);
          const int64_t bu = edge_bin(xu);
          if (bu >= bp) continue;
          const double e = exp_up(xu);
          row[bu] += e;
          row[bp] -= e;
        }
      }
    }
  });
  double* hp = hist.data_ptr<double>();
  for (int64_t slice = 0; slice < S; ++slice)
    for (int64_t j = 0; j < rows * W; ++j) hp[j] += part[slice * rows * W + j];
}

// Mass dropped at thresholds t [B, H_q]: pages with pb < t (P·e^{x}), and in the other pages the
// tokens with min(tok, pb) < t (e^{x}); NaN bounds are kept. -> out [B, H_q] f64 (zeroed by caller).
void certified_dropped(torch::Tensor tok, torch::Tensor pb, torch::Tensor page_req, torch::Tensor ref,
                       torch::Tensor t, double sigma, torch::Tensor out) {
  const int64_t n = tok.size(0), P = tok.size(1), H = tok.size(2);
  const float* tp = tok.data_ptr<float>();
  const float* pp = pb.data_ptr<float>();
  const int64_t* req = page_req.data_ptr<int64_t>();
  const float* rp = ref.data_ptr<float>();
  const float* thr = t.data_ptr<float>();
  const int64_t rows = out.numel(), S = page_slices(n, H);
  std::vector<double> part(S * rows, 0.0);
  at::parallel_for(0, H * S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % H, slice = task / H;
      for (int64_t i = slice * n / S; i < (slice + 1) * n / S; ++i) {
        const int64_t rh = req[i] * H + h;
        const float page = pp[i * H + h];
        const double r = rp[rh];
        double& acc = part[slice * rows + rh];
        if (page < thr[rh]) {
          acc += double(P) * exp_up(sigma * (double(page) - r));
          continue;
        }
        for (int64_t p = 0; p < P; ++p) {
          const float u = std::min(tp[(i * P + p) * H + h], page);
          if (u < thr[rh]) acc += exp_up(sigma * (double(u) - r));
        }
      }
    }
  });
  double* op = out.data_ptr<double>();
  for (int64_t slice = 0; slice < S; ++slice)
    for (int64_t j = 0; j < rows; ++j) op[j] += part[slice * rows + j];
}

// ----- exact part and merge: the torch steps around the attend kernel, fused for small batches ------

namespace {

// [start, end) of each request's rows in a request-sorted row list req [n] -> bounds [B + 1].
std::vector<int64_t> request_bounds(const int64_t* req, int64_t n, int64_t B) {
  std::vector<int64_t> bounds(B + 1, n);
  int64_t r = 0;
  for (int64_t i = 0; i <= n; ++i) {
    const int64_t cur = i < n ? req[i] : B;
    while (r <= cur && r <= B) bounds[r++] = i;
  }
  return bounds;
}

// The budget rule on one head's n sample scores (``stride`` floats apart): the ⌊f·n⌋-th largest
// (at least the largest), -inf without samples. NaN ranks above every number, as in torch.topk.
inline float budget_pick(const float* scores, int64_t stride, int64_t n, double fraction, float* scratch) {
  if (n == 0) return -INFINITY;
  const int64_t k = std::min<int64_t>(n, std::max<int64_t>(1, static_cast<int64_t>(std::floor(double(n) * fraction))));
  int64_t m = 0, nans = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float x = scores[j * stride];
    if (std::isnan(x)) {
      ++nans;
    } else {
      scratch[m++] = x;
    }
  }
  if (k <= nans) return NAN;
  std::nth_element(scratch, scratch + (k - 1 - nans), scratch + m, std::greater<float>());
  return scratch[k - 1 - nans];
}

inline float* scratch_for(std::vector<float>& scratch, int64_t n) {
  if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(n);
  return scratch.data();
}

}  // namespace

// Exact scores of the dense part and of the sample, the reference score and the masses relative
// to it (design §4; louver_sgl/decode/step.py:exact_part is the specification).
// q [B, H_q, D] f32; k_cache [slots, H_kv, D]; dense_slots, dense_req [ND], sample_slots, sample_req
// [NS] i64, request-sorted -> s_dense [ND, H_q] f32, sample [B, M, H_q] f32 (each request's sample
// scores in order, padded with -inf; M >= its largest sample), ref [B, H_q] f32 (-inf: no exact
// score), z [B, H_q, 2] f64 (Σ e^{σ(s − ref)} over the dense part, over the sample). With a budget
// fraction f >= 0 it also writes the budget policy's T [B, H_q] f32 (threshold.budget_threshold is
// the specification); with f < 0, t is not touched.
void exact_part(torch::Tensor q, torch::Tensor k_cache, torch::Tensor dense_slots, torch::Tensor dense_req,
                torch::Tensor sample_slots, torch::Tensor sample_req, double sigma, double budget,
                torch::Tensor s_dense, torch::Tensor sample, torch::Tensor ref, torch::Tensor z, torch::Tensor t) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), h_kv = k_cache.size(1), G = H / h_kv;
  const int64_t nd = dense_slots.size(0), ns = sample_slots.size(0), M = sample.size(1);
  const float* qp = q.data_ptr<float>();
  const int64_t *ds = dense_slots.data_ptr<int64_t>(), *dr = dense_req.data_ptr<int64_t>();
  const int64_t *ss = sample_slots.data_ptr<int64_t>(), *sr = sample_req.data_ptr<int64_t>();
  float* sd = s_dense.data_ptr<float>();
  float* sp = sample.data_ptr<float>();
  float* rp = ref.data_ptr<float>();
  double* zp = z.data_ptr<double>();
  float* tp = budget >= 0.0 ? t.data_ptr<float>() : nullptr;
  const std::vector<int64_t> d_bounds = request_bounds(dr, nd, B), s_bounds = request_bounds(sr, ns, B);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(s_bounds[b + 1] - s_bounds[b] <= M, "sample buffer narrower than a request's sample");
  std::fill(sp, sp + B * M * H, -INFINITY);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "exact_part", [&] {
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    // rows 0..nd-1: dense part; nd..nd+ns-1: sample (written at its padded position)
    at::parallel_for(0, nd + ns, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> key(D);
      for (int64_t row = begin; row < end; ++row) {
        const bool dense = row < nd;
        const int64_t i = dense ? row : row - nd, slot = dense ? ds[i] : ss[i], b = dense ? dr[i] : sr[i];
        float* dst = dense ? sd + i * H : sp + (b * M + (i - s_bounds[b])) * H;
        for (int64_t k = 0; k < h_kv; ++k) {
          load_f32(kc + (slot * h_kv + k) * D, D, key.data());
          for (int64_t g = 0; g < G; ++g)
            dst[k * G + g] = dot(key.data(), qp + (b * H + k * G + g) * D, static_cast<int>(D));
        }
      }
    });
  });
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float top = -INFINITY;  // NaN propagates, as in torch's amax
      auto take = [&top](float x) { top = (x > top || std::isnan(x)) && !std::isnan(top) ? x : top; };
      for (int64_t i = d_bounds[b]; i < d_bounds[b + 1]; ++i) take(sd[i * H + h]);
      for (int64_t j = 0; j < s_bounds[b + 1] - s_bounds[b]; ++j) take(sp[(b * M + j) * H + h]);
      rp[bh] = top;
      double zd = 0.0, zs = 0.0;
      const double r = top;
      for (int64_t i = d_bounds[b]; i < d_bounds[b + 1]; ++i) zd += std::exp(sigma * (double(sd[i * H + h]) - r));
      for (int64_t j = 0; j < s_bounds[b + 1] - s_bounds[b]; ++j)
        zs += std::exp(sigma * (double(sp[(b * M + j) * H + h]) - r));
      zp[bh * 2] = zd;
      zp[bh * 2 + 1] = zs;
      if (budget >= 0.0)
        tp[bh] = budget_pick(sp + b * M * H + h, H, s_bounds[b + 1] - s_bounds[b], budget, scratch_for(scratch, M));
    }
  });
}

// Softmax merge of the dense part with the attend kernel's chunk states (step.py:_merge is the
// specification). s_dense [ND, H_q] f32; dense_slots, dense_req [ND] i64; v_cache [slots, H_kv, Dv];
// m, l [NC, H_q] f32 (m in σ·score units; −inf: empty chunk); o [NC, H_q, Dv] f32; chunk_req [NC]
// i64 (both row lists request-sorted) -> out [B, H_q, Dv] f32.
void merge_chunks(torch::Tensor s_dense, torch::Tensor dense_slots, torch::Tensor dense_req, torch::Tensor v_cache,
                  torch::Tensor m, torch::Tensor l, torch::Tensor o, torch::Tensor chunk_req, double sigma,
                  torch::Tensor out) {
  const int64_t B = out.size(0), H = out.size(1), DV = out.size(2), h_kv = v_cache.size(1), G = H / h_kv;
  const int64_t nd = dense_slots.size(0), nc = chunk_req.size(0);
  const float *sd = s_dense.data_ptr<float>(), *mp = m.data_ptr<float>(), *lp = l.data_ptr<float>();
  const float* op = o.data_ptr<float>();
  const int64_t *ds = dense_slots.data_ptr<int64_t>(), *dr = dense_req.data_ptr<int64_t>();
  const std::vector<int64_t> d_bounds = request_bounds(dr, nd, B),
                             c_bounds = request_bounds(chunk_req.data_ptr<int64_t>(), nc, B);
  float* outp = out.data_ptr<float>();
  const float sig = static_cast<float>(sigma);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v_cache.scalar_type(), "merge_chunks", [&] {
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, B * h_kv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> val(DV), num(G * DV), top(G), den(G);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / h_kv, k = task % h_kv, h0 = b * H + k * G;
        for (int64_t g = 0; g < G; ++g) {
          float t = -INFINITY;
          for (int64_t i = d_bounds[b]; i < d_bounds[b + 1]; ++i) t = std::max(t, sig * sd[i * H + k * G + g]);
          for (int64_t c = c_bounds[b]; c < c_bounds[b + 1]; ++c) t = std::max(t, mp[c * H + k * G + g]);
          top[g] = std::isfinite(t) ? t : 0.f;
          den[g] = 0.f;
        }
        std::fill(num.begin(), num.end(), 0.f);
        for (int64_t i = d_bounds[b]; i < d_bounds[b + 1]; ++i) {
          load_f32(vc + (ds[i] * h_kv + k) * DV, DV, val.data());
          for (int64_t g = 0; g < G; ++g) {
            const float w = std::exp(sig * sd[i * H + k * G + g] - top[g]);
            den[g] += w;
            axpy(num.data() + g * DV, w, val.data(), DV);
          }
        }
        for (int64_t c = c_bounds[b]; c < c_bounds[b + 1]; ++c)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t row = c * H + k * G + g;
            const float scale = std::exp(mp[row] - top[g]);  // 0 for an empty chunk (m = −inf)
            if (scale == 0.f) continue;
            den[g] += lp[row] * scale;
            axpy(num.data() + g * DV, scale, op + row * DV, DV);
          }
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < DV; ++d) outp[(h0 + g) * DV + d] = num[g * DV + d] / den[g];
      }
    });
  });
}

// Per-request totals of the attend kernel's chunk outputs (fused.chunk_totals_reference is the
// specification). counts [NC, H_kv, 2G + 3] i64, mass [NC, H_kv, G, 3] f64, chunk_req [NC] i64 ->
// per_head [B, H_q, 2] i64 (attended, pages skipped), per_req [B, 3] i64 (union candidates, values
// read, pages read), masses [B, H_q, 3] f64; all outputs are overwritten.
void chunk_totals(torch::Tensor counts, torch::Tensor mass, torch::Tensor chunk_req, torch::Tensor per_head,
                  torch::Tensor per_req, torch::Tensor masses) {
  const int64_t nc = counts.size(0), h_kv = counts.size(1), G = mass.size(2), H = h_kv * G;
  const int64_t* cp = counts.data_ptr<int64_t>();
  const double* mp = mass.data_ptr<double>();
  const int64_t* req = chunk_req.data_ptr<int64_t>();
  int64_t* ph = per_head.data_ptr<int64_t>();
  int64_t* pr = per_req.data_ptr<int64_t>();
  double* ms = masses.data_ptr<double>();
  std::fill(ph, ph + per_head.numel(), 0);
  std::fill(pr, pr + per_req.numel(), 0);
  std::fill(ms, ms + masses.numel(), 0.0);
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t b = req[c];
    for (int64_t k = 0; k < h_kv; ++k) {
      const int64_t* row = cp + (c * h_kv + k) * (2 * G + 3);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = b * H + k * G + g;
        ph[h * 2] += row[g];
        ph[h * 2 + 1] += row[G + g];
        for (int j = 0; j < 3; ++j) ms[h * 3 + j] += mp[((c * h_kv + k) * G + g) * 3 + j];
      }
      pr[b * 3] += row[2 * G];
      pr[b * 3 + 1] += row[2 * G + 1];
    }
    pr[b * 3 + 2] += cp[c * h_kv * (2 * G + 3) + 2 * G + 2];
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grid_bounds", &grid_bounds, "Louver grid page and token upper bounds (CPU)");
  m.def("grid_sparse_attend", &grid_sparse_attend, "Louver grid filter + sparse attention (CPU)");
  m.def("certified_hist", &certified_hist, "Louver certified-threshold histogram (CPU)");
  m.def("certified_dropped", &certified_dropped, "Louver certified dropped-mass recount (CPU)");
  m.def("exact_part", &exact_part, "Louver exact scores of the dense part and sample, ref and masses (CPU)");
  m.def("chunk_totals", &chunk_totals, "Louver per-request totals of the attend kernel's chunk outputs (CPU)");
  m.def("merge_chunks", &merge_chunks, "Louver merge of the dense part with the attend kernel's chunks (CPU)");
}
