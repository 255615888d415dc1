// bf16 linear layers at decode sizes on AMX tiles, reading the weights oneDNN packed.
//
// Why. On an AMX CPU oneDNN multiplies bf16 on the tiles and wins at prefill sizes, but a decode step
// multiplies each weight by a few to a few tens of rows, and there its packed kernels read the weights
// well below what one core streams: SmolLM2-135M's linear layers and LM head at one thread on an
// AMX Xeon, 16 rows 13.0 ms against this kernel's 10.1, 32 rows 15.3 against 11.5 (python -m
// bench.cpu_gemm_bench; docs/benchmarks.md). This kernel streams
// each weight once per call, whatever the row count up to a few tiles, and leaves the rest to oneDNN
// (engine/models/amx_gemm.py decides, per call, by rows).
//
// Which weights. oneDNN's packed bf16 weight for these shapes is a run of column panels: for each
// panel of `width` output features (32 or 64), for each pair of input features, the panel's width
// pairs side by side: [n / width][k / 2][width][2]. That is the layout AMX's B tiles read (a tile row
// is 16 columns' pairs, 64 bytes; the next row, the next pair, one panel row further). Nothing of
// oneDNN's promises the layout: the caller proves it on each weight (the panels read back equal to
// the plain weight) before handing it here, and keeps oneDNN where it does not.
//
// Numbers. Each output is one float32 sum over k (the tile's order: pairs summed, then accumulated),
// plus the bias, rounded once to bf16 (to nearest even), as oneDNN's AMX kernels do.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

// Built with GCC 12 or later only (AMX's intrinsics and CPU-feature names need a recent compiler; 12 is
// what it is tested with); elsewhere the library comes without it: supported() is false, oneDNN keeps
// every size.
#if defined(__x86_64__) && defined(__linux__) && !defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 12
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define INFLIGHT_AMX 1
#define TARGET_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

namespace {

#ifdef INFLIGHT_AMX

// Tiles (numbers written out: the intrinsics paste them into the instruction's text): 0 and 1 two row
// blocks of x (A), 2 and 3 two column blocks of the weight (B), 4-7 their products (C), 4 + 2 * row
// block + column block.

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process AMX's tile state only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once, for the process.
bool request_tiles() {
  constexpr long kReqXcompPerm = 0x1023;
  constexpr long kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

const bool kHasAmx = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                     __builtin_cpu_supports("avx512bf16") && request_tiles();

// The weights' stream asks this far ahead of the k-slice it multiplies: the tile loads alone left the
// hardware prefetcher behind at 32 rows (12.3-12.8 ms -> 11.1-11.2 for the bench's pass; 2-16 KiB
// tried, 4 best).
constexpr int64_t kPrefetchBytes = 4096;

TARGET_AMX void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC does not see that ldtilecfg reads cfg and drops the stores above without this.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

TARGET_AMX void release_tiles() { _tile_release(); }

// c[MB * 16, NB * 16] (float32, row stride 32) = a[MB * 16, k] @ the weight's NB column blocks.
// a: rows `lda` elements apart; b: the first block's first pair row, rows `ldb` bytes apart.
template <int MB, int NB>
TARGET_AMX void tiles(const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t ldb, int64_t k,
                      float* c) {
  _tile_zero(4);
  if constexpr (NB > 1) _tile_zero(5);
  if constexpr (MB > 1) _tile_zero(6);
  if constexpr (MB > 1 && NB > 1) _tile_zero(7);
  const auto* ap = reinterpret_cast<const char*>(a);
  const auto* bp = reinterpret_cast<const char*>(b);
  const int64_t a_stride = lda * 2;
  for (int64_t kk = 0; kk < k / 32; ++kk) {
    const char* bk = bp + kk * 16 * ldb;
    for (int64_t line = 0; line < 16 * ldb; line += 64) _mm_prefetch(bk + kPrefetchBytes + line, _MM_HINT_T0);
    _tile_loadd(2, bk, ldb);
    if constexpr (NB > 1) _tile_loadd(3, bk + 64, ldb);
    _tile_loadd(0, ap + kk * 64, a_stride);
    _tile_dpbf16ps(4, 0, 2);
    if constexpr (NB > 1) _tile_dpbf16ps(5, 0, 3);
    if constexpr (MB > 1) {
      _tile_loadd(1, ap + 16 * a_stride + kk * 64, a_stride);
      _tile_dpbf16ps(6, 1, 2);
      if constexpr (NB > 1) _tile_dpbf16ps(7, 1, 3);
    }
  }
  constexpr int64_t kLdc = 32 * 4;
  _tile_stored(4, c, kLdc);
  if constexpr (NB > 1) _tile_stored(5, c + 16, kLdc);
  if constexpr (MB > 1) _tile_stored(6, c + 16 * 32, kLdc);
  if constexpr (MB > 1 && NB > 1) _tile_stored(7, c + 16 * 32 + 16, kLdc);
}

using TileFn = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, int64_t, float*);
constexpr TileFn kTiles[2][2] = {{tiles<1, 1>, tiles<1, 2>}, {tiles<2, 1>, tiles<2, 2>}};

// out[rows, cols] (bf16, row stride ldo) = c (float32, row stride 32) + bias[cols], cols a multiple of 16.
TARGET_AMX void write_out(const float* c, int64_t rows, int64_t cols, at::BFloat16* out, int64_t ldo,
                          const at::BFloat16* bias) {
  for (int64_t j = 0; j < cols; j += 16) {
    __m512 bj = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + j));
      bj = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * 32 + j), bj));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + j), (__m256i)v);
    }
  }
}

