// The random draw of the CPU sampler without the torch path's temporaries: the exponential race of
// engine/sampling/sampler.py, argmax(logit - log q) with q ~ Exp(1) from the counter-based hash of
// (seed, step, token).
//
// Why. The torch path builds q as some thirty whole-vocabulary int64 and float64 tensors (the hash in
// 64-bit arithmetic, then the log) before the scores: at 32 rows of a 49,152-token vocabulary that is
// about 35 ms a step on one core, as long as SmolLM2's whole decode step in bf16. Here the hash runs in
// uint32 lanes, as it is defined, a cache-sized chunk of a row at a time, and only the scores are kept.
//
// Numbers: the torch path's, value for value. h = fmix32(fmix32(token * 0x9E3779B1 ^ k1) ^ k2),
// u = (h + 0.5) / 2^32 in float64 (exact), q = float32(-log(u)), score = logit - log(q) in float32,
// then torch.argmax's choice (the first maximum; NaN counts as the maximum). The two logs are the
// functions torch's own log runs on contiguous tensors: MKL's vector log (vmdLn / vmsLn, high
// accuracy, torch's mode) from the libtorch this library links. A libtorch without MKL runs SLEEF's
// logs instead, which differ from MKL's in the last bit of about 1% of values: there the op reports
// itself unsupported and the sampler keeps the torch path. tests/kernels/test_cpu_race.py compares
// every score.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <cstring>
#include <vector>

#include "argmax.h"
#include "vec.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define INFLIGHT_RACE_X86 1

extern "C" {
// MKL's vector logs, as libtorch exports them when built with MKL (weak: absent otherwise). n is
// MKL_INT, 32 or 64 bits by the build; passed in a 64-bit register either way, and rows are < 2^31.
void vmdLn(int64_t n, const double* a, double* r, uint64_t mode) __attribute__((weak));
void vmsLn(int64_t n, const float* a, float* r, uint64_t mode) __attribute__((weak));
}
#endif

namespace {

#ifdef INFLIGHT_RACE_X86

#define TARGET_AVX512 __attribute__((target("avx512f,avx512dq")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))

constexpr uint32_t kSpread = 0x9E3779B1u;
constexpr double kInv32 = 1.0 / 4294967296.0;
// torch's mode for its MKL calls (ATen/cpu/vml.h): VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
constexpr uint64_t kVmlMode = 0x00000002u | 0x00140000u | 0x00000100u;
// Tokens per chunk: the chunk's float64 u, float32 q and scores stay in L2 between the passes.
constexpr int64_t kChunk = 4096;

// MurmurHash3's finaliser, sixteen lanes (uint32 multiplies wrap, as the hash is defined).
TARGET_AVX512 inline __m512i fmix32_16(__m512i h) {
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

// u[i] = (h(first + i) + 0.5) / 2^32 for i < m, m a multiple of 16 (the chunk's buffers are padded).
TARGET_AVX512 void uniform_avx512(int64_t first, int64_t m, uint32_t k1, uint32_t k2, double* u) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i vk1 = _mm512_set1_epi32(static_cast<int>(k1));
  const __m512i vk2 = _mm512_set1_epi32(static_cast<int>(k2));
  const __m512d half = _mm512_set1_pd(0.5), scale = _mm512_set1_pd(kInv32);
  for (int64_t i = 0; i < m; i += 16) {
    const __m512i token = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first + i)), lane);
    const __m512i mixed = _mm512_mullo_epi32(token, _mm512_set1_epi32(static_cast<int>(kSpread)));
    const __m512i h = fmix32_16(_mm512_xor_si512(fmix32_16(_mm512_xor_si512(mixed, vk1)), vk2));
    const __m512d lo = _mm512_cvtepu32_pd(_mm512_castsi512_si256(h));
    const __m512d hi = _mm512_cvtepu32_pd(_mm512_extracti64x4_epi64(h, 1));
    _mm512_storeu_pd(u + i, _mm512_mul_pd(_mm512_add_pd(lo, half), scale));
    _mm512_storeu_pd(u + i + 8, _mm512_mul_pd(_mm512_add_pd(hi, half), scale));
  }
}

