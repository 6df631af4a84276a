// int8-weight matmul for decode-sized batches on the CPU backend, called through the XLA FFI:
//   x [M, I] f32, w_q [O, I] int8 (the model's [out, in] layout), w_scale [O] f32
//   ->  y [M, O] f32 ~ x . (w_q * w_scale[:, None])^T.
// W8A8: each row of x is quantized on entry, symmetric per row (x_scale[m] = max|x[m]| / 127,
// x_q = round(x / x_scale) in [-127, 127], rounding half to even; both divisions as
// multiplications by the reciprocal, as XLA compiles them in the reference; an all-zero row
// has scale 0 and gives zeros), the integer dot runs on vpdpbusd (u8 x s8 -> s32, four products a lane),
// then y[m, o] = float(acc[m, o]) * x_scale[m] * w_scale[o]: the same arithmetic as
// matmul_int8_reference, whose integer sums are exact, so the two agree bit for bit.
// vpdpbusd takes one unsigned operand: x goes in as x_q + 128 (u8, 1 .. 255) and the kernel
// subtracts 128 * sum_i w_q[o, i], which it sums itself in the same pass over w (one more
// vpdpbusd of each weight vector against a vector of ones, in a task's first row tile only).
// I a multiple of 64; any O, any M (the Python side offers M <= INT8_MAX_ROWS); the Python side
// checks too.
//
// act_bits = 16 (attribute; 8: the W8A8 path above): x quantized per row to int16 instead
// (x_scale[m] = max|x[m]| / 32767, x_q in [-32767, 32767]: relative error ~1.5e-5, the
// quality of weight-only int8), each weight vector sign-extended to int16 as it is read
// (vpmovsxbw, once per 32 weights, shared by the rows of a tile), the products summed by
// vpdpwssd (s16 pairs -> s32). A lane of an accumulator sums I / 32 pair products of at most
// 2 * 32767 * 128 = 8388352 in magnitude: exact in int32 for I <= kMaxIn16 = 8192 (256 of them,
// 2147418112 < 2^31), refused beyond. The total over all I lanes may not fit int32 (from I = 512
// in the worst case), so the 16 lanes are converted to f32 and summed by a fixed tree (lanes
// 4b + j of 128-bit block b: s_b = (l0 + l2) + (l1 + l3), then (s0 + s1) + (s2 + s3)),
// which matmul_int8_reference(act_bits=16) repeats, so the two still agree bit for bit.
//
// Tasks own blocks of kBlock output features; each tile of kOuts weight rows (in L1) meets
// every tile of up to kRows rows of x (x_u8 is M x I bytes, in L1 / L2), kRows x kOuts
// 16-lane s32 accumulators, summed by one tree of shuffles at the end. Half the weight bytes
// of bf16 and twice the products per instruction of vdpbf16ps (scripts/bench_matmul.py
// --dtype int8).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel_for.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRows = 4;    // x rows per tile (at most)
constexpr int64_t kOuts = 4;    // weight rows per tile
// The first row tile of each weight tile prefetches the weight tile kPrefetchTiles ahead, so that
// reading the weights overlaps the dot products (the 30-layer stack in a C++ harness, one thread:
// 16 rows 19.6 -> 14.6 ms, 32 rows 37 -> 25, 1 row 11.0 -> 9.4; 1, 2 and 4 tiles ahead alike).
// Past the task's block or w it is harmless (prefetches never fault).
constexpr int64_t kPrefetchTiles = 2;
constexpr int64_t kMaxIn16 = 8192;  // act_bits 16: the largest I whose lane sums fit int32
constexpr int64_t kBlock = 32;  // output features per task (a multiple of kOuts; O = 576: 18 tasks, even on 2 threads)

// acc + the four-byte dot products of u (u8) and s (s8), per 32-bit lane (vpdpbusd). Inline
// asm: GCC 12 compiles _mm512_dpbusd_epi32 on an array of accumulators into a copy and a
// store to the stack around each one (the 30-layer stack in a C++ harness: 16 rows 2x slower).
inline __m512i Dot(__m512i acc, __m512i u, __m512i s) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

