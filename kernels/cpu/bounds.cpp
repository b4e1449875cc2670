// The certified threshold of the grid family in one pass over the codes: per (request, query
// head) the histogram of the mass dropped at each threshold edge, from the same int8 token bounds
// the attend pass gates with, then T = the largest edge whose certified mass fits eps·Z_lb.
// Specification: louver_sgl.decode.threshold.certified_choice.

#include "common.h"
#include "ops.h"
#include "page_scan.h"

using namespace louver_cpu;

namespace {

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
// factor; rounding: relative bound on the histograms' fp64 rounding; edges: the levels;
// residual_weights (the op's name; CertifiedPass::residual): residual int8 weights.
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
      PageScan scan(G, D, bits, P, sigma, edges, c.residual);
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
  choose_thresholds(part.data(), threads, rows, W, hist.data_ptr<double>(), habs.data_ptr<double>(),
                    z_lb.data_ptr<double>(), rp, sigma, eps_budget, rounding, edges, t.data_ptr<float>(),
                    certificate.data_ptr<double>(), nullptr);
}

// The histograms from per-thread partials part [threads, rows, 3, W] (tok, page, covered rows, as
// HistRows) into hist and habs [rows, W], then per row T (t [rows] f32), its certificate and its
// edge (edge_out [rows], when given: −1 where none fits) by the histogram rule.
void louver_cpu::choose_thresholds(const double* part, int64_t threads, int64_t rows, int64_t W, double* hist,
                                   double* habs, const double* z_lb, const float* ref, double sigma, double eps_budget,
                                   double rounding, const Edges& edges, float* t, double* certificate,
                                   int64_t* edge_out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < W; ++j) {
      double tk = 0.0, pg = 0.0, cov = 0.0;
      for (int64_t thread = 0; thread < threads; ++thread) {
        const double* row = part + (3 * thread * rows + 3 * r) * W;
        tk += row[j];
        pg += row[W + j];
        cov += row[2 * W + j];
      }
      hist[r * W + j] = tk * kMassUp + pg - cov * kMassUp;
      habs[r * W + j] = tk * kMassUp + pg + cov * kMassUp;
    }
    double cert;
    const int64_t edge = fitting_edge(hist + r * W, habs + r * W, W, eps_budget * z_lb[r], rounding, edges, &cert);
    t[r] = edge_threshold(edge, ref[r], sigma, edges);
    certificate[r] = cert;
    if (edge_out) edge_out[r] = edge;
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
  c.residual = n.flag("residual_weights");
  n.done();
  run_certified_pass(c);
}
