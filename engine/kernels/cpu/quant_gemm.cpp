// Linear layers on weights kept in GGUF block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K): out = x @ w.T
// (+ bias), w read as stored, one row of blocks per output feature (engine/quant/formats.py documents
// each block's struct; the format is the contract).
//
// Why dequantize into float32 rather than quantize x to int8 (llama.cpp's way, maddubs / VNNI dot
// products). A decode step multiplies 1 to 64 rows by every weight: its time is the weights' stream
// from memory, which the block format alone cuts (4.5 bits a value for Q4_0 against 32); what the
// multiply does with the bytes once they are in a register is second. Dequantized weights multiplied in
// float32 give exactly what the float model of the dequantized weight gives (the engine's GGUF path
// until now), with no rounding of the activations added, so a quantized model is the same model, and
// tests hold it to float32 rounding. Integer dot products on int8 activations would cut the multiply's
// cost where it bounds (prefill, batches of hundreds); they are the next step, not this file.
//
// How. Threads split the out features into tiles of kTileRows rows. A tile's rows are dequantized into
// a float32 buffer (kTileRows x k, in L1/L2), then every row of x is multiplied by the whole tile, two
// rows of x at a time: 2 x kTileRows vector accumulators, each weight vector loaded once per two rows.
// For one row of x this is one stream of the weights' bytes; for 64 rows the dequantization is paid
// once per tile and the rest is a float GEMM.
//
// Instruction sets, chosen from the host at load: AVX-512 (16-lane float vectors), AVX2 + FMA (8
// lanes), and the same code for the baseline CPU (the compiler's generic vectors: SSE2 on x86-64, plain
// C++ elsewhere). The dequantizers are written once with GCC vector extensions and inlined into each.
//
// Numbers. Dequantized values are bit-identical to gguf's (numpy, float32): every product of a scale and
// a quant is exact in float32, so contraction into an FMA changes nothing. Each output is a float32 sum
// over k (lane-wise partial sums, added at the end), plus the bias, rounded once to x's dtype.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#define QUANT_X86 1
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#endif

#define INLINE __attribute__((always_inline)) inline

namespace {

// ggml's type ids (GGMLQuantizationType), the format names of engine/quant/formats.py.
enum Format : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };
enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

constexpr int kTileRows = 4;  // weight rows per tile: 2 x 4 accumulators fit AVX2's 16 registers

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf16 __attribute__((vector_size(64)));
typedef uint8_t vu8 __attribute__((vector_size(16)));
typedef int8_t vi8 __attribute__((vector_size(16)));

int64_t block_size(int64_t fmt) { return fmt >= kQ4_K ? 256 : 32; }
int64_t block_bytes(int64_t fmt) {
  switch (fmt) {
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

INLINE float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}
INLINE vu8 bytes16(const uint8_t* p) {
  vu8 v;
  std::memcpy(&v, p, 16);
  return v;
}
INLINE vf16 widen(vu8 v) { return __builtin_convertvector(v, vf16); }
INLINE void put(float* out, vf16 v) { std::memcpy(out, &v, sizeof(v)); }

// Each dequantizer writes one block's values to out[0 .. block size).

INLINE void dq_q8_0(const uint8_t* b, float* out) {
  const float d = half_at(b);
  for (int h = 0; h < 2; ++h) {
    vi8 q;
    std::memcpy(&q, b + 2 + 16 * h, 16);
    put(out + 16 * h, d * __builtin_convertvector(q, vf16));
  }
}

INLINE void dq_q4_0(const uint8_t* b, float* out) {
  const float d = half_at(b);
  const vu8 q = bytes16(b + 2);
  put(out, d * (widen(q & 15) - 8.f));
  put(out + 16, d * (widen(q >> 4) - 8.f));
}

INLINE void dq_q4_1(const uint8_t* b, float* out) {
  const float d = half_at(b), m = half_at(b + 2);
  const vu8 q = bytes16(b + 4);
  put(out, d * widen(q & 15) + m);
  put(out + 16, d * widen(q >> 4) + m);
}

// Sub-block s's 6-bit scale and min from a Q4_K/Q5_K block's 12 scale bytes (get_scale_min_k4).
INLINE void scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K (HIGH_BITS false) and Q5_K (true): chunk j of 64 values is 32 bytes of nibbles, low nibbles the
// sub-block 2j, high ones 2j + 1; Q5_K's fifth bit of sub-block s is bit s of qh[l].
template <bool HIGH_BITS>
INLINE void dq_k_quant(const uint8_t* b, float* out) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (HIGH_BITS ? 48 : 16);
  for (int j = 0; j < 4; ++j) {
    for (int part = 0; part < 2; ++part) {  // low nibbles: sub-block 2j; high: 2j + 1
      const int sub = 2 * j + part;
      int sc, m;
      scale_min(scales, sub, sc, m);
      const float scale = d * static_cast<float>(sc), offset = dmin * static_cast<float>(m);
      for (int h = 0; h < 2; ++h) {  // 16 of the chunk's 32 bytes at a time
        const vu8 q = bytes16(qs + 32 * j + 16 * h);
        vu8 v = part == 0 ? (q & 15) : (q >> 4);
        if constexpr (HIGH_BITS) v |= ((bytes16(qh + 16 * h) >> sub) & 1) << 4;
        put(out + 32 * sub + 16 * h, scale * widen(v) - offset);
      }
    }
  }
}

