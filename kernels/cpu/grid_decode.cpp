// Fused CPU kernels of the Louver decode step for the grid bound family.
//
// grid_token_bounds: token upper bounds of a batch of pages (unpack b-bit codes + G dot products
//   in one pass over the packed codes; the torch reference materialises float codes instead).
// grid_sparse_attend: for every (request, KV head, chunk of pages): token bounds, candidate gate
//   (page kept and bound >= T for any head of the GQA group), exact scores from the candidate's key,
//   value gate, online softmax with V read only for attended rows. Partial softmax states per chunk
//   are merged by the caller (split-K), so two cores stay busy even at batch 1.
// Both kernels only read caller-owned inputs and write caller-owned outputs.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_f32(T x) { return static_cast<float>(x); }

// Unpack one token's packed codes [bytes] into floats [dim].
inline void unpack_row(const uint8_t* src, int bits, int dim, float* dst) {
  if (bits == 8) {
    for (int d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
  } else if (bits == 4) {
    for (int j = 0; j < dim / 2; ++j) {
      dst[2 * j] = static_cast<float>(src[j] & 0xF);
      dst[2 * j + 1] = static_cast<float>(src[j] >> 4);
    }
  } else {  // 2 bits
    for (int j = 0; j < dim / 4; ++j) {
      const uint8_t b = src[j];
      dst[4 * j] = static_cast<float>(b & 3);
      dst[4 * j + 1] = static_cast<float>((b >> 2) & 3);
      dst[4 * j + 2] = static_cast<float>((b >> 4) & 3);
      dst[4 * j + 3] = static_cast<float>(b >> 6);
    }
  }
}

inline float dot(const float* a, const float* b, int n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

}  // namespace

// codes [slots, H_kv, bytes] u8; page_ids [n] i64; weights [n, H_kv, G, D] f32; offset [n, H_kv, G] f32
// -> out [n, P, H_kv, G] f32
void grid_token_bounds(torch::Tensor codes, torch::Tensor page_ids, torch::Tensor weights,
                       torch::Tensor offset, int64_t bits, int64_t page_size, torch::Tensor out) {
  const int64_t n = page_ids.size(0), h_kv = weights.size(1), groups = weights.size(2);
  const int dim = static_cast<int>(weights.size(3));
  const int64_t bytes = codes.size(2);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const int64_t* pid = page_ids.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();
  const float* off = offset.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n * h_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / h_kv, k = task % h_kv;
      const float* wk = w + (i * h_kv + k) * groups * dim;
      for (int64_t p = 0; p < page_size; ++p) {
        const int64_t slot = pid[i] * page_size + p;
        unpack_row(c + (slot * h_kv + k) * bytes, static_cast<int>(bits), dim, row.data());
        float* dst = o + ((i * page_size + p) * h_kv + k) * groups;
        for (int64_t g = 0; g < groups; ++g)
          dst[g] = off[(i * h_kv + k) * groups + g] + dot(row.data(), wk + g * dim, dim);
      }
    }
  });
}

