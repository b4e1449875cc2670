// The attend pass as an op of its own (used by certified steps, whose T needs the bound passes
// first; the other policies run it inside fused_step).

#include "attend.h"
#include "ops.h"

using namespace louver_cpu;

// Outputs per (chunk, KV head): m, l [NC, H_kv, G] f32 (m in σ·score units), o [NC, H_kv, G, D_v]
// f32 (unnormalised), counts [NC, H_kv, 2G + 3] i64 (attended per head, pages skipped per head,
// union candidates, values read, pages read), mass [NC, H_kv, G, 3] f64 (see HeadState).
void grid_sparse_attend(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor lo,
                        torch::Tensor scale, torch::Tensor radius, torch::Tensor codes, torch::Tensor page_ids,
                        torch::Tensor chunk_req, torch::Tensor chunk_begin, torch::Tensor chunk_end, torch::Tensor t,
                        torch::Tensor t_gate, torch::Tensor ref, double sigma, int64_t bits, int64_t page_size,
                        torch::Tensor m_out, torch::Tensor l_out, torch::Tensor o_out, torch::Tensor counts,
                        torch::Tensor mass) {
  TORCH_CHECK(lo.scalar_type() == k_cache.scalar_type(), "index codebooks must use the KV dtype");
  const AttendArgs a = attend_args(q, k_cache, v_cache, codes, page_ids, chunk_req, chunk_begin, chunk_end, t, t_gate,
                                   ref, sigma, bits, page_size, m_out, l_out, o_out, counts, mass);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "grid_sparse_attend", [&] {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, a.n_chunks, 1, [&](int64_t, int64_t) {
      attend_worker(a, k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), lo.data_ptr<scalar_t>(),
                    scale.data_ptr<scalar_t>(), radius.data_ptr<scalar_t>(), next);
    });
  });
}
