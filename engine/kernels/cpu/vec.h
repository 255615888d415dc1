// Vector helpers shared by the CPU kernels: 16 floats per vector (GCC vector extensions), bf16
// widening and rounding, exp. Compiled into each kernel's target clones (AVX-512, AVX2, baseline).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && !defined(INFLIGHT_NO_CLONES)
#define INFLIGHT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define INFLIGHT_CLONES
#endif

namespace inflight_cpu {

constexpr int kLanes = 16;

// The two dtypes the CPU kernels take (each op checks its inputs first): f gets a value of the type.
template <typename F>
void dispatch(at::ScalarType dtype, F&& f) {
  if (dtype == at::kBFloat16) {
    f(at::BFloat16{});
  } else {
    f(float{});
  }
}

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t vu16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vu32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));

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

typedef int32_t vi32 __attribute__((vector_size(kLanes * sizeof(int32_t))));

// float -> bf16 rounding to nearest even, as torch rounds (NaN stays NaN).
__attribute__((always_inline)) inline void store16(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
__attribute__((always_inline)) inline void store16(at::BFloat16* p, vfloat v) {
  vu32 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vu32 rounded = (bits + (((bits >> 16) & 1u) + 0x7fffu)) >> 16;
  const vu32 nan = (bits >> 16) | 0x40u;  // quiet NaN, as torch's conversion produces
  const vu32 out = v != v ? nan : rounded;
  const vu16 h = __builtin_convertvector(out, vu16);
  std::memcpy(p, &h, sizeof(h));
}

// v rounded to T's precision and widened back, in registers: the rounding a store to T and a load
// back would do (bf16: to nearest even, NaN stays NaN; float: nothing).
__attribute__((always_inline)) inline vfloat round_to(float, vfloat v) { return v; }
__attribute__((always_inline)) inline vfloat round_to(at::BFloat16, vfloat v) {
  vu32 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vu32 rounded = (bits + (((bits >> 16) & 1u) + 0x7fffu)) & 0xffff0000u;
  const vu32 nan = (bits | 0x400000u) & 0xffff0000u;
  const vu32 out = v != v ? nan : rounded;
  vfloat r;
  std::memcpy(&r, &out, sizeof(r));
  return r;
}

// 32 bf16 values as two float vectors, without load16's widening (whose 16-to-32-bit conversion costs
// cross-lane shuffles on every vector): a 32-bit word holds two bf16 values, so its low half shifted up is
// the even-indexed value and its high half masked is the odd one. Elementwise work whose inputs and output
// all take this order needs no reordering; store32_split rounds as store16 does, bit for bit.
__attribute__((always_inline)) inline void load32_split(const at::BFloat16* p, vfloat& even, vfloat& odd) {
  vu32 w;
  std::memcpy(&w, p, sizeof(w));
  const vu32 e = w << 16, o = w & 0xffff0000u;
  std::memcpy(&even, &e, sizeof(even));
  std::memcpy(&odd, &o, sizeof(odd));
}
__attribute__((always_inline)) inline void store32_split(at::BFloat16* p, vfloat even, vfloat odd) {
  const vfloat re = round_to(at::BFloat16{}, even), ro = round_to(at::BFloat16{}, odd);
  vu32 e, o;
  std::memcpy(&e, &re, sizeof(e));
  std::memcpy(&o, &ro, sizeof(o));
  const vu32 w = (e >> 16) | o;
  std::memcpy(p, &w, sizeof(w));
}

// exp, to about 2 ulp, for x <= 88 (larger x would overflow; callers stay below): 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2 / 2, p a degree-6 Taylor polynomial; below -87 the result flushes to 0.
__attribute__((always_inline)) inline vfloat vexp(vfloat x) {
  const vfloat lo = x < -87.f ? vfloat{} + 1.f : vfloat{};
  x = x < -87.f ? vfloat{} - 87.f : x;
  const vfloat n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + (x < 0.f ? -0.5f : 0.5f), vi32), vfloat);
  const vfloat r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  vfloat p = vfloat{} + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const vi32 bits = (__builtin_convertvector(n, vi32) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const vfloat result = p * scale;
  return lo != 0.f ? vfloat{} : result;
}

}  // namespace inflight_cpu
