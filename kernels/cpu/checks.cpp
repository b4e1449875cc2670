// Exhaustive checks of numeric building blocks whose error bounds enter a certificate (the tests
// call them; nothing else does).

#include <cstring>
#include <mutex>

#include "common.h"
#include "ops.h"

using namespace louver_cpu;

namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// The build's vector exp of xs[16] into ys[16]: exp_ps16 with AVX-512, exp_ps8 with AVX2 (Up: the
// dropped masses' exp from above, exp_up16 / exp_up8).
template <bool Up>
void vector_exp16(const float* xs, float* ys) {
#if defined(__AVX512F__)
  const __m512 x = _mm512_loadu_ps(xs);
  _mm512_storeu_ps(ys, Up ? exp_up16(x) : exp_ps16(x));
#elif defined(LOUVER_AVX2)
  for (int h = 0; h < 16; h += 8) {
    const __m256 x = _mm256_loadu_ps(xs + h);
    _mm256_storeu_ps(ys + h, Up ? exp_up8(x) : exp_ps8(x));
  }
#else
  (void)xs;
  (void)ys;
#endif
}

// Smallest and largest exp(x) / e^x of the build's vector exp (Up: exp_up) over the fp32 bit
// patterns [first, last] (one sign).
template <bool Up>
std::pair<double, double> ratio_patterns(uint32_t first, uint32_t last) {
  std::mutex lock;
  double low = INFINITY, high = 0.0;
  const int64_t n = int64_t(last) - int64_t(first) + 1;
  at::parallel_for(0, (n + 15) / 16, 1 << 16, [&](int64_t begin, int64_t end) {
    double lo = INFINITY, hi = 0.0;
    alignas(64) float xs[16], ys[16];
    for (int64_t blk = begin; blk < end; ++blk) {
      for (int i = 0; i < 16; ++i) xs[i] = from_bits(uint32_t(first + std::min<int64_t>(blk * 16 + i, n - 1)));
      vector_exp16<Up>(xs, ys);
      for (int i = 0; i < 16; ++i) {
        const double r = double(ys[i]) / std::exp(double(xs[i]));
        lo = std::min(lo, r);
        hi = std::max(hi, r);
      }
    }
    std::lock_guard<std::mutex> guard(lock);
    low = std::min(low, lo);
    high = std::max(high, hi);
  });
  return {low, high};
}

// ratio_patterns over every fp32 x in [lo, hi] (both signs); ``name`` for the errors.
template <bool Up>
std::pair<double, double> ratio_range(double lo, double hi, const char* name) {
  TORCH_CHECK(kHaveAvx512 || kHaveAvx2, name, ": built without AVX-512 or AVX2");
  TORCH_CHECK(lo <= hi, name, ": need lo <= hi");
  const float a = static_cast<float>(lo), b = static_cast<float>(hi);
  double low = INFINITY, high = 0.0;
  auto widen = [&](std::pair<double, double> r) {
    low = std::min(low, r.first);
    high = std::max(high, r.second);
  };
  if (a < 0.f) widen(ratio_patterns<Up>(to_bits(std::min(b, -0.f)), to_bits(a)));  // −0 .. a
  if (b >= 0.f) widen(ratio_patterns<Up>(to_bits(std::max(a, 0.f)), to_bits(b)));
  return {low, high};
}

}  // namespace

// (smallest, largest) exp_up(x) / e^x over every fp32 x in [lo, hi]: the dropped masses' exp from
// above (exp_up16, or exp_up8 in AVX2 builds). Needs AVX-512 or AVX2.
std::tuple<double, double> exp_up_ratio(double lo, double hi) { return ratio_range<true>(lo, hi, "exp_up_ratio"); }

