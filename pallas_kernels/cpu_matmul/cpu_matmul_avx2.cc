// Decode-sized matmuls for CPUs with AVX2 and FMA (and no AVX512-BF16), through the XLA FFI:
//   x [M, I] f32, w [O, I] f32 or bf16 (the model's [out, in] layout)  ->  y [M, O] f32 = x . w^T.
// With bf16 weights x is rounded to bf16 first (as x.astype(bfloat16) does) and each weight is
// widened to f32 as it is read (a 16-bit shift): products and sums in f32, the same
// arithmetic as matmul_bf16_reference up to the order of the sums. I a multiple of 8; any O.
//
// A few rows against a weight matrix read once is bound by reading the weights; XLA:CPU's
// library dot reaches a fraction of that here (scripts/bench_matmul.py: on a 2-core AMD EPYC,
// f32 at 8 rows took 3.5x its 1-row time). Tasks own blocks of kBlock output features; each
// tile of kOuts weight rows (in L1) meets every kRows-row tile of x (in L2), kRows x kOuts
// 8-lane accumulators summed horizontally at the end. A tile's weights past kChunkBytes are
// taken in chunks of I, so that they stay in L1 for every row tile (the down projection's
// 6 x 1536 f32 are 36 KB, past Zen 3's 32 KB L1: 10-14% faster at 8-16 rows, 5-7% at 32, in a
// C++ harness of the 30-layer stack on 2 threads). Tiles of 2 x 6 (12 accumulators; a
// single row: 1 x 8): on a Zen 3 core, in L1, 2 x 6, 1 x 8, 2 x 5 and 3 x 4 tiles ran ~4 G
// FMA/s, 4 x 3 and 4 x 2 ~2-2.5 (compiled with GCC 12).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel_for.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 48;  // output features per task (a multiple of both tiles' kO)

// Cache-line aligned floats for the kernel's own copies of x and of widened bf16 weights. A plain
// vector is only 16-byte aligned: then half of the 32-byte loads straddle two lines and cost
// two, and which copy lands where changed from run to run (bf16 at 32 rows: 59 or 77 ms).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
using Floats = std::vector<float, LineAligned<float>>;

inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {  // 8 bf16 -> f32: the bf16 bits are an f32's top half
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

inline float Sum(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// A span of weight memory for a tile to pull into the caches while it computes (up to two
// 64-byte lines per step of 8 inputs): the weight tile it meets next, so that each tile's
// first pass is not stalled on memory (a Zen 3 core, 16 rows, weights streamed from memory:
// 2.8-3.0 -> 3.2-3.4 G FMA/s). The last row tile may reach a few lines past the next tile:
// prefetches never fault.
struct Prefetch {
  const char* p = nullptr;
  int64_t lines = 0;
};

// Weight rows longer than this many f32 bytes per tile are split along I: the tile's part of
// the weights stays in L1 while every row tile of x meets it.
constexpr int64_t kChunkBytes = 12 * 1024;

// One tile over inputs [c0, c0 + len): y[m0 + r, o0 + j] for r < kR, j < n_outs (<= kO) from x
// [M_pad, I] (f32, row stride in) and wr, the weight rows o0 .. o0 + kO from input c0 (row stride
// ws). part [kR * kO] 8-lane partial sums carry a row split into chunks: read unless `first`,
// written unless `last` (then y gets the sums).
template <int kR, int kO, typename W>
inline void Tile(const float* __restrict x, const W* __restrict wr, int64_t in, int64_t ws, int64_t c0,
                 int64_t len, int64_t m0, int64_t o0, int64_t n_outs, int64_t m, int64_t out,
                 float* __restrict y, __m256* __restrict part, bool first, bool last, Prefetch pf = {}) {
  __m256 acc[kR][kO];
  for (int r = 0; r < kR; ++r)
    for (int j = 0; j < kO; ++j) acc[r][j] = first ? _mm256_setzero_ps() : part[r * kO + j];
  const float* xr = x + m0 * in + c0;
  for (int64_t c = 0, line = 0; c < len; c += 8, line += 2) {
    if (line < pf.lines) _mm_prefetch(pf.p + line * 64, _MM_HINT_T0);
    if (line + 1 < pf.lines) _mm_prefetch(pf.p + (line + 1) * 64, _MM_HINT_T0);
    __m256 wv[kO];
    for (int j = 0; j < kO; ++j) wv[j] = Load8(wr + j * ws + c);
    for (int r = 0; r < kR; ++r) {
      const __m256 xv = _mm256_loadu_ps(xr + r * in + c);
      for (int j = 0; j < kO; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  if (!last) {
    for (int r = 0; r < kR; ++r)
      for (int j = 0; j < kO; ++j) part[r * kO + j] = acc[r][j];
    return;
  }
  for (int64_t r = 0; r < kR && m0 + r < m; ++r)
    for (int j = 0; j < n_outs; ++j) y[(m0 + r) * out + o0 + j] = Sum(acc[r][j]);
}

// The weight rows [o_begin, o_end) against every row of x: full kO tiles, then one at a time.
// bf16 rows meeting several row tiles of x are widened to f32 once, into L1, for all of them.
template <int kR, int kO, typename W>
void Block(const float* x, const W* w, int64_t in, int64_t m, int64_t m_pad, int64_t out, int64_t o_begin,
           int64_t o_end, float* y) {
  thread_local Floats wide;
  thread_local std::vector<__m256, LineAligned<__m256>> parts;
  const bool widen = !std::is_same_v<W, float> && m_pad > kR;
  const int64_t chunks = std::max<int64_t>(1, kO * in * int64_t(sizeof(float)) / kChunkBytes);
  const int64_t chunk = (in / 8 + chunks - 1) / chunks * 8;  // inputs per chunk, a multiple of 8
  if (widen) wide.resize(kO * chunk);
  parts.resize(m_pad / kR * kR * kO);
  // the next tile's weights, split evenly over this tile's (chunk, row tile) passes
  const int64_t passes = m_pad / kR * ((in + chunk - 1) / chunk);
  const int64_t tile_lines = (kO * in * int64_t(sizeof(W)) + 63) / 64;
  const int64_t lines_per_pass = (tile_lines + passes - 1) / passes;
  int64_t o0 = o_begin;
  for (; o0 + kO <= o_end; o0 += kO) {
    const bool has_next = o0 + 2 * kO <= o_end;  // a next full tile in this block
    int64_t pass = 0;
    for (int64_t c0 = 0; c0 < in; c0 += chunk) {
      const int64_t len = std::min(chunk, in - c0);
      const bool first = c0 == 0, last = c0 + len >= in;
      const W* wr = w + o0 * in + c0;
      if (widen)
        for (int j = 0; j < kO; ++j)
          for (int64_t i = 0; i < len; i += 8) _mm256_storeu_ps(wide.data() + j * chunk + i, Load8(wr + j * in + i));
      for (int64_t m0 = 0, t = 0; m0 < m_pad; m0 += kR, ++t, ++pass) {
        const int64_t lines = has_next ? std::min(lines_per_pass, tile_lines - pass * lines_per_pass) : 0;
        const Prefetch pf = lines > 0 ? Prefetch{reinterpret_cast<const char*>(w + (o0 + kO) * in) +
                                                     pass * lines_per_pass * 64, lines}
                                      : Prefetch{};
        __m256* part = parts.data() + t * kR * kO;
        if (widen) Tile<kR, kO>(x, wide.data(), in, chunk, c0, len, m0, o0, kO, m, out, y, part, first, last, pf);
        else Tile<kR, kO>(x, wr, in, in, c0, len, m0, o0, kO, m, out, y, part, first, last, pf);
      }
    }
  }
  for (; o0 < o_end; ++o0)
    for (int64_t m0 = 0; m0 < m_pad; m0 += kR)
      Tile<kR, 1>(x, w + o0 * in, in, in, 0, in, m0, o0, 1, m, out, y, nullptr, true, true);
}

// bf16 rounding of an f32 (round to nearest even; NaN stays NaN), kept as an f32.
inline float RoundToBF16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return v;
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &bits, 4);
  return v;
}

template <ffi::DataType kW>
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kW> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  using W = std::conditional_t<kW == ffi::DataType::F32, float, uint16_t>;
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || wd[1] % 8 != 0)
    return ffi::Error::InvalidArgument("cpu matmul (AVX2): x [M, I], w [O, I] with I % 8 == 0");
  const int64_t m = xd[0], in = xd[1], out = wd[0];
  if (in == 0) {  // empty sums
    std::fill_n(y->typed_data(), m * out, 0.f);
    return ffi::Error::Success();
  }
  const int kR = m >= 2 ? 2 : 1;
  const int64_t m_pad = (m + kR - 1) / kR * kR;
  // x, bf16-rounded for bf16 weights, zero rows up to a multiple of kR
  Floats xs(m_pad * in, 0.f);
  const float* xp = x.typed_data();
  if constexpr (kW == ffi::DataType::F32) {
    std::copy(xp, xp + m * in, xs.begin());
  } else {
    for (int64_t i = 0; i < m * in; ++i) xs[i] = RoundToBF16(xp[i]);
  }
  const W* wp = reinterpret_cast<const W*>(w.typed_data());
  float* yp = y->typed_data();
  const int64_t tasks = (out + kBlock - 1) / kBlock;
  pagedjax::ParallelFor(pool, tasks, [&](int64_t t) {
    const int64_t begin = t * kBlock, end = std::min(out, begin + kBlock);
    if (kR == 2) Block<2, 6>(xs.data(), wp, in, m, m_pad, out, begin, end, yp);
    else Block<1, 8>(xs.data(), wp, in, m, m_pad, out, begin, end, yp);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulAvx2F32, MatmulImpl<ffi::DataType::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, I]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [O, I]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, O]

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulAvx2BF16, MatmulImpl<ffi::DataType::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, I]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w [O, I]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, O]
