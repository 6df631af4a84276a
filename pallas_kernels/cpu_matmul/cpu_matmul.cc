// bf16 matmul for the CPU backend, called through the XLA FFI:
//   x [M, I] f32 (rounded to bf16 here, as x.astype(bfloat16) does), w [O, I] bf16 (the
//   model's [out, in] layout)  ->  y [M, O] f32 = x . w^T, products and sums in f32.
// I a multiple of 32; O a multiple of 4 (AVX512-BF16 path) or of 16 (AMX path); the Python
// side checks.
//
// Two paths, the caller picks (attribute `amx`):
// - AMX (Intel Sapphire Rapids and later): tiles of 16 weight rows x 32 inputs (read straight
//   from w, row stride I) meet x packed as pairs ("VNNI": [I/2][16 rows][2]); C^T = w . x^T
//   accumulates in 16x16 f32 tiles. A task owns 32 output features and walks every 32-row
//   block of x, so each weight row is read from memory once per call; up to 32 rows the call
//   runs at the speed the weights stream in (scripts/bench_matmul.py).
// - AVX512-BF16 (vdpbf16ps): tasks own blocks of output features, each block of 4 weight rows
//   (in L1) meets every 4-row tile of x, 16 f32 accumulators, summed by one tree of shuffles.
// XLA:CPU's library dots reach a fraction of the memory bandwidth on decode shapes (a few rows
// against a weight matrix read once).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

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

// ---- GEMV: up to 8 rows of x -------------------------------------------------------------
// A decode step of a few sequences reads every weight once and does little arithmetic per
// byte, so it is bound by how fast the weights stream in. The 4 x 4 tiles above walk four
// weight rows side by side (four short strided streams, which the hardware prefetchers follow
// badly: a 2-core AMD EPYC streamed SmolLM2's head at 10 GB/s that way, 14.7 walking one row
// at a time, a plain streaming sum 16.4; in a C++ harness, one thread) and pad x to four rows.
// Here each weight row is read start to end (the rows follow each other in w [O, I], so a
// tile reads one contiguous span), its dots with MR rows of x summed in 16 accumulators per
// tile of 16 / MR weight rows (one SumEach). MR = 1 and 2 keep two accumulators per row of x,
// so that the dependent dot chain is not the bound.
constexpr int64_t kGemvRows = 8;  // x rows up to which MatmulBF16 takes the GEMV tiles

// y[0 .. MR, o0 .. o0 + 16 / MR) from the bf16 rows xb [MR, I] and the weight rows from wr.
template <int MR>
inline void GemvTile(const uint16_t* xb, const uint16_t* wr, int64_t in, int64_t o0, int64_t m, int64_t out,
                     float* y) {
  constexpr int kO = 16 / MR, kSplit = MR <= 2 ? 2 : 1;  // accumulators per x row
  __m512 acc[16];
  for (int j = 0; j < kO; ++j) {
    const uint16_t* w = wr + j * in;
    __m512 a[MR][kSplit];
    for (auto& row : a)
      for (auto& v : row) v = _mm512_setzero_ps();
    for (int64_t c = 0; c < in; c += 32) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + c);
      const int h = kSplit == 2 ? (c / 32) & 1 : 0;
      for (int r = 0; r < MR; ++r) a[r][h] = _mm512_dpbf16_ps(a[r][h], (__m512bh)_mm512_loadu_si512(xb + r * in + c), wv);
    }
    for (int r = 0; r < MR; ++r) acc[r * kO + j] = kSplit == 2 ? _mm512_add_ps(a[r][0], a[r][kSplit - 1]) : a[r][0];
  }
  __m512 grid[kRows][kOuts];  // accumulator k at [k / 4][k % 4]: SumEach puts its sum in lane k
  for (int k = 0; k < 16; ++k) grid[k / kOuts][k % kOuts] = acc[k];
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, SumEach(grid));
  for (int r = 0; r < MR && r < m; ++r) std::memcpy(y + r * out + o0, lanes + r * kO, kO * sizeof(float));
}

// The weight rows [o_begin, o_end) against the rows of xb (MR of them, zeros past m): GEMV
// tiles, then 4 x 4 tiles for a remainder (O is a multiple of 4).
template <int MR>
void GemvBlock(const uint16_t* xb, const uint16_t* w, int64_t in, int64_t m, int64_t o_begin, int64_t o_end,
               int64_t out, float* y) {
  constexpr int kO = 16 / MR;
  int64_t o0 = o_begin;
  for (; o0 + kO <= o_end; o0 += kO) GemvTile<MR>(xb, w + o0 * in, in, o0, m, out, y);
  for (; o0 < o_end; o0 += kOuts)
    for (int64_t m0 = 0; m0 < m; m0 += kRows) Tile(xb, w, in, m0, o0, m, out, y);
}

