// One whole decode step of the policies whose T needs no bound pass (budget, fixed, dense) in a
// single call and a single parallel region: exact part -> T and value gate per head -> attend ->
// merge, then the per-request totals. Separate ops would cost a round trip through Python and a
// fresh parallel region per phase; on a two-core machine both were a large part of a 32K step.

#include "attend.h"
#include "exact_merge.h"
#include "ops.h"

#include <omp.h>

using namespace louver_cpu;

namespace {

// The phases in one parallel region (a pragma cannot sit inside the dtype-dispatch macro).
template <typename KV>
void run_phases(const ExactArgs& e, const AttendArgs& a, const MergeArgs& g, const KV* kc, const KV* vc, const KV* lo,
                const KV* sc, const KV* rad, double t_fixed, bool value_gate, float* tp, float* gp) {
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> key(e.D), scratch;
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
    attend_worker(a, kc, vc, lo, sc, rad, next);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t task = 0; task < g.B * g.h_kv; ++task) merge_tasks(g, vc, task, task + 1);
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

// fused_step, then the step statistics (step_stats) and the output in the caller's dtype, in one
// call. After a layer has swept the caches each Python-level op of a step's host work costs tens
// of microseconds (the interpreter's and torch's own code and data come back from memory), so at
// batch 1 three ops and the glue between them were a sixth of a 32K step.
// Inputs as fused_step (its outputs are the caller-owned scratch buffers; q may be any float
// dtype, the step runs on its fp32 copy), plus num_indexed [B] i64 and fallback_fraction as
// step_stats, and out: [B, H_q, Dv] in any float dtype, or None for a new tensor in q's dtype.
// Returns (out, then step_stats' threshold, candidates, pages_skipped, mass_bound,
// dense_fallback, then its counts split into union_candidates, values_read, pages_read [B] i64,
// and whether any request falls back to dense; out then still holds the sparse result for it).
FusedDecodeResult fused_decode(
    torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor lo, torch::Tensor scale,
    torch::Tensor radius, torch::Tensor codes, torch::Tensor dense_slots, torch::Tensor dense_req,
    torch::Tensor sample_slots, torch::Tensor sample_req, torch::Tensor page_ids, torch::Tensor chunk_req,
    torch::Tensor chunk_begin, torch::Tensor chunk_end, double sigma, double budget, double t_fixed, bool value_gate,
    int64_t bits, int64_t page_size, torch::Tensor s_dense, torch::Tensor sample, torch::Tensor ref, torch::Tensor z,
    torch::Tensor t, torch::Tensor gate, torch::Tensor m_out, torch::Tensor l_out, torch::Tensor o_out,
    torch::Tensor counts, torch::Tensor mass, torch::Tensor result, torch::Tensor per_head, torch::Tensor per_req,
    torch::Tensor masses, torch::Tensor num_indexed, double fallback_fraction, std::optional<torch::Tensor> out) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() && codes.device().is_cpu(),
              "fused_decode: q, the KV caches and the index must be CPU tensors");
  if (out.has_value())
    TORCH_CHECK(out->sizes() == result.sizes(), "fused_decode: out must be [B, H_q, Dv] like the result");
  const torch::Tensor q32 = q.scalar_type() == at::kFloat && q.is_contiguous() ? q : q.to(at::kFloat).contiguous();
  fused_step(q32, k_cache, v_cache, lo, scale, radius, codes, dense_slots, dense_req, sample_slots, sample_req,
             page_ids, chunk_req, chunk_begin, chunk_end, sigma, budget, t_fixed, value_gate, bits, page_size, s_dense,
             sample, ref, z, t, gate, m_out, l_out, o_out, counts, mass, result, per_head, per_req, masses);
  auto [threshold, candidates, skipped, bound, fallback, totals, any] =
      step_stats(t, z, per_head, per_req, masses, torch::empty({0}, z.options()), num_indexed, fallback_fraction,
                 k_cache.size(1));
  torch::Tensor dest =
      out.has_value() ? out->copy_(result) : result.to(q.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  return {dest, threshold, candidates, skipped, bound, fallback,
          totals.select(1, 0), totals.select(1, 1), totals.select(1, 2), any};
}
