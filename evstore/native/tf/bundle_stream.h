// Streaming TensorFlow tensor bundles (the format of tf.train.Checkpoint and
// tf.compat.v1.train.Saver) for EmbeddingVariable checkpoints.
//
// Why not BundleWriter: BundleWriter (and AddSlice) needs each tensor's full
// shape before its first byte, but a live table's row count is only known
// once the rows have been read, and holding the table still for a save would
// stop training. The bundle format itself does not need it: a tensor is a
// contiguous byte range (shard, offset, size, crc32c) in one of the data
// files, and the index is written last. So each streamed tensor gets a data
// file (shard) of its own, appended chunk by chunk; whole tensors (dense
// variables, global step) share shard 0, and so may columns written one after
// another (one open at a time: `in_shard0`). Finish() drops empty columns (their
// entries point at zero bytes of shard 0), names the shards
// `prefix.data-SSSSS-of-NNNNN`, fsyncs them, and writes `prefix.index`
// (TensorFlow's table format via tsl::table::TableBuilder, header entry
// first, then entries sorted by name, exactly what BundleWriter produces), so
// tf.train.load_checkpoint and BundleReader read every tensor.
//
// String tensors (DT_STRING: tf.string keys) use TensorFlow's own encoding
// in the data file: every element's length as a varint64, the masked crc32c
// of the lengths (each as a little-endian uint32), then the bytes; the entry's
// crc32c covers those uint32 lengths, the masked length checksum and the
// bytes (not the varints), as BundleWriter / ReadStringTensor do. A streamed
// string column writes its lengths and its bytes to two temporary files and
// joins them when it ends (one sequential copy of the key bytes).
//
// Memory: one write buffer per open column (OutFile); a column is
// closed as soon as its EV is done. Nothing holds a copy of the table.
// Failure: any error leaves the writer failed; its destructor deletes every
// file it created unless Finish() succeeded.
// Object sink (a prefix "evsink://..."): the same files, in the same order,
// go to the process's registered sink instead of the local filesystem (an
// object-store root written from memory, with no local staging); a string
// column's two parts are held in memory until it ends, and the index is
// built in memory; renames and removals are the sink's.
// Object source (a prefix "evsource://..."): the mirror of the sink for the
// reader. The index and each data file are read through the process's
// registered source (checkpoint/object_source.py: ranged reads of the object
// store, read ahead per open file) instead of local files; the checks are the
// same (each entry's size against its file, each tensor's crc32c at Finish).
#pragma once
#include <cstdint>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "../core/direct_reader.h"
#include "../core/direct_writer.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/protobuf/tensor_bundle.pb.h"

namespace tsl {
class WritableFile;
}

