// The attend pass of the grid family: per (request, chunk of pages) task, for every KV head,
// page bounds, token bounds (16-token VNNI blocks), the candidate gate (any head of the GQA
// group), exact scores from the candidates' keys, the value gate, an online softmax with V read
// only for attended rows, and the dropped-mass accounting. Partial softmax states per chunk are
// merged afterwards (split-K), so both cores stay busy even at batch 1.
#pragma once

#include "common.h"

namespace louver_cpu {

struct AttendArgs {
  const float* q;          // [B, H_q, D]
  Codes codes;             // [slots, H_kv, bytes] or block16 (see Codes)
  const int64_t* page_ids; // [NP] grouped by request
  const int64_t* chunk_req;    // [NC] request of each chunk
  const int64_t* chunk_begin;  // [NC] first page row
  const int64_t* chunk_end;    // [NC] one past the last page row
  const float* t;          // [B, H_q] threshold for page and token bounds
  const float* t_gate;     // [B, H_q] value gate threshold (-inf: attend every candidate)
  const float* ref;        // [B, H_q] reference score of the mass accounting
  float sigma;
  int64_t h_q, h_kv, groups, dim, dim_v, bytes, page_size, bits, n_chunks;
  // outputs per (chunk, KV head): m, l [NC, H_kv, G] f32 (m in σ·score units), o [NC, H_kv, G, D_v]
  // f32 (unnormalised), counts [NC, H_kv, 2G + 3] i64 (attended per head, pages skipped per head,
  // union candidates, values read, pages read), mass [NC, H_kv, G, 3] f64 (see HeadState)
  float *m_out, *l_out, *o_out;
  int64_t* counts;
  double* mass;
  // debug only (null on the serving path): the attended set [NP, P, H_q] u8, 1 where head h of the
  // page row's request attended that token of the page (after the value gate); written by the
  // runner that owns the (page row, KV head), so threads never share a byte
  uint8_t* attended = nullptr;
  // The a-posteriori certified rule (null / false otherwise). First pass: t_reserve [B, H_q], the
  // histogram rule's level (the lowest the second level can reach). Pages some head keeps at
  // t_reserve are scanned, and their tokens that are no candidates at t but whose bound (the
  // token bound, at most the page bound) reaches t_reserve for some head go to the reserve with
  // those bounds per head; page_bound_out [NP, H_q] receives every page bound. Band pass (band):
  // the candidates are the reserve's tokens whose bound reaches the lowered t for some head: no
  // code is read again and no key is scored twice. band_req [B]: requests with a lowered head
  // (the other requests' chunks write an empty state). The reserve of chunk c and KV head k
  // starts at entry (chunk_begin[c]·H_kv + k·(chunk_end[c] − chunk_begin[c]))·P: slot [E] i64,
  // pos [E] i64 (page row · P + offset), bound [E, G] f32; count [NC, H_kv] i64.
  const float* t_reserve = nullptr;
  float* page_bound_out = nullptr;
  // [NP, H_q]: the first pass writes every opened page's magnitudes (page_terms' mag), the band
  // pass reads those of its entries' pages (the slack of their exact scores)
  float* page_mag = nullptr;
  int64_t *reserve_slot = nullptr, *reserve_pos = nullptr, *reserve_count = nullptr;
  float* reserve_bound = nullptr;
  bool band = false;
  const uint8_t* band_req = nullptr;
  // only_req [B] (null: every request): the pass runs the chunks of the requests marked 1 and
  // writes nothing for the others (the one-scan certified step's two kinds of requests)
  const uint8_t* only_req = nullptr;
  // only_kv [B·H_kv] (null: every KV head), with only_req: of those requests' chunks, the pass
  // runs the KV heads marked 1 and writes nothing for the others, which keep the earlier pass's
  // chunk states (the one-pass a-posteriori rule's groups with no lowered head)
  const uint8_t* only_kv = nullptr;
  // residual int8 weights (quantize_weights_residual): a second integer dot per token for a bound
  // ~250 times tighter in its int8 slack; applied where 2·G <= 8 (the dot kernels' heads)
  bool residual = false;
  // mass[0] sums each dropped token's own e^{σ(u − ref)} (exp_up, per lane, kMassUp) instead of a page's
  // count times its largest dropped bound's: one exp per block instead of one per page, for a
  // bound up to ~8x tighter (the one-pass rule a posteriori certifies with it)
  bool tight_dropped = false;
};

// Accounting per head, relative to exp(σ·(s − ref)) in fp64: mass[0] index-dropped keys (skipped
// pages count P·e^{σ(pb − ref)}, kept pages their tokens below T), mass[1] value-gated candidates
// (exact score below the gate threshold; an upper bound), mass[2] every union candidate (a lower
// bound: it only enlarges the softmax denominator's lower bound).
struct HeadState {
  float m = -INFINITY, l = 0.f;
  int64_t attended = 0, skipped = 0;
  double mass[3] = {0.0, 0.0, 0.0};
};

inline double rel_mass(float sigma, float x, float ref) {
  return std::exp(std::min(700.0, double(sigma) * (double(x) - double(ref))));
}

constexpr int64_t kBatchRows = 512;  // candidates per scored batch (ChunkRunner::batch_capacity)
constexpr int64_t kKeyAhead = 32;    // candidate K rows fetched ahead of scoring
constexpr int64_t kValueAhead = 8;   // V rows fetched ahead of the accumulation

template <typename KV>
struct ChunkRunner {
  const AttendArgs& a;
  const KV *kc, *vc, *lo, *sc, *rad;
  int64_t b, k, head0;
  bool open = false, vector_scores, residual;
  int64_t cap;  // batch capacity; declared before the buffers sized by it
  std::vector<float> buf, acc, w, off, pb, step, step2, resid, drop_max, drop_lanes, drop_mass, book, rows16, score, weight;
  // int8 weights [G2, D] (G2 = 2·G with residual weights: heads G.. hold the residuals);
  // nibble_order block 64 and block 8
  std::vector<int8_t> wq, wsplit, wsplit8;
  std::vector<int32_t> idot;
  std::vector<uint8_t> page_codes;
  std::vector<uint16_t> attend_bits, need_bits;  // per 16-candidate block: [G][blocks], [blocks]
  std::vector<int64_t> drop_count, cand_slot, value_rows, cand_pos;  // cand_pos: only with a.attended
  std::vector<char> keep_page, keep_res;  // keep_res: the page reaches t_reserve for the head
  std::vector<float> res_ub;  // [G, 16] the scanned block's token bounds (reserve entries)
  // per head: the largest page magnitude (page_terms' mag) of the pages whose candidates the
  // chunk has scored so far, and the references the candidates' masses are taken against
  // (lifted for the lower bound mass[2], lowered for the upper bound mass[1]: set by flush)
  std::vector<float> page_mag, mag_max, ref_low, ref_high;
  int64_t res_base = 0, res_n = 0;  // this chunk's reserve region and its entries
  std::vector<HeadState> st;
  int64_t n_cand = 0, n_union = 0, n_values = 0, n_pages_read = 0;
  int64_t page_row = 0;  // the page row open_page last saw
  bool skip = false;  // AttendArgs::only_kv left this KV head out of the chunk: no page opens