// The kRows * kOuts = 16 horizontal sums of a[r][j] in one vector, lane 4 r + j (rows past
// R are left as zero vectors by the caller): a tree of adds over shuffles.
inline __m512i SumEach(const __m512i a[kRows][kOuts]) {
  __m512i t[8], u[4];
  for (int k = 0; k < 8; ++k) {  // pairs (2k, 2k + 1): per 128-bit lane [x02, y02, x13, y13]
    const __m512i x = a[(2 * k) / kOuts][(2 * k) % kOuts], y = a[(2 * k + 1) / kOuts][(2 * k + 1) % kOuts];
    t[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y));
  }
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: that lane's sums of accumulators 4k .. 4k + 3
    const __m512 p = _mm512_castsi512_ps(t[2 * k]), q = _mm512_castsi512_ps(t[2 * k + 1]);
    u[k] = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(p, q, 0x44)),
                            _mm512_castps_si512(_mm512_shuffle_ps(p, q, 0xEE)));
  }
  const __m512i v0 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88), _mm512_shuffle_i32x4(u[0], u[1], 0xDD));
  const __m512i v1 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x88), _mm512_shuffle_i32x4(u[2], u[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(v0, v1, 0x88), _mm512_shuffle_i32x4(v0, v1, 0xDD));
}

// Four lanes' sums of a[j] (j < kOuts): lane j of the result.
inline __m128i SumFour(const __m512i a[kOuts]) {
  __m512i z[kRows][kOuts];
  for (int64_t j = 0; j < kOuts; ++j) {
    z[0][j] = a[j];
    for (int64_t r = 1; r < kRows; ++r) z[r][j] = _mm512_setzero_si512();
  }
  return _mm512_castsi512_si128(SumEach(z));
}

// y[m0 .. m0 + R, o0 .. o0 + kOuts] from the u8 rows xu [M, I] and w [O, I]. kSum: also sum
// the weight rows (into wsum[kOuts], s32) and prefetch a later weight tile, for the first row
// tile of a weight tile; later tiles reuse the sums.
template <int R, bool kSum>
inline void Tile(const uint8_t* xu, const int8_t* w, int64_t in, int64_t m0, int64_t o0, int64_t out,
                 const float* x_scale, const float* w_scale, int32_t* wsum, float* y) {
  __m512i acc[kRows][kOuts], sum[kOuts];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_si512();
  for (auto& s : sum) s = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi8(1);
  const int8_t* wr = w + o0 * in;
  const uint8_t* xr = xu + m0 * in;
  for (int64_t c = 0; c < in; c += 64) {
    __m512i wv[kOuts];
    for (int64_t j = 0; j < kOuts; ++j) wv[j] = _mm512_loadu_si512(wr + j * in + c);
    if (kSum)
      for (int64_t j = 0; j < kOuts; ++j) {
        sum[j] = Dot(sum[j], ones, wv[j]);
        _mm_prefetch(reinterpret_cast<const char*>(wr + (kOuts * kPrefetchTiles + j) * in + c), _MM_HINT_T0);
      }
    for (int64_t r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(xr + r * in + c);
      for (int64_t j = 0; j < kOuts; ++j) acc[r][j] = Dot(acc[r][j], xv, wv[j]);
    }
  }
  if (kSum) _mm_storeu_si128(reinterpret_cast<__m128i*>(wsum), SumFour(sum));
  // lane 4 r + j: sum_i (x_q + 128) w_q  ->  minus 128 sum_i w_q  ->  f32, scaled
  const __m512i bias = _mm512_slli_epi32(
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wsum))), 7);
  const __m512i dots = _mm512_sub_epi32(SumEach(acc), bias);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_cvtepi32_ps(dots));
  for (int64_t r = 0; r < R; ++r) {
    const __m128 v = _mm_mul_ps(_mm_mul_ps(_mm_load_ps(lanes + 4 * r), _mm_set1_ps(x_scale[m0 + r])),
                                _mm_loadu_ps(w_scale + o0));
    _mm_storeu_ps(y + (m0 + r) * out + o0, v);
  }
}

