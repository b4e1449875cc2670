// The steps around the attend pass, as per-index-range phases shared by their own ops
// (exact_part, merge_chunks) and by fused_step: exact scores of the dense part and the sample,
// per-head reference score, masses and sample threshold; the softmax merge of the dense part with
// the chunk states; per-request totals of the chunk counters.
#pragma once

#include "common.h"

namespace louver_cpu {

#if defined(__AVX512F__)
// The numbers of x [n] that compare CMP to the pivot, packed into y (16 lanes of slack); returns
// their count and adds those equal to the pivot to *equal when given. The compress goes to a
// register: Zen 4 compresses to memory slowly.
template <int CMP>
inline int64_t compress_where(const float* x, int64_t n, __m512 pivot, float* y, int64_t* equal = nullptr) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(lanes, x + i);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes, v, pivot, CMP);
    _mm512_storeu_ps(y + count, _mm512_maskz_compress_ps(hit, v));
    count += __builtin_popcount(hit);
    if (equal) *equal += __builtin_popcount(_mm512_mask_cmp_ps_mask(lanes, v, pivot, _CMP_EQ_OQ));
  }
  return count;
}
#endif

// The k-th largest (1-based, 1 <= k <= n) of the n numbers in x (no NaN); x and y: n + 16 floats
// each (y scratch; a compress stores 16 lanes).
// A quickselect whose partitions are vector compares and compresses (AVX-512): nth_element's
// compares mispredict on about every other element, a few microseconds per head and step at 256
// samples. Either order of +0 and -0 may be the result where they tie.
inline float kth_largest(float* x, float* y, int64_t n, int64_t k) {
#if defined(__AVX512F__)
  while (n > 16) {
    const float a = x[0], b = x[n / 2], c = x[n - 1];
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // median of three
    const __m512 pv = _mm512_set1_ps(pivot);
    int64_t equal = 0;
    const int64_t above = compress_where<_CMP_GT_OQ>(x, n, pv, y, &equal);
    if (k <= above) {
      std::swap(x, y);
      n = above;
      continue;
    }
    if (k <= above + equal) return pivot;
    k -= above + equal;
    n = compress_where<_CMP_LT_OQ>(x, n, pv, y);
    std::swap(x, y);
  }
#else
  (void)y;
#endif
  std::nth_element(x, x + (k - 1), x + n, std::greater<float>());
  return x[k - 1];
}

// The budget rule on one head's n sample scores (``stride`` floats apart): the ⌊f·n⌋-th largest
// (at least the largest), -inf without samples. NaN ranks above every number, as in torch.topk.
inline float budget_pick(const float* scores, int64_t stride, int64_t n, double fraction, std::vector<float>& scratch) {
  if (n == 0) return -INFINITY;
  const int64_t k = std::min<int64_t>(n, std::max<int64_t>(1, static_cast<int64_t>(std::floor(double(n) * fraction))));
  if (static_cast<int64_t>(scratch.size()) < 2 * (n + 16)) scratch.resize(2 * (n + 16));
  int64_t m = 0, nans = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float x = scores[j * stride];
    if (std::isnan(x)) {
      ++nans;
    } else {
      scratch[m++] = x;
    }
  }
  if (k <= nans) return NAN;
  return kth_largest(scratch.data(), scratch.data() + n + 16, m, k - nans);
}

// contract.ValueGate.threshold: T − rel·(|T| + 1) with torch's fp32 operations (volatile keeps the
// compiler from fusing them into one FMA, whose rounding would differ).
inline float value_gate_threshold(float t, float rel) {
  volatile float margin = rel * (std::fabs(t) + 1.f);
  return t - margin;
}

struct ExactArgs {
  const float* q;  // [B, H, D]
  const int64_t *ds, *dr, *ss, *sr;
  int64_t B, H, D, h_kv, G, nd, ns, M;
  double sigma, budget;
  float *sd, *sp, *rp, *tp;  // s_dense [ND, H], sample [B, M, H], ref [B, H], t [B, H] (null: no budget)
  double* zp;                // z [B, H, 2]
  std::vector<int64_t> d_bounds, s_bounds;
  std::vector<float> knorm_rows;  // [ND + NS, H_kv] upper bounds of the rows' key norms (kn)
  float* kn = nullptr;
};

