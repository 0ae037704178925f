// Streaming readout of a Table for checkpoints. No TensorFlow here.
//
// A checkpoint writer implements ExportSink and receives the table in chunks
// of at most `chunk_rows` keys, so a save needs one chunk of extra memory, not
// a copy of the table:
//   Rows(keys, rows, stride, versions, freqs, n)  admitted keys; row i is
//        rows[i*stride .. i*stride + stride): embedding then the slots named
//        in the export's `slots` (a prefix of the table's slots).
//   Filtered(keys, freqs, seen, n)                counted, not admitted keys
//        with the step each was last seen at (-1 unknown): eviction ages
//        them from it.
//   Deleted(keys, n)                              keys erased since the last
//        committed export (deltas only).
//   BloomBlocks(ids, counters, n)                 a BloomFilter's counter
//        blocks (filter_policy.h), CountingBloom::kBlock bytes each: in a
//        full every non-zero block, in a delta the blocks raised since the
//        last committed export. Nothing without a Bloom filter.
// With the table's clock (the kernel saves it), this is everything that
// decides a future admission or eviction, so a restore resumes exactly.
//
// Consistency under concurrent training
//   * Full: every key once (Table::ForEachKey), each read under its
//     segment's shared lock, chunk flushes included, so every row is a value
//     it had during the export (never torn). All-DRAM, segment after segment
//     (a segment is one instant); tiered, the rows in DRAM first and then the
//     cold rows in the tier file's order, so the file streams in long reads.
//     The order of keys in a full is not a contract (readers, restores with
//     resharding, delta application and serving look keys up). Keys
//     inserted or changed after the snapshot was sealed may or may not be in
//     the full; they are in the table's open dirty set either way, so the next
//     delta carries them (a chain never misses a change).
//   * Delta: the sealed snapshot's dirty keys are read in chunks (Table::Read,
//     per-key lock). A dirty key erased since the seal is skipped: its
//     deletion is in the open deleted set, hence in the next delta.
//   * Slots added while an export runs (an optimizer's first apply) are
//     appended after the existing ones, so the captured slot prefix stays
//     valid; the new slots reach the next checkpoint through the dirty set.
// A sink reports failure by throwing; the lock guards release on unwind and
// the caller aborts the snapshot.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "table.h"

namespace evstore {

template <typename K>
class ExportSink {
 public:
  virtual ~ExportSink() = default;
  virtual void Rows(const K* keys, const float* rows, int stride, const int64_t* versions, const int64_t* freqs,
                    int64_t n) = 0;
  virtual void Filtered(const K* keys, const int64_t* freqs, const int64_t* seen, int64_t n) = 0;
  virtual void Deleted(const K* keys, int64_t n) = 0;
  virtual void BloomBlocks(const int64_t* ids, const uint8_t* counters, int64_t n) = 0;
};

struct ExportCounts {
  int64_t rows = 0;
  int64_t filtered = 0;
  int64_t deleted = 0;
  int64_t bloom_blocks = 0;
};

namespace export_internal {

// A chunk's keys. Integer keys are values; a string key (std::string_view)
// is copied into the chunk, because a full export hands its chunk to the sink
// after the segment lock is released, when the table may already have freed
// its own copy of an erased key.
template <typename K>
struct KeyColumn : std::vector<K> {};
template <>
struct KeyColumn<std::string_view> {
  void reserve(int64_t n) { ends_.reserve(n); }
  void push_back(std::string_view k) {
    bytes_.append(k.data(), k.size());
    ends_.push_back(bytes_.size());
  }
  size_t size() const { return ends_.size(); }
  bool empty() const { return ends_.empty(); }
  const std::string_view* data() {
    views_.resize(ends_.size());
    size_t b = 0;
    for (size_t i = 0; i < ends_.size(); ++i) {
      views_[i] = std::string_view(bytes_.data() + b, ends_[i] - b);
      b = ends_[i];
    }
    return views_.data();
  }
  void clear() {
    bytes_.clear();
    ends_.clear();
    views_.clear();
  }

 private:
  std::string bytes_;
  std::vector<size_t> ends_;
  std::vector<std::string_view> views_;
};

// Keys [p, p + n) of a snapshot (its owned copies) as the table's key type.
template <typename K, typename Owned>
const K* KeyViews(const Owned* p, int64_t n, std::vector<K>* buf) {
  if constexpr (std::is_same_v<K, Owned>) {
    return p;
  } else {
    buf->resize(n);
    for (int64_t i = 0; i < n; ++i) (*buf)[i] = K(p[i]);
    return buf->data();
  }
}

// Chunk buffers shared by both export kinds.
template <typename K>
struct Chunk {
  Chunk(int stride, int64_t cap) : stride(stride), cap(cap) {
    keys.reserve(cap);
    rows.reserve(cap * stride);
    versions.reserve(cap);
    freqs.reserve(cap);
    fkeys.reserve(cap);
    ffreqs.reserve(cap);
    fseen.reserve(cap);
  }
  const int stride;
  const int64_t cap;
  KeyColumn<K> keys;
  std::vector<float> rows;
  std::vector<int64_t> versions, freqs;
  KeyColumn<K> fkeys;
  std::vector<int64_t> ffreqs, fseen;

