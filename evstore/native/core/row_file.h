// RowFile: the disk engine of the tiered row store (tiered_store.h). No TensorFlow.
//
// Layout: one flat file of fixed-size records, record `loc` at byte offset
// loc * record_bytes (a row's floats as in DRAM: RecordBytes, row_store.h). The store decides where each row goes (log_space.h: a
// log-structured layout, where a batch of evicted rows is one contiguous run
// of records written by one pwritev); this class only moves records: runs of
// adjacent records written in one call, records read one memcpy each from a
// mapping of the file (below). Records never written are holes (a sparse file).
//
// Reads. The file is mapped read-only and shared (MAP_SHARED: the kernel's
// page cache, coherent with pwrite), in windows of kWindowRecords records
// (no record straddles two) mapped on first use and kept until the file is
// replaced (Widen) or closed. A record whose page is in the page cache is then
// a memcpy: no syscall and no page-cache lookup per record, which is what a
// pread of one 768-byte row costs several times over. The mapped pages are
// the page cache's (shared, clean, reclaimable under memory pressure, the same
// pages a pread would have left cached); the process's RSS counts them as
// RssFile, the DRAM the tier holds for itself is its RssAnon. Portable path:
// where mmap is refused (an address-space limit, a file system without it)
// or the store asks for it (TierConfig::mapped_reads = false), records are
// read with one preadv per run of adjacent records, as before the mapping.
// A page not in the page cache (reclaimed under memory pressure, or a file
// larger than memory) is read by the fault that touches it: one synchronous
// 4 KiB read (MADV_RANDOM: no readahead window), one after another through a
// batch. So ReadMany counts this thread's major faults (getrusage) around its
// copies, on one call in kFaultSample while it is not hinting (the count is
// two system calls; a cached batch's copies are far cheaper than a disk's
// reads); after a batch that took any, the next kHintBatches batches first
// hand the kernel all their records (WillNeed, one fadvise per run of
// adjacent records), which reads them together, and their faults find the
// pages in the cache. Batches whose pages are all cached pay the two
// getrusage calls once in kFaultSample.
//
// Mapped as written. A page of the file is in the page cache once written,
// but a read through the mapping still takes a page fault on its first touch
// from this process (a minor fault: the kernel maps it, and up to 15 cached
// neighbours). A large file written in bulk (a load, a restore, a widening)
// and read back at random paid one such fault per few misses for as long as
// most of its pages had not been touched. So each run of records written is
// also mapped at once (Populate: MADV_POPULATE_READ over its pages, one call
// per run, no fault taken): a cached record is a memcpy from its first read.
// A kernel without MADV_POPULATE_READ turns it off (populating()).
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
// Invariants: only records that were written (so inside the file) are read;
// a record is never read while it is being written (the store reads only
// live records and reuses an extent only when none of its records is live).
//
// Errors: a write that cannot complete (ENOSPC, EFBIG from RLIMIT_FSIZE,
// EIO) returns false with errno kept in last_error(); the caller keeps the
// row in DRAM, so a full disk loses nothing. A preadv that fails throws
// std::runtime_error (the row's only copy is unreadable); through the
// mapping, a disk error reading a page not in the page cache raises SIGBUS
// instead (the process ends; nothing committed is lost: checkpoints are the
// source of truth). A store that must survive a failing disk asks for the
// portable path.
#pragma once
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace evstore {

class RowFile {
 public:
  static constexpr const char* kDirPrefix = "evstore-tier-";
  // Records per mapped window, and windows enough for every record location
  // (log_space.h: 2^32 records at most).
  static constexpr uint32_t kWindowShift = 20;
  static constexpr uint32_t kWindowRecords = 1u << kWindowShift;
  static constexpr uint32_t kWindows = 1u << (32 - kWindowShift);
  static constexpr size_t kMaxIov = 1024;  // IOV_MAX on Linux: buffers per preadv/pwritev
  static constexpr size_t kZeroBytes = size_t{64} << 10;  // WriteZeros' buffer

  // Creates the private directory under `parent` (created if missing) and an
  // empty record file of `record_bytes` per record. Throws std::runtime_error
  // when the parent cannot be created or written.
  RowFile(const std::string& parent, size_t record_bytes, bool mapped_reads = true)
      : record_bytes_(record_bytes), mapped_(mapped_reads), windows_(new std::atomic<char*>[kWindows]) {
    for (uint32_t w = 0; w < kWindows; ++w) windows_[w].store(nullptr, std::memory_order_relaxed);
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
  // Whether reads go through the mapping (false: the portable preadv path,
  // asked for or fallen back to when mmap was refused).
  bool mapped_reads() const { return mapped_.load(std::memory_order_relaxed); }

  // Writes `n` adjacent records from `loc`, record i from srcs[i] (one
  // pwritev per kMaxIov records): a batch written from where its rows are,
  // without a copy. False (errno in last_error(), and in *err if given) when
  // the disk refuses: those records' contents on disk are then unspecified.
  // Reads and writes of different records may run concurrently (one
  // descriptor, positioned calls); Widen may not run beside them.
  bool Write(uint32_t loc, const void* const* srcs, size_t n, int* err = nullptr) {
    iovec iov[kMaxIov];
    for (size_t i = 0; i < n;) {
      const size_t m = std::min(n - i, kMaxIov);
      for (size_t k = 0; k < m; ++k) iov[k] = iovec{const_cast<void*>(srcs[i + k]), record_bytes_};
      if (!WriteRun(loc + static_cast<uint32_t>(i), iov, m, err)) return false;
      i += m;
    }
    Populate(loc, n);
    return true;
  }

  // Writes `n` records of zeros from `loc` (free room, written so that the
  // page cache holds its pages: log_space.h's reserve), in writes of up to
  // kMaxIov * kZeroBytes bytes. False when the disk refused (last_error()).
  bool WriteZeros(uint32_t loc, size_t n) {
    static const std::vector<char> zeros(kZeroBytes);
    off_t at = static_cast<off_t>(loc) * static_cast<off_t>(record_bytes_);
    for (size_t left = n * record_bytes_; left > 0;) {
      iovec iov[kMaxIov];
      size_t k = 0, bytes = 0;
      for (; k < kMaxIov && bytes < left; ++k) {
        iov[k] = iovec{const_cast<char*>(zeros.data()), std::min(kZeroBytes, left - bytes)};
        bytes += iov[k].iov_len;
      }
      if (!WriteV(fd_, at, iov, k, nullptr)) return false;
      at += static_cast<off_t>(bytes);
      left -= bytes;
    }
    return true;
  }

  // Reads record `loc` (previously written). Throws std::runtime_error on failure.
  void Read(uint32_t loc, void* dst) const {
    if (const char* rec = Mapped(loc)) {
      std::memcpy(dst, rec, record_bytes_);
      return;
    }
    iovec v{dst, record_bytes_};
    ReadRun(loc, &v, 1);
  }
  // Reads records locs[0..n) (ascending, distinct) into dsts[i]: from the
  // mapping, or on the portable path one preadv per run of adjacent records
  // (so rows written by one eviction batch come back in one call). Throws
  // std::runtime_error on failure (preadv).
  void ReadMany(const uint32_t* locs, void* const* dsts, size_t n) const {
    if (mapped_.load(std::memory_order_relaxed) && n > 0) {
      // Pages reclaimed from the page cache: the batch's reads asked for
      // together (see "Reads" above), while earlier batches faulted.
      const bool hinting = hint_batches_.load(std::memory_order_relaxed) > 0;
      if (hinting) {
        hint_batches_.fetch_sub(1, std::memory_order_relaxed);
        hinted_batches_.fetch_add(1, std::memory_order_relaxed);
        WillNeed(locs, n);
      }
      // Faults are counted (two getrusage calls) on one call in kFaultSample
      // of those that do not hint, the file's first included: a run of faults
      // is noticed within a few batches, and a cached file costs little.
      const bool sample = !hinting && reads_.fetch_add(1, std::memory_order_relaxed) % kFaultSample == 0;
      const long faults = sample ? MajorFaults() : 0;
      // The copies wait on memory: a record of the mapping is rarely in the
      // CPU cache (nor its page in the TLB), and one memcpy reaches its lines
      // one after another. So every line of the record kReadAhead places on
      // is asked for first, and the copies overlap those misses.
      size_t i = 0;
      for (size_t a = 0; a < std::min(n, kReadAhead); ++a) PrefetchRecord(locs[a]);
      for (; i < n; ++i) {
        if (i + kReadAhead < n) PrefetchRecord(locs[i + kReadAhead]);
        const char* rec = Mapped(locs[i]);
        if (!rec) break;  // mmap refused: the rest on the portable path
        std::memcpy(dsts[i], rec, record_bytes_);
      }
      if (sample && MajorFaults() != faults) hint_batches_.store(kHintBatches, std::memory_order_relaxed);
      locs += i;
      dsts += i;
      n -= i;
    }
    iovec iov[64];
    std::vector<iovec> big;
    for (size_t i = 0; i < n;) {
      size_t j = i + 1;
      while (j < n && j - i < kMaxIov && locs[j] == locs[j - 1] + 1) ++j;
      iovec* v = iov;
      if (j - i > 64) {
        big.resize(j - i);
        v = big.data();
      }
      for (size_t k = i; k < j; ++k) v[k - i] = iovec{dsts[k], record_bytes_};
      ReadRun(locs[i], v, j - i);
      i = j;
    }
  }

  // Reads the `n` adjacent records from `first` into dst (one pread, bytes
  // between written records included: a full export's sequential stream).
  // Throws std::runtime_error on failure.
  void ReadSpan(uint32_t first, size_t n, void* dst) const {
    iovec v{dst, n * record_bytes_};
    ReadRun(first, &v, 1);
  }
  // Tells the kernel the `n` records from `first` will be read soon (read-ahead).
  void WillNeedSpan(uint32_t first, size_t n) const {
    ::posix_fadvise(fd_, static_cast<off_t>(first) * static_cast<off_t>(record_bytes_),
                    static_cast<off_t>(n * record_bytes_), POSIX_FADV_WILLNEED);
  }

  // Tells the kernel records locs[0..n) (ascending) will be read soon, one
  // hint per run of adjacent records: it starts reading them from disk
  // without waiting, so the reads that follow find them in the page cache.
  void WillNeed(const uint32_t* locs, size_t n) const {
    for (size_t i = 0; i < n;) {
      size_t j = i + 1;
      while (j < n && locs[j] == locs[j - 1] + 1) ++j;
      ::posix_fadvise(fd_, static_cast<off_t>(locs[i]) * static_cast<off_t>(record_bytes_),
                      static_cast<off_t>((j - i) * record_bytes_), POSIX_FADV_WILLNEED);
      i = j;
    }
  }

  // Whether written records are mapped as they are written (see "Mapped as
  // written" above): reads through the mapping, and a kernel that does it.
  bool populating() const {
    return mapped_.load(std::memory_order_relaxed) && populate_.load(std::memory_order_relaxed);
  }

  // Batches of ReadMany that asked the kernel for their records first
  // (WillNeed) because an earlier batch's mapped reads took major faults.
  int64_t hinted_batches() const { return hinted_batches_.load(std::memory_order_relaxed); }

  // Bytes the file occupies on disk (allocated blocks, not its apparent size).
  int64_t disk_bytes() const {
    struct stat st;
    if (fd_ < 0 || ::fstat(fd_, &st) != 0) return 0;
    return static_cast<int64_t>(st.st_blocks) * 512;
  }

  // Re-lays the records out at `new_record_bytes` (optimizer slots added):
  // new record i (i < nrecords) is old record old_loc(i) followed by `tail`,
  // written in runs of adjacent records. The new file replaces the old one
  // only when complete; on failure the old one stays and false is returned
  // (last_error()).
  template <typename OldLoc>
  bool Widen(size_t new_record_bytes, uint32_t nrecords, const OldLoc& old_loc, const std::vector<char>& tail) {
    int nfd = ::open(DataPath(1).c_str(), O_CREAT | O_RDWR | O_TRUNC | O_CLOEXEC, 0600);
    if (nfd < 0) {
      last_error_.store(errno, std::memory_order_relaxed);
      return false;
    }
    constexpr uint32_t kRun = 256;
    std::vector<char> buf(kRun * new_record_bytes);
    try {
      for (uint32_t lo = 0; lo < nrecords; lo += kRun) {
        const uint32_t n = std::min(kRun, nrecords - lo);
        for (uint32_t i = 0; i < n; ++i) {
          char* rec = buf.data() + i * new_record_bytes;
          Read(old_loc(lo + i), rec);
          std::memcpy(rec + record_bytes_, tail.data(), new_record_bytes - record_bytes_);
        }
        if (!WriteAt(nfd, lo, new_record_bytes, n, buf.data(), nullptr)) {
          ::close(nfd);
          ::unlink(DataPath(1).c_str());
          return false;
        }
      }
    } catch (const std::runtime_error&) {
      last_error_.store(EIO, std::memory_order_relaxed);
      ::close(nfd);
      ::unlink(DataPath(1).c_str());
      return false;
    }
    if (::rename(DataPath(1).c_str(), DataPath(0).c_str()) != 0) {
      last_error_.store(errno, std::memory_order_relaxed);
      ::close(nfd);
      ::unlink(DataPath(1).c_str());
      return false;
    }
    Unmap();
    ::close(fd_);
    fd_ = nfd;
    record_bytes_ = new_record_bytes;
    Populate(0, nrecords);  // the whole new file was just written: its pages are cached
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

  // Writes n records of `record_bytes` from `src` at record `loc` of file `fd`.
  bool WriteAt(int fd, uint32_t loc, size_t record_bytes, size_t n, const void* src, int* err) {
    iovec one{const_cast<void*>(src), record_bytes * n};
    return WriteV(fd, static_cast<off_t>(loc) * static_cast<off_t>(record_bytes), &one, 1, err);
  }

  // Records a mapped read asks the CPU for ahead of the one it copies.
  static constexpr size_t kReadAhead = 4;
  // Starts loading record `loc`'s lines from the mapping into the CPU cache.
  void PrefetchRecord(uint32_t loc) const {
    const char* rec = Mapped(loc);
    if (!rec) return;
    for (size_t off = 0; off < record_bytes_; off += 64) __builtin_prefetch(rec + off);
    __builtin_prefetch(rec + record_bytes_ - 1);  // the last line, when records are not whole lines
  }
  // Record `loc` in the mapping (its window mapped on first use), or null on
  // the portable path (the first refused mmap turns the mapping off).
  const char* Mapped(uint32_t loc) const {
    if (!mapped_.load(std::memory_order_relaxed)) return nullptr;
    const uint32_t w = loc >> kWindowShift;
    char* base = windows_[w].load(std::memory_order_acquire);
    if (!base && !(base = MapWindow(w))) return nullptr;
    return base + static_cast<size_t>(loc & (kWindowRecords - 1)) * record_bytes_;
  }
  char* MapWindow(uint32_t w) const {
    std::lock_guard<std::mutex> l(map_mu_);
    char* base = windows_[w].load(std::memory_order_relaxed);
    if (base || !mapped_.load(std::memory_order_relaxed)) return base;
    void* p = ::mmap(nullptr, WindowBytes(), PROT_READ, MAP_SHARED | MAP_NORESERVE, fd_,
                     static_cast<off_t>(w) * static_cast<off_t>(WindowBytes()));
    if (p == MAP_FAILED) {
      mapped_.store(false, std::memory_order_relaxed);
      return nullptr;
    }
    ::madvise(p, WindowBytes(), MADV_RANDOM);  // a fault reads its page, not a readahead window
    base = static_cast<char*>(p);
    windows_[w].store(base, std::memory_order_release);
    return base;
  }
  size_t WindowBytes() const { return static_cast<size_t>(kWindowRecords) * record_bytes_; }
  // Maps the pages of records [loc, loc + n) (just written: in the page
  // cache) into the mapping's page tables, one madvise per window. A kernel
  // without MADV_POPULATE_READ (before Linux 5.14: EINVAL) turns it off; any
  // other refusal (a page the kernel could not read) leaves those pages to
  // fault in when read, as before.
  void Populate(uint32_t loc, size_t n) const {
    if (n == 0 || !populate_.load(std::memory_order_relaxed)) return;
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    for (uint64_t lo = loc, end = uint64_t{loc} + n; lo < end;) {
      const uint32_t w = static_cast<uint32_t>(lo >> kWindowShift);
      const uint64_t hi = std::min<uint64_t>(end, uint64_t{w + 1} << kWindowShift);
      const char* base = Mapped(static_cast<uint32_t>(lo));
      if (!base) return;  // the portable path: nothing is mapped
      const uintptr_t from = reinterpret_cast<uintptr_t>(base) & ~(page - 1);
      const uintptr_t to = reinterpret_cast<uintptr_t>(base) + (hi - lo) * record_bytes_;
      if (::madvise(reinterpret_cast<void*>(from), to - from, kPopulateRead) != 0 && errno == EINVAL) {
        populate_.store(false, std::memory_order_relaxed);
        return;
      }
      lo = hi;
    }
  }
  // Page faults of this thread that read the disk (getrusage: the kernel's count).
  static long MajorFaults() {
    rusage ru;
    ::getrusage(RUSAGE_THREAD, &ru);
    return ru.ru_majflt;
  }
  // Unmaps every window (the file is being replaced or closed: no reader runs).
  void Unmap() {
    for (uint32_t w = 0; w < kWindows; ++w) {
      char* base = windows_[w].exchange(nullptr, std::memory_order_relaxed);
      if (base) ::munmap(base, WindowBytes());
    }
  }

  // Writes the buffers of v[0..n) as adjacent records from `loc`.
  bool WriteRun(uint32_t loc, iovec* v, size_t n, int* err) {
    return WriteV(fd_, static_cast<off_t>(loc) * static_cast<off_t>(record_bytes_), v, n, err);
  }
  // Writes the buffers of v[0..n) at byte `at` of `fd` (short writes resumed); on failure
  // keeps errno in last_error_ and *err.
  bool WriteV(int fd, off_t at, iovec* v, size_t n, int* err) {
    size_t first = 0;
    while (first < n) {
      ssize_t put = ::pwritev(fd, v + first, static_cast<int>(n - first), at);
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) {
        const int e = put < 0 ? errno : ENOSPC;
        last_error_.store(e, std::memory_order_relaxed);
        if (err) *err = e;
        return false;
      }
      at += put;
      Advance(v, n, &first, static_cast<size_t>(put));
    }
    return true;
  }
  // Moves past `done` bytes of v[first..n) (a short read or write).
  static void Advance(iovec* v, size_t n, size_t* first, size_t done) {
    while (*first < n && done >= v[*first].iov_len) done -= v[(*first)++].iov_len;
    if (done) {  // inside one buffer: continue after what was moved
      v[*first].iov_base = static_cast<char*>(v[*first].iov_base) + done;
      v[*first].iov_len -= done;
    }
  }

  // Reads the adjacent records from `loc` into the buffers of v[0..n).
  void ReadRun(uint32_t loc, iovec* v, size_t n) const {
    off_t at = static_cast<off_t>(loc) * static_cast<off_t>(record_bytes_);
    size_t first = 0;
    while (first < n) {
      ssize_t got = ::preadv(fd_, v + first, static_cast<int>(n - first), at);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        throw std::runtime_error("tiered storage: reading record " + std::to_string(loc) + " from " + DataPath(0) +
                                 " failed: " + (got < 0 ? std::strerror(errno) : "short file"));
      at += got;
      Advance(v, n, &first, static_cast<size_t>(got));
    }
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
    Unmap();
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
  mutable std::atomic<bool> mapped_;                   // reads through the mapping
  mutable std::mutex map_mu_;                          // maps a window
  std::unique_ptr<std::atomic<char*>[]> windows_;      // per window: its mapping, or null
  // ReadMany batches still to hint (WillNeed) since the last one that took a
  // major fault; and the batches hinted so far.
  static constexpr int kHintBatches = 256;
  static constexpr uint32_t kFaultSample = 8;
  static_assert(kFaultSample < kHintBatches, "a run of faults is noticed well within one hinted window");
  mutable std::atomic<int> hint_batches_{0};
  mutable std::atomic<uint32_t> reads_{0};  // mapped ReadMany calls that did not hint (fault sampling)
  mutable std::atomic<int64_t> hinted_batches_{0};
  // MADV_POPULATE_READ (Linux 5.14; the value where older headers lack it).
#ifdef MADV_POPULATE_READ
  static constexpr int kPopulateRead = MADV_POPULATE_READ;
#else
  static constexpr int kPopulateRead = 22;
#endif
  mutable std::atomic<bool> populate_{true};  // Populate: off once the kernel refuses it
};

}  // namespace evstore
