// The certified threshold of the grid family in one pass over the codes: per (request, query
// head) the histogram of the mass dropped at each threshold edge, from the same int8 token bounds
// the attend pass gates with, then T = the largest edge whose certified mass fits eps·Z_lb.
// Specification: louver_sgl.decode.threshold.certified_choice.

#include "common.h"
#include "ops.h"

using namespace louver_cpu;

namespace {

// Levels: the Edges of the call (named.h). A unit's bin is the number of edges <= its
// x = σ·(bound − ref) (NaN: past the end).

// Upper bound of e^x (x at most 700, as the specification clamps; at least −700: no underflow):
// glibc's exp is within 1 ulp, so scaling by (1 + 2^-50) rounds up. (An fp32 exp of x rounded to
// fp32 errs by up to |x|·2^-24: not an upper bound.)
double exp_up(double x) { return std::exp(std::clamp(x, -700.0, 700.0)) * (1.0 + 0x1p-50); }

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

// One page and KV head: the int8 token weights of its G query heads, exactly as the attend pass
// builds them (ChunkRunner::open_page), then every token's bound into the histograms.
struct PageScan {
  int64_t G, D, bits, P;
  double sigma;
  Edges edges;
  std::vector<float> book, w, off, pb, step;
  std::vector<int8_t> wq, wsplit, wsplit8;
  std::vector<uint8_t> page_codes;
  std::vector<int64_t> page_bin;
  std::vector<int32_t> idot;  // per-token integer dots; members: scan runs per page and KV head
  std::vector<int32_t> quads8;  // the AVX2 scan's broadcast weights [G, D/64, 16, 8]
  std::vector<double> sums;   // per head, the page's counted token masses

  PageScan(int64_t G_, int64_t D_, int64_t bits_, int64_t P_, double sigma_, const Edges& edges_)
      : G(G_), D(D_), bits(bits_), P(P_), sigma(sigma_), edges(edges_), book(3 * D_), w(G_ * D_),
        off(G_), pb(G_), step(G_), wq(G_ * D_), wsplit(G_ * D_), wsplit8(G_ * D_),
        page_codes(P_ * D_), page_bin(G_), idot(G_), quads8(kHaveAvx2 ? 2 * G_ * D_ : 0), sums(G_) {}

  bool vnni() const { return kHaveVnni && D % 64 == 0 && (bits == 4 || bits == 8) && G <= 8; }

  // The attend pass's 8-lane scan (ChunkRunner::avx2_scan) applies: AVX2 builds, 4-bit block16 codes.
  bool avx2_blocks(const Codes& codes) const { return kHaveAvx2 && codes.block16 && bits == 4 && D % 64 == 0 && G <= 8; }

  template <typename M>
  void open(const float* q, const M* lo, const M* sc, const M* rad) {
    load_codebook(lo, sc, rad, D, book.data());
    page_terms(q, book.data(), book.data() + D, book.data() + 2 * D, G, D, bits, w.data(), off.data(), pb.data());
    for (int64_t g = 0; g < G; ++g) {
      off[g] += quantize_weights(w.data() + g * D, D, bits, wq.data() + g * D, &step[g]);
      if (vnni()) nibble_order_int8(wq.data() + g * D, bits, D, 64, wsplit.data() + g * D);
      if ((vnni() || kHaveAvx2) && bits == 4) nibble_order_int8(wq.data() + g * D, bits, D, 8, wsplit8.data() + g * D);
      if (kHaveAvx2 && bits == 4 && D % 64 == 0) broadcast_quads8(wsplit8.data() + g * D, D, quads8.data() + g * 2 * D);
    }
  }