  ChunkRunner(const AttendArgs& args, const KV* kc_, const KV* vc_, const KV* lo_, const KV* sc_,
              const KV* rad_, int64_t chunk, int64_t kv_head)
      : a(args), kc(kc_), vc(vc_), lo(lo_), sc(sc_), rad(rad_), b(args.chunk_req[chunk]), k(kv_head),
        head0(args.chunk_req[chunk] * args.h_q + kv_head * args.groups),
        vector_scores((kHaveAvx512 || kHaveAvx2) && args.dim % 16 == 0 && args.dim_v % 16 == 0 && args.groups <= 8),
        residual(args.residual && 2 * args.groups <= 8),
        cap(batch_capacity(args.page_size)),
        buf(std::max(args.dim, args.dim_v)), acc(args.groups * args.dim_v, 0.f), w(args.groups * args.dim),
        off(args.groups), pb(args.groups), step(args.groups), step2(args.groups), resid(args.dim),
        drop_max(args.groups),
        drop_lanes(16 * args.groups), drop_mass(16 * args.groups), book(3 * args.dim), rows16(16 * args.dim), score(args.groups * cap),
        weight(args.groups * cap), wq(2 * args.groups * args.dim), wsplit(2 * args.groups * args.dim),
        wsplit8(2 * args.groups * args.dim), idot(2 * args.groups),
        page_codes(args.page_size * args.dim),
        attend_bits(args.groups * cap / 16), need_bits(cap / 16), drop_count(args.groups), cand_slot(cap),
        value_rows(cap), cand_pos(args.attended ? cap : 0), keep_page(args.groups), keep_res(args.groups, 0),
        res_ub(16 * args.groups), page_mag(args.groups), mag_max(args.groups, 0.f), ref_low(args.groups),
        ref_high(args.groups), st(args.groups) {
    set_reserve(chunk);
  }

  // The reserve region of chunk ``chunk`` for this runner's KV head (AttendArgs::t_reserve).
  void set_reserve(int64_t chunk) {
    const int64_t first = a.chunk_begin[chunk], pages = a.chunk_end[chunk] - first;
    res_base = (first * a.h_kv + k * pages) * a.page_size;
    res_n = 0;
  }

  static int64_t padded(int64_t n) { return (n + 15) / 16 * 16; }

  // Candidates are collected over pages and scored in batches of up to this many (at least one
  // page): each phase then streams through many independent rows with its reads issued well
  // ahead, instead of a page's few candidates waiting on their rows one page at a time.
  static int64_t batch_capacity(int64_t page_size) { return padded(std::max<int64_t>(kBatchRows, 2 * page_size)); }

  // Start chunk ``chunk`` with the buffers of the previous one (a runner lives for a whole worker:
  // building its two dozen scratch vectors per chunk cost as much as a phase of the step).
  void reset(int64_t chunk) {
    b = a.chunk_req[chunk];
    head0 = b * a.h_q + k * a.groups;
    open = false;
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(st.begin(), st.end(), HeadState{});
    n_cand = n_union = n_values = n_pages_read = 0;
    std::fill(mag_max.begin(), mag_max.end(), 0.f);
    set_reserve(chunk);
  }

  // Page bounds of page row i; if some head of the group keeps the page, its token weights are
  // quantised and the page is open for scanning. Returns whether it is open. (page_setup quantises
  // every head's weights with the page bounds, kept or not: pages are rarely skipped, and its one
  // pass costs a quarter less than the three steps it replaces.)
  bool open_page(int64_t i) {
    if (skip) return open = false;
    const int64_t G = a.groups, D = a.dim, meta = (a.page_ids[i] * a.h_kv + k) * D;
    page_row = i;
    const bool fused = !residual && page_setup_fits(D, a.bits);  // the int8 weights of every head, at once
    if (fused) {
      page_setup(a.q + head0 * D, lo + meta, sc + meta, rad + meta, G, D, a.bits, off.data(), pb.data(),
                 page_mag.data(), wq.data(), step.data());
    } else {
      load_codebook(lo + meta, sc + meta, rad + meta, D, book.data());
      page_terms(a.q + head0 * D, book.data(), book.data() + D, book.data() + 2 * D, G, D, a.bits, w.data(),
                 off.data(), pb.data(), page_mag.data());
    }
    open = false;
    for (int64_t g = 0; g < G; ++g) {
      keep_page[g] = !(pb[g] < a.t[head0 + g]);  // NaN keeps
      keep_res[g] = a.t_reserve && !(pb[g] < a.t_reserve[head0 + g]);
      if (a.page_bound_out) a.page_bound_out[i * a.h_q + k * G + g] = pb[g];
      if (!keep_page[g]) {
        st[g].skipped += 1;
        st[g].mass[0] += double(a.page_size) * rel_mass(a.sigma, pb[g], a.ref[head0 + g]);
      }
      open |= keep_page[g] || keep_res[g];
    }
    if (!open) return false;
    ++n_pages_read;
    grow_magnitude();
    if (a.page_mag) std::copy(page_mag.begin(), page_mag.end(), a.page_mag + i * a.h_q + k * G);
    for (int64_t g = 0; g < G; ++g) {
      if (!fused && (keep_page[g] || keep_res[g]))
        off[g] += residual ? quantize_weights_residual(w.data() + g * D, D, a.bits, wq.data() + g * D,
                                                       wq.data() + (G + g) * D, &step[g], &step2[g], resid.data())
                           : quantize_weights(w.data() + g * D, D, a.bits, wq.data() + g * D, &step[g]);
      drop_count[g] = 0;
      drop_max[g] = -INFINITY;
      std::fill(drop_lanes.begin() + 16 * g, drop_lanes.begin() + 16 * (g + 1), -INFINITY);
      std::fill(drop_mass.begin() + 16 * g, drop_mass.begin() + 16 * (g + 1), 0.f);
    }
    if (vnni_scan()) {  // 4-bit 16-token blocks read wsplit8; the per-token path (and 8 bits) wsplit
      const bool blocks4 = a.bits == 4, tokens = a.bits != 4 || a.page_size % 16 != 0;
      for (int64_t g = 0; g < dot_heads(); ++g) {
        if (tokens) nibble_order_int8(wq.data() + g * D, a.bits, D, 64, wsplit.data() + g * D);
        if (blocks4) nibble_order_int8(wq.data() + g * D, a.bits, D, 8, wsplit8.data() + g * D);
      }
    } else if (avx2_scan() && a.bits == 4) {  // 8-bit codes take the weights in channel order
      for (int64_t g = 0; g < dot_heads(); ++g) nibble_order_int8(wq.data() + g * D, a.bits, D, 8, wsplit8.data() + g * D);
    }
    return true;
  }

