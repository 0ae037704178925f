// Streaming tensor bundle writer and reader (see bundle_stream.h).
#include "bundle_stream.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.pb.h"
#include "tensorflow/core/framework/versions.pb.h"
#include "tensorflow/core/util/tensor_bundle/naming.h"
#include "tensorflow/core/util/tensor_bundle/tensor_bundle.h"
#include "xla/tsl/lib/hash/crc32c.h"  // Mask / Unmask of entry checksums
#include "../core/crc32c.h"
#include "xla/tsl/lib/io/iterator.h"
#include "xla/tsl/lib/io/table.h"
#include "xla/tsl/lib/io/table_builder.h"
#include "xla/tsl/lib/io/table_options.h"
#include "xla/tsl/platform/env.h"

namespace evstore {
namespace tf {

namespace {

std::runtime_error IoError(const std::string& what, const std::string& path) {
  return std::runtime_error(what + " '" + path + "': " + std::strerror(errno));
}

std::string Dirname(const std::string& p) {
  size_t i = p.rfind('/');
  return i == std::string::npos ? "." : (i == 0 ? "/" : p.substr(0, i));
}

void FsyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // best effort: some filesystems do not allow it
  ::fsync(fd);
  ::close(fd);
}

// Appends the whole file `path` to `out`; `crc` (if not null) is extended
// with the bytes copied.
void CopyInto(const std::string& path, OutFile* out, uint32_t* crc) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError("cannot reopen", path);
  std::vector<char> buf(1 << 20);
  ssize_t r;
  while ((r = ::read(fd, buf.data(), buf.size())) != 0) {
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      ::close(fd);
      throw IoError("cannot read", path);
    }
    out->Write(buf.data(), r);
    if (crc) *crc = Crc32cExtend(*crc, buf.data(), r);
  }
  ::close(fd);
}

void ThrowIfError(const absl::Status& s, const std::string& what) {
  if (!s.ok()) throw std::runtime_error(what + ": " + std::string(s.message()));
}

struct Sink {
  SinkOpenFn open = nullptr;
  SinkWriteFn write = nullptr;
  SinkCloseFn close = nullptr;
  SinkRenameFn rename = nullptr;
  SinkRemoveFn remove = nullptr;
};
Sink g_sink;  // set once per process, before any save (checkpoint/object_sink.py)

const Sink& TheSink(const std::string& path) {
  if (!g_sink.open)
    throw std::runtime_error("checkpoint file '" + path + "' is for an object sink, and this process registered "
                             "none (checkpoint/object_sink.py install())");
  return g_sink;
}

// The table builder's output, kept in memory (an object sink's index).
class StringFile : public tsl::WritableFile {
 public:
  absl::Status Append(absl::string_view data) override {
    s.append(data.data(), data.size());
    return absl::OkStatus();
  }
  absl::Status Close() override { return absl::OkStatus(); }
  absl::Status Flush() override { return absl::OkStatus(); }
  absl::Status Sync() override { return absl::OkStatus(); }
  std::string s;
};

}  // namespace

bool IsSinkPath(const std::string& path) { return path.rfind(kSinkScheme, 0) == 0; }

extern "C" __attribute__((visibility("default"))) void evstore_set_object_sink(
    SinkOpenFn open, SinkWriteFn write, SinkCloseFn close, SinkRenameFn rename, SinkRemoveFn remove) {
  g_sink = Sink{open, write, close, rename, remove};
}

void SinkRename(const std::string& from, const std::string& to) {
  if (TheSink(from).rename(from.c_str(), to.c_str()) != 0)
    throw std::runtime_error("object sink: cannot rename '" + from + "' to '" + to + "'");
}

void SinkRemove(const std::string& path) {
  if (g_sink.remove) g_sink.remove(path.c_str());
}

// ------------------------------------------------------------------ object source

namespace {
struct Source {
  SourceOpenFn open = nullptr;
  SourceSizeFn size = nullptr;
  SourceReadFn read = nullptr;
  SourceCloseFn close = nullptr;
};
Source g_source;  // set once per process, before any load (checkpoint/object_source.py)

// A whole file held in memory as a RandomAccessFile (an object source's index, for the table reader).
class StringSource : public tsl::RandomAccessFile {
 public:
  explicit StringSource(std::string s) : s_(std::move(s)) {}
  absl::Status Read(uint64_t offset, size_t n, absl::string_view* result, char* scratch) const override {
    if (offset >= s_.size()) {
      *result = absl::string_view();
      return n == 0 ? absl::OkStatus() : absl::OutOfRangeError("read past the end of the index");
    }
    const size_t take = std::min(n, s_.size() - static_cast<size_t>(offset));
    *result = absl::string_view(s_.data() + offset, take);
    return take == n ? absl::OkStatus() : absl::OutOfRangeError("read past the end of the index");
  }
  size_t size() const { return s_.size(); }

