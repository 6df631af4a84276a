// Paged attention for the CPU backend, called from JAX through the XLA FFI.
//
// Packed (ragged) layout, the contract of packed_paged_attention (packed.py):
//   q [T, H, D] f32 (the query tokens of all sequences, laid end to end),
//   k_pages / v_pages [Hkv, NB, BS, D] f32, bf16, int8 or f8e4m3fn, block_tables [S, MB] i32,
//   kv_lens [S] i32, q_starts [S] i32, q_lens [S] i32  ->  out [T, H, D] f32;
//   int8 / f8e4m3fn pages come with k_scales / v_scales [Hkv, NB, BS] f16 (one per token and
//   kv head, kv_quant.py): a key is k_pages[h, b, t, :] * k_scales[h, b, t].
// bf16 pages are widened to f32 as they are read (a 16-bit shift), quantized ones widened and
// multiplied by their token's scale as they are read (no dequantized copy of the pool); all
// arithmetic is f32. Handlers: PagedAttentionF32, PagedAttentionBF16, PagedAttentionInt8 and
// PagedAttentionFP8 (the last two take the scale buffers after the pages).
// Sequence s owns query tokens [q_starts[s], q_starts[s] + q_lens[s]); its query j sits at
// position kv_lens[s] - q_lens[s] + j and attends causally to keys 0..that position (and
// < kv_lens[s]). Tokens no sequence owns, and sequences with no key, give zeros. (The padded
// [S, Q] layout is the special case q_starts[s] = s * Q.)
// Attributes: scale; sliding_window (> 0: the query at p sees key t only if p - t < window;
// 0: no window); soft_cap (> 0: a scaled score s becomes soft_cap * tanh(s / soft_cap) before
// masking; 0: off). With a window, a task starts at the first page holding a key inside the
// window of the sequence's earliest query: pages wholly before it are never read.
// Table entries past a sequence's keys are never read; out-of-range entries in use are
// clamped to [0, NB) (as the ragged path does).
//
// One task per (sequence, kv head): it walks the sequence's pages once, up to the last key
// any of its queries sees, 16 keys (a tile) at a time, and keeps an online softmax (max, sum,
// accumulator) per query row. A tile's keys are transposed to [D, 16] (in registers with
// AVX-512), so a row's 16 scores are D vector FMAs with no horizontal sums, and each loaded
// key or value vector serves 4 query rows. Work follows each sequence's own length. Tasks are shared between the calling thread and
// XLA's intra-op thread pool (parallel_for.h). Built at first use by cpu_native.py (g++ -O3 -march=native;
// no -ffast-math: with GCC 12 it links crtfastmath.o, which turns on flush-to-zero for the
// whole process).
#include <algorithm>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel_for.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNoMax = -3.0e38f;

struct Shapes {
  int64_t t, s, h, d, hkv, nb, bs, mb;
};

// A page element as f32: f32 as is; bf16 (its bits in a uint16_t) is the top half of an f32.
inline float Widen(float x) { return x; }
inline float Widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// An f8e4m3fn page element (its bits); int8 pages are int8_t. Quantized elements are widened
// to a "raw" f32 and multiplied by a per-token factor (RawFactor x the token's f16 scale): int8
// raw is the integer; f8e4m3fn raw is the value / 256: its sign, exponent field and mantissa
// placed in an f16's (bias 15 for 7) and converted in hardware, subnormals included, with no
// f32 denormal on the way. raw x (256 x scale) rounds once, as value x scale does: the same f32.
struct Fp8E4M3 { uint8_t bits; };
template <typename P>
constexpr bool kQuantized = std::is_same_v<P, int8_t> || std::is_same_v<P, Fp8E4M3>;
template <typename P>
constexpr float RawFactor = std::is_same_v<P, Fp8E4M3> ? 256.f : 1.f;

inline float Widen(int8_t x) { return static_cast<float>(x); }
inline float Widen(Fp8E4M3 x) {  // the raw value: e4m3fn / 256 (exact); 0x7F / 0xFF: NaN
  const int e = (x.bits >> 3) & 15, m = x.bits & 7;
  float f;
  if ((x.bits & 0x7F) == 0x7F) {
    f = std::numeric_limits<float>::quiet_NaN();
  } else {
    const uint32_t bits = e == 0 ? 0u : (static_cast<uint32_t>(e - 7 - 8 + 127) << 23) | (static_cast<uint32_t>(m) << 20);
    std::memcpy(&f, &bits, sizeof f);
    if (e == 0) f = static_cast<float>(m) * (1.f / 131072.f);  // m * 2^-9 / 256
  }
  return (x.bits & 0x80) ? -f : f;
}

