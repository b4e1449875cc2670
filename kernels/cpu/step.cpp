// One whole decode step in a single call: exact part -> T and value gate per head -> attend ->
// merge, then the per-request totals (one parallel region; certified steps choose T by a bound
// pass between the exact part and the attend pass). Separate ops would cost a round trip through Python and a
// fresh parallel region per phase; on a two-core machine both were a large part of a 32K step.

#include "attend.h"
#include "exact_merge.h"
#include "ops.h"
#include "stats.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

using namespace louver_cpu;

namespace {

enum Phases { kExactPart = 1, kAttend = 2, kMerge = 4, kAttendMerge = 6, kAllPhases = 7 };

// The phases in one parallel region (a pragma cannot sit inside the dtype-dispatch macro): the
// exact part with T and the value gate per head, then attend and merge. Certified steps run them
// as two regions with the threshold's bound pass between.
template <typename KV>
void run_phases(const ExactArgs& e, const AttendArgs& a, const MergeArgs& g, const KV* kc, const KV* vc, const KV* lo,
                const KV* sc, const KV* rad, double t_fixed, bool value_gate, float gate_rel, float* tp, float* gp,
                int phases = kAllPhases) {
  std::atomic<int64_t> next{0};
  const bool dense_ready = g.dense_ready;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    if (phases & kExactPart) {
      std::vector<float> key(kExactScratch * e.D), scratch;
      {  // an even share of the scattered sample and of the dense part per thread (the sample's
         // random rows cost far more per row), each a contiguous range that exact_rows prefetches within
        const int64_t id = omp_get_thread_num(), n = omp_get_num_threads();
        exact_rows(e, kc, e.nd + e.ns * id / n, e.nd + e.ns * (id + 1) / n, key.data());
        exact_rows(e, kc, e.nd * id / n, e.nd * (id + 1) / n, key.data());
      }
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < e.B * e.H; ++bh) {
        exact_heads(e, bh, bh + 1, scratch);
        if (!e.tp) tp[bh] = static_cast<float>(t_fixed);
        gp[bh] = value_gate ? value_gate_threshold(tp[bh], gate_rel) : -INFINITY;
      }
    }
    // the dense part's states, once per step: the queue's last tasks in the first attend pass
    // (small ones, after the chunks, that even out the threads' ends), else in the merge
    if (phases & kAttend) {
      const int64_t tasks = g.B * g.h_kv;
      for (int64_t i = attend_worker(a, kc, vc, lo, sc, rad, next) - a.n_chunks; !dense_ready && i < tasks;
           i = next++ - a.n_chunks)
        dense_task(g, vc, i);
    }
    if ((phases & kAttend) && (phases & kMerge)) {
#pragma omp barrier
    }
    if (phases & kMerge) {
#pragma omp for schedule(static)
      for (int64_t task = 0; task < g.B * g.h_kv; ++task) {
        if (!dense_ready && !(phases & kAttend)) dense_task(g, vc, task);
        merge_tasks(g, task, task + 1);
      }
    }
  }
  g.dense_ready = g.dense_ready || (phases & kAttendMerge);
}

}  // namespace

// One whole step of the sample-threshold policies by name: inputs as for exact_part and the
// attend pass (q [B, H_q, D] f32, k_cache, v_cache, lo, scale, radius, codes, dense_slots,
// dense_req, sample_slots, sample_req, page_ids, chunk_req, chunk_begin, chunk_end, sigma, budget
// (>= 0: T is the sample rule's, else t_fixed, −inf for the dense policy), t_fixed, value_gate and
// gate_rel (gate = T − gate_rel·(|T| + 1), else −inf), bits, page_size, residual_weights
// (AttendArgs::residual)). Outputs (all written):
// s_dense, sample, ref, z, t, gate [B, H_q] f32, the attend outputs m, l, o, counts, mass, result
// [B, H_q, Dv] f32, and the chunk totals per_head, per_req, masses.
void fused_step(Named& n) {
  torch::Tensor q = n.tensor("q"), k_cache = n.tensor("k_cache"), v_cache = n.tensor("v_cache");
  torch::Tensor lo = n.tensor("lo"), scale = n.tensor("scale"), radius = n.tensor("radius"), codes = n.tensor("codes");
  torch::Tensor s_dense = n.tensor("s_dense"), sample = n.tensor("sample"), ref = n.tensor("ref"), z = n.tensor("z");
  torch::Tensor t = n.tensor("t"), gate = n.tensor("gate"), m = n.tensor("m"), l = n.tensor("l"), o = n.tensor("o");
  torch::Tensor counts = n.tensor("counts"), mass = n.tensor("mass"), result = n.tensor("result");
  torch::Tensor chunk_req = n.tensor("chunk_req"), dense_slots = n.tensor("dense_slots"), dense_req = n.tensor("dense_req");
  const double sigma = n.real("sigma"), budget = n.real("budget"), t_fixed = n.real("t_fixed");
  const bool value_gate = n.flag("value_gate"), residual = n.flag("residual_weights");
  const float gate_rel = static_cast<float>(n.real("gate_rel"));
  TORCH_CHECK(lo.scalar_type() == k_cache.scalar_type(), "index codebooks must use the KV dtype");
  const ExactArgs e = exact_args(q, k_cache, dense_slots, dense_req, n.tensor("sample_slots"),
                                 n.tensor("sample_req"), sigma, budget, s_dense, sample, ref, z, t);
  AttendArgs a = attend_args(q, k_cache, v_cache, codes, n.tensor("page_ids"), chunk_req,
                             n.tensor("chunk_begin"), n.tensor("chunk_end"), t, gate, ref, sigma,
                             n.integer("bits"), n.integer("page_size"), m, l, o, counts, mass);
  a.residual = residual;
  const MergeArgs g = merge_args(s_dense, dense_slots, dense_req, v_cache, m.view({a.n_chunks, a.h_q}),
                                 l.view({a.n_chunks, a.h_q}), o.view({a.n_chunks, a.h_q, a.dim_v}), chunk_req, sigma,
                                 result);
  torch::Tensor per_head = n.tensor("per_head"), per_req = n.tensor("per_req"), masses = n.tensor("masses");
  n.done();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "fused_step", [&] {
    run_phases(e, a, g, k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), lo.data_ptr<scalar_t>(),
               scale.data_ptr<scalar_t>(), radius.data_ptr<scalar_t>(), t_fixed, value_gate, gate_rel,
               t.data_ptr<float>(), gate.data_ptr<float>());
  });
  chunk_totals_into(counts, mass, chunk_req, per_head, per_req, masses);
}

