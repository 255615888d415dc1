// Paged attention and KV store for the CPU engine, read in place through the block tables.
//
// Registered as torch ops (torch.ops.inflight_cpu.*), built by engine/kernels/cpu/__init__.py. The
// packed-step metadata is that of engine/attention/backend.py; the cache is head-major
// (KVLayout.HEAD_MAJOR there):
//   kv_cache [2, num_blocks, Hkv, block_size, D]   query/out [T, Hq, D]
//   query_start_loc [S + 1] int32   seq_lens [S] int32   block_tables [S, max_blocks] int32
// so the K (or V) of one kv head in one block, a page, is one run of block_size * D elements: an item
// streams whole pages, and neither its cache lines nor its 4 KiB memory pages hold other heads' rows
// (token-major, one kv head's keys are D-element rows at a stride of Hkv * D).
//
// Work is split into items (request, kv head, tile of up to kTileQ query tokens); one item computes
// the G = Hq / Hkv query heads that share its kv head for every query token of its tile, so each K and
// V row is read once per item, however large the GQA group. Scores are kept for the whole context (two
// passes: scores and softmax, then the weighted sum of V), which reads K and V exactly once and needs
// no rescaling. Softmax and accumulation are float32 whatever the cache dtype.
//
// Vectorisation: GCC vector extensions over 16 floats, compiled as clones for AVX-512, AVX2 and a
// baseline (target_clones), so one build runs on any x86-64 host and picks its best path at load time.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

using namespace inflight_cpu;

constexpr int64_t kTileQ = 8;  // query tokens per work item in a prefill chunk

// Shuffle masks of reduce16: lane i of the result takes lane mask[i] of the concatenation (a, b).
constexpr vi32 kLo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
constexpr vi32 kHi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
constexpr vi32 kLo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
constexpr vi32 kHi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
constexpr vi32 kLo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
constexpr vi32 kHi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
constexpr vi32 kLo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
constexpr vi32 kHi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

__attribute__((always_inline)) inline vfloat fold(vfloat a, vfloat b, vi32 lo, vi32 hi) {
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// Lane j of the result is the sum of the lanes of x[j]: sixteen dot products finished with 45 vector
// ops instead of sixteen serial horizontal sums. Each level adds partial sums of the same vector only,
// so a NaN in one key's products stays in that key's lane. Level by level (a..p = x[0..15]):
//   1: (a,b) -> [a 8 partials | b 8 partials]        8 folds
//   2: (ab,cd) -> [a 4 | b 4 | c 4 | d 4]             4 folds
//   3: (abcd,efgh) -> [a 2 | b 2 | ... | h 2]         2 folds
//   4: (a..h,i..p) -> [a b c ... p]                   1 fold
__attribute__((always_inline)) inline vfloat reduce16(const vfloat* x) {
  vfloat l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) l1[i] = fold(x[2 * i], x[2 * i + 1], kLo1, kHi1);
  for (int i = 0; i < 4; ++i) l2[i] = fold(l1[2 * i], l1[2 * i + 1], kLo2, kHi2);
  for (int i = 0; i < 2; ++i) l3[i] = fold(l2[2 * i], l2[2 * i + 1], kLo3, kHi3);
  return fold(l3[0], l3[1], kLo4, kHi4);
}

#if defined(__x86_64__) && !defined(INFLIGHT_NO_CLONES)
// bf16 caches on CPUs with AVX512_BF16: one query row against sixteen keys with VDPBF16PS (pairs of
// exact bf16 products summed into float32 lanes), half the instructions of widening both sides
// to float and no widened copy of K. ``pairs`` = D / 32. Writes the sixteen raw dot products.
__attribute__((target("avx512f,avx512bf16"))) void dots16_bf16(const at::BFloat16* q,
                                                               const at::BFloat16* const* keys, int64_t pairs,
                                                               float* out) {
  vfloat dots[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < pairs; ++c) {
      const __m512i a = _mm512_loadu_si512(q + 32 * c);
      const __m512i b = _mm512_loadu_si512(keys[j] + 32 * c);
      acc = _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
    }
    std::memcpy(&dots[j], &acc, sizeof(acc));
  }
  const vfloat s = reduce16(dots);
  std::memcpy(out, &s, sizeof(s));
}
const bool kHasDpBf16 = __builtin_cpu_supports("avx512bf16");
#else
void dots16_bf16(const at::BFloat16*, const at::BFloat16* const*, int64_t, float*) {}
const bool kHasDpBf16 = false;
#endif

