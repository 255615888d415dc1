// The body of the quantized linear kernels (quant_gemm.cpp), included once per instruction set, each
// time inside its own namespace and `#pragma GCC target` region with QUANT_ISA set (2: AVX-512, 1: AVX2
// + FMA, 0: the baseline CPU), so that every function here, inlined into the next, is compiled for
// that set. No include guard: included three times on purpose.

// The primitives each instruction set writes with its own instructions: GCC 12 turns a generic
// u8 x 16 -> float x 16 conversion into one byte extract and one scalar conversion per lane (the kernel
// ran 10-30x slower than torch's float32 linear with it), and c10::Half's software conversion kept the
// scales on the stack.
//   half_at(p): the fp16 at p as a float.
//   emit(out, q, scale, offset): out[i] = scale * q[i] + offset for 16 bytes q (Q = vu8 or vi8). Every
//   scale * q here is exact in float32, so the FMA rounds as a multiply then an add would.
#if QUANT_ISA >= 1
INLINE float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}
#else
INLINE float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}
#endif

#if QUANT_ISA == 2
typedef vf16 VF;  // the multiply's vector: one zmm
template <typename Q>
INLINE void emit(float* out, Q q, float scale, float offset) {
  __m128i b;
  std::memcpy(&b, &q, 16);
  const __m512i wide = std::is_same_v<Q, vi8> ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(scale), _mm512_set1_ps(offset)));
}
#elif QUANT_ISA == 1
typedef vf8 VF;  // one ymm
template <typename Q>
INLINE void emit(float* out, Q q, float scale, float offset) {
  __m128i b;
  std::memcpy(&b, &q, 16);
  const __m128i b_hi = _mm_srli_si128(b, 8);
  constexpr bool sign = std::is_same_v<Q, vi8>;
  const __m256i lo = sign ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  const __m256i hi = sign ? _mm256_cvtepi8_epi32(b_hi) : _mm256_cvtepu8_epi32(b_hi);
  const __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
  _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), s, o));
  _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), s, o));
}
#else
typedef vf8 VF;  // what the baseline CPU makes of 8 floats (two xmm on x86-64)
template <typename Q>
INLINE void emit(float* out, Q q, float scale, float offset) {
  for (int i = 0; i < 16; ++i) out[i] = scale * static_cast<float>(q[i]) + offset;
}
#endif

// load_i8(p): VF's lane count of int8 values at p as floats, converted in registers (the per-channel
// int8 weights' decode path reads them straight into the multiply).
#if QUANT_ISA == 2
INLINE VF load_i8(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (VF)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
#elif QUANT_ISA == 1
INLINE VF load_i8(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (VF)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
#else
INLINE VF load_i8(const uint8_t* p) {
  VF v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(static_cast<int8_t>(p[i]));
  return v;
}
#endif

// load_f8(p): VF's lane count of fp8 e4m3 codes at p as their values times 2^-8 (callers fold 2^8 into the
// row's scale): each byte's sign, exponent and mantissa moved under an fp16's, which the hardware
// converts (F16C: subnormals included, no fp8 instructions needed; engine/quant/channel.py,
// decode_e4m3, writes the same in torch). Exact: every e4m3 value times 2^-8 is an fp16. The byte
// sign-extended to 16 bits and shifted left 7 puts its low 7 bits at 7..13 and its sign at 14 and 15;
// clearing bit 14 leaves the fp16.
#if QUANT_ISA == 2
INLINE VF load_f8(const uint8_t* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (VF)_mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(-0x4080)));
}
#elif QUANT_ISA == 1
INLINE VF load_f8(const uint8_t* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return (VF)_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(-0x4080)));
}
#else
INLINE VF load_f8(const uint8_t* p) {
  VF v;
  for (int i = 0; i < 8; ++i) {
    const auto bits = static_cast<uint16_t>(((p[i] & 0x7f) << 7) | ((p[i] & 0x80) << 8));
    v[i] = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  }
  return v;
}
#endif

// A per-channel code vector as floats: int8 values themselves, e4m3 values times 2^-8.
template <bool F8>
INLINE VF load_code(const uint8_t* p) {
  if constexpr (F8) {
    return load_f8(p);
  } else {
    return load_i8(p);
  }
}

// What a per-channel row's scale is multiplied by for load_code's values to be the weight's.
template <bool F8>
constexpr float code_unbias() {
  return F8 ? 256.f : 1.f;
}

// Each dequantizer writes one block's values to out[0 .. block size).