// An f16 (its bits) as f32.
inline float HalfToFloat(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
  float f;
  if (e == 0) {
    f = static_cast<float>(m) * (1.f / 16777216.f);  // m * 2^-24
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (e == 31 ? (0xFFu << 23) | (m << 13) : ((e + 112) << 23) | (m << 13));
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// ExpSoftmax's constants (shared with its 8-lane form, ExpSoftmax8).
constexpr float kExpRound = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
constexpr float kExpLog2e = 1.44269504088896341f, kExpLn2Hi = 0.693359375f, kExpLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
constexpr float kExpClamp = -88.f;  // keeps n a small integer
constexpr float kExpZeroBelow = -87.f;

// e^x for the softmax's x <= 0: x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), Cephes' degree-6
// polynomial for e^r (relative error ~1e-7, f32 rounding), 2^n through the exponent bits;
// x < -87: 0. Plain arithmetic (std::exp does not vectorize without -ffast-math).
inline float ExpSoftmax(float x) {
  const float xc = std::max(x, kExpClamp);
  const float n = (xc * kExpLog2e + kExpRound) - kExpRound;
  float r = std::fma(n, -kExpLn2Hi, xc);
  r = std::fma(n, -kExpLn2Lo, r);
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kExpPoly[i]);
  p = std::fma(p * r, r, r) + 1.f;
  const uint32_t bits = static_cast<uint32_t>(std::max(static_cast<int32_t>(n) + 127, 1)) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < kExpZeroBelow ? 0.f : p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// ExpSoftmax on 8 lanes, the same steps: GCC left the softmax's loop over it scalar, and with
// this (and the P.V accumulators in kDChunk pieces) the kernel alone, 30 layers of 8 sequences
// x 200 keys on a 2-core AMD EPYC, went 4.3-4.5 -> 3.7 ms at 1 query token each, 7.2-9.1 ->
// 5.9-6.9 at 2, 11.2-13.8 -> 8.7-10.2 at 4 (two in-process A/B runs, 25 alternated calls each).
inline __m256 ExpSoftmax8(__m256 x) {
  const __m256 round = _mm256_set1_ps(kExpRound);
  const __m256 xc = _mm256_max_ps(_mm256_set1_ps(kExpClamp), x);  // x itself when NaN (maxps: the second if unordered)
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(kExpLog2e), round), round);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kExpLn2Hi), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kExpLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_max_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)),
                                     _mm256_set1_epi32(1));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kExpZeroBelow), _CMP_NLT_UQ);  // x < -87: 0 (NaN stays NaN)
  return _mm256_and_ps(_mm256_mul_ps(p, scale), keep);
}
#endif

constexpr int64_t kTile = 16;     // keys scored at once: one 16-lane f32 vector

// kt [D, kTile] = the n <= kTile rows k [n, D], widened to f32 and transposed (zeros past n);
// quantized rows are multiplied by their factor rs[t] (unused otherwise).
template <typename P>
inline void TransposeTileScalar(const P* k, int64_t n, int64_t d, const float* rs, float* kt) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < d; ++i) {
      if constexpr (kQuantized<P>) kt[i * kTile + t] = Widen(k[t * d + i]) * rs[t];
      else kt[i * kTile + t] = Widen(k[t * d + i]);
    }
  for (int64_t i = 0; i < d; ++i)
    for (int64_t t = n; t < kTile; ++t) kt[i * kTile + t] = 0.f;
}

#if defined(__AVX512F__)
// 16 quantized elements as raw f32 (see Widen).
inline __m512 LoadRaw16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 LoadRaw16(const Fp8E4M3* p) {
  // sign-extended to 16 bits and shifted by 7: the sign in bits 15 and 14, exponent and mantissa
  // in 13..7; clearing bit 14 leaves the f16 bits
  const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  const __m512 f = _mm512_cvtph_ps(h);
  // 0x7F / 0xFF (NaN) land on +-1.875, past the largest finite raw value (448 / 256 = 1.75)
  const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_abs_ps(f), _mm512_set1_ps(1.875f), _CMP_EQ_OQ);
  return _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}

// Row t of a 16 x 16 block of k (starting at column c) as 16 f32 lanes; zeros for t >= n.
inline __m512 LoadRow(const float* k, int64_t t, int64_t n, int64_t d, int64_t c, const float*) {
  return t < n ? _mm512_loadu_ps(k + t * d + c) : _mm512_setzero_ps();
}
inline __m512 LoadRow(const uint16_t* k, int64_t t, int64_t n, int64_t d, int64_t c, const float*) {
  if (t >= n) return _mm512_setzero_ps();
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + t * d + c));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bf16 -> f32
}
template <typename P, typename = std::enable_if_t<kQuantized<P>>>
inline __m512 LoadRow(const P* k, int64_t t, int64_t n, int64_t d, int64_t c, const float* rs) {
  return t < n ? _mm512_mul_ps(LoadRaw16(k + t * d + c), _mm512_set1_ps(rs[t])) : _mm512_setzero_ps();
}

