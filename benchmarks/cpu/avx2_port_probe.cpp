// Which AVX2 operations share a port on this machine, and what the 8-bit scan's widening costs.
//
//   g++ -O3 -mavx2 -mfma -o /tmp/avx2_port_probe benchmarks/cpu/avx2_port_probe.cpp && /tmp/avx2_port_probe
//
// Prints ns per operation for 8 independent chains of one instruction (throughput, not latency),
// and for mixes of two; then ns per 16-token block of three heads for the 8-bit block scan's dot
// (kernels/cpu/common.h, dot_block16_avx2_8bit_rows) with three ways of widening its int16 pair
// sums: vpmaddwd per dword (the per-weight rule, |w| <= 63), vpmaddwd per two dwords (the lane
// groups' rule), and shifts and adds per dword (no multiply). The three dots are checked equal on
// weights within both rules. Timings from one process: compare ratios, not absolute times.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr long kIters = 50000000;

// 8 independent chains: chain i applies A (i < split) or B (i >= split) to itself.
template <typename A, typename B>
__attribute__((noinline)) __m256i chains(long n, int split, A a, B b) {
  __m256i x[8];
  for (int i = 0; i < 8; ++i) x[i] = _mm256_set1_epi32(i + 1);
  for (long it = 0; it < n; ++it) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) x[i] = i < split ? a(x[i]) : b(x[i]);
  }
  __m256i r = x[0];
  for (int i = 1; i < 8; ++i) r = _mm256_xor_si256(r, x[i]);
  return r;
}

template <typename A, typename B>
void probe(const char* name, int split, A a, B b) {
  const auto t0 = Clock::now();
  const __m256i r = chains(kIters, split, a, b);
  const double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / kIters;
  std::printf("%-34s %6.3f ns per 8 operations (%d)\n", name, ns, _mm256_extract_epi32(r, 0) & 1);
}

// The block scan's dot of one 16-token block (cols [16 dwords, 16 tokens, 4]) with 3 heads' weight
// quads broadcast (wb [3, 16, 8] int32): out[g·16 + t]. Widen: 0 vpmaddwd per dword, 1 per two
// dwords, 2 shifts and adds per dword.
template <int Widen>
__attribute__((noinline)) void dot3(const uint8_t* cols, const int32_t* wb, int32_t* out) {
  const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi32(0x8000);
  const auto* quads = reinterpret_cast<const __m256i*>(wb);
  __m256i acc[2][3], high[2][3];
  for (int h = 0; h < 2; ++h)
    for (int g = 0; g < 3; ++g) acc[h][g] = high[h][g] = _mm256_setzero_si256();
  constexpr int kStep = Widen == 1 ? 2 : 1;
  for (int j = 0; j < 16; j += kStep) {
    __m256i c[2][2];
    for (int i = 0; i < kStep; ++i)
      for (int h = 0; h < 2; ++h) c[i][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cols + (j + i) * 64 + 32 * h));
    for (int g = 0; g < 3; ++g)
      for (int h = 0; h < 2; ++h) {
        __m256i x = _mm256_maddubs_epi16(c[0][h], _mm256_loadu_si256(quads + g * 16 + j));
        if (Widen == 1) x = _mm256_add_epi16(x, _mm256_maddubs_epi16(c[1][h], _mm256_loadu_si256(quads + g * 16 + j + 1)));
        if (Widen == 2) {  // y = x with its low half biased to unsigned; Σ(hi + lo) recovered at the end
          const __m256i y = _mm256_xor_si256(x, bias);
          acc[h][g] = _mm256_add_epi32(acc[h][g], y);
          high[h][g] = _mm256_add_epi32(high[h][g], _mm256_srai_epi32(y, 16));
        } else {
          acc[h][g] = _mm256_add_epi32(acc[h][g], _mm256_madd_epi16(x, ones));
        }
      }
  }
  for (int h = 0; h < 2; ++h)
    for (int g = 0; g < 3; ++g) {
      __m256i r = acc[h][g];
      if (Widen == 2) {
        const __m256i low = _mm256_sub_epi32(_mm256_sub_epi32(r, _mm256_slli_epi32(high[h][g], 16)),
                                             _mm256_set1_epi32(16 * 32768));
        r = _mm256_add_epi32(high[h][g], low);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * 16 + 8 * h), r);
    }
}

template <int Widen>
double time_dot(const std::vector<uint8_t>& codes, const int32_t* wb, int64_t blocks, int reps) {
  alignas(32) int32_t out[48];
  int64_t sink = 0;
  const auto t0 = Clock::now();
  for (int r = 0; r < reps; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      dot3<Widen>(codes.data() + b * 1024, wb, out);
      sink += out[5];
    }
  const double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / (double(reps) * blocks);
  return sink == 42 ? -ns : ns;
}

}  // namespace

int main() {
  const __m256i w = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  const auto maddubs = [&](__m256i x) { return _mm256_maddubs_epi16(x, w); };
  const auto madd = [&](__m256i x) { return _mm256_madd_epi16(x, ones); };
  const auto add = [&](__m256i x) { return _mm256_add_epi32(x, w); };
  const auto shuffle = [&](__m256i x) { return _mm256_shuffle_epi8(x, w); };
  const auto shift = [&](__m256i x) { return _mm256_srai_epi32(x, 1); };
  probe("vpmaddubsw x8", 8, maddubs, maddubs);
  probe("vpmaddwd x8", 8, madd, madd);
  probe("vpaddd x8", 8, add, add);
  probe("vpshufb x8", 8, shuffle, shuffle);
  probe("vpmaddubsw x4 + vpmaddwd x4", 4, maddubs, madd);
  probe("vpmaddubsw x4 + vpshufb x4", 4, maddubs, shuffle);
  probe("vpmaddubsw x4 + vpsrad x4", 4, maddubs, shift);

  const int64_t blocks = 64;  // in L1
  std::vector<uint8_t> codes(blocks * 1024);
  std::srand(1);
  for (auto& c : codes) c = static_cast<uint8_t>(std::rand());
  alignas(32) int32_t wb[3 * 16 * 8];
  for (int q = 0; q < 3 * 16; ++q) {  // |w| <= 31: within both rules (Σ|w| <= 124 per lane group)
    int8_t quad[4];
    for (auto& x : quad) x = static_cast<int8_t>(std::rand() % 63 - 31);
    int32_t v;
    std::memcpy(&v, quad, 4);
    for (int t = 0; t < 8; ++t) wb[q * 8 + t] = v;
  }
  alignas(32) int32_t a[48], b[48], c[48];
  for (int64_t i = 0; i < blocks; ++i) {
    dot3<0>(codes.data() + i * 1024, wb, a);
    dot3<1>(codes.data() + i * 1024, wb, b);
    dot3<2>(codes.data() + i * 1024, wb, c);
    if (std::memcmp(a, b, sizeof a) || std::memcmp(a, c, sizeof a)) {
      std::printf("the three dots differ at block %ld\n", static_cast<long>(i));
      return 1;
    }
  }
  const int reps = 20000;
  std::printf("8-bit block dot, 3 heads, per 16-token block: vpmaddwd per dword %.1f ns, per two dwords %.1f ns, "
              "shifts per dword %.1f ns\n",
              time_dot<0>(codes, wb, blocks, reps), time_dot<1>(codes, wb, blocks, reps), time_dot<2>(codes, wb, blocks, reps));
  return 0;
}
