// The 8-bit cache's attention rows (engine/kernels/cpu/kv_quant.cpp), compiled twice by that file: once
// under AVX-512 (KVQ_AVX512 1: codes widened by VPMOVSXBD / VPMOVZXBD) and once for any x86-64 host
// (target clones; codes widened by a loop the compiler vectorizes). GCC 12 turns __builtin_convertvector
// from 16 bytes to 16 ints into one scalar move per lane, which cost more than the key's multiply-adds.
// Included inside a namespace; needs vfloat, Geometry, Pages, Scratch, RowsFn, hsum, row_scale.

// 16 codes of a row as the values they stand for before the row's scale (which callers apply once per
// key to a sum, not per code).
#if KVQ_AVX512
template <bool FP8>
__attribute__((always_inline)) inline vfloat decode16(const uint8_t* p) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (!FP8) {
    return (vfloat)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
  } else {
    // An e4m3 byte's exponent and mantissa bits in float32's fields are its value times 2^-120.
    const __m512i w = _mm512_cvtepu8_epi32(c);
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x7f)), 20),
                                         _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x80)), 24));
    return (vfloat)_mm512_castsi512_ps(bits) * 0x1p120f;
  }
}
#else
template <bool FP8>
__attribute__((always_inline)) inline vfloat decode16(const uint8_t* p) {
  if constexpr (!FP8) {
    int32_t w[kLanes];
    for (int i = 0; i < kLanes; ++i) w[i] = static_cast<int8_t>(p[i]);
    vi32 c;
    std::memcpy(&c, w, sizeof(c));
    return __builtin_convertvector(c, vfloat);
  } else {
    // An e4m3 byte's exponent and mantissa bits in float32's fields are its value times 2^-120.
    uint32_t bits[kLanes];
    for (int i = 0; i < kLanes; ++i) bits[i] = ((p[i] & 0x7fu) << 20) | ((p[i] & 0x80u) << 24);
    vfloat f;
    std::memcpy(&f, bits, sizeof(f));
    return f * 0x1p120f;
  }
}

#endif

// Calls f(t, row) for keys lo..hi-1 in order, one block's run of rows at a time.
template <typename F>
__attribute__((always_inline)) inline void for_each_row(const Pages& p, int64_t lo, int64_t hi, F&& f) {
  for (int64_t t0 = lo; t0 < hi;) {
    const int64_t t1 = std::min(hi, (t0 | p.mask) + 1);
    const uint8_t* row = p.row(t0);
    for (int64_t t = t0; t < t1; ++t, row += p.row_bytes) f(t, row);
    t0 = t1;
  }
}

// Raw scores (q . k, q pre-scaled) of NR rows against keys [lo, hi): each key's codes decoded once into
// C registers for the NR rows, whose queries stay in registers too. scores[r * n + t - lo].
template <int C, int NR, bool FP8>
__attribute__((always_inline)) inline void score_rows(const float* q, const Pages& k, int64_t lo, int64_t hi,
                                                      float* scores, int64_t n) {
  constexpr int64_t D = C * kLanes;
  vfloat qv[NR][C];
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < C; ++c) qv[r][c] = load16(q + r * D + c * kLanes);
  }
  for_each_row(k, lo, hi, [&](int64_t t, const uint8_t* row) __attribute__((always_inline)) {
    // The scale applies to the whole dot: q . (codes * s) = s * (q . codes).
    vfloat acc[NR] = {};
    for (int c = 0; c < C; ++c) {
      const vfloat kv = decode16<FP8>(row + c * kLanes);
      for (int r = 0; r < NR; ++r) acc[r] += qv[r][c] * kv;
    }
    const float s = row_scale(row, D);
    for (int r = 0; r < NR; ++r) scores[r * n + (t - lo)] = hsum(acc[r]) * s;
  });
}

// out rows = sum over keys of p * v for NR rows (p: the rows' softmax numerators, scores[r * n + ...]),
// each key's V codes decoded once into registers; the NR x C sums stay in registers.
template <int C, int NR, bool FP8>
__attribute__((always_inline)) inline void accumulate_rows(const float* p, int64_t n, const Pages& v, int64_t lo,
                                                           int64_t hi, float* acc_out) {
  constexpr int64_t D = C * kLanes;
  vfloat acc[NR][C] = {};
  for_each_row(v, lo, hi, [&](int64_t t, const uint8_t* row) __attribute__((always_inline)) {
    // Each row's weight times the key's scale, then times the raw codes.
    const float s = row_scale(row, D);
    float w[NR];
    for (int r = 0; r < NR; ++r) w[r] = p[r * n + (t - lo)] * s;
    for (int c = 0; c < C; ++c) {
      const vfloat vv = decode16<FP8>(row + c * kLanes);
      for (int r = 0; r < NR; ++r) acc[r][c] += w[r] * vv;
    }
  });
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < C; ++c) store16(acc_out + r * D + c * kLanes, acc[r][c]);
  }
}

