// The CPU engine's linear layers, out = x @ w.T (+ bias), on weights packed once into column panels,
// for AVX-512 (float32) and AVX512_BF16 (bf16) hosts without AMX.
//
// Why not oneDNN for these. A decode step multiplies a few to a few tens of rows by every weight, so
// its time is the weights' stream from memory: on a 2-core AMD EPYC (Zen 5) oneDNN's packed kernels
// read SmolLM2-135M's bf16 weights at 27 GB/s for one row and 14 GB/s for 16, where this plain walk
// over panels reads them at 35 and 21. At prefill sizes both are bound by the multiply units and run
// within a few percent of each other. On AMX hosts oneDNN's tile kernels stay (engine/models/
// cpu_gemm.py decides).
//
// Layout. Columns (output features) go in groups of 48, three 16-lane vectors; a group's block holds,
// for each k, its 48 weights side by side (float32), or for each pair of k, 48 pairs (bf16: what
// vdpbf16ps multiplies), so a group streams from memory front to back once per 8 rows of x. The
// last group may be 16 or 32 columns wide (out features must be a multiple of 16). The packed tensor
// is a carrier: its shape [n / 16, k (float32) or ceil(k / 2) (bf16), 16 or 32] gives n and k, its
// memory holds the groups one after another.
//
// Numbers. Each output is one float32 sum over k in order, plus the bias, rounded once to the output
// dtype (bf16: to nearest even). vdpbf16ps adds each pair's two products before accumulating and
// flushes denormals, as oneDNN's bf16 kernels on these CPUs do.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#define INFLIGHT_GEMM_X86 1
#define TARGET_F32 __attribute__((target("avx512f,fma")))
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))
#endif

namespace {

constexpr int64_t kGroup = 48;  // columns per group: three vectors
constexpr int64_t kRows = 8;    // rows per register block: 8 x 3 accumulators of the 32 registers
// A block of two or more rows asks for the weights this far ahead of the line it multiplies. One row
// keeps up with the stream on the hardware prefetcher alone; at 2-8 rows the multiplies between two
// lines leave the prefetcher behind, and the stream fell from 35-40 GB/s to 26-29 (8 rows) without
// this. The groups of one thread lie one after another, so the last lines of a group fetch the next.
// 8 KiB measured best of 0.5-16 KiB on a Zen 5 (bench.cpu_gemm_bench).
constexpr int kPrefetchRows = 2;
constexpr int kPrefetchBytes = 8192;

#ifdef INFLIGHT_GEMM_X86

__mmask16 lane_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// c[MR, NV * 16] = a[MR, k] @ (one group's block of NV vectors a k) + bias.
template <int MR, int NV>
TARGET_F32 void block_f32(const float* a, int64_t lda, const float* b, int64_t k, float* c, int64_t ldc,
                          const float* bias) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* bk = b + kk * NV * 16;
    if constexpr (MR >= kPrefetchRows)
      for (int j = 0; j < NV; ++j) _mm_prefetch(reinterpret_cast<const char*>(bk + j * 16) + kPrefetchBytes, _MM_HINT_T0);
    __m512 bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = _mm512_loadu_ps(bk + j * 16);
    for (int m = 0; m < MR; ++m) {
      const __m512 av = _mm512_set1_ps(a[m * lda + kk]);
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_fmadd_ps(av, bv[j], acc[m][j]);
    }
  }
  for (int j = 0; j < NV; ++j) {
    const __m512 bj = bias != nullptr ? _mm512_loadu_ps(bias + j * 16) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) _mm512_storeu_ps(c + m * ldc + j * 16, _mm512_add_ps(acc[m][j], bj));
  }
}

template <int MR, int NV>
TARGET_BF16 void block_bf16(const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t k, at::BFloat16* c,
                            int64_t ldc, const at::BFloat16* bias) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const auto* bk = reinterpret_cast<const uint16_t*>(b) + kk * NV * 32;
    if constexpr (MR >= kPrefetchRows)
      for (int j = 0; j < NV; ++j) _mm_prefetch(reinterpret_cast<const char*>(bk + j * 32) + kPrefetchBytes, _MM_HINT_T0);
    __m512bh bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(bk + j * 32);
    for (int m = 0; m < MR; ++m) {
      // Two bf16 of x, (k, k + 1), broadcast to every lane.
      int32_t pair;
      std::memcpy(&pair, a + m * lda + 2 * kk, 4);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], av, bv[j]);
    }
  }
  if (k & 1) {  // an odd k's last one pairs with zero (as its packed weights do)
    const auto* bk = reinterpret_cast<const uint16_t*>(b) + pairs * NV * 32;
    __m512bh bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(bk + j * 32);
    for (int m = 0; m < MR; ++m) {
      uint16_t last;
      std::memcpy(&last, a + m * lda + k - 1, 2);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(last));
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], av, bv[j]);
    }
  }
  for (int j = 0; j < NV; ++j) {
    __m512 bj = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + j * 16));
      bj = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    for (int m = 0; m < MR; ++m) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], bj));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + m * ldc + j * 16), (__m256i)out);
    }
  }
}