 private:
  std::string s_;
};
}  // namespace

bool IsSourcePath(const std::string& path) { return path.rfind(kSourceScheme, 0) == 0; }

extern "C" __attribute__((visibility("default"))) void evstore_set_object_source(SourceOpenFn open, SourceSizeFn size,
                                                                                  SourceReadFn read,
                                                                                  SourceCloseFn close) {
  g_source = Source{open, size, read, close};
}

InFile::InFile(const std::string& path, int64_t start, int64_t end) : path_(path) {
  if (IsSourcePath(path_)) {
    if (!g_source.open)
      throw std::runtime_error("checkpoint file '" + path_ + "' is of an object source, and this process registered "
                               "none (checkpoint/object_source.py install())");
    src_ = g_source.open(path_.c_str(), start, end);
    if (src_ < 0) throw std::runtime_error("cannot open checkpoint data file '" + path_ + "': missing or unreadable");
    return;
  }
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw IoError("cannot open checkpoint data file", path_);
  direct_ = std::make_unique<DirectReader>(path_);
}

InFile::~InFile() {
  if (fd_ >= 0) ::close(fd_);
  if (src_ >= 0) g_source.close(src_);
}

int64_t InFile::Size() const {
  if (src_ >= 0) {
    const int64_t n = g_source.size(src_);
    if (n < 0) throw std::runtime_error("cannot read the size of checkpoint file '" + path_ + "'");
    return n;
  }
  struct stat st;
  if (::fstat(fd_, &st) != 0) throw IoError("cannot stat checkpoint file", path_);
  return st.st_size;
}

void InFile::WillNeed(int64_t offset, int64_t n) const {
  // A direct read would not use what the kernel read ahead into its cache.
  if (fd_ >= 0 && n > 0 && !direct_->Takes(offset)) ::posix_fadvise(fd_, offset, n, POSIX_FADV_WILLNEED);
}

int64_t InFile::ReadAt(int64_t offset, char* p, int64_t n) const {
  int64_t done = src_ >= 0 ? 0 : direct_->Read(offset, p, n);
  if (done < 0) throw IoError("cannot read checkpoint file", path_);
  while (done < n) {
    int64_t r;
    if (src_ >= 0) {
      r = g_source.read(src_, offset + done, p + done, n - done);
      if (r < 0) throw std::runtime_error("cannot read checkpoint file '" + path_ + "'");
    } else {
      r = ::pread(fd_, p + done, n - done, offset + done);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw IoError("cannot read checkpoint file", path_);
    }
    if (r == 0) break;  // the end of the file
    done += r;
  }
  return done;
}

std::string InFile::ReadAll() const {
  std::string s(static_cast<size_t>(Size()), '\0');
  const int64_t got = ReadAt(0, s.data(), static_cast<int64_t>(s.size()));
  s.resize(static_cast<size_t>(got));
  return s;
}

// ------------------------------------------------------------------ OutFile

OutFile::OutFile(std::string path, bool in_memory)
    : path_(std::move(path)),
      in_memory_(in_memory),
      buf_(in_memory ? 0 : IsSinkPath(path_) ? kBufferBytes : kLocalBufferBytes),
      cur_(buf_.data()),
      cap_(buf_.size()) {
  if (in_memory_) return;
  if (IsSinkPath(path_)) {
    sink_ = TheSink(path_).open(path_.c_str());
    if (sink_ < 0) throw std::runtime_error("object sink: cannot create checkpoint file '" + path_ + "'");
    return;
  }
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw IoError("cannot create checkpoint file", path_);
  direct_ = std::make_unique<DirectWriter>(path_, fd_);
  if (!direct_->direct()) {
    direct_.reset();
    return;
  }
  std::vector<char>().swap(buf_);
  cur_ = direct_->buffer();
  cap_ = direct_->capacity();
}

OutFile::~OutFile() {
  direct_.reset();  // waits for its write in flight, which writes to fd_
  if (fd_ >= 0) ::close(fd_);
  if (sink_ >= 0) g_sink.close(sink_, /*keep=*/0);  // not closed: a failed save, nothing of it is kept
}