// The same in registers, 16 x 16 blocks at a time (D a multiple of 16).
template <typename P>
inline void TransposeTile(const P* k, int64_t n, int64_t d, const float* rs, float* kt) {
  if (d % 16 != 0) return TransposeTileScalar(k, n, d, rs, kt);
  for (int64_t c = 0; c < d; c += 16) {
    __m512 r[16], t[16];
    for (int64_t i = 0; i < 16; ++i) r[i] = LoadRow(k, i, n, d, c, rs);
    for (int i = 0; i < 16; i += 2) {  // pairs of rows, within 128-bit lanes
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // r[i + j], lane L: column 4 L + j of rows i..i+3
      r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
      r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
      r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int j = 0; j < 4; ++j) {  // gather lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
      const __m512 v0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), v1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
      const __m512 v2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88), v3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
      _mm512_storeu_ps(kt + (c + j) * kTile, _mm512_shuffle_f32x4(v0, v2, 0x88));
      _mm512_storeu_ps(kt + (c + 4 + j) * kTile, _mm512_shuffle_f32x4(v1, v3, 0x88));
      _mm512_storeu_ps(kt + (c + 8 + j) * kTile, _mm512_shuffle_f32x4(v0, v2, 0xDD));
      _mm512_storeu_ps(kt + (c + 12 + j) * kTile, _mm512_shuffle_f32x4(v1, v3, 0xDD));
    }
  }
}
#elif defined(__AVX2__)
// Row t of an 8 x 8 block of k (starting at column c) as 8 f32 lanes; zeros for t >= n.
inline __m256 LoadRow8(const float* k, int64_t t, int64_t n, int64_t d, int64_t c, const float*) {
  return t < n ? _mm256_loadu_ps(k + t * d + c) : _mm256_setzero_ps();
}
inline __m256 LoadRow8(const uint16_t* k, int64_t t, int64_t n, int64_t d, int64_t c, const float*) {
  if (t >= n) return _mm256_setzero_ps();
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k + t * d + c));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bf16 -> f32
}
// 8 quantized elements as raw f32 (see Widen).
inline __m256 LoadRaw8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 LoadRaw8(const Fp8E4M3* p) {
#if defined(__F16C__)
  const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));  // as LoadRaw16
  const __m128i h = _mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
  const __m256 f = _mm256_cvtph_ps(h);
  const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.f), f);
  const __m256 nan = _mm256_cmp_ps(abs, _mm256_set1_ps(1.875f), _CMP_EQ_OQ);  // 0x7F / 0xFF
  return _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = Widen(p[i]);
  return _mm256_load_ps(f);
#endif
}
template <typename P, typename = std::enable_if_t<kQuantized<P>>>
inline __m256 LoadRow8(const P* k, int64_t t, int64_t n, int64_t d, int64_t c, const float* rs) {
  return t < n ? _mm256_mul_ps(LoadRaw8(k + t * d + c), _mm256_set1_ps(rs[t])) : _mm256_setzero_ps();
}

// AVX2 (no AVX-512): the same, 8 x 8 blocks at a time (D a multiple of 8).
template <typename P>
inline void TransposeTile(const P* k, int64_t n, int64_t d, const float* rs, float* kt) {
  if (d % 8 != 0) return TransposeTileScalar(k, n, d, rs, kt);
  for (int64_t t0 = 0; t0 < kTile; t0 += 8)
    for (int64_t c = 0; c < d; c += 8) {
      __m256 r[8], t[8];
      for (int64_t i = 0; i < 8; ++i) r[i] = LoadRow8(k, t0 + i, n, d, c, rs);
      for (int i = 0; i < 8; i += 2) {  // pairs of rows, within 128-bit lanes
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {  // r[i + j], lane L: column 4 L + j of rows i..i+3
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int j = 0; j < 4; ++j) {  // columns j and 4 + j: the low / high 128-bit halves of rows 0-3 and 4-7
        _mm256_storeu_ps(kt + (c + j) * kTile + t0, _mm256_permute2f128_ps(r[j], r[4 + j], 0x20));
        _mm256_storeu_ps(kt + (c + 4 + j) * kTile + t0, _mm256_permute2f128_ps(r[j], r[4 + j], 0x31));
      }
    }
}
#else
template <typename P>
inline void TransposeTile(const P* k, int64_t n, int64_t d, const float* rs, float* kt) {
  TransposeTileScalar(k, n, d, rs, kt);
}
#endif

// vt [n, D] = the quantized rows v [n, D] as f32, row t multiplied by its factor rs[t].
template <typename P>
inline void DequantRows(const P* v, int64_t n, int64_t d, const float* rs, float* vt) {
  for (int64_t t = 0; t < n; ++t) {
    const P* src = v + t * d;
    float* dst = vt + t * d;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 f = _mm512_set1_ps(rs[t]);
    for (; i + 16 <= d; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(LoadRaw16(src + i), f));
#elif defined(__AVX2__)
    const __m256 f = _mm256_set1_ps(rs[t]);
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(LoadRaw8(src + i), f));
#endif
    for (; i < d; ++i) dst[i] = Widen(src[i]) * rs[t];
  }
}
constexpr int64_t kRowBlock = 4;  // query rows sharing each key load
// Head dims the P.V accumulators take at a time: kRowBlock x kDChunk floats in vector registers
// (AVX-512: 4 x 64 = 16 of its 32; AVX2: 4 x 16 = 8 of 16, where 4 x 64 would spill).
#if defined(__AVX512F__)
constexpr int64_t kDChunk = 64;
#else
constexpr int64_t kDChunk = 16;
#endif