template <bool kSum>
inline void TileRows(int64_t rows, const uint8_t* xu, const int8_t* w, int64_t in, int64_t m0, int64_t o0,
                     int64_t out, const float* xs, const float* ws, int32_t* wsum, float* y) {
  switch (rows) {
    case 1: return Tile<1, kSum>(xu, w, in, m0, o0, out, xs, ws, wsum, y);
    case 2: return Tile<2, kSum>(xu, w, in, m0, o0, out, xs, ws, wsum, y);
    case 3: return Tile<3, kSum>(xu, w, in, m0, o0, out, xs, ws, wsum, y);
    default: return Tile<4, kSum>(xu, w, in, m0, o0, out, xs, ws, wsum, y);
  }
}

// acc + the two-product sums of s16 pairs, per 32-bit lane (vpdpwssd); inline asm as Dot.
inline __m512i DotW(__m512i acc, __m512i x, __m512i w) {
  __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

// SumEach in f32: the same tree over the same lanes, lane 4 r + j of the result.
inline __m512 SumEachF(const __m512 a[kRows][kOuts]) {
  __m512 t[8], u[4];
  for (int k = 0; k < 8; ++k) {
    const __m512 x = a[(2 * k) / kOuts][(2 * k) % kOuts], y = a[(2 * k + 1) / kOuts][(2 * k + 1) % kOuts];
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int k = 0; k < 4; ++k)
    u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0x44), _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], 0xEE));
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

// The f32 tree over 16 int32 lane sums (as SumEachF does for each accumulator).
inline float LaneTree(const int32_t l[16]) {
  float s[4];
  for (int b = 0; b < 4; ++b)
    s[b] = (float(l[4 * b]) + float(l[4 * b + 2])) + (float(l[4 * b + 1]) + float(l[4 * b + 3]));
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// act_bits 16: y[m0 .. m0 + R, o0 .. o0 + kOuts] from the s16 rows xq [M, I] and w [O, I].
// kPrefetch: the first row tile of a weight tile prefetches a later weight tile.
template <int R, bool kPrefetch>
inline void Tile16(const int16_t* xq, const int8_t* w, int64_t in, int64_t m0, int64_t o0, int64_t out,
                   const float* x_scale, const float* w_scale, float* y) {
  __m512i acc[kRows][kOuts];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_si512();
  const int8_t* wr = w + o0 * in;
  const int16_t* xr = xq + m0 * in;
  for (int64_t c = 0; c < in; c += 64) {
    if (kPrefetch)
      for (int64_t j = 0; j < kOuts; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(wr + (kOuts * kPrefetchTiles + j) * in + c), _MM_HINT_T0);
    for (int64_t h = c; h < c + 64; h += 32) {
      __m512i wv[kOuts];
      for (int64_t j = 0; j < kOuts; ++j)
        wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + j * in + h)));
      for (int64_t r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(xr + r * in + h);
        for (int64_t j = 0; j < kOuts; ++j) acc[r][j] = DotW(acc[r][j], xv, wv[j]);
      }
    }
  }
  __m512 accf[kRows][kOuts];
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < kOuts; ++j) accf[r][j] = _mm512_cvtepi32_ps(acc[r][j]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, SumEachF(accf));
  for (int64_t r = 0; r < R; ++r) {
    const __m128 v = _mm_mul_ps(_mm_mul_ps(_mm_load_ps(lanes + 4 * r), _mm_set1_ps(x_scale[m0 + r])),
                                _mm_loadu_ps(w_scale + o0));
    _mm_storeu_ps(y + (m0 + r) * out + o0, v);
  }
}