void OutFile::Write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  crc_ = Crc32cExtend(crc_, p, n);
  size_ += n;
  if (in_memory_) {
    mem_.append(p, n);
    return;
  }
  while (n > 0) {
    if (used_ == 0 && n >= cap_ && fd_ >= 0 && !direct_) {  // whole buffers' worth: from the caller's bytes
      const size_t whole = n - n % cap_;
      WriteOut(p, whole);
      p += whole;
      n -= whole;
      continue;
    }
    size_t take = std::min(n, cap_ - used_);
    std::memcpy(cur_ + used_, p, take);
    used_ += take;
    p += take;
    n -= take;
    if (used_ == cap_) Flush();
  }
}

void OutFile::WriteRows(const void* data, size_t row_bytes, size_t stride_bytes, size_t rows) {
  const char* p = static_cast<const char*>(data);
  if (stride_bytes == row_bytes) return Write(p, row_bytes * rows);
  if (in_memory_) {
    for (size_t i = 0; i < rows; ++i) Write(p + i * stride_bytes, row_bytes);
    return;
  }
  while (rows > 0) {
    const size_t fit = std::max<size_t>(1, (cap_ - used_) / row_bytes);
    const size_t take = std::min(rows, fit);
    if (used_ + take * row_bytes > cap_) {  // a row that does not fit what is left: through Write
      Write(p, row_bytes);
      p += stride_bytes;
      --rows;
      continue;
    }
    char* dst = cur_ + used_;
    for (size_t i = 0; i < take; ++i, p += stride_bytes) std::memcpy(dst + i * row_bytes, p, row_bytes);
    crc_ = Crc32cExtend(crc_, dst, take * row_bytes);  // while the gathered rows are in the cache
    used_ += take * row_bytes;
    size_ += static_cast<int64_t>(take * row_bytes);
    rows -= take;
    if (cap_ - used_ < row_bytes) Flush();  // a direct file's waits for a whole buffer (the row through Write)
  }
}

void OutFile::Flush() {
  if (sink_ >= 0) {
    if (used_ > 0 && g_sink.write(sink_, cur_, static_cast<int64_t>(used_)) != 0)
      throw std::runtime_error("object sink: cannot write checkpoint file '" + path_ + "'");
    used_ = 0;
    return;
  }
  if (direct_) {
    if (used_ == cap_) SubmitDirect();  // else the bytes wait for the rest of their buffer (or Close)
    return;
  }
  WriteOut(cur_, used_);
  used_ = 0;
}

void OutFile::SubmitDirect() {
  if (const int err = direct_->Submit(written_)) {
    errno = err;
    throw IoError("cannot write checkpoint file", path_);
  }
  written_ += static_cast<int64_t>(used_);
  cur_ = direct_->buffer();
  used_ = 0;
}

void OutFile::WriteOut(const char* p, size_t n) {
  size_t off = 0;
  while (off < n) {
    ssize_t w = ::write(fd_, p + off, n - off);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw IoError("cannot write checkpoint file", path_);
    }
    off += static_cast<size_t>(w);
  }
  written_ += static_cast<int64_t>(n);
#if defined(__linux__)
  // Start the disk writing what this file holds so far, without waiting for
  // it: the save's CPU work and the disk's writes then overlap, where the
  // kernel would otherwise start only at its dirty-page threshold and leave
  // the rest to Close's fsync. Best effort: a filesystem without it (or a
  // failure) leaves the write-back to the kernel and the fsync.
  if (written_ - kicked_ >= kWritebackBytes) {
    ::sync_file_range(fd_, kicked_, written_ - kicked_, SYNC_FILE_RANGE_WRITE);
    kicked_ = written_;
  }
#endif
}

void OutFile::Close(bool sync) {
  if (sink_ >= 0) {  // the sink's close completes the upload: durable in the object store, or an error
    Flush();
    const int64_t h = sink_;
    sink_ = -1;
    if (g_sink.close(h, /*keep=*/1) != 0)
      throw std::runtime_error("object sink: cannot complete checkpoint file '" + path_ + "'");
    std::vector<char>().swap(buf_);
    return;
  }
  if (fd_ < 0) return;
  if (direct_) {  // the buffer in flight, then the tail through the page cache
    const int err = direct_->Finish(used_, written_);
    direct_.reset();
    if (err != 0) {
      errno = err;
      throw IoError("cannot write checkpoint file", path_);
    }
    written_ += static_cast<int64_t>(used_);
    used_ = 0;
  } else {
    Flush();
  }
  if (sync && ::fsync(fd_) != 0) throw IoError("cannot fsync checkpoint file", path_);
  if (::close(fd_) != 0) {
    fd_ = -1;
    throw IoError("cannot close checkpoint file", path_);
  }
  fd_ = -1;
  std::vector<char>().swap(buf_);
}

// ------------------------------------------------------------------ writer