namespace {

using Strides3 = std::array<int64_t, 3>;

// dst = src, both [B, H, D] with any strides, converted through fp32 (q into the step's fp32
// copy, the fp32 result into the caller's dtype) with plain loops: no ATen op on the step's path.
template <typename From, typename To>
void copy_heads(const From* src, const Strides3& src_stride, To* dst, const Strides3& dst_stride, int64_t B, int64_t H,
                int64_t D) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const From* in = src + b * src_stride[0] + h * src_stride[1];
      To* out = dst + b * dst_stride[0] + h * dst_stride[1];
      for (int64_t d = 0; d < D; ++d)
        out[d * dst_stride[2]] = static_cast<To>(static_cast<float>(in[d * src_stride[2]]));
    }
}

Strides3 strides3(const torch::Tensor& x) { return {x.stride(0), x.stride(1), x.stride(2)}; }

void check_buffer(const torch::Tensor& x, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.scalar_type() == dtype, "StepPlan: ", name,
              " must be a contiguous CPU tensor of dtype ", dtype);
}

// The safe level (threshold.safe_level) T = ref + ln(eps_budget·z / ((1 + rounding)·n_indexed)) / σ,
// rounded down to fp32: every dropped unit's bound is below T, so the mass dropped is below
// n_indexed·e^{σ(T − ref)}, which fits eps_budget·z. −inf where nothing is indexed or a term is
// not finite.
float safe_level(float ref, double z, int64_t n_indexed, double sigma, double eps_budget, double rounding) {
  const double level = double(ref) + std::log(eps_budget * z / ((1.0 + rounding) * double(n_indexed))) / sigma;
  float down = static_cast<float>(level);
  if (double(down) > level) down = std::nextafter(down, -INFINITY);
  return (n_indexed > 0 && std::isfinite(level)) ? down : -INFINITY;
}

// The provisional levels of the one-pass certified rules into p.t: per (request, head) the safe
// level at z_level (Z_lb, where the check always passes, or the a-posteriori estimate Z_est).
void provisional_levels(StepPlan& p, const double* z_level, double sigma, double eps_budget, double rounding) {
  const int64_t B = p.q32.size(0), H = p.q32.size(1);
  const float* ref = p.ref.data_ptr<float>();
  const int64_t* n_idx = p.num_indexed.data_ptr<int64_t>();
  float* t = p.t.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) t[b * H + h] = safe_level(ref[b * H + h], z_level[b * H + h], n_idx[b], sigma,
                                                              eps_budget, rounding);
}

// The one-pass check (threshold.provisional_certified): a head is certified at its provisional T
// when the attend pass's index-dropped mass times (1 + rounding) fits eps_budget·Z_lb; that
// product is its certificate. Returns per request whether some head failed (NaN fails); marks the
// failed heads in lowered [B·H_q].
std::vector<char> certify_provisional(StepPlan& p, double eps_budget, double rounding, uint8_t* lowered) {
  const int64_t B = p.q32.size(0), H = p.q32.size(1);
  const double* masses = p.masses.data_ptr<double>();
  const double* z_lb = p.z_lb.data_ptr<double>();
  double* cert = p.certificate.data_ptr<double>();
  std::vector<char> failed(B, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t i = b * H + h;
      cert[i] = masses[3 * i] * (1.0 + rounding);
      if (!(cert[i] <= eps_budget * z_lb[i])) failed[b] = 1, lowered[i] = 1;
    }
  return failed;
}

// Z_att of row i: max(Z_lb, Z_dense + the exact mass of the attend pass's union candidates,
// masses[..., 2]), the denominator both a-posteriori checks divide by (Z_lb = the exact part's two
// masses, z[2i] + z[2i + 1]).
double attended_z(const StepPlan& p, int64_t i) {
  const double *z = p.z.data_ptr<double>(), *masses = p.masses.data_ptr<double>();
  return std::max(z[2 * i] + z[2 * i + 1], z[2 * i] + masses[3 * i + 2]);
}

