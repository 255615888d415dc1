// Linear layers on weights kept in GGUF block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K):
// out = x @ w.T (+ bias), w read as stored, one row of blocks per output feature
// (engine/quant/formats.py documents each block's struct; the format is the contract). And on
// per-channel int8 or fp8 weights (w8_linear: engine/quant/channel.py), through the same tiles.
//
// Why dequantize into float32 rather than quantize x to int8 (llama.cpp's way, maddubs / VNNI dot
// products). A decode step multiplies 1 to 64 rows by every weight: its time is the weights' stream
// from memory, which the block format alone cuts (4.5 bits a value for Q4_0 against 32); what the
// multiply does with the bytes once they are in a register is second. Dequantized weights multiplied in
// float32 give exactly what the float model of the dequantized weight gives (the engine's GGUF path
// until now), with no rounding of the activations added, so a quantized model is the same model, and
// tests hold it to float32 rounding. That is what these kernels compute for many rows. For a few rows
// (a decode step) quant_linear_int8 does it llama.cpp's way instead: x's rows quantized to int8 blocks
// of 32 and integer dot products (quant_gemm_int8.h), which on this design's float path cost more than
// the weights' stream once the weights are 4 to 8 bits; engine/quant/linear.py picks per row count.
//
// How. Threads split the out features into tiles of kTileRows rows. A tile's rows are dequantized into
// a float32 buffer (kTileRows x k, in L1/L2), then every row of x is multiplied by the whole tile, two
// rows of x at a time: 2 x kTileRows vector accumulators, each weight vector loaded once per two rows.
// For one row of x this is one stream of the weights' bytes; for 64 rows the dequantization is paid
// once per tile and the rest is a float GEMM.
//
// Instruction sets, chosen from the host at load: AVX-512 (16-lane float vectors), AVX2 + FMA + F16C (8
// lanes), and the same code for the baseline CPU (the compiler's generic vectors: SSE2 on x86-64, plain
// C++ elsewhere). The kernels are written once (quant_gemm_isa.h, GCC vector extensions and a few
// per-set primitives) and compiled once per set, each in its own namespace under `#pragma GCC target`.
// The float kernels leave VNNI and AVX512_BF16 unused; the integer path uses VNNI where the host has it
// (kAvx512Vnni), else AVX2's vpmaddubsw.
//
// Numbers. Dequantized values are bit-identical to gguf's (numpy, float32): every product of a scale and
// a quant is exact in float32, so contraction into an FMA changes nothing. Each output is a float32 sum
// over k (lane-wise partial sums, added at the end), plus the bias, rounded once to x's dtype.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define QUANT_X86 1
#endif

#define INLINE __attribute__((always_inline)) inline

namespace {

// ggml's type ids (GGMLQuantizationType), the format names of engine/quant/formats.py.
// kW8 / kF8: per-channel int8 or fp8 e4m3 rows (compressed-tensors W8A16 and W8A16-FP8), no ggml type: k
// bytes a row, one float32 scale a row in Job::scales; the multiply is the blocks' (a tile dequantized,
// then a float GEMM), and one or two rows of x (decode) convert the codes in registers instead
// (multiply_channel_direct).
enum Format : int64_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kW8 = 1000,
  kF8 = 1001
};
// kAvx512Vnni: the float kernels of kAvx512, and vpdpbusd for the integer path (quant_linear_int8), which
// runs the AVX2 code (vpmaddubsw) on kAvx2 and kAvx512.
enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3 };

constexpr int kTileRows = 4;  // weight rows per tile: 2 x 4 accumulators fit AVX2's 16 registers

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf16 __attribute__((vector_size(64)));
typedef uint8_t vu8 __attribute__((vector_size(16)));
typedef int8_t vi8 __attribute__((vector_size(16)));