// One tile of n <= kTile keys for every query row of a task. k, v: the tile's rows [n, D] in
// the page (P: float, uint16_t holding bf16, int8_t or Fp8E4M3); ks, vs [n]: quantized pages'
// per-key factors (RawFactor x scale; unused otherwise). qs [rows_pad, D]: the queries, pre-scaled,
// zero-padded to a multiple of kRowBlock rows; seen [rows_pad]: how many of the tile's keys
// each row sees (causal; 0..n), from [rows_pad]: the first of them (sliding window; 0
// without; a row with from >= seen must have seen 0); soft_cap > 0: scores soft-capped. Updates each row's running max m, sum l and accumulator acc
// [rows_pad, D]. kt [D, kTile], vt [kTile, D], p [kRowBlock, kTile]: scratch.
// The keys are transposed into kt so that a row's kTile scores come out of D vector FMAs with
// no horizontal sums; each key vector then serves kRowBlock rows.
template <int64_t kD, typename P>
void TileStep(const float* __restrict qs, const P* __restrict k, const P* __restrict v,
              const float* __restrict ks, const float* __restrict vs, int64_t n,
              int64_t dim, int64_t rows_pad, const int64_t* __restrict seen, const int64_t* __restrict from,
              float soft_cap, float* __restrict kt,
              float* __restrict vt, float* __restrict p, float* __restrict acc, float* __restrict m,
              float* __restrict l) {
  const int64_t d = kD > 0 ? kD : dim;
  TransposeTile(k, n, d, ks, kt);
  const float* vr = reinterpret_cast<const float*>(v);
  if constexpr (kQuantized<P>) {
    DequantRows(v, n, d, vs, vt);
    vr = vt;
  } else if constexpr (!std::is_same_v<P, float>) {
#pragma omp simd
    for (int64_t i = 0; i < n * d; ++i) vt[i] = Widen(v[i]);
    vr = vt;
  }
  for (int64_t r0 = 0; r0 < rows_pad; r0 += kRowBlock) {
    int64_t block_seen = 0;
    for (int64_t b = 0; b < kRowBlock; ++b) block_seen = std::max(block_seen, seen[r0 + b]);
    if (block_seen == 0) continue;
    float s[kRowBlock][kTile] = {};
    for (int64_t i = 0; i < d; ++i) {
      const float* kr = kt + i * kTile;
      for (int64_t b = 0; b < kRowBlock; ++b) {
        const float qv = qs[(r0 + b) * d + i];
#pragma omp simd
        for (int64_t t = 0; t < kTile; ++t) s[b][t] += qv * kr[t];
      }
    }
    for (int64_t b = 0; b < kRowBlock; ++b) {
      const int64_t r = r0 + b, nr = seen[r], fr = from[r];
      float* pr = p + b * kTile;
      if (nr == 0) {  // this row sees none of the tile: weights 0, state unchanged
        std::fill_n(pr, kTile, 0.f);
        continue;
      }
      if (soft_cap > 0.f) {
        const float inv_cap = 1.f / soft_cap;
        for (int64_t t = fr; t < nr; ++t) s[b][t] = soft_cap * std::tanh(s[b][t] * inv_cap);
      }
      float mx = kNoMax;
      for (int64_t t = fr; t < nr; ++t) mx = std::max(mx, s[b][t]);
      const float m_new = std::max(m[r], mx);
      const float alpha = ExpSoftmax(m[r] - m_new);  // 0 on the first tile (m = kNoMax)
      float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
      __m256 vsum = _mm256_setzero_ps();
      for (int64_t t = 0; t < kTile; t += 8) {  // lanes fr <= t + i < nr only
        const __m256 lane = _mm256_add_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(float(t)));
        const __m256 seen_mask = _mm256_and_ps(_mm256_cmp_ps(lane, _mm256_set1_ps(float(nr)), _CMP_LT_OQ),
                                               _mm256_cmp_ps(lane, _mm256_set1_ps(float(fr)), _CMP_GE_OQ));
        const __m256 e = _mm256_and_ps(ExpSoftmax8(_mm256_sub_ps(_mm256_loadu_ps(&s[b][t]), _mm256_set1_ps(m_new))),
                                       seen_mask);
        _mm256_storeu_ps(pr + t, e);
        vsum = _mm256_add_ps(vsum, e);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vsum);
      for (float x : lanes) sum += x;
#else
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < kTile; ++t) {
        const float e = t < nr && t >= fr ? ExpSoftmax(s[b][t] - m_new) : 0.f;
        pr[t] = e;
        sum += e;
      }
#endif
      m[r] = m_new;
      l[r] = l[r] * alpha + sum;
      float* a = acc + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] *= alpha;
    }
    if constexpr (kD > 0 && kD % kDChunk == 0) {  // the block's accumulators in registers, kDChunk lanes at a time
      for (int64_t c = 0; c < kD; c += kDChunk) {
        float o[kRowBlock][kDChunk];
        for (int64_t b = 0; b < kRowBlock; ++b)
#pragma omp simd
          for (int64_t i = 0; i < kDChunk; ++i) o[b][i] = acc[(r0 + b) * kD + c + i];
        for (int64_t t = 0; t < block_seen; ++t) {
          const float* vrow = vr + t * kD + c;
          for (int64_t b = 0; b < kRowBlock; ++b) {
            const float w = p[b * kTile + t];
#pragma omp simd
            for (int64_t i = 0; i < kDChunk; ++i) o[b][i] += w * vrow[i];
          }
        }
        for (int64_t b = 0; b < kRowBlock; ++b)
#pragma omp simd
          for (int64_t i = 0; i < kDChunk; ++i) acc[(r0 + b) * kD + c + i] = o[b][i];
      }
    } else {
      for (int64_t t = 0; t < block_seen; ++t) {
        const float* vrow = vr + t * d;
        for (int64_t b = 0; b < kRowBlock; ++b) {
          const float w = p[b * kTile + t];
          float* a = acc + (r0 + b) * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) a[i] += w * vrow[i];
        }
      }
    }
  }
}