INLINE void dq_q8_0(const uint8_t* b, float* out) {
  const float d = half_at(b);
  for (int h = 0; h < 2; ++h) {
    vi8 q;
    std::memcpy(&q, b + 2 + 16 * h, 16);
    emit(out + 16 * h, q, d, 0.f);
  }
}

INLINE void dq_q4_0(const uint8_t* b, float* out) {
  const float d = half_at(b);
  const vu8 q = bytes16(b + 2);
  // d * (q - 8): exact in float32 either way.
  emit(out, (vi8)(q & 15) - 8, d, 0.f);
  emit(out + 16, (vi8)(q >> 4) - 8, d, 0.f);
}

INLINE void dq_q4_1(const uint8_t* b, float* out) {
  const float d = half_at(b), m = half_at(b + 2);
  const vu8 q = bytes16(b + 4);
  emit(out, (vu8)(q & 15), d, m);
  emit(out + 16, (vu8)(q >> 4), d, m);
}

// Q5_0 (MIN false: d * (q - 16)) and Q5_1 (true: d * q + m): Q4_0/Q4_1's nibbles, each with its fifth
// bit from qh (fifth_bits in quant_gemm.cpp). qh follows the fp16 field(s), qs the 4 qh bytes.
template <bool MIN>
INLINE void dq_q5(const uint8_t* b, float* out) {
  const float d = half_at(b);
  const uint8_t* qh = b + (MIN ? 4 : 2);
  const vu8 q = bytes16(qh + 4);
  vu8 lo, hi;
  fifth_bits(qh, lo, hi);
  if constexpr (MIN) {
    const float m = half_at(b + 2);
    emit(out, (vu8)((q & 15) | lo), d, m);
    emit(out + 16, (vu8)((q >> 4) | hi), d, m);
  } else {
    // d * (q - 16): exact in float32, as Q4_0's.
    emit(out, (vi8)((q & 15) | lo) - 16, d, 0.f);
    emit(out + 16, (vi8)((q >> 4) | hi) - 16, d, 0.f);
  }
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
        emit(out + 32 * sub + 16 * h, v, scale, -offset);
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
        emit(out + 128 * h + 32 * p + 16 * g, (vi8)(low | (high << 4)) - 32, scale, 0.f);
      }
    }
  }
}

// A per-channel row (not a block format), int8 or e4m3 codes: x[i] = scale * q[i], k a multiple of 16,
// round(q * scale) in float32 as the dequantized float weight holds it (for e4m3: (q * 2^-8) * (scale *
// 2^8), both factors exact, so the same single rounding).
template <bool F8>
INLINE void dq_channel(const uint8_t* row, int64_t k, float scale, float* out) {
  if constexpr (F8) {
    const VF s = VF{} + scale * code_unbias<true>();
    for (int64_t i = 0; i < k; i += sizeof(VF) / sizeof(float)) {
      const VF v = load_f8(row + i) * s;
      std::memcpy(out + i, &v, sizeof(VF));
    }
  } else {
    for (int64_t i = 0; i < k; i += 16) {
      vi8 q;
      std::memcpy(&q, row + i, 16);
      emit(out + i, q, scale, 0.f);
    }
  }
}

template <int64_t FMT>
INLINE void dq_row_as(const uint8_t* row, int64_t num_blocks, float* out) {
  constexpr int64_t bytes = block_bytes(FMT);
  constexpr int64_t values = block_size(FMT);
  for (int64_t i = 0; i < num_blocks; ++i) {
    const uint8_t* b = row + i * bytes;
    float* o = out + i * values;
    if constexpr (FMT == kQ8_0) dq_q8_0(b, o);
    if constexpr (FMT == kQ4_0) dq_q4_0(b, o);
    if constexpr (FMT == kQ4_1) dq_q4_1(b, o);
    if constexpr (FMT == kQ5_0) dq_q5<false>(b, o);
    if constexpr (FMT == kQ5_1) dq_q5<true>(b, o);
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
    case kQ5_0: dq_row_as<kQ5_0>(row, n, out); break;
    case kQ5_1: dq_row_as<kQ5_1>(row, n, out); break;
    case kQ4_K: dq_row_as<kQ4_K>(row, n, out); break;
    case kQ5_K: dq_row_as<kQ5_K>(row, n, out); break;
    default: dq_row_as<kQ6_K>(row, n, out); break;
  }
}

INLINE VF load_vf(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof(VF));
  return v;
}

INLINE float hsum(VF v) {
  float lanes[sizeof(VF) / sizeof(float)];
  std::memcpy(lanes, &v, sizeof(VF));
  float s = 0.f;
  for (float lane : lanes) s += lane;
  return s;
}

