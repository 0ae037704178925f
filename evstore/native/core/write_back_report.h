// WriteBackReport: the write-backs a tiered store's disk refused
// (tiered_store.h), handed to the operation whose eviction failed. No
// TensorFlow.
//
// An operation opens a report on its thread for its duration (the TF
// kernels: EvTableOp::Compute); a thread that runs part of its work (a pool
// helper of its ParallelFor: kernel_util.h IntraOp) joins it for that part
// (Join). A store whose eviction fails on a thread adds the failure to the
// report that thread has open (Deliver). A failure with no report to go to
// (the store's cleaner thread, or a caller with none open) the store keeps
// and delivers to the next fault that takes a slot on a thread with a report
// open, once.
//
// Invariants: current_ is this thread's innermost open report (or joined
// one), restored when it closes; a report outlives every Join of it (the
// ParallelFor that joins helpers to it returns before it closes); Add is
// safe from several threads of one operation at once (mu_).
#pragma once
#include <cstdint>
#include <mutex>
#include <string>

namespace evstore {

class WriteBackReport {
 public:
  WriteBackReport() : prev_(current_) { current_ = this; }
  ~WriteBackReport() { current_ = prev_; }
  WriteBackReport(const WriteBackReport&) = delete;
  WriteBackReport& operator=(const WriteBackReport&) = delete;

  // Refused write-backs handed to this operation so far, and the first one's message.
  int64_t failures() const {
    std::lock_guard<std::mutex> l(mu_);
    return failures_;
  }
  std::string message() const {
    std::lock_guard<std::mutex> l(mu_);
    return message_;
  }

  // The report open on this thread (null: none).
  static WriteBackReport* Current() { return current_; }
  // Adds `n` refused write-backs (described by `message`) to the report open
  // on this thread; false, changing nothing, when none is open.
  static bool Deliver(const std::string& message, int64_t n = 1) {
    if (!current_) return false;
    current_->Add(message, n);
    return true;
  }

  // Makes `report` (may be null) this thread's open report while it lives: a
  // pool thread running a chunk of an operation's work.
  class Join {
   public:
    explicit Join(WriteBackReport* report) : prev_(current_) { current_ = report; }
    ~Join() { current_ = prev_; }
    Join(const Join&) = delete;
    Join& operator=(const Join&) = delete;

   private:
    WriteBackReport* prev_;
  };

 private:
  void Add(const std::string& message, int64_t n) {
    std::lock_guard<std::mutex> l(mu_);
    if (failures_ == 0) message_ = message;
    failures_ += n;
  }

  WriteBackReport* prev_;
  mutable std::mutex mu_;
  int64_t failures_ = 0;
  std::string message_;
  static inline thread_local WriteBackReport* current_ = nullptr;
};

}  // namespace evstore