// A task's working memory, kept per thread across calls (no allocation per task).
struct Scratch {
  std::vector<float> m, l, acc, qs, kt, vt, p, ks, vs;
  std::vector<int64_t> limit, lo, seen, from;
};

// Attention of sequence `seq` against kv head `hk`: every query row j * G + g. kD > 0 fixes
// the head dim at compile time (unrolled inner loops); 0 reads it from sh. P: the page
// element type (float, uint16_t holding bf16, int8_t or Fp8E4M3); ksp, vsp: the f16 scales
// [Hkv, NB, BS] of quantized pages (null otherwise).
template <int64_t kD, typename P>
void AttendOne(const Shapes& sh, int64_t seq, int64_t hk, const float* q, const P* kp,
               const P* vp, const uint16_t* ksp, const uint16_t* vsp, const int32_t* tables, const int32_t* kv_lens,
               const int32_t* q_starts, const int32_t* q_lens, float scale, int64_t window, float soft_cap,
               float* out) {
  const int64_t g_count = sh.h / sh.hkv, d = kD > 0 ? kD : sh.d, bs = sh.bs;
  const int64_t q0 = q_starts[seq];  // first query token of the sequence in q / out
  if (q0 < 0 || q0 >= sh.t) return;
  const int64_t q_len = std::min<int64_t>(q_lens[seq], sh.t - q0);
  const int64_t kv_len = std::min<int64_t>(kv_lens[seq], sh.mb * bs);  // keys exist only in the table
  if (q_len <= 0 || kv_len <= 0) return;  // out is zeroed before the tasks run
  const int64_t first_pos = kv_lens[seq] - q_lens[seq];
  const int64_t rows = q_len * g_count, rows_pad = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  thread_local Scratch scratch;
  Scratch& w = scratch;
  w.m.assign(rows_pad, kNoMax);  // a finite "minus infinity": exp(kNoMax - max) is exactly 0 (no inf - inf)
  w.l.assign(rows_pad, 0.f);
  w.acc.assign(rows_pad * d, 0.f);
  w.qs.assign(rows_pad * d, 0.f);
  w.kt.resize(d * kTile);
  w.vt.resize(kTile * d);
  w.p.resize(kRowBlock * kTile);
  w.ks.resize(kTile);
  w.vs.resize(kTile);
  w.limit.assign(rows_pad, -1);  // last key position each row sees (-1: padding, sees none)
  w.lo.assign(rows_pad, 0);  // first key position each row sees (sliding window; 0 without)
  w.seen.resize(rows_pad);
  w.from.assign(rows_pad, 0);
  int64_t last = -1;
  for (int64_t j = 0; j < q_len; ++j) {
    const int64_t lim = std::min(first_pos + j, kv_len - 1);
    last = std::max(last, lim);
    for (int64_t g = 0; g < g_count; ++g) {
      const int64_t r = j * g_count + g;
      w.limit[r] = lim;
      if (window > 0) w.lo[r] = std::max<int64_t>(first_pos + j - window + 1, 0);
      const float* src = q + ((q0 + j) * sh.h + hk * g_count + g) * d;
      for (int64_t i = 0; i < d; ++i) w.qs[r * d + i] = src[i] * scale;
    }
  }
  const int32_t* table = tables + seq * sh.mb;
  // with a window, the first page (and tile in it) holding a key the earliest query (j = 0) sees
  const int64_t first_key = window > 0 ? std::max<int64_t>(first_pos - window + 1, 0) : 0;
  const int64_t first_page = first_key / bs;
  for (int64_t page = first_page; page * bs <= last; ++page) {
    const int64_t blk = std::clamp<int64_t>(table[page], 0, sh.nb - 1);
    const int64_t page_seen = std::min(bs, last - page * bs + 1);  // keys of this page any row sees
    const P* kb = kp + (hk * sh.nb + blk) * bs * d;  // [BS, D]
    const P* vb = vp + (hk * sh.nb + blk) * bs * d;
    if ((page + 1) * bs <= last) {  // pages are scattered: fetch the next one while on this one
      const int64_t nxt_blk = hk * sh.nb + std::clamp<int64_t>(table[page + 1], 0, sh.nb - 1), nxt = nxt_blk * bs * d;
      for (int64_t i = 0; i < bs * d; i += 64 / static_cast<int64_t>(sizeof(P))) {  // a cache line
        __builtin_prefetch(kp + nxt + i);
        __builtin_prefetch(vp + nxt + i);
      }
      if constexpr (kQuantized<P>)
        for (int64_t i = 0; i < bs; i += 32) {
          __builtin_prefetch(ksp + nxt_blk * bs + i);
          __builtin_prefetch(vsp + nxt_blk * bs + i);
        }
    }
    const int64_t tile0 = page == first_page ? (first_key - page * bs) / kTile * kTile : 0;
    for (int64_t t0 = tile0; t0 < page_seen; t0 += kTile) {
      const int64_t n = std::min(kTile, page_seen - t0), base = page * bs + t0;
      for (int64_t r = 0; r < rows_pad; ++r) w.seen[r] = std::clamp<int64_t>(w.limit[r] - base + 1, 0, n);
      if (window > 0) {
        bool any = false;
        for (int64_t r = 0; r < rows_pad; ++r) {
          w.from[r] = std::clamp<int64_t>(w.lo[r] - base, 0, n);
          if (w.from[r] >= w.seen[r]) w.seen[r] = w.from[r] = 0;  // the tile is before the row's window
          any = any || w.seen[r] > 0;
        }
        if (!any) continue;  // before every row's window
      }
      if constexpr (kQuantized<P>) {
        const uint16_t* ksb = ksp + (hk * sh.nb + blk) * bs + t0;
        const uint16_t* vsb = vsp + (hk * sh.nb + blk) * bs + t0;
        for (int64_t t = 0; t < n; ++t) {
          w.ks[t] = HalfToFloat(ksb[t]) * RawFactor<P>;
          w.vs[t] = HalfToFloat(vsb[t]) * RawFactor<P>;
        }
      }
      TileStep<kD, P>(w.qs.data(), kb + t0 * d, vb + t0 * d, w.ks.data(), w.vs.data(), n, d, rows_pad,
                      w.seen.data(), w.from.data(), soft_cap, w.kt.data(), w.vt.data(), w.p.data(), w.acc.data(), w.m.data(), w.l.data());
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (w.l[r] <= 0.f) continue;
    const int64_t j = r / g_count, g = r % g_count;
    float* o = out + ((q0 + j) * sh.h + hk * g_count + g) * d;
    const float inv = 1.f / w.l[r];
    for (int64_t i = 0; i < d; ++i) o[i] = w.acc[r * d + i] * inv;
  }
}

// The handlers' body: checks shapes, zeroes out, runs a task per (sequence, kv head).
// P: the page element type; PageBuf: the pages' buffer type (f8e4m3fn has no FFI native type:
// an AnyBuffer of that dtype). k_scales / v_scales: quantized pages' f16 scales (null otherwise).
template <typename P, typename PageBuf>
ffi::Error RunAttention(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, PageBuf& k_pages,
                        PageBuf& v_pages, ffi::Buffer<ffi::F16>* k_scales,
                        ffi::Buffer<ffi::F16>* v_scales, ffi::Buffer<ffi::S32>& block_tables,
                        ffi::Buffer<ffi::S32>& kv_lens, ffi::Buffer<ffi::S32>& q_starts,
                        ffi::Buffer<ffi::S32>& q_lens, float scale, int64_t window, float soft_cap,
                        ffi::ResultBuffer<ffi::F32>& out) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto vd = v_pages.dimensions();
  auto td = block_tables.dimensions();
  auto kld = kv_lens.dimensions();
  auto qsd = q_starts.dimensions();
  auto qld = q_lens.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 || kld.size() != 1 ||
      qsd.size() != 1 || qld.size() != 1)
    return ffi::Error::InvalidArgument("paged attention: bad ranks");
  Shapes sh{qd[0], td[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[1]};
  bool same_pages = true;
  for (int i = 0; i < 4; ++i) same_pages = same_pages && kd[i] == vd[i];
  if (window < 0 || !(soft_cap >= 0.f)) return ffi::Error::InvalidArgument("paged attention: bad sliding_window / soft_cap");
  if (!same_pages || sh.hkv <= 0 || sh.nb <= 0 || sh.bs <= 0 || kd[3] != sh.d || sh.h % sh.hkv != 0 ||
      kld[0] != sh.s || qsd[0] != sh.s || qld[0] != sh.s)
    return ffi::Error::InvalidArgument("paged attention: inconsistent shapes");
  const uint16_t *ksp = nullptr, *vsp = nullptr;
  if constexpr (kQuantized<P>) {
    for (ffi::Buffer<ffi::F16>* sc : {k_scales, v_scales}) {
      auto sd = sc->dimensions();
      if (sd.size() != 3 || sd[0] != sh.hkv || sd[1] != sh.nb || sd[2] != sh.bs)
        return ffi::Error::InvalidArgument("paged attention: scales must be [Hkv, NB, BS]");
    }
    ksp = k_scales->typed_data();
    vsp = v_scales->typed_data();
  }
  const float* qp = q.typed_data();
  const P* kp = static_cast<const P*>(k_pages.untyped_data());
  const P* vp = static_cast<const P*>(v_pages.untyped_data());
  const int32_t* tp = block_tables.typed_data();
  const int32_t* kl = kv_lens.typed_data();
  const int32_t* qs = q_starts.typed_data();
  const int32_t* ql = q_lens.typed_data();
  float* op = out->typed_data();
  std::fill_n(op, sh.t * sh.h * sh.d, 0.f);  // tokens no sequence owns stay zero
  auto attend = sh.d == 64 ? AttendOne<64, P> : sh.d == 128 ? AttendOne<128, P> : AttendOne<0, P>;
  pagedjax::ParallelFor(pool, sh.s * sh.hkv, [&sh, attend, qp, kp, vp, ksp, vsp, tp, kl, qs, ql, scale, window, soft_cap,
                                              op](int64_t i) {
    attend(sh, i / sh.hkv, i % sh.hkv, qp, kp, vp, ksp, vsp, tp, kl, qs, ql, scale, window, soft_cap, op);
  });
  return ffi::Error::Success();
}