// constexpr: the per-format templates of quant_gemm_isa.h take their block strides from here.
constexpr int64_t block_size(int64_t fmt) { return fmt >= kQ4_K ? 256 : 32; }
constexpr int64_t block_bytes(int64_t fmt) {
  switch (fmt) {
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

INLINE vu8 bytes16(const uint8_t* p) {
  vu8 v;
  std::memcpy(&v, p, 16);
  return v;
}

// Q5_0 / Q5_1's fifth bits, for both the float (quant_gemm_isa.h) and the integer (quant_gemm_int8.h)
// paths: bit i of the 4 qh bytes read as a little-endian word (byte i / 8, bit i % 8) is bit 4 of value
// i. lo gets values 0..15, hi 16..31, each lane 16 where the bit is set and 0 where not. Each qh byte is
// spread over 8 lanes and tested against that lane's own bit (a byte shuffle, an and, a compare): x86
// has no per-lane byte shift, which `(byte >> lane) & 1` would need.
INLINE void fifth_bits(const uint8_t* qh, vu8& lo, vu8& hi) {
  vu8 bytes{};
  std::memcpy(&bytes, qh, 4);
  const vu8 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const vu8 first = __builtin_shufflevector(bytes, bytes, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const vu8 second = __builtin_shufflevector(bytes, bytes, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  lo = (vu8)((first & bit) != 0) & 16;
  hi = (vu8)((second & bit) != 0) & 16;
}

// What one thread's share of a multiply needs.
struct Job {
  const float* x;  // [m, k], rows contiguous, ldx apart
  int64_t ldx, m, k;
  const uint8_t* w;  // [n, row_bytes]
  int64_t row_bytes, n, fmt;
  const float* bias;  // [n] or null
  float* out;         // [m, n] contiguous
  const float* scales;  // kW8, kF8: [n], each row's scale
};

// What one thread's share of an integer-path multiply needs: x's rows quantized (quantize_rows).
struct IntJob {
  const int8_t* xq;  // [m, k]: blocks of 32 int8 values
  const float* xd;   // [m, k / 32]: each block's scale
  const float* xs;   // [m, k / 32]: each block's scale times the sum of its values
  int64_t m, k;
  const uint8_t* w;  // [n, row_bytes]
  int64_t row_bytes, n, fmt;
  const float* bias;  // [n] or null
  float* out;         // [m, n] contiguous
};

// A tile's four weight rows from row col of w; rows past the last (rows < 4) read the first again and
// are not stored (store_tile).
struct TileRows {
  const uint8_t *w0, *w1, *w2, *w3;
};
INLINE TileRows tile_rows(const uint8_t* w, int64_t row_bytes, int64_t col, int64_t rows) {
  const uint8_t* w0 = w + col * row_bytes;
  return {w0, rows > 1 ? w0 + row_bytes : w0, rows > 2 ? w0 + 2 * row_bytes : w0, rows > 3 ? w0 + 3 * row_bytes : w0};
}

// The next tile's rows (after w0's four), requested a slice per block of the current one: four rows read
// side by side stream from memory at about half the rate without it (the hardware prefetchers follow one
// stream).
struct NextTile {
  const uint8_t* next;
  int64_t step;  // bytes a block
  INLINE void fetch(int64_t block) const {
    for (int64_t o = block * step; o < (block + 1) * step; o += 64) __builtin_prefetch(next + o);
  }
};
INLINE NextTile next_tile(const uint8_t* w0, int64_t row_bytes, int64_t blocks) {
  return {w0 + kTileRows * row_bytes, (kTileRows * row_bytes + blocks - 1) / blocks};
}

// out[r .. r + mr, col .. col + rows) = sums (+ bias), out n columns wide.
INLINE void store_tile(float* out, int64_t n, const float* bias, const float (&sums)[2][4], int mr, int64_t r,
                       int64_t col, int64_t rows) {
  for (int mm = 0; mm < mr; ++mm) {
    for (int64_t c = 0; c < rows; ++c) out[(r + mm) * n + col + c] = sums[mm][c] + (bias != nullptr ? bias[col + c] : 0.f);
  }
}

// The kernels, once per instruction set (quant_gemm_isa.h; the integer path: quant_gemm_int8.h).
#ifdef QUANT_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace isa_avx512 {
#define QUANT_ISA 2
#include "quant_gemm_isa.h"
#undef QUANT_ISA
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
#define QUANT_ISA 1
#include "quant_gemm_isa.h"
#include "quant_gemm_int8.h"
#undef QUANT_ISA
}  // namespace isa_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace isa_avx512vnni {
#define QUANT_ISA 3
#include "quant_gemm_int8.h"
#undef QUANT_ISA
}  // namespace isa_avx512vnni
#pragma GCC pop_options
#endif

namespace isa_portable {
#define QUANT_ISA 0
#include "quant_gemm_isa.h"
#include "quant_gemm_int8.h"
#undef QUANT_ISA
}  // namespace isa_portable

using TilesFn = void (*)(const Job&, int64_t, int64_t);
using IntTilesFn = void (*)(const IntJob&, int64_t, int64_t);
using RowFn = void (*)(const Job&, int64_t, float*);

#ifdef QUANT_X86
// Asked of the CPU once, not on each call.
const bool kHasAvx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("f16c");
const bool kHasAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
const bool kHasVnni = kHasAvx512 && __builtin_cpu_supports("avx512vnni");
#endif

int64_t best_isa() {
#ifdef QUANT_X86
  if (kHasVnni) return kAvx512Vnni;
  if (kHasAvx512) return kAvx512;
  if (kHasAvx2) return kAvx2;
#endif
  return kPortable;
}

// The instruction set to run: the best the host has (isa < 0) or the one asked for, if the host has it.
int64_t pick(int64_t isa) {
  if (isa < 0) return best_isa();
  TORCH_CHECK(isa <= best_isa(), "this CPU lacks the instructions of quant_linear path ", isa);
  return isa;
}

Job make_job(const at::Tensor& blocks, int64_t fmt, int64_t k) {
  TORCH_CHECK(block_bytes(fmt) > 0, "unsupported block format (ggml type ", fmt, ")");
  TORCH_CHECK(k > 0 && k % block_size(fmt) == 0, "in features must be whole blocks of ", block_size(fmt));
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(),
              "blocks must be a contiguous uint8 [out features, row bytes] CPU tensor");
  const int64_t row_bytes = k / block_size(fmt) * block_bytes(fmt);
  TORCH_CHECK(blocks.size(1) == row_bytes, "blocks have ", blocks.size(1), " bytes a row, in features ", k,
              " need ", row_bytes);
  Job job{};
  job.w = blocks.data_ptr<uint8_t>();
  job.row_bytes = row_bytes;
  job.n = blocks.size(0);
  job.k = k;
  job.fmt = fmt;
  return job;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t fmt, int64_t in_features,
                        const c10::optional<at::Tensor>& bias, int64_t isa) {
  Job job = make_job(blocks, fmt, in_features);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16),
              "x must be a 2-D float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.size(1) == in_features, "x has ", x.size(1), " features, the weight ", in_features);
  at::Tensor xf = x.to(at::kFloat);
  if (xf.stride(1) != 1) xf = xf.contiguous();
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == job.n, "bias must be [out features]");
    bf = bias->to(at::kFloat).contiguous();
    job.bias = bf.data_ptr<float>();
  }
  at::Tensor out = at::empty({x.size(0), job.n}, x.options().dtype(at::kFloat));
  const int64_t chosen = pick(isa);
  if (x.size(0) == 0) return out.to(dtype);
  job.x = xf.data_ptr<float>();
  job.ldx = xf.stride(0);
  job.m = xf.size(0);
  job.out = out.data_ptr<float>();
  TilesFn fn = isa_portable::tiles;
