// The ops of the compiled CPU module (bound in module.cpp; shapes in each definition's comment).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

void certified_threshold(torch::Tensor q, torch::Tensor page_ids, torch::Tensor page_req, torch::Tensor lo,
                         torch::Tensor scale, torch::Tensor radius, torch::Tensor codes, torch::Tensor ref,
                         torch::Tensor z_lb, double sigma, double eps_budget, double rounding, int64_t bits,
                         int64_t page_size, torch::Tensor hist, torch::Tensor habs, torch::Tensor t,
                         torch::Tensor certificate, torch::Tensor tok, torch::Tensor pb);
void grid_sparse_attend(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor lo,
                        torch::Tensor scale, torch::Tensor radius, torch::Tensor codes, torch::Tensor page_ids,
                        torch::Tensor chunk_req, torch::Tensor chunk_begin, torch::Tensor chunk_end, torch::Tensor t,
                        torch::Tensor t_gate, torch::Tensor ref, double sigma, int64_t bits, int64_t page_size,
                        torch::Tensor m_out, torch::Tensor l_out, torch::Tensor o_out, torch::Tensor counts,
                        torch::Tensor mass);
void exact_part(torch::Tensor q, torch::Tensor k_cache, torch::Tensor dense_slots, torch::Tensor dense_req,
                torch::Tensor sample_slots, torch::Tensor sample_req, double sigma, double budget,
                torch::Tensor s_dense, torch::Tensor sample, torch::Tensor ref, torch::Tensor z, torch::Tensor t);
void merge_chunks(torch::Tensor s_dense, torch::Tensor dense_slots, torch::Tensor dense_req, torch::Tensor v_cache,
                  torch::Tensor m, torch::Tensor l, torch::Tensor o, torch::Tensor chunk_req, double sigma,
                  torch::Tensor out);
void chunk_totals(torch::Tensor counts, torch::Tensor mass, torch::Tensor chunk_req, torch::Tensor per_head,
                  torch::Tensor per_req, torch::Tensor masses);
void fused_step(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor lo, torch::Tensor scale,
                torch::Tensor radius, torch::Tensor codes, torch::Tensor dense_slots, torch::Tensor dense_req,
                torch::Tensor sample_slots, torch::Tensor sample_req, torch::Tensor page_ids, torch::Tensor chunk_req,
                torch::Tensor chunk_begin, torch::Tensor chunk_end, double sigma, double budget, double t_fixed,
                bool value_gate, int64_t bits, int64_t page_size, torch::Tensor s_dense, torch::Tensor sample,
                torch::Tensor ref, torch::Tensor z, torch::Tensor t, torch::Tensor gate, torch::Tensor m_out,
                torch::Tensor l_out, torch::Tensor o_out, torch::Tensor counts, torch::Tensor mass,
                torch::Tensor result, torch::Tensor per_head, torch::Tensor per_req, torch::Tensor masses);
std::tuple<torch::Tensor, bool> step_stats(torch::Tensor t, torch::Tensor z, torch::Tensor per_head,
                                           torch::Tensor per_req, torch::Tensor masses, torch::Tensor index_dropped,
                                           torch::Tensor num_indexed, double fallback_fraction, int64_t h_kv);
std::tuple<double, double> exp_ps16_error(double lo, double hi);

// The plan side of the one-call step, made once per forward pass and shared by every layer: the
// plan's tensors (dense_slots, dense_req, sample_slots, sample_req, page_ids, chunk_req,
// chunk_begin, chunk_end, num_indexed, page_req; i64) and the step's scratch buffers (q32 [B, H_q,
// D], then fused_step's outputs in its order: s_dense, sample, ref, z, t, gate, m, l, o, counts,
// mass, result, per_head, per_req, masses; then the certified threshold's: z_lb [B, H_q], hist,
// habs, certificate, all f64).
struct StepPlan {
  StepPlan(std::vector<torch::Tensor> plan_tensors, std::vector<torch::Tensor> buffers);
  torch::Tensor dense_slots, dense_req, sample_slots, sample_req, page_ids, chunk_req, chunk_begin, chunk_end,
      num_indexed, page_req;
  torch::Tensor q32, s_dense, sample, ref, z, t, gate, m, l, o, counts, mass, result, per_head, per_req, masses;
  torch::Tensor z_lb, hist, habs, certificate;
  torch::Tensor m2, l2, o2;  // m, l, o viewed as [NC, H_q] / [NC, H_q, D_v] for the merge
};

// The layer side, made once per layer: its KV caches, its index (lo, scale, radius, codes) and the
// policy's scalars (as fused_step's; budget < 0: T = t_fixed; eps_budget >= 0: the certified T of
// certified_threshold with that budget and rounding, its certificate as the index-dropped mass,
// no value gate). run(q, plan, out) is fused_step (certified: with the threshold's pass),
// then the packed statistics (stats.h) and the output in out (or a new tensor of q's dtype), in
// one call: at batch 1 each Python-level op or argument of a step costs microseconds once a
// layer has swept the caches. Returns (out, packed statistics, whether any request falls back to
// dense; the caller then replaces those requests' rows, their sparse result is in out).
struct LayerStep {
  LayerStep(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor lo, torch::Tensor scale, torch::Tensor radius,
            torch::Tensor codes, double sigma, double budget, double t_fixed, bool value_gate, int64_t bits,
            int64_t page_size, double fallback_fraction, double eps_budget, double rounding);
  std::tuple<torch::Tensor, torch::Tensor, bool> run(const torch::Tensor& q, StepPlan& plan,
                                                     std::optional<torch::Tensor> out) const;
  torch::Tensor k_cache, v_cache, lo, scale, radius, codes;
  double sigma, budget, t_fixed, fallback_fraction, eps_budget, rounding;
  bool value_gate;
  int64_t bits, page_size;
};
