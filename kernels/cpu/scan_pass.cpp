// The certified histogram rule in one scan of the codes: per chunk of pages (the attend pass's
// tasks), every page's bounds binned into the histogram of the dropped mass, as the two-pass rule's
// bound pass does, and every token whose bound reaches its head's reserve level kept in the
// chunk's reserve with its bounds. The attend pass then reads the reserve at the chosen T (its
// band mode) instead of the codes a second time. Design notes, "Certified in one code pass".

#include <omp.h>

#include "common.h"
#include "ops.h"
#include "page_scan.h"

using namespace louver_cpu;

namespace {

// One chunk of pages for every KV head: page terms, the histogram and the reserve. Returns the
// pages whose codes were read (some head's page bound reaches its level).
template <typename M>
int64_t scan_chunk(const ScanPass& s, const Codes& codes, const M* lo, const M* sc, const M* rad, int64_t c,
                   PageScan& scan, double* part, std::vector<HistRows>& hr) {
  const int64_t P = s.page_size, h_kv = s.h_kv, G = s.groups, H = h_kv * G, D = s.dim, W = s.edges.width();
  const int64_t begin = s.chunk_begin[c], end = s.chunk_end[c], b = s.chunk_req[c];
  const int64_t page_block = P * h_kv * codes.bytes;
  int64_t read = 0;
  std::vector<ReserveRegion> regions(h_kv);
  for (int64_t k = 0; k < h_kv; ++k) {
    const int64_t base = (begin * h_kv + k * (end - begin)) * P;
    regions[k] = ReserveRegion{s.reserve_slot + base, s.reserve_pos + base, s.reserve_bound + base * G, 0};
  }
  for (int64_t i = begin; i < end; ++i) {
    if (i + 1 < end) prefetch_bytes_l2(codes.data + s.page_ids[i + 1] * page_block, page_block);
    bool opened = false;
    for (int64_t k = 0; k < h_kv; ++k) {
      const int64_t head0 = b * H + k * G, meta = (s.page_ids[i] * h_kv + k) * D;
      for (int64_t g = 0; g < G; ++g) {
        double* row = part + (head0 + g) * 3 * W;
        hr[g] = HistRows{row, row + W, row + 2 * W};
      }
      scan.set_levels(s.level + head0, s.level_bin + head0);
      scan.terms(s.q + head0 * D, lo + meta, sc + meta, rad + meta);
      std::copy_n(scan.pb.data(), G, s.page_bound + i * H + k * G);
      std::copy_n(scan.mag.data(), G, s.page_mag + i * H + k * G);
      scan.add_pages(s.ref + head0, hr.data());
      if (!scan.reaches()) continue;  // every head drops the page whole at any T from its level up
      opened = true;
      scan.weights();
      scan.scan(codes, s.page_ids[i] * P, k, s.ref + head0, hr.data(), nullptr, 0, &regions[k], i);
    }
    read += opened;
  }
  for (int64_t k = 0; k < h_kv; ++k) s.reserve_count[c * h_kv + k] = regions[k].n;
  return read;
}

// Every chunk dealt to the threads in turn, thread t's histograms at part + 3·t·stride.
template <typename M>
void scan_chunks(const ScanPass& s, const Codes& codes, const M* lo, const M* sc, const M* rad, double* part,
                 int64_t stride, int64_t* read) {
#pragma omp parallel num_threads(at::get_num_threads())
  {
    PageScan scan(s.groups, s.dim, s.bits, s.page_size, s.sigma, s.edges, s.residual);
    std::vector<HistRows> hr(s.groups);
    double* mine = part + 3 * omp_get_thread_num() * stride;
#pragma omp for schedule(static, 1)
    for (int64_t c = 0; c < s.n_chunks; ++c) read[c] = scan_chunk(s, codes, lo, sc, rad, c, scan, mine, hr);
  }
}

}  // namespace

// The pass (ScanPass, ops.h): the chunks dealt to the threads in turn (a fixed assignment, so that
// each thread's partial histogram, and so the fp64 sums, are the same at every call; the guided
// chunk sizes shrink slowly enough to keep the threads' shares even), then T per (request, head)
// by the histogram rule (choose_thresholds).
void louver_cpu::run_scan_pass(const ScanPass& s) {
  const int64_t W = s.edges.width(), rows = s.batch * s.h_kv * s.groups, threads = at::get_num_threads();
  const Codes codes = codes_view(s.codes);
  TORCH_CHECK(!codes.block16 || s.page_size % 16 == 0, "scan pass: block16 codes need pages of a multiple of 16 slots");
  std::vector<double> part(3 * threads * rows * W, 0.0);
  std::vector<int64_t> read(s.n_chunks, 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, s.lo.scalar_type(), "scan_pass", [&] {
    scan_chunks(s, codes, s.lo.data_ptr<scalar_t>(), s.scale.data_ptr<scalar_t>(), s.radius.data_ptr<scalar_t>(),
                part.data(), rows * W, read.data());
  });
  std::fill(s.pages_read, s.pages_read + s.batch, 0);
  for (int64_t c = 0; c < s.n_chunks; ++c) s.pages_read[s.chunk_req[c]] += read[c];
  choose_thresholds(part.data(), threads, rows, W, s.hist, s.habs, s.z_lb, s.ref, s.sigma, s.eps_budget, s.rounding,
                    s.edges, s.t, s.certificate, s.edge);
}
