// The ops of the compiled CPU module, each declared once (bound in module.cpp; every argument by
// name, see named.h; shapes in each definition's comment).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

#include "named.h"

// Phases of the step as ops of their own, for the tests against their torch specifications.
void exact_part(louver_cpu::Named& args);
void merge_chunks(louver_cpu::Named& args);
void chunk_totals(louver_cpu::Named& args);
std::tuple<torch::Tensor, bool> step_stats(louver_cpu::Named& args);
void certified_threshold(louver_cpu::Named& args);
void fused_step(louver_cpu::Named& args);
std::tuple<double, double> exp_ps16_error(double lo, double hi);
std::tuple<double, double> exp_up_ratio(double lo, double hi);
std::tuple<int64_t, double> weight_rule_of_build(int64_t bits);
int64_t page_setup_mismatches(const torch::Tensor& q, const torch::Tensor& lo, const torch::Tensor& scale,
                              const torch::Tensor& radius, int64_t bits);

namespace louver_cpu {

// The certified threshold's pass over the codes (bounds.cpp), shared by the op and LayerStep.
struct CertifiedPass {
  torch::Tensor q, page_ids, page_req, lo, scale, radius, codes, ref, z_lb;
  double sigma = 0.0, eps_budget = 0.0, rounding = 0.0;
  int64_t bits = 0, page_size = 0;
  Edges edges;
  torch::Tensor hist, habs, t, certificate;
  torch::Tensor tok, pb;  // empty, or the int8 token bounds and page bounds (tests)
  bool residual = false;  // residual int8 weights (AttendArgs::residual)
};
void run_certified_pass(const CertifiedPass& c);
// The certified histogram rule in one scan of the codes (scan_pass.cpp), inside LayerStep: raw
// views of the step plan's buffers. Inputs: q [B, H_q, D] f32, page_ids [NP], chunk_req /
// chunk_begin / chunk_end [NC] (the attend pass's chunks), lo/scale/radius/codes of the layer,
// ref, z_lb [B, H_q], level [B, H_q] f32 and level_bin [B, H_q] (per head the reserve level, the
// fp32 T of edge level_bin, −inf and −1 for none). Outputs: hist, habs, t, certificate and the
// chosen edge [B, H_q] (as the two-pass rule's bound pass), page_bound and page_mag [NP, H_q], the
// reserve of each (chunk, KV head) in AttendArgs's layout (slot, pos, bound, count) and
// pages_read [B] (pages whose codes were read).
struct ScanPass {
  torch::Tensor lo, scale, radius, codes;
  const float* q;
  const int64_t *page_ids, *chunk_req, *chunk_begin, *chunk_end;
  int64_t batch, h_kv, groups, dim, n_chunks, bits, page_size;
  const float *ref, *level;
  const double* z_lb;
  const int64_t* level_bin;
  double sigma, eps_budget, rounding;
  Edges edges;
  double *hist, *habs, *certificate;
  float *t, *page_bound, *page_mag, *reserve_bound;
  int64_t *edge, *reserve_slot, *reserve_pos, *reserve_count, *pages_read;
  bool residual = false;  // residual int8 weights (AttendArgs::residual)
};
void run_scan_pass(const ScanPass& s);
// The histograms from per-thread partials [threads, rows, 3, W] into hist and habs [rows, W], T
// per row by the histogram rule, its certificate and (when edge_out is given) its edge (bounds.cpp).
void choose_thresholds(const double* part, int64_t threads, int64_t rows, int64_t W, double* hist, double* habs,
                       const double* z_lb, const float* ref, double sigma, double eps_budget, double rounding,
                       const Edges& edges, float* t, double* certificate, int64_t* edge_out);
// fp32 T of edge j (threshold.edge_threshold; bounds.cpp).
float edge_threshold(int64_t j, float ref, double sigma, const Edges& edges);
// The largest edge whose bound (the cumulative sums of one row of hist and habs [W], plus rounding
// times the absolute ones: threshold.histogram_bound) fits budget, and that bound in fit (−1 and 0
// where none does; bounds.cpp).
int64_t fitting_edge(const double* hist, const double* habs, int64_t W, double budget, double rounding,
                     const Edges& edges, double* fit);

}  // namespace louver_cpu