  bool vnni_scan() const { return kHaveVnni && a.dim % 64 == 0 && (a.bits == 4 || a.bits == 8) && a.groups <= 8; }

  // Weight rows the integer dots run over: G, or 2·G with residual weights.
  int64_t dot_heads() const { return residual ? 2 * a.groups : a.groups; }

  // The 8-lane scan (AVX2 builds): 4-bit codes, and 8-bit ones without VNNI, in the block16 layout
  // (pages of a multiple of 16).
  bool avx2_scan() const { return avx2_block_scan(a.codes, a.bits, a.dim, a.groups); }

  // Whether the scan walks 16-token blocks (scan_block16) instead of single tokens.
  bool block_scan() const { return vnni_scan() || avx2_scan(); }

  // Token bounds of the open page's tokens p .. p+15 (int8 weights against byte codes, VNNI), then
  // the candidate gate. Dropped tokens are accounted per head by count and largest bound:
  // n·e^{σ(max u − ref)} bounds their mass with one exp per page (with tight_dropped: each by its
  // own bound).
  void scan_block16(int64_t first, int64_t p) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const int64_t G = a.groups;
    __m512i dots[8];
    dot_block16(a.codes, first + p, k, a.bits, a.dim, wsplit.data(), wsplit8.data(), dot_heads(), dots);
    uint32_t cand = 0, res = 0;
    for (int64_t g = 0; g < G; ++g) {
      if (!keep_page[g] && !keep_res[g]) continue;
      const __m512 ub = residual ? token_bounds16_2(off[g], step[g], step2[g], dots[g], dots[G + g])
                                 : token_bounds16(off[g], step[g], dots[g]);
      if (keep_res[g]) {  // a-posteriori first pass: the tokens the band may need
        res |= static_cast<uint16_t>(~_mm512_cmp_ps_mask(ub, _mm512_set1_ps(a.t_reserve[head0 + g]), _CMP_LT_OQ));
        _mm512_storeu_ps(res_ub.data() + 16 * g, ub);
      }
      if (!keep_page[g]) continue;
      const __mmask16 drop = _mm512_cmp_ps_mask(ub, _mm512_set1_ps(a.t[head0 + g]), _CMP_LT_OQ);  // NaN keeps
      if (drop && a.tight_dropped) {  // per lane in fp32; end_page adds the lanes once per page
        const __m512 x = _mm512_mul_ps(_mm512_set1_ps(a.sigma), _mm512_sub_ps(ub, _mm512_set1_ps(a.ref[head0 + g])));
        float* lanes = drop_mass.data() + 16 * g;
        const __m512 sum = _mm512_loadu_ps(lanes);
        _mm512_storeu_ps(lanes, _mm512_mask_add_ps(sum, drop, sum, exp_up16(x)));
      } else if (drop) {  // the largest dropped bound per lane; end_page reduces the lanes once per page
        drop_count[g] += __builtin_popcount(static_cast<uint32_t>(drop));
        const __m512 seen = _mm512_loadu_ps(drop_lanes.data() + 16 * g);
        _mm512_storeu_ps(drop_lanes.data() + 16 * g, _mm512_mask_max_ps(seen, drop, seen, ub));
      }
      cand |= static_cast<uint32_t>(static_cast<uint16_t>(~drop));
    }
    for (res &= ~cand; res; res &= res - 1) reserve(first + p + __builtin_ctz(res), res_ub.data() + __builtin_ctz(res), 16);
    for (; cand; cand &= cand - 1) add_candidate(first + p + __builtin_ctz(cand));
#elif defined(LOUVER_AVX2)
    const int64_t G = a.groups;
    alignas(32) int32_t dots[8 * 16];
    dot_block16_avx2(a.codes.block(first + p, k), a.bits, a.dim, (a.bits == 4 ? wsplit8 : wq).data(), dot_heads(), dots);
    uint32_t cand = 0, res = 0;
    for (int64_t g = 0; g < G; ++g) {
      if (!keep_page[g] && !keep_res[g]) continue;
      const __m256 t = _mm256_set1_ps(a.t[head0 + g]);
      for (int h = 0; h < 2; ++h) {
        const __m256i d = _mm256_load_si256(reinterpret_cast<const __m256i*>(dots + g * 16 + 8 * h));
        const __m256 ub = residual ? token_bounds8_2(off[g], step[g], step2[g], d,
                                                     _mm256_load_si256(reinterpret_cast<const __m256i*>(dots + (G + g) * 16 + 8 * h)))
                                   : token_bounds8(off[g], step[g], d);
        if (keep_res[g]) {  // a-posteriori first pass: the tokens the band may need
          const __m256 low = _mm256_cmp_ps(ub, _mm256_set1_ps(a.t_reserve[head0 + g]), _CMP_LT_OQ);
          res |= (~static_cast<uint32_t>(_mm256_movemask_ps(low)) & 0xFFu) << (8 * h);
          _mm256_storeu_ps(res_ub.data() + 16 * g + 8 * h, ub);
        }
        if (!keep_page[g]) continue;
        const __m256 below = _mm256_cmp_ps(ub, t, _CMP_LT_OQ);  // NaN keeps
        const uint32_t drop = static_cast<uint32_t>(_mm256_movemask_ps(below));
        if (drop && a.tight_dropped) {  // per lane in fp32, as the 16-lane version
          const __m256 x = _mm256_mul_ps(_mm256_set1_ps(a.sigma), _mm256_sub_ps(ub, _mm256_set1_ps(a.ref[head0 + g])));
          float* lanes = drop_mass.data() + 16 * g + 8 * h;
          _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_loadu_ps(lanes), _mm256_and_ps(exp_up8(x), below)));
        } else if (drop) {  // the largest dropped bound per lane, as the 16-lane version
          drop_count[g] += __builtin_popcount(drop);
          float* lanes = drop_lanes.data() + 16 * g + 8 * h;
          const __m256 seen = _mm256_loadu_ps(lanes);
          _mm256_storeu_ps(lanes, _mm256_blendv_ps(seen, _mm256_max_ps(seen, ub), below));
        }
        cand |= (~drop & 0xFFu) << (8 * h);
      }
    }
    for (res &= ~cand; res; res &= res - 1) reserve(first + p + __builtin_ctz(res), res_ub.data() + __builtin_ctz(res), 16);
    for (; cand; cand &= cand - 1) add_candidate(first + p + __builtin_ctz(cand));