void run(const at::Tensor& x, const at::Tensor& panels, const at::BFloat16* bias, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t num_panels = panels.size(0), width = panels.size(2);
  const int64_t n = num_panels * width;
  const auto* a = x.data_ptr<at::BFloat16>();
  const auto* w = panels.data_ptr<at::BFloat16>();
  auto* o = out.data_ptr<at::BFloat16>();
  const int64_t lda = x.stride(0);
  const int64_t ldb = width * 4;           // bytes from one pair row of a panel to the next
  const int64_t panel_elems = k * width;  // a panel: k / 2 pair rows of width pairs
  // Threads split the panels (each streams its own weights); every row block stays with its panel,
  // whose k-slices it reads again from cache.
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles();
    alignas(64) float c[32 * 32];
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t j = 0; j < width; j += 32) {
        const int64_t nb = std::min<int64_t>(2, (width - j) / 16);
        const at::BFloat16* b = w + p * panel_elems + j * 2;
        const int64_t col = p * width + j;
        for (int64_t r = 0; r < m; r += 32) {
          const int64_t mb = std::min<int64_t>(2, (m - r) / 16);
          kTiles[mb - 1][nb - 1](a + r * lda, lda, b, ldb, k, c);
          write_out(c, mb * 16, nb * 16, o + r * n + col, n, bias != nullptr ? bias + col : nullptr);
        }
      }
    }
    release_tiles();
  });
}

#endif  // INFLIGHT_AMX

bool supported() {
#ifdef INFLIGHT_AMX
  return kHasAmx;
#else
  return false;
#endif
}

// x [rows, k] bf16 (rows a multiple of 16, k of 32); panels [n / width, k / 2, width, 2] bf16, width a
// multiple of 16; bias [n] or none.
at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "this CPU (or kernel) gives no AMX bf16 tiles to this process");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be a bf16 [rows, k] CPU tensor with contiguous rows");
  TORCH_CHECK(x.size(0) % 16 == 0, "rows must be a multiple of 16 (AMX tiles), got ", x.size(0));
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.dim() == 4 && panels.size(3) == 2 &&
                  panels.size(2) % 16 == 0 && panels.is_contiguous(),
              "panels must be [n / width, k / 2, width, 2] bf16, width a multiple of 16");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % 32 == 0 && panels.size(1) * 2 == k, "k must be a multiple of 32 and match the panels");
  const int64_t n = panels.size(0) * panels.size(2);
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n,
                "bias must be [out features] bf16");
  }
  at::Tensor out = at::empty({x.size(0), n}, x.options());
#ifdef INFLIGHT_AMX
  if (x.size(0) > 0) run(x, panels, bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr, out);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight_cpu, m) {
  m.def("amx_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor");
  // No tensor to dispatch on: one kernel for every backend.
  m.def("amx_linear_supported() -> bool", &supported);
}

TORCH_LIBRARY_IMPL(inflight_cpu, CPU, m) { m.impl("amx_linear", &linear); }
