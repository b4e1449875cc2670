// The certified histogram's scan of one page and KV head: its int8 token bounds (exactly as the
// attend pass builds them, ChunkRunner::open_page) binned into the histogram of the mass dropped
// at each threshold edge. Shared by the two-pass rule's bound pass (bounds.cpp) and the one-scan
// pass (scan_pass.cpp), which also keeps every token reaching a reserve level for the attend pass.
#pragma once

#include "common.h"

namespace louver_cpu {

// Levels: the Edges of the call (named.h). A unit's bin is the number of edges <= its
// x = σ·(bound − ref) (NaN: past the end).

// Upper bound of e^x (x at most 700, as the specification clamps; at least −700: no underflow):
// glibc's exp is within 1 ulp, so scaling by (1 + 2^-50) rounds up. (An fp32 exp of x rounded to
// fp32 errs by up to |x|·2^-24: not an upper bound.)
inline double exp_up(double x) { return std::exp(std::clamp(x, -700.0, 700.0)) * (1.0 + 0x1p-50); }

// The histogram of one (request, query head), in three parts so that the absolute terms need no
// second scatter: tokens' masses at their bins (all positive), pages' P·e^{x_page} and the sums of
// their counted tokens' masses, both at the page's bin. hist = tok + page − covered, and the
// absolute terms = tok + page + covered, with tok and covered scaled by kMassUp (exp_ps16's
// masses become upper bounds; exp_up's stay ones).
struct HistRows {
  double* tok;
  double* page;
  double* covered;
};

// The one-scan pass's reserve of one (chunk, KV head) (AttendArgs::reserve_slot and its
// neighbours: the same layout, read by the attend pass's band mode): slot [E] i64, pos [E] i64
// (page row · P + offset), bound [E, G] f32, n its entries so far.
struct ReserveRegion {
  int64_t* slot = nullptr;
  int64_t* pos = nullptr;
  float* bound = nullptr;
  int64_t n = 0;
};

// One page and KV head: the int8 token weights of its G query heads, exactly as the attend pass
// builds them (ChunkRunner::open_page), then every token's bound into the histograms.
//
// With reserve levels (set_levels; the one-scan pass), per head g a level L_g = the fp32 T of
// edge j_g: a token whose bound is below L_g lies below edge j_g, so where it sits below that edge
// changes no cumulative sum from edge j_g up, and its mass is added at bin j_g (one vector sum per
// block instead of a scatter per token); a head whose page bound is below L_g counts the page
// alone (its tokens' terms cancel from the page's bin up). Tokens whose bound reaches L_g for
// some head go to the reserve with their bounds. The histogram is then exact from edge j_g up, so
// a T chosen there is the two-pass rule's T; below it the caller runs the two passes.
struct PageScan {
  int64_t G, D, bits, P;
  double sigma;
  Edges edges;
  bool residual;  // residual int8 weights (AttendArgs::residual): heads G.. of the weights
  std::vector<float> book, w, off, pb, step, step2, resid, mag;
  std::vector<int8_t> wq, wsplit, wsplit8;  // [G2, D], G2 = dot_heads()
  std::vector<uint8_t> page_codes;
  std::vector<int64_t> page_bin;
  std::vector<int32_t> idot;  // per-token integer dots; members: scan runs per page and KV head
  std::vector<double> sums;   // per head, the page's counted token masses
  // reserve levels (empty: the two-pass bound pass) and their bins [G]; per head whether the page
  // bound reaches the level, the masses below it, and the block's bounds [G, 16]
  std::vector<float> level;
  std::vector<int64_t> level_bin;
  std::vector<char> reach;
  std::vector<double> below;
  std::vector<float> block_ub;

  PageScan(int64_t G_, int64_t D_, int64_t bits_, int64_t P_, double sigma_, const Edges& edges_, bool residual_)
      : G(G_), D(D_), bits(bits_), P(P_), sigma(sigma_), edges(edges_), residual(residual_ && 2 * G_ <= 8),
        book(3 * D_), w(G_ * D_), off(G_), pb(G_), step(G_), step2(G_), resid(D_), mag(G_), wq(2 * G_ * D_),
        wsplit(2 * G_ * D_), wsplit8(2 * G_ * D_), page_codes(P_ * D_), page_bin(G_), idot(2 * G_),
        sums(G_), reach(G_, 1), below(G_, 0.0), block_ub(16 * G_) {}

