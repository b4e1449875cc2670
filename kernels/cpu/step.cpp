// One whole decode step in a single call: exact part -> T and value gate per head -> attend ->
// merge, then the per-request totals (one parallel region; certified steps choose T by a bound
// pass between the exact part and the attend pass). Separate ops would cost a round trip through Python and a
// fresh parallel region per phase; on a two-core machine both were a large part of a 32K step.

#include "attend.h"
#include "exact_merge.h"
#include "ops.h"
#include "stats.h"

#include <omp.h>

#include <array>
#include <vector>

using namespace louver_cpu;

namespace {

enum Phases { kExactPart = 1, kAttendMerge = 2, kAllPhases = 3 };

// The phases in one parallel region (a pragma cannot sit inside the dtype-dispatch macro): the
// exact part with T and the value gate per head, then attend and merge. Certified steps run them
// as two regions with the threshold's bound pass between.
template <typename KV>
void run_phases(const ExactArgs& e, const AttendArgs& a, const MergeArgs& g, const KV* kc, const KV* vc, const KV* lo,
                const KV* sc, const KV* rad, double t_fixed, bool value_gate, float* tp, float* gp,
                int phases = kAllPhases) {
  std::atomic<int64_t> next{0};
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
        gp[bh] = value_gate ? value_gate_threshold(tp[bh]) : -INFINITY;
      }
    }
    if (phases & kAttendMerge) {
      attend_worker(a, kc, vc, lo, sc, rad, next);
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t task = 0; task < g.B * g.h_kv; ++task) merge_tasks(g, vc, task, task + 1);
    }
  }
}

}  // namespace

// Inputs as for exact_part and grid_sparse_attend; budget >= 0: T is the sample rule's, else
// t_fixed (−inf for the dense policy); value_gate: gate = threshold.gate_threshold(T), else −inf.
// Outputs (all written): s_dense, sample, ref, z, t, gate [B, H_q] f32, the attend outputs m, l, o,
// counts, mass, result [B, H_q, Dv] f32, and the chunk totals per_head, per_req, masses.
void fused_step(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor lo, torch::Tensor scale,
                torch::Tensor radius, torch::Tensor codes, torch::Tensor dense_slots, torch::Tensor dense_req,
                torch::Tensor sample_slots, torch::Tensor sample_req, torch::Tensor page_ids, torch::Tensor chunk_req,
                torch::Tensor chunk_begin, torch::Tensor chunk_end, double sigma, double budget, double t_fixed,
                bool value_gate, int64_t bits, int64_t page_size, torch::Tensor s_dense, torch::Tensor sample,
                torch::Tensor ref, torch::Tensor z, torch::Tensor t, torch::Tensor gate, torch::Tensor m_out,
                torch::Tensor l_out, torch::Tensor o_out, torch::Tensor counts, torch::Tensor mass,
                torch::Tensor result, torch::Tensor per_head, torch::Tensor per_req, torch::Tensor masses) {
  TORCH_CHECK(lo.scalar_type() == k_cache.scalar_type(), "index codebooks must use the KV dtype");
  const ExactArgs e = exact_args(q, k_cache, dense_slots, dense_req, sample_slots, sample_req, sigma, budget, s_dense,
                                 sample, ref, z, t);
  const AttendArgs a = attend_args(q, k_cache, v_cache, codes, page_ids, chunk_req, chunk_begin, chunk_end, t, gate,
                                   ref, sigma, bits, page_size, m_out, l_out, o_out, counts, mass);
  const MergeArgs g = merge_args(s_dense, dense_slots, dense_req, v_cache, m_out.view({a.n_chunks, a.h_q}),
                                 l_out.view({a.n_chunks, a.h_q}), o_out.view({a.n_chunks, a.h_q, a.dim_v}),
                                 chunk_req, sigma, result);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "fused_step", [&] {
    run_phases(e, a, g, k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), lo.data_ptr<scalar_t>(),
               scale.data_ptr<scalar_t>(), radius.data_ptr<scalar_t>(), t_fixed, value_gate, t.data_ptr<float>(),
               gate.data_ptr<float>());
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

}  // namespace

StepPlan::StepPlan(std::vector<torch::Tensor> plan_tensors, std::vector<torch::Tensor> buffers) {
  TORCH_CHECK(plan_tensors.size() == 10 && buffers.size() == 20, "StepPlan: expected 10 plan tensors and 20 buffers");
  dense_slots = plan_tensors[0], dense_req = plan_tensors[1], sample_slots = plan_tensors[2];
  sample_req = plan_tensors[3], page_ids = plan_tensors[4], chunk_req = plan_tensors[5];
  chunk_begin = plan_tensors[6], chunk_end = plan_tensors[7], num_indexed = plan_tensors[8];
  page_req = plan_tensors[9];
  for (const auto& x : plan_tensors) check_buffer(x, at::kLong, "a plan tensor");
  q32 = buffers[0], s_dense = buffers[1], sample = buffers[2], ref = buffers[3], z = buffers[4], t = buffers[5];
  gate = buffers[6], m = buffers[7], l = buffers[8], o = buffers[9], counts = buffers[10], mass = buffers[11];
  result = buffers[12], per_head = buffers[13], per_req = buffers[14], masses = buffers[15];
  z_lb = buffers[16], hist = buffers[17], habs = buffers[18], certificate = buffers[19];
  for (const auto* x : {&q32, &s_dense, &sample, &ref, &t, &gate, &m, &l, &o, &result})
    check_buffer(*x, at::kFloat, "an fp32 buffer");
  for (const auto* x : {&z, &mass, &masses, &z_lb, &hist, &habs, &certificate})
    check_buffer(*x, at::kDouble, "an fp64 buffer");
  for (const auto* x : {&counts, &per_head, &per_req}) check_buffer(*x, at::kLong, "a count buffer");
  TORCH_CHECK(q32.dim() == 3 && result.dim() == 3 && result.size(0) == q32.size(0) && result.size(1) == q32.size(1),
              "StepPlan: q32 must be [B, H_q, D] and result [B, H_q, D_v]");
  const int64_t n = chunk_req.size(0), heads = q32.size(1);
  m2 = m.view({n, heads});
  l2 = l.view({n, heads});
  o2 = o.view({n, heads, result.size(2)});
}

