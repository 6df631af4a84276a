// 8-bit-weight matmul on bf16 dots for decode-sized batches on the CPU backend, called through
// the XLA FFI, one kernel templated on the weight format:
//   MatmulFP8:      x [M, I] f32, w_q [O, I] float8_e4m3fn, w_scale [O] f32
//   MatmulInt8BF16: x [M, I] f32, w_q [O, I] int8,          w_scale [O] f32
//   ->  y [M, O] f32 = (x rounded to bf16) . w_q^T (products and sums in f32), times w_scale
// (the model's [out, in] layout). The same as matmul_fp8_reference / matmul_int8_bf16_reference
// up to the order of the f32 sums.
//
// Every e4m3fn value and every int8 is exact in bf16, so the weights are widened to bf16 in
// registers, 32 at a time (a format's Widen), and the dot runs on vdpbf16ps with f32
// accumulators, as in cpu_matmul.cc.
// FP8 (e4m3fn), per 32 weights: the bytes sign-extended to 16 bits (the sign lands in bit 15),
// shifted left by 4 so that the 4 exponent and 3 mantissa bits sit where bf16 keeps its top
// ones, the exponent rebiased (+ (127 - 7) << 7). Codes with exponent field 0 (zero and
// subnormals m * 2^-9) or 15 (the top binade, with the NaN codes 0x7F / 0xFF) come from a
// 32-entry table (vpermw on the code's low 5 bits) instead; then the sign is ORed in. All
// results are normal bf16 (or zero, NaN), so vdpbf16ps, which treats denormal inputs as zero,
// takes them as they are.
// Int8, per 32 weights: two vpmovsxbd (16 each to s32), vcvtdq2ps (exact: |w| <= 128 < 2^24),
// one vcvtne2ps2bf16 (exact: 8 significant bits at most), 5 instructions against FP8's 8.
//
// Tasks own blocks of kBlock output features; each tile of kOuts weight rows meets every tile
// of up to kRows rows of x (x in bf16, M x I x 2 bytes, in L1 / L2). The first row tile of a
// weight tile widens the weights in registers and, when more row tiles follow, stores the
// bf16 weights in a per-task buffer (kOuts x I x 2 bytes, in L1) that the later row tiles read,
// so each weight is widened once per call. The f32 sums of a tile come from one tree of
// shuffles; w_scale multiplies them at the end. I a multiple of 32; any M and O (the last
// O % kOuts outputs scalar); the Python side checks too.
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

constexpr int64_t kRows = 4;   // x rows per tile (at most)
constexpr int64_t kOuts = 4;   // weight rows per tile
constexpr int64_t kBlock = 32; // output features per task (a multiple of kOuts)
// The first row tile of each weight tile prefetches the weight tile kPrefetchTiles ahead.
constexpr int64_t kPrefetchTiles = 2;

// The bf16 bits of e4m3fn code b (the table's source of truth, and the scalar tail's).
inline uint16_t Bf16OfCode(uint8_t b) {
  const uint16_t sign = uint16_t(b & 0x80) << 8;
  const int e = (b >> 3) & 15, m = b & 7;
  if ((b & 0x7F) == 0x7F) return sign | 0x7FC0;  // NaN
  if (e == 0) {
    if (m == 0) return sign;  // +-0
    // m * 2^-9: normalize the 3-bit mantissa
    int shift = 0;
    while (!(m << shift & 4)) ++shift;  // leading bit to position 2
    const int exp = 127 - 7 - shift;    // value (m << shift) / 4 * 2^(-7 - shift)
    const int mant = ((m << shift) & 3) << 5;
    return sign | uint16_t(exp << 7) | uint16_t(mant);
  }
  return sign | uint16_t(((b & 0x7F) << 4) + (120 << 7));
}

struct Tables {
  alignas(64) uint16_t special[32];  // by the code's low 5 bits: exponent field 0 (0 .. 7) or 15 (24 .. 31)
  float value[256];                  // every code as f32 (the scalar tail)
  Tables() {
    for (int i = 0; i < 32; ++i) special[i] = Bf16OfCode(uint8_t(i < 8 ? i : (0x78 | (i & 7))));
    for (int c = 0; c < 256; ++c) {
      const uint32_t bits = uint32_t(Bf16OfCode(uint8_t(c))) << 16;
      std::memcpy(&value[c], &bits, 4);
    }
  }
};

const Tables& GetTables() {
  static const Tables tables;
  return tables;
}