  // Page masses at their bins.
  void add_pages(const float* ref, const HistRows* rows) {
    for (int64_t g = 0; g < G; ++g) {
      const double x = sigma * (double(pb[g]) - double(ref[g]));
      page_bin[g] = edges.bin(x);
      if (!std::isnan(x)) rows[g].page[page_bin[g]] += double(P) * exp_up(x);
    }
  }

#if defined(__AVX512F__)
  // add_token for 16 tokens: bins from fp64 x as Edges::bin, masses from exp_ps16 (x above 80:
  // exp_up; the merge scales every token mass by kMassUp), scattered one counted lane at a time.
  void add_tokens16(int64_t g, __m512 ub, double ref, const HistRows& row, double& sum) const {
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
    const __mmask16 below = _mm512_cmp_epi32_mask(b, page, _MM_CMPINT_LT);
    if (!below) return;
    const __m512 x32 = _mm512_insertf32x8(_mm512_castps256_ps512(xs[0]), xs[1], 1);
    const __m512 e = exp_ps16(_mm512_max_ps(x32, _mm512_set1_ps(-87.f)));
    _mm512_store_pd(mass, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    _mm512_store_pd(mass + 8, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
    _mm512_store_si512(bin, b);
    for (uint32_t big = _mm512_cmp_ps_mask(x32, _mm512_set1_ps(80.f), _CMP_GT_OQ) & below; big; big &= big - 1)
      mass[__builtin_ctz(big)] = exp_up(x[__builtin_ctz(big)]);
    double* tok = row.tok;  // a local: through ``row`` each add waited on the last store
    for (uint32_t m = below; m; m &= m - 1) tok[bin[__builtin_ctz(m)]] += mass[__builtin_ctz(m)];
    sum += _mm512_mask_reduce_add_pd(static_cast<__mmask8>(below), _mm512_load_pd(mass)) +
           _mm512_mask_reduce_add_pd(static_cast<__mmask8>(below >> 8), _mm512_load_pd(mass + 8));
  }
#endif

#if defined(LOUVER_AVX2)
  // add_tokens16 for 8 tokens (AVX2 builds): bins from fp64 x as Edges::bin, masses from exp_ps8
  // (exp_ps16's results; x above 80: exp_up), scattered one counted lane at a time.
  void add_tokens8(int64_t g, __m256 ub, double ref, const HistRows& row, double& sum) const {
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
    const uint32_t below = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(page, b))));
    if (!below) return;
    const __m256 x32 = _mm256_set_m128(xs[1], xs[0]);
    const __m256 e = exp_ps8(_mm256_max_ps(x32, _mm256_set1_ps(-87.f)));
    _mm256_store_pd(mass, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    _mm256_store_pd(mass + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(bin), b);
    const uint32_t big = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x32, _mm256_set1_ps(80.f), _CMP_GT_OQ)));
    for (uint32_t m = big & below; m; m &= m - 1) mass[__builtin_ctz(m)] = exp_up(x[__builtin_ctz(m)]);
    double* tok = row.tok;  // a local: through ``row`` each add waited on the last store
    double total = 0.0;
    for (uint32_t m = below; m; m &= m - 1) {
      tok[bin[__builtin_ctz(m)]] += mass[__builtin_ctz(m)];
      total += mass[__builtin_ctz(m)];
    }
    sum += total;
  }
#endif

  // Token p of the page with bound ub for head g: counted at its bin when below the page's bin.
  void add_token(int64_t g, float ub, double ref, const HistRows& row, double& sum) const {
    const float u = (std::isnan(ub) || std::isnan(pb[g])) ? NAN : std::min(ub, pb[g]);
    const double x = sigma * (double(u) - ref);
    const int64_t bin = edges.bin(x);
    if (bin >= page_bin[g]) return;  // NaN: past the last edge, never below the page
    const double e = exp_up(x);
    row.tok[bin] += e;
    sum += e;
  }

  // The page's tokens (its first slot ``first`` in ``codes``; token bounds also into tok_out when
  // given, [P, ...] rows ``tok_stride`` floats apart, G heads each).
  void scan(const Codes& codes, int64_t first, int64_t k, const float* ref, const HistRows* rows, float* tok_out,
            int64_t tok_stride) {
    std::fill(sums.begin(), sums.end(), 0.0);
    int64_t p = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (vnni() && P % 16 == 0) {
      alignas(64) float ub[16];
      __m512i dots[8];
      for (; p + 16 <= P; p += 16) {
        dot_block16(codes, first + p, k, bits, D, wsplit.data(), wsplit8.data(), G, dots);
        for (int64_t g = 0; g < G; ++g) {
          const __m512 bound = token_bounds16(off[g], step[g], dots[g]);
          add_tokens16(g, bound, ref[g], rows[g], sums[g]);
          if (tok_out) {
            _mm512_store_ps(ub, bound);
            for (int t = 0; t < 16; ++t) tok_out[(p + t) * tok_stride + g] = ub[t];
          }
        }
      }
    }
#elif defined(LOUVER_AVX2)
    if (avx2_blocks(codes)) {  // bounds from the attend pass's operations (token_bounds8)
      alignas(32) int32_t dots[8 * 16];
      alignas(32) float ub[8];
      for (; p + 16 <= P; p += 16) {
        dot_block16_avx2_4bit(codes.block(first + p, k), D, quads8.data(), G, dots);
        for (int64_t g = 0; g < G; ++g)
          for (int h = 0; h < 2; ++h) {
            const __m256i d = _mm256_load_si256(reinterpret_cast<const __m256i*>(dots + g * 16 + 8 * h));
            const __m256 bound = token_bounds8(off[g], step[g], d);
            add_tokens8(g, bound, ref[g], rows[g], sums[g]);
            if (tok_out) {
              _mm256_store_ps(ub, bound);
              for (int t = 0; t < 8; ++t) tok_out[(p + 8 * h + t) * tok_stride + g] = ub[t];
            }
          }
      }
    }
#endif
    if (p < P && !vnni()) unpack_page(codes, first, k, bits, P, D, page_codes.data());
    uint8_t scratch[Codes::kMaxBytes];
    for (; p < P; ++p) {
      if (vnni()) {
        dot_token_vnni(codes.token(first + p, k, scratch), bits, D, wsplit.data(), G, idot.data());
      } else {
        for (int64_t g = 0; g < G; ++g) idot[g] = dot_u8s8(page_codes.data() + p * D, wq.data() + g * D, D);
      }
      for (int64_t g = 0; g < G; ++g) {
        const float ub = token_bound(off[g], step[g], idot[g]);
        add_token(g, ub, ref[g], rows[g], sums[g]);
        if (tok_out) tok_out[p * tok_stride + g] = ub;
      }
    }
    for (int64_t g = 0; g < G; ++g) rows[g].covered[page_bin[g]] += sums[g];
  }
};

