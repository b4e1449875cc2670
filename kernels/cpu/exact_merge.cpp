// The exact part, the merge and the chunk totals as ops of their own, by name (the tests check
// them against their torch specifications; LayerStep runs the same phases in one parallel region).

#include "exact_merge.h"
#include "ops.h"

using namespace louver_cpu;

// Exact scores of the dense part and of the sample, the reference score and the masses relative
// to it (design §4; louver_sgl/decode/impl_torch.py:exact_part is the specification).
// q [B, H_q, D] f32; k_cache [slots, H_kv, D]; dense_slots, dense_req [ND], sample_slots, sample_req
// [NS] i64, request-sorted -> s_dense [ND, H_q] f32, sample [B, M, H_q] f32 (each request's sample
// scores in order, padded with -inf; M >= its largest sample), ref [B, H_q] f32 (-inf: no exact
// score), z [B, H_q, 2] f64 (Σ e^{σ(s − ref)} over the dense part, over the sample). With a budget
// fraction f >= 0 it also writes the budget policy's T [B, H_q] f32 (threshold.budget_threshold is
// the specification); with f < 0, t is not touched.
void exact_part(Named& n) {
  torch::Tensor q = n.tensor("q"), k_cache = n.tensor("k_cache"), s_dense = n.tensor("s_dense");
  torch::Tensor sample = n.tensor("sample"), ref = n.tensor("ref"), z = n.tensor("z"), t = n.tensor("t");
  const ExactArgs e = exact_args(q, k_cache, n.tensor("dense_slots"), n.tensor("dense_req"), n.tensor("sample_slots"),
                                 n.tensor("sample_req"), n.real("sigma"), n.real("budget"), s_dense, sample, ref, z, t);
  n.done();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "exact_part", [&] {
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    at::parallel_for(0, e.nd + e.ns, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> key(kExactScratch * e.D);
      exact_rows(e, kc, begin, end, key.data());
    });
  });
  at::parallel_for(0, e.B * e.H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    exact_heads(e, begin, end, scratch);
  });
}

// Softmax merge of the dense part with the attend kernel's chunk states (reference_compiled.merge_reference is
// the specification). s_dense [ND, H_q] f32; dense_slots, dense_req [ND] i64; v_cache [slots, H_kv,
// Dv]; m, l [NC, H_q] f32 (m in σ·score units; −inf: empty chunk); o [NC, H_q, Dv] f32; chunk_req
// [NC] i64 (both row lists request-sorted) -> out [B, H_q, Dv] f32.
void merge_chunks(Named& n) {
  torch::Tensor v_cache = n.tensor("v_cache"), out = n.tensor("out");
  const MergeArgs g = merge_args(n.tensor("s_dense"), n.tensor("dense_slots"), n.tensor("dense_req"), v_cache,
                                 n.tensor("m"), n.tensor("l"), n.tensor("o"), n.tensor("chunk_req"), n.real("sigma"), out);
  n.done();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v_cache.scalar_type(), "merge_chunks", [&] {
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, g.B * g.h_kv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) dense_task(g, vc, task);
      merge_tasks(g, begin, end);
    });
  });
}

// Per-request totals of the attend kernel's chunk outputs (reference_compiled.chunk_totals_reference is the
// specification). counts [NC, H_kv, 2G + 3] i64, mass [NC, H_kv, G, 3] f64, chunk_req [NC] i64 ->
// per_head [B, H_q, 2] i64 (attended, pages skipped), per_req [B, 3] i64 (union candidates, values
// read, pages read), masses [B, H_q, 3] f64; all outputs are overwritten.
void chunk_totals(Named& n) {
  torch::Tensor per_head = n.tensor("per_head"), per_req = n.tensor("per_req"), masses = n.tensor("masses");
  chunk_totals_into(n.tensor("counts"), n.tensor("mass"), n.tensor("chunk_req"), per_head, per_req, masses);
  n.done();
}