// The weight formats: Widen turns the 32 codes at p into 32 bf16, exactly (see the top); Value
// is one code as f32 (the scalar tail). kType: the FFI element type of w_q.
struct FP8 {
  static constexpr ffi::DataType kType = ffi::F8E4M3FN;
  static constexpr const char* kName = "cpu fp8 matmul: w_q must be float8_e4m3fn";
  const __m512i special = _mm512_load_si512(GetTables().special);  // Tables::special
  inline __m512i Widen(const uint8_t* p) const;
  static float Value(uint8_t code) { return GetTables().value[code]; }
  static void Init() { GetTables(); }  // built before the threads start
};

struct Int8 {
  static constexpr ffi::DataType kType = ffi::S8;
  static constexpr const char* kName = "cpu int8 bf16 matmul: w_q must be int8";
  inline __m512i Widen(const uint8_t* p) const {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo in words 0 .. 15, hi in 16 .. 31
  }
  static float Value(uint8_t code) { return float(int8_t(code)); }
  static void Init() {}
};

inline __m512i FP8::Widen(const uint8_t* p) const {
  const __m512i sx = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i t = _mm512_slli_epi16(sx, 4);
  __m512i r = _mm512_add_epi16(_mm512_and_si512(t, _mm512_set1_epi16(0x07F0)), _mm512_set1_epi16(120 << 7));
  // exponent field 0 or 15 <=> bits 4..6 of (code + 8) are clear
  const __mmask32 is_special = _mm512_testn_epi16_mask(_mm512_add_epi16(sx, _mm512_set1_epi16(8)),
                                                     _mm512_set1_epi16(0x70));
  r = _mm512_mask_permutexvar_epi16(r, is_special, sx, special);
  return _mm512_ternarylogic_epi32(r, sx, _mm512_set1_epi16(int16_t(0x8000)), 0xF8);  // r | (sx & 0x8000)
}