template <ffi::DataType kPage>
ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<kPage> k_pages, ffi::Buffer<kPage> v_pages,
                              ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> q_starts, ffi::Buffer<ffi::S32> q_lens, float scale,
                              int64_t sliding_window, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  return RunAttention<ffi::NativeType<kPage>>(pool, q, k_pages, v_pages, nullptr, nullptr, block_tables, kv_lens, q_starts,
                             q_lens, scale, sliding_window, soft_cap, out);
}

// Quantized pages (int8, f8e4m3fn) with their f16 scales [Hkv, NB, BS].
template <typename P, typename PageBuf>
ffi::Error PagedAttentionQuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                   PageBuf k_pages, PageBuf v_pages,
                                   ffi::Buffer<ffi::F16> k_scales, ffi::Buffer<ffi::F16> v_scales,
                                   ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
                                   ffi::Buffer<ffi::S32> q_starts, ffi::Buffer<ffi::S32> q_lens, float scale,
                                   int64_t sliding_window, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  if constexpr (std::is_same_v<PageBuf, ffi::AnyBuffer>) {
    auto fp8 = [](ffi::DataType t) { return t == ffi::F8E4M3FN || t == ffi::U8; };  // U8: the e4m3fn bytes
    if (!fp8(k_pages.element_type()) || !fp8(v_pages.element_type()))
      return ffi::Error::InvalidArgument("paged attention: pages must be f8e4m3fn (or its bytes, u8)");
  }
  return RunAttention<P>(pool, q, k_pages, v_pages, &k_scales, &v_scales, block_tables, kv_lens, q_starts,
                             q_lens, scale, sliding_window, soft_cap, out);
}