#ifdef QUANT_X86
  if (chosen >= kAvx512) fn = isa_avx512::tiles;
  if (chosen == kAvx2) fn = isa_avx2::tiles;
#endif
  const int64_t tiles = (job.n + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { fn(job, t0, t1); });
  return dtype == at::kFloat ? out : out.to(dtype);
}

// x's rows as the integer path reads them: each block of 32 values quantized symmetrically to int8 with
// one float32 scale, d = amax / 127 and q = round_half_even(x * (1 / d)) (llama.cpp's Q8_0 activations,
// with the scale kept in float32 rather than fp16), and d * sum(q) for the formats with a min. Plain
// float32 operations in a fixed order (the product rounded before the rounding to an integer, never fused):
// tests repeat them in torch and get the same integers. One block at a time, q and d out; the sum of q
// returned.
int32_t round_block_portable(const float* v, int8_t* q, float* d) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float scale = amax / 127.f;
  const float inv = scale != 0.f ? 1.f / scale : 0.f;
  int32_t sum = 0;
  for (int i = 0; i < 32; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
    sum += q[i];
  }
  *d = scale;
  return sum;
}

#ifdef QUANT_X86
// The same operations on two 16-lane vectors: std::nearbyint does not vectorize at the baseline ISA (a
// libm call a value, which made rounding a prefill's rows cost more than its bf16 multiply).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
// A block's two halves replaced by their integers q (as floats); returns the block's scale d.
INLINE float round_pair(__m512& a, __m512& b) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float scale = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(scale != 0.f ? 1.f / scale : 0.f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  a = _mm512_roundscale_ps(_mm512_mul_ps(a, inv), kNearest);
  b = _mm512_roundscale_ps(_mm512_mul_ps(b, inv), kNearest);
  return scale;
}