// Arguments of the exact phases; fills the sample buffer with −inf (its padding).
inline ExactArgs exact_args(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& dense_slots,
                            const torch::Tensor& dense_req, const torch::Tensor& sample_slots,
                            const torch::Tensor& sample_req, double sigma, double budget, torch::Tensor& s_dense,
                            torch::Tensor& sample, torch::Tensor& ref, torch::Tensor& z, torch::Tensor& t) {
  ExactArgs e{q.data_ptr<float>(), dense_slots.data_ptr<int64_t>(), dense_req.data_ptr<int64_t>(),
              sample_slots.data_ptr<int64_t>(), sample_req.data_ptr<int64_t>(), q.size(0), q.size(1), q.size(2),
              k_cache.size(1), q.size(1) / k_cache.size(1), dense_slots.size(0), sample_slots.size(0), sample.size(1),
              sigma, budget, s_dense.data_ptr<float>(), sample.data_ptr<float>(), ref.data_ptr<float>(),
              budget >= 0.0 ? t.data_ptr<float>() : nullptr, z.data_ptr<double>(), {}, {}};
  e.d_bounds = request_bounds(e.dr, e.nd, e.B);
  e.s_bounds = request_bounds(e.sr, e.ns, e.B);
  for (int64_t b = 0; b < e.B; ++b)
    TORCH_CHECK(e.s_bounds[b + 1] - e.s_bounds[b] <= e.M, "sample buffer narrower than a request's sample");
  std::fill(e.sp, e.sp + e.B * e.M * e.H, -INFINITY);
  e.knorm_rows.resize((e.nd + e.ns) * e.h_kv);
  e.kn = e.knorm_rows.data();
  return e;
}

constexpr int64_t kExactAhead = 12;  // rows prefetched ahead by exact_rows
constexpr int64_t kExactAheadL2 = 48;  // rows prefetched ahead into L2 by exact_rows16
constexpr int64_t kExactScratch = 16;  // rows of the scratch exact_rows takes, in units of D

// Row ``row`` of the exact part (0..ND-1 the dense part, ND..ND+NS-1 the sample): its KV slot, its
// request, and where it writes its H scores.
inline int64_t exact_slot(const ExactArgs& e, int64_t row) { return row < e.nd ? e.ds[row] : e.ss[row - e.nd]; }
inline int64_t exact_req(const ExactArgs& e, int64_t row) { return row < e.nd ? e.dr[row] : e.sr[row - e.nd]; }
inline float* exact_dst(const ExactArgs& e, int64_t row) {
  if (row < e.nd) return e.sd + row * e.H;
  const int64_t i = row - e.nd, b = e.sr[i];
  return e.sp + (b * e.M + (i - e.s_bounds[b])) * e.H;
}

#if defined(__AVX512F__)
// exact_rows for D a multiple of 16: blocks of up to 16 rows of one part and one request, per KV
// head 16 FMA chains per query head reduced by the transposing add tree (a dot product per row
// and head ended in a serial horizontal sum: the largest fixed cost of a batch-1 step).
// rows: scratch [16, D] (lanes past a short block read stale finite rows and are not written).
template <typename KV>
inline void exact_rows16(const ExactArgs& e, const KV* kc, int64_t begin, int64_t end, float* rows) {
  const int64_t D = e.D, row_elems = e.h_kv * D, row_bytes = row_elems * static_cast<int64_t>(sizeof(KV));
  for (int64_t r = begin; r < std::min(end, begin + 16); ++r)
    prefetch_bytes(kc + exact_slot(e, r) * row_elems, row_bytes);
  for (int64_t r = begin + 16; r < std::min(end, begin + kExactAheadL2); ++r)
    prefetch_bytes_l2(kc + exact_slot(e, r) * row_elems, row_bytes);
  alignas(64) float lanes[16];
  for (int64_t row = begin; row < end;) {
    const int64_t b = exact_req(e, row), part_end = row < e.nd ? std::min(end, e.nd) : end;
    float* dst = exact_dst(e, row);
    int64_t n = 1;
    while (n < 16 && row + n < part_end && exact_req(e, row + n) == b) ++n;
    for (int64_t r = row + 16; r < std::min(end, row + 32); ++r)  // the next block (rows are scattered)
      prefetch_bytes(kc + exact_slot(e, r) * row_elems, row_bytes);
    // and further ahead into L2: a cold random row waits on memory longer than a block computes
    for (int64_t r = row + kExactAheadL2; r < std::min(end, row + kExactAheadL2 + 16); ++r)
      prefetch_bytes_l2(kc + exact_slot(e, r) * row_elems, row_bytes);
    for (int64_t k = 0; k < e.h_kv; ++k) {
      for (int64_t t = 0; t < n; ++t) load_f32(kc + exact_slot(e, row + t) * row_elems + k * D, D, rows + t * D);
      norms_up16(rows, D, lanes);
      for (int64_t t = 0; t < n; ++t) e.kn[(row + t) * e.h_kv + k] = lanes[t];
      for (int64_t g = 0; g < e.G; ++g) {
        __m512 v[16];
        staged_products16(rows, e.q + (b * e.H + k * e.G + g) * D, D, v);
        _mm512_store_ps(lanes, lane_sums16_ps(v));
        for (int64_t t = 0; t < n; ++t) {
          // rows of one part are consecutive: dense rows H apart, a request's sample rows too
          dst[t * e.H + k * e.G + g] = lanes[t];
        }
      }
    }
    row += n;
  }
}
#endif

