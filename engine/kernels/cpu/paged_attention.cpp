// Paged attention and KV store for the CPU engine, read in place through the block tables.
//
// Registered as torch ops (torch.ops.inflight_cpu.*), built by engine/kernels/cpu/build.py. The paged
// layout and the packed-step metadata are those of engine/attention/backend.py:
//   kv_cache [2, num_blocks, block_size, Hkv, D]   query/out [T, Hq, D]
//   query_start_loc [S + 1] int32   seq_lens [S] int32   block_tables [S, max_blocks] int32
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
#include <vector>

namespace {

constexpr int kLanes = 16;
constexpr int64_t kTileQ = 8;  // query tokens per work item in a prefill chunk

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t vu16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vu32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));

#if defined(__x86_64__) && !defined(INFLIGHT_NO_CLONES)
#define INFLIGHT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define INFLIGHT_CLONES
#endif

// bf16 is the upper half of a float32: widen by a 16-bit shift.
__attribute__((always_inline)) inline vfloat load16(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
__attribute__((always_inline)) inline vfloat load16(const at::BFloat16* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  vu32 w = __builtin_convertvector(h, vu32) << 16;
  vfloat v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
__attribute__((always_inline)) inline float hsum(vfloat v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
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
  int64_t kv_stride_block, kv_stride_tok, v_offset;  // v_offset: kv_cache[1] - kv_cache[0]
  int64_t bt_stride;
  float scale;
};

// One item: rows = (query tokens of the tile) x (heads of the group). Row r = token i * G + g, its
// query sits at position seq_len - query_len + i and sees keys 0..that position.
template <typename T>
INFLIGHT_CLONES void attend_item(const Item& it, const Geometry& g, const T* query, const T* cache,
                                 const int32_t* qsl, const int32_t* seq_lens, const int32_t* tables, T* out,
                                 std::vector<float>& scratch) {
  const int64_t q0 = qsl[it.seq];
  const int64_t query_len = qsl[it.seq + 1] - q0;
  const int64_t seq_len = seq_lens[it.seq];
  const int64_t first_pos = seq_len - query_len;  // position of the request's first query token
  const int64_t num_tok = it.q_end - it.q_begin;
  const int64_t rows = num_tok * g.group;
  const int64_t ctx = first_pos + it.q_end;  // keys the last row of the tile can see
  const int64_t D = g.head_size;
  const int32_t* table = tables + it.seq * g.bt_stride;

  // scratch: queries [rows, D] (scaled, float), scores [rows, ctx], accumulators [rows, D]
  scratch.resize(static_cast<size_t>(rows * (2 * D + ctx)));
  float* qf = scratch.data();
  float* scores = qf + rows * D;
  float* acc = scores + rows * ctx;
  for (int64_t i = 0; i < num_tok; ++i) {
    for (int64_t h = 0; h < g.group; ++h) {
      const T* src = query + (q0 + it.q_begin + i) * g.q_stride_t + (it.kv_head * g.group + h) * g.q_stride_h;
      float* dst = qf + (i * g.group + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * g.scale;
    }
  }
  std::memset(acc, 0, sizeof(float) * rows * D);

  // Pass 1: scores of every row against every visible key.
  const T* k_head = cache + it.kv_head * D;
  for (int64_t t0 = 0; t0 < ctx; t0 += g.block_size) {
    const T* k_block = k_head + static_cast<int64_t>(table[t0 / g.block_size]) * g.kv_stride_block;
    const int64_t n = std::min(g.block_size, ctx - t0);
    for (int64_t j = 0; j < n; ++j) {
      const T* k = k_block + j * g.kv_stride_tok;
      vfloat kv[16];  // head sizes up to 256
      for (int64_t c = 0; c < g.chunks; ++c) kv[c] = load16(k + c * kLanes);
      for (int64_t r = 0; r < rows; ++r) {
        const float* q = qf + r * D;
        vfloat s = load16(q) * kv[0];
        for (int64_t c = 1; c < g.chunks; ++c) s += load16(q + c * kLanes) * kv[c];
        scores[r * ctx + t0 + j] = hsum(s);
      }
    }
  }

  // Softmax per row over its own causal limit; probabilities overwrite the scores.
  std::vector<float> inv_sum(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t limit = first_pos + it.q_begin + r / g.group + 1;
    float* s = scores + r * ctx;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < limit; ++t) m = std::max(m, s[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < limit; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    for (int64_t t = limit; t < ctx; ++t) s[t] = 0.f;  // future keys of earlier rows in the tile
    inv_sum[r] = 1.f / sum;
  }

  // Pass 2: weighted sum of V.
  const T* v_head = cache + g.v_offset + it.kv_head * D;
  for (int64_t t0 = 0; t0 < ctx; t0 += g.block_size) {
    const T* v_block = v_head + static_cast<int64_t>(table[t0 / g.block_size]) * g.kv_stride_block;
    const int64_t n = std::min(g.block_size, ctx - t0);
    for (int64_t j = 0; j < n; ++j) {
      const T* v = v_block + j * g.kv_stride_tok;
      vfloat vv[16];
      for (int64_t c = 0; c < g.chunks; ++c) vv[c] = load16(v + c * kLanes);
      for (int64_t r = 0; r < rows; ++r) {
        const float p = scores[r * ctx + t0 + j];
        float* a = acc + r * D;
        for (int64_t c = 0; c < g.chunks; ++c) {
          vfloat x = load16(a + c * kLanes) + p * vv[c];
          std::memcpy(a + c * kLanes, &x, sizeof(x));
        }
      }
    }
  }
  for (int64_t i = 0; i < num_tok; ++i) {
    for (int64_t h = 0; h < g.group; ++h) {
      const int64_t r = i * g.group + h;
      T* dst = out + (q0 + it.q_begin + i) * g.o_stride_t + (it.kv_head * g.group + h) * g.o_stride_h;
      store_row(dst, acc + r * D, D, inv_sum[r]);
    }
  }
}

// The two cache dtypes the CPU engine uses; check_common has refused any other.
template <typename F>
void dispatch(at::ScalarType dtype, F&& f) {
  if (dtype == at::kBFloat16) {
    f(at::BFloat16{});
  } else {
    f(float{});
  }
}

void check_common(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.device().is_cpu(), "inflight_cpu ops run on CPU tensors");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, blocks, block_size, Hkv, D]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "kv_cache must be float32 or bfloat16");
}

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     double scale) {
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
  g.num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(g.num_heads % g.num_kv_heads == 0, "query heads must be a multiple of kv heads");
  g.group = g.num_heads / g.num_kv_heads;
  g.head_size = kv_cache.size(4);
  TORCH_CHECK(query.size(2) == g.head_size, "query head size differs from the cache's");
  TORCH_CHECK(g.head_size % kLanes == 0 && g.head_size <= 256, "head size must be a multiple of 16, <= 256");
  g.chunks = g.head_size / kLanes;
  g.block_size = kv_cache.size(2);
  g.q_stride_t = query.stride(0);
  g.q_stride_h = query.stride(1);
  g.o_stride_t = out.stride(0);
  g.o_stride_h = out.stride(1);
  g.kv_stride_block = kv_cache.stride(1);
  g.kv_stride_tok = kv_cache.stride(2);
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
    at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
      std::vector<float> scratch;
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        attend_item<scalar_t>(items[i], g, q, cache, qsl, lens, tables, o, scratch);
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
  const int64_t num_kv_heads = kv_cache.size(3), head_size = kv_cache.size(4);
  TORCH_CHECK(key.size(1) == num_kv_heads && key.size(2) == head_size, "key shape differs from the cache's");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "head dim must be contiguous");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
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
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = (slot * num_kv_heads + h) * head_size;
        std::memcpy(k_cache + dst, k + t * key.stride(0) + h * key.stride(1), row_bytes);
        std::memcpy(v_cache + dst, v + t * value.stride(0) + h * value.stride(1), row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(inflight_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor block_tables, float scale) -> ()");
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(inflight_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("store_kv", &store_kv);
}
