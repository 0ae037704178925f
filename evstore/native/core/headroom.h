// MemoryHeadroomBytes: how much more memory this process may take now
// without pushing the machine or its cgroup into reclaim or the OOM killer.
// The arena reads it once per widening to decide how many new row blocks to
// prepare before the table takes its segment locks (arena.h).
//
//   headroom = min(MemAvailable                      /proc/meminfo,
//                  limit - usage + inactive_file     every cgroup level from
//                                                    ours up that sets a
//                                                    memory limit)
//              - kHeadroomMarginBytes (1 GiB)
//
// Cgroups, both versions, each where /proc/self/mountinfo says its hierarchy
// is mounted (a cgroup2 hierarchy may sit at /sys/fs/cgroup/unified beside v1
// controllers), our cgroup's path from /proc/self/cgroup taken relative to the
// mount's root (a container sees only its own subtree):
//   v2  (the "0::<path>" line, a cgroup2 mount): memory.max - memory.current
//       + memory.stat's inactive_file; "max" sets no limit;
//   v1  (the line naming the memory controller, a cgroup mount with option
//       "memory"): memory.limit_in_bytes - memory.usage_in_bytes + memory.stat's
//       total_inactive_file (this level and its children, as usage counts
//       them); a limit of 2^62 or more (v1 writes "no limit" as
//       PAGE_COUNTER_MAX pages, 9223372036854771712 with 4 KiB pages) sets none.
// inactive_file is page cache the kernel reclaims before it charges the
// cgroup past its limit, as MemAvailable counts it machine-wide.
// The 1 GiB margin is left for everything else the process and its
// neighbours allocate meanwhile. Never negative; 0 when nothing is readable
// (callers then keep their smallest bound). Linux only: elsewhere 0.
//
// `root` ("" for the running system) is prefixed to every absolute path read
// (/proc/..., and the mount points mountinfo names): a test points it at a
// tree of fixture files (headroom_test.cc).
#pragma once
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace evstore {

constexpr int64_t kHeadroomMarginBytes = int64_t{1} << 30;

namespace headroom_detail {
// A limit at or above this sets none (cgroup v1's "no limit" is 2^63 - 4096).
constexpr int64_t kNoLimit = int64_t{1} << 62;

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
// Whether comma-separated `list` holds `item`.
inline bool Lists(const std::string& list, const std::string& item) {
  return ("," + list + ",").find("," + item + ",") != std::string::npos;
}

// One cgroup version's files: names of the limit, the usage, and memory.stat's
// reclaimable page cache key.
struct CgroupFiles {
  const char* limit;
  const char* usage;
  const char* inactive;
};
inline constexpr CgroupFiles kV2{"memory.max", "memory.current", "inactive_file "};
inline constexpr CgroupFiles kV1{"memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file "};

// The directory of our cgroup `path` in the hierarchy mounted at `mount`
// whose root is `mount_root` (under `root`), or "" if `path` is outside it.
inline std::string CgroupDir(const std::string& root, const std::string& mount, const std::string& mount_root,
                             const std::string& path) {
  std::string rel = path;
  if (mount_root != "/") {
    if (rel.compare(0, mount_root.size(), mount_root) != 0 ||
        (rel.size() > mount_root.size() && rel[mount_root.size()] != '/'))
      return "";
    rel = rel.substr(mount_root.size());
  }
  if (rel == "/") rel.clear();
  return root + mount + rel;
}

// The least room of every level from `dir` up to `top` that sets a limit, or -1.
inline int64_t LeastRoom(std::string dir, const std::string& top, const CgroupFiles& files) {
  int64_t least = -1;
  for (;;) {
    const int64_t limit = Number(dir + "/" + files.limit);
    const int64_t usage = Number(dir + "/" + files.usage);
    if (limit >= 0 && limit < kNoLimit && usage >= 0) {
      const int64_t inactive = std::max<int64_t>(0, Field(dir + "/memory.stat", files.inactive));
      const int64_t room = std::max<int64_t>(0, limit - usage + inactive);
      least = least < 0 ? room : std::min(least, room);
    }
    const size_t slash = dir.rfind('/');
    if (dir.size() <= top.size() || slash == std::string::npos || slash < top.size()) break;
    dir.resize(slash);
  }
  return least;
}
}  // namespace headroom_detail

// Bytes free for this process, the smallest of the machine's and each
// limiting cgroup level's (both versions), before the margin.
inline int64_t MemoryAvailableBytes(const std::string& root = "") {
  using namespace headroom_detail;
  int64_t avail = -1;
  const auto take = [&avail](int64_t room) {
    if (room >= 0) avail = avail < 0 ? room : std::min(avail, room);
  };
  try {
    const int64_t kib = Field(root + "/proc/meminfo", "MemAvailable:");
    if (kib >= 0) avail = kib * 1024;
    // Our cgroup paths: v2's, and v1's memory controller's.
    std::ifstream cg(root + "/proc/self/cgroup");
    std::string line, v2_path, v1_path;
    while (std::getline(cg, line)) {
      const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
      if (b == std::string::npos) continue;
      const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
      if (line.compare(0, a, "0") == 0 && controllers.empty()) v2_path = path;
      if (Lists(controllers, "memory")) v1_path = path;
    }
    // Where each hierarchy is mounted: "id parent dev root mountpoint opts [tags] - fstype source superopts".
    std::ifstream mi(root + "/proc/self/mountinfo");
    bool v2_done = v2_path.empty(), v1_done = v1_path.empty();
    while (std::getline(mi, line) && !(v2_done && v1_done)) {
      std::istringstream in(line);
      std::vector<std::string> f;
      for (std::string w; in >> w;) f.push_back(w);
      const auto dash = std::find(f.begin(), f.end(), "-");
      if (f.size() < 5 || dash == f.end() || f.end() - dash < 4) continue;
      const std::string &mount_root = f[3], &mount = f[4], &fstype = dash[1], &superopts = dash[3];
      if (fstype == "cgroup2" && !v2_done) {
        const std::string dir = CgroupDir(root, mount, mount_root, v2_path);
        if (!dir.empty()) take(LeastRoom(dir, root + mount, kV2));
        v2_done = true;
      } else if (fstype == "cgroup" && !v1_done && Lists(superopts, "memory")) {
        const std::string dir = CgroupDir(root, mount, mount_root, v1_path);
        if (!dir.empty()) take(LeastRoom(dir, root + mount, kV1));
        v1_done = true;
      }
    }
  } catch (const std::exception&) {  // an unreadable or malformed number
    return avail < 0 ? 0 : avail;
  }
  return avail < 0 ? 0 : avail;
}

inline int64_t MemoryHeadroomBytes(const std::string& root = "") {
  return std::max<int64_t>(0, MemoryAvailableBytes(root) - kHeadroomMarginBytes);
}

}  // namespace evstore
