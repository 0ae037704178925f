// MemoryHeadroomBytes (headroom.h): the machine's MemAvailable, and every
// limiting level of our cgroup in either version, wherever mountinfo says its
// hierarchy is mounted, read from trees of fixture files shaped like
// /proc and /sys/fs/cgroup (the `root` parameter); the running system's
// figure is the machine's or below it; and a child in a real cgroup v1 with a
// limit reads that limit (where the hierarchy is there and writable: root).
//
// cgroup v2 is read from fixture trees only: there is no real v2 case. On the
// machine this was written on (Linux 6.18, a Firecracker VM) the memory
// controller is bound to a v1 hierarchy (/proc/cgroups: hierarchy 4) that
// holds live cgroups, among them the one the VM's init puts every process in
// (/proc/self/cgroup: memory:/process_api/...). A controller can serve one
// hierarchy at a time and leaves v1 only when its v1 hierarchy is unmounted
// with no child cgroups left, or at boot (cgroup_no_v1=memory), so both the
// cgroup2 mount at /sys/fs/cgroup/unified and a fresh cgroup2 mount (made in
// a private mount namespace) list only `hugetlb` in cgroup.controllers, and
// writing "+memory" to cgroup.subtree_control fails.
// A real v2 memory.max case needs a host booted with memory on v2.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "headroom.h"
#include "test_check.h"

using namespace evstore;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;
constexpr const char* kV1NoLimit = "9223372036854771712";  // what cgroup v1 reads when no limit is set

std::string g_base;
int g_trees = 0;

// A fresh fixture tree (a directory standing for "/").
std::string Tree() {
  const std::string root = g_base + "/" + std::to_string(g_trees++);
  fs::create_directories(root);
  return root;
}