// The check of the one-pass rule a posteriori: a head whose dropped-mass bound at its provisional
// level times (1 + rounding) fits eps_budget·Z_att (Z_att = max(Z_lb, Z_dense + the exact mass of
// the attend pass's union candidates, masses[..., 2]) is certified there with that product; a head
// where it does not (or is NaN) is lowered to the safe level at Z_att, where every dropped unit's
// bound is below T, so the mass dropped is below n·e^{σ(T − ref)} ≤ eps_budget·Z_att: its
// certificate (0 where T = −inf). Returns per request whether some head was lowered; marks the
// lowered heads in lowered [B·H_q].
std::vector<uint8_t> lower_to_safe(StepPlan& p, double sigma, double eps_budget, double rounding,
                                   uint8_t* lowered) {
  const int64_t B = p.q32.size(0), H = p.q32.size(1);
  const double* masses = p.masses.data_ptr<double>();
  const float* ref = p.ref.data_ptr<float>();
  const int64_t* n_idx = p.num_indexed.data_ptr<int64_t>();
  float* t = p.t.data_ptr<float>();
  double* cert = p.certificate.data_ptr<double>();
  std::vector<uint8_t> band(B, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t i = b * H + h;
      const double z_att = attended_z(p, i);
      cert[i] = masses[3 * i] * (1.0 + rounding);
      if (cert[i] <= eps_budget * z_att) continue;  // certified at the provisional level
      t[i] = safe_level(ref[i], z_att, n_idx[b], sigma, eps_budget, rounding);
      cert[i] = t[i] == -INFINITY ? 0.0 : eps_budget * z_att;
      band[b] = 1, lowered[i] = 1;
    }
  return band;
}

// Rows b of t / certificate not in ``failed`` put back from the kept copies ([B, H_q] each).
void keep_rows(const std::vector<char>& failed, const torch::Tensor& t_kept, torch::Tensor& t,
               const torch::Tensor& cert_kept, torch::Tensor& cert) {
  const int64_t H = t.size(1);
  for (int64_t b = 0; b < static_cast<int64_t>(failed.size()); ++b) {
    if (failed[b]) continue;
    std::copy_n(t_kept.data_ptr<float>() + b * H, H, t.data_ptr<float>() + b * H);
    std::copy_n(cert_kept.data_ptr<double>() + b * H, H, cert.data_ptr<double>() + b * H);
  }
}

// The a-posteriori rule's estimate of Z into z_est (threshold.estimated_z): per (request, head)
// max(Z_lb, share·(Z_dense + Z_sample·n_indexed / samples)), share the request's own where
// shares [B] is given (LayerStep::run's share), else the layer's; the certified pass picks the
// first level against it.
void estimated_z(StepPlan& p, double share, const double* shares, double* z_est) {
  const int64_t B = p.q32.size(0), H = p.q32.size(1);
  const double* z = p.z.data_ptr<double>();
  const int64_t* n_idx = p.num_indexed.data_ptr<int64_t>();
  std::vector<int64_t> samples(B, 0);
  const int64_t* sr = p.sample_req.data_ptr<int64_t>();
  for (int64_t i = 0; i < p.sample_req.size(0); ++i) ++samples[sr[i]];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t i = b * H + h;
      const double scaled = z[2 * i + 1] * double(n_idx[b]) / double(std::max<int64_t>(samples[b], 1));
      z_est[i] = std::max(z[2 * i] + z[2 * i + 1], (shares ? shares[b] : share) * (z[2 * i] + scaled));
    }
}

// fitting_edge for row i of the plan's histograms.
int64_t fitting_edge(const StepPlan& p, int64_t i, double budget, double rounding, const Edges& edges, double* fit) {
  const int64_t W = p.hist.size(2);
  return fitting_edge(p.hist.data_ptr<double>() + i * W, p.habs.data_ptr<double>() + i * W, W, budget, rounding,
                      edges, fit);
}

// The histogram rule's levels (Z_lb of the exact part) [B·H_q]: the lowest the a-posteriori second
// level can reach (Z_att >= Z_lb), so the first pass keeps every token above them in its reserve.
std::vector<float> histogram_levels(const StepPlan& p, double sigma, double eps_budget, double rounding,
                                    const Edges& edges) {
  const int64_t n = p.q32.size(0) * p.q32.size(1);
  const double* z = p.z.data_ptr<double>();
  const float* ref = p.ref.data_ptr<float>();
  std::vector<float> levels(n);
  double fit;
  for (int64_t i = 0; i < n; ++i)
    levels[i] = edge_threshold(fitting_edge(p, i, eps_budget * (z[2 * i] + z[2 * i + 1]), rounding, edges, &fit),
                               ref[i], sigma, edges);
  return levels;
}