#else
    (void)first;
    (void)p;
#endif
  }

  // The same bounds and gate for tokens p .. P−1, one token at a time (pages not a multiple of 16,
  // or no VNNI / a D that is not a multiple of 64).
  void scan_tokens(int64_t first, int64_t p) {
    const int64_t G = a.groups, D = a.dim, P = a.page_size;
    const bool vnni = vnni_scan();
    if (!vnni && p < P) unpack_page(a.codes, first, k, a.bits, P, D, page_codes.data());
    uint8_t scratch[Codes::kMaxBytes];
    for (; p < P; ++p) {
      if (vnni) {
        dot_token_vnni(a.codes.token(first + p, k, scratch), a.bits, D, wsplit.data(), dot_heads(), idot.data());
      } else {
        for (int64_t g = 0; g < dot_heads(); ++g) idot[g] = dot_u8s8(page_codes.data() + p * D, wq.data() + g * D, D);
      }
      bool cand = false, res = false;
      for (int64_t g = 0; g < G; ++g) {
        if (!keep_page[g] && !keep_res[g]) continue;
        const float ub = residual ? token_bound2(off[g], step[g], step2[g], idot[g], idot[G + g])
                                  : token_bound(off[g], step[g], idot[g]);
        if (keep_res[g]) {  // a-posteriori first pass: the tokens the band may need
          res |= !(ub < a.t_reserve[head0 + g]);
          res_ub[g] = ub;
        }
        if (!keep_page[g]) continue;
        if (ub < a.t[head0 + g]) {
          if (a.tight_dropped) {
            st[g].mass[0] += rel_mass(a.sigma, ub, a.ref[head0 + g]);
          } else {
            ++drop_count[g];
            drop_max[g] = std::max(drop_max[g], ub);
          }
        } else {
          cand = true;  // NaN keeps
        }
      }
      if (cand) add_candidate(first + p);
      else if (res) reserve(first + p, res_ub.data(), 1);
    }
  }

  // Candidates are gathered first and their K rows prefetched into L2 (scoring fetches them into
  // L1 kKeyAhead rows ahead), so that the random row reads overlap instead of stalling one by one.
  // Into L1 here they competed with the codes for its few miss buffers (5-7 % slower cold steps).
  void add_candidate(int64_t slot) {
    if (a.attended) cand_pos[n_cand] = page_row * a.page_size + slot - a.page_ids[page_row] * a.page_size;
    cand_slot[n_cand++] = slot;
    prefetch_bytes_l2(kc + (slot * a.h_kv + k) * a.dim, a.dim * static_cast<int64_t>(sizeof(KV)));
  }

  // A token of the open page into the reserve (AttendArgs::t_reserve): its slot, position and per
  // head the bound the band gates with, ub[g · stride] at most the page bound (NaN stays NaN, and
  // keeps); a head whose page bound is below t_reserve keeps its page bound, below every level the
  // band can take.
  void reserve(int64_t slot, const float* ub, int64_t stride) {
    const int64_t e = res_base + res_n++, G = a.groups;
    a.reserve_slot[e] = slot;
    a.reserve_pos[e] = page_row * a.page_size + slot - a.page_ids[page_row] * a.page_size;
    for (int64_t g = 0; g < G; ++g) {
      const float u = ub[g * stride], page = pb[g];
      a.reserve_bound[e * G + g] = !keep_res[g] ? page : (std::isnan(u) || std::isnan(page)) ? NAN : std::min(u, page);
    }
  }

  // mag_max takes in the page terms' magnitudes of the page just opened (NaN propagates).
  void grow_magnitude() {
    for (int64_t g = 0; g < a.groups; ++g)
      mag_max[g] = std::isnan(page_mag[g]) || std::isnan(mag_max[g]) ? NAN : std::max(mag_max[g], page_mag[g]);
  }

  // The band pass over this chunk's reserve: the tokens whose bound reaches the lowered T for some
  // head of the group, scored and attended in batches. The pages of its entries are not opened,
  // but their magnitudes (written by the first pass) are taken in.
  void run_reserve(int64_t chunk) {
    const int64_t G = a.groups, n = a.reserve_count[chunk * a.h_kv + k];
    int64_t seen_row = -1;
    for (int64_t e = res_base; e < res_base + n; ++e) {
      bool on = false;
      for (int64_t g = 0; g < G; ++g) on |= !(a.reserve_bound[e * G + g] < a.t[head0 + g]);  // NaN keeps
      if (!on) continue;
      const int64_t row = a.reserve_pos[e] / a.page_size;
      if (row != seen_row) {
        std::copy(a.page_mag + row * a.h_q + k * G, a.page_mag + row * a.h_q + (k + 1) * G, page_mag.begin());
        grow_magnitude();
        seen_row = row;
      }
      if (a.attended) cand_pos[n_cand] = a.reserve_pos[e];
      cand_slot[n_cand++] = a.reserve_slot[e];
      prefetch_bytes_l2(kc + (a.reserve_slot[e] * a.h_kv + k) * a.dim, a.dim * static_cast<int64_t>(sizeof(KV)));
      if (n_cand == cap) flush();
    }
    flush();
  }

  static void prefetch_row(const KV* row, int64_t n) { prefetch_bytes(row, n * static_cast<int64_t>(sizeof(KV))); }

  // The codebooks (lo, scale, radius) of page row i for every KV head (open_page's first reads;
  // fetched two pages ahead they no longer stall each page's setup: −2 % after a dense pass).
  void prefetch_codebooks(int64_t i) const {
    const int64_t n = a.h_kv * a.dim, first = a.page_ids[i] * n;
    for (const KV* book : {lo, sc, rad}) prefetch_row(book + first, n);
  }

  // After the scan of an open page: its dropped-mass accounting. Its candidates join the batch,
  // which is scored and attended (flush) once another page might not fit or the chunk ends.
  void end_page() {
    for (int64_t g = 0; g < a.groups; ++g) {
      if (a.tight_dropped) st[g].mass[0] += lane_mass(drop_mass.data() + 16 * g);
      if (!drop_count[g]) continue;
      float top = drop_max[g];  // the per-token path's; the 16-token blocks' are in drop_lanes
      for (int i = 0; i < 16; ++i) top = std::max(top, drop_lanes[16 * g + i]);
      st[g].mass[0] += double(drop_count[g]) * rel_mass(a.sigma, top, a.ref[head0 + g]);
    }
    if (n_cand + a.page_size > cap) flush();
  }

  // Exact scores of the batch's candidates (keys first), the value gate, then V only for the rows
  // some head attends.
  void flush() {
    if (n_cand == 0) return;
    n_union += n_cand;
    for (int64_t g = 0; g < a.groups; ++g) {  // every candidate's score errs by less than its page's slack
      const float ref = a.ref[head0 + g], slack = score_slack(mag_max[g], a.dim);
      ref_low[g] = lifted_ref(ref, slack);
      ref_high[g] = -lifted_ref(-ref, slack);
    }
    if (vector_scores) {
      score_candidates16();
    } else {
      score_candidates();
    }
    attend_candidates();
    n_cand = 0;
  }

  // Exact scores of the candidates [G, n_cand] in ``score``, attend/need flags and the masses
  // of the candidates (per token; the reference for the vector version below).
  void score_candidates() {
    const int64_t G = a.groups, D = a.dim, P16 = cap;
    std::fill(attend_bits.begin(), attend_bits.end(), 0);
    std::fill(need_bits.begin(), need_bits.end(), 0);
    for (int64_t c = 0; c < n_cand; ++c) {
      load_f32(kc + (cand_slot[c] * a.h_kv + k) * D, D, buf.data());
      for (int64_t g = 0; g < G; ++g) {
        const float s = dot(buf.data(), a.q + (head0 + g) * D, static_cast<int>(D));
        score[g * P16 + c] = s;
        const bool attend = !(s < a.t_gate[head0 + g]);
        st[g].mass[2] += rel_mass(a.sigma, s, ref_low[g]);
        if (!attend) st[g].mass[1] += rel_mass(a.sigma, s, ref_high[g]);
        if (attend) {
          attend_bits[g * (P16 / 16) + c / 16] |= uint16_t(1u << (c % 16));
          need_bits[c / 16] |= uint16_t(1u << (c % 16));
        }
      }
    }
  }

  // score_candidates for 16 candidates at a time: the 16-lane partial products of every head and
  // candidate (block_products) reduced by the transposing add tree, and the masses in fp32
  // (add_masses).
  void score_candidates16() {
#if defined(LOUVER_AVX2)
    // vector_scores: groups <= 8
    return with_heads(a.groups, [&](auto g) { score_candidates16_avx2<decltype(g)::value>(); });
#endif
#if defined(__AVX512F__)
    const int64_t G = a.groups, D = a.dim, P16 = cap;
    __m512 part[8][16];  // [head][candidate]; lanes past a short block read stale finite values
    for (int64_t g = 0; g < G; ++g)
      for (int t = 0; t < 16; ++t) part[g][t] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < n_cand; c0 += 16) {
      const int64_t nb = std::min<int64_t>(16, n_cand - c0);
      const __mmask16 valid = nb == 16 ? __mmask16(0xFFFF) : __mmask16((1u << nb) - 1);
      for (int64_t c = c0 + kKeyAhead; c < std::min(n_cand, c0 + kKeyAhead + 16); ++c)
        prefetch_row(kc + (cand_slot[c] * a.h_kv + k) * D, D);
      block_products(c0, nb, part);
      uint16_t need = 0;
      for (int64_t g = 0; g < G; ++g) {
        const __m512 s = lane_sums16_ps(part[g]);
        _mm512_storeu_ps(score.data() + g * P16 + c0, s);
        const __mmask16 attend = valid & ~_mm512_cmp_ps_mask(s, _mm512_set1_ps(a.t_gate[head0 + g]), _CMP_LT_OQ);
        attend_bits[g * (P16 / 16) + c0 / 16] = attend;
        need |= attend;
        add_masses(s, valid, attend, st[g], g);
      }
      need_bits[c0 / 16] = need;
      // the V rows some head attends, into L2 as soon as they are known (the value loop fetches
      // them into L1 kValueAhead rows ahead): in cold steps the value phase halved, the step 2-5 %
      for (uint32_t bits = need; bits; bits &= bits - 1)
        prefetch_bytes_l2(vc + (cand_slot[c0 + __builtin_ctz(bits)] * a.h_kv + k) * a.dim_v,
                          a.dim_v * static_cast<int64_t>(sizeof(KV)));
    }
