// RowFile: the disk engine of the tiered row store (tiered_store.h). No TensorFlow.
//
// Layout: one flat file of fixed-size records, record r (a row id) at byte
// offset r * record_bytes. Row ids are dense (the store recycles freed ids
// before it grows), so the file needs no index: the row id IS the address,
// and the DRAM cost of the disk tier is nothing beyond the store's per-row
// metadata. Records never written are holes (a sparse file).
//
// Why not a key-value store: measured against RocksDB on the same Zipf
// workload (bench/tiered_engine_bench.cc, BENCHMARKS.md "Tiered storage"),
// positional reads and writes of fixed records beat an LSM tree that must
// index, compact and merge what is, here, an array.
//
// The file belongs to the process: it lives in a private directory
//   <parent>/evstore-tier-<pid>-<n>/rows
// created by Open, holding a lock file locked with flock() for the life of
// the RowFile. Close (the destructor) removes the directory. A directory
// left by a killed process has an unlocked lock file (the kernel drops the
// lock with the process): Open removes every such directory under <parent>
// before creating its own, so a crash leaks nothing past the next start.
// The disk tier is a cache of state, never a source of truth: nothing here
// survives the process, and restores rebuild it from checkpoints.
//
// Errors: a write that cannot complete (ENOSPC, EFBIG from RLIMIT_FSIZE,
// EIO) returns false with errno kept in last_error(); the caller keeps the
// row in DRAM, so a full disk loses nothing. A read that fails throws
// std::runtime_error (the row's only copy is unreadable).
#pragma once
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <string>
#include <vector>

namespace evstore {

class RowFile {
 public:
  static constexpr const char* kDirPrefix = "evstore-tier-";