BundleStreamWriter::BundleStreamWriter(std::string prefix) : prefix_(std::move(prefix)), sink_(IsSinkPath(prefix_)) {
  std::string tmp = prefix_ + ".tmp-main";
  main_ = std::make_unique<OutFile>(tmp);
  created_.push_back(tmp);
}

BundleStreamWriter::~BundleStreamWriter() {
  if (finished_) return;
  main_.reset();
  for (auto& c : cols_) c.file.reset();
  for (const auto& p : created_) Remove(p);
}

void BundleStreamWriter::Remove(const std::string& path) {
  if (sink_) {
    SinkRemove(path);
  } else {
    ::unlink(path.c_str());
  }
}

void BundleStreamWriter::Rename(const std::string& from, const std::string& to) {
  if (sink_) {
    SinkRename(from, to);
  } else if (::rename(from.c_str(), to.c_str()) != 0) {
    throw IoError("cannot rename checkpoint file to", to);
  }
}

void BundleStreamWriter::CheckName(const std::string& name) {
  if (name.empty()) throw std::invalid_argument("checkpoint tensor names must not be empty");
  if (entries_.count(name)) throw std::invalid_argument("duplicate checkpoint tensor name '" + name + "'");
  for (const auto& c : cols_)
    if (c.name == name) throw std::invalid_argument("duplicate checkpoint tensor name '" + name + "'");
}

void BundleStreamWriter::AddTensor(const std::string& name, const tensorflow::Tensor& t) {
  CheckName(name);
  if (open_in_shard0_ >= 0)
    throw std::logic_error("tensor '" + name + "' added while column '" + cols_[open_in_shard0_].name +
                           "' streams into shard 0");
  if (!tensorflow::DataTypeCanUseMemcpy(t.dtype()))
    throw std::invalid_argument("checkpoint tensor '" + name + "' has dtype " +
                                tensorflow::DataTypeString(t.dtype()) + ", which the streaming writer does not store");
  has_whole_tensors_ = true;
  tensorflow::BundleEntryProto& e = entries_[name];
  e.set_dtype(t.dtype());
  t.shape().AsProto(e.mutable_shape());
  e.set_shard_id(0);
  e.set_offset(main_->size());
  auto bytes = t.tensor_data();
  main_->Write(bytes.data(), bytes.size());
  e.set_size(bytes.size());
  e.set_crc32c(tsl::crc32c::Mask(Crc32cExtend(0, bytes.data(), bytes.size())));
}

int BundleStreamWriter::BeginColumn(const std::string& name, tensorflow::DataType dtype,
                                    std::vector<int64_t> inner_dims, bool in_shard0) {
  CheckName(name);
  Column c;
  c.name = name;
  c.dtype = dtype;
  int64_t elems = 1;
  for (int64_t d : inner_dims) elems *= d;
  c.inner = std::move(inner_dims);
  c.row_bytes = elems * tensorflow::DataTypeSize(dtype);
  if (in_shard0) {
    if (open_in_shard0_ >= 0)
      throw std::logic_error("column '" + name + "' begun while '" + cols_[open_in_shard0_].name +
                             "' streams into shard 0");
    c.in_shard0 = true;
    c.offset = main_->size();
    has_whole_tensors_ = true;
    cols_.push_back(std::move(c));
    open_in_shard0_ = static_cast<int>(cols_.size()) - 1;
    return open_in_shard0_;
  }
  c.temp_path = prefix_ + ".tmp-" + std::to_string(cols_.size());
  created_.push_back(c.temp_path);
  c.file = std::make_unique<OutFile>(c.temp_path);
  cols_.push_back(std::move(c));
  return static_cast<int>(cols_.size()) - 1;
}

int BundleStreamWriter::BeginStringColumn(const std::string& name) {
  const int col = BeginColumn(name, tensorflow::DT_STRING, {});
  Column& c = cols_[col];
  c.is_string = true;
  c.row_bytes = 0;
  const std::string len_path = c.temp_path + ".len";
  if (sink_) {  // joined at EndColumn from memory: an object sink's file cannot be read back
    c.file = std::make_unique<OutFile>(c.temp_path, /*in_memory=*/true);
    c.lengths = std::make_unique<OutFile>(len_path, /*in_memory=*/true);
    return col;
  }
  created_.push_back(len_path);
  c.lengths = std::make_unique<OutFile>(len_path);
  return col;
}