// Exact scores of rows [begin, end): rows 0..ND-1 are the dense part, ND..ND+NS-1 the sample
// (written at its padded position). scratch: [kExactScratch, D].
template <typename KV>
inline void exact_rows(const ExactArgs& e, const KV* kc, int64_t begin, int64_t end, float* scratch) {
#if defined(__AVX512F__)
  if (e.D % 16 == 0) return exact_rows16(e, kc, begin, end, scratch);
#endif
  for (int64_t row = begin; row < end; ++row) {
    const int64_t b = exact_req(e, row), slot = exact_slot(e, row);
    float* dst = exact_dst(e, row);
    if (row + kExactAhead < end)  // the rows are scattered (the sample is random): fetch ahead
      prefetch_bytes(kc + exact_slot(e, row + kExactAhead) * e.h_kv * e.D,
                     e.h_kv * e.D * static_cast<int64_t>(sizeof(KV)));
    for (int64_t k = 0; k < e.h_kv; ++k) {
      load_f32(kc + (slot * e.h_kv + k) * e.D, e.D, scratch);
      e.kn[row * e.h_kv + k] = norm_up(scratch, e.D);
      for (int64_t g = 0; g < e.G; ++g)
        dst[k * e.G + g] = dot(scratch, e.q + (b * e.H + k * e.G + g) * e.D, static_cast<int>(e.D));
    }
  }
}

// The largest of n key-norm bounds src[i·stride] (0 for none; NaN propagates).
inline float strided_max_norm(const float* src, int64_t stride, int64_t n) {
  float top = 0.f;
  for (int64_t i = 0; i < n; ++i) top = std::isnan(src[i * stride]) || std::isnan(top) ? NAN : std::max(top, src[i * stride]);
  return top;
}