// Page slices for the bound pass: several per thread, so that the cores finish together (their
// histograms add up in one partial per thread).
int64_t page_slices(int64_t n_pages) {
  return std::max<int64_t>(1, std::min<int64_t>(n_pages, 8 * at::get_num_threads()));
}

}  // namespace

// fp32 T of edge j for reference score ref (threshold.edge_threshold): just under the edge,
// rounded down; −inf for j < 0 or a non-finite ref.
float louver_cpu::edge_threshold(int64_t j, float ref, double sigma, const Edges& edges) {
  if (j < 0 || !std::isfinite(ref)) return -INFINITY;
  const double t = double(ref) + (edges.low + edges.step * double(j) - edges.margin) / sigma;
  float t32 = static_cast<float>(t);
  if (double(t32) > t) t32 = std::nextafter(t32, -INFINITY);
  return t32;
}

int64_t louver_cpu::fitting_edge(const double* hist, const double* habs, int64_t W, double budget, double rounding,
                                 const Edges& edges, double* fit) {
  double cum = 0.0, cum_abs = 0.0;
  int64_t edge = -1;
  *fit = 0.0;
  for (int64_t j = 0; j < std::min<int64_t>(W, edges.count); ++j) {
    cum += hist[j];
    cum_abs += habs[j];
    const double bound = cum + rounding * cum_abs;
    if (bound <= budget) edge = j, *fit = bound;
  }
  return edge;
}

