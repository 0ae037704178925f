// SpanReader: reads a list of spans of a tiered store's file ahead of their
// consumer, in a thread of its own, so a full export's reads of the tier file
// overlap its writes of the checkpoint (Table::ForEachKey). No TensorFlow.
//
// Layout: two buffers of `buffer_floats` each. The thread reads span k into
// buffer k % 2 (each span a list of runs: records [first, first + n) read in
// one call into the buffer at float offset `at`), once the consumer has
// released that buffer; the consumer takes spans in order (Next), each valid
// until its next call. So at most two spans are in DRAM, and reading span
// k + 1 runs while span k is consumed.
// Stream: TieredStore::ColdStream or any class with ReadSpan(epoch, first, n,
// dst) -> bool (false: the layout changed, nothing read) and ReadAhead(epoch,
// first, n).
// Errors: a read that throws ends the thread; the consumer's Next for that
// span rethrows it. Destroying the reader (also when the consumer throws)
// stops the thread and joins it.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace evstore {

template <typename Stream>
class SpanReader {
 public:
  struct Run {
    uint32_t first;  // the run's first record
    uint32_t n;      // records in the run
    size_t at;       // where in the span's buffer (floats) it goes
  };

  SpanReader(const Stream& stream, uint64_t epoch, size_t buffer_floats, std::vector<std::vector<Run>> spans)
      : stream_(stream), epoch_(epoch), spans_(std::move(spans)) {
    for (Buf& b : bufs_) b.data.resize(buffer_floats);
    thread_ = std::thread([this] { Loop(); });
  }
  ~SpanReader() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  SpanReader(const SpanReader&) = delete;
  SpanReader& operator=(const SpanReader&) = delete;

  // The next span's buffer (spans in the order given); *read is false when
  // the store's layout changed before it was read (its bytes are then not
  // the records'). Releases the previous span's buffer. Rethrows a failed read.
  const float* Next(bool* read) {
    std::unique_lock<std::mutex> l(mu_);
    if (taken_ > 0) {
      bufs_[(taken_ - 1) % 2].ready = false;
      cv_.notify_all();
    }
    Buf& b = bufs_[taken_ % 2];
    cv_.wait(l, [&] { return b.ready || error_; });
    if (!b.ready) std::rethrow_exception(error_);
    ++taken_;
    *read = b.read;
    return b.data.data();
  }

 private:
  struct Buf {
    std::vector<float> data;
    bool ready = false;  // holds a span not yet released by the consumer
    bool read = false;
  };

  void Loop() {
    for (size_t k = 0; k < spans_.size(); ++k) {
      Buf& b = bufs_[k % 2];
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return !b.ready || stop_; });
        if (stop_) return;
      }
      bool read = true;
      try {
        if (k + 1 < spans_.size() && !spans_[k + 1].empty()) {  // the kernel starts on the span after
          const std::vector<Run>& nx = spans_[k + 1];
          stream_.ReadAhead(epoch_, nx.front().first, nx.back().first + nx.back().n - nx.front().first);
        }
        for (const Run& r : spans_[k])
          if (!(read = stream_.ReadSpan(epoch_, r.first, r.n, b.data.data() + r.at))) break;
      } catch (...) {
        std::lock_guard<std::mutex> l(mu_);
        error_ = std::current_exception();
        cv_.notify_all();
        return;
      }
      {
        std::lock_guard<std::mutex> l(mu_);
        b.read = read;
        b.ready = true;
      }
      cv_.notify_all();
    }
  }

  const Stream& stream_;
  const uint64_t epoch_;
  const std::vector<std::vector<Run>> spans_;
  Buf bufs_[2];
  std::mutex mu_;
  std::condition_variable cv_;
  size_t taken_ = 0;  // spans handed to the consumer (mu_)
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: started once every member above exists
};

}  // namespace evstore
