// The Llama layer's pointwise ops, fused, for the CPU engine: RMSNorm (with the residual add),
// rotary embedding in place, SiLU-and-mul. A decode step at 64 sequences runs each of these over a
// few tens of thousands of elements, where torch's cost is per op (dispatch, temporaries, a float32
// copy), not per element: one pass each instead of five to fifteen ops.
//
// Rounding follows HF (and engine/kernels/reference.py) op by op: RMSNorm normalises in float32,
// rounds to the model dtype, then multiplies by the weight and rounds; the residual sum is rounded
// before the norm; rotary computes in float32 and rounds once; SiLU rounds before the multiply.
// Multiply-adds are not contracted into FMAs (fp-contract=off for this file), so float32 results
// equal torch's op-by-op results except for the order of the norm's sum of squares.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

// Separate multiplies and adds, as torch's op-by-op results round them (set before vec.h, whose
// helpers are inlined here).
#pragma GCC optimize("fp-contract=off")

#include "argmax.h"
#include "vec.h"

namespace {

using namespace inflight_cpu;

constexpr int64_t kRowGrain = 8;  // rows per parallel chunk: small steps stay on one thread

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, n] with contiguous rows");
}

// dst[i] = f(a[i], b[i]) over the whole vectors of n (a multiple of 16; the caller does the rest). bf16
// goes two values a 32-bit word (load32_split) as far as it can: no cross-lane widening, the same bits.
template <typename T, typename F>
__attribute__((always_inline)) inline void map2(T* dst, const T* a, const T* b, int64_t n, F f) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
      vfloat ae, ao, be, bo;
      load32_split(a + i, ae, ao);
      load32_split(b + i, be, bo);
      store32_split(dst + i, f(ae, be), f(ao, bo));
    }
  }
  for (; i + kLanes <= n; i += kLanes) store16(dst + i, f(load16(a + i), load16(b + i)));
}

// out[r] = weight * round(x[r] / rms(x[r])); with a residual: residual[r] = round(x[r] + residual[r])
// first, and the norm is of the new residual.
template <typename T>
INFLIGHT_CLONES void norm_rows(T* out, int64_t out_stride, const T* x, int64_t x_stride, T* residual,
                               int64_t res_stride, const T* weight, int64_t n, float eps, int64_t r0, int64_t r1) {
  const int64_t nv = n / kLanes * kLanes;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * x_stride;
    T* o = out + r * out_stride;
    const T* src = xr;
    if (residual != nullptr) {
      T* res = residual + r * res_stride;
      map2(res, xr, res, n, [](vfloat a, vfloat b) __attribute__((always_inline)) { return a + b; });
      for (int64_t i = nv; i < n; ++i) res[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(res[i]));
      src = res;
    }
    vfloat acc{};
    for (int64_t i = 0; i < nv; i += kLanes) {
      const vfloat v = load16(src + i);
      acc += v * v;
    }
    float sq = 0.f;
    for (int j = 0; j < kLanes; ++j) sq += acc[j];
    for (int64_t i = nv; i < n; ++i) sq += static_cast<float>(src[i]) * static_cast<float>(src[i]);
    const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + eps);
    // Round the normalised value to T (a no-op for float), then scale by the weight and round.
    map2(o, src, weight, n,
         [inv](vfloat v, vfloat w) __attribute__((always_inline)) { return round_to(T{}, v * inv) * w; });
    for (int64_t i = nv; i < n; ++i) {
      const T normed = static_cast<T>(static_cast<float>(src[i]) * inv);
      o[i] = static_cast<T>(static_cast<float>(normed) * static_cast<float>(weight[i]));
    }
  }
}

void rms_norm(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
              double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "x, out and weight must share a dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [n], contiguous");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must have x's shape");
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
  }
  const int64_t rows = x.size(0), n = x.size(1);
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T* res = residual.has_value() ? residual->data_ptr<T>() : nullptr;
    const int64_t res_stride = residual.has_value() ? residual->stride(0) : 0;
    at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
      norm_rows<T>(out.data_ptr<T>(), out.stride(0), x.data_ptr<T>(), x.stride(0), res, res_stride,
                   weight.data_ptr<T>(), n, static_cast<float>(eps), r0, r1);
    });
  });
}

// NeoX / HF rotate_half: dimension i < D/2 pairs with i + D/2. cos in cache[pos, :D/2], sin in
// cache[pos, D/2:]. heads: [T, H, D] with any token and head strides.
template <typename T>
INFLIGHT_CLONES void rotate_rows(T* x, int64_t stride_t, int64_t stride_h, int64_t num_heads, int64_t head_size,
                                 const int64_t* positions, const float* cache, int64_t t0, int64_t t1) {
  const int64_t half = head_size / 2;
  const int64_t hv = half / kLanes * kLanes;
  for (int64_t t = t0; t < t1; ++t) {
    const float* cos = cache + positions[t] * head_size;
    const float* sin = cos + half;
    for (int64_t h = 0; h < num_heads; ++h) {
      T* a = x + t * stride_t + h * stride_h;
      T* b = a + half;
      for (int64_t i = 0; i < hv; i += kLanes) {
        const vfloat x1 = load16(a + i), x2 = load16(b + i), c = load16(cos + i), s = load16(sin + i);
        store16(a + i, x1 * c - x2 * s);
        store16(b + i, x2 * c + x1 * s);
      }
      for (int64_t i = hv; i < half; ++i) {
        const float x1 = static_cast<float>(a[i]), x2 = static_cast<float>(b[i]);
        a[i] = static_cast<T>(x1 * cos[i] - x2 * sin[i]);
        b[i] = static_cast<T>(x2 * cos[i] + x1 * sin[i]);
      }
    }
  }
}

