// The integer path of the block-format linear kernels (quant_gemm.cpp: quant_linear_int8), included once
// per instruction set like quant_gemm_isa.h, inside its own namespace and `#pragma GCC target` region,
// with QUANT_ISA set: 3 AVX-512 VNNI (256-bit vpdpbusd, AVX512VL), 1 AVX2 (vpmaddubsw + vpmaddwd; an
// AVX-512 host without VNNI runs this one too), 0 the baseline CPU (the same code in generic vectors).
// No include guard: included three times on purpose.
//
// What it computes. x's rows arrive quantized (quant_gemm.cpp: quantize_rows): blocks of 32 int8 values
// q_x with one float32 scale d_x each (symmetric, round to nearest even, d_x = amax / 127) and the
// block's sum times its scale, s_x = d_x * sum(q_x). Every weight format is read as 32-value sub-blocks:
// 32 small integers q_w, a scale vector (one float for all but Q6_K, whose two 16-value halves have a
// scale each) and, for the formats with a min (Q4_1, Q5_1, Q4_K, Q5_K), a float m with
//   sub-block . x_block = d_x * sum_lanes(scale * dot(q_w, q_x)) + m * s_x.
// dot gives 8 int32 lanes, lane l the sum over bytes 4l .. 4l + 3 (vpdpbusd's shape): exact integers,
// converted to float once per sub-block and multiplied by the scales in float32.
//
// Signed weights (Q8_0 without VNNI, Q6_K as q - 32): vpdpbusd / vpmaddubsw multiply unsigned by signed
// bytes, so |q_w| goes as the unsigned operand and q_x with q_w's sign as the signed one (vpsignb);
// |q_w| <= 128 and |q_x| <= 127 keep vpmaddubsw's 16-bit pair sums (<= 32512) from saturating. Unsigned
// ones (nibbles 0..15, Q5_1's and Q5_K's 0..31) go as they are, and so do the offset formats (kOffset).

typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef int8_t s8x32 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));

#if QUANT_ISA == 3
// The one instruction set whose namespace does not include quant_gemm_isa.h, where half_at lives.
INLINE float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}
#endif

INLINE u8x32 ld32(const void* p) {
  u8x32 v;
  std::memcpy(&v, p, 32);
  return v;
}

INLINE u8x32 join16(vu8 lo, vu8 hi) {
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                                 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

// dot_us(u, s): lane l = sum_{i < 4} u[4l + i] * s[4l + i], u unsigned, s signed. dot_ss: both signed.
#if QUANT_ISA == 3
INLINE i32x8 dot_us(u8x32 u, s8x32 s) {
  return (i32x8)_mm256_dpbusd_epi32(_mm256_setzero_si256(), (__m256i)u, (__m256i)s);
}
#elif QUANT_ISA >= 1
INLINE i32x8 dot_us(u8x32 u, s8x32 s) {
  return (i32x8)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)u, (__m256i)s), _mm256_set1_epi16(1));
}
#else
INLINE i32x8 dot_us(u8x32 u, s8x32 s) {
  i32x8 r{};
  for (int l = 0; l < 8; ++l) {
    for (int i = 0; i < 4; ++i) r[l] += static_cast<int32_t>(u[4 * l + i]) * static_cast<int32_t>(s[4 * l + i]);
  }
  return r;
}
#endif

#if QUANT_ISA >= 1
INLINE i32x8 dot_ss(s8x32 w, s8x32 x) {
  const __m256i wi = (__m256i)w;
  return dot_us((u8x32)_mm256_sign_epi8(wi, wi), (s8x32)_mm256_sign_epi8((__m256i)x, wi));
}
#else
INLINE i32x8 dot_ss(s8x32 w, s8x32 x) {
  i32x8 r{};
  for (int l = 0; l < 8; ++l) {
    for (int i = 0; i < 4; ++i) r[l] += static_cast<int32_t>(w[4 * l + i]) * static_cast<int32_t>(x[4 * l + i]);
  }
  return r;
}
#endif

// Sub-block j's 6-bit scale and min of a Q4_K/Q5_K block's 12 scale bytes (get_scale_min_k4).
INLINE void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Offset formats: Q4_0 (q - 8), Q5_0 (q - 16) and, with VNNI, Q8_0 (q + 128 - 128) go as unsigned q with
// a min of -offset * scale (the block's x sum does the rest: the min term above), which spares the two
// vpsignb of a signed dot. Q8_0's q + 128 reaches 255: vpdpbusd sums it exactly, but vpmaddubsw's 16-bit
// pair sums (255 * 127 * 2) would saturate, so without VNNI Q8_0 stays signed. Q6_K stays signed: its
// two scales per sub-block would need a sum of x per 16 values.
template <int64_t FMT>
constexpr int kOffset = FMT == kQ4_0 ? 8 : FMT == kQ5_0 ? 16 : (FMT == kQ8_0 && QUANT_ISA == 3) ? 128 : 0;
template <int64_t FMT>
constexpr bool kSigned = (FMT == kQ8_0 && kOffset<FMT> == 0) || FMT == kQ6_K;
template <int64_t FMT>
constexpr bool kHasMin = FMT == kQ4_1 || FMT == kQ5_1 || FMT == kQ4_K || FMT == kQ5_K || kOffset<FMT> != 0;