// Where an item's keys live: the offset of each of its pages (one per block of its context) in the
// K half of the cache; the V half is the same offsets past v_offset. Key position t is row t & mask
// of page t >> shift (block_size is a power of two).
struct Pages {
  const int64_t* offsets;
  int shift;
  int64_t mask;
  int64_t row(int64_t t, int64_t d) const { return offsets[t >> shift] + (t & mask) * d; }
};

// Pages are scattered, so the hardware prefetcher loses the stream at every page boundary: fetch the
// keys [begin, end) ahead of use, one contiguous run of cache lines per page they span. kLocality 3:
// into L1, for use within the next groups; 2: into L2, for a later pass.
template <typename T, int64_t D, int kLocality = 3>
__attribute__((always_inline)) inline void prefetch_keys(const T* half, const Pages& pages, int64_t begin,
                                                         int64_t end) {
  while (begin < end) {
    const int64_t stop = std::min(end, ((begin >> pages.shift) + 1) << pages.shift);  // this page's part
    const char* first = reinterpret_cast<const char*>(half + pages.row(begin, D));
    const char* last = reinterpret_cast<const char*>(half + pages.row(stop - 1, D) + D);
    first = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(first) & ~uintptr_t{63});
    for (; first < last; first += 64) __builtin_prefetch(first, 0, kLocality);
    begin = stop;
  }
}

template <typename T>
inline void store_row(T* dst, const float* src, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * mul);
}

struct Item {
  int64_t seq;
  int64_t kv_head;
  int64_t q_begin;  // first query token of the tile, relative to the request's first query token
  int64_t q_end;
};

struct Geometry {
  int64_t num_heads, num_kv_heads, group, head_size, chunks, block_size;
  int64_t q_stride_t, q_stride_h;  // query strides in elements (last dim contiguous)
  int64_t o_stride_t, o_stride_h;
  int64_t kv_stride_block, kv_stride_head, v_offset;  // v_offset: kv_cache[1] - kv_cache[0]
  int64_t bt_stride;
  float scale;
};

struct Scratch {
  std::vector<float> floats;
  std::vector<int64_t> pages;  // Pages::offsets of the current item
};

// Two prefetch distances per stream. Into L1, just ahead of use: what the next groups read. Into L2,
// a window of kL2Bytes ahead: at an item's start its first window of K and of V is requested at
// once, then the window rolls with each pass, so many misses are in flight rather than the few that
// two groups ahead make (a 16-key group's compute does not hide one memory trip per page). V's first
// window then waits in L2 for pass 2. A window of 32 KiB per stream did as well as 256 KiB at
// SmolLM2's shape (bench/cpu_attention_bench.py), at contexts of 300 and 3000.
constexpr int64_t kKAhead = 2 * kLanes;  // keys of K prefetched ahead into L1: two groups of 16
constexpr int64_t kVAhead = 32;  // keys of V prefetched ahead of the accumulation into L1
constexpr int64_t kL2Bytes = 32 << 10;