// ---- AMX ------------------------------------------------------------------------------

constexpr int64_t kTile = 16;  // AMX tile: 16 rows; 32 bf16 (64 bytes) a row

struct TileConfig {  // the palette-1 layout ldtilecfg reads
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// r [16][16] 32-bit -> its transpose, in registers.
inline void Transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 128-bit lane L of r[i + j]: column 4 L + j of rows i .. i + 4
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int j = 0; j < 4; ++j) {
      t[h + j] = _mm512_shuffle_i32x4(r[h + j], r[h + 4 + j], 0x88);
      t[h + 4 + j] = _mm512_shuffle_i32x4(r[h + j], r[h + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xDD);
  }
}

// x [m, in] f32 -> bf16 pairs, one 16 x 32 tile (1 KiB) per (row block b, 32 inputs c):
// xp32[((b * (in / 32) + c) * 16 + r) * 16 + j] = (x[16 b + j, 32 c + 2 r], x[.., 32 c + 2 r + 1]);
// rows past m are zero.
void PackX(const float* x, int64_t m, int64_t in, uint32_t* xp) {
  const int64_t blocks = (m + kTile - 1) / kTile, chunks = in / 32;
  std::vector<uint32_t> rows(blocks * kTile * (in / 2), 0);  // x in bf16, [16 blocks][in / 2] pairs
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = 0; c < in; c += 32) {
      const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i * in + c + 16), _mm512_loadu_ps(x + i * in + c));
      _mm512_storeu_si512(rows.data() + i * (in / 2) + c / 2, (__m512i)pair);
    }
  __m512i r[16];
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t c = 0; c < chunks; ++c) {
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows.data() + (b * kTile + j) * (in / 2) + c * 16);
      Transpose16(r);
      uint32_t* tile = xp + (b * chunks + c) * 256;
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(tile + j * 16, r[j]);
    }
}