namespace evstore {
namespace tf {

// Object sink: a bundle whose prefix starts with kSinkScheme ("evsink://<id>/<prefix>") is never a
// local file. Each of its files goes, buffer by buffer, to callbacks the process registered with
// evstore_set_object_sink (checkpoint/object_sink.py streams them into the object store), and a
// rename or removal is asked of the same callbacks. A process that registered none fails the save.
// Callbacks return 0 (open: a handle >= 0) on success; the sink keeps the reason of a failure.
inline constexpr char kSinkScheme[] = "evsink://";
bool IsSinkPath(const std::string& path);
extern "C" {
typedef int64_t (*SinkOpenFn)(const char* path);
typedef int (*SinkWriteFn)(int64_t handle, const char* data, int64_t n);
typedef int (*SinkCloseFn)(int64_t handle, int keep);  // keep = 0: discard what was written
typedef int (*SinkRenameFn)(const char* from, const char* to);
typedef int (*SinkRemoveFn)(const char* path);
void evstore_set_object_sink(SinkOpenFn open, SinkWriteFn write, SinkCloseFn close, SinkRenameFn rename,
                             SinkRemoveFn remove);
}
void SinkRename(const std::string& from, const std::string& to);  // throws
void SinkRemove(const std::string& path);                          // best effort

// Object source: a bundle whose prefix starts with kSourceScheme ("evsource://<id>/<prefix>") is read
// through callbacks the process registered with evstore_set_object_source (checkpoint/object_source.py),
// never from a local file. open: a handle >= 0, or < 0 when the file cannot be opened (missing);
// [start, end) are the bytes the opener will read (end < 0: the whole file), so the source reads
// ahead within them and never past them (a tensor's byte range: each byte of a column is fetched
// once, and a small tensor costs its own bytes, not a block); size: the file's bytes (< 0: error);
// read: up to n bytes at offset into dst, the count read (fewer only at the file's end; < 0: error);
// close: releases the handle. Calls on one handle come from one thread at a time; the source keeps
// the reason of a failure. A process that registered none fails.
inline constexpr char kSourceScheme[] = "evsource://";
bool IsSourcePath(const std::string& path);
extern "C" {
typedef int64_t (*SourceOpenFn)(const char* path, int64_t start, int64_t end);
typedef int64_t (*SourceSizeFn)(int64_t handle);
typedef int64_t (*SourceReadFn)(int64_t handle, int64_t offset, char* dst, int64_t n);
typedef void (*SourceCloseFn)(int64_t handle);
void evstore_set_object_source(SourceOpenFn open, SourceSizeFn size, SourceReadFn read, SourceCloseFn close);
}

// A file opened for positioned reads: a local file, or a file of an object
// source (IsSourcePath). Closed by its destructor.
// Direct reads: a local file's reads whose offset and buffer are aligned
// (core/direct_io.h) go around the page cache for their whole blocks
// (core/direct_reader.h); the rest, and every read where the file system
// refuses O_DIRECT, through the page cache.
class InFile {
 public:
  // Throws std::runtime_error naming the file. [start, end): the bytes this
  // file will be read at (end < 0: anywhere), for an object source's reads.
  explicit InFile(const std::string& path, int64_t start = 0, int64_t end = -1);
  ~InFile();
  InFile(const InFile&) = delete;
  InFile& operator=(const InFile&) = delete;
  int64_t Size() const;                                   // throws
  int64_t ReadAt(int64_t offset, char* dst, int64_t n) const;  // bytes read (< n only at the end); throws
  // Whether reads at aligned offsets into aligned buffers go around the page cache.
  bool direct() const { return direct_ && direct_->direct(); }
  std::string ReadAll() const;                            // the whole file; throws
  // Asks the kernel to start reading [offset, offset + n) now (a local file;
  // an object source's file reads ahead on its own).
  void WillNeed(int64_t offset, int64_t n) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  std::unique_ptr<DirectReader> direct_;  // a local file's direct reads
  int64_t src_ = -1;  // handle of an object source's file
};

// An append-only file that keeps its size and crc32c as it goes: a local
// file, a file of an object sink (IsSinkPath), or (`in_memory`) a buffer
// that is never flushed anywhere (`memory()`: its bytes).
//
// A local file's bytes go to the disk as they are written: every
// kWritebackBytes the writer asks the kernel to start writing them back
// (sync_file_range, not waiting), so a large save keeps the disk busy while
// it computes and its final fsync waits only for the tail. A Write of at
// least a buffer's worth into an empty buffer goes to the file straight from
// the caller's bytes (no copy into the buffer).
// Direct writes: where the file system takes O_DIRECT, a local file's bytes
// go to the disk around the page cache instead (core/direct_writer.h: whole
// aligned buffers, each written by a thread while the next one fills); the
// tail (less than a buffer) goes through the page cache at Close, and Close's
// fsync makes all of it durable.
class OutFile {
 public:
  static constexpr size_t kBufferBytes = 1 << 20;       // an object sink's: bytes per sink call
  static constexpr size_t kLocalBufferBytes = 256 << 10; // a local file's: stays in the core's L2 cache
  static constexpr int64_t kWritebackBytes = 8 << 20;
  explicit OutFile(std::string path, bool in_memory = false);  // throws std::runtime_error
  ~OutFile();
  void Write(const void* data, size_t n);  // throws std::runtime_error
  // Appends `rows` rows of `row_bytes` bytes, row i at data + i * stride_bytes
  // (a column of interleaved rows), gathered straight into the write buffer.
  void WriteRows(const void* data, size_t row_bytes, size_t stride_bytes, size_t rows);
  void Close(bool sync);                    // flush (+ fsync), throws
  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }
  uint32_t crc() const { return crc_; }
  const std::string& memory() const { return mem_; }

 private:
  void Flush();
  void WriteOut(const char* p, size_t n);  // all of it to the local file; throws
  void SubmitDirect();                     // the full buffer to the disk, by a thread; the other one next
  std::string path_;
  int fd_ = -1;
  std::unique_ptr<DirectWriter> direct_;    // a local file's direct writes (null: none)
  int64_t written_ = 0;  // bytes handed to the local file
  int64_t kicked_ = 0;   // bytes whose write-back was started
  int64_t sink_ = -1;      // handle of an object sink's file
  bool in_memory_ = false;
  std::string mem_;
  std::vector<char> buf_;
  char* cur_ = nullptr;                     // the buffer being filled: buf_'s or direct_->buffer()
  size_t cap_ = 0;                          // its size
  size_t used_ = 0;
  int64_t size_ = 0;
  uint32_t crc_ = 0;
};

struct BundleFile {
  std::string name;  // basename
  int64_t size;
  uint32_t crc32c;   // of the whole file, unmasked
};

class BundleStreamWriter {
 public:
  explicit BundleStreamWriter(std::string prefix);
  ~BundleStreamWriter();
  BundleStreamWriter(const BundleStreamWriter&) = delete;
  BundleStreamWriter& operator=(const BundleStreamWriter&) = delete;