template <bool kPrefetch>
inline void Tile16Rows(int64_t rows, const int16_t* xq, const int8_t* w, int64_t in, int64_t m0, int64_t o0,
                       int64_t out, const float* xs, const float* ws, float* y) {
  switch (rows) {
    case 1: return Tile16<1, kPrefetch>(xq, w, in, m0, o0, out, xs, ws, y);
    case 2: return Tile16<2, kPrefetch>(xq, w, in, m0, o0, out, xs, ws, y);
    case 3: return Tile16<3, kPrefetch>(xq, w, in, m0, o0, out, xs, ws, y);
    default: return Tile16<4, kPrefetch>(xq, w, in, m0, o0, out, xs, ws, y);
  }
}

// act_bits 16, the last O % kOuts outputs (scalar): the same lanes, the same tree.
void TailOutput16(const int16_t* xq, const int8_t* w, int64_t m, int64_t in, int64_t o, int64_t out,
                  const float* xs, const float* ws, float* y) {
  const int8_t* wr = w + o * in;
  for (int64_t r = 0; r < m; ++r) {
    int32_t l[16] = {};
    for (int64_t i = 0; i < in; ++i) l[(i % 32) / 2] += int32_t(xq[r * in + i]) * wr[i];
    y[r * out + o] = LaneTree(l) * xs[r] * ws[o];
  }
}

// act_bits 16: x [m, in] f32 -> x_q as s16 [m, in] (in [-32767, 32767]), and x_scale [m].
void QuantizeX16(const float* x, int64_t m, int64_t in, int16_t* xq, float* xs) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * in;
    __m512 mx = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) mx = _mm512_max_ps(mx, _mm512_and_ps(_mm512_loadu_ps(xr + i), abs_mask));
    const float scale = _mm512_reduce_max_ps(mx) * (1.0f / 32767.0f);
    xs[r] = scale;
    if (scale == 0.0f) {
      std::memset(xq + r * in, 0, in * sizeof(int16_t));
      continue;
    }
    const __m512 inv = _mm512_set1_ps(1.0f / scale), lo = _mm512_set1_ps(-32767.0f), hi = _mm512_set1_ps(32767.0f);
    for (int64_t i = 0; i < in; i += 16) {
      const __m512 q = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i), inv), lo), hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * in + i), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(q)));
    }
  }
}

// act_bits 16: y[:, o_begin .. o_end] (a multiple of kOuts wide) from the quantized x.
void Outputs16(const int16_t* xq, const float* xs, const int8_t* w, const float* ws, int64_t m, int64_t in,
               int64_t out, int64_t o_begin, int64_t o_end, float* y) {
  for (int64_t o0 = o_begin; o0 < o_end; o0 += kOuts) {
    Tile16Rows<true>(std::min(kRows, m), xq, w, in, 0, o0, out, xs, ws, y);
    for (int64_t m0 = kRows; m0 < m; m0 += kRows)
      Tile16Rows<false>(std::min(kRows, m - m0), xq, w, in, m0, o0, out, xs, ws, y);
  }
}

// The same for the last O % kOuts outputs, one at a time (scalar; O is rarely not a multiple of 4).
void TailOutput(const uint8_t* xu, const int8_t* w, int64_t m, int64_t in, int64_t o, int64_t out,
                const float* xs, const float* ws, float* y) {
  const int8_t* wr = w + o * in;
  int32_t wsum = 0;
  for (int64_t i = 0; i < in; ++i) wsum += wr[i];
  for (int64_t r = 0; r < m; ++r) {
    int32_t acc = 0;
    for (int64_t i = 0; i < in; ++i) acc += int32_t(xu[r * in + i]) * wr[i];
    y[r * out + o] = float(acc - 128 * wsum) * xs[r] * ws[o];
  }
}

