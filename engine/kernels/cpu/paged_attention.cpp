// Paged attention and KV store for the CPU engine, read in place through the block tables.
//
// Registered as torch ops (torch.ops.inflight_cpu.*), built by engine/kernels/cpu/__init__.py. The
// packed-step metadata is that of engine/attention/backend.py; the cache is head-major with
// key-interleaved K pages (KVLayout.HEAD_MAJOR_KT there):
//   kv_cache [2, num_blocks, Hkv, block_size, D] in size   query/out [T, Hq, D]
//   query_start_loc [S + 1] int32   seq_lens [S] int32   block_tables [S, max_blocks] int32
// The K (or V) of one kv head in one block, a page, is one run of block_size * D elements: an item
// streams whole pages, and neither its cache lines nor its 4 KiB memory pages hold other heads'
// keys. A V page is [block_size][D] (a key's values side by side); a K page is [D / P][block_size][P],
// P = 4 / sizeof(T), so that a score is computed for 16 keys at once (see kPack below).
//
// Work is split into items (request, kv head, tile of up to kTileQ query tokens); one item computes
// the G = Hq / Hkv query heads that share its kv head for every query token of its tile, so each K and
// V row is read once per item, however large the GQA group. Scores are kept for the whole context (two
// passes: scores and softmax, then the weighted sum of V), which reads K and V exactly once and needs
// no rescaling. Softmax and accumulation are float32 whatever the cache dtype.
//
// Sliding window (HF's kv_idx > q_idx - W) and logit soft cap (Gemma 2's cap * tanh(score / cap)) live
// in attend_item, outside every scorer: each row has a key range [row_lo, row_limit); no page before
// the one holding the item's first row_lo is read (those blocks may be freed and reused: pass 1 scores
// from that key's 16-key group, masking the keys before it, and pass 2 reads V from the key itself),
// and the cap maps a group's scaled scores before they are masked. The AVX-512 and generic scorers compute the same raw scores whatever the window, so
// both are correct by construction.
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

// K pages are key-interleaved (KVLayout.HEAD_MAJOR_KT): the K page of one (block, kv head) is
// [D / P][block_size][P] with P = 4 / sizeof(T) (float32 1, bf16 2), so one dim (float32) or one
// pair of dims (bf16) of 16 consecutive keys fills one 64-byte line. The scores of 16 keys are then
// sums of lines times a broadcast query element, lane by lane: no horizontal sum per key, which on
// a token-major page (a key's D values side by side) cost more than the multiplications.
template <typename T>
constexpr int64_t kPack = 4 / static_cast<int64_t>(sizeof(T));

// Scores are computed for NG groups of 16 keys (NG = 1 or 2) against NR rows at once: each line is
// loaded once into a register for the NR rows, and each broadcast query element serves the NG
// groups' lines, so loads stay below the multiply-adds. kChains: independent partial sums per
// (row, group), enough chains to cover the multiply-add latency.
template <int NR, int NG>
constexpr int kChains = NR * NG >= 4 ? 2 : 8 / (NR * NG);