// Softmax numerators of one row in place: soft cap, mask outside [row_lo, pos], exp(x - max); returns
// 1 / their sum.
inline float softmax_row(float* s, int64_t n, int64_t lo, int64_t row_lo, int64_t pos, float soft_cap) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float m = kNegInf;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t t = lo + j;
    float x = s[j];
    if (soft_cap > 0.f) x = soft_cap * std::tanh(x / soft_cap);
    x = (t < row_lo || t > pos) ? kNegInf : x;
    s[j] = x;
    m = std::max(m, x);
  }
  // vexp flushes anything below -87 (the masked -inf included) to exactly 0.
  vfloat sum{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vfloat e = vexp(load16(s + j) - m);
    store16(s + j, e);
    sum += e;
  }
  float total = hsum(sum);
  for (; j < n; ++j) {
    s[j] = s[j] == kNegInf ? 0.f : std::exp(s[j] - m);
    total += s[j];
  }
  return total > 0.f ? 1.f / total : 0.f;
}

// One item: rows r = i * G + g (token q_begin + i, head kv_head * G + g), taken 4 at a time.
template <int C, bool FP8>
__attribute__((always_inline)) inline void attend_rows(const Geometry& g, const Pages& pages, int64_t num_rows,
                                                       int64_t num_cached, int64_t q_begin, int64_t lo, int64_t hi,
                                                       Scratch& sc, float* acc) {
  constexpr int64_t D = C * kLanes;
  const int64_t n = hi - lo;
  Pages v_pages = pages;
  v_pages.cache += g.v_offset;
  for (int64_t r0 = 0; r0 < num_rows; r0 += 4) {
    const int nr = static_cast<int>(std::min<int64_t>(4, num_rows - r0));
    const float* q = &sc.q[r0 * D];
    float* s = &sc.scores[r0 * n];
    switch (nr) {
      case 1: score_rows<C, 1, FP8>(q, pages, lo, hi, s, n); break;
      case 2: score_rows<C, 2, FP8>(q, pages, lo, hi, s, n); break;
      case 3: score_rows<C, 3, FP8>(q, pages, lo, hi, s, n); break;
      default: score_rows<C, 4, FP8>(q, pages, lo, hi, s, n); break;
    }
    for (int r = 0; r < nr; ++r) {
      const int64_t pos = num_cached + q_begin + (r0 + r) / g.group;
      const int64_t row_lo = g.sliding_window > 0 ? std::max<int64_t>(lo, pos - g.sliding_window + 1) : lo;
      // Keys past the row's position are masked: its own row never reads past them either (hi is the
      // item's last row's, the same or later).
      sc.inv_sum[r0 + r] = softmax_row(s + r * n, n, lo, row_lo, pos, g.soft_cap);
    }
    float* out = acc + r0 * D;
    switch (nr) {
      case 1: accumulate_rows<C, 1, FP8>(s, n, v_pages, lo, hi, out); break;
      case 2: accumulate_rows<C, 2, FP8>(s, n, v_pages, lo, hi, out); break;
      case 3: accumulate_rows<C, 3, FP8>(s, n, v_pages, lo, hi, out); break;
      default: accumulate_rows<C, 4, FP8>(s, n, v_pages, lo, hi, out); break;
    }
  }
}

template <int C, bool FP8>
KVQ_CLONES void attend_rows_fn(const Geometry& g, const Pages& pages, int64_t num_rows, int64_t num_cached,
                                    int64_t q_begin, int64_t lo, int64_t hi, Scratch& sc, float* acc) {
  attend_rows<C, FP8>(g, pages, num_rows, num_cached, q_begin, lo, hi, sc, acc);
}


template <bool FP8>
RowsFn rows_fn(int64_t chunks) {
  switch (chunks) {
    case 1: return &attend_rows_fn<1, FP8>;
    case 2: return &attend_rows_fn<2, FP8>;
    case 4: return &attend_rows_fn<4, FP8>;
    case 5: return &attend_rows_fn<5, FP8>;
    case 6: return &attend_rows_fn<6, FP8>;
    case 8: return &attend_rows_fn<8, FP8>;
    case 16: return &attend_rows_fn<16, FP8>;
    default: return nullptr;
  }
}