// Per (request, head) bh in [begin, end): ref (max exact score; NaN propagates, as in torch's
// amax), the masses relative to it (lower bounds within a factor kMassDown of the fp64 sums), and
// with a budget the sample threshold.
inline void exact_heads(const ExactArgs& e, int64_t begin, int64_t end, std::vector<float>& scratch) {
  const int64_t H = e.H, M = e.M;
  for (int64_t bh = begin; bh < end; ++bh) {
    const int64_t b = bh / H, h = bh % H, n_sample = e.s_bounds[b + 1] - e.s_bounds[b];
    float top = -INFINITY;
#if defined(__AVX512F__)
    {
      const float dense_top = strided_max(e.sd + e.d_bounds[b] * H + h, H, e.d_bounds[b + 1] - e.d_bounds[b]);
      const float sample_top = strided_max(e.sp + b * M * H + h, H, n_sample);
      top = std::isnan(dense_top) || std::isnan(sample_top) ? NAN : std::max(dense_top, sample_top);
    }
#else
    auto take = [&top](float x) { top = (x > top || std::isnan(x)) && !std::isnan(top) ? x : top; };
    for (int64_t i = e.d_bounds[b]; i < e.d_bounds[b + 1]; ++i) take(e.sd[i * H + h]);
    for (int64_t j = 0; j < n_sample; ++j) take(e.sp[(b * M + j) * H + h]);
#endif
    e.rp[bh] = top;
    double zd = 0.0, zs = 0.0;
    const int64_t d0 = e.d_bounds[b], nd = e.d_bounds[b + 1] - d0;
    // every score of a part is lowered by the slack of its fp32 dot: ‖q‖·(the part's largest key
    // norm) bounds each Σ_d |q_d·k_d| (impl_torch.exact_part is the specification)
    const float qn = norm_up(e.q + bh * e.D, e.D);
    const float lift_d = score_slack(qn * strided_max_norm(e.kn + d0 * e.h_kv + h / e.G, e.h_kv, nd), e.D);
    const float lift_s = score_slack(
        qn * strided_max_norm(e.kn + (e.nd + e.s_bounds[b]) * e.h_kv + h / e.G, e.h_kv, n_sample), e.D);
    if ((kHaveAvx512 || kHaveAvx2) && std::isfinite(top)) {  // lower bounds from fp32 exps (kMassDown)
#if defined(__AVX512F__) || defined(LOUVER_AVX2)
      zd = mass_lower(e.sd + d0 * H + h, H, nd, static_cast<float>(e.sigma), lifted_ref(top, lift_d));
      zs = mass_lower(e.sp + b * M * H + h, H, n_sample, static_cast<float>(e.sigma), lifted_ref(top, lift_s));
#endif
    } else {  // NaN / inf scores: the fp64 sums (NaN or inf propagate as in torch)
      const double rd = double(top) + lift_d, rs = double(top) + lift_s;
      for (int64_t i = d0; i < d0 + nd; ++i) zd += std::exp(e.sigma * (double(e.sd[i * H + h]) - rd));
      for (int64_t j = 0; j < n_sample; ++j) zs += std::exp(e.sigma * (double(e.sp[(b * M + j) * H + h]) - rs));
    }
    e.zp[bh * 2] = zd;
    e.zp[bh * 2 + 1] = zs;
    if (e.tp) e.tp[bh] = budget_pick(e.sp + b * M * H + h, H, n_sample, e.budget, scratch);
  }
}

struct MergeArgs {
  const float *sd, *mp, *lp, *op;  // s_dense [ND, H]; m, l [NC, H]; o [NC, H, DV]
  const int64_t *ds, *dr;
  int64_t B, H, DV, h_kv, G;
  float sig;
  float* outp;  // [B, H, DV]
  std::vector<int64_t> d_bounds, c_bounds;
  // The dense part's softmax state per (request, head), as a chunk's (dense_task writes it, the
  // merge reads it): m [B, H] (its largest σ·s; −inf: none), l [B, H], then o [B, H, DV]
  mutable std::vector<float> dense;
  mutable bool dense_ready = false;  // whether dense_task has run for every task
  float* dense_m() const { return dense.data(); }
  float* dense_l() const { return dense.data() + B * H; }
  float* dense_o() const { return dense.data() + 2 * B * H; }
};

inline MergeArgs merge_args(const torch::Tensor& s_dense, const torch::Tensor& dense_slots,
                            const torch::Tensor& dense_req, const torch::Tensor& v_cache, const torch::Tensor& m,
                            const torch::Tensor& l, const torch::Tensor& o, const torch::Tensor& chunk_req,
                            double sigma, torch::Tensor& out) {
  MergeArgs g{s_dense.data_ptr<float>(), m.data_ptr<float>(), l.data_ptr<float>(), o.data_ptr<float>(),
              dense_slots.data_ptr<int64_t>(), dense_req.data_ptr<int64_t>(), out.size(0), out.size(1), out.size(2),
              v_cache.size(1), out.size(1) / v_cache.size(1), static_cast<float>(sigma), out.data_ptr<float>(), {}, {}};
  g.d_bounds = request_bounds(g.dr, dense_slots.size(0), g.B);
  g.c_bounds = request_bounds(chunk_req.data_ptr<int64_t>(), chunk_req.size(0), g.B);
  g.dense.resize(g.B * g.H * (2 + g.DV));
  return g;
}