// x [m, in] f32 -> x_q + 128 as u8 [m, in], and x_scale [m].
void QuantizeX(const float* x, int64_t m, int64_t in, uint8_t* xu, float* xs) {
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * in;
    __m512 mx = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) mx = _mm512_max_ps(mx, _mm512_and_ps(_mm512_loadu_ps(xr + i), abs_mask));
    const float scale = _mm512_reduce_max_ps(mx) * (1.0f / 127.0f);
    xs[r] = scale;
    if (scale == 0.0f) {  // an all-zero row: x_q = 0
      std::memset(xu + r * in, 128, in);
      continue;
    }
    const __m512 inv = _mm512_set1_ps(1.0f / scale), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i off = _mm512_set1_epi32(128);
    for (int64_t i = 0; i < in; i += 16) {
      // x * (1 / scale), rounded half to even (the default MXCSR mode, as jnp.round), clipped
      const __m512 q = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i), inv), lo), hi);
      const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(q), off);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xu + r * in + i), _mm512_cvtepi32_epi8(u));
    }
  }
}

// y[:, o_begin .. o_end] (a multiple of kOuts wide) from the quantized x.
void Outputs(const uint8_t* xu, const float* xs, const int8_t* w, const float* ws, int64_t m, int64_t in,
             int64_t out, int64_t o_begin, int64_t o_end, float* y) {
  alignas(16) int32_t wsum[kOuts];
  for (int64_t o0 = o_begin; o0 < o_end; o0 += kOuts) {
    TileRows<true>(std::min(kRows, m), xu, w, in, 0, o0, out, xs, ws, wsum, y);
    for (int64_t m0 = kRows; m0 < m; m0 += kRows)
      TileRows<false>(std::min(kRows, m - m0), xu, w, in, m0, o0, out, xs, ws, wsum, y);
  }
}

ffi::Error MatmulInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> w_scale, ffi::ResultBuffer<ffi::F32> y, int32_t act_bits) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto sd = w_scale.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 1 || xd[1] != wd[1] || sd[0] != wd[0] || wd[1] % 64 != 0)
    return ffi::Error::InvalidArgument("cpu int8 matmul: x [M, I], w_q [O, I], w_scale [O] with I % 64 == 0");
  if (act_bits != 8 && act_bits != 16)
    return ffi::Error::InvalidArgument("cpu int8 matmul: act_bits must be 8 or 16");
  if (act_bits == 16 && wd[1] > kMaxIn16)
    return ffi::Error::InvalidArgument("cpu int8 matmul: act_bits 16 takes I <= 8192");
  const int64_t m = xd[0], in = xd[1], out = wd[0];
  if (m == 0 || out == 0) return ffi::Error::Success();
  const int8_t* wp = w.typed_data();
  const float* ws = w_scale.typed_data();
  float* yp = y->typed_data();
  const int64_t out_tiles = out / kOuts * kOuts;
  const int64_t tasks = (out_tiles + kBlock - 1) / kBlock;
  std::vector<float> xs(m);
  if (act_bits == 16) {
    std::vector<int16_t> xq(m * in);
    QuantizeX16(x.typed_data(), m, in, xq.data(), xs.data());
    pagedjax::ParallelFor(pool, tasks, [&](int64_t t) {
      Outputs16(xq.data(), xs.data(), wp, ws, m, in, out, t * kBlock, std::min(out_tiles, (t + 1) * kBlock), yp);
    });
    for (int64_t o = out_tiles; o < out; ++o) TailOutput16(xq.data(), wp, m, in, o, out, xs.data(), ws, yp);
    return ffi::Error::Success();
  }
  std::vector<uint8_t> xu(m * in);
  QuantizeX(x.typed_data(), m, in, xu.data(), xs.data());
  pagedjax::ParallelFor(pool, tasks, [&](int64_t t) {
    Outputs(xu.data(), xs.data(), wp, ws, m, in, out, t * kBlock, std::min(out_tiles, (t + 1) * kBlock), yp);
  });
  for (int64_t o = out_tiles; o < out; ++o) TailOutput(xu.data(), wp, m, in, o, out, xs.data(), ws, yp);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulInt8, MatmulInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, I]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w_q [O, I]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_scale [O]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, O]
                                  .Attr<int32_t>("act_bits"));   // 8: W8A8, 16: x as int16