template <typename T>
using BlockFn = void (*)(const T*, int64_t, const T*, int64_t, T*, int64_t, const T*);

// kTable<T>[nv - 1][rows - 1]: the block for that many vectors and rows.
template <typename T, int NV, int... R>
constexpr std::array<BlockFn<T>, sizeof...(R)> row_blocks(std::integer_sequence<int, R...>) {
  if constexpr (std::is_same_v<T, float>) {
    return {block_f32<R + 1, NV>...};
  } else {
    return {block_bf16<R + 1, NV>...};
  }
}

template <typename T>
const std::array<std::array<BlockFn<T>, kRows>, 3> kTable = {
    row_blocks<T, 1>(std::make_integer_sequence<int, kRows>{}),
    row_blocks<T, 2>(std::make_integer_sequence<int, kRows>{}),
    row_blocks<T, 3>(std::make_integer_sequence<int, kRows>{})};

template <typename T>
void run(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const T* bias) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t depth = packed.size(1);  // k, or k's pairs
  const int64_t lanes = std::is_same_v<T, float> ? 1 : 2;
  const T* a = x.data_ptr<T>();
  const T* b = packed.data_ptr<T>();
  T* c = out.data_ptr<T>();
  const int64_t lda = x.stride(0), ldc = out.stride(0);
  const int64_t groups = (n + kGroup - 1) / kGroup;
  // Threads split the groups (each streams its own weights); rows stay with their group.
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t col = g * kGroup;
      const int64_t nv = std::min(kGroup, n - col) / 16;
      const T* block = b + col * depth * lanes;
      for (int64_t r = 0; r < m; r += kRows) {
        const int64_t rows = std::min(kRows, m - r);
        kTable<T>[nv - 1][rows - 1](a + r * lda, lda, block, k, c + r * ldc + col, ldc,
                                    bias != nullptr ? bias + col : nullptr);
      }
    }
  });
}

#endif  // INFLIGHT_GEMM_X86

#ifdef INFLIGHT_GEMM_X86
// Asked of the CPU once, not on each of a step's several hundred calls.
const bool kHasF32 = __builtin_cpu_supports("avx512f");
const bool kHasBf16 = kHasF32 && __builtin_cpu_supports("avx512bf16");
#endif

bool supported(at::ScalarType dtype) {
#ifdef INFLIGHT_GEMM_X86
  if (dtype == at::kFloat) return kHasF32;
  if (dtype == at::kBFloat16) return kHasBf16;
#endif
  return false;
}

at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2, "weight must be a 2-D CPU tensor");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "weight must be float32 or bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % 16 == 0 && n > 0 && k > 0, "out features must be a positive multiple of 16, got ", n);
  const int64_t lanes = dtype == at::kFloat ? 1 : 2;
  const int64_t depth = (k + lanes - 1) / lanes;
  // [n, depth, lanes] with an odd k's last pair padded with zero.
  at::Tensor w = at::zeros({n, depth * lanes}, weight.options());
  w.narrow(1, 0, k).copy_(weight);
  w = w.view({n, depth, lanes});
  at::Tensor packed = at::empty({n / 16, depth, 16 * lanes}, weight.options());
  at::Tensor flat = packed.view({-1});
  for (int64_t col = 0; col < n; col += kGroup) {
    const int64_t width = std::min(kGroup, n - col);
    // The group's columns, k-major: [depth, width, lanes].
    flat.narrow(0, col * depth * lanes, width * depth * lanes)
        .view({depth, width, lanes})
        .copy_(w.narrow(0, col, width).permute({1, 0, 2}));
  }
  return packed;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x must be [rows, k] with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == dtype && packed.dim() == 3 && packed.is_contiguous(),
              "packed must come from pack_linear, in x's dtype");
  const int64_t lanes = dtype == at::kFloat ? 1 : 2;
  TORCH_CHECK(packed.size(2) == 16 * lanes && packed.size(1) == (x.size(1) + lanes - 1) / lanes,
              "x's k does not match the packed weight");
  const int64_t n = packed.size(0) * 16;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == n,
                "bias must be [out features] in x's dtype");
  }
  TORCH_CHECK(supported(dtype), "this CPU lacks the instructions of the packed ", dtype, " kernel");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
#ifdef INFLIGHT_GEMM_X86
  if (dtype == at::kFloat) {
    run<float>(out, x, packed, bias.has_value() ? bias->data_ptr<float>() : nullptr);
  } else {
    run<at::BFloat16>(out, x, packed, bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr);
  }
#endif
  return out;
}

bool linear_supported(at::ScalarType dtype) { return supported(dtype); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight_cpu, m) {
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  // No tensor to dispatch on: one kernel for every backend.
  m.def("packed_linear_supported(ScalarType dtype) -> bool", &linear_supported);
}

TORCH_LIBRARY_IMPL(inflight_cpu, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("packed_linear", &linear);
}