// acc[i] = sum over t < limit of p[i * p_stride + t] * V[t] for NR rows; written to out [NR, D]. Walks
// page by page: within a page the rows are consecutive.
template <typename T, int C, int NR>
__attribute__((always_inline)) inline void weighted_v(const T* v_cache, const Pages& pages, int64_t block_size,
                                                      int64_t window, const float* p, int64_t p_stride,
                                                      int64_t limit, float* out) {
  constexpr int64_t D = C * kLanes;
  vfloat acc[NR][C];
  for (int i = 0; i < NR; ++i) {
    for (int c = 0; c < C; ++c) acc[i][c] = vfloat{};
  }
  for (int64_t t0 = 0; t0 < limit; t0 += block_size) {
    const int64_t ahead = t0 + kVAhead, far = t0 + window;
    prefetch_keys<T, D>(v_cache, pages, std::min(ahead, limit), std::min(ahead + block_size, limit));
    prefetch_keys<T, D, 2>(v_cache, pages, std::min(far, limit), std::min(far + block_size, limit));
    const T* page = v_cache + pages.row(t0, D);
    const int64_t n = std::min(block_size, limit - t0);
    for (int64_t j = 0; j < n; ++j) {
      const T* v = page + j * D;
      for (int c = 0; c < C; ++c) {
        const vfloat x = load16(v + c * kLanes);
        for (int i = 0; i < NR; ++i) acc[i][c] += p[i * p_stride + t0 + j] * x;
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int c = 0; c < C; ++c) std::memcpy(out + i * C * kLanes + c * kLanes, &acc[i][c], sizeof(vfloat));
  }
}

// One item: rows = (query tokens of the tile) x (heads of the group). Row r = token i * G + g, its
// query sits at position seq_len - query_len + i and sees keys 0..that position. C = D / 16, a
// compile-time constant so that a row's query and accumulator live in registers.
template <typename T, int C>
INFLIGHT_CLONES void attend_item(const Item& it, const Geometry& g, const T* query, const T* cache,
                                 const int32_t* qsl, const int32_t* seq_lens, const int32_t* tables, T* out,
                                 Scratch& scratch) {
  constexpr int64_t D = C * kLanes;
  const int64_t q0 = qsl[it.seq];
  const int64_t query_len = qsl[it.seq + 1] - q0;
  const int64_t first_pos = seq_lens[it.seq] - query_len;  // position of the request's first query token
  const int64_t num_tok = it.q_end - it.q_begin;
  const int64_t rows = num_tok * g.group;
  const int64_t ctx = first_pos + it.q_end;  // keys the last row of the tile can see
  const int64_t ctx_pad = (ctx + kLanes - 1) / kLanes * kLanes;
  const int32_t* table = tables + it.seq * g.bt_stride;

  // The item's pages, once. block_size is a power of two (the engine enforces it): shifts, not
  // divisions, per key.
  const int64_t num_pages = (ctx + g.block_size - 1) / g.block_size;
  scratch.pages.resize(static_cast<size_t>(num_pages));
  for (int64_t b = 0; b < num_pages; ++b) {
    scratch.pages[b] = static_cast<int64_t>(table[b]) * g.kv_stride_block + it.kv_head * g.kv_stride_head;
  }
  const Pages pages{scratch.pages.data(), __builtin_ctzll(static_cast<uint64_t>(g.block_size)), g.block_size - 1};
  // scratch: scaled queries [rows, D], probabilities [rows, ctx_pad]
  scratch.floats.resize(static_cast<size_t>(rows * (D + ctx_pad)));
  float* qf = scratch.floats.data();
  float* scores = qf + rows * D;
  for (int64_t i = 0; i < num_tok; ++i) {
    for (int64_t h = 0; h < g.group; ++h) {
      const T* src = query + (q0 + it.q_begin + i) * g.q_stride_t + (it.kv_head * g.group + h) * g.q_stride_h;
      float* dst = qf + (i * g.group + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * g.scale;
    }
  }

  const T* k_cache = cache;
  const T* v_cache = cache + g.v_offset;
  constexpr bool kDpEligible = std::is_same_v<T, at::BFloat16> && C % 2 == 0;
  const bool dp = kDpEligible && kHasDpBf16;
  // Pass 1, scores: sixteen keys at a time. float32 keys are read in place (after the first row the
  // group's rows sit in L1 for the others); bf16 ones, without VDPBF16PS, are widened to float once
  // into an L1-resident buffer that every row of the item then reads.
  alignas(64) float kbuf[std::is_same_v<T, float> ? 1 : kLanes * D];
  // The L2 window in keys: a K or V row is D * sizeof(T) bytes.
  const int64_t window = std::max<int64_t>(kKAhead + kLanes, kL2Bytes / (D * static_cast<int64_t>(sizeof(T))));
  prefetch_keys<T, D>(k_cache, pages, 0, std::min(kKAhead, ctx));
  prefetch_keys<T, D, 2>(k_cache, pages, kKAhead, std::min(window, ctx));
  prefetch_keys<T, D, 2>(v_cache, pages, 0, std::min(window, ctx));
  for (int64_t t0 = 0; t0 < ctx_pad; t0 += kLanes) {
    const int64_t ahead = t0 + kKAhead, far = t0 + window;
    prefetch_keys<T, D>(k_cache, pages, std::min(ahead, ctx), std::min(ahead + kLanes, ctx));
    prefetch_keys<T, D, 2>(k_cache, pages, std::min(far, ctx), std::min(far + kLanes, ctx));
    // Positions past ctx repeat the last key, so the padded lanes of a partial group read valid
    // memory (their scores are discarded).
    const T* keys[kLanes];
    for (int j = 0; j < kLanes; ++j) keys[j] = k_cache + pages.row(std::min(t0 + j, ctx - 1), D);
    const float* kf[kLanes];
    if constexpr (std::is_same_v<T, float>) {
      for (int j = 0; j < kLanes; ++j) kf[j] = keys[j];
    } else {
      for (int j = 0; j < kLanes; ++j) kf[j] = kbuf + j * D;
      if (!dp) {
        for (int j = 0; j < kLanes; ++j) {
          for (int c = 0; c < C; ++c) {
            const vfloat x = load16(keys[j] + c * kLanes);
            std::memcpy(kbuf + j * D + c * kLanes, &x, sizeof(x));
          }
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t limit = first_pos + it.q_begin + r / g.group + 1;  // keys this row sees
      if (t0 >= limit) continue;  // an earlier query token of a prefill tile
      vfloat sv;
      if constexpr (kDpEligible) {
        if (dp) {
          const T* q_row = query + (q0 + it.q_begin + r / g.group) * g.q_stride_t +
                           (it.kv_head * g.group + r % g.group) * g.q_stride_h;
          alignas(64) float raw[kLanes];
          dots16_bf16(q_row, keys, C / 2, raw);
          sv = load16(raw) * g.scale;
        }
      }
      if (!dp) {
        const float* qr = qf + r * D;
        vfloat dots[kLanes];
        for (int j = 0; j < kLanes; ++j) {
          vfloat acc = load16(qr) * load16(kf[j]);
          for (int c = 1; c < C; ++c) acc += load16(qr + c * kLanes) * load16(kf[j] + c * kLanes);
          dots[j] = acc;
        }
        sv = reduce16(dots);
      }
      if (t0 + kLanes > limit) {  // the row's last group: keys past its limit do not exist for it
        for (int j = 0; j < kLanes; ++j) {
          if (t0 + j >= limit) sv[j] = -std::numeric_limits<float>::infinity();
        }
      }
      std::memcpy(scores + r * ctx_pad + t0, &sv, sizeof(sv));
    }
  }
  // V's first keys, from L2 (its first window) to L1 during the softmax.
  prefetch_keys<T, D>(v_cache, pages, 0, std::min(kVAhead, ctx));
  // Softmax numerators in place (zero past each row's limit, up to ctx_pad), and 1 / their sum.
  float inv_sum[kTileQ * 16];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t limit = first_pos + it.q_begin + r / g.group + 1;
    const int64_t groups = (limit + kLanes - 1) / kLanes;
    float* sr = scores + r * ctx_pad;
    vfloat vmax = vfloat{} - std::numeric_limits<float>::infinity();
    for (int64_t t0 = 0; t0 < groups * kLanes; t0 += kLanes) {
      const vfloat x = load16(sr + t0);
      vmax = vmax > x ? vmax : x;
    }
    float m = vmax[0];
    for (int j = 1; j < kLanes; ++j) m = std::max(m, vmax[j]);
    vfloat vsum{};
    for (int64_t t0 = 0; t0 < groups * kLanes; t0 += kLanes) {
      const vfloat e = vexp(load16(sr + t0) - m);
      std::memcpy(sr + t0, &e, sizeof(e));
      vsum += e;
    }
    std::memset(sr + groups * kLanes, 0, sizeof(float) * (ctx_pad - groups * kLanes));
    float sum = 0.f;
    for (int j = 0; j < kLanes; ++j) sum += vsum[j];
    inv_sum[r] = 1.f / sum;
  }
  // Pass 2, weighted sum of V: up to kRowsPerPass rows at once share each V load, with their
  // accumulators (NR x C vectors) in registers; a zero probability adds nothing. NR is a
  // compile-time constant (a GQA group of 3 runs as one pass of 3, not a pass of 4 with a
  // runtime bound, which would leave the accumulators in memory).
  constexpr int64_t kRowsPerPass = C <= 4 ? 4 : (C <= 8 ? 2 : 1);
  for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {
    const int64_t nr = std::min(kRowsPerPass, rows - r0);
    const int64_t limit = first_pos + it.q_begin + (r0 + nr - 1) / g.group + 1;  // of the last row
    float* acc_out = qf + r0 * D;  // the scaled queries of these rows are no longer needed
    const float* p = scores + r0 * ctx_pad;
    const int64_t bs = g.block_size;
    switch (nr) {
      case 4: weighted_v<T, C, (kRowsPerPass >= 4 ? 4 : 1)>(v_cache, pages, bs, window, p, ctx_pad, limit, acc_out); break;
      case 3: weighted_v<T, C, (kRowsPerPass >= 3 ? 3 : 1)>(v_cache, pages, bs, window, p, ctx_pad, limit, acc_out); break;
      case 2: weighted_v<T, C, (kRowsPerPass >= 2 ? 2 : 1)>(v_cache, pages, bs, window, p, ctx_pad, limit, acc_out); break;
      default: weighted_v<T, C, 1>(v_cache, pages, bs, window, p, ctx_pad, limit, acc_out); break;
    }
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t r = r0 + i;
      const int64_t tok = r / g.group, h = r % g.group;
      T* dst = out + (q0 + it.q_begin + tok) * g.o_stride_t + (it.kv_head * g.group + h) * g.o_stride_h;
      store_row(dst, acc_out + i * D, D, inv_sum[r]);
    }
  }
}

// Head sizes the kernel is compiled for (D = 16 * C).
template <typename T>
using ItemFn = void (*)(const Item&, const Geometry&, const T*, const T*, const int32_t*, const int32_t*,
                        const int32_t*, T*, Scratch&);

template <typename T>
ItemFn<T> item_fn(int64_t chunks) {
  switch (chunks) {
    case 1: return &attend_item<T, 1>;
    case 2: return &attend_item<T, 2>;
    case 4: return &attend_item<T, 4>;
    case 5: return &attend_item<T, 5>;
    case 6: return &attend_item<T, 6>;
    case 8: return &attend_item<T, 8>;
    case 16: return &attend_item<T, 16>;
    default: return nullptr;
  }
}

void check_common(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.device().is_cpu(), "inflight_cpu ops run on CPU tensors");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, blocks, Hkv, block_size, D]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "kv_cache must be float32 or bfloat16");
}

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     double scale, int64_t max_query_len) {
  check_common(kv_cache);
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "query and out must be [T, Hq, D]");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == kv_cache.scalar_type(),
              "query, out and kv_cache must share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head dim must be contiguous");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt,
              "metadata must be int32");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() && block_tables.stride(1) == 1,
              "metadata must be contiguous");
  Geometry g{};
  g.num_heads = query.size(1);
  g.num_kv_heads = kv_cache.size(2);
  TORCH_CHECK(g.num_heads % g.num_kv_heads == 0, "query heads must be a multiple of kv heads");
  g.group = g.num_heads / g.num_kv_heads;
  TORCH_CHECK(g.group <= 16, "at most 16 query heads per kv head");
  g.head_size = kv_cache.size(4);
  TORCH_CHECK(query.size(2) == g.head_size, "query head size differs from the cache's");
  TORCH_CHECK(g.head_size % kLanes == 0 && item_fn<float>(g.head_size / kLanes) != nullptr,
              "head size must be 16, 32, 64, 80, 96, 128 or 256");
  g.chunks = g.head_size / kLanes;
  g.block_size = kv_cache.size(3);
  TORCH_CHECK((g.block_size & (g.block_size - 1)) == 0, "block_size must be a power of two");
  g.q_stride_t = query.stride(0);
  g.q_stride_h = query.stride(1);
  g.o_stride_t = out.stride(0);
  g.o_stride_h = out.stride(1);
  g.kv_stride_block = kv_cache.stride(1);
  g.kv_stride_head = kv_cache.stride(2);
  g.v_offset = kv_cache.stride(0);
  g.bt_stride = block_tables.stride(0);
  g.scale = static_cast<float>(scale);

  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(num_seqs * g.num_kv_heads));
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t query_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(query_len <= lens[s], "a request has more query tokens than context");
    if (query_len > max_query_len) continue;  // the caller attends this one another way; rows untouched
    for (int64_t begin = 0; begin < query_len; begin += kTileQ) {
      for (int64_t h = 0; h < g.num_kv_heads; ++h) {
        items.push_back({s, h, begin, std::min(begin + kTileQ, query_len)});
      }
    }
  }
  // Dynamic scheduling, costliest items first: at::parallel_for splits a range statically, which
  // leaves one thread with the long contexts; here each thread pulls the next item from a counter.
  auto cost = [&](const Item& it) { return (it.q_end - it.q_begin) * (lens[it.seq] - qsl[it.seq + 1] + qsl[it.seq] + it.q_end); };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_items);
  std::atomic<int64_t> next{0};
  dispatch(kv_cache.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* cache = kv_cache.data_ptr<scalar_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const ItemFn<scalar_t> fn = item_fn<scalar_t>(g.chunks);
    at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
      Scratch scratch;
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        fn(items[i], g, q, cache, qsl, lens, tables, o, scratch);
      }
    });
  });
}