int32_t round_block_avx512(const float* v, int8_t* q, float* d) {
  __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  *d = round_pair(a, b);
  const __m512i qa = _mm512_cvtps_epi32(a), qb = _mm512_cvtps_epi32(b);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

// round_rows_int8's loop: x's blocks rounded (round_pair, as the integer path's) and written back as
// q * d in the output's dtype, read and written in bf16 where the tensors are (a bf16 prefill's rows
// cross memory at half float32's bytes, and no float32 copy of them is made).
__m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
void store16(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as torch's conversion does (the values are finite: q * d, |q| <= 127).
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// A dequantized row (float32, n a multiple of 16) rounded to bf16 as torch's conversion rounds it.
void floats_to_bf16_avx512(const float* src, c10::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) store16(dst + i, _mm512_loadu_ps(src + i));
}

template <typename In, typename Out>
void round_rows_avx512(const In* src, Out* dst, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    __m512 a = load16(src + 32 * b), c = load16(src + 32 * b + 16);
    const __m512 d = _mm512_set1_ps(round_pair(a, c));
    store16(dst + 32 * b, _mm512_mul_ps(a, d));
    store16(dst + 32 * b + 16, _mm512_mul_ps(c, d));
  }
}
#pragma GCC pop_options
#endif

using RoundBlockFn = int32_t (*)(const float*, int8_t*, float*);

RoundBlockFn round_block_fn() {
#ifdef QUANT_X86
  if (kHasAvx512) return round_block_avx512;
#endif
  return round_block_portable;
}

void quantize_rows(const float* x, int64_t ldx, int64_t m, int64_t k, int8_t* q, float* d, float* s) {
  const int64_t nb = k / 32;
  const RoundBlockFn round_block = round_block_fn();
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i = r * nb + b;
      const int32_t sum = round_block(x + r * ldx + 32 * b, q + r * k + 32 * b, d + i);
      s[i] = d[i] * static_cast<float>(sum);
    }
  }
}

// The weight in float32, or (bf16) rounded to bf16 row by row from a float32 row in cache: a many-row
// bf16 product then reads half the bytes, and no float32 copy of the whole weight is written and read
// back to convert it.
// A job's weight rows dequantized into a new [n, k] float32 or bf16 tensor.
at::Tensor dequantize_job(const Job& job, const at::TensorOptions& options, int64_t isa, bool bf16) {
  const int64_t in_features = job.k;
  const int64_t chosen = pick(isa);
  RowFn row_fn = isa_portable::row_to;
#ifdef QUANT_X86
  if (chosen >= kAvx512) row_fn = isa_avx512::row_to;
  if (chosen == kAvx2) row_fn = isa_avx2::row_to;
#endif
  at::Tensor out = at::empty({job.n, in_features}, options.dtype(bf16 ? at::kBFloat16 : at::kFloat));
  if (!bf16) {
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, job.n, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) row_fn(job, r, dst + r * in_features);
    });
    return out;
  }
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
#ifdef QUANT_X86
  const bool wide = kHasAvx512;
#else
  const bool wide = false;
#endif
  at::parallel_for(0, job.n, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(in_features);
    for (int64_t r = r0; r < r1; ++r) {
      row_fn(job, r, row.data());
      c10::BFloat16* to = dst + r * in_features;
#ifdef QUANT_X86
      if (wide) {
        floats_to_bf16_avx512(row.data(), to, in_features);
        continue;
      }
#endif
      for (int64_t i = 0; i < in_features; ++i) to[i] = c10::BFloat16(row[i]);
    }
  });
  return out;
}

