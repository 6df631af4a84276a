// Paged attention for the CPU backend, called from JAX through the XLA FFI.
//
// Packed (ragged) layout, the contract of packed_paged_attention (packed.py):
//   q [T, H, D] f32 (the query tokens of all sequences, laid end to end),
//   k_pages / v_pages [Hkv, NB, BS, D] f32, block_tables [S, MB] i32, kv_lens [S] i32,
//   q_starts [S] i32, q_lens [S] i32  ->  out [T, H, D] f32.
// Sequence s owns query tokens [q_starts[s], q_starts[s] + q_lens[s]); its query j sits at
// position kv_lens[s] - q_lens[s] + j and attends causally to keys 0..that position (and
// < kv_lens[s]). Tokens no sequence owns, and sequences with no key, give zeros. (The padded
// [S, Q] layout is the special case q_starts[s] = s * Q.)
// Table entries past a sequence's keys are never read; out-of-range entries in use are
// clamped to [0, NB) (as the ragged path does).
//
// One task per (sequence, kv head): it walks the sequence's pages once, up to the last key
// any of its queries sees, and keeps an online softmax (max, sum, accumulator) per query row.
// Work follows each sequence's own length. Tasks are shared between the calling thread and
// XLA's intra-op thread pool. Built at first use by cpu_native.py (g++ -O3 -march=native;
// no -ffast-math: with GCC 12 it links crtfastmath.o, which turns on flush-to-zero for the
// whole process).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNoMax = -3.0e38f;

struct Shapes {
  int64_t t, s, h, d, hkv, nb, bs, mb;
};

inline float Dot(const float* a, const float* b, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += a[i] * b[i];
  return acc;
}

// Attention of sequence `seq` against kv head `hk`: every query row j * G + g. kD > 0 fixes
// the head dim at compile time (unrolled inner loops); 0 reads it from sh.
template <int64_t kD>
void AttendOne(const Shapes& sh, int64_t seq, int64_t hk, const float* q, const float* kp,
               const float* vp, const int32_t* tables, const int32_t* kv_lens,
               const int32_t* q_starts, const int32_t* q_lens, float scale, float* out) {
  const int64_t g_count = sh.h / sh.hkv, d = kD > 0 ? kD : sh.d, bs = sh.bs;
  const int64_t q0 = q_starts[seq];  // first query token of the sequence in q / out
  if (q0 < 0 || q0 >= sh.t) return;
  const int64_t q_len = std::min<int64_t>(q_lens[seq], sh.t - q0);
  const int64_t kv_len = std::min<int64_t>(kv_lens[seq], sh.mb * bs);  // keys exist only in the table
  if (q_len <= 0 || kv_len <= 0) return;  // out is zeroed before the tasks run
  const int64_t first_pos = kv_lens[seq] - q_lens[seq];
  const int64_t rows = q_len * g_count;
  // A finite "minus infinity": the first page's rescale factor exp(kNoMax - max) is exactly 0
  // (no inf - inf).
  std::vector<float> m(rows, kNoMax), l(rows, 0.f);
  std::vector<float> acc(rows * d, 0.f), qs(rows * d), sc(bs);
  std::vector<int64_t> limit(q_len);  // last key position each query slot sees
  int64_t last = -1;
  for (int64_t j = 0; j < q_len; ++j) {
    limit[j] = std::min(first_pos + j, kv_len - 1);
    last = std::max(last, limit[j]);
    for (int64_t g = 0; g < g_count; ++g) {
      const float* src = q + ((q0 + j) * sh.h + hk * g_count + g) * d;
      for (int64_t i = 0; i < d; ++i) qs[(j * g_count + g) * d + i] = src[i] * scale;
    }
  }
  const int32_t* table = tables + seq * sh.mb;
  for (int64_t page = 0; page * bs <= last; ++page) {
    const int64_t blk = std::clamp<int64_t>(table[page], 0, sh.nb - 1);
    const float* kb = kp + (hk * sh.nb + blk) * bs * d;  // [BS, D]
    const float* vb = vp + (hk * sh.nb + blk) * bs * d;
    if ((page + 1) * bs <= last) {  // pages are scattered: fetch the next one while on this one
      const int64_t nxt = (hk * sh.nb + std::clamp<int64_t>(table[page + 1], 0, sh.nb - 1)) * bs * d;
      for (int64_t i = 0; i < bs * d; i += 16) {
        __builtin_prefetch(kp + nxt + i);
        __builtin_prefetch(vp + nxt + i);
      }
    }
    for (int64_t j = 0; j < q_len; ++j) {
      const int64_t n = std::min(bs, limit[j] - page * bs + 1);  // keys of this page it sees
      if (n <= 0) continue;
      for (int64_t g = 0; g < g_count; ++g) {
        const int64_t r = j * g_count + g;
        const float* qr = qs.data() + r * d;
        float mx = kNoMax;
        for (int64_t t = 0; t < n; ++t) {
          sc[t] = Dot(qr, kb + t * d, d);
          mx = std::max(mx, sc[t]);
        }
        const float m_new = std::max(m[r], mx);
        const float alpha = std::exp(m[r] - m_new);
        float* a = acc.data() + r * d;
        float sum = l[r] * alpha;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) a[i] *= alpha;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
          sc[t] = std::exp(sc[t] - m_new);
          sum += sc[t];
        }
        for (int64_t t = 0; t < n; ++t) {
          const float p = sc[t];
          const float* vr = vb + t * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) a[i] += p * vr[i];
        }
        m[r] = m_new;
        l[r] = sum;
      }
    }
  }
  for (int64_t j = 0; j < q_len; ++j)
    for (int64_t g = 0; g < g_count; ++g) {
      const int64_t r = j * g_count + g;
      if (l[r] <= 0.f) continue;
      float* o = out + ((q0 + j) * sh.h + hk * g_count + g) * d;
      const float inv = 1.f / l[r];
      for (int64_t i = 0; i < d; ++i) o[i] = acc[r * d + i] * inv;
    }
}

// Runs task(i) for i < n on the calling thread and up to pool.num_threads() helpers. The
// caller waits only for tasks a helper has claimed, so a busy pool cannot deadlock it.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, F task) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, task]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      task(i);
      if (state->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                              ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> q_starts, ffi::Buffer<ffi::S32> q_lens, float scale,
                              ffi::ResultBuffer<ffi::F32> out) {
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
  if (!same_pages || sh.hkv <= 0 || sh.nb <= 0 || sh.bs <= 0 || kd[3] != sh.d || sh.h % sh.hkv != 0 ||
      kld[0] != sh.s || qsd[0] != sh.s || qld[0] != sh.s)
    return ffi::Error::InvalidArgument("paged attention: inconsistent shapes");
  const float* qp = q.typed_data();
  const float* kp = k_pages.typed_data();
  const float* vp = v_pages.typed_data();
  const int32_t* tp = block_tables.typed_data();
  const int32_t* kl = kv_lens.typed_data();
  const int32_t* qs = q_starts.typed_data();
  const int32_t* ql = q_lens.typed_data();
  float* op = out->typed_data();
  std::fill_n(op, sh.t * sh.h * sh.d, 0.f);  // tokens no sequence owns stay zero
  auto attend = sh.d == 64 ? AttendOne<64> : sh.d == 128 ? AttendOne<128> : AttendOne<0>;
  ParallelFor(pool, sh.s * sh.hkv, [&sh, attend, qp, kp, vp, tp, kl, qs, ql, scale, op](int64_t i) {
    attend(sh, i / sh.hkv, i % sh.hkv, qp, kp, vp, tp, kl, qs, ql, scale, op);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionF32, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_starts
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_lens
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