void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slot_mapping) {
  check_common(kv_cache);
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "key, value and kv_cache must share a dtype");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key and value must be [T, Hkv, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be int64");
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t num_kv_heads = kv_cache.size(2), block_size = kv_cache.size(3), head_size = kv_cache.size(4);
  TORCH_CHECK(key.size(1) == num_kv_heads && key.size(2) == head_size, "key shape differs from the cache's");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "head dim must be contiguous");
  const int64_t num_slots = kv_cache.size(1) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  dispatch(kv_cache.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* k_cache = kv_cache.data_ptr<scalar_t>();
    scalar_t* v_cache = k_cache + kv_cache.stride(0);
    const scalar_t* k = key.data_ptr<scalar_t>();
    const scalar_t* v = value.data_ptr<scalar_t>();
    const size_t row_bytes = sizeof(scalar_t) * head_size;
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // a padding token
      TORCH_CHECK(slot < num_slots, "slot ", slot, " is outside the cache");
      // Slot s is row s % block_size of block s / block_size's page of each kv head.
      const int64_t page0 = (slot / block_size) * kv_cache.stride(1) + (slot % block_size) * head_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = page0 + h * kv_cache.stride(2);
        std::memcpy(k_cache + dst, k + t * key.stride(0) + h * key.stride(1), row_bytes);
        std::memcpy(v_cache + dst, v + t * value.stride(0) + h * value.stride(1), row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(inflight_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor block_tables, float scale, int max_query_len) -> ()");
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(inflight_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("store_kv", &store_kv);
}
