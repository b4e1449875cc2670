// The packed step statistics (one fp64 tensor [B, H_q + 1, kStatsWidth] per step, unpacked by
// louver_sgl.decode.contract.StepStats on first access): row h < H_q of request b holds head h's
// (threshold, candidates, pages skipped, dropped-mass bound, lowered 0/1), row H_q the request's
// (dense fallback 0/1, union candidates, values read, pages read, 0). Counts are exact in fp64
// (< 2^53).
#pragma once

#include <cstdint>

namespace louver_cpu {

constexpr int64_t kStatsWidth = 5;

// The statistics of reference_compiled.step_stats_reference into packed [B, H + 1, kStatsWidth];
// returns whether any request falls back to dense. Inputs as the step_stats op; index_dropped may
// be null; lowered [B·H] (heads whose first level failed its check) may be null (none).
bool step_stats_packed(const float* t, const double* z, const int64_t* per_head, const int64_t* per_req,
                       const double* masses, const double* index_dropped, const uint8_t* lowered,
                       const int64_t* num_indexed, int64_t B, int64_t H, double fallback_fraction, int64_t h_kv,
                       double* packed);

}  // namespace louver_cpu