void BundleStreamWriter::AppendStrings(int col, const std::string_view* v, int64_t n) {
  Column& c = cols_.at(col);
  if (c.ended || !c.is_string) throw std::logic_error("column '" + c.name + "' is not an open string column");
  char varint[10];
  for (int64_t i = 0; i < n; ++i) {
    uint64_t len = v[i].size();
    if (len > UINT32_MAX) throw std::invalid_argument("string of more than 4 GiB in '" + c.name + "'");
    const uint32_t len32 = static_cast<uint32_t>(len);  // the checksum covers each length as a uint32
    c.lengths_crc = Crc32cExtend(c.lengths_crc, &len32, sizeof(len32));
    int k = 0;
    do {
      uint8_t b = len & 0x7F;
      len >>= 7;
      varint[k++] = static_cast<char>(len ? (b | 0x80) : b);
    } while (len);
    c.lengths->Write(varint, k);
    c.file->Write(v[i].data(), v[i].size());
  }
  c.rows += n;
}

void BundleStreamWriter::Append(int col, const void* data, int64_t rows) {
  Column& c = cols_.at(col);
  if (c.ended) throw std::logic_error("column '" + c.name + "' already ended");
  if (c.is_string) throw std::logic_error("column '" + c.name + "' holds strings: AppendStrings");
  if (c.in_shard0) {
    main_->Write(data, rows * c.row_bytes);
    c.crc = Crc32cExtend(c.crc, data, rows * c.row_bytes);
    c.size += rows * c.row_bytes;
  } else {
    c.file->Write(data, rows * c.row_bytes);
  }
  c.rows += rows;
}

void BundleStreamWriter::AppendStrided(int col, const void* data, int64_t stride_bytes, int64_t rows) {
  Column& c = cols_.at(col);
  if (c.ended) throw std::logic_error("column '" + c.name + "' already ended");
  if (c.is_string || c.in_shard0) throw std::logic_error("column '" + c.name + "' takes no strided rows");
  c.file->WriteRows(data, c.row_bytes, stride_bytes, rows);
  c.rows += rows;
}

void BundleStreamWriter::EndColumn(int col) {
  Column& c = cols_.at(col);
  if (c.ended) return;
  if (c.in_shard0) {
    c.entry_crc = c.crc;
    c.ended = true;
    open_in_shard0_ = -1;
    return;
  }
  if (c.is_string && c.rows > 0) {
    // [varint lengths][masked crc32c of the uint32 lengths][bytes] into one file.
    c.file->Close(/*sync=*/false);
    c.lengths->Close(/*sync=*/false);
    std::unique_ptr<OutFile> bytes = std::move(c.file), lengths = std::move(c.lengths);
    c.temp_path += ".s";
    created_.push_back(c.temp_path);
    OutFile joined(c.temp_path);
    if (sink_) {
      joined.Write(lengths->memory().data(), lengths->memory().size());
    } else {
      CopyInto(lengths->path(), &joined, nullptr);
    }
    const uint32_t masked = tsl::crc32c::Mask(c.lengths_crc);
    const char le[4] = {static_cast<char>(masked & 0xFF), static_cast<char>((masked >> 8) & 0xFF),
                        static_cast<char>((masked >> 16) & 0xFF), static_cast<char>(masked >> 24)};
    joined.Write(le, 4);
    c.entry_crc = Crc32cExtend(c.lengths_crc, le, 4);
    if (sink_) {
      joined.Write(bytes->memory().data(), bytes->memory().size());
      c.entry_crc = Crc32cExtend(c.entry_crc, bytes->memory().data(), bytes->memory().size());
    } else {
      CopyInto(bytes->path(), &joined, &c.entry_crc);
      ::unlink(bytes->path().c_str());
      ::unlink(lengths->path().c_str());
    }
    joined.Close(/*sync=*/true);
    c.size = joined.size();
    c.crc = joined.crc();
    c.ended = true;
    return;
  }
  if (c.lengths) {  // an empty string column: no bytes at all (TensorFlow reads size 0 as no strings)
    c.lengths->Close(/*sync=*/false);
    if (!sink_) ::unlink(c.lengths->path().c_str());
    c.lengths.reset();
  }
  c.file->Close(/*sync=*/c.file->size() > 0);  // an empty column's file is unlinked: nothing to make durable
  c.size = c.file->size();
  c.crc = c.entry_crc = c.file->crc();
  c.file.reset();
  c.ended = true;
}

// The index (as BundleWriter writes it): header entry, then the entries
// sorted by name (std::map order = the table's byte order).
void BundleStreamWriter::BuildIndex(int num_shards, tsl::WritableFile* f, const std::string& where) {
  tsl::table::Options opts;
  opts.compression = tsl::table::kNoCompression;
  tsl::table::TableBuilder builder(opts, f);
  tensorflow::BundleHeaderProto header;
  header.set_num_shards(num_shards);
  header.set_endianness(tensorflow::BundleHeaderProto::LITTLE);
  header.mutable_version()->set_producer(tensorflow::kTensorBundleVersion);
  header.mutable_version()->set_min_consumer(tensorflow::kTensorBundleMinConsumer);
  builder.Add(tensorflow::kHeaderEntryKey, header.SerializeAsString());
  for (const auto& kv : entries_) builder.Add(kv.first, kv.second.SerializeAsString());
  ThrowIfError(builder.Finish(), "cannot write " + where);
}

