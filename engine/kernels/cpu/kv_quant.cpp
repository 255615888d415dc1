// Paged attention and KV store over an 8-bit cache (kv_cache_dtype int8 or fp8_e4m3), for the CPU engine.
//
// Registered as torch ops next to the float kernels' (torch.ops.inflight_cpu.*_quant), built on demand
// by engine/kernels/cpu/__init__.py (load_kv_quant). The row format is engine/kernels/kv_quant.py's:
// each (token, kv head) row of K (or V) is D one-byte codes, then the row's float32 scale, value =
// code * scale. The cache is head-major (KVLayout.HEAD_MAJOR), so one kv head's rows of a block are one
// run of block_size * (D + 4) bytes that an item streams:
//   kv_cache [2, num_blocks, Hkv, block_size, D + 4] int8 or float8_e4m3fn   query/out [T, Hq, D]
//   query_start_loc [S + 1] int32   seq_lens [S] int32   block_tables [S, max_blocks] int32
//
// Work is split into items (request, kv head, tile of up to kTileQ query tokens); an item holds the
// G = Hq / Hkv query heads of its kv head for every token of its tile, so each row of codes is
// dequantized once per item. Two passes over the item's keys: scores (dequantize a block's K rows into
// floats, dot them with every query row), softmax in float32, then the weighted sum of the dequantized
// V rows. Keys before the first row's sliding window (HF's kv_idx > q_idx - W) are never read: those
// blocks may be freed and reused. Gemma 2's soft cap maps scaled scores before the mask.
//
// Decoding a code: int8 widens; an e4m3 byte's exponent and mantissa bits, shifted into float32's
// fields, are the value times 2^-120 (bias 127 against 7, subnormals included), so a shift, an OR of
// the sign and a multiply replace a table.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

using namespace inflight_cpu;

constexpr int64_t kTileQ = 16;  // query tokens per work item in a prefill chunk
constexpr int64_t kScaleBytes = 4;

typedef int8_t vi8 __attribute__((vector_size(kLanes)));
typedef uint8_t vu8 __attribute__((vector_size(kLanes)));

inline float row_scale(const uint8_t* row, int64_t head_size) {
  float s;
  std::memcpy(&s, row + head_size, sizeof(s));
  return s;
}

// The sum of a vector's lanes as a tree (halving four times, in registers): a lane-by-lane loop is 16
// dependent adds, and halves taken through memory stall on store forwarding.
typedef float vfloat8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vfloat4 __attribute__((vector_size(4 * sizeof(float))));
__attribute__((always_inline)) inline float hsum(vfloat v) {
  const vfloat8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vfloat4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

struct Geometry {
  int64_t num_heads, num_kv_heads, group, head_size, row_bytes, block_size, block_shift;
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;
  int64_t kv_stride_block, kv_stride_head, v_offset, bt_stride;
  float scale, soft_cap;
  int64_t sliding_window;  // 0: off
  bool fp8;
};

struct Item {
  int64_t seq, kv_head, q_begin, q_end;  // query tokens [q_begin, q_end) of the request's this step
};

struct Scratch {
  std::vector<float> q, scores, inv_sum;
};

// Where an item's keys live: key t is row t & mask of the page of block table[t >> shift] (block_size is
// a power of two; a division per key cost more than the key's multiply-adds).
struct Pages {
  const uint8_t* cache;  // the K half; V is v_offset further
  const int32_t* table;
  int64_t head_off, stride_block, shift, mask, row_bytes;
  const uint8_t* row(int64_t t) const {
    return cache + table[t >> shift] * stride_block + head_off + (t & mask) * row_bytes;
  }
};


using RowsFn = void (*)(const Geometry&, const Pages&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&, float*);

// The rows' code twice: for AVX-512 hosts, and for any other (its own target clones for AVX2).
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
#define KVQ_AVX512 1
#define KVQ_CLONES
#include "kv_quant_rows.h"
#undef KVQ_CLONES
#undef KVQ_AVX512
}  // namespace avx512
#pragma GCC pop_options
namespace generic {
#define KVQ_AVX512 0
#define KVQ_CLONES INFLIGHT_CLONES
#include "kv_quant_rows.h"
#undef KVQ_CLONES
#undef KVQ_AVX512
}  // namespace generic

const bool kHasAvx512 = __builtin_cpu_supports("avx512f");

