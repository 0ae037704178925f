// How the core splits work across threads without knowing who owns them.
// The TensorFlow kernels pass TF's intra-op thread pool (through SharedFor
// below); tests pass SerialFor or a std::thread pool. `work(begin, end)` is
// called on disjoint ranges that cover [0, total); `cost_per_unit` is a rough
// cost (ns) used to size shards.
//
// SharedFor: the calling thread and up to `helpers` pool threads claim chunks
// of [0, total) from one atomic counter, and the caller waits only for chunks
// already claimed. A helper that starts late (its pool thread was busy, or
// descheduled on a loaded machine) finds nothing left and returns at once, so
// a batch never waits for a thread that has not started: on an idle machine
// the work spreads over every thread, on a saturated one it degrades to the
// caller alone instead of stalling on a straggler (a static split, as in
// Eigen's ParallelFor, waits for every shard it handed out).
//
// Invariants of SharedFor:
//  * `work` is called only for claimed chunks, and the caller returns only
//    after every chunk has been claimed and has finished; so no helper calls
//    `work` (or touches the caller's stack) after SharedFor returned. Helpers
//    share nothing else with the caller but a reference-counted State.
//  * An exception thrown by `work` on any thread is rethrown by the caller
//    (the first one; the other chunks still run), after all claimed chunks
//    finished.
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>

namespace evstore {

using ParallelFor = std::function<void(int64_t total, int64_t cost_per_unit,
                                       const std::function<void(int64_t, int64_t)>& work)>;

inline void SerialFor(int64_t total, int64_t /*cost*/,
                      const std::function<void(int64_t, int64_t)>& work) {
  if (total > 0) work(0, total);
}

// Work below this many ns per chunk is not worth handing to another thread.
inline constexpr int64_t kMinChunkNs = 20000;

// `schedule(task)` runs task() on some pool thread, soon or late.
inline void SharedFor(int64_t total, int64_t cost_per_unit, int helpers,
                      const std::function<void(std::function<void()>)>& schedule,
                      const std::function<void(int64_t, int64_t)>& work) {
  if (total <= 0) return;
  const int64_t cost = std::max<int64_t>(1, cost_per_unit);
  // Chunks of about kMinChunkNs: small enough that the caller seldom waits
  // long for a helper's last chunk, large enough to be worth a claim.
  const int64_t chunk = std::min(total, (kMinChunkNs + cost - 1) / cost);
  const int64_t chunks = (total + chunk - 1) / chunk;
  if (helpers <= 0 || chunks <= 1) {
    work(0, total);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    int64_t done = 0;  // units finished; under mu
    std::mutex mu;
    std::condition_variable cv;
    std::exception_ptr error;  // the first one; under mu
    const std::function<void(int64_t, int64_t)>* work = nullptr;
    int64_t total = 0, chunk = 0;
    // Claims and runs chunks until none is left.
    void Drain() {
      for (;;) {
        const int64_t b = next.fetch_add(chunk, std::memory_order_relaxed);
        if (b >= total) return;
        const int64_t e = std::min(total, b + chunk);
        std::exception_ptr err;
        try {
          (*work)(b, e);
        } catch (...) {
          err = std::current_exception();
        }
        std::lock_guard<std::mutex> l(mu);
        if (err && !error) error = err;
        done += e - b;
        if (done == total) cv.notify_all();
      }
    }
  };
  auto s = std::make_shared<State>();
  s->work = &work;
  s->total = total;
  s->chunk = chunk;
  const int n = static_cast<int>(std::min<int64_t>(helpers, chunks - 1));
  for (int i = 0; i < n; ++i) schedule([s] { s->Drain(); });
  s->Drain();
  std::unique_lock<std::mutex> l(s->mu);
  s->cv.wait(l, [&] { return s->done == total; });
  if (s->error) std::rethrow_exception(s->error);
}

}  // namespace evstore