#endif
  }

#if defined(__AVX512F__)
  // part[g][t] = the 16-lane products of head g's query and candidate c0 + t's key, summed over
  // the channel blocks in order (its lanes add up to the score), for t < nb. With D = 64 and at most
  // 4 heads, each key row is converted once into 4 registers and multiplied by every head's query
  // held in registers; otherwise the rows are staged as fp32 and each head runs 16 FMA chains over
  // them (that form was bound by its loads: every FMA reloaded a staged row).
  void block_products(int64_t c0, int64_t nb, __m512 (*part)[16]) {
    const int64_t G = a.groups, D = a.dim;
    if (D == 64 && G <= 4) {
      __m512 qv[4][4];
      for (int64_t g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) qv[g][c] = _mm512_loadu_ps(a.q + (head0 + g) * D + 16 * c);
      for (int64_t t = 0; t < nb; ++t) {
        const KV* row = kc + (cand_slot[c0 + t] * a.h_kv + k) * D;
        const __m512 x[4] = {load16_ps(row), load16_ps(row + 16), load16_ps(row + 32), load16_ps(row + 48)};
        for (int64_t g = 0; g < G; ++g) {
          __m512 v = _mm512_setzero_ps();
          for (int c = 0; c < 4; ++c) v = _mm512_fmadd_ps(x[c], qv[g][c], v);
          part[g][t] = v;
        }
      }
      return;
    }
    for (int64_t t = 0; t < nb; ++t) load_f32(kc + (cand_slot[c0 + t] * a.h_kv + k) * D, D, rows16.data() + t * D);
    for (int64_t g = 0; g < G; ++g) staged_products16(rows16.data(), a.q + (head0 + g) * D, D, part[g]);
  }
