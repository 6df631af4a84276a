// ParallelFor for the native CPU kernels (included by each .cc; native_build.py passes -I).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace pagedjax {

constexpr std::chrono::microseconds kSpin{100};

// Runs task(i) for i < n on the calling thread and up to pool.num_threads() - 1 helpers: as
// many threads as the pool has, the caller counted (XLA:CPU's pool has one per core, and the
// caller is busy too; one more thread time-slices a core, and a task descheduled in mid-run
// holds up the whole call: a 2-core AMD EPYC, f32 decode layers at 8 rows, 32-39 -> 23-37
// ms, scripts/bench_matmul.py). The caller waits only for tasks a helper has claimed, so a
// busy pool cannot deadlock it.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, F task) {
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
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  // the helpers' last tasks are usually microseconds from done: spin up to kSpin before
  // sleeping (a futex sleep and wake-up cost ~10 us, as much as a small kernel call itself)
  const auto spin_until = std::chrono::steady_clock::now() + kSpin;
  while (state->done.load(std::memory_order_acquire) != n) {
    for (int i = 0; i < 32; ++i) __builtin_ia32_pause();
    if (std::chrono::steady_clock::now() > spin_until) break;
  }
  if (state->done.load(std::memory_order_acquire) == n) return;
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

}  // namespace pagedjax