// The check and the second level of the a-posteriori rule (threshold.a_posteriori_second): Z_att
// = max(Z_lb, Z_dense + the exact mass of the first pass's union candidates, masses[..., 2]); a
// head whose certificate (the bound at its first level) does not fit eps_budget·Z_att takes the
// largest edge whose bound (the histogram's cumulative sums) does, its certificate that bound (T
// = −inf and 0 where none fits). Returns per request whether some head was lowered; marks the
// lowered heads in lowered [B·H_q].
std::vector<uint8_t> lower_uncertified(StepPlan& p, double sigma, double eps_budget, double rounding,
                                       const Edges& edges, uint8_t* lowered) {
  const int64_t B = p.q32.size(0), H = p.q32.size(1);
  const float* ref = p.ref.data_ptr<float>();
  float* t = p.t.data_ptr<float>();
  double* cert = p.certificate.data_ptr<double>();
  std::vector<uint8_t> band(B, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t i = b * H + h;
      const double z_att = attended_z(p, i);
      if (t[i] == -INFINITY || cert[i] <= eps_budget * z_att) continue;  // certified at the first level
      double fit;
      const int64_t edge = fitting_edge(p, i, eps_budget * z_att, rounding, edges, &fit);
      t[i] = edge_threshold(edge, ref[i], sigma, edges);
      cert[i] = edge < 0 ? 0.0 : fit;
      band[b] = 1, lowered[i] = 1;
    }
  return band;
}

// The band pass's chunk states merged into the first pass's (log-sum-exp per chunk and head) and
// their counts and masses added, so that the merge and the totals read one state per chunk.
void combine_band(StepPlan& p) {
  const int64_t rows = p.m.numel(), DV = p.result.size(2);
  float *m = p.m.data_ptr<float>(), *l = p.l.data_ptr<float>(), *o = p.o.data_ptr<float>();
  const float *bm = p.band_m.data_ptr<float>(), *bl = p.band_l.data_ptr<float>(), *bo = p.band_o.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    if (bl[r] == 0.f) continue;  // the band attended nothing for this chunk and head
    const float top = std::max(m[r], bm[r]);
    const float s1 = std::exp(m[r] - top), s2 = std::exp(bm[r] - top);
    l[r] = l[r] * s1 + bl[r] * s2;
    for (int64_t d = 0; d < DV; ++d) o[r * DV + d] = o[r * DV + d] * s1 + bo[r * DV + d] * s2;
    m[r] = top;
  }
  int64_t* counts = p.counts.data_ptr<int64_t>();
  const int64_t* bc = p.band_counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < p.counts.numel(); ++i) counts[i] += bc[i];
  double* mass = p.mass.data_ptr<double>();
  const double* bmass = p.band_mass.data_ptr<double>();
  for (int64_t i = 0; i < p.mass.numel(); ++i) mass[i] += bmass[i];
}

// Pages skipped at the first level but kept at the lowered one, per (request, head) [B·H_q]: the
// band pass reads no page, so the first pass's skip counts drop by these.
std::vector<int64_t> unskipped_pages(const StepPlan& p, const torch::Tensor& t0) {
  const int64_t H = p.q32.size(1), n = p.page_ids.size(0);
  const float *pb = p.band_pb.data_ptr<float>(), *t1 = p.t.data_ptr<float>(), *first = t0.data_ptr<float>();
  const int64_t* req = p.page_req.data_ptr<int64_t>();
  std::vector<int64_t> count(p.q32.size(0) * H, 0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t r = req[i] * H + h;
      const float x = pb[i * H + h];
      count[r] += x < first[r] && !(x < t1[r]);
    }
  return count;
}

// The one-scan pass's reserve levels per (request, head) [B·H_q]: the edge ``offset`` edges from
// the highest edge at or under the safe level (threshold.safe_level: every indexed token just under
// it drops a mass that fits the budget, so the histogram rule's edge is never below the safe
// level's; offset −1 leaves a step of margin for the fp32 masses), and its fp32 T
// (edge_threshold); −1 and −inf where the safe level is not finite (every token kept).
void reserve_levels(const StepPlan& p, double sigma, double eps_budget, double rounding, const Edges& edges,
                    int64_t offset, std::vector<float>& level, std::vector<int64_t>& bin) {
  const int64_t B = p.q32.size(0), H = p.q32.size(1);
  const float* ref = p.ref.data_ptr<float>();
  const double* z_lb = p.z_lb.data_ptr<double>();
  const int64_t* n_idx = p.num_indexed.data_ptr<int64_t>();
  level.assign(B * H, -INFINITY);
  bin.assign(B * H, -1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t i = b * H + h;
      const double x = std::log(eps_budget * z_lb[i] / ((1.0 + rounding) * double(n_idx[b])));  // σ·(safe − ref)
      if (n_idx[b] <= 0 || !std::isfinite(x) || !std::isfinite(ref[i])) continue;
      const double j = std::floor((x - edges.low) / edges.step) + double(offset);
      if (j < 0) continue;
      bin[i] = static_cast<int64_t>(std::min(j, double(edges.count - 1)));
      level[i] = edge_threshold(bin[i], ref[i], sigma, edges);
    }
}

// Per (request, head) [B·H_q] the pages of the request whose page bound is below the head's T
// (the one-scan step's skip count: its attend pass reads the reserve, not the pages).
std::vector<int64_t> pages_below(const StepPlan& p) {
  const int64_t H = p.q32.size(1), n = p.page_ids.size(0);
  const float *pb = p.band_pb.data_ptr<float>(), *t = p.t.data_ptr<float>();
  const int64_t* req = p.page_req.data_ptr<int64_t>();
  std::vector<int64_t> count(p.q32.size(0) * H, 0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < H; ++h) count[req[i] * H + h] += pb[i * H + h] < t[req[i] * H + h];
  return count;
}

}  // namespace