// The plan side of the one-call step, made once per forward pass and shared by every layer: the
// plan's tensors (dense_slots, dense_req, sample_slots, sample_req, page_ids, chunk_req,
// chunk_begin, chunk_end, num_indexed, page_req; i64) and the step's scratch buffers (q32 [B, H_q,
// D], then fused_step's outputs: s_dense, sample, ref, z, t, gate, m, l, o, counts, mass, result,
// per_head, per_req, masses; then the certified threshold's: z_lb [B, H_q], hist, habs,
// certificate, all f64), each by its name.
struct StepPlan {
  explicit StepPlan(louver_cpu::Named& args);
  torch::Tensor dense_slots, dense_req, sample_slots, sample_req, page_ids, chunk_req, chunk_begin, chunk_end,
      num_indexed, page_req;
  torch::Tensor q32, s_dense, sample, ref, z, t, gate, m, l, o, counts, mass, result, per_head, per_req, masses;
  torch::Tensor z_lb, hist, habs, certificate;
  torch::Tensor m2, l2, o2;  // m, l, o viewed as [NC, H_q] / [NC, H_q, D_v] for the merge
  // the a-posteriori rule's band pass: chunk states shaped like m, l, o, counts and mass (empty
  // when the layer's policy has no band pass or one-scan reserve)
  torch::Tensor band_m, band_l, band_o, band_counts, band_mass;
  // and the first pass's page bounds and page magnitudes (page_terms' mag) [NP, H_q] f32 and
  // reserve (AttendArgs::t_reserve; the one-scan certified step's too, run_scan_pass): slot, pos
  // [NP·P·H_kv] i64, bound [NP·P·H_kv, G] f32, count [NC, H_kv] i64
  torch::Tensor band_pb, band_mag, reserve_slot, reserve_pos, reserve_bound, reserve_count;
};

// The layer side, made once per layer: its KV caches, its index (lo, scale, radius, codes) and the
// policy's scalars by name: sigma; budget (>= 0: the sample rule's T for that fraction; < 0: T =
// t_fixed, −inf for the dense policy); value_gate with its margin gate_rel (the gate level is T −
// gate_rel·(|T| + 1)); bits, page_size; fallback_fraction; eps_budget (>= 0: the certified T of
// the certified pass with that budget, rounding and the edges edge_low/edge_step/edge_count/
// edge_margin, its certificate as the index-dropped mass, no value gate; with one_pass the attend
// pass first gates at the provisional level and certifies its own dropped mass, and only requests
// whose check fails take that certified pass and a second attend pass; with a_posteriori the
// certified pass picks the first level against the estimate of Z (estimate_share), and heads whose
// certificate does not fit the exact mass of what the attend pass attended are lowered, their
// band attended from the first pass's reserve into the plan's band buffers; with one_scan the
// histogram rule's pass also keeps every token reaching the safe level in the plan's reserve and
// the attend pass reads that reserve at T instead of the codes, run_scan_pass; reserve_offset: its
// level in edges from the safe level's, see CpuLaunch; residual_weights: the token bounds' residual
// int8 weights, AttendArgs::residual). run(q, plan, out) is
// fused_step (certified: with the threshold's pass), then the packed statistics (stats.h) and the
// output in out (or a new tensor of q's dtype), in one call (attended, debug only: a u8 [NP, P, H_q]
// buffer the attend pass fills with the keys it attended, see AttendArgs::attended): at batch 1 each Python-level op or
// argument of a step costs microseconds once a layer has swept the caches. Returns (out, packed
// statistics, whether any request falls back to dense; the caller then replaces those requests'
// rows, their sparse result is in out).
struct LayerStep {
  explicit LayerStep(louver_cpu::Named& args);
  std::tuple<torch::Tensor, torch::Tensor, bool> run(const torch::Tensor& q, StepPlan& plan,
                                                     std::optional<torch::Tensor> out,
                                                     std::optional<torch::Tensor> attended,
                                                     std::optional<torch::Tensor> share) const;
  torch::Tensor k_cache, v_cache, lo, scale, radius, codes;
  double sigma, budget, t_fixed, gate_rel, fallback_fraction, eps_budget, rounding, estimate_share;
  bool value_gate, one_pass, a_posteriori, one_scan, residual_weights;
  int64_t bits, page_size, reserve_offset;
  louver_cpu::Edges edges;
};
