// The AVX2 matmul kernel's 2 x 6 tile (cpu_matmul_avx2.cc) with its data in L2, at each
// misalignment of x and w: G 8-lane FMAs per second, best of 3, on one core.
//
//   g++ -O3 -march=native -std=c++17 scripts/avx2_tile_probe.cc -o /tmp/avx2_tile_probe && /tmp/avx2_tile_probe
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

template <int kR, int kO>
__attribute__((noinline)) void Tile(const float* __restrict x, const float* __restrict w, int64_t in, float* y) {
  __m256 acc[kR][kO];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  for (int64_t c = 0; c < in; c += 8) {
    __m256 wv[kO];
    for (int j = 0; j < kO; ++j) wv[j] = _mm256_loadu_ps(w + j * in + c);
    for (int r = 0; r < kR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * in + c);
      for (int j = 0; j < kO; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int j = 0; j < kO; ++j) y[r * kO + j] = acc[r][j][0] + acc[r][j][7];
}

int main() {
  const int64_t in = 576, rows = 32, outs = 48;  // x 74 KB, w 110 KB: both in L2
  float* xb = static_cast<float*>(std::aligned_alloc(64, rows * in * 4 + 256));
  float* wb = static_cast<float*>(std::aligned_alloc(64, outs * in * 4 + 256));
  std::vector<float> y(64);
  for (int x_off : {0, 4, 8, 12})
    for (int w_off : {0, 4}) {
      float *x = xb + x_off, *w = wb + w_off;
      std::fill(x, x + rows * in, 1.f);
      std::fill(w, w + outs * in, .5f);
      double best = 0;
      for (int rep = 0; rep < 3; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        int64_t fma = 0;
        for (int it = 0; it < 4000; ++it)
          for (int64_t o = 0; o < outs; o += 6)
            for (int64_t m = 0; m < rows; m += 2, fma += 12 * in / 8) Tile<2, 6>(x + m * in, w + o * in, in, y.data());
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::max(best, fma / s / 1e9);
      }
      std::printf("x %2d bytes past a cache line, w %2d: %.2f G FMA/s\n", x_off * 4, w_off * 4, best);
    }
}