#endif

#if defined(LOUVER_AVX2)
  // score_candidates16 with 8 lanes: per candidate, the 8-lane partial products of every head
  // (one pass over the key row, the queries read from L1), reduced 8 candidates at a time by the
  // transposing add tree. G (the group's heads) is a template argument, so that the per-head
  // sums of a key row stay in registers.
  template <int G>
  void score_candidates16_avx2() {
    const int64_t D = a.dim, P16 = cap;
    __m256 part[G][16];  // [head][candidate]; lanes past a short block read stale finite values
    for (int64_t g = 0; g < G; ++g)
      for (int t = 0; t < 16; ++t) part[g][t] = _mm256_setzero_ps();
    for (int64_t c0 = 0; c0 < n_cand; c0 += 16) {
      const int64_t nb = std::min<int64_t>(16, n_cand - c0);
      const uint32_t valid = nb == 16 ? 0xFFFFu : (1u << nb) - 1;
      for (int64_t c = c0 + kKeyAhead; c < std::min(n_cand, c0 + kKeyAhead + 16); ++c)
        prefetch_row(kc + (cand_slot[c] * a.h_kv + k) * D, D);
      for (int64_t t = 0; t < nb; ++t) {
        const KV* row = kc + (cand_slot[c0 + t] * a.h_kv + k) * D;
        __m256 v[G];
        for (int64_t g = 0; g < G; ++g) v[g] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 x = load8_ps(row + d);
          for (int64_t g = 0; g < G; ++g) v[g] = _mm256_fmadd_ps(x, _mm256_loadu_ps(a.q + (head0 + g) * D + d), v[g]);
        }
        for (int64_t g = 0; g < G; ++g) part[g][t] = v[g];
      }
      uint32_t need = 0;
      for (int64_t g = 0; g < G; ++g) {
        const __m256 gate = _mm256_set1_ps(a.t_gate[head0 + g]);
        uint32_t attend = 0;
        for (int h = 0; h < 2; ++h) {
          const __m256 s = lane_sums8_ps(part[g] + 8 * h);
          _mm256_storeu_ps(score.data() + g * P16 + c0 + 8 * h, s);
          const uint32_t lanes = (valid >> (8 * h)) & 0xFFu;
          const uint32_t on = lanes & ~static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(s, gate, _CMP_LT_OQ)));
          add_masses8(s, lanes, on, st[g], g);
          attend |= on << (8 * h);
        }
        attend_bits[g * (P16 / 16) + c0 / 16] = static_cast<uint16_t>(attend);
        need |= attend;
      }
      need_bits[c0 / 16] = static_cast<uint16_t>(need);
      for (uint32_t bits = need; bits; bits &= bits - 1)
        prefetch_bytes_l2(vc + (cand_slot[c0 + __builtin_ctz(bits)] * a.h_kv + k) * a.dim_v,
                          a.dim_v * static_cast<int64_t>(sizeof(KV)));
    }
  }

  // add_masses for 8 lanes (bit i of valid / attend: lane i).
  void add_masses8(__m256 s, uint32_t valid, uint32_t attend, HeadState& h, int64_t g) const {
    const __m256 sig = _mm256_set1_ps(a.sigma);
    h.mass[2] += double(exp_sum_low8(_mm256_mul_ps(sig, _mm256_sub_ps(s, _mm256_set1_ps(ref_low[g]))), valid)) * kMassDown;
    const uint32_t gated = valid & ~attend;
    if (gated)
      h.mass[1] += double(exp_sum_high8(_mm256_mul_ps(sig, _mm256_sub_ps(s, _mm256_set1_ps(ref_high[g]))), gated)) * kMassUp;
  }
#endif

#if defined(__AVX512F__)
  // mass[2] += a lower bound of Σ e^{σ(s − ref)} over the valid lanes' true scores, mass[1] += an
  // upper bound of the same over the valid lanes not attended (fp32 exps, see kMassDown / kMassUp;
  // the fp32 scores' own error, through ref_low / ref_high) for head g.
  void add_masses(__m512 s, __mmask16 valid, __mmask16 attend, HeadState& h, int64_t g) const {
    const __m512 sig = _mm512_set1_ps(a.sigma);
    h.mass[2] += double(exp_sum_low16(_mm512_mul_ps(sig, _mm512_sub_ps(s, _mm512_set1_ps(ref_low[g]))), valid)) * kMassDown;
    const __mmask16 gated = valid & ~attend;
    if (gated)
      h.mass[1] += double(exp_sum_high16(_mm512_mul_ps(sig, _mm512_sub_ps(s, _mm512_set1_ps(ref_high[g]))), gated)) * kMassUp;
  }