// The KV write for bf16 pools: XLA:CPU widens a bf16 scatter to f32 (a full pass over the
// pool, twice, per layer), so the engine writes bf16 pages here instead, in place:
//   k_pages / v_pages [Hkv, NB, BS, D] bf16 (aliased to the outputs), k / v [T, Hkv, D] bf16,
//   slots [T] i32 (block * BS + offset; < 0 or >= NB * BS: dropped).
ffi::Error WriteKVImpl(ffi::Buffer<ffi::BF16> k_pages, ffi::Buffer<ffi::BF16> v_pages,
                       ffi::Buffer<ffi::BF16> k, ffi::Buffer<ffi::BF16> v, ffi::Buffer<ffi::S32> slots,
                       ffi::ResultBuffer<ffi::BF16> k_out, ffi::ResultBuffer<ffi::BF16> v_out) {
  auto pd = k_pages.dimensions();
  auto nd = k.dimensions();
  auto same = [](auto a, auto b) { return std::equal(a.begin(), a.end(), b.begin(), b.end()); };
  if (pd.size() != 4 || nd.size() != 3 || nd[1] != pd[0] || nd[2] != pd[3] ||
      slots.dimensions().size() != 1 || slots.dimensions()[0] != nd[0] ||
      !same(v.dimensions(), nd) || !same(v_pages.dimensions(), pd))
    return ffi::Error::InvalidArgument("kv write: inconsistent shapes");
  const int64_t hkv = pd[0], num_slots = pd[1] * pd[2], d = pd[3], t = nd[0];
  const int32_t* sl = slots.typed_data();
  struct Side { const uint16_t* pages; const uint16_t* rows; uint16_t* out; };
  for (Side side : {Side{k_pages.typed_data(), k.typed_data(), k_out->typed_data()},
                    Side{v_pages.typed_data(), v.typed_data(), v_out->typed_data()}}) {
    if (side.out != side.pages)  // XLA gave the result its own buffer: start from the pool
      std::memcpy(side.out, side.pages, hkv * num_slots * d * sizeof(uint16_t));
    for (int64_t i = 0; i < t; ++i) {
      const int64_t slot = sl[i];
      if (slot < 0 || slot >= num_slots) continue;
      for (int64_t h = 0; h < hkv; ++h)
        std::memcpy(side.out + (h * num_slots + slot) * d, side.rows + (i * hkv + h) * d, d * sizeof(uint16_t));
    }
  }
  return ffi::Error::Success();
}