LayerStep::LayerStep(torch::Tensor k_cache_, torch::Tensor v_cache_, torch::Tensor lo_, torch::Tensor scale_,
                     torch::Tensor radius_, torch::Tensor codes_, double sigma_, double budget_, double t_fixed_,
                     bool value_gate_, int64_t bits_, int64_t page_size_, double fallback_fraction_,
                     double eps_budget_, double rounding_)
    : k_cache(k_cache_), v_cache(v_cache_), lo(lo_), scale(scale_), radius(radius_), codes(codes_), sigma(sigma_),
      budget(budget_), t_fixed(t_fixed_), fallback_fraction(fallback_fraction_), eps_budget(eps_budget_),
      rounding(rounding_), value_gate(value_gate_), bits(bits_), page_size(page_size_) {
  TORCH_CHECK(eps_budget < 0 || (budget < 0 && !value_gate), "LayerStep: a certified step has no budget or value gate");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && codes.device().is_cpu(),
              "LayerStep: the KV caches and the index must be CPU tensors");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3 && k_cache.size(0) == v_cache.size(0) &&
                  k_cache.size(1) == v_cache.size(1) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "LayerStep: k/v caches must be contiguous [slots, H_kv, D]");
  TORCH_CHECK(lo.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "LayerStep: the V cache and the index codebooks must use the K cache's dtype");
}

std::tuple<torch::Tensor, torch::Tensor, bool> LayerStep::run(const torch::Tensor& q, StepPlan& p,
                                                              std::optional<torch::Tensor> out) const {
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "louver_step_q", [&] {
    copy_heads(q.data_ptr<scalar_t>(), strides3(q), p.q32.data_ptr<float>(), strides3(p.q32), B, H, D);
  });
  const ExactArgs e = exact_args(p.q32, k_cache, p.dense_slots, p.dense_req, p.sample_slots, p.sample_req, sigma,
                                 budget, p.s_dense, p.sample, p.ref, p.z, p.t);
  const AttendArgs a = attend_args(p.q32, k_cache, v_cache, codes, p.page_ids, p.chunk_req, p.chunk_begin,
                                   p.chunk_end, p.t, p.gate, p.ref, sigma, bits, page_size, p.m, p.l, p.o, p.counts,
                                   p.mass);
  const MergeArgs g = merge_args(p.s_dense, p.dense_slots, p.dense_req, v_cache, p.m2, p.l2, p.o2, p.chunk_req, sigma,
                                 p.result);
  const bool certified = eps_budget >= 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "louver_step", [&] {
    const auto run = [&](int phases) {
      run_phases(e, a, g, k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), lo.data_ptr<scalar_t>(),
                 scale.data_ptr<scalar_t>(), radius.data_ptr<scalar_t>(), t_fixed, value_gate, p.t.data_ptr<float>(),
                 p.gate.data_ptr<float>(), phases);
    };
    if (!certified) return run(kAllPhases);
    run(kExactPart);  // ref and the exact masses, then T from every token bound (gate: −inf)
    const double* z = p.z.data_ptr<double>();
    double* z_lb = p.z_lb.data_ptr<double>();
    for (int64_t i = 0; i < B * H; ++i) z_lb[i] = z[2 * i] + z[2 * i + 1];
    static const torch::Tensor none = torch::empty({0});
    certified_threshold(p.q32, p.page_ids, p.page_req, lo, scale, radius, codes, p.ref, p.z_lb, sigma, eps_budget,
                        rounding, bits, page_size, p.hist, p.habs, p.t, p.certificate, none, none);
    run(kAttendMerge);
  });
  chunk_totals_into(p.counts, p.mass, p.chunk_req, p.per_head, p.per_req, p.masses);
  torch::Tensor packed = torch::empty({B, H + 1, 4}, torch::TensorOptions().dtype(torch::kDouble));
  const bool any = step_stats_packed(p.t.data_ptr<float>(), p.z.data_ptr<double>(), p.per_head.data_ptr<int64_t>(),
                                     p.per_req.data_ptr<int64_t>(), p.masses.data_ptr<double>(),
                                     certified ? p.certificate.data_ptr<double>() : nullptr,
                                     p.num_indexed.data_ptr<int64_t>(), B, H, fallback_fraction, k_cache.size(1),
                                     packed.data_ptr<double>());
  torch::Tensor dest = out.has_value() ? *out : torch::empty({B, H, DV}, torch::TensorOptions().dtype(q.scalar_type()));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dest.scalar_type(), "louver_step_out", [&] {
    copy_heads(p.result.data_ptr<float>(), strides3(p.result), dest.data_ptr<scalar_t>(), strides3(dest), B, H, DV);
  });
  return {dest, packed, any};
}