#endif

  // Online softmax over the batch's attended candidates: one rescale per head and batch to the
  // batch's largest score, then each needed V row is read once for all heads of the group.
  void attend_candidates() {
    const int64_t G = a.groups, DV = a.dim_v, P16 = cap, blocks = (n_cand + 15) / 16;
    for (int64_t g = 0; g < G; ++g) {
      HeadState& h = st[g];
      const float* sg = score.data() + g * P16;
      const uint16_t* ab = attend_bits.data() + g * (P16 / 16);
      float top = -INFINITY;
      const int64_t count = attended_top(sg, ab, blocks, &top);
      float* wg = weight.data() + g * P16;
      if (count == 0) {
        std::fill(wg, wg + n_cand, 0.f);
        continue;
      }
      h.attended += count;
      if (top > h.m) {  // rescale the running sum to the new maximum
        const float scale = std::exp(h.m - top);
        h.l *= scale;
        float* ag = acc.data() + g * DV;
        for (int64_t d = 0; d < DV; ++d) ag[d] *= scale;
        h.m = top;
      }
      page_weights(sg, ab, blocks, h, wg);
    }
    int64_t nv = 0;  // the rows some head attends, so that their reads can be issued ahead
    for (int64_t blk = 0; blk < blocks; ++blk)
      for (uint32_t bits = need_bits[blk]; bits; bits &= bits - 1) value_rows[nv++] = 16 * blk + __builtin_ctz(bits);
    n_values += nv;
    accumulate_values(nv);
    if (a.attended) record_attended();
  }

  // The debug attended set: every (candidate, head) whose attend bit the softmax above used.
  void record_attended() const {
    const int64_t G = a.groups, blocks = (n_cand + 15) / 16;
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* ab = attend_bits.data() + g * (cap / 16);
      for (int64_t blk = 0; blk < blocks; ++blk)
        for (uint32_t bits = ab[blk]; bits; bits &= bits - 1)
          a.attended[cand_pos[16 * blk + __builtin_ctz(bits)] * a.h_q + k * G + g] = 1;
    }
  }

  // acc[g] += weight[g][c]·V row of candidate c, over the nv candidates in value_rows (a head's
  // zero weight adds nothing, not even 0·inf). With AVX-512 the accumulators of up to 4 heads ×
  // 64 channels stay in 16 registers over all rows, instead of a load and store per row and head.
  void accumulate_values(int64_t nv) {
    const int64_t G = a.groups, DV = a.dim_v, P16 = cap;
#if defined(__AVX512F__)
    if (DV % 64 == 0) {
      const auto row = [&](int64_t i) { return vc + (cand_slot[value_rows[i]] * a.h_kv + k) * DV; };
      const auto wt = [&](int64_t g, int64_t i) { return weight[g * P16 + value_rows[i]]; };
      accumulate_rows<KV>(row, wt, nv, G, DV, acc.data(), true, kValueAhead);
      return;
    }
#elif defined(LOUVER_AVX2)
    if (DV % 32 == 0) {
      const auto row = [&](int64_t i) { return vc + (cand_slot[value_rows[i]] * a.h_kv + k) * DV; };
      const auto wt = [&](int64_t g, int64_t i) { return weight[g * P16 + value_rows[i]]; };
      accumulate_rows<KV>(row, wt, nv, G, DV, acc.data(), true, kValueAhead);
      return;
    }
#endif
    for (int64_t i = 0; i < nv; ++i) {
      if (i + kValueAhead < nv) prefetch_row(vc + (cand_slot[value_rows[i + kValueAhead]] * a.h_kv + k) * DV, DV);
      const int64_t c = value_rows[i];
      load_f32(vc + (cand_slot[c] * a.h_kv + k) * DV, DV, buf.data());
      for (int64_t g = 0; g < G; ++g) {
        const float e = weight[g * P16 + c];
        if (e != 0.f) axpy(acc.data() + g * DV, e, buf.data(), DV);
      }
    }
  }

  // Number of one head's attended candidates and the largest σ·s among them in *top (NaN scores
  // do not move the maximum).
  int64_t attended_top(const float* sg, const uint16_t* ab, int64_t blocks, float* top) const {
    int64_t count = 0;
#if defined(__AVX512F__)
    if (vector_scores) {
      __m512 m = _mm512_set1_ps(-INFINITY);
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const __m512 x = _mm512_mul_ps(_mm512_set1_ps(a.sigma), _mm512_loadu_ps(sg + 16 * blk));
        const __mmask16 on = ab[blk] & _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
        m = _mm512_mask_max_ps(m, on, m, x);
        count += __builtin_popcount(ab[blk]);
      }
      *top = _mm512_reduce_max_ps(m);
      return count;
    }
#elif defined(LOUVER_AVX2)
    if (vector_scores) {
      __m256 m = _mm256_set1_ps(-INFINITY);
      for (int64_t blk = 0; blk < blocks; ++blk)
        for (int h = 0; h < 2; ++h) {
          const __m256 x = _mm256_mul_ps(_mm256_set1_ps(a.sigma), _mm256_loadu_ps(sg + 16 * blk + 8 * h));
          const __m256 on = _mm256_and_ps(lane_mask8(ab[blk] >> (8 * h)), _mm256_cmp_ps(x, x, _CMP_ORD_Q));
          m = _mm256_max_ps(m, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, on));
        }
      for (int64_t blk = 0; blk < blocks; ++blk) count += __builtin_popcount(ab[blk]);
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, m);
      *top = *std::max_element(lanes, lanes + 8);
      return count;
    }
#endif
    for (int64_t c = 0; c < n_cand; ++c)
      if (ab[c / 16] >> (c % 16) & 1) {
        ++count;
        *top = std::max(*top, a.sigma * sg[c]);
      }
    (void)blocks;
    return count;
  }

  // Softmax weights e^{σ·s − m} of one head's candidates (0 where not attended) into wg; adds
  // them to h.l.
  void page_weights(const float* sg, const uint16_t* ab, int64_t blocks, HeadState& h, float* wg) const {
#if defined(__AVX512F__)
    if (vector_scores) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(a.sigma), _mm512_loadu_ps(sg + 16 * blk)),
                                       _mm512_set1_ps(h.m));
        const __m512 e = _mm512_maskz_mov_ps(ab[blk], exp_ps16(x));
        _mm512_storeu_ps(wg + 16 * blk, e);
        sum = _mm512_add_ps(sum, e);
      }
      h.l += _mm512_reduce_add_ps(sum);
      return;
    }