// Softmax weights e^{σ·s − top_j} of the nd dense rows from d0 for the G heads of KV head k:
// weight [G, nd] (resized), den[j] = their sum.
inline void dense_weights(const MergeArgs& g, int64_t d0, int64_t nd, int64_t k, const float* top,
                          std::vector<float>& weight, float* den) {
  const int64_t H = g.H, G = g.G;
  weight.resize(G * nd);
  for (int64_t j = 0; j < G; ++j) {
    const float* src = g.sd + d0 * H + k * G + j;
    float* w = weight.data() + j * nd;
    int64_t i = 0;
    den[j] = 0.f;
#if defined(__AVX512F__)
    __m512 sum = _mm512_setzero_ps();
    for (; i + 16 <= nd; i += 16) {
      const __m512 x = _mm512_fmsub_ps(_mm512_set1_ps(g.sig), gather16(src + i * H, H, 16), _mm512_set1_ps(top[j]));
      const __m512 e = exp_ps16(x);
      _mm512_storeu_ps(w + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    den[j] = _mm512_reduce_add_ps(sum);
#elif defined(LOUVER_AVX2)
    __m256 sum = _mm256_setzero_ps();
    for (; i + 8 <= nd; i += 8) {
      const __m256 x = _mm256_fmsub_ps(_mm256_set1_ps(g.sig), gather8(src + i * H, H, 8), _mm256_set1_ps(top[j]));
      const __m256 e = exp_ps8(x);
      _mm256_storeu_ps(w + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    den[j] = hsum8_ps(sum);
#endif
    for (; i < nd; ++i) {
      w[i] = std::exp(g.sig * src[i * H] - top[j]);
      den[j] += w[i];
    }
  }
}

// num [G, DV] = Σ_i weight[j][i]·V row of dense row d0 + i for KV head k (weight [G, nd]; val:
// scratch [DV]). With AVX-512 the sums of up to 4 heads × 64 channels stay in 16 registers over
// all rows (a load and store of num per row and head were most of the merge).
template <typename KV>
inline void dense_values(const MergeArgs& g, const KV* vc, int64_t d0, int64_t nd, int64_t k, const float* weight,
                         float* num, float* val) {
  const int64_t G = g.G, DV = g.DV, h_kv = g.h_kv;
  const auto row = [&](int64_t i) { return vc + (g.ds[d0 + i] * h_kv + k) * DV; };
  std::fill(num, num + G * DV, 0.f);
#if defined(__AVX512F__)
  if (DV % 64 == 0) {
    accumulate_rows<KV>(row, [&](int64_t j, int64_t i) { return weight[j * nd + i]; }, nd, G, DV, num, false,
                        kExactAhead);
    return;
  }
#elif defined(LOUVER_AVX2)
  if (DV % 32 == 0) {
    accumulate_rows<KV>(row, [&](int64_t j, int64_t i) { return weight[j * nd + i]; }, nd, G, DV, num, false,
                        kExactAhead);
    return;
  }
#endif
  for (int64_t i = 0; i < std::min(nd, kExactAhead); ++i) prefetch_bytes(row(i), DV * static_cast<int64_t>(sizeof(KV)));
  for (int64_t i = 0; i < nd; ++i) {
    if (i + kExactAhead < nd) prefetch_bytes(row(i + kExactAhead), DV * static_cast<int64_t>(sizeof(KV)));
    load_f32(row(i), DV, val);
    for (int64_t j = 0; j < G; ++j) axpy(num + j * DV, weight[j * nd + i], val, DV);
  }
}

// The dense part's softmax state (MergeArgs::dense) of task (request, KV head): per head of the
// group the largest σ·s of its dense rows (NaN scores aside), and l, o relative to it (to 0 where it
// is not finite; m = −inf where it is −inf: no dense row). A task of its own so that it can run in
// the attend pass's queue, beside the chunks, instead of in the merge after them.
template <typename KV>
inline void dense_task(const MergeArgs& g, const KV* vc, int64_t task) {
  const int64_t H = g.H, G = g.G, h_kv = g.h_kv;
  const int64_t b = task / h_kv, k = task % h_kv, h0 = b * H + k * G;
  const int64_t d0 = g.d_bounds[b], nd = g.d_bounds[b + 1] - d0;
  std::vector<float> val(g.DV), top(G), weight;
  for (int64_t j = 0; j < G; ++j) {
    float t = -INFINITY;
    for (int64_t i = d0; i < d0 + nd; ++i) t = std::max(t, g.sig * g.sd[i * H + k * G + j]);
    top[j] = std::isfinite(t) ? t : 0.f;
    g.dense_m()[h0 + j] = t == -INFINITY ? -INFINITY : top[j];
  }
  dense_weights(g, d0, nd, k, top.data(), weight, g.dense_l() + h0);
  dense_values(g, vc, d0, nd, k, weight.data(), g.dense_o() + h0 * g.DV, val.data());
}

// Merge tasks (request, KV head) in [begin, end): softmax over the dense part's state (dense_task,
// run before) and the chunks' partial states, written normalised to out.
inline void merge_tasks(const MergeArgs& g, int64_t begin, int64_t end) {
  const int64_t H = g.H, DV = g.DV, G = g.G, h_kv = g.h_kv;
  std::vector<float> num(G * DV), top(G), den(G);
  const float *dm = g.dense_m(), *dl = g.dense_l(), *dov = g.dense_o();
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / h_kv, k = task % h_kv, h0 = b * H + k * G;
    for (int64_t j = 0; j < G; ++j) {
      float t = dm[h0 + j];
      for (int64_t c = g.c_bounds[b]; c < g.c_bounds[b + 1]; ++c) t = std::max(t, g.mp[c * H + k * G + j]);
      top[j] = std::isfinite(t) ? t : 0.f;
      // not skipped where the scale is 0: a NaN dense score's NaN must reach the output
      const float scale = std::exp(dm[h0 + j] - top[j]);
      den[j] = dl[h0 + j] * scale;
      for (int64_t d = 0; d < DV; ++d) num[j * DV + d] = dov[(h0 + j) * DV + d] * scale;
    }
    for (int64_t c = g.c_bounds[b]; c < g.c_bounds[b + 1]; ++c)
      for (int64_t j = 0; j < G; ++j) {
        const int64_t row = c * H + k * G + j;
        const float scale = std::exp(g.mp[row] - top[j]);  // 0 for an empty chunk (m = −inf)
        if (scale == 0.f) continue;
        den[j] += g.lp[row] * scale;
        axpy(num.data() + j * DV, scale, g.op + row * DV, DV);
      }
    for (int64_t j = 0; j < G; ++j)
      for (int64_t d = 0; d < DV; ++d) g.outp[(h0 + j) * DV + d] = num[j * DV + d] / den[j];
  }
}

// Per-request totals of the chunk counters (see the chunk_totals op); outputs overwritten.
inline void chunk_totals_into(const torch::Tensor& counts, const torch::Tensor& mass, const torch::Tensor& chunk_req,
                              torch::Tensor& per_head, torch::Tensor& per_req, torch::Tensor& masses) {
  const int64_t nc = counts.size(0), h_kv = counts.size(1), G = mass.size(2), H = h_kv * G;
  const int64_t* cp = counts.data_ptr<int64_t>();
  const double* mp = mass.data_ptr<double>();
  const int64_t* req = chunk_req.data_ptr<int64_t>();
  int64_t* ph = per_head.data_ptr<int64_t>();
  int64_t* pr = per_req.data_ptr<int64_t>();
  double* ms = masses.data_ptr<double>();
  std::fill(ph, ph + per_head.numel(), 0);
  std::fill(pr, pr + per_req.numel(), 0);
  std::fill(ms, ms + masses.numel(), 0.0);
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t b = req[c];
    for (int64_t k = 0; k < h_kv; ++k) {
      const int64_t* row = cp + (c * h_kv + k) * (2 * G + 3);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = b * H + k * G + g;
        ph[h * 2] += row[g];
        ph[h * 2 + 1] += row[G + g];
        for (int j = 0; j < 3; ++j) ms[h * 3 + j] += mp[((c * h_kv + k) * G + g) * 3 + j];
      }
      pr[b * 3] += row[2 * G];
      pr[b * 3 + 1] += row[2 * G + 1];
    }
    pr[b * 3 + 2] += cp[c * h_kv * (2 * G + 3) + 2 * G + 2];  // pages read: KV head 0's task
  }
}

}  // namespace louver_cpu