std::vector<BundleFile> BundleStreamWriter::Finish(bool sync_dir) {
  for (size_t i = 0; i < cols_.size(); ++i) EndColumn(static_cast<int>(i));
  // Shard ids: 0 = whole tensors (and empty columns); 1.. = non-empty
  // columns in creation order. When nothing lives in shard 0 it is not
  // written and the columns start at 0: every data file is then referenced
  // by an entry, which TensorFlow's MergeV2Checkpoints requires (it renames
  // only referenced files, yet counts every file in the merged header).
  int nonempty = 0;
  int own_files = 0;  // columns that may have a file of their own
  for (const auto& c : cols_) {
    own_files += !c.in_shard0;
    nonempty += c.size > 0 && !c.in_shard0;
  }
  const bool main_used = has_whole_tensors_ || nonempty < own_files || nonempty == 0;
  const int num_shards = (main_used ? 1 : 0) + nonempty;
  main_->Close(/*sync=*/main_used);   // unused: unlinked below
  std::vector<BundleFile> files;
  auto rename = [&](const std::string& from, int shard, int64_t size, uint32_t crc) {
    std::string to = tensorflow::DataFilename(prefix_, shard, num_shards);
    Rename(from, to);
    created_.push_back(to);
    files.push_back({to.substr(to.rfind('/') + 1), size, crc});
  };
  if (main_used) {
    rename(prefix_ + ".tmp-main", 0, main_->size(), main_->crc());
  } else {
    Remove(prefix_ + ".tmp-main");
  }
  int shard = main_used ? 1 : 0;
  for (auto& c : cols_) {
    tensorflow::BundleEntryProto& e = entries_[c.name];
    e.set_dtype(c.dtype);
    tensorflow::TensorShape shape({c.rows});
    for (int64_t d : c.inner) shape.AddDim(d);
    shape.AsProto(e.mutable_shape());
    e.set_size(c.size);
    e.set_crc32c(tsl::crc32c::Mask(c.entry_crc));
    if (c.in_shard0) {
      e.set_shard_id(0);
      e.set_offset(c.size ? c.offset : 0);
    } else if (c.size == 0) {
      e.set_shard_id(0);
      e.set_offset(0);
      Remove(c.temp_path);
    } else {
      e.set_shard_id(shard);
      e.set_offset(0);
      rename(c.temp_path, shard++, c.size, c.crc);
    }
  }
  // The index, written last (as BundleWriter does).
  const std::string index = tensorflow::MetaFilename(prefix_);
  if (sink_) {  // built in memory, handed to the sink whole under its own name
    StringFile f;
    BuildIndex(num_shards, &f, index);
    OutFile out(index);
    created_.push_back(index);
    out.Write(f.s.data(), f.s.size());
    out.Close(/*sync=*/true);
    files.push_back({index.substr(index.rfind('/') + 1), out.size(), out.crc()});
    finished_ = true;
    return files;
  }
  const std::string index_tmp = index + ".tmp";
  created_.push_back(index_tmp);
  {
    std::unique_ptr<tsl::WritableFile> f;
    ThrowIfError(tsl::Env::Default()->NewWritableFile(index_tmp, &f), "cannot create " + index_tmp);
    BuildIndex(num_shards, f.get(), index_tmp);
    ThrowIfError(f->Sync(), "cannot fsync " + index_tmp);
    ThrowIfError(f->Close(), "cannot close " + index_tmp);
  }
  if (::rename(index_tmp.c_str(), index.c_str()) != 0) throw IoError("cannot rename checkpoint index to", index);
  created_.push_back(index);
  // Index file size and crc, for the caller's manifest.
  {
    std::vector<char> buf(1 << 16);
    const FileCrc32c f = Crc32cOfFile(index.c_str(), buf.data(), buf.size());
    if (f.err != 0) {
      errno = f.err;   // IoError names errno; close() may have changed it
      throw IoError(f.opened ? "cannot read" : "cannot reopen", index);
    }
    files.push_back({index.substr(index.rfind('/') + 1), f.size, f.crc});
  }
  if (sync_dir) FsyncDir(Dirname(prefix_));
  finished_ = true;
  return files;
}

// ------------------------------------------------------------------ reader