// The 16 horizontal sums of a[r][j] in one vector, lane 4 r + j: a tree of adds over shuffles.
inline __m512 SumEach(const __m512 a[kRows][kOuts]) {
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

// acc + the pair products of bf16 x and w (vdpbf16ps). Inline asm, as the int8 kernel's Dot:
// keeps the accumulator array in registers.
inline __m512 Dot(__m512 acc, __m512i x, __m512i w) {
  __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

enum Source { kWiden, kWidenStore, kBuffer };

// y[m0 .. m0 + R, o0 .. o0 + kOuts] from the bf16 rows xb [M, I] and the weight tile: widened
// from w_q (kWiden; kWidenStore also stores it to wb [kOuts, I]) or read from wb (kBuffer).
template <class F, int R, Source S>
inline void Tile(const uint16_t* xb, const uint8_t* w, uint16_t* wb, int64_t in, int64_t m0, int64_t o0,
                 int64_t out, const float* w_scale, float* y) {
  __m512 acc[kRows][kOuts];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const F format{};
  const uint8_t* wr = w + o0 * in;
  const uint16_t* xr = xb + m0 * in;
  for (int64_t c = 0; c < in; c += 32) {
    __m512i wv[kOuts];
    if (S == kBuffer) {
      for (int64_t j = 0; j < kOuts; ++j) wv[j] = _mm512_load_si512(wb + j * in + c);
    } else {
      if ((c & 63) == 0)
        for (int64_t j = 0; j < kOuts; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(wr + (kOuts * kPrefetchTiles + j) * in + c), _MM_HINT_T0);
      for (int64_t j = 0; j < kOuts; ++j) {
        wv[j] = format.Widen(wr + j * in + c);
        if (S == kWidenStore) _mm512_store_si512(wb + j * in + c, wv[j]);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(xr + r * in + c);
      for (int64_t j = 0; j < kOuts; ++j) acc[r][j] = Dot(acc[r][j], xv, wv[j]);
    }
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, SumEach(acc));
  const __m128 scale = _mm_loadu_ps(w_scale + o0);
  for (int64_t r = 0; r < R; ++r) _mm_storeu_ps(y + (m0 + r) * out + o0, _mm_mul_ps(_mm_load_ps(lanes + 4 * r), scale));
}

template <class F, Source S>
inline void TileRows(int64_t rows, const uint16_t* xb, const uint8_t* w, uint16_t* wb, int64_t in, int64_t m0,
                     int64_t o0, int64_t out, const float* ws, float* y) {
  switch (rows) {
    case 1: return Tile<F, 1, S>(xb, w, wb, in, m0, o0, out, ws, y);
    case 2: return Tile<F, 2, S>(xb, w, wb, in, m0, o0, out, ws, y);
    case 3: return Tile<F, 3, S>(xb, w, wb, in, m0, o0, out, ws, y);
    default: return Tile<F, 4, S>(xb, w, wb, in, m0, o0, out, ws, y);
  }
}

// y[:, o_begin .. o_end] (a multiple of kOuts wide); wb: kOuts x I bf16, 64-byte aligned.
template <class F>
void Outputs(const uint16_t* xb, const uint8_t* w, const float* ws, int64_t m, int64_t in, int64_t out,
             int64_t o_begin, int64_t o_end, uint16_t* wb, float* y) {
  for (int64_t o0 = o_begin; o0 < o_end; o0 += kOuts) {
    if (m <= kRows) {
      TileRows<F, kWiden>(m, xb, w, wb, in, 0, o0, out, ws, y);
      continue;
    }
    TileRows<F, kWidenStore>(kRows, xb, w, wb, in, 0, o0, out, ws, y);
    for (int64_t m0 = kRows; m0 < m; m0 += kRows)
      TileRows<F, kBuffer>(std::min(kRows, m - m0), xb, w, wb, in, m0, o0, out, ws, y);
  }
}

// The last O % kOuts outputs, one at a time (scalar).
template <class F>
void TailOutput(const uint16_t* xb, const uint8_t* w, int64_t m, int64_t in, int64_t o, int64_t out,
                const float* ws, float* y) {
  const uint8_t* wr = w + o * in;
  for (int64_t r = 0; r < m; ++r) {
    float acc = 0.0f;
    for (int64_t i = 0; i < in; ++i) {
      const uint32_t bits = uint32_t(xb[r * in + i]) << 16;
      float xv;
      std::memcpy(&xv, &bits, 4);
      acc += xv * F::Value(wr[i]);
    }
    y[r * out + o] = acc * ws[o];
  }
}

template <class F>
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::Buffer<ffi::F32> w_scale, ffi::ResultBuffer<ffi::F32> y) {
  if (w.element_type() != F::kType) return ffi::Error::InvalidArgument(F::kName);
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto sd = w_scale.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 1 || xd[1] != wd[1] || sd[0] != wd[0] || wd[1] % 32 != 0)
    return ffi::Error::InvalidArgument("cpu 8-bit matmul: x [M, I], w_q [O, I], w_scale [O] with I % 32 == 0");
  const int64_t m = xd[0], in = xd[1], out = wd[0];
  float* yp = y->typed_data();
  if (m == 0 || out == 0) return ffi::Error::Success();
  if (in == 0) {
    std::memset(yp, 0, m * out * sizeof(float));
    return ffi::Error::Success();
  }
  F::Init();
  // x rounded to bf16 (round to nearest even, as x.astype(bfloat16))
  std::vector<uint16_t> xb(m * in);
  const float* xp = x.typed_data();
  for (int64_t i = 0; i < m * in; i += 32) {
    const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xp + i + 16), _mm512_loadu_ps(xp + i));
    _mm512_storeu_si512(xb.data() + i, (__m512i)pair);
  }
  const uint8_t* wp = static_cast<const uint8_t*>(w.untyped_data());
  const float* ws = w_scale.typed_data();
  const int64_t out_tiles = out / kOuts * kOuts;
  const int64_t tasks = (out_tiles + kBlock - 1) / kBlock;
  pagedjax::ParallelFor(pool, tasks, [&](int64_t t) {
    uint16_t* wb = nullptr;
    std::vector<uint16_t> buffer;
    if (m > kRows) {
      buffer.resize(kOuts * in + 32);
      wb = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
    }
    Outputs<F>(xb.data(), wp, ws, m, in, out, t * kBlock, std::min(out_tiles, (t + 1) * kBlock), wb, yp);
  });
  for (int64_t o = out_tiles; o < out; ++o) TailOutput<F>(xb.data(), wp, m, in, o, out, ws, yp);
  return ffi::Error::Success();
}

ffi::Error MatmulFP8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                         ffi::Buffer<ffi::F32> w_scale, ffi::ResultBuffer<ffi::F32> y) {
  return MatmulImpl<FP8>(pool, x, w, w_scale, y);
}

ffi::Error MatmulInt8BF16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                              ffi::Buffer<ffi::F32> w_scale, ffi::ResultBuffer<ffi::F32> y) {
  return MatmulImpl<Int8>(pool, x, w, w_scale, y);
}

}  // namespace

// x [M, I] f32, w_q [O, I] (float8_e4m3fn / int8), w_scale [O] f32 -> y [M, O] f32
#define PAGEDJAX_BIND_8BIT        \
  ffi::Ffi::Bind()                \
      .Ctx<ffi::ThreadPool>()     \
      .Arg<ffi::Buffer<ffi::F32>>() \
      .Arg<ffi::AnyBuffer>()      \
      .Arg<ffi::Buffer<ffi::F32>>() \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulFP8, MatmulFP8Impl, PAGEDJAX_BIND_8BIT);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulInt8BF16, MatmulInt8BF16Impl, PAGEDJAX_BIND_8BIT);