// The pass (CertifiedPass, ops.h): q [B, H_q, D] f32; page_ids, page_req [n] i64; lo/scale/radius
// [pages, H_kv, D] (KV dtype); codes u8 [slots, H_kv, bytes] or block16 [slots/16, H_kv, bytes/4,
// 16, 4] (see Codes); ref [B, H_q] f32; z_lb [B, H_q] f64; eps_budget = eps times the fp64 safety
// factor; rounding: relative bound on the histograms' fp64 rounding; edges: the levels.
// -> hist, habs [B, H_q, edges.count + 2] f64 (the histogram and its absolute terms; the dropped
// mass at edge j is cumsum(hist)[j] + rounding·cumsum(habs)[j]), t [B, H_q] f32, certificate
// [B, H_q] f64 (that mass at the chosen edge, relative to ref; 0 where T = −inf). tok [n, P, H_q]
// f32 and pb [n, H_q] f32: the int8 token bounds and the page bounds, written when not empty.
void louver_cpu::run_certified_pass(const CertifiedPass& c) {
  const torch::Tensor &q = c.q, &page_ids = c.page_ids, &page_req = c.page_req, &lo = c.lo, &scale = c.scale;
  const torch::Tensor &radius = c.radius, &ref = c.ref, &z_lb = c.z_lb, &hist = c.hist, &habs = c.habs;
  const torch::Tensor &t = c.t, &certificate = c.certificate, &tok = c.tok, &pb = c.pb;
  const double sigma = c.sigma, eps_budget = c.eps_budget, rounding = c.rounding;
  const int64_t bits = c.bits, page_size = c.page_size, width = c.edges.width();
  const Edges edges = c.edges;
  const torch::Tensor& codes = c.codes;
  const int64_t n = page_ids.size(0), h_kv = lo.size(1), D = lo.size(2), B = ref.size(0);
  const Codes view = codes_view(codes);
  const int64_t h_q = q.size(1), G = h_q / h_kv, P = page_size;
  TORCH_CHECK(!view.block16 || P % 16 == 0, "certified_threshold: block16 codes need pages of a multiple of 16 slots");
  TORCH_CHECK(q.is_contiguous() && ref.is_contiguous() && z_lb.is_contiguous() && hist.is_contiguous() &&
                  habs.is_contiguous() && t.is_contiguous() && certificate.is_contiguous(),
              "certified_threshold: q, ref, z_lb and the outputs must be contiguous");
  TORCH_CHECK(hist.numel() == B * h_q * width && habs.numel() == hist.numel(),
              "certified_threshold: hist and habs must be [B, H_q, ", width, "]");
  const bool with_bounds = tok.numel() > 0;
  TORCH_CHECK(!with_bounds || (tok.numel() == n * P * h_q && pb.numel() == n * h_q),
              "certified_threshold: tok must be [n, P, H_q] and pb [n, H_q]");
  const float* qp = q.data_ptr<float>();
  const int64_t* pid = page_ids.data_ptr<int64_t>();
  const int64_t* preq = page_req.data_ptr<int64_t>();
  const float* rp = ref.data_ptr<float>();
  float* tok_out = with_bounds ? tok.data_ptr<float>() : nullptr;
  float* pb_out = with_bounds ? pb.data_ptr<float>() : nullptr;
  const int64_t rows = B * h_q, S = page_slices(n), W = width, threads = at::get_num_threads();
  // per thread: tok, page, covered rows (one per slice was ~1 MB at batch 1, fresh pages each call)
  std::vector<double> part(3 * threads * rows * W, 0.0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lo.scalar_type(), "certified_threshold", [&] {
    const scalar_t* lp = lo.data_ptr<scalar_t>();
    const scalar_t* sp = scale.data_ptr<scalar_t>();
    const scalar_t* radp = radius.data_ptr<scalar_t>();
    at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
      PageScan scan(G, D, bits, P, sigma, edges);
      std::vector<HistRows> hr(G);
      double* base = part.data() + 3 * at::get_thread_num() * rows * W;
      for (int64_t slice = begin; slice < end; ++slice) {
        for (int64_t i = slice * n / S; i < (slice + 1) * n / S; ++i) {
          for (int64_t k = 0; k < h_kv; ++k) {
            const int64_t head0 = preq[i] * h_q + k * G, meta = (pid[i] * h_kv + k) * D;
            for (int64_t g = 0; g < G; ++g) {
              double* row = base + (head0 + g) * 3 * W;
              hr[g] = HistRows{row, row + W, row + 2 * W};
            }
            scan.open(qp + head0 * D, lp + meta, sp + meta, radp + meta);
            scan.add_pages(rp + head0, hr.data());
            scan.scan(view, pid[i] * P, k, rp + head0, hr.data(), with_bounds ? tok_out + i * P * h_q + k * G : nullptr, h_q);
            if (pb_out)
              for (int64_t g = 0; g < G; ++g) pb_out[i * h_q + k * G + g] = scan.pb[g];
          }
        }
      }
    });
  });
  double* hp = hist.data_ptr<double>();
  double* ap = habs.data_ptr<double>();
  const double* zp = z_lb.data_ptr<double>();
  float* tp = t.data_ptr<float>();
  double* cp = certificate.data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < W; ++j) {
      double tk = 0.0, pg = 0.0, cov = 0.0;
      for (int64_t thread = 0; thread < threads; ++thread) {
        const double* row = part.data() + (3 * thread * rows + 3 * r) * W;
        tk += row[j];
        pg += row[W + j];
        cov += row[2 * W + j];
      }
      hp[r * W + j] = tk * kMassUp + pg - cov * kMassUp;
      ap[r * W + j] = tk * kMassUp + pg + cov * kMassUp;
    }
    double cert;
    const int64_t edge = fitting_edge(hp + r * W, ap + r * W, W, eps_budget * zp[r], rounding, edges, &cert);
    tp[r] = edge_threshold(edge, rp[r], sigma, edges);
    cp[r] = cert;
  }
}

// The pass as an op, by name (fields of CertifiedPass; tok and pb may be empty).
void certified_threshold(Named& n) {
  CertifiedPass c;
  c.q = n.tensor("q"), c.page_ids = n.tensor("page_ids"), c.page_req = n.tensor("page_req"), c.lo = n.tensor("lo");
  c.scale = n.tensor("scale"), c.radius = n.tensor("radius"), c.codes = n.tensor("codes"), c.ref = n.tensor("ref");
  c.z_lb = n.tensor("z_lb"), c.sigma = n.real("sigma"), c.eps_budget = n.real("eps_budget");
  c.rounding = n.real("rounding"), c.bits = n.integer("bits"), c.page_size = n.integer("page_size");
  c.edges = Edges::read(n);
  c.hist = n.tensor("hist"), c.habs = n.tensor("habs"), c.t = n.tensor("t"), c.certificate = n.tensor("certificate");
  c.tok = n.tensor("tok"), c.pb = n.tensor("pb");
  n.done();
  run_certified_pass(c);
}