namespace {

struct AttendArgs {
  const float* q;          // [B, H_q, D]
  const uint8_t* codes;    // [slots, H_kv, bytes]
  const int64_t* page_ids; // [NP] grouped by request
  const int64_t* chunk_req;    // [NC] request of each chunk
  const int64_t* chunk_begin;  // [NC] first page row
  const int64_t* chunk_end;    // [NC] one past the last page row
  const float* weights;    // [NP, H_kv, G, D]
  const float* offset;     // [NP, H_kv, G]
  const bool* keep_page;   // [NP, H_q]
  const float* t_tok;      // [B, H_q] token threshold
  const float* t_gate;     // [B, H_q] value gate threshold (-inf: attend every candidate)
  const float* ref;        // [B, H_q] reference score of the mass accounting
  float sigma;
  int64_t h_q, h_kv, groups, dim, dim_v, bytes, page_size, bits;
};

// Mass accounting per head, relative to exp(σ·(s − ref)), accumulated in fp64:
// [0] index-dropped tokens (page kept for the head, own bound below T), [1] value-gated candidates
// (exact score below the gate threshold), [2] every union candidate (exact).
struct HeadState {
  float m = -INFINITY, l = 0.f;
  int64_t attended = 0;
  double mass[3] = {0.0, 0.0, 0.0};
};

template <typename KV>
void attend_chunk(const AttendArgs& a, const KV* kc, const KV* vc, int64_t chunk, int64_t k,
                  float* m_out, float* l_out, float* o_out, int64_t* counts, double* mass_out) {
  const int64_t b = a.chunk_req[chunk], G = a.groups, D = a.dim, DV = a.dim_v;
  const int64_t head0 = b * a.h_q + k * G;
  std::vector<float> row(D), buf(std::max(D, DV)), acc(G * DV, 0.f), s(G);
  std::vector<char> attend(G);
  std::vector<HeadState> st(G);
  const float* qk = a.q + head0 * D;
  int64_t n_union = 0, n_values = 0;
  for (int64_t i = a.chunk_begin[chunk]; i < a.chunk_end[chunk]; ++i) {
    const bool* kp = a.keep_page + i * a.h_q + k * G;
    bool any_page = false;
    for (int64_t g = 0; g < G; ++g) any_page |= kp[g];
    if (!any_page) continue;
    const float* wk = a.weights + (i * a.h_kv + k) * G * D;
    const float* off = a.offset + (i * a.h_kv + k) * G;
    for (int64_t p = 0; p < a.page_size; ++p) {
      const int64_t slot = a.page_ids[i] * a.page_size + p;
      unpack_row(a.codes + (slot * a.h_kv + k) * a.bytes, static_cast<int>(a.bits), D, row.data());
      bool cand = false;
      for (int64_t g = 0; g < G; ++g) {
        if (!kp[g]) continue;
        const float u = off[g] + dot(row.data(), wk + g * D, D);
        const bool keep = !(u < a.t_tok[head0 + g]);  // NaN keeps
        if (!keep) st[g].mass[0] += std::exp(std::min(700.0, double(a.sigma) * (double(u) - a.ref[head0 + g])));
        cand |= keep;
      }
      if (!cand) continue;
      ++n_union;
      const KV* kr = kc + (slot * a.h_kv + k) * D;
      for (int64_t d = 0; d < D; ++d) buf[d] = to_f32(kr[d]);
      bool need_v = false;
      for (int64_t g = 0; g < G; ++g) {
        s[g] = dot(buf.data(), qk + g * D, D);
        const double e = std::exp(std::min(700.0, double(a.sigma) * (double(s[g]) - a.ref[head0 + g])));
        attend[g] = !(s[g] < a.t_gate[head0 + g]);
        st[g].mass[2] += e;
        if (!attend[g]) st[g].mass[1] += e;
        need_v |= attend[g];
      }
      if (!need_v) continue;
      ++n_values;
      const KV* vr = vc + (slot * a.h_kv + k) * DV;
      for (int64_t d = 0; d < DV; ++d) buf[d] = to_f32(vr[d]);
      for (int64_t g = 0; g < G; ++g) {
        if (!attend[g]) continue;
        HeadState& h = st[g];
        ++h.attended;
        const float x = a.sigma * s[g];
        float* ag = acc.data() + g * DV;
        if (x > h.m) {  // rescale the running sum to the new maximum
          const float scale = std::exp(h.m - x);
          h.l *= scale;
          for (int64_t d = 0; d < DV; ++d) ag[d] *= scale;
          h.m = x;
        }
        const float e = std::exp(x - h.m);
        h.l += e;
#pragma omp simd
        for (int64_t d = 0; d < DV; ++d) ag[d] += e * buf[d];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    m_out[g] = st[g].m;
    l_out[g] = st[g].l;
    for (int64_t d = 0; d < DV; ++d) o_out[g * DV + d] = acc[g * DV + d];
    counts[g] = st[g].attended;
    for (int j = 0; j < 3; ++j) mass_out[g * 3 + j] = st[g].mass[j];
  }
  counts[G] = n_union;
  counts[G + 1] = n_values;
}

}  // namespace

// Outputs per (chunk, KV head): m, l [NC, H_kv, G] f32 (m in σ·score units), o [NC, H_kv, G, D_v]
// f32 (unnormalised), counts [NC, H_kv, G + 2] i64 (attended per head, union, values read),
// mass [NC, H_kv, G, 3] f64 (index-dropped, value-gated, all candidates; see HeadState).
void grid_sparse_attend(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor codes, torch::Tensor page_ids, torch::Tensor chunk_req,
                        torch::Tensor chunk_begin, torch::Tensor chunk_end, torch::Tensor weights,
                        torch::Tensor offset, torch::Tensor keep_page, torch::Tensor t_tok,
                        torch::Tensor t_gate, torch::Tensor ref, double sigma, int64_t bits,
                        int64_t page_size, torch::Tensor m_out, torch::Tensor l_out,
                        torch::Tensor o_out, torch::Tensor counts, torch::Tensor mass) {
  AttendArgs a{q.data_ptr<float>(), codes.data_ptr<uint8_t>(), page_ids.data_ptr<int64_t>(),
               chunk_req.data_ptr<int64_t>(), chunk_begin.data_ptr<int64_t>(),
               chunk_end.data_ptr<int64_t>(), weights.data_ptr<float>(), offset.data_ptr<float>(),
               keep_page.data_ptr<bool>(), t_tok.data_ptr<float>(), t_gate.data_ptr<float>(),
               ref.data_ptr<float>(), static_cast<float>(sigma), q.size(1), k_cache.size(1), q.size(1) / k_cache.size(1),
               q.size(2), v_cache.size(2), codes.size(2), page_size, bits};
  const int64_t n_chunks = chunk_req.size(0), G = a.groups;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "grid_sparse_attend", [&] {
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, n_chunks * a.h_kv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t c = task / a.h_kv, k = task % a.h_kv;
        const int64_t base = (c * a.h_kv + k) * G;
        attend_chunk<scalar_t>(a, kc, vc, c, k, m_out.data_ptr<float>() + base,
                               l_out.data_ptr<float>() + base, o_out.data_ptr<float>() + base * a.dim_v,
                               counts.data_ptr<int64_t>() + (c * a.h_kv + k) * (G + 2),
                               mass.data_ptr<double>() + base * 3);
      }
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grid_token_bounds", &grid_token_bounds, "Louver grid token upper bounds (CPU)");
  m.def("grid_sparse_attend", &grid_sparse_attend, "Louver grid filter + sparse attention (CPU)");
}
