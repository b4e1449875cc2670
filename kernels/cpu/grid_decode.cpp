// Fused CPU kernels of the Louver decode step for the grid bound family.
//
// grid_bounds: page and token upper bounds of a batch of pages straight from the queries (page
//   terms, then unpack b-bit codes + G dot products in one pass over the packed codes; the torch
//   reference materialises float codes instead). Certified steps need all of them to choose T.
// grid_sparse_attend: for every (request, KV head, chunk of pages): page bounds, token bounds,
//   candidate gate (page and token bound >= T for any head of the GQA group), exact scores from the
//   candidate's key, value gate, online softmax with V read only for attended rows, and the
//   dropped-mass accounting. Partial softmax states per chunk are merged by the caller (split-K),
//   so both cores stay busy even at batch 1.
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

// Query terms of one page and KV head, for its G query heads (see louver_sgl/index/grid.py):
// token bound = off[g] + Σ_d w[g][d]·code_d; page bound pb[g]; both include the fp32 slack
// (same formula as numerics.dot_slack with num_terms = 2·D + 2).
template <typename M>
void page_terms(const float* qk, const M* lo, const M* sc, const M* rad, int64_t G, int64_t D,
                int64_t bits, float* w, float* off, float* pb) {
  const float levels = static_cast<float>(1 << bits);
  const float terms = static_cast<float>(2 * D + 2 + 8);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qk + g * D;
    float o = 0.f, page = 0.f, radius = 0.f, mag = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const float l = to_f32(lo[d]), s = to_f32(sc[d]), r = to_f32(rad[d]), q = qg[d];
      w[g * D + d] = q * s;
      o += q * (l + 0.5f * s);
      page += std::max(q * (l + 0.5f * s), q * (l + (levels - 0.5f) * s));
      radius += std::fabs(q) * r;
      mag += std::fabs(q) * (std::fabs(l) + levels * std::fabs(s) + r);
    }
    const float slack = mag * (2.f * terms * 5.9604645e-08f) + terms * std::ldexp(1.0f, -130);
    off[g] = o + radius + slack;
    pb[g] = page + radius + slack;
  }
}

}  // namespace

// Page and token upper bounds of a batch of pages, straight from the queries.
// q [B, H_q, D] f32; page_ids, page_req [n] i64; lo/scale/radius [pages, H_kv, D] (KV dtype);
// codes [slots, H_kv, bytes] u8 -> tok [n, P, H_kv, G] f32, pb [n, H_kv, G] f32.
void grid_bounds(torch::Tensor q, torch::Tensor page_ids, torch::Tensor page_req, torch::Tensor lo,
                 torch::Tensor scale, torch::Tensor radius, torch::Tensor codes, int64_t bits,
                 int64_t page_size, torch::Tensor tok, torch::Tensor pb) {
  const int64_t n = page_ids.size(0), h_kv = lo.size(1), D = lo.size(2);
  const int64_t h_q = q.size(1), G = h_q / h_kv, bytes = codes.size(2);
  const float* qp = q.data_ptr<float>();
  const int64_t* pid = page_ids.data_ptr<int64_t>();
  const int64_t* preq = page_req.data_ptr<int64_t>();
  const uint8_t* c = codes.data_ptr<uint8_t>();
  float* tp = tok.data_ptr<float>();
  float* pbp = pb.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lo.scalar_type(), "grid_bounds", [&] {
    const scalar_t* lp = lo.data_ptr<scalar_t>();
    const scalar_t* sp = scale.data_ptr<scalar_t>();
    const scalar_t* rp = radius.data_ptr<scalar_t>();
    at::parallel_for(0, n * h_kv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> row(D), w(G * D), off(G);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / h_kv, k = task % h_kv, meta = (pid[i] * h_kv + k) * D;
        page_terms(qp + (preq[i] * h_q + k * G) * D, lp + meta, sp + meta, rp + meta, G, D, bits,
                   w.data(), off.data(), pbp + (i * h_kv + k) * G);
        for (int64_t p = 0; p < page_size; ++p) {
          const int64_t slot = pid[i] * page_size + p;
          unpack_row(c + (slot * h_kv + k) * bytes, static_cast<int>(bits), static_cast<int>(D), row.data());
          float* dst = tp + ((i * page_size + p) * h_kv + k) * G;
          for (int64_t g = 0; g < G; ++g) dst[g] = off[g] + dot(row.data(), w.data() + g * D, static_cast<int>(D));
        }
      }
    });
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
  const float* t;          // [B, H_q] threshold for page and token bounds
  const float* t_gate;     // [B, H_q] value gate threshold (-inf: attend every candidate)
  const float* ref;        // [B, H_q] reference score of the mass accounting
  float sigma;
  int64_t h_q, h_kv, groups, dim, dim_v, bytes, page_size, bits;
};