BundleStreamReader::BundleStreamReader(std::string prefix) : prefix_(std::move(prefix)) {
  const std::string index = tensorflow::MetaFilename(prefix_);
  uint64_t size = 0;
  std::unique_ptr<tsl::RandomAccessFile> file;
  if (IsSourcePath(index)) {  // read whole through the object source (a few KB: one entry per tensor)
    std::string bytes;
    try {
      bytes = InFile(index).ReadAll();
    } catch (const std::runtime_error& e) {
      throw std::runtime_error("cannot read checkpoint index " + index + ": " + e.what());
    }
    size = bytes.size();
    file = std::make_unique<StringSource>(std::move(bytes));
  } else {
    tsl::Env* env = tsl::Env::Default();
    ThrowIfError(env->GetFileSize(index, &size), "cannot read checkpoint index " + index);
    ThrowIfError(env->NewRandomAccessFile(index, &file), "cannot open checkpoint index " + index);
  }
  tsl::table::Table* raw = nullptr;
  ThrowIfError(tsl::table::Table::Open(tsl::table::Options(), file.get(), size, &raw),
               "corrupt checkpoint index " + index);
  std::unique_ptr<tsl::table::Table> table(raw);
  std::unique_ptr<tsl::table::Iterator> it(table->NewIterator());
  bool header = false;
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    std::string key(it->key());
    auto value = it->value();
    if (key.empty()) {
      tensorflow::BundleHeaderProto h;
      if (!h.ParseFromArray(value.data(), static_cast<int>(value.size())))
        throw std::runtime_error("corrupt checkpoint index " + index + ": bad header");
      num_shards_ = h.num_shards();
      header = true;
      continue;
    }
    tensorflow::BundleEntryProto e;
    if (!e.ParseFromArray(value.data(), static_cast<int>(value.size())))
      throw std::runtime_error("corrupt checkpoint index " + index + ": bad entry for '" + key + "'");
    entries_.emplace(std::move(key), std::move(e));
  }
  ThrowIfError(it->status(), "corrupt checkpoint index " + index);
  if (!header || num_shards_ < 1) throw std::runtime_error("corrupt checkpoint index " + index + ": no header");
}

const tensorflow::BundleEntryProto& BundleStreamReader::Entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end())
    throw std::runtime_error("checkpoint " + prefix_ + " has no tensor '" + name + "'");
  return it->second;
}

std::string BundleStreamReader::DataPath(int shard) const {
  return tensorflow::DataFilename(prefix_, shard, num_shards_);
}