  void FlushRows(ExportSink<K>* sink, ExportCounts* c) {
    if (keys.empty()) return;
    sink->Rows(keys.data(), rows.data(), stride, versions.data(), freqs.data(), keys.size());
    c->rows += keys.size();
    keys.clear();
    rows.clear();
    versions.clear();
    freqs.clear();
  }
  void FlushFiltered(ExportSink<K>* sink, ExportCounts* c) {
    if (fkeys.empty()) return;
    sink->Filtered(fkeys.data(), ffreqs.data(), fseen.data(), fkeys.size());
    c->filtered += fkeys.size();
    fkeys.clear();
    ffreqs.clear();
    fseen.clear();
  }
};

// Streams Bloom counter blocks `ids` (all of them when ids is null, then only
// the non-zero ones) in chunks of at most `cap` blocks.
template <typename K, typename Tr, typename S>
void ExportBloom(const Table<K, Tr, S>& t, const std::vector<int64_t>* ids, int64_t cap, ExportSink<K>* sink,
                 ExportCounts* c) {
  if (!t.has_bloom()) return;
  const int64_t B = CountingBloom::kBlock, total = ids ? ids->size() : t.bloom()->num_blocks();
  cap = std::max<int64_t>(1, std::min<int64_t>(cap, (64 << 20) / B));  // at most 64 MiB per chunk
  std::vector<int64_t> out_ids;
  std::vector<uint8_t> buf(cap * B);
  auto flush = [&] {
    if (out_ids.empty()) return;
    sink->BloomBlocks(out_ids.data(), buf.data(), out_ids.size());
    c->bloom_blocks += out_ids.size();
    out_ids.clear();
  };
  for (int64_t j = 0; j < total; ++j) {
    const int64_t id = ids ? (*ids)[j] : j;
    uint8_t* dst = buf.data() + out_ids.size() * B;
    if (!t.ReadBloomBlock(id, dst) && !ids) continue;  // a full skips all-zero blocks
    out_ids.push_back(id);
    if (static_cast<int64_t>(out_ids.size()) == cap) flush();
  }
  flush();
}

}  // namespace export_internal

// Every key of the table. `num_slots` is the slot prefix written with each row.
template <typename K, typename Tr, typename S>
ExportCounts ExportFull(const Table<K, Tr, S>& t, int num_slots, int64_t chunk_rows, ExportSink<K>* sink) {
  const int stride = t.dim() * (1 + num_slots);
  export_internal::Chunk<K> ch(stride, chunk_rows < 1 ? 1 : chunk_rows);
  ExportCounts c;
  t.ForEachKey([&](const ExportedKey<K>& x, const float* row) {
    if (x.admitted) {
      ch.keys.push_back(x.key);
      ch.rows.insert(ch.rows.end(), row, row + stride);
      ch.versions.push_back(x.version);
      ch.freqs.push_back(x.freq);
      if (static_cast<int64_t>(ch.keys.size()) == ch.cap) ch.FlushRows(sink, &c);
    } else {
      ch.fkeys.push_back(x.key);
      ch.ffreqs.push_back(x.freq);
      ch.fseen.push_back(x.seen);
      if (static_cast<int64_t>(ch.fkeys.size()) == ch.cap) ch.FlushFiltered(sink, &c);
    }
  });
  ch.FlushRows(sink, &c);
  ch.FlushFiltered(sink, &c);
  export_internal::ExportBloom(t, nullptr, ch.cap, sink, &c);
  return c;
}

// The sealed snapshot's changes: dirty keys' current state, deleted keys.
template <typename K, typename Tr, typename S>
ExportCounts ExportDelta(const Table<K, Tr, S>& t, const typename Table<K, Tr, S>::Snapshot& snap, int num_slots,
                         int64_t chunk_rows, ExportSink<K>* sink) {
  const int stride = t.dim() * (1 + num_slots);
  const int64_t cap = chunk_rows < 1 ? 1 : chunk_rows;
  export_internal::Chunk<K> ch(stride, cap);
  ExportCounts c;
  std::vector<uint8_t> present(cap), admitted(cap);
  std::vector<int64_t> versions(cap), freqs(cap), seen(cap);
  std::vector<float> rows(cap * stride);
  const int64_t n = snap.dirty.size();
  std::vector<K> views;
  for (int64_t lo = 0; lo < n; lo += cap) {
    const int64_t m = std::min(cap, n - lo);
    const K* keys = export_internal::KeyViews<K>(snap.dirty.data() + lo, m, &views);
    t.Read(keys, m, stride, present.data(), admitted.data(), versions.data(), freqs.data(), rows.data(),
           seen.data());
    for (int64_t i = 0; i < m; ++i) {
      if (!present[i]) continue;  // erased since the seal: in the next delta's deleted keys
      if (admitted[i]) {
        ch.keys.push_back(keys[i]);
        ch.rows.insert(ch.rows.end(), rows.data() + i * stride, rows.data() + (i + 1) * stride);
        ch.versions.push_back(versions[i]);
        ch.freqs.push_back(freqs[i]);
      } else {
        ch.fkeys.push_back(keys[i]);
        ch.ffreqs.push_back(freqs[i]);
        ch.fseen.push_back(seen[i]);
      }
    }
    ch.FlushRows(sink, &c);
    ch.FlushFiltered(sink, &c);
  }
  for (size_t lo = 0; lo < snap.deleted.size(); lo += cap) {
    const int64_t m = std::min<int64_t>(cap, snap.deleted.size() - lo);
    sink->Deleted(export_internal::KeyViews<K>(snap.deleted.data() + lo, m, &views), m);
    c.deleted += m;
  }
  export_internal::ExportBloom(t, &snap.bloom_blocks, cap, sink, &c);
  return c;
}

}  // namespace evstore
