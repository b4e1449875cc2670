// The step statistics from the compiled step's totals, as one op: at batch 1 the two dozen small
// tensor ops that computed them in Python cost a sixth of a whole step.

#include <cmath>
#include <tuple>

#include "ops.h"

namespace {

// torch.maximum's NaN rule: NaN if either is NaN.
double nan_max(double a, double b) { return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b); }

}  // namespace

// fused.step_stats_reference is the specification. t [B, H_q] f32; z [B, H_q, 2] f64 (masses of
// the dense part and the sample); per_head [B, H_q, 2] i64 (attended, pages skipped); per_req
// [B, 3] i64 (union candidates, values read, pages read); masses [B, H_q, 3] f64; index_dropped
// [B, H_q] f64, or empty to use masses[..., 0]; num_indexed [B] i64 -> new tensors (threshold
// [B, H_q] f32, candidates [B, H_q] i64, pages_skipped [B, H_q] i64, mass_bound [B, H_q] f64,
// dense_fallback [B] bool, counts [B, 3] i64) and whether any request falls back to dense.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, bool> step_stats(
    torch::Tensor t, torch::Tensor z, torch::Tensor per_head, torch::Tensor per_req, torch::Tensor masses,
    torch::Tensor index_dropped, torch::Tensor num_indexed, double fallback_fraction, int64_t h_kv) {
  const int64_t B = t.size(0), H = t.size(1);
  TORCH_CHECK(t.is_contiguous() && z.is_contiguous() && per_head.is_contiguous() && per_req.is_contiguous() &&
                  masses.is_contiguous() && num_indexed.is_contiguous() && index_dropped.is_contiguous(),
              "step_stats: inputs must be contiguous");
  TORCH_CHECK(index_dropped.numel() == 0 || index_dropped.numel() == B * H, "step_stats: index_dropped must be [B, H_q]");
  const auto i64 = torch::TensorOptions().dtype(torch::kLong);
  torch::Tensor threshold = t.clone(), candidates = torch::empty({B, H}, i64), skipped = torch::empty({B, H}, i64);
  torch::Tensor bound = torch::empty({B, H}, i64.dtype(torch::kDouble));
  torch::Tensor fallback = torch::empty({B}, i64.dtype(torch::kBool)), counts = per_req.clone();
  const double* zp = z.data_ptr<double>();
  const double* mp = masses.data_ptr<double>();
  const double* dp = index_dropped.numel() ? index_dropped.data_ptr<double>() : nullptr;
  const int64_t* ph = per_head.data_ptr<int64_t>();
  const int64_t* pr = per_req.data_ptr<int64_t>();
  const int64_t* ni = num_indexed.data_ptr<int64_t>();
  int64_t* cand = candidates.data_ptr<int64_t>();
  int64_t* skip = skipped.data_ptr<int64_t>();
  double* bd = bound.data_ptr<double>();
  bool* fb = fallback.data_ptr<bool>();
  bool any = false;
  for (int64_t b = 0; b < B; ++b) {
    // the torch path's comparison: int64 count against the fp32 product fraction · max(N·H_kv, 1)
    const float limit = static_cast<float>(fallback_fraction) * static_cast<float>(std::max<int64_t>(ni[b] * h_kv, 1));
    fb[b] = static_cast<float>(pr[b * 3]) > limit;
    any |= fb[b];
    for (int64_t h = 0; h < H; ++h) {
      const int64_t i = b * H + h;
      const double z_final = nan_max(zp[2 * i] + zp[2 * i + 1], zp[2 * i] + mp[3 * i + 2]);
      const double dropped = dp ? dp[i] : mp[3 * i];
      bd[i] = fb[b] ? 0.0 : (dropped + mp[3 * i + 1]) / z_final;
      cand[i] = fb[b] ? ni[b] : ph[2 * i];
      skip[i] = ph[2 * i + 1];
    }
  }
  return {threshold, candidates, skipped, bound, fallback, counts, any};
}