#elif defined(LOUVER_AVX2)
    if (vector_scores) {
      __m256 sum = _mm256_setzero_ps();
      for (int64_t blk = 0; blk < blocks; ++blk)
        for (int half = 0; half < 2; ++half) {
          const __m256 x = _mm256_sub_ps(
              _mm256_mul_ps(_mm256_set1_ps(a.sigma), _mm256_loadu_ps(sg + 16 * blk + 8 * half)), _mm256_set1_ps(h.m));
          const __m256 e = _mm256_and_ps(lane_mask8(ab[blk] >> (8 * half)), exp_ps8(x));
          _mm256_storeu_ps(wg + 16 * blk + 8 * half, e);
          sum = _mm256_add_ps(sum, e);
        }
      h.l += hsum8_ps(sum);
      return;
    }
#endif
    for (int64_t c = 0; c < blocks * 16; ++c) {
      const bool on = c < n_cand && (ab[c / 16] >> (c % 16) & 1);
      wg[c] = on ? std::exp(a.sigma * sg[c] - h.m) : 0.f;
      h.l += wg[c];
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

// One chunk of pages for all KV heads. A page's codes for all heads are one contiguous block
// (P·H_kv·bytes, in either layout); the scan walks it in 16-token blocks with every open head per
// block, so the block streams from memory once and in order, while the same block of the next
// page is prefetched.
template <typename KV>
void run_chunk(std::vector<ChunkRunner<KV>>& runners, const AttendArgs& a, int64_t c) {
  const int64_t P = a.page_size, page_block = P * a.h_kv * a.bytes, block16 = 16 * a.h_kv * a.bytes;
  const bool blocks = runners[0].block_scan();
  for (int64_t i = a.chunk_begin[c]; i < a.chunk_end[c]; ++i) {
    const uint8_t* next = i + 1 < a.chunk_end[c] ? a.codes.data + a.page_ids[i + 1] * page_block : nullptr;
    if (i + 2 < a.chunk_end[c]) runners[0].prefetch_codebooks(i + 2);
    bool any = false;
    for (auto& r : runners) any |= r.open_page(i);
    if (!any) continue;
    const int64_t first = a.page_ids[i] * P;
    int64_t p = 0;
    if (blocks) {
      for (; p + 16 <= P; p += 16) {
        if (next) prefetch_bytes_l2(next + p / 16 * block16, block16);
        for (auto& r : runners)
          if (r.open) r.scan_block16(first, p);
      }
    } else if (next) {
      prefetch_bytes(next, page_block);
    }
    for (auto& r : runners)
      if (r.open) {
        r.scan_tokens(first, p);
        r.end_page();
      }
  }
  for (auto& r : runners) r.flush();
}

// Arguments of the attend pass from its tensors (outputs as in AttendArgs).
inline AttendArgs attend_args(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& codes, const torch::Tensor& page_ids, const torch::Tensor& chunk_req,
                              const torch::Tensor& chunk_begin, const torch::Tensor& chunk_end, const torch::Tensor& t,
                              const torch::Tensor& t_gate, const torch::Tensor& ref, double sigma, int64_t bits,
                              int64_t page_size, torch::Tensor& m_out, torch::Tensor& l_out, torch::Tensor& o_out,
                              torch::Tensor& counts, torch::Tensor& mass) {
  const Codes view = codes_view(codes);
  TORCH_CHECK(!view.block16 || page_size % 16 == 0, "block16 codes need pages of a multiple of 16 slots");
  return AttendArgs{q.data_ptr<float>(), view, page_ids.data_ptr<int64_t>(),
                    chunk_req.data_ptr<int64_t>(), chunk_begin.data_ptr<int64_t>(), chunk_end.data_ptr<int64_t>(),
                    t.data_ptr<float>(), t_gate.data_ptr<float>(), ref.data_ptr<float>(), static_cast<float>(sigma),
                    q.size(1), k_cache.size(1), q.size(1) / k_cache.size(1), q.size(2), v_cache.size(2),
                    view.bytes, page_size, bits, chunk_req.size(0), m_out.data_ptr<float>(),
                    l_out.data_ptr<float>(), o_out.data_ptr<float>(), counts.data_ptr<int64_t>(),
                    mass.data_ptr<double>()};
}

// One thread's share of the attend pass: chunks taken from the shared counter ``next`` until none
// is left. Tasks are not split statically: their costs differ (the candidate count varies along
// the context), and a static split left one core idle for a large part of a batch-1 step. Returns
// the first number it drew past the chunks (the queue may hold more tasks after them).
template <typename KV>
int64_t attend_worker(const AttendArgs& a, const KV* kc, const KV* vc, const KV* lo, const KV* sc, const KV* rad,
                      std::atomic<int64_t>& next) {
  const int64_t G = a.groups;
  std::vector<ChunkRunner<KV>> runners;
  int64_t c = next++;
  for (; c < a.n_chunks; c = next++) {
    if (a.only_req && !a.only_req[a.chunk_req[c]]) continue;
    if (runners.empty()) {
      runners.reserve(a.h_kv);
      for (int64_t k = 0; k < a.h_kv; ++k) runners.emplace_back(a, kc, vc, lo, sc, rad, c, k);
    } else {
      for (auto& r : runners) r.reset(c);
    }
    for (int64_t k = 0; k < a.h_kv; ++k)
      runners[k].skip = a.only_kv && !a.only_kv[a.chunk_req[c] * a.h_kv + k];
    if (!a.band) {
      run_chunk(runners, a, c);
    } else if (a.band_req[a.chunk_req[c]]) {  // the other requests' chunks: an empty state
      for (auto& r : runners) r.run_reserve(c);
    }
    if (a.t_reserve)
      for (int64_t k = 0; k < a.h_kv; ++k) a.reserve_count[c * a.h_kv + k] = runners[k].res_n;
    for (int64_t k = 0; k < a.h_kv; ++k) {
      if (runners[k].skip) continue;  // the earlier pass's state stands
      const int64_t task = c * a.h_kv + k, base = task * G;
      runners[k].write(a.m_out + base, a.l_out + base, a.o_out + base * a.dim_v, a.counts + task * (2 * G + 3),
                       a.mass + base * 3);
    }
  }
  return c;
}

}  // namespace louver_cpu
