// The step statistics from the compiled step's totals, packed into one tensor: at batch 1 every
// tensor a step creates or op it runs costs microseconds once a layer has swept the caches.

#include <cmath>
#include <tuple>

#include "ops.h"
#include "stats.h"

namespace louver_cpu {

namespace {

// torch.maximum's NaN rule: NaN if either is NaN.
double nan_max(double a, double b) { return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b); }

}  // namespace

bool step_stats_packed(const float* t, const double* z, const int64_t* per_head, const int64_t* per_req,
                       const double* masses, const double* index_dropped, const uint8_t* lowered,
                       const int64_t* num_indexed, int64_t B, int64_t H, double fallback_fraction, int64_t h_kv,
                       double* packed) {
  bool any = false;
  for (int64_t b = 0; b < B; ++b) {
    // the torch path's comparison: int64 count against the fp32 product fraction · max(N·H_kv, 1)
    const float limit =
        static_cast<float>(fallback_fraction) * static_cast<float>(std::max<int64_t>(num_indexed[b] * h_kv, 1));
    const bool fallback = static_cast<float>(per_req[b * 3]) > limit;
    any |= fallback;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t i = b * H + h;
      const double z_final = nan_max(z[2 * i] + z[2 * i + 1], z[2 * i] + masses[3 * i + 2]);
      const double dropped = index_dropped ? index_dropped[i] : masses[3 * i];
      double* row = packed + (b * (H + 1) + h) * kStatsWidth;
      row[0] = t[i];
      row[1] = static_cast<double>(fallback ? num_indexed[b] : per_head[2 * i]);
      row[2] = static_cast<double>(per_head[2 * i + 1]);
      row[3] = fallback ? 0.0 : (dropped + masses[3 * i + 1]) / z_final;
      row[4] = lowered && lowered[i] ? 1.0 : 0.0;
    }
    double* row = packed + (b * (H + 1) + H) * kStatsWidth;
    row[0] = fallback ? 1.0 : 0.0;
    for (int j = 0; j < 3; ++j) row[1 + j] = static_cast<double>(per_req[b * 3 + j]);
    if (fallback) row[2] = static_cast<double>(num_indexed[b] * h_kv);  // dense attention reads every V row
    row[4] = 0.0;
  }
  return any;
}

}  // namespace louver_cpu

// reference_compiled.step_stats_reference is the specification. By name: t [B, H_q] f32; z [B, H_q, 2] f64
// (masses of the dense part and the sample); per_head [B, H_q, 2] i64 (attended, pages skipped);
// per_req [B, 3] i64 (union candidates, values read, pages read); masses [B, H_q, 3] f64;
// index_dropped [B, H_q] f64, or empty to use masses[..., 0]; num_indexed [B] i64;
// fallback_fraction; h_kv -> (packed statistics, see stats.h, with no head lowered: the op has no
// checks; and whether any request falls back).
std::tuple<torch::Tensor, bool> step_stats(louver_cpu::Named& n) {
  const torch::Tensor t = n.tensor("t"), z = n.tensor("z"), per_head = n.tensor("per_head");
  const torch::Tensor per_req = n.tensor("per_req"), masses = n.tensor("masses");
  const torch::Tensor index_dropped = n.tensor("index_dropped"), num_indexed = n.tensor("num_indexed");
  const double fallback_fraction = n.real("fallback_fraction");
  const int64_t h_kv = n.integer("h_kv");
  n.done();
  const int64_t B = t.size(0), H = t.size(1);
  TORCH_CHECK(t.is_contiguous() && z.is_contiguous() && per_head.is_contiguous() && per_req.is_contiguous() &&
                  masses.is_contiguous() && num_indexed.is_contiguous() && index_dropped.is_contiguous(),
              "step_stats: inputs must be contiguous");
  TORCH_CHECK(index_dropped.numel() == 0 || index_dropped.numel() == B * H, "step_stats: index_dropped must be [B, H_q]");
  torch::Tensor packed =
      torch::empty({B, H + 1, louver_cpu::kStatsWidth}, torch::TensorOptions().dtype(torch::kDouble));
  const bool any = louver_cpu::step_stats_packed(
      t.data_ptr<float>(), z.data_ptr<double>(), per_head.data_ptr<int64_t>(), per_req.data_ptr<int64_t>(),
      masses.data_ptr<double>(), index_dropped.numel() ? index_dropped.data_ptr<double>() : nullptr, nullptr,
      num_indexed.data_ptr<int64_t>(), B, H, fallback_fraction, h_kv, packed.data_ptr<double>());
  return {packed, any};
}