// portable: the generic copy even on an AVX-512 host (what tests compare the two with).
RowsFn rows_fn(int64_t chunks, bool fp8, bool portable) {
  if (kHasAvx512 && !portable) return fp8 ? avx512::rows_fn<true>(chunks) : avx512::rows_fn<false>(chunks);
  return fp8 ? generic::rows_fn<true>(chunks) : generic::rows_fn<false>(chunks);
}


template <typename T>
void attend(const Item& it, const Geometry& g, RowsFn fn, const T* query, const uint8_t* cache, const int32_t* qsl,
            const int32_t* lens, const int32_t* tables, T* out, Scratch& sc, std::vector<float>& acc) {
  const int64_t D = g.head_size, G = g.group, chunks = D / kLanes;
  const int64_t q_start = qsl[it.seq];
  const int64_t num_cached = lens[it.seq] - (qsl[it.seq + 1] - q_start);
  const int64_t num_rows = (it.q_end - it.q_begin) * G;
  const int64_t hi = num_cached + it.q_end;  // past the last row's own position
  // Keys before the first row's window are never read: their blocks may be freed and reused.
  const int64_t lo =
      g.sliding_window > 0 ? std::max<int64_t>(0, num_cached + it.q_begin - g.sliding_window + 1) : 0;
  sc.q.resize(static_cast<size_t>(num_rows * D));
  sc.scores.resize(static_cast<size_t>(num_rows * (hi - lo)));
  sc.inv_sum.resize(static_cast<size_t>(num_rows));
  acc.resize(static_cast<size_t>(num_rows * D));
  for (int64_t r = 0; r < num_rows; ++r) {
    const T* src = query + (q_start + it.q_begin + r / G) * g.q_stride_t + (it.kv_head * G + r % G) * g.q_stride_h;
    for (int64_t c = 0; c < chunks; ++c) store16(&sc.q[r * D + c * kLanes], load16(src + c * kLanes) * g.scale);
  }
  const Pages pages{cache,          tables + it.seq * g.bt_stride, it.kv_head * g.kv_stride_head,
                    g.kv_stride_block, g.block_shift, g.block_size - 1, g.row_bytes};
  fn(g, pages, num_rows, num_cached, it.q_begin, lo, hi, sc, acc.data());
  for (int64_t r = 0; r < num_rows; ++r) {
    T* dst = out + (q_start + it.q_begin + r / G) * g.o_stride_t + (it.kv_head * G + r % G) * g.o_stride_h;
    for (int64_t c = 0; c < chunks; ++c) store16(dst + c * kLanes, load16(&acc[r * D + c * kLanes]) * sc.inv_sum[r]);
  }
}

bool is_fp8(const at::Tensor& kv_cache) { return kv_cache.scalar_type() == at::kFloat8_e4m3fn; }

void check_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.device().is_cpu(), "inflight_cpu ops run on CPU tensors");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, blocks, Hkv, block_size, D + 4]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(kv_cache.scalar_type() == at::kChar || is_fp8(kv_cache), "kv_cache must be int8 or float8_e4m3fn");
  TORCH_CHECK((kv_cache.size(4) - kScaleBytes) % kLanes == 0, "head size must be a multiple of 16");
}