StepPlan::StepPlan(Named& n) {
  dense_slots = n.tensor("dense_slots"), dense_req = n.tensor("dense_req"), sample_slots = n.tensor("sample_slots");
  sample_req = n.tensor("sample_req"), page_ids = n.tensor("page_ids"), chunk_req = n.tensor("chunk_req");
  chunk_begin = n.tensor("chunk_begin"), chunk_end = n.tensor("chunk_end"), num_indexed = n.tensor("num_indexed");
  page_req = n.tensor("page_req");
  q32 = n.tensor("q32"), s_dense = n.tensor("s_dense"), sample = n.tensor("sample"), ref = n.tensor("ref");
  z = n.tensor("z"), t = n.tensor("t"), gate = n.tensor("gate"), m = n.tensor("m"), l = n.tensor("l");
  o = n.tensor("o"), counts = n.tensor("counts"), mass = n.tensor("mass"), result = n.tensor("result");
  per_head = n.tensor("per_head"), per_req = n.tensor("per_req"), masses = n.tensor("masses");
  z_lb = n.tensor("z_lb"), hist = n.tensor("hist"), habs = n.tensor("habs"), certificate = n.tensor("certificate");
  band_m = n.tensor("band_m"), band_l = n.tensor("band_l"), band_o = n.tensor("band_o");
  band_counts = n.tensor("band_counts"), band_mass = n.tensor("band_mass"), band_pb = n.tensor("band_pb");
  band_mag = n.tensor("band_mag");
  reserve_slot = n.tensor("reserve_slot"), reserve_pos = n.tensor("reserve_pos");
  reserve_bound = n.tensor("reserve_bound"), reserve_count = n.tensor("reserve_count");
  n.done();
  for (const auto* x : {&band_m, &band_l, &band_o, &band_pb, &band_mag, &reserve_bound}) check_buffer(*x, at::kFloat, "a band buffer");
  for (const auto* x : {&band_counts, &reserve_slot, &reserve_pos, &reserve_count}) check_buffer(*x, at::kLong, "a band buffer");
  check_buffer(band_mass, at::kDouble, "band_mass");
  const bool band = band_m.numel() > 0;
  TORCH_CHECK(!band || (band_m.sizes() == m.sizes() && band_l.sizes() == l.sizes() && band_o.sizes() == o.sizes() &&
                        band_counts.sizes() == counts.sizes() && band_mass.sizes() == mass.sizes() &&
                        band_pb.numel() == page_ids.size(0) * q32.size(1) && band_mag.numel() == band_pb.numel() &&
                        reserve_slot.numel() == reserve_pos.numel() &&
                        reserve_bound.numel() == reserve_slot.numel() * (q32.size(1) / counts.size(1)) &&
                        reserve_count.numel() == chunk_req.size(0) * counts.size(1)),
              "StepPlan: the band buffers must be empty or shaped for the plan (see ops.h)");
  for (const auto* x : {&dense_slots, &dense_req, &sample_slots, &sample_req, &page_ids, &chunk_req, &chunk_begin,
                        &chunk_end, &num_indexed, &page_req})
    check_buffer(*x, at::kLong, "a plan tensor");
  for (const auto* x : {&q32, &s_dense, &sample, &ref, &t, &gate, &m, &l, &o, &result})
    check_buffer(*x, at::kFloat, "an fp32 buffer");
  for (const auto* x : {&z, &mass, &masses, &z_lb, &hist, &habs, &certificate})
    check_buffer(*x, at::kDouble, "an fp64 buffer");
  for (const auto* x : {&counts, &per_head, &per_req}) check_buffer(*x, at::kLong, "a count buffer");
  TORCH_CHECK(q32.dim() == 3 && result.dim() == 3 && result.size(0) == q32.size(0) && result.size(1) == q32.size(1),
              "StepPlan: q32 must be [B, H_q, D] and result [B, H_q, D_v]");
  const int64_t chunks = chunk_req.size(0), heads = q32.size(1);
  m2 = m.view({chunks, heads});
  l2 = l.view({chunks, heads});
  o2 = o.view({chunks, heads, result.size(2)});
}

LayerStep::LayerStep(Named& n)
    : k_cache(n.tensor("k_cache")), v_cache(n.tensor("v_cache")), lo(n.tensor("lo")), scale(n.tensor("scale")),
      radius(n.tensor("radius")), codes(n.tensor("codes")), sigma(n.real("sigma")), budget(n.real("budget")),
      t_fixed(n.real("t_fixed")), gate_rel(n.real("gate_rel")), fallback_fraction(n.real("fallback_fraction")),
      eps_budget(n.real("eps_budget")), rounding(n.real("rounding")), estimate_share(n.real("estimate_share")),
      value_gate(n.flag("value_gate")), one_pass(n.flag("one_pass")), a_posteriori(n.flag("a_posteriori")),
      one_scan(n.flag("one_scan")), residual_weights(n.flag("residual_weights")),
      bits(n.integer("bits")), page_size(n.integer("page_size")), reserve_offset(n.integer("reserve_offset")),
      edges(Edges::read(n)) {
  n.done();
  TORCH_CHECK(eps_budget < 0 || (budget < 0 && !value_gate), "LayerStep: a certified step has no budget or value gate");
  TORCH_CHECK(!a_posteriori || (eps_budget >= 0 && estimate_share > 0),
              "LayerStep: a_posteriori is a certified rule with a positive estimate_share");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && codes.device().is_cpu(),
              "LayerStep: the KV caches and the index must be CPU tensors");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3 && k_cache.size(0) == v_cache.size(0) &&
                  k_cache.size(1) == v_cache.size(1) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "LayerStep: k/v caches must be contiguous [slots, H_kv, D]");
  TORCH_CHECK(lo.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "LayerStep: the V cache and the index codebooks must use the K cache's dtype");
}