TARGET_AVX2 inline __m256i fmix32_8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// Four uint32 hashes to float64 exactly (as int32 after flipping the top bit, plus 2^31), then u.
TARGET_AVX2 inline __m256d uniform4(__m128i h) {
  const __m128i flipped = _mm_xor_si128(h, _mm_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256d value = _mm256_add_pd(_mm256_cvtepi32_pd(flipped), _mm256_set1_pd(2147483648.0));
  return _mm256_mul_pd(_mm256_add_pd(value, _mm256_set1_pd(0.5)), _mm256_set1_pd(kInv32));
}

TARGET_AVX2 void uniform_avx2(int64_t first, int64_t m, uint32_t k1, uint32_t k2, double* u) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i vk1 = _mm256_set1_epi32(static_cast<int>(k1));
  const __m256i vk2 = _mm256_set1_epi32(static_cast<int>(k2));
  for (int64_t i = 0; i < m; i += 8) {
    const __m256i token = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first + i)), lane);
    const __m256i mixed = _mm256_mullo_epi32(token, _mm256_set1_epi32(static_cast<int>(kSpread)));
    const __m256i h = fmix32_8(_mm256_xor_si256(fmix32_8(_mm256_xor_si256(mixed, vk1)), vk2));
    _mm256_storeu_pd(u + i, uniform4(_mm256_castsi256_si128(h)));
    _mm256_storeu_pd(u + i + 4, uniform4(_mm256_extracti128_si256(h, 1)));
  }
}

const bool kHasAvx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
const bool kHasAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
const bool kHasLogs = vmdLn != nullptr && vmsLn != nullptr;

// One row's scores into s[0, n): logits x, keys (k1, k2); u and q are scratch of kChunk values.
void row_scores(const float* x, int64_t n, uint32_t k1, uint32_t k2, bool avx512, double* u, float* q, float* s) {
  for (int64_t first = 0; first < n; first += kChunk) {
    const int64_t m = std::min(kChunk, n - first);
    const int64_t padded = (m + 15) / 16 * 16;
    if (avx512) {
      uniform_avx512(first, padded, k1, k2, u);
    } else {
      uniform_avx2(first, padded, k1, k2, u);
    }
    vmdLn(padded, u, u, kVmlMode);  // the padding lanes hold values in (0, 1) too
    for (int64_t i = 0; i < padded; ++i) q[i] = static_cast<float>(-u[i]);  // rounds to nearest even
    vmsLn(padded, q, q, kVmlMode);
    for (int64_t i = 0; i < m; ++i) s[first + i] = x[first + i] - q[i];
  }
}

#endif  // INFLIGHT_RACE_X86

bool race_supported() {
#ifdef INFLIGHT_RACE_X86
  return (kHasAvx512 || kHasAvx2) && kHasLogs;
#else
  return false;
#endif
}

// Which vector code hashes: 0 the best this CPU has, 2 AVX2 (tests run both on an AVX-512 host).
constexpr int64_t kIsaBest = 0, kIsaAvx2 = 2;

// tokens[r] = argmax over the row of (logits[r] - log q[r]), q keyed by keys[r] = (k1, k2). ``scores``,
// when given ([rows, vocab] float32), receives the scores themselves (tests compare them bit for bit).
at::Tensor exponential_race(const at::Tensor& logits, const at::Tensor& keys, const c10::optional<at::Tensor>& scores,
                            int64_t isa) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat, "logits must be float32 on the CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be [rows, vocab] with contiguous rows");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "a vocabulary of 2^31 tokens or more is not supported");
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.dim() == 2 && keys.size(1) == 2 &&
                  keys.size(0) == logits.size(0),
              "keys must be int64 [rows, 2]");
  TORCH_CHECK(isa == kIsaBest || isa == kIsaAvx2, "isa must be 0 (best) or 2 (AVX2)");
  TORCH_CHECK(race_supported(), "this CPU has neither AVX-512 nor AVX2, or libtorch has no MKL");
  if (scores.has_value()) {
    TORCH_CHECK(scores->scalar_type() == at::kFloat && scores->is_contiguous() && scores->sizes() == logits.sizes(),
                "scores must be a contiguous float32 tensor of logits' shape");
  }
  const at::Tensor k = keys.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
#ifdef INFLIGHT_RACE_X86
  const bool avx512 = kHasAvx512 && isa == kIsaBest;
  const float* x = logits.data_ptr<float>();
  const int64_t* kp = k.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  float* kept = scores.has_value() ? scores->data_ptr<float>() : nullptr;
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> u(kChunk);
    std::vector<float> q(kChunk);
    std::vector<float> scratch(kept == nullptr ? static_cast<size_t>(n) : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const auto k1 = static_cast<uint32_t>(kp[2 * r]), k2 = static_cast<uint32_t>(kp[2 * r + 1]);
      float* s = kept == nullptr ? scratch.data() : kept + r * n;
      row_scores(x + r * stride, n, k1, k2, avx512, u.data(), q.data(), s);
      o[r] = inflight_cpu::first_argmax(s, n);
    }
  });
#endif
  return out;
}