// Accounting per head, relative to exp(σ·(s − ref)) in fp64: mass[0] index-dropped keys (skipped
// pages count P·e^{σ(pb − ref)}, kept pages their tokens below T), mass[1] value-gated candidates
// (exact score below the gate threshold), mass[2] every union candidate (exact).
struct HeadState {
  float m = -INFINITY, l = 0.f;
  int64_t attended = 0, skipped = 0;
  double mass[3] = {0.0, 0.0, 0.0};
};

inline double rel_mass(float sigma, float x, float ref) {
  return std::exp(std::min(700.0, double(sigma) * (double(x) - double(ref))));
}

template <typename KV>
struct ChunkRunner {
  const AttendArgs& a;
  const KV *kc, *vc, *lo, *sc, *rad;
  int64_t b, k, head0;
  std::vector<float> row, buf, acc, s, w, off, pb;
  std::vector<char> keep_page, attend;
  std::vector<HeadState> st;
  int64_t n_union = 0, n_values = 0, n_pages_read = 0;

  ChunkRunner(const AttendArgs& args, const KV* kc_, const KV* vc_, const KV* lo_, const KV* sc_,
              const KV* rad_, int64_t chunk, int64_t kv_head)
      : a(args), kc(kc_), vc(vc_), lo(lo_), sc(sc_), rad(rad_), b(args.chunk_req[chunk]), k(kv_head),
        head0(args.chunk_req[chunk] * args.h_q + kv_head * args.groups), row(args.dim),
        buf(std::max(args.dim, args.dim_v)), acc(args.groups * args.dim_v, 0.f), s(args.groups),
        w(args.groups * args.dim), off(args.groups), pb(args.groups), keep_page(args.groups),
        attend(args.groups), st(args.groups) {}

  // Page bounds of page row i; false if every head of the group skips the page.
  bool open_page(int64_t i) {
    const int64_t G = a.groups, meta = (a.page_ids[i] * a.h_kv + k) * a.dim;
    page_terms(a.q + head0 * a.dim, lo + meta, sc + meta, rad + meta, G, a.dim, a.bits, w.data(),
               off.data(), pb.data());
    bool any = false;
    for (int64_t g = 0; g < G; ++g) {
      keep_page[g] = !(pb[g] < a.t[head0 + g]);  // NaN keeps
      if (!keep_page[g]) {
        st[g].skipped += 1;
        st[g].mass[0] += double(a.page_size) * rel_mass(a.sigma, pb[g], a.ref[head0 + g]);
      }
      any |= keep_page[g];
    }
    return any;
  }

  // Token gate of one slot; true if some head of the group keeps it.
  bool token_candidate(int64_t slot) {
    unpack_row(a.codes + (slot * a.h_kv + k) * a.bytes, static_cast<int>(a.bits), a.dim, row.data());
    bool cand = false;
    for (int64_t g = 0; g < a.groups; ++g) {
      if (!keep_page[g]) continue;
      const float u = off[g] + dot(row.data(), w.data() + g * a.dim, a.dim);
      const bool keep = !(u < a.t[head0 + g]);
      if (!keep) st[g].mass[0] += rel_mass(a.sigma, u, a.ref[head0 + g]);
      cand |= keep;
    }
    return cand;
  }