// Raw scores (q . k; q as the caller scaled it) of NR rows against NG groups of 16 keys; group g's
// line c sits at lines[g] + c * stride. q: NR rows of D floats at a stride of D. out[g * NR + r].
template <typename T, int C, int NR, int NG>
__attribute__((always_inline)) inline void group_scores(const T* const* lines, int64_t stride, const float* q,
                                                        vfloat* out) {
  constexpr int64_t D = C * kLanes;
  constexpr int S = kChains<NR, NG>;
  vfloat acc[NG][NR][S];
  for (int g = 0; g < NG; ++g) {
    for (int r = 0; r < NR; ++r) {
      for (int s = 0; s < S; ++s) acc[g][r][s] = vfloat{};
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t d0 = 0; d0 < D; d0 += S) {
      for (int s = 0; s < S; ++s) {
        vfloat x[NG];
        for (int g = 0; g < NG; ++g) {
          x[g] = load16(lines[g] + (d0 + s) * stride);
        }
        for (int r = 0; r < NR; ++r) {
          const float qv = q[r * D + d0 + s];
          for (int g = 0; g < NG; ++g) acc[g][r][s] += x[g] * qv;
        }
      }
    }
  } else {
    // A bf16 line read as 16 32-bit lanes: the low half of lane j is dim 2c of key j, the high half
    // dim 2c + 1; each widens to float with a shift or a mask.
    for (int64_t c0 = 0; c0 < D / 2; c0 += S) {
      for (int s = 0; s < S; ++s) {
        vfloat lo[NG], hi[NG];
        for (int g = 0; g < NG; ++g) {
          vu32 w;
          std::memcpy(&w, lines[g] + (c0 + s) * stride, sizeof(w));
          const vu32 lo_bits = w << 16, hi_bits = w & 0xffff0000u;
          std::memcpy(&lo[g], &lo_bits, sizeof(vfloat));
          std::memcpy(&hi[g], &hi_bits, sizeof(vfloat));
        }
        for (int r = 0; r < NR; ++r) {
          const float q0 = q[r * D + 2 * (c0 + s)], q1 = q[r * D + 2 * (c0 + s) + 1];
          for (int g = 0; g < NG; ++g) acc[g][r][s] += lo[g] * q0 + hi[g] * q1;
        }
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    for (int r = 0; r < NR; ++r) {
      vfloat sum = acc[g][r][0];
      for (int s = 1; s < S; ++s) sum += acc[g][r][s];
      out[g * NR + r] = sum;
    }
  }
}

#if defined(__x86_64__) && !defined(INFLIGHT_NO_CLONES)
// The AVX-512 scorers' partial sums: zeroed, and at the end each (group, row)'s S chains added and
// written as out[g * NR + r].
template <int NG, int NR, int S>
__attribute__((target("avx512f"), always_inline)) inline void zero_sums(__m512 (&acc)[NG][NR][S]) {
  for (int g = 0; g < NG; ++g) {
    for (int r = 0; r < NR; ++r) {
      for (int s = 0; s < S; ++s) acc[g][r][s] = _mm512_setzero_ps();
    }
  }
}

template <int NG, int NR, int S>
__attribute__((target("avx512f"), always_inline)) inline void store_sums(const __m512 (&acc)[NG][NR][S], float* out) {
  for (int g = 0; g < NG; ++g) {
    for (int r = 0; r < NR; ++r) {
      __m512 sum = acc[g][r][0];
      for (int s = 1; s < S; ++s) sum = _mm512_add_ps(sum, acc[g][r][s]);
      _mm512_storeu_ps(out + (g * NR + r) * kLanes, sum);
    }
  }
}

// bf16 caches on CPUs with AVX512_BF16: VDPBF16PS multiplies a line (a dim pair of 16 keys) by a
// broadcast pair of query dims and adds both exact products into each key's float32 lane. q: NR
// rows of the raw bf16 query, as dim pairs. Writes NG x NR x 16 raw scores.
template <int C, int NR, int NG>
__attribute__((target("avx512f,avx512bf16"))) void group_scores_dp(const at::BFloat16* const* lines, int64_t stride,
                                                                   const uint32_t* const* q, float* out) {
  constexpr int64_t kPairs = C * kLanes / 2;
  constexpr int S = kChains<NR, NG>;
  __m512 acc[NG][NR][S];
  zero_sums(acc);
  for (int64_t c0 = 0; c0 < kPairs; c0 += S) {
    for (int s = 0; s < S; ++s) {
      __m512i x[NG];
      for (int g = 0; g < NG; ++g) {
        x[g] = _mm512_loadu_si512(lines[g] + (c0 + s) * stride);
      }
      for (int r = 0; r < NR; ++r) {
        const __m512i qq = _mm512_set1_epi32(static_cast<int>(q[r][c0 + s]));
        for (int g = 0; g < NG; ++g) acc[g][r][s] = _mm512_dpbf16_ps(acc[g][r][s], (__m512bh)x[g], (__m512bh)qq);
      }
    }
  }
  store_sums(acc, out);
}
const bool kHasDpBf16 = __builtin_cpu_supports("avx512bf16");

// float32 caches on AVX-512 CPUs: group_scores with each line held in a register for the NR rows
// (the compiler otherwise folds the line's load into every row's multiply-add, one load per FMA,
// which made the load ports, not the FMAs, the bound). Same sums in the same order.
template <int C, int NR, int NG>
__attribute__((target("avx512f"))) void group_scores_f32(const float* const* lines, int64_t stride, const float* q,
                                                         float* out) {
  constexpr int64_t D = C * kLanes;
  constexpr int S = kChains<NR, NG>;
  __m512 acc[NG][NR][S];
  zero_sums(acc);
  for (int64_t d0 = 0; d0 < D; d0 += S) {
    for (int s = 0; s < S; ++s) {
      __m512 x[NG];
      for (int g = 0; g < NG; ++g) {
        x[g] = _mm512_loadu_ps(lines[g] + (d0 + s) * stride);
        __asm__("" : "+v"(x[g]));
      }
      for (int r = 0; r < NR; ++r) {
        const __m512 qv = _mm512_set1_ps(q[r * D + d0 + s]);
        for (int g = 0; g < NG; ++g) acc[g][r][s] = _mm512_fmadd_ps(x[g], qv, acc[g][r][s]);
      }
    }
  }
  store_sums(acc, out);
}
const bool kHasAvx512 = __builtin_cpu_supports("avx512f");
#else
template <int C, int NR, int NG>
void group_scores_f32(const float* const*, int64_t, const float*, float*) {}
const bool kHasAvx512 = false;
template <int C, int NR, int NG>
void group_scores_dp(const at::BFloat16* const*, int64_t, const uint32_t* const*, float*) {}
const bool kHasDpBf16 = false;
#endif

// Scores of rows [r0, r0 + nr) (nr <= 4) against NG groups: NR a compile-time constant, so that the
// accumulators stay in registers.
template <typename T, int C, int NG>
__attribute__((always_inline)) inline void rows_scores(bool dp, int64_t nr, const T* const* lines, int64_t stride,
                                                       const uint32_t* const* q_pairs, const float* qf, vfloat* out) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (dp) {
      float* raw = reinterpret_cast<float*>(out);
      switch (nr) {
        case 4: group_scores_dp<C, 4, NG>(lines, stride, q_pairs, raw); return;
        case 3: group_scores_dp<C, 3, NG>(lines, stride, q_pairs, raw); return;
        case 2: group_scores_dp<C, 2, NG>(lines, stride, q_pairs, raw); return;
        default: group_scores_dp<C, 1, NG>(lines, stride, q_pairs, raw); return;
      }
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    if (kHasAvx512) {
      float* raw = reinterpret_cast<float*>(out);
      switch (nr) {
        case 4: group_scores_f32<C, 4, NG>(lines, stride, qf, raw); return;
        case 3: group_scores_f32<C, 3, NG>(lines, stride, qf, raw); return;
        case 2: group_scores_f32<C, 2, NG>(lines, stride, qf, raw); return;
        default: group_scores_f32<C, 1, NG>(lines, stride, qf, raw); return;
      }
    }
  }
  switch (nr) {
    case 4: group_scores<T, C, 4, NG>(lines, stride, qf, out); return;
    case 3: group_scores<T, C, 3, NG>(lines, stride, qf, out); return;
    case 2: group_scores<T, C, 2, NG>(lines, stride, qf, out); return;
    default: group_scores<T, C, 1, NG>(lines, stride, qf, out); return;
  }
}

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

// Prefetch the K lines of the 16-key group starting at key t (a multiple of 16), if it exists. With
// pages of 16 keys or more the group is one line per dim (pair) at a stride of block_size * P; smaller
// pages hold whole groups' worth of keys side by side, so the group is its pages, whole.
template <typename T, int64_t D, int kLocality = 3>
__attribute__((always_inline)) inline void prefetch_group(const T* k_half, const Pages& pages, int64_t block_size,
                                                          int64_t t, int64_t ctx) {
  if (t >= ctx) return;
  if (block_size >= kLanes) {
    const T* line = k_half + pages.offsets[t >> pages.shift] + (t & pages.mask) * kPack<T>;
    for (int64_t c = 0; c < D / kPack<T>; ++c) __builtin_prefetch(line + c * block_size * kPack<T>, 0, kLocality);
  } else {
    prefetch_keys<T, D, kLocality>(k_half, pages, t, std::min(t + kLanes, ctx));
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
  int64_t sliding_window;  // W: a query at p sees keys p - W + 1 .. p; 0: no window
  float soft_cap;  // cap: scores -> cap * tanh(score / cap); 0: off
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

// acc[i] = sum over begin <= t < limit of p[i * p_stride + t - base] * V[t] for NR rows; written to
// out [NR, D]. Walks page by page: within a page the rows are consecutive. No V row before begin is read.
template <typename T, int C, int NR>
__attribute__((always_inline)) inline void weighted_v(const T* v_cache, const Pages& pages, int64_t block_size,
                                                      int64_t window, const float* p, int64_t p_stride,
                                                      int64_t begin, int64_t base, int64_t limit, float* out) {
  constexpr int64_t D = C * kLanes;
  // bf16 with an even number of 16-value chunks: accumulator c (even) holds the even dims of chunks
  // c and c + 1, accumulator c + 1 their odd dims. Each sum is still taken key by key, in order.
  constexpr bool kPairs = std::is_same_v<T, at::BFloat16> && C % 2 == 0;
  vfloat acc[NR][C];
  for (int i = 0; i < NR; ++i) {
    for (int c = 0; c < C; ++c) acc[i][c] = vfloat{};
  }
  for (int64_t t0 = begin; t0 < limit;) {
    const int64_t stop = std::min(limit, ((t0 >> pages.shift) + 1) << pages.shift);  // this page's part
    const int64_t ahead = t0 + kVAhead, far = t0 + window;
    prefetch_keys<T, D>(v_cache, pages, std::min(ahead, limit), std::min(ahead + block_size, limit));
    prefetch_keys<T, D, 2>(v_cache, pages, std::min(far, limit), std::min(far + block_size, limit));
    const T* page = v_cache + pages.row(t0, D);
    const float* pt = p + (t0 - base);  // this page's probabilities, row 0
    const int64_t n = stop - t0;
    t0 = stop;
    for (int64_t j = 0; j < n; ++j) {
      const T* v = page + j * D;
      if constexpr (kPairs) {
        // 32 bf16 values as 16 32-bit lanes: the low halves are the even dims, the high halves the
        // odd ones, each widened by one shift or mask (a 16-value load widens with two ops).
        for (int c = 0; c < C; c += 2) {
          vu32 w;
          std::memcpy(&w, v + c * kLanes, sizeof(w));
          const vu32 lo_bits = w << 16, hi_bits = w & 0xffff0000u;
          vfloat even, odd;
          std::memcpy(&even, &lo_bits, sizeof(even));
          std::memcpy(&odd, &hi_bits, sizeof(odd));
          for (int i = 0; i < NR; ++i) {
            const float pi = pt[i * p_stride + j];
            acc[i][c] += pi * even;
            acc[i][c + 1] += pi * odd;
          }
        }
      } else {
        for (int c = 0; c < C; ++c) {
          const vfloat x = load16(v + c * kLanes);
          for (int i = 0; i < NR; ++i) acc[i][c] += pt[i * p_stride + j] * x;
        }
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    float* row = out + i * D;
    for (int c = 0; c < C; ++c) {
      if constexpr (kPairs) {  // back from (even, odd) halves to dim order
        const int half = c & 1;
        for (int m = 0; m < kLanes; ++m) row[(c - half) * kLanes + 2 * m + half] = acc[i][c][m];
      } else {
        std::memcpy(row + c * kLanes, &acc[i][c], sizeof(vfloat));
      }
    }
  }
}

// One item: rows = (query tokens of the tile) x (heads of the group). Row r = token i * G + g, its
// query sits at position seq_len - query_len + i and sees keys row_lo(r)..that position (row_lo 0
// without a window). C = D / 16, a compile-time constant so that a row's query and accumulator live in
// registers. Scores are kept from base, the 16-key group of the first row's row_lo, on. Worked
// example, W 20, a tile of tokens at positions 40..47 (G 1): row 0 sees 21..40, row 7 28..47; base 16,
// so pass 1 scores groups 16.. and 32.. (keys 16..20 masked), pass 2 reads V rows 21..47 only.
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
  // Keys row r sees: [row_lo(r), row_limit(r)).
  auto row_limit = [&](int64_t r) { return first_pos + it.q_begin + r / g.group + 1; };
  auto row_lo = [&](int64_t r) {
    return g.sliding_window > 0 ? std::max<int64_t>(0, row_limit(r) - g.sliding_window) : int64_t{0};
  };
  const int64_t lo = row_lo(0);  // the item's first key: nothing before it is read
  const int64_t base = lo / kLanes * kLanes;  // scores kept from here: [rows, span]
  const int64_t span = ctx_pad - base;

  // The item's pages, once, from the one holding lo (earlier entries: never read). block_size is a
  // power of two (the engine enforces it): shifts, not divisions, per key.
  const int shift = __builtin_ctzll(static_cast<uint64_t>(g.block_size));
  const int64_t first_page = lo >> shift;
  const int64_t num_pages = (ctx + g.block_size - 1) / g.block_size;
  scratch.pages.assign(static_cast<size_t>(num_pages), 0);
  for (int64_t b = first_page; b < num_pages; ++b) {
    scratch.pages[b] = static_cast<int64_t>(table[b]) * g.kv_stride_block + it.kv_head * g.kv_stride_head;
  }
  const Pages pages{scratch.pages.data(), shift, g.block_size - 1};
  // scratch: scaled queries [rows, D], probabilities [rows, span] (key t at column t - base)
  scratch.floats.resize(static_cast<size_t>(rows * (D + span)));
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
  const bool dp = std::is_same_v<T, at::BFloat16> && kHasDpBf16;
  // VDPBF16PS reads the query as it is, in bf16 dim pairs (the scale is applied to its scores).
  const uint32_t* q_pairs[kTileQ * 16];
  if (dp) {
    for (int64_t r = 0; r < rows; ++r) {
      q_pairs[r] = reinterpret_cast<const uint32_t*>(query + (q0 + it.q_begin + r / g.group) * g.q_stride_t +
                                                     (it.kv_head * g.group + r % g.group) * g.q_stride_h);
    }
  }
  // Pass 1, scores: two groups of sixteen keys at a time, against up to four rows at once. A group
  // lies within one page when pages hold 16 keys or more; smaller pages' parts of a group are first
  // copied side by side into kbuf, laid out as pages of 16 keys.
  alignas(64) T kbuf[2 * kLanes * D];
  const int64_t page_line = g.block_size * kPack<T>;  // elements between a K page's lines
  // The L2 window in keys (a K or V row is D * sizeof(T) bytes), whole groups.
  const int64_t window =
      std::max<int64_t>(kKAhead + kLanes, kL2Bytes / (D * static_cast<int64_t>(sizeof(T)))) / kLanes * kLanes;
  for (int64_t t = base; t < std::min(base + kKAhead, ctx); t += kLanes) {
    prefetch_group<T, D>(k_cache, pages, g.block_size, t, ctx);
  }
  for (int64_t t = base + kKAhead; t < std::min(base + window, ctx); t += kLanes) {
    prefetch_group<T, D, 2>(k_cache, pages, g.block_size, t, ctx);
  }
  prefetch_keys<T, D, 2>(v_cache, pages, lo, std::min(lo + window, ctx));
  for (int64_t t0 = base; t0 < ctx_pad; t0 += 2 * kLanes) {
    const int64_t ng = std::min<int64_t>(2, (ctx_pad - t0) / kLanes);
    const T* lines[2];
    int64_t stride = kLanes * kPack<T>;
    for (int64_t j = 0; j < ng; ++j) {
      const int64_t t = t0 + j * kLanes;
      prefetch_group<T, D>(k_cache, pages, g.block_size, t + kKAhead, ctx);
      prefetch_group<T, D, 2>(k_cache, pages, g.block_size, t + window, ctx);
      if (g.block_size >= kLanes) {
        // Lanes past ctx read the rest of the page (allocated; their scores are masked below).
        lines[j] = k_cache + pages.offsets[t >> pages.shift] + (t & pages.mask) * kPack<T>;
        stride = page_line;
      } else {
        T* tile = kbuf + j * kLanes * D;
        lines[j] = tile;
        const int64_t last_page = std::min(num_pages, (t + kLanes) >> pages.shift);
        // Pages before lo's are not read: their lanes keep what kbuf held, and are masked below.
        for (int64_t b = std::max(t >> pages.shift, first_page); b < last_page; ++b) {
          const T* page = k_cache + pages.offsets[b];
          T* dst = tile + (b * g.block_size - t) * kPack<T>;
          for (int64_t c = 0; c < D / kPack<T>; ++c) {
            std::memcpy(dst + c * kLanes * kPack<T>, page + c * page_line, sizeof(T) * page_line);
          }
        }
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, rows - r0);
      if (t0 >= row_limit(r0 + nr - 1)) continue;  // earlier query tokens of a prefill tile
      if (t0 + ng * kLanes <= row_lo(r0)) continue;  // before every one of these rows' windows
      alignas(64) vfloat sv[8];
      if (ng == 2) {
        rows_scores<T, C, 2>(dp, nr, lines, stride, q_pairs + r0, qf + r0 * D, sv);
      } else {
        rows_scores<T, C, 1>(dp, nr, lines, stride, q_pairs + r0, qf + r0 * D, sv);
      }
      for (int64_t j = 0; j < ng; ++j) {
        const int64_t t = t0 + j * kLanes;
        for (int64_t i = 0; i < nr; ++i) {
          vfloat v = sv[j * nr + i];
          if (dp) v *= g.scale;
          if (g.soft_cap > 0.f) {  // as HF: the scaled score, capped, then masked
            for (int k = 0; k < kLanes; ++k) v[k] = g.soft_cap * std::tanh(v[k] / g.soft_cap);
          }
          const int64_t limit = row_limit(r0 + i), rlo = row_lo(r0 + i);
          if (t + kLanes > limit || t < rlo) {  // keys outside [rlo, limit) do not exist for this row
            for (int k = 0; k < kLanes; ++k) {
              if (t + k >= limit || t + k < rlo) v[k] = -std::numeric_limits<float>::infinity();
            }
          }
          std::memcpy(scores + (r0 + i) * span + (t - base), &v, sizeof(vfloat));
        }
      }
    }
  }
  // V's first keys, from L2 (its first window) to L1 during the softmax.
  prefetch_keys<T, D>(v_cache, pages, lo, std::min(lo + kVAhead, ctx));
  // Softmax numerators in place (zero outside each row's groups, from base up to ctx_pad), and 1 /
  // their sum. Columns are key - base.
  float inv_sum[kTileQ * 16];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g_begin = row_lo(r) / kLanes * kLanes - base;  // the row's first group's column
    const int64_t g_end = (row_limit(r) + kLanes - 1) / kLanes * kLanes - base;
    float* sr = scores + r * span;
    vfloat vmax = vfloat{} - std::numeric_limits<float>::infinity();
    for (int64_t t0 = g_begin; t0 < g_end; t0 += kLanes) {
      const vfloat x = load16(sr + t0);
      vmax = vmax > x ? vmax : x;
    }
    float m = vmax[0];
    for (int j = 1; j < kLanes; ++j) m = std::max(m, vmax[j]);
    vfloat vsum{};
    for (int64_t t0 = g_begin; t0 < g_end; t0 += kLanes) {
      const vfloat e = vexp(load16(sr + t0) - m);
      std::memcpy(sr + t0, &e, sizeof(e));
      vsum += e;
    }
    std::memset(sr, 0, sizeof(float) * g_begin);
    std::memset(sr + g_end, 0, sizeof(float) * (span - g_end));
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
    const int64_t limit = row_limit(r0 + nr - 1);  // of the last row
    const int64_t begin = row_lo(r0);  // of the first: the later rows' keys before theirs weigh 0
    float* acc_out = qf + r0 * D;  // the scaled queries of these rows are no longer needed
    const float* p = scores + r0 * span;
    const int64_t bs = g.block_size;
    switch (nr) {
      case 4: weighted_v<T, C, (kRowsPerPass >= 4 ? 4 : 1)>(v_cache, pages, bs, window, p, span, begin, base, limit, acc_out); break;
      case 3: weighted_v<T, C, (kRowsPerPass >= 3 ? 3 : 1)>(v_cache, pages, bs, window, p, span, begin, base, limit, acc_out); break;
      case 2: weighted_v<T, C, (kRowsPerPass >= 2 ? 2 : 1)>(v_cache, pages, bs, window, p, span, begin, base, limit, acc_out); break;
      default: weighted_v<T, C, 1>(v_cache, pages, bs, window, p, span, begin, base, limit, acc_out); break;
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
                     double scale, int64_t max_query_len, int64_t sliding_window, double logits_soft_cap) {
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
  TORCH_CHECK(sliding_window >= 0 && logits_soft_cap >= 0, "sliding_window and logits_soft_cap are >= 0 (0: off)");
  g.sliding_window = sliding_window;
  g.soft_cap = static_cast<float>(logits_soft_cap);

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
  // An item's keys: its last token's context, less what precedes its first token's window.
  auto cost = [&](const Item& it) {
    const int64_t first_pos = lens[it.seq] - qsl[it.seq + 1] + qsl[it.seq];
    const int64_t keys = first_pos + it.q_end;
    const int64_t skipped = sliding_window > 0 ? std::max<int64_t>(0, first_pos + it.q_begin + 1 - sliding_window) : 0;
    return (it.q_end - it.q_begin) * (keys - skipped);
  };
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
    constexpr int64_t pack = kPack<scalar_t>;
    constexpr size_t pair_bytes = sizeof(scalar_t) * pack;
    const int64_t line = block_size * pack;  // elements between a K page's lines
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // a padding token
      TORCH_CHECK(slot < num_slots, "slot ", slot, " is outside the cache");
      // Slot s is key s % block_size of block s / block_size's page of each kv head: a row of the V
      // page, and in the K page one element (float32) or pair (bf16) in each of its D / P lines.
      const int64_t row = slot % block_size;
      const int64_t page0 = (slot / block_size) * kv_cache.stride(1);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t page = page0 + h * kv_cache.stride(2);
        const scalar_t* src = k + t * key.stride(0) + h * key.stride(1);
        scalar_t* dst = k_cache + page + row * pack;
        for (int64_t c = 0; c < head_size / pack; ++c) std::memcpy(dst + c * line, src + c * pack, pair_bytes);
        std::memcpy(v_cache + page + row * head_size, v + t * value.stride(0) + h * value.stride(1), row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(inflight_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor block_tables, float scale, int max_query_len, int sliding_window=0, "
        "float logits_soft_cap=0.0) -> ()");
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(inflight_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("store_kv", &store_kv);
}