  // Weight rows the integer dots run over: G, or 2·G with residual weights.
  int64_t dot_heads() const { return residual ? 2 * G : G; }

  bool vnni() const { return kHaveVnni && D % 64 == 0 && (bits == 4 || bits == 8) && G <= 8; }

  // The attend pass's 8-lane scan (ChunkRunner::avx2_scan) applies: AVX2 builds, block16 codes of
  // 4 bits, or of 8 without VNNI.
  bool avx2_blocks(const Codes& codes) const { return avx2_block_scan(codes, bits, D, G); }

  // Reserve levels of the next pages' heads: level [G] f32 (−inf: every token), bins [G].
  void set_levels(const float* lv, const int64_t* bins) {
    level.assign(lv, lv + G);
    level_bin.assign(bins, bins + G);
  }

  // Page terms of the page (and its magnitudes in mag, the slack of its exact scores).
  template <typename M>
  void terms(const float* q, const M* lo, const M* sc, const M* rad) {
    load_codebook(lo, sc, rad, D, book.data());
    page_terms(q, book.data(), book.data() + D, book.data() + 2 * D, G, D, bits, w.data(), off.data(), pb.data(),
               mag.data());
  }

  // Whether some head's page bound reaches its reserve level (NaN reaches); per head in reach.
  bool reaches() {
    bool any = false;
    for (int64_t g = 0; g < G; ++g) {
      reach[g] = level.empty() || !(pb[g] < level[g]);
      any |= reach[g];
    }
    return any;
  }

  // The int8 token weights of the page terms' heads (and their residuals).
  void weights() {
    for (int64_t g = 0; g < G; ++g)
      off[g] += residual ? quantize_weights_residual(w.data() + g * D, D, bits, wq.data() + g * D,
                                                     wq.data() + (G + g) * D, &step[g], &step2[g], resid.data())
                         : quantize_weights(w.data() + g * D, D, bits, wq.data() + g * D, &step[g]);
    nibble_weights();
  }

  // The int8 weights in the orders the dot kernels read (nibble_order_int8).
  void nibble_weights() {
    for (int64_t g = 0; g < dot_heads(); ++g) {
      if (vnni()) nibble_order_int8(wq.data() + g * D, bits, D, 64, wsplit.data() + g * D);
      if ((vnni() || kHaveAvx2) && bits == 4) nibble_order_int8(wq.data() + g * D, bits, D, 8, wsplit8.data() + g * D);
    }
  }

  // terms and weights (in one pass where page_setup serves: the same values bit for bit).
  template <typename M>
  void open(const float* q, const M* lo, const M* sc, const M* rad) {
    if (residual || !page_setup_fits(D, bits)) {
      terms(q, lo, sc, rad);
      return weights();
    }
    page_setup(q, lo, sc, rad, G, D, bits, off.data(), pb.data(), mag.data(), wq.data(), step.data());
    nibble_weights();
  }

  // Page masses at their bins.
  void add_pages(const float* ref, const HistRows* rows) {
    for (int64_t g = 0; g < G; ++g) {
      const double x = sigma * (double(pb[g]) - double(ref[g]));
      page_bin[g] = edges.bin(x);
      if (!std::isnan(x)) rows[g].page[page_bin[g]] += double(P) * exp_up(x);
    }
  }