// ---- top-p ------------------------------------------------------------------------------------
// The nucleus without sorting the vocabulary (torch's sort of [32, 49152] float32 took 144 ms on one
// core). A token stays when the probability of the tokens strictly more likely than it is below
// top_p; as a threshold on the logit, the kept tokens are {x >= T}, T the smallest kept logit, so a
// tie at T stays whole (as the GPU kernel, engine/kernels/sampling.py, keeps it; torch's sort keeps an
// order-dependent part of it).
//
// How: each token's weight e = exp(x - max) into a histogram of kBins bins of the logit over the
// kSpan nats below the maximum (a monotone binning: a larger logit never lands in a lower bin, ties
// share one); the bins' running mass from the top finds the one bin where the mass before reaches
// top_p * sum(e); only that bin's tokens are sorted. Every token of an earlier bin stays, every one
// of a later bin goes. Below kSpan nats a token weighs under e^-40 of the top one: the whole tail of
// a vocabulary weighs less than the rounding of top_p itself, so those tokens go.
constexpr int kBins = 2048;
constexpr float kSpan = 40.f;

// e[i] = exp(x[i] - top); returns their sum.
INFLIGHT_CLONES double weights(const float* x, int64_t n, float top, float* e) {
  using inflight_cpu::kLanes;
  const int64_t nv = n / kLanes * kLanes;
  double z = 0.0;
  for (int64_t i = 0; i < nv; i += kLanes) {
    const inflight_cpu::vfloat v = inflight_cpu::vexp(inflight_cpu::load16(x + i) - top);
    std::memcpy(e + i, &v, sizeof(v));
    float part = 0.f;
    for (int j = 0; j < kLanes; ++j) part += v[j];
    z += part;
  }
  for (int64_t i = nv; i < n; ++i) {
    e[i] = std::exp(x[i] - top);
    z += e[i];
  }
  return z;
}

struct TopPScratch {
  std::vector<float> e;
  std::vector<double> mass;
  std::vector<std::pair<float, float>> edge;  // (logit, weight) of the crossing bin's tokens
};

void top_p_row(float* x, int64_t n, float top_p, TopPScratch& t) {
  const float top = *std::max_element(x, x + n);
  if (!(top_p < 1.f) || !std::isfinite(top)) return;  // everything stays; or a row of -inf / NaN
  t.e.resize(static_cast<size_t>(n));
  const double bound = static_cast<double>(top_p) * weights(x, n, top, t.e.data());
  const float scale = static_cast<float>(kBins) / kSpan;
  auto bin = [&](float v) {  // 0 for the top; kBins for everything past the span (and -inf, NaN)
    const float d = (top - v) * scale;
    return d < static_cast<float>(kBins) ? static_cast<int>(d) : kBins;
  };
  t.mass.assign(kBins + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) t.mass[bin(x[i])] += t.e[i];
  double before = 0.0;
  int crossing = 0;
  while (crossing < kBins && before + t.mass[crossing] < bound) before += t.mass[crossing++];
  float threshold = -std::numeric_limits<float>::infinity();  // no crossing (rounding): all stay
  if (crossing < kBins) {
    t.edge.clear();
    for (int64_t i = 0; i < n; ++i) {
      if (bin(x[i]) == crossing) t.edge.emplace_back(x[i], t.e[i]);
    }
    std::sort(t.edge.begin(), t.edge.end(), [](const auto& l, const auto& r) { return l.first > r.first; });
    for (const auto& [v, w] : t.edge) {
      if (before >= bound) break;
      threshold = v;
      before += w;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] < threshold) x[i] = -std::numeric_limits<float>::infinity();
  }
}

// In place: each row of logits [rows, vocab] keeps its nucleus of top_p[row] (>= 1: the whole row).
void top_p_mask_(at::Tensor logits, const at::Tensor& top_p) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat, "logits must be float32 on the CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [rows, vocab] with contiguous rows");
  TORCH_CHECK(top_p.scalar_type() == at::kFloat && top_p.dim() == 1 && top_p.size(0) == logits.size(0),
              "top_p must be float32 [rows]");
  const at::Tensor p = top_p.contiguous();
  const float* pp = p.data_ptr<float>();
  float* x = logits.data_ptr<float>();
  const int64_t n = logits.size(1), stride = logits.stride(0);
  at::parallel_for(0, logits.size(0), 1, [&](int64_t r0, int64_t r1) {
    TopPScratch scratch;
    for (int64_t r = r0; r < r1; ++r) top_p_row(x + r * stride, n, pp[r], scratch);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight_cpu, m) {
  m.def("exponential_race(Tensor logits, Tensor keys, Tensor(a!)? scores=None, int isa=0) -> Tensor");
  // No tensor to dispatch on: one kernel for every backend.
  m.def("exponential_race_supported() -> bool", &race_supported);
  m.def("top_p_mask_(Tensor(a!) logits, Tensor top_p) -> ()");
}

TORCH_LIBRARY_IMPL(inflight_cpu, CPU, m) {
  m.impl("exponential_race", &exponential_race);
  m.impl("top_p_mask_", &top_p_mask_);
}