// C^T tiles for weight rows n0 .. n0 + 16 NT and x row blocks b0 .. b0 + MB (x packed):
// ct[t][b] [16 n][16 rows]. Tiles 0-3: C, 4-5: weights, 6-7: x.
template <int NT, int MB>
__attribute__((target("amx-tile,amx-bf16"))) void AmxBlock(const uint16_t* w, int64_t in, const uint32_t* xp,
                                                            int64_t b0, int64_t n0, float ct[2][2][256]) {
  const int64_t chunks = in / 32;
  _tile_zero(0);
  if (MB > 1) _tile_zero(1);
  if (NT > 1) _tile_zero(2);
  if (NT > 1 && MB > 1) _tile_zero(3);
  const uint16_t* w0 = w + n0 * in;
  const uint32_t* x0 = xp + b0 * chunks * 256;
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(4, w0 + c * 32, in * 2);
    _tile_loadd(6, x0 + c * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (MB > 1) {
      _tile_loadd(7, x0 + (chunks + c) * 256, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (NT > 1) {
      _tile_loadd(5, w0 + kTile * in + c * 32, in * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (MB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, ct[0][0], 64);
  if (MB > 1) _tile_stored(1, ct[0][1], 64);
  if (NT > 1) _tile_stored(2, ct[1][0], 64);
  if (NT > 1 && MB > 1) _tile_stored(3, ct[1][1], 64);
}

__attribute__((target("amx-tile,amx-bf16"))) void AmxTask(const uint16_t* w, int64_t in, int64_t out,
                                                           const uint32_t* xp, int64_t m, int64_t task,
                                                           float* y) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTile;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  const int64_t n0 = task * 2 * kTile, nt = std::min<int64_t>(2, (out - n0) / kTile);
  const int64_t blocks = (m + kTile - 1) / kTile;
  alignas(64) float ct[2][2][256];
  for (int64_t b0 = 0; b0 < blocks; b0 += 2) {
    const int64_t mb = std::min<int64_t>(2, blocks - b0);
    if (nt == 2 && mb == 2) AmxBlock<2, 2>(w, in, xp, b0, n0, ct);
    else if (nt == 2) AmxBlock<2, 1>(w, in, xp, b0, n0, ct);
    else if (mb == 2) AmxBlock<1, 2>(w, in, xp, b0, n0, ct);
    else AmxBlock<1, 1>(w, in, xp, b0, n0, ct);
    __m512i r[16];
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t b = 0; b < mb; ++b) {  // ct[t][b] [16 n][16 rows] -> y rows
        for (int j = 0; j < 16; ++j) r[j] = _mm512_load_si512(ct[t][b] + j * kTile);
        Transpose16(r);
        for (int64_t j = 0; j < kTile && (b0 + b) * kTile + j < m; ++j)
          _mm512_storeu_si512(y + ((b0 + b) * kTile + j) * out + n0 + t * kTile, r[j]);
      }
  }
  _tile_release();
}

// Asks Linux for the AMX tile state (once per process); false where the CPU or kernel lacks it.
bool AmxReady() {
  static const bool ready = [] {
    unsigned eax, ebx, ecx, edx;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool has_amx = (edx >> 22 & 1) && (edx >> 24 & 1);  // AMX-BF16, AMX-TILE
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return has_amx && syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ready;
}

ffi::Error MatmulAmx(ffi::ThreadPool& pool, const float* x, const uint16_t* w, int64_t m, int64_t in,
                     int64_t out, float* y) {
  if (!AmxReady()) return ffi::Error::Internal("cpu matmul: AMX asked for but not available");
  if (out % kTile != 0) return ffi::Error::InvalidArgument("cpu matmul: the AMX path needs O % 16 == 0");
  const int64_t blocks = (m + kTile - 1) / kTile;
  std::vector<uint32_t> xp(blocks * (in / 32) * 256, 0);
  PackX(x, m, in, xp.data());
  pagedjax::ParallelFor(pool, (out + 2 * kTile - 1) / (2 * kTile),
                        [&](int64_t t) { AmxTask(w, in, out, xp.data(), m, t, y); });
  return ffi::Error::Success();
}

ffi::Error MatmulBF16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                          ffi::ResultBuffer<ffi::F32> y, bool amx) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || wd[1] % 32 != 0 || wd[0] % kOuts != 0)
    return ffi::Error::InvalidArgument("cpu matmul: x [M, I], w [O, I] with I % 32 == 0 and O % 4 == 0");
  const int64_t m = xd[0], in = xd[1], out = wd[0];
  if (amx)
    return MatmulAmx(pool, x.typed_data(), reinterpret_cast<const uint16_t*>(w.typed_data()), m, in, out,
                     y->typed_data());
  const int64_t mr = m <= 2 ? m : m <= 4 ? 4 : 8;  // the GEMV tiles' rows, where m <= kGemvRows
  const int64_t m_pad = std::max((m + kRows - 1) / kRows * kRows, m <= kGemvRows ? mr : 0);
  // x rounded to bf16 (round to nearest even), zero rows up to a multiple of kRows
  std::vector<uint16_t> xb(m_pad * in, 0);
  const float* xp = x.typed_data();
  for (int64_t i = 0; i < m * in; i += 32) {
    const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xp + i + 16), _mm512_loadu_ps(xp + i));
    _mm512_storeu_si512(xb.data() + i, (__m512i)pair);
  }
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* yp = y->typed_data();
  const int64_t tasks = (out + kBlock - 1) / kBlock;
  if (m <= kGemvRows) {
    pagedjax::ParallelFor(pool, tasks, [&](int64_t t) {
      const int64_t begin = t * kBlock, end = std::min(out, begin + kBlock);
      if (mr == 1) GemvBlock<1>(xb.data(), wp, in, m, begin, end, out, yp);
      else if (mr == 2) GemvBlock<2>(xb.data(), wp, in, m, begin, end, out, yp);
      else if (mr == 4) GemvBlock<4>(xb.data(), wp, in, m, begin, end, out, yp);
      else GemvBlock<8>(xb.data(), wp, in, m, begin, end, out, yp);
    });
    return ffi::Error::Success();
  }
  pagedjax::ParallelFor(pool, tasks, [&](int64_t t) {
    const int64_t o_end = std::min(out, (t + 1) * kBlock);
    for (int64_t o0 = t * kBlock; o0 < o_end; o0 += kOuts)
      for (int64_t m0 = 0; m0 < m_pad; m0 += kRows) Tile(xb.data(), wp, in, m0, o0, m, out, yp);
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" int PagedjaxAmxReady() { return AmxReady(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulBF16, MatmulBF16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, I]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w [O, I]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, O]
                                  .Attr<bool>("amx"));
