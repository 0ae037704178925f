// MemoryHeadroomBytes: how much more memory this process may take now
// without pushing the machine or its cgroup into reclaim or the OOM killer.
// The arena reads it once per widening to decide how many new row blocks to
// prepare before the table takes its segment locks (arena.h).
//
//   headroom = min(MemAvailable                      /proc/meminfo,
//                  memory.max - memory.current
//                  + inactive_file                   every cgroup v2 level
//                                                    from ours up that sets
//                                                    a limit)
//              - kHeadroomMarginBytes (1 GiB)
//
// inactive_file (memory.stat) is page cache the kernel reclaims before it
// charges the cgroup past its limit, as MemAvailable counts it machine-wide.
// The 1 GiB margin is left for everything else the process and its
// neighbours allocate meanwhile. Never negative; 0 when nothing is readable
// (callers then keep their smallest bound). Linux only: elsewhere 0.
#pragma once
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>

namespace evstore {

constexpr int64_t kHeadroomMarginBytes = int64_t{1} << 30;

namespace headroom_detail {
// The value after `key` on the line that starts with it, or -1.
inline int64_t Field(const std::string& path, const std::string& key) {
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line))
    if (line.compare(0, key.size(), key) == 0) return std::stoll(line.substr(key.size()));
  return -1;
}
// A cgroup file's single number; -1 when absent or "max".
inline int64_t Number(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s == "max") return -1;
  return std::stoll(s);
}
}  // namespace headroom_detail

// Bytes free for this process, the smallest of the machine's and each
// limiting cgroup level's, before the margin.
inline int64_t MemoryAvailableBytes() {
  using namespace headroom_detail;
  int64_t avail = -1;
  try {
    const int64_t kib = Field("/proc/meminfo", "MemAvailable:");
    if (kib >= 0) avail = kib * 1024;
    std::ifstream cg("/proc/self/cgroup");
    std::string line, rel;
    while (std::getline(cg, line))
      if (line.rfind("0::", 0) == 0) rel = line.substr(3);  // cgroup v2
    if (!rel.empty()) {
      for (std::string dir = "/sys/fs/cgroup" + (rel == "/" ? std::string() : rel);;) {
        const int64_t max = Number(dir + "/memory.max");
        const int64_t cur = Number(dir + "/memory.current");
        if (max >= 0 && cur >= 0) {
          const int64_t inactive = std::max<int64_t>(0, Field(dir + "/memory.stat", "inactive_file "));
          const int64_t room = std::max<int64_t>(0, max - cur + inactive);
          avail = avail < 0 ? room : std::min(avail, room);
        }
        const size_t slash = dir.rfind('/');
        if (dir == "/sys/fs/cgroup" || slash == std::string::npos) break;
        dir.resize(slash);
      }
    }
  } catch (const std::exception&) {  // an unreadable or malformed number
    return avail < 0 ? 0 : avail;
  }
  return avail < 0 ? 0 : avail;
}

inline int64_t MemoryHeadroomBytes() {
  return std::max<int64_t>(0, MemoryAvailableBytes() - kHeadroomMarginBytes);
}

}  // namespace evstore