void rotary(at::Tensor query, at::Tensor key, const at::Tensor& positions, const at::Tensor& cache) {
  for (const at::Tensor* t : {&query, &key}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1, "query and key must be [T, H, D] with contiguous heads");
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  }
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key must share a dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.is_contiguous() && cache.size(1) == query.size(2),
              "cache must be [max_pos, D] float32");
  TORCH_CHECK(query.size(2) % 2 == 0, "head size must be even");
  const int64_t tokens = positions.size(0);
  TORCH_CHECK(query.size(0) == tokens && key.size(0) == tokens, "one position per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cache.size(0), "position ", pos[t], " is outside the rotary cache");
  }
  dispatch(query.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, tokens, kRowGrain, [&](int64_t t0, int64_t t1) {
      rotate_rows<T>(query.data_ptr<T>(), query.stride(0), query.stride(1), query.size(1), query.size(2), pos,
                     cache.data_ptr<float>(), t0, t1);
      rotate_rows<T>(key.data_ptr<T>(), key.stride(0), key.stride(1), key.size(1), key.size(2), pos,
                     cache.data_ptr<float>(), t0, t1);
    });
  });
}

__attribute__((always_inline)) inline vfloat silu(vfloat g) {
  const vfloat neg = -g;
  // exp(-g) overflows float past 88.7: clamp, the quotient is -0 either way.
  const vfloat e = vexp(neg > 88.f ? vfloat{} + 88.f : neg);
  return g / (1.f + e);
}

// out[r] = round(silu(gate)) * up, gate = x[r, :I], up = x[r, I:]; silu(g) = g / (1 + exp(-g)).
template <typename T>
INFLIGHT_CLONES void silu_rows(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t inter, int64_t r0,
                               int64_t r1) {
  const int64_t nv = inter / kLanes * kLanes;
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate = x + r * x_stride;
    const T* up = gate + inter;
    T* o = out + r * out_stride;
    // bf16 on map2's pair path (as rms_norm): [2048, 2 x 1536] on one thread of an AMX Xeon 2.55 ->
    // 2.07 ms against the 16-lane path (float32: 1.43, where the stream bounds it).
    // The lambda inlined, as every vector helper here: out of line (a target clone calling generic code
    // with 64-byte vectors) this one crashed the process.
    map2(o, gate, up, nv,
         [](vfloat g, vfloat u) __attribute__((always_inline)) { return round_to(T{}, silu(g)) * u; });
    for (int64_t i = nv; i < inter; ++i) {
      const float g = static_cast<float>(gate[i]);
      const T s = static_cast<T>(g / (1.f + std::exp(-g)));
      o[i] = static_cast<T>(static_cast<float>(s) * static_cast<float>(up[i]));
    }
  }
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "x and out must share a dtype");
  TORCH_CHECK(x.size(1) % 2 == 0 && out.size(1) == x.size(1) / 2 && out.size(0) == x.size(0),
              "x must be [T, 2I] and out [T, I]");
  const int64_t rows = x.size(0), inter = out.size(1);
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
      silu_rows<T>(out.data_ptr<T>(), out.stride(0), x.data_ptr<T>(), x.stride(0), inter, r0, r1);
    });
  });
}

}  // namespace

namespace inflight_cpu {

// torch.argmax's semantics (argmax.h). torch's CPU reduction runs at about 0.35 GB/s on [64, 49152]
// logits (9 ms a step); sixteen lanes with their own running maximum and index do it in a fraction of that.
INFLIGHT_CLONES int64_t first_argmax(const float* x, int64_t n) {
  // Pass 1: the maximum (and whether there is a NaN); pass 2: its first index, with an early exit.
  const int64_t nv = n / kLanes * kLanes;
  vfloat vmax = vfloat{} - std::numeric_limits<float>::infinity();
  vi32 nan{};
  for (int64_t i = 0; i < nv; i += kLanes) {
    const vfloat v = load16(x + i);
    vmax = v > vmax ? v : vmax;
    nan |= v != v;
  }
  float best = -std::numeric_limits<float>::infinity();
  bool any_nan = false;
  for (int j = 0; j < kLanes; ++j) {
    best = std::max(best, vmax[j]);
    any_nan |= nan[j] != 0;
  }
  for (int64_t i = nv; i < n; ++i) {
    best = std::max(best, x[i]);
    any_nan |= std::isnan(x[i]);
  }
  int64_t start = 0;  // sixteen at a time to the first vector that holds the answer
  for (; start < nv; start += kLanes) {
    const vfloat v = load16(x + start);
    const vi32 hit = any_nan ? (v != v) : (v == best);
    bool any = false;
    for (int j = 0; j < kLanes; ++j) any |= hit[j] != 0;
    if (any) break;
  }
  for (int64_t i = start; i < n; ++i) {
    if (any_nan ? std::isnan(x[i]) : x[i] == best) return i;
  }
  return 0;  // a row of -inf only: every element equals the maximum, the first is 0
}

}  // namespace inflight_cpu

namespace {

using namespace inflight_cpu;

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "x must be float32 on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0, "x must be [rows, n] with contiguous rows");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "rows longer than 2^31 are not supported");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = first_argmax(data + r * x.stride(0), n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def("rotary(Tensor(a!) query, Tensor(b!) key, Tensor positions, Tensor cache) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(inflight_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
}