  // The reserve level of head g (−inf without levels).
  float level_of(int64_t g) const { return level.empty() ? -INFINITY : level[g]; }

#if defined(__AVX512F__)
  // add_token for 16 tokens: bins from fp64 x as Edges::bin, masses from exp_ps16 (x above 80:
  // exp_up; the merge scales every token mass by kMassUp), scattered one counted lane at a time;
  // lanes below the reserve level summed into below[g] instead. Returns the lanes' bounds min(ub,
  // pb) (NaN if either is).
  __m512 add_tokens16(int64_t g, __m512 ub, double ref, const HistRows& row) {
    const __mmask16 nan = _mm512_cmp_ps_mask(ub, ub, _CMP_UNORD_Q);
    const __m512 u = _mm512_mask_mov_ps(_mm512_min_ps(ub, _mm512_set1_ps(pb[g])), nan, ub);  // NaN if either is
    const __m512d s = _mm512_set1_pd(sigma), r = _mm512_set1_pd(ref), low = _mm512_set1_pd(edges.low);
    alignas(64) double x[16], mass[16];
    alignas(64) int32_t bin[16];
    __m256i bins[2];
    __m256 xs[2];
    for (int h = 0; h < 2; ++h) {
      const __m256 uh = h ? _mm512_extractf32x8_ps(u, 1) : _mm512_castps512_ps256(u);
      const __m512d xd = _mm512_mul_pd(s, _mm512_sub_pd(_mm512_cvtps_pd(uh), r));
      _mm512_store_pd(x + 8 * h, xd);
      const __m512d j = _mm512_add_pd(
          _mm512_roundscale_pd(_mm512_mul_pd(_mm512_sub_pd(xd, low), _mm512_set1_pd(1.0 / edges.step)),
                               _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
          _mm512_set1_pd(1.0));
      const __m512d clamped = _mm512_min_pd(_mm512_max_pd(j, _mm512_setzero_pd()), _mm512_set1_pd(double(edges.count)));
      const __mmask8 ord = _mm512_cmp_pd_mask(xd, xd, _CMP_ORD_Q);
      bins[h] = _mm512_cvtpd_epi32(_mm512_mask_mov_pd(_mm512_set1_pd(double(edges.count)), ord, clamped));
      xs[h] = _mm512_cvtpd_ps(xd);
    }
    const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(bins[0]), bins[1], 1);
    const __m512i page = _mm512_set1_epi32(static_cast<int32_t>(page_bin[g]));
    const __mmask16 counted = _mm512_cmp_epi32_mask(b, page, _MM_CMPINT_LT);
    if (!counted) return u;
    const __m512 x32 = _mm512_insertf32x8(_mm512_castps256_ps512(xs[0]), xs[1], 1);
    const __m512 e = exp_ps16(_mm512_max_ps(x32, _mm512_set1_ps(-87.f)));
    _mm512_store_pd(mass, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    _mm512_store_pd(mass + 8, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
    _mm512_store_si512(bin, b);
    for (uint32_t big = _mm512_cmp_ps_mask(x32, _mm512_set1_ps(80.f), _CMP_GT_OQ) & counted; big; big &= big - 1)
      mass[__builtin_ctz(big)] = exp_up(x[__builtin_ctz(big)]);
    const __mmask16 under = counted & _mm512_cmp_ps_mask(u, _mm512_set1_ps(level_of(g)), _CMP_LT_OQ);
    double* tok = row.tok;  // a local: through ``row`` each add waited on the last store
    for (uint32_t m = counted & ~under; m; m &= m - 1) tok[bin[__builtin_ctz(m)]] += mass[__builtin_ctz(m)];
    if (under)
      below[g] += _mm512_mask_reduce_add_pd(static_cast<__mmask8>(under), _mm512_load_pd(mass)) +
                  _mm512_mask_reduce_add_pd(static_cast<__mmask8>(under >> 8), _mm512_load_pd(mass + 8));
    sums[g] += _mm512_mask_reduce_add_pd(static_cast<__mmask8>(counted), _mm512_load_pd(mass)) +
               _mm512_mask_reduce_add_pd(static_cast<__mmask8>(counted >> 8), _mm512_load_pd(mass + 8));
    return u;
  }
#endif

#if defined(LOUVER_AVX2)
  // add_tokens16 for 8 tokens (AVX2 builds): bins from fp64 x as Edges::bin, masses from exp_ps8
  // (exp_ps16's results; x above 80: exp_up), scattered one counted lane at a time, lanes below
  // the reserve level into below[g]. Returns min(ub, pb) as add_tokens16.
  __m256 add_tokens8(int64_t g, __m256 ub, double ref, const HistRows& row) {
    const __m256 nan = _mm256_cmp_ps(ub, ub, _CMP_UNORD_Q);
    const __m256 u = _mm256_blendv_ps(_mm256_min_ps(ub, _mm256_set1_ps(pb[g])), ub, nan);  // NaN if either is
    const __m256d s = _mm256_set1_pd(sigma), r = _mm256_set1_pd(ref), low = _mm256_set1_pd(edges.low);
    alignas(32) double x[8], mass[8];
    alignas(32) int32_t bin[8];
    __m128i bins[2];
    __m128 xs[2];
    for (int h = 0; h < 2; ++h) {
      const __m128 uh = h ? _mm256_extractf128_ps(u, 1) : _mm256_castps256_ps128(u);
      const __m256d xd = _mm256_mul_pd(s, _mm256_sub_pd(_mm256_cvtps_pd(uh), r));
      _mm256_store_pd(x + 4 * h, xd);
      const __m256d j = _mm256_add_pd(_mm256_floor_pd(_mm256_mul_pd(_mm256_sub_pd(xd, low), _mm256_set1_pd(1.0 / edges.step))),
                                      _mm256_set1_pd(1.0));
      const __m256d clamped = _mm256_min_pd(_mm256_max_pd(j, _mm256_setzero_pd()), _mm256_set1_pd(double(edges.count)));
      const __m256d ord = _mm256_cmp_pd(xd, xd, _CMP_ORD_Q);
      bins[h] = _mm256_cvtpd_epi32(_mm256_blendv_pd(_mm256_set1_pd(double(edges.count)), clamped, ord));
      xs[h] = _mm256_cvtpd_ps(xd);
    }
    const __m256i b = _mm256_set_m128i(bins[1], bins[0]);
    const __m256i page = _mm256_set1_epi32(static_cast<int32_t>(page_bin[g]));
    const uint32_t counted = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(page, b))));
    if (!counted) return u;
    const __m256 x32 = _mm256_set_m128(xs[1], xs[0]);
    const __m256 e = exp_ps8(_mm256_max_ps(x32, _mm256_set1_ps(-87.f)));
    _mm256_store_pd(mass, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    _mm256_store_pd(mass + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(bin), b);
    const uint32_t big = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x32, _mm256_set1_ps(80.f), _CMP_GT_OQ)));
    for (uint32_t m = big & counted; m; m &= m - 1) mass[__builtin_ctz(m)] = exp_up(x[__builtin_ctz(m)]);
    const uint32_t under = counted &
        static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(u, _mm256_set1_ps(level_of(g)), _CMP_LT_OQ)));
    double* tok = row.tok;  // a local: through ``row`` each add waited on the last store
    double total = 0.0, under_sum = 0.0;
    for (uint32_t m = counted; m; m &= m - 1) {
      const int lane = __builtin_ctz(m);
      if (under >> lane & 1) under_sum += mass[lane];
      else tok[bin[lane]] += mass[lane];
      total += mass[lane];
    }
    below[g] += under_sum;
    sums[g] += total;
    return u;
  }