// Copy-on-write for bf16 pools (XLA:CPU widens a bf16 scatter, or an update in a loop, to f32
// over the whole pool), in place: k_pages / v_pages [Hkv, L * NB, BS, D] bf16 (aliased to the
// outputs), src / dst [C] i32: block src[i] -> dst[i] in each of the `num_layers` layers (layer
// l's blocks start at l * NB); the real copies come first, the first dst outside [0, NB) ends them.
ffi::Error CopyBlocksImpl(ffi::Buffer<ffi::BF16> k_pages, ffi::Buffer<ffi::BF16> v_pages,
                          ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst, int64_t num_layers,
                          ffi::ResultBuffer<ffi::BF16> k_out, ffi::ResultBuffer<ffi::BF16> v_out) {
  auto pd = k_pages.dimensions();
  if (pd.size() != 4 || num_layers <= 0 || pd[1] % num_layers != 0 || src.dimensions().size() != 1 ||
      dst.dimensions().size() != 1 || src.dimensions()[0] != dst.dimensions()[0] ||
      !std::equal(pd.begin(), pd.end(), v_pages.dimensions().begin(), v_pages.dimensions().end()))
    return ffi::Error::InvalidArgument("copy blocks: inconsistent shapes");
  const int64_t hkv = pd[0], total = pd[1], nb = total / num_layers, block = pd[2] * pd[3];
  const int32_t* s = src.typed_data();
  const int32_t* d = dst.typed_data();
  struct Side { const uint16_t* pages; uint16_t* out; };
  for (Side side : {Side{k_pages.typed_data(), k_out->typed_data()}, Side{v_pages.typed_data(), v_out->typed_data()}}) {
    if (side.out != side.pages) std::memcpy(side.out, side.pages, hkv * total * block * sizeof(uint16_t));
    for (int64_t i = 0; i < src.dimensions()[0] && d[i] >= 0 && d[i] < nb; ++i) {
      if (s[i] < 0 || s[i] >= nb) continue;
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t l = 0; l < num_layers; ++l) {
          const int64_t base = (h * total + l * nb) * block;
          std::memcpy(side.out + base + d[i] * block, side.out + base + s[i] * block, block * sizeof(uint16_t));
        }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedCopyBlocksBF16, CopyBlocksImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // k_pages
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // src
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst
                                  .Attr<int64_t>("num_layers")
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // k_pages, in place
                                  .Ret<ffi::Buffer<ffi::BF16>>());  // v_pages, in place

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedKVWriteBF16, WriteKVImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // k_pages
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // k
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // k_pages, in place
                                  .Ret<ffi::Buffer<ffi::BF16>>());  // v_pages, in place

#define PAGED_ATTENTION_HANDLER(name, page_type)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, PagedAttentionImpl<page_type>,                   \
                                ffi::Ffi::Bind()                                       \
                                    .Ctx<ffi::ThreadPool>()                            \
                                    .Arg<ffi::Buffer<ffi::F32>>()      /* q */         \
                                    .Arg<ffi::Buffer<page_type>>()     /* k_pages */   \
                                    .Arg<ffi::Buffer<page_type>>()     /* v_pages */   \
                                    .Arg<ffi::Buffer<ffi::S32>>()      /* block_tables */ \
                                    .Arg<ffi::Buffer<ffi::S32>>()      /* kv_lens */   \
                                    .Arg<ffi::Buffer<ffi::S32>>()      /* q_starts */  \
                                    .Arg<ffi::Buffer<ffi::S32>>()      /* q_lens */    \
                                    .Attr<float>("scale")                              \
                                    .Attr<int64_t>("sliding_window")  /* 0: none */    \
                                    .Attr<float>("soft_cap")          /* 0: off */     \
                                    .Ret<ffi::Buffer<ffi::F32>>())

PAGED_ATTENTION_HANDLER(PagedAttentionF32, ffi::F32);
PAGED_ATTENTION_HANDLER(PagedAttentionBF16, ffi::BF16);

#define PAGED_ATTENTION_QUANT_HANDLER(name, elem_type, page_type)                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (PagedAttentionQuantImpl<elem_type, page_type>), \
                                ffi::Ffi::Bind()                                       \
                                    .Ctx<ffi::ThreadPool>()                            \
                                    .Arg<ffi::Buffer<ffi::F32>>()      /* q */         \
                                    .Arg<page_type>()                  /* k_pages */   \
                                    .Arg<page_type>()                  /* v_pages */   \
                                    .Arg<ffi::Buffer<ffi::F16>>()      /* k_scales */  \
                                    .Arg<ffi::Buffer<ffi::F16>>()      /* v_scales */  \
                                    .Arg<ffi::Buffer<ffi::S32>>()      /* block_tables */ \
                                    .Arg<ffi::Buffer<ffi::S32>>()      /* kv_lens */   \
                                    .Arg<ffi::Buffer<ffi::S32>>()      /* q_starts */  \
                                    .Arg<ffi::Buffer<ffi::S32>>()      /* q_lens */    \
                                    .Attr<float>("scale")                              \
                                    .Attr<int64_t>("sliding_window")  /* 0: none */    \
                                    .Attr<float>("soft_cap")          /* 0: off */     \
                                    .Ret<ffi::Buffer<ffi::F32>>())

PAGED_ATTENTION_QUANT_HANDLER(PagedAttentionInt8, int8_t, ffi::Buffer<ffi::S8>);
PAGED_ATTENTION_QUANT_HANDLER(PagedAttentionFP8, Fp8E4M3, ffi::AnyBuffer);