at::Tensor quant_dequantize(const at::Tensor& blocks, int64_t fmt, int64_t in_features, int64_t isa, bool bf16) {
  return dequantize_job(make_job(blocks, fmt, in_features), blocks.options(), isa, bf16);
}

// A per-channel weight's job (kW8 or kF8), its tensors checked.
Job channel_job(const at::Tensor& qweight, const at::Tensor& scale) {
  const bool fp8 = qweight.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(qweight.device().is_cpu() && (fp8 || qweight.scalar_type() == at::kChar) && qweight.dim() == 2 &&
                  qweight.is_contiguous(),
              "qweight must be a contiguous int8 or float8_e4m3fn [out features, in features] CPU tensor");
  const int64_t n = qweight.size(0), k = qweight.size(1);
  TORCH_CHECK(k > 0 && k % 16 == 0, "per-channel weights need in features in multiples of 16, got ", k);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.numel() == n && scale.is_contiguous(),
              "scale must be a contiguous float32 [out features] tensor");
  Job job{};
  job.w = static_cast<const uint8_t*>(qweight.data_ptr());
  job.row_bytes = k;
  job.n = n;
  job.k = k;
  job.fmt = fp8 ? kF8 : kW8;
  job.scales = scale.data_ptr<float>();
  return job;
}

// A per-channel weight dequantized (scale * q in float32, or that rounded to bf16), for a many-row step.
at::Tensor w8_dequantize(const at::Tensor& qweight, const at::Tensor& scale, int64_t isa, bool bf16) {
  return dequantize_job(channel_job(qweight, scale), qweight.options(), isa, bf16);
}

// Per-channel int8 or fp8 e4m3 weights (weight-only): out = x @ (scale[:, None] * qweight).T (+ bias).
at::Tensor w8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& bias, int64_t isa) {
  Job job = channel_job(qweight, scale);
  const int64_t n = job.n, k = job.k;
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16),
              "x must be a 2-D float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " features, the weight ", k);
  at::Tensor xf = x.to(at::kFloat);
  if (xf.stride(1) != 1) xf = xf.contiguous();
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n, "bias must be [out features]");
    bf = bias->to(at::kFloat).contiguous();
    job.bias = bf.data_ptr<float>();
  }
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  const int64_t chosen = pick(isa);
  if (x.size(0) == 0) return out.to(dtype);
  job.x = xf.data_ptr<float>();
  job.ldx = xf.stride(0);
  job.m = xf.size(0);
  job.out = out.data_ptr<float>();
  TilesFn fn = isa_portable::tiles;
#ifdef QUANT_X86
  if (chosen >= kAvx512) fn = isa_avx512::tiles;
  if (chosen == kAvx2) fn = isa_avx2::tiles;
#endif
  const int64_t tiles = (n + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { fn(job, t0, t1); });
  return dtype == at::kFloat ? out : out.to(dtype);
}

// out = x @ w.T (+ bias) with x's rows quantized to int8 blocks (quantize_rows) and integer dot products
// per 32 values (quant_gemm_int8.h): llama.cpp's way, for a few rows (a decode step), where the float
// kernels' dequantization and float multiplies bound the time rather than the weights' bytes.
at::Tensor quant_linear_int8(const at::Tensor& x, const at::Tensor& blocks, int64_t fmt, int64_t in_features,
                             const c10::optional<at::Tensor>& bias, int64_t isa) {
  const Job shape = make_job(blocks, fmt, in_features);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16),
              "x must be a 2-D float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.size(1) == in_features, "x has ", x.size(1), " features, the weight ", in_features);
  IntJob job{};
  job.w = shape.w;
  job.row_bytes = shape.row_bytes;
  job.n = shape.n;
  job.k = shape.k;
  job.fmt = fmt;
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == job.n, "bias must be [out features]");
    bf = bias->to(at::kFloat).contiguous();
    job.bias = bf.data_ptr<float>();
  }
  const int64_t m = x.size(0), k = in_features;
  at::Tensor out = at::empty({m, job.n}, x.options().dtype(at::kFloat));
  const int64_t chosen = pick(isa);
  if (m == 0) return out.to(dtype);
  at::Tensor xf = x.to(at::kFloat);
  if (xf.stride(1) != 1) xf = xf.contiguous();
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor xd = at::empty({m, 2, k / 32}, x.options().dtype(at::kFloat));
  quantize_rows(xf.data_ptr<float>(), xf.stride(0), m, k, xq.data_ptr<int8_t>(), xd.data_ptr<float>(),
                xd.data_ptr<float>() + m * (k / 32));
  job.xq = xq.data_ptr<int8_t>();
  job.xd = xd.data_ptr<float>();
  job.xs = job.xd + m * (k / 32);
  job.m = m;
  job.out = out.data_ptr<float>();
  IntTilesFn fn = isa_portable::int_tiles;