// (largest relative error of the vector exp (exp_ps16, or exp_ps8 in AVX2 builds: the same
// operations) over every fp32 x in [lo, hi], the bound the kernels assume: kExpPs16RelError).
// Needs AVX-512 or AVX2 (the builds that use them).
std::tuple<double, double> exp_ps16_error(double lo, double hi) {
  const auto [low, high] = ratio_range<false>(lo, hi, "exp_ps16_error");
  return {std::max(high - 1.0, 1.0 - low), kExpPs16RelError};
}

// This build's rule for the int8 weights of its token bounds for codes of ``bits`` bits
// (int8_weight_rule): the largest |weight| and the lane groups' limit (0: none), the torch
// specification's Int8Rule.
std::tuple<int64_t, double> weight_rule_of_build(int64_t bits) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "int8_weight_rule: bits must be 2, 4 or 8");
  return {kInt8WeightLimit, int8_group_limit(bits)};
}

namespace {

bool same_or_both_nan(float x, float y) { return to_bits(x) == to_bits(y) || (std::isnan(x) && std::isnan(y)); }

template <typename M>
int64_t page_setup_rows(const float* q, const M* lo, const M* sc, const M* rad, int64_t rows, int64_t G, int64_t D,
                        int64_t bits) {
  std::vector<float> book(3 * D), w(G * D), off(G), pb(G), mag(G), step(G), off2(G), pb2(G), mag2(G), step2(G);
  std::vector<int8_t> wq(G * D), wq2(G * D);
  int64_t differ = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const M *l = lo + r * D, *s = sc + r * D, *a = rad + r * D;
    load_codebook(l, s, a, D, book.data());
    page_terms(q, book.data(), book.data() + D, book.data() + 2 * D, G, D, bits, w.data(), off.data(), pb.data(),
               mag.data());
    for (int64_t g = 0; g < G; ++g) off[g] += quantize_weights(w.data() + g * D, D, bits, wq.data() + g * D, &step[g]);
    page_setup(q, l, s, a, G, D, bits, off2.data(), pb2.data(), mag2.data(), wq2.data(), step2.data());
    bool same = true;
    for (int64_t g = 0; g < G; ++g) {
      same &= same_or_both_nan(off[g], off2[g]) && same_or_both_nan(pb[g], pb2[g]) && same_or_both_nan(mag[g], mag2[g]);
      // a NaN off makes every token bound NaN (kept), whatever the weights
      if (!std::isnan(off[g]))
        same &= to_bits(step[g]) == to_bits(step2[g]) && std::equal(wq.begin() + g * D, wq.begin() + (g + 1) * D,
                                                                    wq2.begin() + g * D);
    }
    differ += !same;
  }
  return differ;
}

}  // namespace

// The pages (rows of lo, scale, radius [rows, D]) on which page_setup's off, pb, mag, step and
// int8 weights for queries q [G, D] (fp32) differ from load_codebook, page_terms and
// quantize_weights' bit for bit (NaN: both NaN; the weights only where off is not NaN). −1 where
// this build does not use page_setup for D and ``bits``.
int64_t page_setup_mismatches(const torch::Tensor& q, const torch::Tensor& lo, const torch::Tensor& scale,
                              const torch::Tensor& radius, int64_t bits) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "page_setup_mismatches: q [G, D] fp32");
  const int64_t G = q.size(0), D = q.size(1);
  for (const auto* x : {&lo, &scale, &radius})
    TORCH_CHECK(x->dim() == 2 && x->size(1) == D && x->size(0) == lo.size(0) && x->is_contiguous() &&
                    x->scalar_type() == lo.scalar_type(),
                "page_setup_mismatches: lo, scale, radius [rows, D] contiguous, of one dtype");
  if (!page_setup_fits(D, bits)) return -1;
  int64_t differ = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lo.scalar_type(), "page_setup_mismatches", [&] {
    differ = page_setup_rows(q.data_ptr<float>(), lo.data_ptr<scalar_t>(), scale.data_ptr<scalar_t>(),
                             radius.data_ptr<scalar_t>(), lo.size(0), G, D, bits);
  });
  return differ;
}