// out[r .. r + MR, col .. col + rows) = x[r .. r + MR] @ tile.T, tile = kTileRows (4) dequantized rows of
// k. The accumulators are named, not an array: GCC kept an array of them on the stack.
template <int MR>
INLINE void multiply_tile(const Job& job, const float* tile, int64_t r, int64_t col, int64_t rows) {
  const int64_t k = job.k;
  const float* x0 = job.x + r * job.ldx;
  const float* x1 = x0 + (MR == 2 ? job.ldx : 0);
  VF a0{}, a1{}, a2{}, a3{}, b0{}, b1{}, b2{}, b3{};  // row r (a) and r + 1 (b) times the 4 weight rows
  for (int64_t i = 0; i < k; i += sizeof(VF) / sizeof(float)) {
    const VF w0 = load_vf(tile + i), w1 = load_vf(tile + k + i), w2 = load_vf(tile + 2 * k + i),
             w3 = load_vf(tile + 3 * k + i);
    const VF xa = load_vf(x0 + i);
    a0 += xa * w0;
    a1 += xa * w1;
    a2 += xa * w2;
    a3 += xa * w3;
    if constexpr (MR == 2) {
      const VF xb = load_vf(x1 + i);
      b0 += xb * w0;
      b1 += xb * w1;
      b2 += xb * w2;
      b3 += xb * w3;
    }
  }
  const float sums[2][4] = {{hsum(a0), hsum(a1), hsum(a2), hsum(a3)}, {hsum(b0), hsum(b1), hsum(b2), hsum(b3)}};
  store_tile(job.out, job.n, job.bias, sums, MR, r, col, rows);
}

// Per-channel int8 or e4m3 weights times one or two rows of x (a decode step): each weight vector
// converted in registers and multiplied at once, no tile buffer; the row's scale multiplies its sum at
// the end. Rows past the last (rows < 4) read the tile's first row again and are not stored.
template <int MR, bool F8>
INLINE void multiply_channel_direct(const Job& job, int64_t r, int64_t col, int64_t rows) {
  const int64_t k = job.k;
  const float* x0 = job.x + r * job.ldx;
  const float* x1 = x0 + (MR == 2 ? job.ldx : 0);
  const auto [w0, w1, w2, w3] = tile_rows(job.w, job.row_bytes, col, rows);
  VF a0{}, a1{}, a2{}, a3{}, b0{}, b1{}, b2{}, b3{};
  for (int64_t i = 0; i < k; i += sizeof(VF) / sizeof(float)) {
    const VF q0 = load_code<F8>(w0 + i), q1 = load_code<F8>(w1 + i), q2 = load_code<F8>(w2 + i),
             q3 = load_code<F8>(w3 + i);
    const VF xa = load_vf(x0 + i);
    a0 += xa * q0;
    a1 += xa * q1;
    a2 += xa * q2;
    a3 += xa * q3;
    if constexpr (MR == 2) {
      const VF xb = load_vf(x1 + i);
      b0 += xb * q0;
      b1 += xb * q1;
      b2 += xb * q2;
      b3 += xb * q3;
    }
  }
  const float sums[2][4] = {{hsum(a0), hsum(a1), hsum(a2), hsum(a3)}, {hsum(b0), hsum(b1), hsum(b2), hsum(b3)}};
  for (int mm = 0; mm < MR; ++mm) {
    for (int64_t j = 0; j < rows; ++j) {
      const float bias = job.bias != nullptr ? job.bias[col + j] : 0.f;
      job.out[(r + mm) * job.n + col + j] = sums[mm][j] * (job.scales[col + j] * code_unbias<F8>()) + bias;
    }
  }
}

#if QUANT_ISA == 2
// The blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) times one or two rows of x (a decode step) with each
// block's 32 values made in two registers (emit's arithmetic, so the same floats) and multiplied at
// once: no tile of dequantized rows written and read back. Summed in the tile path's order (lane l over values l, l + 16, l + 32, ...).
template <typename Q>
INLINE __m512 widen(Q q, float scale, float offset) {
  __m128i b;
  std::memcpy(&b, &q, 16);
  const __m512i wide = std::is_same_v<Q, vi8> ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(scale), _mm512_set1_ps(offset));
}

