// The AVX2 matmul kernel's own 2 x 6 tile (Tile in pallas_kernels/cpu_matmul/cpu_matmul_avx2.cc)
// with its data in L2, at each misalignment of x and w: G 8-lane FMAs per second, best of 3, on
// one core. From the project root:
//
//   g++ -O3 -march=native -std=c++17 -w -I"$(python -c 'import jax; print(jax.ffi.include_dir())')" \
//       -Ipallas_kernels scripts/avx2_tile_probe.cc -o /tmp/avx2_tile_probe && /tmp/avx2_tile_probe
#include "../pallas_kernels/cpu_matmul/cpu_matmul_avx2.cc"

#include <chrono>
#include <cstdio>
#include <cstdlib>

int main() {
  const int64_t in = 576, rows = 32, outs = 48;  // x 74 KB, w 110 KB: both in L2
  float* xb = static_cast<float*>(std::aligned_alloc(64, rows * in * 4 + 256));
  float* wb = static_cast<float*>(std::aligned_alloc(64, outs * in * 4 + 256));
  std::vector<float> y(rows * outs);
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
            for (int64_t m = 0; m < rows; m += 2, fma += 12 * in / 8)
              Tile<2, 6>(x, w + o * in, in, m, o, 6, rows, outs, y.data());
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::max(best, fma / s / 1e9);
      }
      std::printf("x %2d bytes past a cache line, w %2d: %.2f G FMA/s (y[0] %.0f)\n", x_off * 4, w_off * 4, best, y[0]);
    }
}
