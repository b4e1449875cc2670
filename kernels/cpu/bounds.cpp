// Bound passes of the certified threshold (grid family): page and token upper bounds of every
// indexed page, the histogram of their masses over the fixed levels, and the exact recount of the
// mass dropped at the chosen T.

#include "common.h"
#include "ops.h"

using namespace louver_cpu;

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
      std::vector<float> row(D), w(G * D), wr(G * D), off(G), book(3 * D), codes16(16 * D);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / h_kv, k = task % h_kv, meta = (pid[i] * h_kv + k) * D;
        load_codebook(lp + meta, sp + meta, rp + meta, D, book.data());
        page_terms(qp + (preq[i] * h_q + k * G) * D, book.data(), book.data() + D, book.data() + 2 * D,
                   G, D, bits, w.data(), off.data(), pbp + (i * h_kv + k) * G);
        int64_t p = 0;
#if defined(__AVX512F__)
        if (bits == 8 || bits == 4) {
          for (int64_t g = 0; g < G; ++g) nibble_order(w.data() + g * D, bits, D, 32, wr.data() + g * D);
          for (; p + 16 <= page_size; p += 16)
            bounds_block16(c + ((pid[i] * page_size + p) * h_kv + k) * bytes, h_kv * bytes, bits, D, wr.data(),
                           off.data(), G, codes16.data(), tp + ((i * page_size + p) * h_kv + k) * G, h_kv * G);
        }
#endif
        for (; p < page_size; ++p) {
          const int64_t slot = pid[i] * page_size + p;
          unpack_row(c + (slot * h_kv + k) * bytes, static_cast<int>(bits), static_cast<int>(D), row.data());
          float* dst = tp + ((i * page_size + p) * h_kv + k) * G;
          for (int64_t g = 0; g < G; ++g) dst[g] = off[g] + dot(row.data(), w.data() + g * D, static_cast<int>(D));
        }
      }
    });
  });
}

// Levels (louver_sgl/decode/threshold.py): edge j = kEdgeLow + kEdgeStep·j, j < kEdgeCount, in units
// of σ·(T − ref). A unit's bin is the number of edges <= its x = σ·(bound − ref) (NaN: past the end).
constexpr double kEdgeLow = -48.0, kEdgeStep = 0.25;
constexpr int64_t kEdgeCount = 257;

inline int64_t edge_bin(double x) {
  if (std::isnan(x)) return kEdgeCount;
  if (x < kEdgeLow) return 0;
  const double j = std::floor((x - kEdgeLow) / kEdgeStep);
  return j >= kEdgeCount - 1 ? kEdgeCount : static_cast<int64_t>(j) + 1;
}

// Page slices per head for the certified passes: enough (head, slice) tasks for every thread to
// get several, so that one head with more work does not leave a core idle.
inline int64_t page_slices(int64_t n_pages, int64_t heads) {
  const int64_t want = (4 * at::get_num_threads() + heads - 1) / heads;
  return std::max<int64_t>(1, std::min<int64_t>(n_pages, want));
}

// Upper bound of e^x: glibc's expf is within 1 ulp, so scaling by (1 + 2^-21) rounds up.
inline double exp_up(double x) {
  if (x > 80.0) return std::exp(std::min(x, 700.0)) * (1.0 + 1e-12);
  return static_cast<double>(std::exp(static_cast<float>(x))) * (1.0 + 4.76837158203125e-07);
}

// hist [B, H_q, kEdgeCount + 2] f64 (zeroed by the caller): pages add P·e^{x_page} at their bin,
// tokens e^{x_tok} over [bin_tok, bin_page) as a +/- pair (see filter._certified_mass).
// tok [NP, P, H_q], pb [NP, H_q] f32; page_req [NP] i64; ref [B, H_q] f32.
void certified_hist(torch::Tensor tok, torch::Tensor pb, torch::Tensor page_req, torch::Tensor ref,
                    double sigma, torch::Tensor hist) {
  const int64_t n = tok.size(0), P = tok.size(1), H = tok.size(2), W = kEdgeCount + 2;
  const float* tp = tok.data_ptr<float>();
  const float* pp = pb.data_ptr<float>();
  const int64_t* req = page_req.data_ptr<int64_t>();
  const float* rp = ref.data_ptr<float>();
  const int64_t rows = hist.size(0) * H, S = page_slices(n, H);
  std::vector<double> part(S * rows * W, 0.0);  // one histogram per page slice, summed below
  at::parallel_for(0, H * S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % H, slice = task / H;
      for (int64_t i = slice * n / S; i < (slice + 1) * n / S; ++i) {
        const double r = rp[req[i] * H + h];
        const float page = pp[i * H + h];
        const double xp = sigma * (double(page) - r);
        const int64_t bp = edge_bin(xp);
        double* row = part.data() + (slice * rows + req[i] * H + h) * W;
        if (!std::isnan(xp)) row[bp] += double(P) * exp_up(xp);
        for (int64_t p = 0; p < P; ++p) {
          const float u = std::min(tp[(i * P + p) * H + h], page);  // NaN page keeps NaN
          const double xu = sigma * (double(u) - r);
          const int64_t bu = edge_bin(xu);
          if (bu >= bp) continue;
          const double e = exp_up(xu);
          row[bu] += e;
          row[bp] -= e;
        }
      }
    }
  });
  double* hp = hist.data_ptr<double>();
  for (int64_t slice = 0; slice < S; ++slice)
    for (int64_t j = 0; j < rows * W; ++j) hp[j] += part[slice * rows * W + j];
}

// Mass dropped at thresholds t [B, H_q]: pages with pb < t (P·e^{x}), and in the other pages the
// tokens with min(tok, pb) < t (e^{x}); NaN bounds are kept. -> out [B, H_q] f64 (zeroed by caller).
void certified_dropped(torch::Tensor tok, torch::Tensor pb, torch::Tensor page_req, torch::Tensor ref,
                       torch::Tensor t, double sigma, torch::Tensor out) {
  const int64_t n = tok.size(0), P = tok.size(1), H = tok.size(2);
  const float* tp = tok.data_ptr<float>();
  const float* pp = pb.data_ptr<float>();
  const int64_t* req = page_req.data_ptr<int64_t>();
  const float* rp = ref.data_ptr<float>();
  const float* thr = t.data_ptr<float>();
  const int64_t rows = out.numel(), S = page_slices(n, H);
  std::vector<double> part(S * rows, 0.0);
  at::parallel_for(0, H * S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % H, slice = task / H;
      for (int64_t i = slice * n / S; i < (slice + 1) * n / S; ++i) {
        const int64_t rh = req[i] * H + h;
        const float page = pp[i * H + h];
        const double r = rp[rh];
        double& acc = part[slice * rows + rh];
        if (page < thr[rh]) {
          acc += double(P) * exp_up(sigma * (double(page) - r));
          continue;
        }
        for (int64_t p = 0; p < P; ++p) {
          const float u = std::min(tp[(i * P + p) * H + h], page);
          if (u < thr[rh]) acc += exp_up(sigma * (double(u) - r));
        }
      }
    }
  });
  double* op = out.data_ptr<double>();
  for (int64_t slice = 0; slice < S; ++slice)
    for (int64_t j = 0; j < rows; ++j) op[j] += part[slice * rows + j];
}