// Q6_K, value 128h + 32p + l: low bits ql[64h + 32(p & 1) + l] >> 4(p >> 1), high bits qh[32h + l] >> 2p,
// scale scales[8h + 2p + l / 16].
INLINE void dq_q6_k(const uint8_t* b, float* out) {
  const float d = half_at(b + 208);
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  for (int h = 0; h < 2; ++h) {
    for (int p = 0; p < 4; ++p) {
      for (int g = 0; g < 2; ++g) {  // l in [16g, 16g + 16)
        const vu8 ql = bytes16(b + 64 * h + 32 * (p & 1) + 16 * g);
        const vu8 low = (p >> 1) ? (ql >> 4) : (ql & 15);
        const vu8 high = (bytes16(b + 128 + 32 * h + 16 * g) >> (2 * p)) & 3;
        const float scale = d * static_cast<float>(scales[8 * h + 2 * p + g]);
        put(out + 128 * h + 32 * p + 16 * g, scale * (widen(low | (high << 4)) - 32.f));
      }
    }
  }
}

template <int64_t FMT>
INLINE void dq_row_as(const uint8_t* row, int64_t num_blocks, float* out) {
  constexpr int64_t bytes = FMT == kQ8_0 ? 34 : FMT == kQ4_0 ? 18 : FMT == kQ4_1 ? 20 : FMT == kQ4_K ? 144
                                                                     : FMT == kQ5_K ? 176 : 210;
  constexpr int64_t values = FMT >= kQ4_K ? 256 : 32;
  for (int64_t i = 0; i < num_blocks; ++i) {
    const uint8_t* b = row + i * bytes;
    float* o = out + i * values;
    if constexpr (FMT == kQ8_0) dq_q8_0(b, o);
    if constexpr (FMT == kQ4_0) dq_q4_0(b, o);
    if constexpr (FMT == kQ4_1) dq_q4_1(b, o);
    if constexpr (FMT == kQ4_K) dq_k_quant<false>(b, o);
    if constexpr (FMT == kQ5_K) dq_k_quant<true>(b, o);
    if constexpr (FMT == kQ6_K) dq_q6_k(b, o);
  }
}

INLINE void dq_row(int64_t fmt, const uint8_t* row, int64_t k, float* out) {
  const int64_t n = k / block_size(fmt);
  switch (fmt) {
    case kQ8_0: dq_row_as<kQ8_0>(row, n, out); break;
    case kQ4_0: dq_row_as<kQ4_0>(row, n, out); break;
    case kQ4_1: dq_row_as<kQ4_1>(row, n, out); break;
    case kQ4_K: dq_row_as<kQ4_K>(row, n, out); break;
    case kQ5_K: dq_row_as<kQ5_K>(row, n, out); break;
    default: dq_row_as<kQ6_K>(row, n, out); break;
  }
}

// What one thread's share of a multiply needs.
struct Job {
  const float* x;  // [m, k], rows contiguous, ldx apart
  int64_t ldx, m, k;
  const uint8_t* w;  // [n, row_bytes]
  int64_t row_bytes, n, fmt;
  const float* bias;  // [n] or null
  float* out;         // [m, n] contiguous
};