  // Exact scores from the candidate's key, value gate, then V and the online softmax.
  void attend_slot(int64_t slot) {
    const int64_t G = a.groups, D = a.dim, DV = a.dim_v;
    ++n_union;
    const KV* kr = kc + (slot * a.h_kv + k) * D;
    for (int64_t d = 0; d < D; ++d) buf[d] = to_f32(kr[d]);
    bool need_v = false;
    for (int64_t g = 0; g < G; ++g) {
      s[g] = dot(buf.data(), a.q + (head0 + g) * D, D);
      const double e = rel_mass(a.sigma, s[g], a.ref[head0 + g]);
      attend[g] = !(s[g] < a.t_gate[head0 + g]);
      st[g].mass[2] += e;
      if (!attend[g]) st[g].mass[1] += e;
      need_v |= attend[g];
    }
    if (!need_v) return;
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

  void run(int64_t chunk) {
    for (int64_t i = a.chunk_begin[chunk]; i < a.chunk_end[chunk]; ++i) {
      if (!open_page(i)) continue;
      ++n_pages_read;
      for (int64_t p = 0; p < a.page_size; ++p) {
        const int64_t slot = a.page_ids[i] * a.page_size + p;
        if (token_candidate(slot)) attend_slot(slot);
      }
    }
  }

  void write(float* m_out, float* l_out, float* o_out, int64_t* counts, double* mass_out) const {
    const int64_t G = a.groups, DV = a.dim_v;
    for (int64_t g = 0; g < G; ++g) {
      m_out[g] = st[g].m;
      l_out[g] = st[g].l;
      for (int64_t d = 0; d < DV; ++d) o_out[g * DV + d] = acc[g * DV + d];
      counts[g] = st[g].attended;
      counts[G + g] = st[g].skipped;
      for (int j = 0; j < 3; ++j) mass_out[g * 3 + j] = st[g].mass[j];
    }
    counts[2 * G] = n_union;
    counts[2 * G + 1] = n_values;
    counts[2 * G + 2] = n_pages_read;
  }
};

}  // namespace

// Outputs per (chunk, KV head): m, l [NC, H_kv, G] f32 (m in σ·score units), o [NC, H_kv, G, D_v]
// f32 (unnormalised), counts [NC, H_kv, 2G + 3] i64 (attended per head, pages skipped per head,
// union candidates, values read, pages read), mass [NC, H_kv, G, 3] f64 (see HeadState).
void grid_sparse_attend(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor lo, torch::Tensor scale, torch::Tensor radius,
                        torch::Tensor codes, torch::Tensor page_ids, torch::Tensor chunk_req,
                        torch::Tensor chunk_begin, torch::Tensor chunk_end, torch::Tensor t,
                        torch::Tensor t_gate, torch::Tensor ref, double sigma, int64_t bits,
                        int64_t page_size, torch::Tensor m_out, torch::Tensor l_out,
                        torch::Tensor o_out, torch::Tensor counts, torch::Tensor mass) {
  TORCH_CHECK(lo.scalar_type() == k_cache.scalar_type(), "index codebooks must use the KV dtype");
  AttendArgs a{q.data_ptr<float>(), codes.data_ptr<uint8_t>(), page_ids.data_ptr<int64_t>(),
               chunk_req.data_ptr<int64_t>(), chunk_begin.data_ptr<int64_t>(),
               chunk_end.data_ptr<int64_t>(), t.data_ptr<float>(), t_gate.data_ptr<float>(),
               ref.data_ptr<float>(), static_cast<float>(sigma), q.size(1), k_cache.size(1),
               q.size(1) / k_cache.size(1), q.size(2), v_cache.size(2), codes.size(2), page_size, bits};
  const int64_t n_chunks = chunk_req.size(0), G = a.groups;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "grid_sparse_attend", [&] {
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const scalar_t* lp = lo.data_ptr<scalar_t>();
    const scalar_t* sp = scale.data_ptr<scalar_t>();
    const scalar_t* rp = radius.data_ptr<scalar_t>();
    at::parallel_for(0, n_chunks * a.h_kv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t c = task / a.h_kv, k = task % a.h_kv, base = task * G;
        ChunkRunner<scalar_t> runner(a, kc, vc, lp, sp, rp, c, k);
        runner.run(c);
        runner.write(m_out.data_ptr<float>() + base, l_out.data_ptr<float>() + base,
                     o_out.data_ptr<float>() + base * a.dim_v,
                     counts.data_ptr<int64_t>() + task * (2 * G + 3), mass.data_ptr<double>() + base * 3);
      }
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grid_bounds", &grid_bounds, "Louver grid page and token upper bounds (CPU)");
  m.def("grid_sparse_attend", &grid_sparse_attend, "Louver grid filter + sparse attention (CPU)");
}