void paged_attention_quant(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           const at::Tensor& block_tables, double scale, int64_t sliding_window,
                           double logits_soft_cap, bool portable) {
  check_cache(kv_cache);
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "query and out must be [T, Hq, D]");
  TORCH_CHECK(query.scalar_type() == out.scalar_type() &&
                  (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16),
              "query and out must share a dtype, float32 or bfloat16");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head dim must be contiguous");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt,
              "metadata must be int32");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() && block_tables.stride(1) == 1,
              "metadata must be contiguous");
  TORCH_CHECK(sliding_window >= 0 && logits_soft_cap >= 0, "sliding_window and logits_soft_cap are >= 0 (0: off)");
  Geometry g{};
  g.num_heads = query.size(1);
  g.num_kv_heads = kv_cache.size(2);
  TORCH_CHECK(g.num_heads % g.num_kv_heads == 0, "query heads must be a multiple of kv heads");
  g.group = g.num_heads / g.num_kv_heads;
  g.row_bytes = kv_cache.size(4);
  g.head_size = g.row_bytes - kScaleBytes;
  TORCH_CHECK(query.size(2) == g.head_size, "query head size differs from the cache's");
  TORCH_CHECK(rows_fn(g.head_size / kLanes, false, false) != nullptr, "head size must be 16, 32, 64, 80, 96, 128 or 256");
  g.block_size = kv_cache.size(3);
  TORCH_CHECK((g.block_size & (g.block_size - 1)) == 0, "block_size must be a power of two");
  g.block_shift = __builtin_ctzll(static_cast<unsigned long long>(g.block_size));
  g.q_stride_t = query.stride(0);
  g.q_stride_h = query.stride(1);
  g.o_stride_t = out.stride(0);
  g.o_stride_h = out.stride(1);
  g.kv_stride_block = kv_cache.stride(1);
  g.kv_stride_head = kv_cache.stride(2);
  g.v_offset = kv_cache.stride(0);
  g.bt_stride = block_tables.stride(0);
  g.scale = static_cast<float>(scale);
  g.soft_cap = static_cast<float>(logits_soft_cap);
  g.sliding_window = sliding_window;
  g.fp8 = is_fp8(kv_cache);

  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t query_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(query_len <= lens[s], "a request has more query tokens than context");
    for (int64_t begin = 0; begin < query_len; begin += kTileQ) {
      for (int64_t h = 0; h < g.num_kv_heads; ++h) items.push_back({s, h, begin, std::min(begin + kTileQ, query_len)});
    }
  }
  // Costliest first, pulled from a counter by each thread (a static split leaves one thread the long ones).
  auto cost = [&](const Item& it) { return (it.q_end - it.q_begin) * (lens[it.seq] - qsl[it.seq + 1] + qsl[it.seq] + it.q_end); };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_items);
  std::atomic<int64_t> next{0};
  const uint8_t* cache = static_cast<const uint8_t*>(kv_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const RowsFn fn = rows_fn(g.head_size / kLanes, g.fp8, portable);
  dispatch(query.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
      Scratch scratch;
      std::vector<float> acc;
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        attend(items[i], g, fn, q, cache, qsl, lens, tables, o, scratch, acc);
      }
    });
  });
}

// One row: codes of x / s with s = max |x| / QMAX, rounded as torch rounds (int8: to nearest even;
// fp8: c10's conversion), then s. Bit for bit the reference's (engine/kernels/kv_quant.py).
template <typename T>
void quantize_row(const T* x, int64_t D, bool fp8, uint8_t* dst) {
  const float qmax = fp8 ? 448.f : 127.f;
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float s = amax / qmax;
  const float div = s == 0.f ? 1.f : s;
  for (int64_t i = 0; i < D; ++i) {
    const float c = std::min(std::max(static_cast<float>(x[i]) / div, -qmax), qmax);
    dst[i] = fp8 ? c10::Float8_e4m3fn(c).x : static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(c)));
  }
  std::memcpy(dst + D, &s, sizeof(s));
}

void store_kv_quant(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slot_mapping) {
  check_cache(kv_cache);
  TORCH_CHECK(key.scalar_type() == value.scalar_type() &&
                  (key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16),
              "key and value must share a dtype, float32 or bfloat16");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key and value must be [T, Hkv, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be int64");
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t num_kv_heads = kv_cache.size(2), block_size = kv_cache.size(3), row_bytes = kv_cache.size(4);
  const int64_t head_size = row_bytes - kScaleBytes;
  TORCH_CHECK(key.size(1) == num_kv_heads && key.size(2) == head_size, "key shape differs from the cache's");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "head dim must be contiguous");
  const int64_t num_slots = kv_cache.size(1) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is outside the cache");
  const bool fp8 = is_fp8(kv_cache);
  uint8_t* k_cache = static_cast<uint8_t*>(kv_cache.data_ptr());
  uint8_t* v_cache = k_cache + kv_cache.stride(0);
  dispatch(key.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* k = key.data_ptr<scalar_t>();
    const scalar_t* v = value.data_ptr<scalar_t>();
    at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;  // a padding token
        const int64_t row = (slot / block_size) * kv_cache.stride(1) + (slot % block_size) * row_bytes;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t dst = row + h * kv_cache.stride(2);
          quantize_row(k + t * key.stride(0) + h * key.stride(1), head_size, fp8, k_cache + dst);
          quantize_row(v + t * value.stride(0) + h * value.stride(1), head_size, fp8, v_cache + dst);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight_cpu, m) {
  m.def("paged_attention_quant(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor block_tables, float scale, int sliding_window=0, float logits_soft_cap=0.0, "
        "bool portable=False) -> ()");
  m.def("store_kv_quant(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(inflight_cpu, CPU, m) {
  m.impl("paged_attention_quant", &paged_attention_quant);
  m.impl("store_kv_quant", &store_kv_quant);
}