#ifdef QUANT_X86
  if (chosen == kAvx512Vnni) fn = isa_avx512vnni::int_tiles;
  if (chosen == kAvx2 || chosen == kAvx512) fn = isa_avx2::int_tiles;
#endif
  const int64_t tiles = (job.n + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { fn(job, t0, t1); });
  return dtype == at::kFloat ? out : out.to(dtype);
}

// x's rows as the integer path rounds them (quantize_rows: the same operations, so the same integers),
// back as q * d per block of 32, rounded once to x's dtype (float32 or bf16). A product past the integer
// path's row bound multiplies these rows, so that what a row's result holds does not depend on how many
// rows share its step beyond that dtype's rounding.
at::Tensor round_rows_int8(const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) % 32 == 0 &&
                  (dtype == at::kFloat || dtype == at::kBFloat16),
              "x must be a 2-D float32 or bfloat16 CPU tensor with whole blocks of 32 columns");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), nb = k / 32;
  at::Tensor out = at::empty({m, k}, xc.options());
#ifdef QUANT_X86
  if (kHasAvx512) {
    at::parallel_for(0, m * nb, 256, [&](int64_t b0, int64_t b1) {
      if (dtype == at::kFloat) {
        round_rows_avx512(xc.data_ptr<float>(), out.data_ptr<float>(), b0, b1);
      } else {
        round_rows_avx512(xc.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), b0, b1);
      }
    });
    return out;
  }
#endif
  const at::Tensor xf = xc.to(at::kFloat);
  at::Tensor of = dtype == at::kFloat ? out : at::empty({m, k}, xf.options());
  const float* src = xf.data_ptr<float>();
  float* dst = of.data_ptr<float>();
  at::parallel_for(0, m * nb, 64, [&](int64_t b0, int64_t b1) {
    int8_t q[32];
    float scale;
    for (int64_t b = b0; b < b1; ++b) {
      round_block_portable(src + 32 * b, q, &scale);
      for (int i = 0; i < 32; ++i) dst[32 * b + i] = static_cast<float>(q[i]) * scale;
    }
  });
  if (dtype != at::kFloat) out.copy_(of);
  return out;
}

int64_t quant_linear_isa() { return best_isa(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight_cpu, m) {
  // fmt: the ggml type id; isa: -1 the host's best, else 0 portable, 1 AVX2, 2 AVX-512, 3 AVX-512 VNNI
  // (tests pick).
  m.def("quant_linear(Tensor x, Tensor blocks, int fmt, int in_features, Tensor? bias, int isa=-1) -> Tensor");
  // The same product with x's rows quantized to int8 blocks of 32 and integer dot products (3: VNNI).
  m.def("quant_linear_int8(Tensor x, Tensor blocks, int fmt, int in_features, Tensor? bias, int isa=-1) -> Tensor");
  m.def("quant_dequantize(Tensor blocks, int fmt, int in_features, int isa=-1, bool bf16=False) -> Tensor");
  m.def("round_rows_int8(Tensor x) -> Tensor");
  m.def("w8_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias, int isa=-1) -> Tensor");
  m.def("w8_dequantize(Tensor qweight, Tensor scale, int isa=-1, bool bf16=False) -> Tensor");
  // No tensor to dispatch on: one kernel for every backend.
  m.def("quant_linear_isa() -> int", &quant_linear_isa);
}

TORCH_LIBRARY_IMPL(inflight_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_int8", &quant_linear_int8);
  m.impl("quant_dequantize", &quant_dequantize);
  m.impl("round_rows_int8", &round_rows_int8);
  m.impl("w8_linear", &w8_linear);
  m.impl("w8_dequantize", &w8_dequantize);
}