// Q5_0 / Q5_1's fifth bits as one 32-lane vector, 16 where bit i of the 4 qh bytes is set. With AVX-512
// BW and VL the 32 bits are a byte mask as they stand (one masked move); elsewhere fifth_bits' shuffles.
INLINE u8x32 fifth_bits32(const uint8_t* qh) {
#if QUANT_ISA == 3
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  return (u8x32)_mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(16));
#else
  vu8 lo, hi;
  fifth_bits(qh, lo, hi);  // quant_gemm.cpp
  return join16(lo, hi);
#endif
}

// Sub-block j (values 32j .. 32j + 32) of a weight row: its integers q (signed formats: int8 bits), its
// scale(s) and its min (see the top).
template <int64_t FMT>
INLINE void sub_block(const uint8_t* row, int64_t j, u8x32& q, f32x8& scale, float& min) {
  if constexpr (FMT == kQ8_0) {
    const uint8_t* b = row + block_bytes(FMT) * j;
    q = ld32(b + 2);
    const float d = half_at(b);
    scale = f32x8{} + d;
    if constexpr (kOffset<FMT> != 0) {
      q ^= 0x80;  // q + 128, as unsigned bytes
      min = -128.f * d;
    }
  } else if constexpr (FMT == kQ4_0 || FMT == kQ4_1) {
    const uint8_t* b = row + block_bytes(FMT) * j;
    const vu8 v = bytes16(b + (FMT == kQ4_0 ? 2 : 4));
    q = join16(v & 15, v >> 4);
    const float d = half_at(b);
    scale = f32x8{} + d;
    min = FMT == kQ4_1 ? half_at(b + 2) : -8.f * d;
  } else if constexpr (FMT == kQ5_0 || FMT == kQ5_1) {
    const uint8_t* b = row + block_bytes(FMT) * j;
    const uint8_t* qh = b + (FMT == kQ5_0 ? 2 : 4);
    const vu8 v = bytes16(qh + 4);
    q = join16(v & 15, v >> 4) | fifth_bits32(qh);
    const float d = half_at(b);
    scale = f32x8{} + d;
    min = FMT == kQ5_1 ? half_at(b + 2) : -16.f * d;
  } else if constexpr (FMT == kQ4_K || FMT == kQ5_K) {
    const uint8_t* b = row + block_bytes(FMT) * (j >> 3);
    const int s = static_cast<int>(j & 7);
    int sc, m;
    k_scale_min(b + 4, s, sc, m);
    const u8x32 packed = ld32(b + (FMT == kQ4_K ? 16 : 48) + 32 * (s >> 1));
    q = (s & 1) ? (packed >> 4) : (packed & 15);
    if constexpr (FMT == kQ5_K) q |= ((ld32(b + 16) >> s) & 1) << 4;
    scale = f32x8{} + half_at(b) * static_cast<float>(sc);
    min = -half_at(b + 2) * static_cast<float>(m);
  } else {  // Q6_K: values 128h + 32p + l (dq_q6_k in quant_gemm_isa.h)
    const uint8_t* b = row + block_bytes(FMT) * (j >> 3);
    const int h = static_cast<int>((j >> 2) & 1), p = static_cast<int>(j & 3);
    const u8x32 ql = ld32(b + 64 * h + 32 * (p & 1));
    const u8x32 low = (p >> 1) ? (ql >> 4) : (ql & 15);
    const u8x32 high = (ld32(b + 128 + 32 * h) >> (2 * p)) & 3;
    q = (low | (high << 4)) - 32;
    const float d = half_at(b + 208);
    const auto* scales = reinterpret_cast<const int8_t*>(b + 192 + 8 * h + 2 * p);
    const float s0 = d * static_cast<float>(scales[0]), s1 = d * static_cast<float>(scales[1]);
    scale = f32x8{s0, s0, s0, s0, s1, s1, s1, s1};
  }
}

template <int64_t FMT>
INLINE f32x8 sub_dot(u8x32 q, u8x32 xq) {
  i32x8 d;
  if constexpr (kSigned<FMT>) {
    d = dot_ss((s8x32)q, (s8x32)xq);
  } else {
    d = dot_us(q, (s8x32)xq);
  }
  return __builtin_convertvector(d, f32x8);
}