std::tuple<torch::Tensor, torch::Tensor, bool> LayerStep::run(const torch::Tensor& q, StepPlan& p,
                                                              std::optional<torch::Tensor> out,
                                                              std::optional<torch::Tensor> attended,
                                                              std::optional<torch::Tensor> share) const {
  const int64_t B = p.q32.size(0), H = p.q32.size(1), D = p.q32.size(2), DV = p.result.size(2);
  TORCH_CHECK_VALUE(q.dim() == 3 && q.size(0) == B && q.size(1) == H && q.size(2) == D,
                    "louver step: the plan is for queries [B, H_q, D] = [", B, ", ", H, ", ", D, "], got q ",
                    q.sizes());
  TORCH_CHECK_VALUE(D == k_cache.size(2) && DV == v_cache.size(2) && H % k_cache.size(1) == 0,
                    "louver step: the plan's buffers do not fit this layer's KV caches");
  TORCH_CHECK_VALUE(q.device().is_cpu() && at::isFloatingType(q.scalar_type()),
                    "louver step: q must be a float CPU tensor");
  if (out.has_value())
    TORCH_CHECK_VALUE(out->device().is_cpu() && out->dim() == 3 && out->size(0) == B && out->size(1) == H &&
                          out->size(2) == DV && at::isFloatingType(out->scalar_type()),
                      "louver step: out must be a float CPU tensor [B, H_q, D_v] like the result");
  const double* shares = nullptr;
  if (share.has_value()) {
    TORCH_CHECK_VALUE(a_posteriori, "louver step: a share per request is for the a-posteriori rule only");
    TORCH_CHECK_VALUE(share->device().is_cpu() && share->scalar_type() == at::kDouble && share->is_contiguous() &&
                          share->dim() == 1 && share->size(0) == B,
                      "louver step: share must be a contiguous fp64 CPU tensor [B] = [", B, "], got ", share->sizes());
    shares = share->data_ptr<double>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK_VALUE(std::isfinite(shares[b]) && shares[b] > 0, "louver step: share[", b, "] = ", shares[b],
                        " is not a positive finite number");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "louver_step_q", [&] {
    copy_heads(q.data_ptr<scalar_t>(), strides3(q), p.q32.data_ptr<float>(), strides3(p.q32), B, H, D);
  });
  const ExactArgs e = exact_args(p.q32, k_cache, p.dense_slots, p.dense_req, p.sample_slots, p.sample_req, sigma,
                                 budget, p.s_dense, p.sample, p.ref, p.z, p.t);
  AttendArgs a = attend_args(p.q32, k_cache, v_cache, codes, p.page_ids, p.chunk_req, p.chunk_begin, p.chunk_end,
                             p.t, p.gate, p.ref, sigma, bits, page_size, p.m, p.l, p.o, p.counts, p.mass);
  a.residual = residual_weights;
  if (attended.has_value()) {
    TORCH_CHECK_VALUE(attended->device().is_cpu() && attended->is_contiguous() &&
                          attended->scalar_type() == at::kByte &&
                          attended->numel() == p.page_ids.size(0) * page_size * H,
                      "louver step: attended must be a contiguous uint8 CPU tensor [page rows, P, H_q]");
    a.attended = attended->data_ptr<uint8_t>();
  }
  const MergeArgs g = merge_args(p.s_dense, p.dense_slots, p.dense_req, v_cache, p.m2, p.l2, p.o2, p.chunk_req, sigma,
                                 p.result);
  const bool certified = eps_budget >= 0;
  bool totals_summed = false;  // the one-pass check already summed the final attend pass's chunks
  std::vector<int64_t> unskipped;  // a-posteriori: pages the lowered levels keep, per (request, head)
  std::vector<uint8_t> lowered(B * H, 0);  // heads whose first level failed its check
  // one scan: per (request, head) the pages below T, per request the pages read (−1: the request
  // took the two passes, whose attend pass counted them)
  std::vector<int64_t> scan_counts, scan_read;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "louver_step", [&] {
    const auto run_with = [&](const AttendArgs& args, int phases) {
      run_phases(e, args, g, k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), lo.data_ptr<scalar_t>(),
                 scale.data_ptr<scalar_t>(), radius.data_ptr<scalar_t>(), t_fixed, value_gate,
                 static_cast<float>(gate_rel), p.t.data_ptr<float>(), p.gate.data_ptr<float>(), phases);
    };
    const auto run = [&](int phases) {
      if ((phases & kAttendMerge) && attended.has_value()) attended->zero_();  // the last attend pass's set
      run_with(a, phases);
    };
    if (!certified) return run(kAllPhases);
    run(kExactPart);  // ref and the exact masses, then T from every token bound (gate: −inf)
    const double* z = p.z.data_ptr<double>();
    double* z_lb = p.z_lb.data_ptr<double>();
    for (int64_t i = 0; i < B * H; ++i) z_lb[i] = z[2 * i] + z[2 * i + 1];
    CertifiedPass c;
    c.q = p.q32, c.page_ids = p.page_ids, c.page_req = p.page_req, c.lo = lo, c.scale = scale, c.radius = radius;
    c.codes = codes, c.ref = p.ref, c.z_lb = p.z_lb, c.sigma = sigma, c.eps_budget = eps_budget;
    c.rounding = rounding, c.bits = bits, c.page_size = page_size, c.edges = edges, c.residual = residual_weights;
    c.hist = p.hist, c.habs = p.habs, c.t = p.t, c.certificate = p.certificate;
    if (a_posteriori && one_pass && p.page_ids.numel() > 0) {  // the one-pass rule a posteriori
      std::vector<double> z_est(B * H);
      estimated_z(p, estimate_share, shares, z_est.data());
      provisional_levels(p, z_est.data(), sigma, eps_budget, rounding);
      AttendArgs first = a;
      first.tight_dropped = true;  // the check needs each dropped token's own bound mass
      if (attended.has_value()) attended->zero_();
      run_with(first, kAttend);
      chunk_totals_into(p.counts, p.mass, p.chunk_req, p.per_head, p.per_req, p.masses);
      const std::vector<uint8_t> again_req = lower_to_safe(p, sigma, eps_budget, rounding, lowered.data());
      if (std::find(again_req.begin(), again_req.end(), 1) != again_req.end()) {
        // the KV groups with a lowered head attend again at their final levels (a superset of the
        // first pass's set: their chunk states are replaced); the other groups' levels did not
        // move, and they keep the first pass's states. A failed check lowers one group of three
        // in most cases (captured text and random tokens at 16K / 8K, shares 5.66 and 8).
        const int64_t h_kv = k_cache.size(1), G = H / h_kv;
        std::vector<uint8_t> again_kv(B * h_kv, 0);
        for (int64_t i = 0; i < B * H; ++i)
          if (lowered[i]) again_kv[(i / H) * h_kv + (i % H) / G] = 1;
        AttendArgs again = a;
        again.only_req = again_req.data(), again.only_kv = again_kv.data();
        run_with(again, kAttend);
      }
      return run_with(a, kMerge);
    }
    if (a_posteriori && !one_pass && p.page_ids.numel() > 0) {  // no indexed page: the histogram path
      TORCH_CHECK(p.band_m.numel() > 0, "louver step: an a-posteriori layer needs a plan with band buffers");
      torch::Tensor z_est = p.z_lb.clone();  // the first level's denominator (z_lb keeps the exact part's)
      estimated_z(p, estimate_share, shares, z_est.data_ptr<double>());
      c.z_lb = z_est;
      run_certified_pass(c);
      const std::vector<float> reserve_levels = histogram_levels(p, sigma, eps_budget, rounding, edges);
      AttendArgs first = a;  // at T0, keeping in the reserve what the band may need
      first.t_reserve = reserve_levels.data(), first.page_bound_out = p.band_pb.data_ptr<float>();
      first.page_mag = p.band_mag.data_ptr<float>();
      first.reserve_slot = p.reserve_slot.data_ptr<int64_t>(), first.reserve_pos = p.reserve_pos.data_ptr<int64_t>();
      first.reserve_bound = p.reserve_bound.data_ptr<float>(), first.reserve_count = p.reserve_count.data_ptr<int64_t>();
      if (attended.has_value()) attended->zero_();  // both passes add to the set
      run_with(first, kAttend);
      chunk_totals_into(p.counts, p.mass, p.chunk_req, p.per_head, p.per_req, p.masses);
      const torch::Tensor t0 = p.t.clone();
      const std::vector<uint8_t> band = lower_uncertified(p, sigma, eps_budget, rounding, edges, lowered.data());
      if (std::find(band.begin(), band.end(), 1) != band.end()) {
        AttendArgs ab = first;  // the band: the reserve's keys at the lowered levels
        ab.t_reserve = nullptr, ab.page_bound_out = nullptr, ab.band = true, ab.band_req = band.data();
        ab.m_out = p.band_m.data_ptr<float>(), ab.l_out = p.band_l.data_ptr<float>();
        ab.o_out = p.band_o.data_ptr<float>(), ab.counts = p.band_counts.data_ptr<int64_t>();
        ab.mass = p.band_mass.data_ptr<double>();
        run_with(ab, kAttend);
        combine_band(p);
        unskipped = unskipped_pages(p, t0);
      }
      return run_with(a, kMerge);
    }
    if (!one_pass && one_scan && p.page_ids.numel() > 0) {  // the histogram rule in one scan of the codes
      TORCH_CHECK(p.band_m.numel() > 0, "louver step: a one-scan certified layer needs a plan with band buffers");
      std::vector<float> level;
      std::vector<int64_t> level_bin, edge(B * H);
      reserve_levels(p, sigma, eps_budget, rounding, edges, reserve_offset, level, level_bin);
      std::vector<int64_t> pages_read(B);
      ScanPass s{lo, scale, radius, codes, p.q32.data_ptr<float>(), p.page_ids.data_ptr<int64_t>(),
                 p.chunk_req.data_ptr<int64_t>(), p.chunk_begin.data_ptr<int64_t>(), p.chunk_end.data_ptr<int64_t>(),
                 B, k_cache.size(1), H / k_cache.size(1), D, p.chunk_req.size(0), bits, page_size,
                 p.ref.data_ptr<float>(), level.data(), p.z_lb.data_ptr<double>(), level_bin.data(), sigma,
                 eps_budget, rounding, edges, p.hist.data_ptr<double>(), p.habs.data_ptr<double>(),
                 p.certificate.data_ptr<double>(), p.t.data_ptr<float>(), p.band_pb.data_ptr<float>(),
                 p.band_mag.data_ptr<float>(), p.reserve_bound.data_ptr<float>(), edge.data(),
                 p.reserve_slot.data_ptr<int64_t>(), p.reserve_pos.data_ptr<int64_t>(),
                 p.reserve_count.data_ptr<int64_t>(), pages_read.data(), residual_weights};
      run_scan_pass(s);
      // a head whose T lies below its reserve level (possible only where a term is not finite)
      // needs tokens the reserve lacks: its request takes the two passes
      std::vector<uint8_t> scanned(B, 1), rest(B, 0);
      for (int64_t i = 0; i < B * H; ++i)
        if (edge[i] < level_bin[i]) scanned[i / H] = 0, rest[i / H] = 1;
      if (attended.has_value()) attended->zero_();
      AttendArgs ab = a;  // the scanned requests: the reserve's tokens at T
      ab.band = true, ab.band_req = scanned.data(), ab.only_req = scanned.data();
      ab.page_mag = p.band_mag.data_ptr<float>();
      ab.reserve_slot = p.reserve_slot.data_ptr<int64_t>(), ab.reserve_pos = p.reserve_pos.data_ptr<int64_t>();
      ab.reserve_bound = p.reserve_bound.data_ptr<float>(), ab.reserve_count = p.reserve_count.data_ptr<int64_t>();
      run_with(ab, kAttend);
      if (std::find(rest.begin(), rest.end(), 1) != rest.end()) {
        const torch::Tensor t_kept = p.t.clone(), cert_kept = p.certificate.clone();
        run_certified_pass(c);
        keep_rows(std::vector<char>(rest.begin(), rest.end()), t_kept, p.t, cert_kept, p.certificate);
        AttendArgs af = a;
        af.only_req = rest.data();
        run_with(af, kAttend);
      }
      run_with(a, kMerge);
      scan_counts = pages_below(p);
      for (int64_t b = 0; b < B; ++b) {
        if (!scanned[b]) std::fill_n(scan_counts.begin() + b * H, H, int64_t(-1));
        scan_read.push_back(scanned[b] ? pages_read[b] : -1);
      }
      return;
    }
    if (!one_pass) {
      run_certified_pass(c);
      return run(kAttendMerge);
    }
    provisional_levels(p, z_lb, sigma, eps_budget, rounding);
    run(kAttendMerge);
    chunk_totals_into(p.counts, p.mass, p.chunk_req, p.per_head, p.per_req, p.masses);
    const std::vector<char> failed = certify_provisional(p, eps_budget, rounding, lowered.data());
    totals_summed = std::find(failed.begin(), failed.end(), 1) == failed.end();
    if (totals_summed) return;
    // the rare path: the certified pass (every request), then the passing requests' provisional
    // T and certificate put back, and one more attend pass
    const torch::Tensor t_kept = p.t.clone(), cert_kept = p.certificate.clone();
    run_certified_pass(c);
    keep_rows(failed, t_kept, p.t, cert_kept, p.certificate);
    run(kAttendMerge);
  });
  if (!totals_summed) chunk_totals_into(p.counts, p.mass, p.chunk_req, p.per_head, p.per_req, p.masses);
  int64_t* per_head = p.per_head.data_ptr<int64_t>();
  for (int64_t i = 0; i < static_cast<int64_t>(unskipped.size()); ++i) per_head[2 * i + 1] -= unskipped[i];
  for (int64_t i = 0; i < static_cast<int64_t>(scan_counts.size()); ++i)
    if (scan_counts[i] >= 0) per_head[2 * i + 1] = scan_counts[i];
  for (int64_t b = 0; b < static_cast<int64_t>(scan_read.size()); ++b)
    if (scan_read[b] >= 0) p.per_req.data_ptr<int64_t>()[3 * b + 2] = scan_read[b];
  torch::Tensor packed = torch::empty({B, H + 1, kStatsWidth}, torch::TensorOptions().dtype(torch::kDouble));
  const bool any = step_stats_packed(p.t.data_ptr<float>(), p.z.data_ptr<double>(), p.per_head.data_ptr<int64_t>(),
                                     p.per_req.data_ptr<int64_t>(), p.masses.data_ptr<double>(),
                                     certified ? p.certificate.data_ptr<double>() : nullptr, lowered.data(),
                                     p.num_indexed.data_ptr<int64_t>(), B, H, fallback_fraction, k_cache.size(1),
                                     packed.data_ptr<double>());
  torch::Tensor dest = out.has_value() ? *out : torch::empty({B, H, DV}, torch::TensorOptions().dtype(q.scalar_type()));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dest.scalar_type(), "louver_step_out", [&] {
    copy_heads(p.result.data_ptr<float>(), strides3(p.result), dest.data_ptr<scalar_t>(), strides3(dest), B, H, DV);
  });
  return {dest, packed, any};
}
