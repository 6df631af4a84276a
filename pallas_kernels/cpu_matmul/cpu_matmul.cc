// Skinny bf16 matmul for the CPU backend (decode-sized batches), called through the XLA FFI:
//   x [M, I] f32 (rounded to bf16 here, as x.astype(bfloat16) does), w [O, I] bf16 (the
//   model's [out, in] layout)  ->  y [M, O] f32 = x . w^T, products and sums in f32.
// Needs AVX512-BF16 (vdpbf16ps); I a multiple of 32, O a multiple of 4 (cpu_matmul.py checks).
//
// XLA:CPU's library dots reach a fraction of the memory bandwidth on these shapes (a few rows
// against a weight matrix read once); this kernel streams each weight row once per call:
// tasks own blocks of output features, each block of 4 weight rows (in L1) meets every
// 4-row tile of x, 16 f32 accumulators, summed by one tree of shuffles at the end.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel_for.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRows = 4;     // x rows per tile
constexpr int64_t kOuts = 4;     // weight rows per tile
constexpr int64_t kBlock = 64;   // output features per task

// The 16 horizontal sums of a[r][j] in one vector, lane 4 r + j: a tree of adds over
// shuffles (45 instructions instead of 16 separate reductions).
inline __m512 SumEach(const __m512 a[kRows][kOuts]) {
  __m512 t[8], u[4];
  for (int k = 0; k < 8; ++k) {  // pairs (2k, 2k + 1): per 128-bit lane [x02, y02, x13, y13]
    const __m512 x = a[(2 * k) / kOuts][(2 * k) % kOuts], y = a[(2 * k + 1) / kOuts][(2 * k + 1) % kOuts];
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: that lane's sums of accumulators 4k .. 4k + 3
    u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0x44), _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0xEE));
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

// y[m0 .. m0+4, o0 .. o0+4] from the bf16 rows xb [M_pad, I] and w [O, I].
inline void Tile(const uint16_t* xb, const uint16_t* w, int64_t in, int64_t m0, int64_t o0, int64_t m_count,
                 int64_t out_count, float* y) {
  __m512 acc[kRows][kOuts];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const uint16_t* wr = w + o0 * in;
  const uint16_t* xr = xb + m0 * in;
  for (int64_t c = 0; c < in; c += 32) {
    __m512bh wv[kOuts];
    for (int64_t j = 0; j < kOuts; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wr + j * in + c);
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + r * in + c);
      for (int64_t j = 0; j < kOuts; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  const __m512 sums = SumEach(acc);  // 128-bit lane r: y[m0 + r, o0 .. o0 + 4]
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sums);
  for (int64_t r = 0; r < kRows && m0 + r < m_count; ++r) std::memcpy(y + (m0 + r) * out_count + o0, lanes + 4 * r, 16);
}

ffi::Error MatmulBF16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                          ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || wd[1] % 32 != 0 || wd[0] % kOuts != 0)
    return ffi::Error::InvalidArgument("cpu matmul: x [M, I], w [O, I] with I % 32 == 0 and O % 4 == 0");
  const int64_t m = xd[0], in = xd[1], out = wd[0];
  const int64_t m_pad = (m + kRows - 1) / kRows * kRows;
  // x rounded to bf16 (round to nearest even), zero rows up to a multiple of kRows
  std::vector<uint16_t> xb(m_pad * in, 0);
  const float* xp = x.typed_data();
  for (int64_t i = 0; i < m * in; i += 32) {
    const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xp + i + 16), _mm512_loadu_ps(xp + i));
    _mm512_storeu_si512(xb.data() + i, (__m512i)pair);
  }
  const uint16_t* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t tasks = (out + kBlock - 1) / kBlock;
  pagedjax::ParallelFor(pool, tasks, [&](int64_t t) {
    const int64_t o_end = std::min(out, (t + 1) * kBlock);
    for (int64_t o0 = t * kBlock; o0 < o_end; o0 += kOuts)
      for (int64_t m0 = 0; m0 < m_pad; m0 += kRows) Tile(xb.data(), wp, in, m0, o0, m, out, yp);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulBF16, MatmulBF16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, I]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w [O, I]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, O]