INLINE float hsum8(f32x8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// out[r .. r + MR, col .. col + rows) for kTileRows (4) weight rows; rows past the last read the tile's
// first row again and are not stored. Accumulators are named, as in multiply_tile.
template <int64_t FMT, int MR>
INLINE void int_tile(const IntJob& job, int64_t r, int64_t col, int64_t rows) {
  const int64_t nb = job.k / 32;
  const auto [w0, w1, w2, w3] = tile_rows(job.w, job.row_bytes, col, rows);
  const int8_t* xq0 = job.xq + r * job.k;
  const int8_t* xq1 = xq0 + (MR == 2 ? job.k : 0);
  const float* xd0 = job.xd + r * nb;
  const float* xd1 = xd0 + (MR == 2 ? nb : 0);
  const float* xs0 = job.xs + r * nb;
  const float* xs1 = xs0 + (MR == 2 ? nb : 0);
  const NextTile prefetch = next_tile(w0, job.row_bytes, nb);
  f32x8 a0{}, a1{}, a2{}, a3{}, b0{}, b1{}, b2{}, b3{};
  float ma0 = 0.f, ma1 = 0.f, ma2 = 0.f, ma3 = 0.f, mb0 = 0.f, mb1 = 0.f, mb2 = 0.f, mb3 = 0.f;
  // A K-quant's sub-blocks in an inner loop of constant length, unrolled: each sub-block's position in
  // its super-block is then a constant, and what the super-block shares (d, dmin, the scale bytes'
  // layout) is read once per super-block instead of once per sub-block.
  constexpr int64_t kInner = (FMT == kQ4_K || FMT == kQ5_K || FMT == kQ6_K) ? 8 : 1;
  for (int64_t jo = 0; jo < nb; jo += kInner) {
#pragma GCC unroll 8
  for (int64_t j = jo; j < jo + kInner; ++j) {
    prefetch.fetch(j);
    u8x32 q0, q1, q2, q3;
    f32x8 s0, s1, s2, s3;
    float m0 = 0.f, m1 = 0.f, m2 = 0.f, m3 = 0.f;
    sub_block<FMT>(w0, j, q0, s0, m0);
    sub_block<FMT>(w1, j, q1, s1, m1);
    sub_block<FMT>(w2, j, q2, s2, m2);
    sub_block<FMT>(w3, j, q3, s3, m3);
    const u8x32 xa = ld32(xq0 + 32 * j);
    const float da = xd0[j];
    a0 += sub_dot<FMT>(q0, xa) * (s0 * da);
    a1 += sub_dot<FMT>(q1, xa) * (s1 * da);
    a2 += sub_dot<FMT>(q2, xa) * (s2 * da);
    a3 += sub_dot<FMT>(q3, xa) * (s3 * da);
    if constexpr (kHasMin<FMT>) {
      const float sa = xs0[j];
      ma0 += m0 * sa;
      ma1 += m1 * sa;
      ma2 += m2 * sa;
      ma3 += m3 * sa;
    }
    if constexpr (MR == 2) {
      const u8x32 xb = ld32(xq1 + 32 * j);
      const float db = xd1[j];
      b0 += sub_dot<FMT>(q0, xb) * (s0 * db);
      b1 += sub_dot<FMT>(q1, xb) * (s1 * db);
      b2 += sub_dot<FMT>(q2, xb) * (s2 * db);
      b3 += sub_dot<FMT>(q3, xb) * (s3 * db);
      if constexpr (kHasMin<FMT>) {
        const float sb = xs1[j];
        mb0 += m0 * sb;
        mb1 += m1 * sb;
        mb2 += m2 * sb;
        mb3 += m3 * sb;
      }
    }
  }
  }
  const float sums[2][4] = {{hsum8(a0) + ma0, hsum8(a1) + ma1, hsum8(a2) + ma2, hsum8(a3) + ma3},
                            {hsum8(b0) + mb0, hsum8(b1) + mb1, hsum8(b2) + mb2, hsum8(b3) + mb3}};
  store_tile(job.out, job.n, job.bias, sums, MR, r, col, rows);
}

template <int64_t FMT>
INLINE void int_tiles_as(const IntJob& job, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t col = t * kTileRows, rows = std::min<int64_t>(kTileRows, job.n - col);
    int64_t r = 0;
    for (; r + 2 <= job.m; r += 2) int_tile<FMT, 2>(job, r, col, rows);
    if (r < job.m) int_tile<FMT, 1>(job, r, col, rows);
  }
}

// Entry point: out features' tiles [t0, t1) of an integer-path multiply.
inline void int_tiles(const IntJob& job, int64_t t0, int64_t t1) {
  switch (job.fmt) {
    case kQ8_0: int_tiles_as<kQ8_0>(job, t0, t1); break;
    case kQ4_0: int_tiles_as<kQ4_0>(job, t0, t1); break;
    case kQ4_1: int_tiles_as<kQ4_1>(job, t0, t1); break;
    case kQ5_0: int_tiles_as<kQ5_0>(job, t0, t1); break;
    case kQ5_1: int_tiles_as<kQ5_1>(job, t0, t1); break;
    case kQ4_K: int_tiles_as<kQ4_K>(job, t0, t1); break;
    case kQ5_K: int_tiles_as<kQ5_K>(job, t0, t1); break;
    default: int_tiles_as<kQ6_K>(job, t0, t1); break;
  }
}