template <int64_t FMT>
INLINE void block_values(const uint8_t* b, __m512& lo, __m512& hi) {
  const float d = half_at(b);
  if constexpr (FMT == kQ8_0) {
    vi8 q0, q1;
    std::memcpy(&q0, b + 2, 16);
    std::memcpy(&q1, b + 18, 16);
    lo = widen(q0, d, 0.f);
    hi = widen(q1, d, 0.f);
  } else {
    // Q4_0, Q4_1, Q5_0, Q5_1: a block's 16 (or 32) possible values made once, d * (i - offset) + m by
    // emit's arithmetic, and each lane's value looked up by its quant (vpermps; Q5's fifth bit picks
    // the second table, vpermt2ps): one lookup per 16 values where the conversion took three.
    constexpr bool kFive = FMT == kQ5_0 || FMT == kQ5_1;
    constexpr bool kMin = FMT == kQ4_1 || FMT == kQ5_1;
    constexpr float kOffset = FMT == kQ4_0 ? 8.f : FMT == kQ5_0 ? 16.f : 0.f;
    const float m = kMin ? half_at(b + 2) : 0.f;
    const uint8_t* qs = b + 2 + (kMin ? 2 : 0) + (kFive ? 4 : 0);
    const vu8 q = bytes16(qs);
    const vu8 q_lo = q & 15, q_hi = q >> 4;
    __m128i nib_lo, nib_hi;
    std::memcpy(&nib_lo, &q_lo, 16);
    std::memcpy(&nib_hi, &q_hi, 16);
    __m512i idx_lo = _mm512_cvtepu8_epi32(nib_lo), idx_hi = _mm512_cvtepu8_epi32(nib_hi);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 scale = _mm512_set1_ps(d), min = _mm512_set1_ps(m);
    const __m512 low = _mm512_fmadd_ps(_mm512_sub_ps(iota, _mm512_set1_ps(kOffset)), scale, min);
    if constexpr (kFive) {
      uint32_t bits;
      std::memcpy(&bits, b + 2 + (kMin ? 2 : 0), 4);
      const __m512i sixteen = _mm512_set1_epi32(16);
      idx_lo = _mm512_or_si512(idx_lo, _mm512_maskz_mov_epi32(static_cast<__mmask16>(bits & 0xFFFF), sixteen));
      idx_hi = _mm512_or_si512(idx_hi, _mm512_maskz_mov_epi32(static_cast<__mmask16>(bits >> 16), sixteen));
      const __m512 high =
          _mm512_fmadd_ps(_mm512_sub_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.f)), _mm512_set1_ps(kOffset)), scale, min);
      lo = _mm512_permutex2var_ps(low, idx_lo, high);
      hi = _mm512_permutex2var_ps(low, idx_hi, high);
    } else {
      lo = _mm512_permutexvar_ps(idx_lo, low);
      hi = _mm512_permutexvar_ps(idx_hi, low);
    }
  }
}

template <int64_t FMT, int MR>
INLINE void multiply_blocks_direct(const Job& job, int64_t r, int64_t col, int64_t rows) {
  constexpr int64_t bytes = block_bytes(FMT);
  const int64_t nb = job.k / 32;
  const float* x0 = job.x + r * job.ldx;
  const float* x1 = x0 + (MR == 2 ? job.ldx : 0);
  const auto [w0, w1, w2, w3] = tile_rows(job.w, job.row_bytes, col, rows);
  const NextTile prefetch = next_tile(w0, job.row_bytes, nb);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int64_t i = 0; i < nb; ++i) {
    prefetch.fetch(i);
    __m512 l0, h0, l1, h1, l2, h2, l3, h3;
    block_values<FMT>(w0 + i * bytes, l0, h0);
    block_values<FMT>(w1 + i * bytes, l1, h1);
    block_values<FMT>(w2 + i * bytes, l2, h2);
    block_values<FMT>(w3 + i * bytes, l3, h3);
    const __m512 xl = _mm512_loadu_ps(x0 + 32 * i), xh = _mm512_loadu_ps(x0 + 32 * i + 16);
    a0 = _mm512_fmadd_ps(xh, h0, _mm512_fmadd_ps(xl, l0, a0));
    a1 = _mm512_fmadd_ps(xh, h1, _mm512_fmadd_ps(xl, l1, a1));
    a2 = _mm512_fmadd_ps(xh, h2, _mm512_fmadd_ps(xl, l2, a2));
    a3 = _mm512_fmadd_ps(xh, h3, _mm512_fmadd_ps(xl, l3, a3));
    if constexpr (MR == 2) {
      const __m512 yl = _mm512_loadu_ps(x1 + 32 * i), yh = _mm512_loadu_ps(x1 + 32 * i + 16);
      b0 = _mm512_fmadd_ps(yh, h0, _mm512_fmadd_ps(yl, l0, b0));
      b1 = _mm512_fmadd_ps(yh, h1, _mm512_fmadd_ps(yl, l1, b1));
      b2 = _mm512_fmadd_ps(yh, h2, _mm512_fmadd_ps(yl, l2, b2));
      b3 = _mm512_fmadd_ps(yh, h3, _mm512_fmadd_ps(yl, l3, b3));
    }
  }
  const float sums[2][4] = {{hsum((VF)a0), hsum((VF)a1), hsum((VF)a2), hsum((VF)a3)},
                            {hsum((VF)b0), hsum((VF)b1), hsum((VF)b2), hsum((VF)b3)}};
  store_tile(job.out, job.n, job.bias, sums, MR, r, col, rows);
}

