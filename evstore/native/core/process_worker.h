// ProcessWorker<T>(): a process's one background worker of type T (the block
// reserve's prefaulter, the huge-page collapser), created on first use and
// again in a forked child, whose memory holds the parent's instance but none
// of its threads. Leaked on purpose: its detached thread may outlive static
// destructors. T's default constructor starts the thread and sets a member
// `const pid_t pid_` to getpid(); T befriends ProcessWorker<T> if that
// constructor is private.
#pragma once
#include <sys/types.h>
#include <unistd.h>

#include <mutex>

namespace evstore {

template <typename T>
T& ProcessWorker() {
  static std::mutex init_mu;
  static T* instance = nullptr;
  std::lock_guard<std::mutex> l(init_mu);
  if (!instance || instance->pid_ != getpid()) instance = new T();
  return *instance;
}

}  // namespace evstore