#endif

  // Token p of the page with bound ub for head g: counted at its bin when below the page's bin
  // (below its reserve level: into below[g]). Returns min(ub, pb) (NaN if either is).
  float add_token(int64_t g, float ub, double ref, const HistRows& row) {
    const float u = (std::isnan(ub) || std::isnan(pb[g])) ? NAN : std::min(ub, pb[g]);
    const double x = sigma * (double(u) - ref);
    const int64_t bin = edges.bin(x);
    if (bin >= page_bin[g]) return u;  // NaN: past the last edge, never below the page
    const double e = exp_up(x);
    if (u < level_of(g)) below[g] += e;
    else row.tok[bin] += e;
    sums[g] += e;
    return u;
  }

  // The page's tokens (its first slot ``first`` in ``codes``; token bounds also into tok_out when
  // given, [P, ...] rows ``tok_stride`` floats apart, G heads each). With reserve levels, heads
  // whose page bound is below theirs count no tokens, the tokens reaching some head's level go to
  // ``res`` (page row ``row``), and each head's masses below its level join its level's bin.
  void scan(const Codes& codes, int64_t first, int64_t k, const float* ref, const HistRows* rows, float* tok_out,
            int64_t tok_stride, ReserveRegion* res = nullptr, int64_t row = 0) {
    std::fill(sums.begin(), sums.end(), 0.0);
    std::fill(below.begin(), below.end(), 0.0);
    int64_t p = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (vnni() && P % 16 == 0) {
      alignas(64) float ub[16];
      __m512i dots[8];
      for (; p + 16 <= P; p += 16) {
        dot_block16(codes, first + p, k, bits, D, wsplit.data(), wsplit8.data(), dot_heads(), dots);
        uint32_t keep = 0;
        for (int64_t g = 0; g < G; ++g) {
          if (!reach[g]) continue;
          const __m512 bound = residual ? token_bounds16_2(off[g], step[g], step2[g], dots[g], dots[G + g])
                                        : token_bounds16(off[g], step[g], dots[g]);
          const __m512 u = add_tokens16(g, bound, ref[g], rows[g]);
          if (res) {
            keep |= static_cast<uint16_t>(~_mm512_cmp_ps_mask(u, _mm512_set1_ps(level[g]), _CMP_LT_OQ));  // NaN keeps
            _mm512_storeu_ps(block_ub.data() + 16 * g, u);
          }
          if (tok_out) {
            _mm512_store_ps(ub, bound);
            for (int t = 0; t < 16; ++t) tok_out[(p + t) * tok_stride + g] = ub[t];
          }
        }
        if (keep) reserve_block(*res, keep, first + p, row * P + p);
      }
    }
#elif defined(LOUVER_AVX2)
    if (avx2_blocks(codes)) {  // bounds from the attend pass's operations (token_bounds8)
      alignas(32) int32_t dots[8 * 16];
      alignas(32) float ub[8];
      for (; p + 16 <= P; p += 16) {
        dot_block16_avx2(codes.block(first + p, k), bits, D, (bits == 4 ? wsplit8 : wq).data(), dot_heads(), dots);
        uint32_t keep = 0;
        for (int64_t g = 0; g < G; ++g) {
          if (!reach[g]) continue;
          for (int h = 0; h < 2; ++h) {
            const __m256i d = _mm256_load_si256(reinterpret_cast<const __m256i*>(dots + g * 16 + 8 * h));
            const __m256 bound =
                residual ? token_bounds8_2(off[g], step[g], step2[g], d,
                                           _mm256_load_si256(reinterpret_cast<const __m256i*>(dots + (G + g) * 16 + 8 * h)))
                         : token_bounds8(off[g], step[g], d);
            const __m256 u = add_tokens8(g, bound, ref[g], rows[g]);
            if (res) {
              const __m256 low = _mm256_cmp_ps(u, _mm256_set1_ps(level[g]), _CMP_LT_OQ);  // NaN keeps
              keep |= (~static_cast<uint32_t>(_mm256_movemask_ps(low)) & 0xFFu) << (8 * h);
              _mm256_storeu_ps(block_ub.data() + 16 * g + 8 * h, u);
            }
            if (tok_out) {
              _mm256_store_ps(ub, bound);
              for (int t = 0; t < 8; ++t) tok_out[(p + 8 * h + t) * tok_stride + g] = ub[t];
            }
          }
        }
        if (keep) reserve_block(*res, keep, first + p, row * P + p);
      }
    }
#endif
    if (p < P && !vnni()) unpack_page(codes, first, k, bits, P, D, page_codes.data());
    uint8_t scratch[Codes::kMaxBytes];
    for (; p < P; ++p) {
      if (vnni()) {
        dot_token_vnni(codes.token(first + p, k, scratch), bits, D, wsplit.data(), dot_heads(), idot.data());
      } else {
        for (int64_t g = 0; g < dot_heads(); ++g) idot[g] = dot_u8s8(page_codes.data() + p * D, wq.data() + g * D, D);
      }
      bool keep = false;
      for (int64_t g = 0; g < G; ++g) {
        if (!reach[g]) continue;
        const float ub = residual ? token_bound2(off[g], step[g], step2[g], idot[g], idot[G + g])
                                  : token_bound(off[g], step[g], idot[g]);
        const float u = add_token(g, ub, ref[g], rows[g]);
        if (res) {
          keep |= !(u < level[g]);  // NaN keeps
          block_ub[16 * g] = u;
        }
        if (tok_out) tok_out[p * tok_stride + g] = ub;
      }
      if (keep) reserve_block(*res, 1u, first + p, row * P + p);
    }
    for (int64_t g = 0; g < G; ++g) {
      rows[g].covered[page_bin[g]] += sums[g];
      if (below[g] != 0.0 && !level_bin.empty()) rows[g].tok[level_bin[g]] += below[g];
    }
  }

  // The lanes ``keep`` of a block (from slot ``slot``, position ``pos``) into the reserve: slot,
  // position and per head its bound (block_ub[16·g + lane]); a head whose page bound is below its
  // level keeps the page bound, below every T the pass can choose from that level up
  // (AttendArgs::t_reserve's entries alike).
  void reserve_block(ReserveRegion& r, uint32_t keep, int64_t slot, int64_t pos) {
    for (int64_t g = 0; g < G; ++g)
      if (!reach[g]) std::fill_n(block_ub.begin() + 16 * g, 16, pb[g]);
    int64_t n = r.n;
    for (; keep; keep &= keep - 1, ++n) {
      const int lane = __builtin_ctz(keep);
      r.slot[n] = slot + lane;
      r.pos[n] = pos + lane;
      float* bound = r.bound + n * G;
      for (int64_t g = 0; g < G; ++g) bound[g] = block_ub[16 * g + lane];
    }
    r.n = n;
  }
};

}  // namespace louver_cpu