template <int64_t FMT>
INLINE void blocks_direct_tiles(const Job& job, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t col = t * kTileRows, rows = std::min<int64_t>(kTileRows, job.n - col);
    if (job.m == 2) {
      multiply_blocks_direct<FMT, 2>(job, 0, col, rows);
    } else {
      multiply_blocks_direct<FMT, 1>(job, 0, col, rows);
    }
  }
}

// Whether run_tiles took the job: one or two rows on a format of 32-value blocks.
INLINE bool blocks_direct(const Job& job, int64_t t0, int64_t t1) {
  if (job.m > 2) return false;
  switch (job.fmt) {
    case kQ8_0: blocks_direct_tiles<kQ8_0>(job, t0, t1); return true;
    case kQ4_0: blocks_direct_tiles<kQ4_0>(job, t0, t1); return true;
    case kQ4_1: blocks_direct_tiles<kQ4_1>(job, t0, t1); return true;
    case kQ5_0: blocks_direct_tiles<kQ5_0>(job, t0, t1); return true;
    case kQ5_1: blocks_direct_tiles<kQ5_1>(job, t0, t1); return true;
    default: return false;
  }
}
#endif

// One or two rows of x times per-channel weights (a decode step), tile by tile, from registers.
template <bool F8>
INLINE void channel_direct_tiles(const Job& job, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t col = t * kTileRows, rows = std::min<int64_t>(kTileRows, job.n - col);
    if (job.m == 2) {
      multiply_channel_direct<2, F8>(job, 0, col, rows);
    } else {
      multiply_channel_direct<1, F8>(job, 0, col, rows);
    }
  }
}

INLINE void dq_any_row(const Job& job, int64_t row, float* out) {
  const uint8_t* w = job.w + row * job.row_bytes;
  if (job.fmt == kW8) {
    dq_channel<false>(w, job.k, job.scales[row], out);
  } else if (job.fmt == kF8) {
    dq_channel<true>(w, job.k, job.scales[row], out);
  } else {
    dq_row(job.fmt, w, job.k, out);
  }
}

INLINE void run_tiles(const Job& job, int64_t t0, int64_t t1) {
  if ((job.fmt == kW8 || job.fmt == kF8) && job.m <= 2) {
    job.fmt == kF8 ? channel_direct_tiles<true>(job, t0, t1) : channel_direct_tiles<false>(job, t0, t1);
    return;
  }
#if QUANT_ISA == 2
  if (blocks_direct(job, t0, t1)) return;
#endif
  std::vector<float> tile(kTileRows * job.k);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t col = t * kTileRows, rows = std::min<int64_t>(kTileRows, job.n - col);
    // The next tile's bytes requested before this one is multiplied: a decode step streams every weight
    // from memory once, and the multiply hides the fetch.
    const uint8_t* next = job.w + (col + kTileRows) * job.row_bytes;
    if (t + 1 < t1) {
      for (int64_t o = 0; o < kTileRows * job.row_bytes; o += 64) __builtin_prefetch(next + o);
    }
    for (int64_t j = 0; j < rows; ++j) dq_any_row(job, col + j, tile.data() + j * job.k);
    if (rows < kTileRows) std::fill(tile.begin() + rows * job.k, tile.end(), 0.f);  // the last tile's gap
    int64_t r = 0;
    for (; r + 2 <= job.m; r += 2) multiply_tile<2>(job, tile.data(), r, col, rows);
    if (r < job.m) multiply_tile<1>(job, tile.data(), r, col, rows);
  }
}


// Entry points: out features' tiles [t0, t1) of a multiply; row r of the weight dequantized into out[0, k).
inline void tiles(const Job& job, int64_t t0, int64_t t1) { run_tiles(job, t0, t1); }
inline void row_to(const Job& job, int64_t r, float* out) { dq_any_row(job, r, out); }