void Put(const std::string& root, const std::string& path, const std::string& text) {
  const fs::path p = root + path;
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

void Machine(const std::string& root, int64_t available) {
  Put(root, "/proc/meminfo", "MemTotal:       25165824 kB\nMemFree:          100000 kB\nMemAvailable:   " +
                                 std::to_string(available / 1024) + " kB\n");
}

// This machine's shape: v1 controllers under /sys/fs/cgroup/<name>, cgroup2 at /sys/fs/cgroup/unified.
void HybridMounts(const std::string& root) {
  Put(root, "/proc/self/mountinfo",
      "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
      "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
      "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
      "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n");
}

void V1Level(const std::string& root, const std::string& dir, const std::string& limit, int64_t usage,
             int64_t inactive) {
  Put(root, dir + "/memory.limit_in_bytes", limit + "\n");
  Put(root, dir + "/memory.usage_in_bytes", std::to_string(usage) + "\n");
  // inactive_file is this level's own; total_inactive_file counts its children too, as usage does.
  Put(root, dir + "/memory.stat", "cache 1\ninactive_file 1\nactive_file 7\ntotal_inactive_file " +
                                      std::to_string(inactive) + "\n");
}

void V2Level(const std::string& root, const std::string& dir, const std::string& max, int64_t current,
             int64_t inactive) {
  Put(root, dir + "/memory.max", max + "\n");
  Put(root, dir + "/memory.current", std::to_string(current) + "\n");
  Put(root, dir + "/memory.stat", "anon 5\nactive_file 9\ninactive_file " + std::to_string(inactive) + "\n");
}

void test_without_cgroup_limits_the_headroom_is_the_machine_s_less_the_margin() {
  const std::string root = Tree();
  Machine(root, 8 * kGiB);
  HybridMounts(root);
  Put(root, "/proc/self/cgroup", "4:memory:/job\n1:cpu:/\n0::/\n");
  V1Level(root, "/sys/fs/cgroup/memory/job", kV1NoLimit, 3 * kGiB, 0);
  V1Level(root, "/sys/fs/cgroup/memory", kV1NoLimit, 5 * kGiB, 0);
  CHECK_EQ(MemoryAvailableBytes(root), 8 * kGiB);
  CHECK_EQ(MemoryHeadroomBytes(root), 8 * kGiB - kHeadroomMarginBytes);
}

void test_a_cgroup_v1_memory_limit_bounds_the_headroom_less_its_usage_plus_inactive_cache() {
  const std::string root = Tree();
  Machine(root, 8 * kGiB);
  HybridMounts(root);
  Put(root, "/proc/self/cgroup", "4:memory:/job/task\n1:cpu:/\n0::/\n");
  V1Level(root, "/sys/fs/cgroup/memory/job/task", std::to_string(2 * kGiB), 900 * kMiB, 100 * kMiB);
  V1Level(root, "/sys/fs/cgroup/memory/job", kV1NoLimit, 900 * kMiB, 100 * kMiB);
  CHECK_EQ(MemoryAvailableBytes(root), 2 * kGiB - 900 * kMiB + 100 * kMiB);
  CHECK_EQ(MemoryHeadroomBytes(root), 2 * kGiB - 800 * kMiB - kHeadroomMarginBytes);
}

void test_a_tighter_cgroup_v1_limit_of_a_parent_level_wins() {
  const std::string root = Tree();
  Machine(root, 8 * kGiB);
  HybridMounts(root);
  Put(root, "/proc/self/cgroup", "4:memory:/job/task\n0::/\n");
  V1Level(root, "/sys/fs/cgroup/memory/job/task", std::to_string(4 * kGiB), kGiB, 0);
  V1Level(root, "/sys/fs/cgroup/memory/job", std::to_string(3 * kGiB), 2 * kGiB + 512 * kMiB, 0);
  CHECK_EQ(MemoryAvailableBytes(root), 512 * kMiB);
  CHECK_EQ(MemoryHeadroomBytes(root), int64_t{0});  // never negative
}

void test_in_a_container_the_cgroup_v1_path_is_taken_from_the_mount_s_root() {
  // The container sees its own cgroup /docker/c1 mounted at /sys/fs/cgroup/memory.
  const std::string root = Tree();
  Machine(root, 8 * kGiB);
  Put(root, "/proc/self/mountinfo",
      "600 590 0:32 /docker/c1 /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n");
  Put(root, "/proc/self/cgroup", "4:memory:/docker/c1/inner\n");
  V1Level(root, "/sys/fs/cgroup/memory/inner", std::to_string(3 * kGiB), 0, 0);
  V1Level(root, "/sys/fs/cgroup/memory", std::to_string(2 * kGiB + 256 * kMiB), 0, 0);
  CHECK_EQ(MemoryAvailableBytes(root), 2 * kGiB + 256 * kMiB);
}

void test_a_cgroup_v2_memory_max_of_any_level_up_bounds_the_headroom() {
  const std::string root = Tree();
  Machine(root, 8 * kGiB);
  Put(root, "/proc/self/mountinfo", "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n");
  Put(root, "/proc/self/cgroup", "0::/a/b\n");
  V2Level(root, "/sys/fs/cgroup/a/b", "max", kGiB, 0);
  V2Level(root, "/sys/fs/cgroup/a", std::to_string(2 * kGiB), 3 * kGiB / 2, 256 * kMiB);
  CHECK_EQ(MemoryAvailableBytes(root), 768 * kMiB);
}

void test_a_cgroup2_hierarchy_beside_v1_controllers_is_read_where_it_is_mounted() {
  const std::string root = Tree();
  Machine(root, 8 * kGiB);
  HybridMounts(root);
  Put(root, "/proc/self/cgroup", "4:memory:/\n0::/svc\n");
  V2Level(root, "/sys/fs/cgroup/unified/svc", std::to_string(3 * kGiB), kGiB, 0);
  // A memory.max at the top of the tmpfs is not the hierarchy's: not read.
  Put(root, "/sys/fs/cgroup/memory.max", "1\n");
  Put(root, "/sys/fs/cgroup/memory.current", "0\n");
  CHECK_EQ(MemoryAvailableBytes(root), 2 * kGiB);
}

void test_nothing_readable_gives_no_headroom_and_a_malformed_file_keeps_what_was_read() {
  CHECK_EQ(MemoryAvailableBytes(g_base + "/no-such-root"), int64_t{0});
  CHECK_EQ(MemoryHeadroomBytes(g_base + "/no-such-root"), int64_t{0});
  const std::string root = Tree();
  Machine(root, 4 * kGiB);
  HybridMounts(root);
  Put(root, "/proc/self/cgroup", "4:memory:/job\n0::/\n");
  Put(root, "/sys/fs/cgroup/memory/job/memory.limit_in_bytes", "garbage\n");
  Put(root, "/sys/fs/cgroup/memory/job/memory.usage_in_bytes", "0\n");
  CHECK_EQ(MemoryAvailableBytes(root), 4 * kGiB);
}

void test_the_running_system_s_figure_is_at_most_the_machine_s_available_memory() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kib = -1, v;
  while (f >> key >> v) {
    if (key == "MemAvailable:") kib = v;
    f.ignore(64, '\n');
  }
  CHECK(kib > 0);
  const int64_t got = MemoryAvailableBytes();
  std::printf("  this process: %lld MiB available, MemAvailable %lld MiB\n", static_cast<long long>(got / kMiB),
              static_cast<long long>(kib / 1024));
  CHECK(got > 0);
  CHECK(got <= kib * 1024 + 64 * kMiB);  // MemAvailable moves between the two reads
}