  // Creates the private directory under `parent` (created if missing) and an
  // empty record file of `record_bytes` per record. Throws std::runtime_error
  // when the parent cannot be created or written.
  RowFile(const std::string& parent, size_t record_bytes) : record_bytes_(record_bytes) {
    if (parent.empty()) throw std::invalid_argument("tiered storage needs a directory path");
    if (::mkdir(parent.c_str(), 0700) != 0 && errno != EEXIST)
      throw std::runtime_error("tiered storage: cannot create " + parent + ": " + std::strerror(errno));
    ClearStale(parent);
    static std::atomic<int> seq{0};
    for (int attempt = 0;; ++attempt) {
      dir_ = parent + "/" + kDirPrefix + std::to_string(::getpid()) + "-" + std::to_string(seq++);
      if (::mkdir(dir_.c_str(), 0700) == 0) break;
      if (errno != EEXIST || attempt > 1000)
        throw std::runtime_error("tiered storage: cannot create " + dir_ + ": " + std::strerror(errno));
    }
    lock_fd_ = ::open((dir_ + "/lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    if (lock_fd_ < 0 || ::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      int e = errno;
      RemoveDir(dir_);
      throw std::runtime_error("tiered storage: cannot lock " + dir_ + ": " + std::strerror(e));
    }
    fd_ = ::open(DataPath(0).c_str(), O_CREAT | O_RDWR | O_TRUNC | O_CLOEXEC, 0600);
    if (fd_ < 0) {
      int e = errno;
      Close();
      throw std::runtime_error("tiered storage: cannot create " + DataPath(0) + ": " + std::strerror(e));
    }
  }
  ~RowFile() { Close(); }
  RowFile(const RowFile&) = delete;
  RowFile& operator=(const RowFile&) = delete;

  const std::string& dir() const { return dir_; }
  size_t record_bytes() const { return record_bytes_; }
  int last_error() const { return last_error_.load(std::memory_order_relaxed); }

  // Writes record r. False (errno in last_error(), and in *err if given)
  // when the disk refuses: the record's previous contents on disk are then
  // unspecified. Reads and writes of different records may run concurrently
  // (pread/pwrite on one descriptor); Widen may not run beside them.
  bool Write(uint32_t r, const void* src, int* err = nullptr) {
    int e = 0;
    const bool ok = WriteAt(fd_, r, record_bytes_, src, &e);
    if (!ok && err) *err = e;
    return ok;
  }

  // Reads record r (previously written). Throws std::runtime_error on failure.
  void Read(uint32_t r, void* dst) const {
    size_t done = 0;
    const off_t base = static_cast<off_t>(r) * static_cast<off_t>(record_bytes_);
    while (done < record_bytes_) {
      ssize_t got = ::pread(fd_, static_cast<char*>(dst) + done, record_bytes_ - done, base + done);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        throw std::runtime_error("tiered storage: reading row " + std::to_string(r) + " from " + DataPath(0) +
                                 " failed: " + (got < 0 ? std::strerror(errno) : "short file"));
      done += static_cast<size_t>(got);
    }
  }

  // Bytes the file occupies on disk (allocated blocks, not its apparent size).
  int64_t disk_bytes() const {
    struct stat st;
    if (fd_ < 0 || ::fstat(fd_, &st) != 0) return 0;
    return static_cast<int64_t>(st.st_blocks) * 512;
  }

  // Re-lays every record out at `new_record_bytes` (optimizer slots added):
  // record r of the old file (only those `present(r)` says exist) is copied
  // to the head of record r of a new file, the rest filled from `tail`.
  // The new file replaces the old one only when complete; on failure the old
  // one stays and false is returned (last_error()).
  template <typename Present>
  bool Widen(size_t new_record_bytes, uint32_t nrecords, const Present& present, const std::vector<char>& tail) {
    int nfd = ::open(DataPath(1).c_str(), O_CREAT | O_RDWR | O_TRUNC | O_CLOEXEC, 0600);
    if (nfd < 0) {
      last_error_.store(errno, std::memory_order_relaxed);
      return false;
    }
    std::vector<char> buf(new_record_bytes);
    for (uint32_t r = 0; r < nrecords; ++r) {
      if (!present(r)) continue;
      Read(r, buf.data());
      std::memcpy(buf.data() + record_bytes_, tail.data(), new_record_bytes - record_bytes_);
      if (!WriteAt(nfd, r, new_record_bytes, buf.data(), nullptr)) {
        ::close(nfd);
        ::unlink(DataPath(1).c_str());
        return false;
      }
    }
    if (::rename(DataPath(1).c_str(), DataPath(0).c_str()) != 0) {
      last_error_.store(errno, std::memory_order_relaxed);
      ::close(nfd);
      ::unlink(DataPath(1).c_str());
      return false;
    }
    ::close(fd_);
    fd_ = nfd;
    record_bytes_ = new_record_bytes;
    return true;
  }

  // Removes every `kDirPrefix*` directory under `parent` whose lock file is
  // not locked (its process is gone). Returns how many were removed.
  static int ClearStale(const std::string& parent) {
    DIR* d = ::opendir(parent.c_str());
    if (!d) return 0;
    std::vector<std::string> stale;
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name.compare(0, std::strlen(kDirPrefix), kDirPrefix) != 0) continue;
      std::string dir = parent + "/" + name;
      int fd = ::open((dir + "/lock").c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) {
        // No lock file: a creator that died before locking it, or one
        // between mkdir and open right now (so only when a minute old).
        struct stat st;
        if (errno == ENOENT && ::stat(dir.c_str(), &st) == 0 && ::time(nullptr) - st.st_mtime > 60)
          stale.push_back(dir);
        continue;
      }
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0) stale.push_back(dir);  // nobody holds it
      ::close(fd);
    }
    ::closedir(d);
    for (const std::string& dir : stale) RemoveDir(dir);
    return static_cast<int>(stale.size());
  }

 private:
  std::string DataPath(int which) const { return dir_ + (which == 0 ? "/rows" : "/rows.widening"); }

  bool WriteAt(int fd, uint32_t r, size_t bytes, const void* src, int* err) {
    size_t done = 0;
    const off_t base = static_cast<off_t>(r) * static_cast<off_t>(bytes);
    while (done < bytes) {
      ssize_t put = ::pwrite(fd, static_cast<const char*>(src) + done, bytes - done, base + done);
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) {
        const int e = put < 0 ? errno : ENOSPC;
        last_error_.store(e, std::memory_order_relaxed);
        if (err) *err = e;
        return false;
      }
      done += static_cast<size_t>(put);
    }
    return true;
  }

  static void RemoveDir(const std::string& dir) {
    if (DIR* d = ::opendir(dir.c_str())) {
      std::vector<std::string> files;
      while (struct dirent* e = ::readdir(d)) {
        std::string name = e->d_name;
        if (name != "." && name != "..") files.push_back(dir + "/" + name);
      }
      ::closedir(d);
      for (const std::string& f : files) ::unlink(f.c_str());
    }
    ::rmdir(dir.c_str());
  }

  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (!dir_.empty()) RemoveDir(dir_);  // while still locked: nobody takes it for stale
    if (lock_fd_ >= 0) ::close(lock_fd_);
    lock_fd_ = -1;
    dir_.clear();
  }

  size_t record_bytes_;
  std::string dir_;
  int fd_ = -1;
  int lock_fd_ = -1;
  std::atomic<int> last_error_{0};
};

}  // namespace evstore