// out[r .. r + MR, col .. col + rows) = x[r .. r + MR] @ tile.T, tile = kTileRows dequantized rows of k.
template <typename VF, int MR>
INLINE void multiply_tile(const Job& job, const float* tile, int64_t r, int64_t col, int64_t rows) {
  constexpr int kL = sizeof(VF) / sizeof(float);
  VF acc[MR][kTileRows] = {};
  const float* x = job.x + r * job.ldx;
  for (int64_t i = 0; i < job.k; i += kL) {
    VF w[kTileRows];
    for (int j = 0; j < kTileRows; ++j) std::memcpy(&w[j], tile + j * job.k + i, sizeof(VF));
    for (int mm = 0; mm < MR; ++mm) {
      VF xv;
      std::memcpy(&xv, x + mm * job.ldx + i, sizeof(VF));
      for (int j = 0; j < kTileRows; ++j) acc[mm][j] += xv * w[j];
    }
  }
  for (int mm = 0; mm < MR; ++mm) {
    for (int j = 0; j < rows; ++j) {
      float sum = 0.f;
      for (int l = 0; l < kL; ++l) sum += acc[mm][j][l];
      job.out[(r + mm) * job.n + col + j] = sum + (job.bias != nullptr ? job.bias[col + j] : 0.f);
    }
  }
}

template <typename VF>
INLINE void run_tiles(const Job& job, int64_t t0, int64_t t1) {
  std::vector<float> tile(kTileRows * job.k);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t col = t * kTileRows, rows = std::min<int64_t>(kTileRows, job.n - col);
    for (int64_t j = 0; j < rows; ++j) dq_row(job.fmt, job.w + (col + j) * job.row_bytes, job.k, tile.data() + j * job.k);
    if (rows < kTileRows) std::fill(tile.begin() + rows * job.k, tile.end(), 0.f);  // the last tile's gap
    int64_t r = 0;
    for (; r + 2 <= job.m; r += 2) multiply_tile<VF, 2>(job, tile.data(), r, col, rows);
    if (r < job.m) multiply_tile<VF, 1>(job, tile.data(), r, col, rows);
  }
}

INLINE void dequantize_rows(const Job& job, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) dq_row(job.fmt, job.w + r * job.row_bytes, job.k, job.out + r * job.k);
}

using TilesFn = void (*)(const Job&, int64_t, int64_t);

#ifdef QUANT_X86
TARGET_AVX512 void tiles_avx512(const Job& job, int64_t t0, int64_t t1) { run_tiles<vf16>(job, t0, t1); }
TARGET_AVX2 void tiles_avx2(const Job& job, int64_t t0, int64_t t1) { run_tiles<vf8>(job, t0, t1); }
TARGET_AVX512 void rows_avx512(const Job& job, int64_t r0, int64_t r1) { dequantize_rows(job, r0, r1); }
TARGET_AVX2 void rows_avx2(const Job& job, int64_t r0, int64_t r1) { dequantize_rows(job, r0, r1); }
// Asked of the CPU once, not on each call.
const bool kHasAvx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
const bool kHasAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
void tiles_portable(const Job& job, int64_t t0, int64_t t1) { run_tiles<vf8>(job, t0, t1); }
void rows_portable(const Job& job, int64_t r0, int64_t r1) { dequantize_rows(job, r0, r1); }

int64_t best_isa() {
#ifdef QUANT_X86
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
  TilesFn fn = tiles_portable;
#ifdef QUANT_X86
  if (chosen == kAvx512) fn = tiles_avx512;
  if (chosen == kAvx2) fn = tiles_avx2;
#endif
  const int64_t tiles = (job.n + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { fn(job, t0, t1); });
  return dtype == at::kFloat ? out : out.to(dtype);
}

at::Tensor quant_dequantize(const at::Tensor& blocks, int64_t fmt, int64_t in_features, int64_t isa) {
  Job job = make_job(blocks, fmt, in_features);
  at::Tensor out = at::empty({job.n, in_features}, blocks.options().dtype(at::kFloat));
  job.out = out.data_ptr<float>();
  const int64_t chosen = pick(isa);
  TilesFn fn = rows_portable;
#ifdef QUANT_X86
  if (chosen == kAvx512) fn = rows_avx512;
  if (chosen == kAvx2) fn = rows_avx2;
#endif
  at::parallel_for(0, job.n, 16, [&](int64_t r0, int64_t r1) { fn(job, r0, r1); });
  return out;
}

int64_t quant_linear_isa() { return best_isa(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight_cpu, m) {
  // fmt: the ggml type id; isa: -1 the host's best, else 0 portable, 1 AVX2, 2 AVX-512 (tests pick).
  m.def("quant_linear(Tensor x, Tensor blocks, int fmt, int in_features, Tensor? bias, int isa=-1) -> Tensor");
  m.def("quant_dequantize(Tensor blocks, int fmt, int in_features, int isa=-1) -> Tensor");
  // No tensor to dispatch on: one kernel for every backend.
  m.def("quant_linear_isa() -> int", &quant_linear_isa);
}

TORCH_LIBRARY_IMPL(inflight_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