// A real cgroup v1 memory hierarchy (this machine's kind; root may create
// cgroups in it): a child moved into a new cgroup with a 256 MiB limit reads
// at most that. Where there is no v1 memory hierarchy, or it is not writable
// (not root, a read-only mount), says so and checks nothing more: the fixture
// trees above are the specification.
void test_a_child_in_a_real_cgroup_v1_with_a_limit_reads_at_most_that_limit() {
  const std::string dir = "/sys/fs/cgroup/memory/evstore-headroom-test-" + std::to_string(::getpid());
  if (!fs::exists("/sys/fs/cgroup/memory/memory.limit_in_bytes") || ::mkdir(dir.c_str(), 0755) != 0) {
    std::printf("  no writable cgroup v1 memory hierarchy here (%s): fixture trees only\n", std::strerror(errno));
    return;
  }
  std::ofstream(dir + "/memory.limit_in_bytes") << 256 * kMiB << "\n";
  int fds[2];
  CHECK(::pipe(fds) == 0);
  const pid_t child = ::fork();
  if (child == 0) {
    std::ofstream(dir + "/cgroup.procs") << ::getpid() << std::endl;
    const int64_t got = MemoryAvailableBytes();
    const ssize_t w = ::write(fds[1], &got, sizeof(got));
    ::_exit(w == sizeof(got) ? 0 : 1);
  }
  int64_t got = -1;
  const ssize_t r = ::read(fds[0], &got, sizeof(got));
  int status = 0;
  ::waitpid(child, &status, 0);
  ::close(fds[0]);
  ::close(fds[1]);
  const bool removed = ::rmdir(dir.c_str()) == 0;  // empty once the child has exited
  std::printf("  a child in a 256 MiB cgroup: %lld MiB available\n", static_cast<long long>(got / kMiB));
  CHECK(removed);
  CHECK(r == sizeof(got) && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(got > 0 && got <= 256 * kMiB);
}

}  // namespace

TEST_MAIN(const ScratchDir dir("/tmp/evstore-headroom-test-"); g_base = dir.path();
          RUN(test_without_cgroup_limits_the_headroom_is_the_machine_s_less_the_margin);
          RUN(test_a_cgroup_v1_memory_limit_bounds_the_headroom_less_its_usage_plus_inactive_cache);
          RUN(test_a_tighter_cgroup_v1_limit_of_a_parent_level_wins);
          RUN(test_in_a_container_the_cgroup_v1_path_is_taken_from_the_mount_s_root);
          RUN(test_a_cgroup_v2_memory_max_of_any_level_up_bounds_the_headroom);
          RUN(test_a_cgroup2_hierarchy_beside_v1_controllers_is_read_where_it_is_mounted);
          RUN(test_nothing_readable_gives_no_headroom_and_a_malformed_file_keeps_what_was_read);
          RUN(test_the_running_system_s_figure_is_at_most_the_machine_s_available_memory);
          RUN(test_a_child_in_a_real_cgroup_v1_with_a_limit_reads_at_most_that_limit);)