  // A whole tensor (memcpy-able dtype) in shard 0. Throws on error.
  void AddTensor(const std::string& name, const tensorflow::Tensor& t);
  // A streamed tensor of shape [rows] + inner_dims; returns its column id.
  // `in_shard0`: its bytes go into shard 0 (no file, no fsync of its own)
  // instead of a data file of its own; at most one such column is open at a
  // time, and no AddTensor while it is (for columns written one after another,
  // as the serving view's, docs/ARCHITECTURE.md "Serving view").
  int BeginColumn(const std::string& name, tensorflow::DataType dtype, std::vector<int64_t> inner_dims,
                  bool in_shard0 = false);
  // A streamed DT_STRING tensor of shape [rows]; returns its column id.
  int BeginStringColumn(const std::string& name);
  // Appends `rows` rows (row-major, inner_dims elements each).
  void Append(int col, const void* data, int64_t rows);
  // Appends `rows` rows, row i at data + i * stride_bytes (a column out of
  // interleaved rows, without a copy of its own first). Not for in_shard0 columns.
  void AppendStrided(int col, const void* data, int64_t stride_bytes, int64_t rows);
  // Appends `n` strings to a string column.
  void AppendStrings(int col, const std::string_view* v, int64_t n);
  // Flushes and closes a column's file (frees its buffer).
  void EndColumn(int col);
  // Renames the shards, writes the index, fsyncs (the directory too unless
  // `sync_dir` is false: a second bundle in the same directory whose writer
  // finishes later fsyncs it). Returns the files written.
  std::vector<BundleFile> Finish(bool sync_dir = true);

 private:
  struct Column {
    std::string name;
    tensorflow::DataType dtype;
    std::vector<int64_t> inner;
    int64_t row_bytes;
    int64_t rows = 0;
    std::unique_ptr<OutFile> file;
    std::string temp_path;
    int64_t size = 0;
    uint32_t crc = 0;        // of the file's bytes
    uint32_t entry_crc = 0;  // the index entry's (unmasked): = crc except for strings
    bool ended = false;
    bool in_shard0 = false;  // bytes in shard 0 from `offset` (BeginColumn's in_shard0)
    int64_t offset = 0;
    // DT_STRING: the varint lengths go to their own file until EndColumn.
    bool is_string = false;
    std::unique_ptr<OutFile> lengths;
    uint32_t lengths_crc = 0;
  };
  void CheckName(const std::string& name);
  void Remove(const std::string& path);                          // best effort
  void Rename(const std::string& from, const std::string& to);   // throws
  void BuildIndex(int num_shards, tsl::WritableFile* f, const std::string& where);
  std::string prefix_;
  std::unique_ptr<OutFile> main_;  // shard 0
  std::vector<Column> cols_;
  std::map<std::string, tensorflow::BundleEntryProto> entries_;
  bool has_whole_tensors_ = false;  // an AddTensor (or an in_shard0 column) wrote into shard 0
  int open_in_shard0_ = -1;          // the in_shard0 column open now, or -1
  std::vector<std::string> created_;  // every path to delete on failure
  bool finished_ = false;
  bool sink_ = false;                 // IsSinkPath(prefix_): no local file at all
};

// Reads a bundle's index and streams tensors chunk by chunk, checking each
// tensor's size against its entry and its crc32c at the end.
class BundleStreamReader {
 public:
  explicit BundleStreamReader(std::string prefix);  // throws std::runtime_error naming the file
  bool Has(const std::string& name) const { return entries_.count(name) != 0; }
  const tensorflow::BundleEntryProto& Entry(const std::string& name) const;  // throws if missing
  std::string DataPath(int shard) const;

  // One tensor opened for sequential chunked reads.
  class Column {
   public:
    Column(const BundleStreamReader& r, const std::string& name, tensorflow::DataType dtype,
           int64_t inner_elems);  // throws on dtype / shape / size mismatch
    ~Column();
    int64_t rows() const { return rows_; }
    void Read(void* dst, int64_t rows);  // next rows; throws on short read
    // The kernel starts reading the next `rows` rows now (a restore asks for
    // its next chunk before it imports this one). No-op for strings.
    void WillNeed(int64_t rows) const;
    // DT_STRING columns: the next `rows` strings, as views into `*storage`
    // (valid until the next call). The lengths are read and their checksum
    // checked when the column opens.
    void ReadStrings(int64_t rows, std::string* storage, std::vector<std::string_view>* out);
    void Finish();                        // all rows read: checks the crc32c
   private:
    void ReadAt(char* dst, int64_t n);
    std::string name_, path_;
    std::unique_ptr<InFile> file_;  // null for a tensor of no bytes
    int64_t rows_ = 0, row_bytes_ = 0, offset_ = 0, end_ = 0;
    uint32_t crc_ = 0, want_crc_ = 0;
    std::vector<uint32_t> lengths_;  // DT_STRING
    int64_t next_ = 0;               // DT_STRING: strings read so far
  };

 private:
  std::string prefix_;
  int num_shards_ = 1;
  std::map<std::string, tensorflow::BundleEntryProto> entries_;
};

}  // namespace tf
}  // namespace evstore