BundleStreamReader::Column::Column(const BundleStreamReader& r, const std::string& name,
                                   tensorflow::DataType dtype, int64_t inner_elems)
    : name_(name) {
  const tensorflow::BundleEntryProto& e = r.Entry(name);
  if (e.dtype() != dtype)
    throw std::invalid_argument("checkpoint tensor '" + name + "' has dtype " +
                                tensorflow::DataTypeString(e.dtype()) + ", expected " +
                                tensorflow::DataTypeString(dtype));
  tensorflow::TensorShape shape(e.shape());
  int64_t inner = 1;
  for (int i = 1; i < shape.dims(); ++i) inner *= shape.dim_size(i);
  if (shape.dims() < 1 || inner != inner_elems)
    throw std::invalid_argument("checkpoint tensor '" + name + "' has shape " + shape.DebugString() +
                                ", expected [N, " + std::to_string(inner_elems) + " elements per row]");
  rows_ = shape.dim_size(0);
  row_bytes_ = inner * tensorflow::DataTypeSize(dtype);
  if (dtype != tensorflow::DT_STRING && e.size() != rows_ * row_bytes_)
    throw std::runtime_error("checkpoint index entry for '" + name + "' is corrupt (size " + std::to_string(e.size()) +
                             " for " + std::to_string(rows_) + " rows)");
  if (e.shard_id() < 0 || e.shard_id() >= r.num_shards_)
    throw std::runtime_error("checkpoint index entry for '" + name + "' names a missing shard");
  path_ = r.DataPath(e.shard_id());
  offset_ = e.offset();
  end_ = e.offset() + e.size();
  want_crc_ = tsl::crc32c::Unmask(e.crc32c());
  if (e.size() == 0) {
    if (dtype == tensorflow::DT_STRING && rows_ != 0)
      throw std::runtime_error("checkpoint index entry for '" + name + "' is corrupt (no bytes for " +
                               std::to_string(rows_) + " strings)");
    return;
  }
  file_ = std::make_unique<InFile>(path_, offset_, end_);  // an object source reads this range only
  if (file_->Size() < end_)
    throw std::runtime_error("checkpoint data file '" + path_ + "' is truncated (tensor '" + name + "' needs " +
                             std::to_string(end_) + " bytes)");
  if (dtype != tensorflow::DT_STRING) return;
  // The lengths (varint64 each), then their masked checksum; the bytes follow.
  const std::string corrupt = "checksum mismatch in checkpoint data file '" + path_ + "' (tensor '" + name + "'): ";
  lengths_.resize(rows_);
  std::vector<char> buf(1 << 16);
  int64_t have = 0, pos = 0, total = 0;
  for (int64_t i = 0; i < rows_; ++i) {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (pos == have) {
        const int64_t want = std::min<int64_t>(buf.size(), end_ - offset_);
        if (want <= 0 || shift > 63) throw std::runtime_error(corrupt + "bad string lengths, the file is corrupt");
        ReadAt(buf.data(), want);
        have = want;
        pos = 0;
      }
      const uint8_t b = static_cast<uint8_t>(buf[pos++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) break;
    }
    if (v > UINT32_MAX) throw std::runtime_error(corrupt + "bad string lengths, the file is corrupt");
    lengths_[i] = static_cast<uint32_t>(v);
    crc_ = Crc32cExtend(crc_, &lengths_[i], sizeof(uint32_t));
    total += v;
  }
  // Give back what was read past the lengths, then the 4-byte checksum.
  offset_ -= have - pos;
  char le[4];
  if (offset_ + 4 > end_) throw std::runtime_error(corrupt + "no length checksum, the file is corrupt");
  ReadAt(le, 4);
  const uint32_t stored = static_cast<uint32_t>(static_cast<uint8_t>(le[0])) |
                          static_cast<uint32_t>(static_cast<uint8_t>(le[1])) << 8 |
                          static_cast<uint32_t>(static_cast<uint8_t>(le[2])) << 16 |
                          static_cast<uint32_t>(static_cast<uint8_t>(le[3])) << 24;
  if (tsl::crc32c::Unmask(stored) != crc_)
    throw std::runtime_error(corrupt + "the string lengths do not match their checksum, the file is corrupt");
  crc_ = Crc32cExtend(crc_, le, 4);
  if (offset_ + total != end_)
    throw std::runtime_error(corrupt + "the string lengths do not add up to the tensor's size, the file is corrupt");
}

// Reads n bytes at offset_ (pread), advancing it; no checksum.
void BundleStreamReader::Column::ReadAt(char* p, int64_t n) {
  if (n > 0 && (!file_ || file_->ReadAt(offset_, p, n) != n))
    throw std::runtime_error("short read of tensor '" + name_ + "' from '" + path_ + "'");
  offset_ += n;
}

void BundleStreamReader::Column::ReadStrings(int64_t rows, std::string* storage, std::vector<std::string_view>* out) {
  if (next_ + rows > rows_) throw std::logic_error("read past the end of tensor '" + name_ + "'");
  int64_t bytes = 0;
  for (int64_t i = 0; i < rows; ++i) bytes += lengths_[next_ + i];
  storage->resize(bytes);
  if (bytes > 0) {
    ReadAt(storage->data(), bytes);
    crc_ = Crc32cExtend(crc_, storage->data(), bytes);
  }
  out->resize(rows);
  int64_t at = 0;
  for (int64_t i = 0; i < rows; ++i) {
    (*out)[i] = std::string_view(storage->data() + at, lengths_[next_ + i]);
    at += lengths_[next_ + i];
  }
  next_ += rows;
}

BundleStreamReader::Column::~Column() = default;

void BundleStreamReader::Column::Read(void* dst, int64_t rows) {
  if (!lengths_.empty() || (rows_ > 0 && row_bytes_ == 0))
    throw std::logic_error("tensor '" + name_ + "' holds strings: ReadStrings");
  int64_t n = rows * row_bytes_;
  if (offset_ + n > end_) throw std::logic_error("read past the end of tensor '" + name_ + "'");
  char* p = static_cast<char*>(dst);
  ReadAt(p, n);
  crc_ = Crc32cExtend(crc_, p, n);
}

void BundleStreamReader::Column::WillNeed(int64_t rows) const {
  if (file_ && lengths_.empty()) file_->WillNeed(offset_, std::min(rows * row_bytes_, end_ - offset_));
}

void BundleStreamReader::Column::Finish() {
  if (offset_ != end_) throw std::logic_error("tensor '" + name_ + "' not fully read");
  if (crc_ != want_crc_)
    throw std::runtime_error("checksum mismatch in checkpoint data file '" + path_ + "' (tensor '" + name_ +
                             "'): the file is corrupt");
}

}  // namespace tf
}  // namespace evstore
