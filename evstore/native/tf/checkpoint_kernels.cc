// Kernels of checkpoint_ops.cc: convert tensors, stream the table through
// core/export.h into a BundleStreamWriter, or from a BundleStreamReader into
// the table. No table logic here.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../core/direct_io.h"
#include "../core/export.h"
#include "../core/shard.h"
#include "../core/view_codec.h"
#include "bundle_stream.h"
#include "kernel_util.h"
#include "../core/crc32c.h"

namespace evstore {
namespace tf {
namespace {

using tensorflow::DataType;
using tensorflow::DataTypeToEnum;
using tensorflow::ResourceHandle;

// Test hook for the crash tests (a real saver killed mid data file): with
// EVSTORE_FAILPOINT=bundle-mid-data the writer, after its first chunk, creates
// $EVSTORE_FAILPOINT_FILE and waits to be killed.
void MaybePauseMidData() {
  const char* fp = std::getenv("EVSTORE_FAILPOINT");
  if (!fp || std::string(fp) != "bundle-mid-data") return;
  if (const char* f = std::getenv("EVSTORE_FAILPOINT_FILE")) std::ofstream(f) << "paused\n";
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

// Streams one EV's export into writer columns: the per-EV tensors of
// docs/reference/checkpoint-format.md (names from core/schema.h): admitted keys with
// their rows, versions, frequencies and slot rows; counted-not-admitted keys with their
// counts and last sightings; each slot's initial value; the clock (evict_policy.h); a BloomFilter's counters
// (filter_policy.h); in deltas the deleted keys.
// Checkpoints written before -seen_filtered / -clock / -bloom_* /
// <slot>-initial_value existed still load: their filtered keys' last-seen step
// is unknown, their clock is the newest version, Bloom counters start from
// zero, and a slot's initial value is the table's (0 for a new slot) until an
// optimizer states it.
// With a serving view writer (`view`, core/view_codec.h) each chunk of rows is
// also encoded into the view bundle as it streams: `<name>-values` in the
// view's dtype and, for int8, `<name>-values_scale`, row-aligned with the keys.
// Key columns hold the tensor type T (int32, int64, or tf.string in
// TensorFlow's string encoding, bundle_stream.h); the core hands the sink its
// key type K = CoreKey<T>.
constexpr char kViewScaleSuffix[] = "_scale";  // `<name>-values_scale` (checkpoint/serving_view.py SCALE)

template <typename T>
class BundleSink : public ExportSink<CoreKey<T>> {
  using K = CoreKey<T>;
  static constexpr bool kString = std::is_same_v<T, tensorflow::tstring>;

 public:
  BundleSink(BundleStreamWriter* w, const std::string& name, int dim, const SlotSpecs& slots, bool delta,
             const CountingBloom* bloom, BundleStreamWriter* view = nullptr, view::Codec codec = view::Codec::kNone)
      : w_(w), dim_(dim), view_(view), codec_(codec) {
    using schema::TensorName;  // tensor names: core/schema.h
    if (view_) {  // one view data file (shard 0): the EVs' view columns are written one after another
      view_values_ = view_->BeginColumn(TensorName(name, schema::kValues),
                                        codec_ == view::Codec::kInt8      ? tensorflow::DT_INT8
                                        : codec_ == view::Codec::kFloat16 ? tensorflow::DT_HALF
                                                                          : tensorflow::DT_BFLOAT16,
                                        {dim}, /*in_shard0=*/true);
      scale_name_ = TensorName(name, schema::kValues) + kViewScaleSuffix;
    }
    keys_ = BeginKeys(TensorName(name, schema::kKeys));
    values_ = w->BeginColumn(TensorName(name, schema::kValues), tensorflow::DT_FLOAT, {dim});
    versions_ = w->BeginColumn(TensorName(name, schema::kVersions), tensorflow::DT_INT64, {});
    freqs_ = w->BeginColumn(TensorName(name, schema::kFreqs), tensorflow::DT_INT64, {});
    for (const auto& s : slots) {
      slot_cols_.push_back(w->BeginColumn(schema::SlotTensor(name, s.first), tensorflow::DT_FLOAT, {dim}));
      tensorflow::Tensor init(tensorflow::DT_FLOAT, tensorflow::TensorShape({1}));
      init.flat<float>()(0) = s.second;  // where the slot starts in rows admitted later
      w->AddTensor(schema::SlotInitialValueTensor(name, s.first), init);
    }
    fkeys_ = BeginKeys(TensorName(name, schema::kKeysFiltered));
    ffreqs_ = w->BeginColumn(TensorName(name, schema::kFreqsFiltered), tensorflow::DT_INT64, {});
    fseen_ = w->BeginColumn(TensorName(name, schema::kSeenFiltered), tensorflow::DT_INT64, {});
    if (delta) deleted_ = BeginKeys(TensorName(name, schema::kDeletedKeys));
    clock_name_ = TensorName(name, schema::kClock);
    if (bloom) {  // small fixed-size tensors go whole into shard 0 (no column file, no fsync of their own)
      std::vector<int64_t> geo = bloom->Geometry();
      tensorflow::Tensor g(tensorflow::DT_INT64, tensorflow::TensorShape({static_cast<int64_t>(geo.size())}));
      std::copy(geo.begin(), geo.end(), g.flat<int64_t>().data());
      w->AddTensor(TensorName(name, schema::kBloomGeometry), g);
      bblocks_ = w->BeginColumn(TensorName(name, schema::kBloomBlocks), tensorflow::DT_INT64, {});
      bcounters_ = w->BeginColumn(TensorName(name, schema::kBloomCounters), tensorflow::DT_UINT8,
                                  {CountingBloom::kBlock});
    }
  }
  void Rows(const K* keys, const float* rows, int stride, const int64_t* versions, const int64_t* freqs,
            int64_t n) override {
    AppendKeys(keys_, keys, n);
    w_->Append(versions_, versions, n);
    w_->Append(freqs_, freqs, n);
    // [embedding | slots...] rows: each column gathered from them straight
    // into its file's write buffer (the serving view encodes a copy of the
    // embeddings).
    for (int c = 0; c <= static_cast<int>(slot_cols_.size()); ++c)
      w_->AppendStrided(c == 0 ? values_ : slot_cols_[c - 1], rows + c * dim_, stride * sizeof(float), n);
    if (view_) {
      buf_.resize(static_cast<size_t>(n) * dim_);
      for (int64_t i = 0; i < n; ++i) std::memcpy(buf_.data() + i * dim_, rows + i * stride, dim_ * sizeof(float));
      vbuf_.resize(static_cast<size_t>(n) * dim_ * view::ElementBytes(codec_));
      const size_t had = scales_.size();
      if (codec_ == view::Codec::kInt8) scales_.resize(had + n);  // kept until the values end (4 bytes a row)
      view::EncodeRows(codec_, buf_.data(), n, dim_, vbuf_.data(), scales_.data() + had);
      view_->Append(view_values_, vbuf_.data(), n);
    }
    MaybePauseMidData();
  }
  void Filtered(const K* keys, const int64_t* freqs, const int64_t* seen, int64_t n) override {
    AppendKeys(fkeys_, keys, n);
    w_->Append(ffreqs_, freqs, n);
    w_->Append(fseen_, seen, n);
  }
  void Deleted(const K* keys, int64_t n) override { AppendKeys(deleted_, keys, n); }
  void BloomBlocks(const int64_t* ids, const uint8_t* counters, int64_t n) override {
    w_->Append(bblocks_, ids, n);
    w_->Append(bcounters_, counters, n);
  }
  // `clock`: the table's clock once the export is read.
  void End(int64_t clock) {
    tensorflow::Tensor t(tensorflow::DT_INT64, tensorflow::TensorShape({1}));
    t.flat<int64_t>()(0) = clock;
    w_->AddTensor(clock_name_, t);
    for (int c : {keys_, values_, versions_, freqs_, fkeys_, ffreqs_, fseen_}) w_->EndColumn(c);
    for (int c : slot_cols_) w_->EndColumn(c);
    for (int c : {deleted_, bblocks_, bcounters_})
      if (c >= 0) w_->EndColumn(c);
    if (view_) view_->EndColumn(view_values_);
    if (view_ && codec_ == view::Codec::kInt8) {  // the row scales, whole, after the values in shard 0
      tensorflow::Tensor t(tensorflow::DT_FLOAT, tensorflow::TensorShape({static_cast<int64_t>(scales_.size())}));
      std::copy(scales_.begin(), scales_.end(), t.flat<float>().data());
      view_->AddTensor(scale_name_, t);
    }
  }

 private:
  int BeginKeys(const std::string& tensor) {
    if constexpr (kString) return w_->BeginStringColumn(tensor);
    return w_->BeginColumn(tensor, DataTypeToEnum<T>::v(), {});
  }
  void AppendKeys(int col, const K* keys, int64_t n) {
    if constexpr (kString) {
      w_->AppendStrings(col, keys, n);
    } else {
      w_->Append(col, keys, n);
    }
  }
  BundleStreamWriter* w_;
  int dim_;
  std::string clock_name_;
  int keys_, values_, versions_, freqs_, fkeys_, ffreqs_, fseen_, deleted_ = -1, bblocks_ = -1,
      bcounters_ = -1;
  std::vector<int> slot_cols_;
  std::vector<float> buf_;
  BundleStreamWriter* view_;
  view::Codec codec_;
  int view_values_ = -1;
  std::string scale_name_;
  std::vector<char> vbuf_;
  std::vector<float> scales_;
};

template <typename K>
ExportCounts SaveOne(OpKernelContext* ctx, const ResourceHandle& h, BundleStreamWriter* w, const std::string& name,
                     int64_t snapshot_id, bool full, int64_t chunk_rows, std::vector<std::string>* slot_names,
                     absl::Status* st, BundleStreamWriter* view, view::Codec codec) {
  tensorflow::core::RefCountPtr<EvResource<K>> res;
  *st = tensorflow::LookupResource(ctx, h, &res);
  if (!st->ok()) {
    *st = errors::FailedPrecondition("EmbeddingVariable '", name, "' is not available for saving (", st->message(),
                                     ")");
    return {};
  }
  return res->Visit([&](auto& t) {
    auto snap = t.OpenSnapshot(static_cast<uint64_t>(snapshot_id));
    SlotSpecs slots = t.slots();
    for (const auto& s : slots) slot_names->push_back(schema::SlotPrefix(name, s.first));
    BundleSink<K> sink(w, name, t.dim(), slots, !full, t.bloom(), view, codec);
    ExportCounts c = full ? ExportFull(t, static_cast<int>(slots.size()), chunk_rows, &sink)
                          : ExportDelta(t, *snap, static_cast<int>(slots.size()), chunk_rows, &sink);
    sink.End(t.clock());
    return c;
  });
}

// The serving view's bundle prefix beside the main bundle at `prefix`
// (`<dir of prefix>/<view_prefix>`).
inline std::string ViewPrefix(const std::string& prefix, const std::string& view_prefix) {
  const size_t slash = prefix.rfind('/');
  return (slash == std::string::npos ? std::string() : prefix.substr(0, slash + 1)) + view_prefix;
}

class EvSaveBundleOp : public OpKernel {
 public:
  explicit EvSaveBundleOp(OpKernelConstruction* c) : OpKernel(c) {
    std::string view;
    OP_REQUIRES_OK(c, ReadAttrs(c, "key_dtypes", &key_dtypes_, "full", &full_, "view", &view, "view_prefix",
                                &view_prefix_));
    OP_REQUIRES_OK(c, ReadChunkRows(c, &chunk_rows_));
    try {
      codec_ = view::Parse(view);
    } catch (const std::invalid_argument& e) {
      c->CtxFailure(errors::InvalidArgument(e.what()));
      return;
    }
  }
  void Compute(OpKernelContext* ctx) override {
    EV_INPUT(ctx, prefix_t, "prefix");
    const std::string prefix(prefix_t.scalar<tensorflow::tstring>()());
    tensorflow::OpInputList handles, dense;
    OP_REQUIRES_OK(ctx, ctx->input_list("handles", &handles));
    OP_REQUIRES_OK(ctx, ctx->input_list("dense", &dense));
    EV_INPUT(ctx, names, "names");
    EV_INPUT(ctx, snaps, "snapshot_ids");
    EV_INPUT(ctx, dense_names, "dense_names");
    const int n = handles.size();
    OP_REQUIRES(ctx, static_cast<int>(key_dtypes_.size()) == n && names.NumElements() == n &&
                         snaps.NumElements() == n,
                errors::InvalidArgument("handles, names, snapshot_ids and key_dtypes must have one entry per EV"));
    OP_REQUIRES(ctx, dense_names.NumElements() == dense.size(),
                errors::InvalidArgument("dense_names must name every dense tensor"));
    std::vector<std::string> slot_names;
    std::vector<ExportCounts> counts(n);
    std::vector<BundleFile> files;
    EV_TRY(ctx, {
      BundleStreamWriter w(prefix);
      std::unique_ptr<BundleStreamWriter> vw;   // the serving view, beside the bundle
      if (codec_ != view::Codec::kNone) vw = std::make_unique<BundleStreamWriter>(ViewPrefix(prefix, view_prefix_));
      for (int i = 0; i < dense.size(); ++i)
        w.AddTensor(std::string(dense_names.flat<tensorflow::tstring>()(i)), dense[i]);
      for (int i = 0; i < n; ++i) {
        const ResourceHandle& h = handles[i].scalar<ResourceHandle>()();
        const std::string name(names.flat<tensorflow::tstring>()(i));
        const int64_t id = snaps.flat<int64_t>()(i);
        absl::Status st;
        if (key_dtypes_[i] == tensorflow::DT_INT64)
          counts[i] = SaveOne<int64_t>(ctx, h, &w, name, id, full_, chunk_rows_, &slot_names, &st, vw.get(), codec_);
        else if (key_dtypes_[i] == tensorflow::DT_STRING)
          counts[i] = SaveOne<tensorflow::tstring>(ctx, h, &w, name, id, full_, chunk_rows_, &slot_names, &st,
                                                   vw.get(), codec_);
        else
          counts[i] = SaveOne<int32_t>(ctx, h, &w, name, id, full_, chunk_rows_, &slot_names, &st, vw.get(), codec_);
        OP_REQUIRES_OK(ctx, st);
      }
      std::vector<BundleFile> view_files;
      if (vw) view_files = vw->Finish(/*sync_dir=*/false);  // the bundle's Finish fsyncs the directory
      files = w.Finish();
      files.insert(files.end(), view_files.begin(), view_files.end());
    });
    Tensor *fn, *fs, *fc, *cn, *sn;
    const int64_t nf = files.size();
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nf}), &fn));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({nf}), &fs));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({nf}), &fc));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({n, 3}), &cn));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({static_cast<int64_t>(slot_names.size())}), &sn));
    for (int64_t i = 0; i < nf; ++i) {
      fn->flat<tensorflow::tstring>()(i) = files[i].name;
      fs->flat<int64_t>()(i) = files[i].size;
      fc->flat<int64_t>()(i) = files[i].crc32c;
    }
    for (int i = 0; i < n; ++i) {
      cn->matrix<int64_t>()(i, 0) = counts[i].rows;
      cn->matrix<int64_t>()(i, 1) = counts[i].filtered;
      cn->matrix<int64_t>()(i, 2) = counts[i].deleted;
    }
    for (size_t i = 0; i < slot_names.size(); ++i) sn->flat<tensorflow::tstring>()(i) = slot_names[i];
  }

 private:
  std::vector<DataType> key_dtypes_;
  bool full_;
  int64_t chunk_rows_;
  view::Codec codec_ = view::Codec::kNone;
  std::string view_prefix_;
};

// Reads a key column chunk by chunk as the core's key type (a string key: a
// view into this reader's buffer, valid until the next Read).
template <typename T>
class KeyReader {
 public:
  KeyReader(const BundleStreamReader& r, const std::string& name) : col_(r, name, DataTypeToEnum<T>::v(), 1) {}
  int64_t rows() const { return col_.rows(); }
  // The next m keys, valid until the read after next (two buffers in turn:
  // a chunk is imported while the next one is read).
  CoreKey<T>* Read(int64_t m) {
    const int b = turn_;
    turn_ ^= 1;
    if constexpr (std::is_same_v<T, tensorflow::tstring>) {
      col_.ReadStrings(m, &bytes_[b], &views_[b]);
      return views_[b].data();
    } else {
      buf_[b].resize(m);
      col_.Read(buf_[b].data(), m);
      return buf_[b].data();
    }
  }
  void Finish() { col_.Finish(); }

 private:
  BundleStreamReader::Column col_;
  int turn_ = 0;
  std::vector<T> buf_[2];
  std::string bytes_[2];
  std::vector<std::string_view> views_[2];
};

// Floats from one slot's rows to the next's in a chunk's slot buffer: m rows
// rounded up to whole blocks of kDirectAlign (core/direct_io.h), so that every
// slot's rows start aligned for a direct read, the last chunk's too.
inline int64_t SlotStride(int64_t m, int dim) {
  return RoundUpToDirect(m * dim * static_cast<int64_t>(sizeof(float))) / static_cast<int64_t>(sizeof(float));
}

// An EV's rows read from a bundle in the table's layout: the float32
// `<ev>-values` as they are; for a serving table in a lower precision
// (core/serving_rows.h), the serving view's codes packed as they are (`view`:
// the view bundle, when its precision is the table's) or the float32 values
// encoded as the view encodes them.
class RowColumn {
 public:
  using Col = BundleStreamReader::Column;
  RowColumn(const BundleStreamReader& main, const BundleStreamReader* view, const std::string& ev,
            const ServingRows* serving, int table_dim)
      : serving_(serving && serving->codec() != view::Codec::kNone ? serving : nullptr), from_view_(view != nullptr) {
    using schema::TensorName;
    if (from_view_) {
      const view::Codec c = serving_->codec();
      const DataType dt = c == view::Codec::kBfloat16 ? tensorflow::DT_BFLOAT16
                          : c == view::Codec::kFloat16 ? tensorflow::DT_HALF
                                                       : tensorflow::DT_INT8;
      values_ = std::make_unique<Col>(*view, TensorName(ev, schema::kValues), dt, serving_->dim());
      if (c == view::Codec::kInt8) {
        scales_ = std::make_unique<Col>(*view, TensorName(ev, schema::kValues) + std::string("_scale"),
                                        tensorflow::DT_FLOAT, 1);
        if (scales_->rows() != values_->rows())
          throw std::runtime_error("serving view: '" + ev + "' has " + std::to_string(scales_->rows()) +
                                   " scales for " + std::to_string(values_->rows()) + " rows");
      }
    } else {
      values_ = std::make_unique<Col>(main, TensorName(ev, schema::kValues), tensorflow::DT_FLOAT,
                                      serving_ ? serving_->dim() : table_dim);
    }
  }
  int64_t rows() const { return values_->rows(); }
  void WillNeed(int64_t m) const {  // the next m rows, read ahead
    values_->WillNeed(m);
    if (scales_) scales_->WillNeed(m);
  }
  // The next m rows into dst (m x the table's dim words).
  void Read(float* dst, int64_t m) {
    if (!serving_) return values_->Read(dst, m);
    if (!from_view_) {
      f32_.resize(static_cast<size_t>(m) * serving_->dim());
      values_->Read(f32_.data(), m);
      return serving_->Encode(f32_.data(), m, dst);
    }
    codes_.resize(static_cast<size_t>(m) * serving_->dim() * view::ElementBytes(serving_->codec()));
    values_->Read(codes_.data(), m);
    scale_buf_.resize(m);
    if (scales_) scales_->Read(scale_buf_.data(), m);
    serving_->Pack(codes_.data(), scale_buf_.data(), m, dst);
  }
  void Finish() {
    values_->Finish();
    if (scales_) scales_->Finish();
  }

 private:
  const ServingRows* serving_;  // null: rows stored as float32
  bool from_view_;
  std::unique_ptr<Col> values_, scales_;
  std::vector<float> f32_, scale_buf_;
  std::vector<char> codes_;
};

// Which target each key of a load goes to: with num_shards 1 every key to
// target 0; otherwise the key's shard (core/shard.h) names it: to[shard], or
// -1 for a shard no target of this load holds (its keys are skipped).
struct Routing {
  int32_t num_shards = 1;
  std::vector<int> to{0};
  bool routed() const { return num_shards > 1; }
};

// Moves the kept positions of a block of rows of `width` values to `dst`
// (dst == src: in place; keep is ascending, so a row never overwrites one
// still to be moved).
template <typename T>
void Gather(const T* src, T* dst, int64_t width, const std::vector<int64_t>& keep) {
  for (size_t w = 0; w < keep.size(); ++w)
    if (dst != src || static_cast<int64_t>(w) != keep[w])
      std::memmove(dst + w * width, src + keep[w] * width, sizeof(T) * width);
}

// Applies EV `name` of the bundle at `prefix` to `targets` (tables of one
// kind and dim), each key to the target `routing` names; counts[i]: what
// target i got. One target: EvLoadBundle; several: EvLoadBundleRouted (the
// shards of one process that a part of another shard count routes its keys
// to, the part read once for all of them). Every tensor is opened (and
// checked against the index) before any table changes, so a wrong dim, dtype
// or a missing file changes nothing; each tensor's crc32c is checked as it
// ends (DataLoss naming the file).
template <typename K, typename TableType>
void LoadBundle(const std::vector<TableType*>& targets, const Routing& routing, const std::string& prefix,
                const std::string& name, const std::vector<std::string>& slot_names, const ServingRows* serving,
                const std::string& view_name, const std::string& view_prefix, bool clear, int64_t cap,
                std::vector<ExportCounts>* counts) {
  const size_t nt = targets.size();
  const bool single = nt == 1, routed = routing.routed();
  const int dim = targets[0]->dim();  // a serving table's packed width (core/serving_rows.h)
  for (TableType* t : targets)
    if (t->dim() != dim) throw std::runtime_error("EvLoadBundleRouted: the target tables' dims differ");
  counts->assign(nt, ExportCounts{});
  BundleStreamReader r(prefix);
  std::unique_ptr<BundleStreamReader> vr;
  if (!view_name.empty()) vr = std::make_unique<BundleStreamReader>(ViewPrefix(prefix, view_prefix));
  using Col = BundleStreamReader::Column;
  using schema::TensorName;  // tensor names: core/schema.h
  KeyReader<K> keys(r, TensorName(name, schema::kKeys)), fkeys(r, TensorName(name, schema::kKeysFiltered));
  RowColumn values(r, vr.get(), name, serving, dim);
  Col versions(r, TensorName(name, schema::kVersions), tensorflow::DT_INT64, 1),
      freqs(r, TensorName(name, schema::kFreqs), tensorflow::DT_INT64, 1),
      ffreqs(r, TensorName(name, schema::kFreqsFiltered), tensorflow::DT_INT64, 1);
  std::vector<std::unique_ptr<Col>> slots;
  std::vector<SlotSpecs> want(nt);
  for (const std::string& s : slot_names) {
    slots.push_back(std::make_unique<Col>(r, schema::SlotTensor(name, s), tensorflow::DT_FLOAT, dim));
    const std::string init_name = schema::SlotInitialValueTensor(name, s);
    const bool held = r.Has(init_name);  // the saved table's initial value (older checkpoints lack it)
    float saved_init = 0.f;
    if (held) {
      Col saved(r, init_name, tensorflow::DT_FLOAT, 1);
      if (saved.rows() != 1)
        throw std::runtime_error("checkpoint " + prefix + ": '" + init_name + "' must hold one value");
      saved.Read(&saved_init, 1);
      saved.Finish();
    }
    for (size_t i = 0; i < nt; ++i) {
      float init = 0.f;
      for (const auto& h : targets[i]->slots())
        if (h.first == s) init = h.second;
      want[i].emplace_back(s, held ? saved_init : init);
    }
  }
  std::unique_ptr<KeyReader<K>> deleted;
  std::unique_ptr<Col> fseen, clock, bblocks, bcounters;
  const std::string deleted_name = TensorName(name, schema::kDeletedKeys),
                    seen_name = TensorName(name, schema::kSeenFiltered), clock_name = TensorName(name, schema::kClock),
                    geometry_name = TensorName(name, schema::kBloomGeometry);
  if (r.Has(deleted_name)) deleted = std::make_unique<KeyReader<K>>(r, deleted_name);
  if (r.Has(seen_name)) fseen = std::make_unique<Col>(r, seen_name, tensorflow::DT_INT64, 1);
  if (r.Has(clock_name)) clock = std::make_unique<Col>(r, clock_name, tensorflow::DT_INT64, 1);
  // Bloom counters restore into a filter of the same geometry (same
  // capacity, fp_rate and segments) holding the same keys (not re-routed).
  TableType& t0 = *targets[0];
  if (single && t0.has_bloom() && !routed && r.Has(geometry_name)) {
    Col geo(r, geometry_name, tensorflow::DT_INT64, 1);
    std::vector<int64_t> saved(geo.rows());
    geo.Read(saved.data(), geo.rows());
    geo.Finish();
    if (saved == t0.bloom()->Geometry()) {
      bblocks = std::make_unique<Col>(r, TensorName(name, schema::kBloomBlocks), tensorflow::DT_INT64, 1);
      bcounters =
          std::make_unique<Col>(r, TensorName(name, schema::kBloomCounters), tensorflow::DT_UINT8, CountingBloom::kBlock);
      if (bblocks->rows() != bcounters->rows())
        throw std::runtime_error("checkpoint " + prefix + ": Bloom tensors of '" + name +
                                 "' disagree on their row count");
    }
  }
  if (fseen && fseen->rows() != fkeys.rows())
    throw std::runtime_error("checkpoint " + prefix + ": tensors of '" + name + "' disagree on their row count");
  if (clock && clock->rows() != 1)
    throw std::runtime_error("checkpoint " + prefix + ": '" + clock_name + "' must hold one value");
  const int64_t n = keys.rows();
  if (values.rows() != n || versions.rows() != n || freqs.rows() != n || fkeys.rows() != ffreqs.rows())
    throw std::runtime_error("checkpoint " + prefix + ": tensors of '" + name + "' disagree on their row count");
  for (const auto& s : slots)
    if (s->rows() != n)
      throw std::runtime_error("checkpoint " + prefix + ": a slot of '" + name + "' has the wrong row count");
  std::vector<std::vector<int>> offs(nt);
  for (size_t i = 0; i < nt; ++i) offs[i] = targets[i]->EnsureSlots(want[i]);
  const int64_t incoming = n + fkeys.rows();
  for (TableType* t : targets) {
    if (clear) t->Clear();
    t->Reserve(t->Stats().size +
               (routed ? incoming / routing.num_shards + incoming / (8 * routing.num_shards) + 1024 : incoming));
  }
  // keep[i]: the positions of a chunk's keys that go to target i (routed
  // loads only), ascending. One target gathers them in place; several into
  // scratch buffers of a chunk each, the chunk read once for all.
  std::vector<std::vector<int64_t>> keep(nt);
  const auto split = [&](const CoreKey<K>* kbuf, int64_t m) {
    for (auto& k : keep) k.clear();
    for (int64_t j = 0; j < m; ++j) {
      const int to = routing.to[ShardOf(kbuf[j], routing.num_shards)];
      if (to >= 0) keep[to].push_back(j);
    }
  };
  std::vector<CoreKey<K>> kscratch(single ? 0 : cap);
  std::vector<int64_t> fbuf(cap), sbuf_seen(cap);
  std::vector<int64_t> vscratch(single ? 0 : cap), fscratch(single ? 0 : cap), seen_scratch(single ? 0 : cap);
  // Each target's part of a chunk of keys: (keys, count) of target i, gathered (routed) or all of them.
  const auto part = [&](CoreKey<K>* kbuf, int64_t m, size_t i) -> std::pair<CoreKey<K>*, int64_t> {
    if (!routed) return {kbuf, m};
    CoreKey<K>* dst = single ? kbuf : kscratch.data();
    Gather(kbuf, dst, 1, keep[i]);
    return {dst, static_cast<int64_t>(keep[i].size())};
  };
  if (deleted) {
    for (int64_t lo = 0; lo < deleted->rows(); lo += cap) {
      const int64_t m = std::min(cap, deleted->rows() - lo);
      CoreKey<K>* kbuf = deleted->Read(m);
      if (routed) split(kbuf, m);
      for (size_t i = 0; i < nt; ++i) {
        auto [kd, mk] = part(kbuf, m, i);
        targets[i]->Erase(kd, mk, /*track_deleted=*/false);
        (*counts)[i].deleted += mk;
      }
    }
    deleted->Finish();
  }
  // Chunks are read one ahead of the import, by a thread of their own
  // (std::async, one per chunk): the reads (direct where aligned: InFile)
  // and their checksums run while the previous chunk is imported (a tiered
  // table writing its tier meanwhile). Two chunks' buffers, each the rows and
  // their slots (none for a serving table or a restore without optimizer
  // slots: a zeroed buffer of a chunk's rows for nothing was 16 MiB of a
  // reload's memory at dim 64), aligned for direct reads.
  struct Chunk {
    int64_t m = 0;
    CoreKey<K>* keys = nullptr;  // KeyReader's: valid until its read after next
    AlignedBuffer<float> rows, sbuf;
    std::vector<int64_t> v, f;
  };
  Chunk bufs[2];
  for (Chunk& b : bufs) {
    b.rows = AlignedBuffer<float>(cap * dim);
    b.sbuf = AlignedBuffer<float>(SlotStride(cap, dim) * slots.size());
    b.v.resize(cap);
    b.f.resize(cap);
  }
  const auto read = [&](int64_t lo, Chunk* b) {
    const int64_t m = std::min(cap, n - lo);
    b->m = m;
    b->keys = keys.Read(m);
    values.Read(b->rows.data(), m);
    versions.Read(b->v.data(), m);
    freqs.Read(b->f.data(), m);
    for (size_t s = 0; s < slots.size(); ++s) slots[s]->Read(b->sbuf.data() + s * SlotStride(m, dim), m);
    // Reads through the page cache (not direct) ask the kernel for the chunk after.
    values.WillNeed(cap);
    versions.WillNeed(cap);
    freqs.WillNeed(cap);
    for (const auto& s : slots) s->WillNeed(cap);
  };
  std::vector<float> rscratch(single ? 0 : cap * dim), sscratch(single ? 0 : SlotStride(cap, dim) * slots.size());
  if (n > 0) read(0, &bufs[0]);
  for (int64_t lo = 0, k = 0; lo < n; lo += cap, ++k) {
    Chunk& cur = bufs[k & 1];
    // Destroyed before `cur` is read into again: a throwing import waits for it.
    std::future<void> next;
    if (lo + cap < n) next = std::async(std::launch::async, read, lo + cap, &bufs[(k + 1) & 1]);
    const int64_t m = cur.m, ss = SlotStride(m, dim);
    CoreKey<K>* kbuf = cur.keys;
    if (routed) split(kbuf, m);
    for (size_t i = 0; i < nt; ++i) {
      auto [kd, mk] = part(kbuf, m, i);
      float *rd = cur.rows.data(), *sd = cur.sbuf.data();
      int64_t *vd = cur.v.data(), *fd = cur.f.data();
      if (routed && !single) rd = rscratch.data(), sd = sscratch.data(), vd = vscratch.data(), fd = fscratch.data();
      if (routed) {
        Gather(cur.rows.data(), rd, dim, keep[i]);
        Gather(cur.v.data(), vd, 1, keep[i]);
        Gather(cur.f.data(), fd, 1, keep[i]);
        for (size_t s = 0; s < slots.size(); ++s) Gather(cur.sbuf.data() + s * ss, sd + s * ss, dim, keep[i]);
      }
      // Slot s of kept row j is at sd[s * ss + j * dim].
      targets[i]->ImportRows(kd, mk, rd, dim, sd, dim, ss, offs[i], vd, fd, /*mark_dirty=*/false);
      (*counts)[i].rows += mk;
    }
    if (next.valid()) next.get();
  }
  keys.Finish();
  values.Finish();
  for (Col* col : {&versions, &freqs}) col->Finish();
  for (const auto& s : slots) s->Finish();
  for (int64_t lo = 0; lo < fkeys.rows(); lo += cap) {
    const int64_t m = std::min(cap, fkeys.rows() - lo);
    CoreKey<K>* kbuf = fkeys.Read(m);
    ffreqs.Read(fbuf.data(), m);
    if (fseen) fseen->Read(sbuf_seen.data(), m);
    if (routed) split(kbuf, m);
    for (size_t i = 0; i < nt; ++i) {
      auto [kd, mk] = part(kbuf, m, i);
      int64_t *fd = fbuf.data(), *sd = sbuf_seen.data();
      if (routed && !single) fd = fscratch.data(), sd = seen_scratch.data();
      if (routed) {
        Gather(fbuf.data(), fd, 1, keep[i]);
        Gather(sbuf_seen.data(), sd, 1, keep[i]);
      }
      targets[i]->ImportFiltered(kd, mk, fd, /*mark_dirty=*/false, /*demote=*/true, fseen ? sd : nullptr);
      (*counts)[i].filtered += mk;
    }
  }
  fkeys.Finish();
  ffreqs.Finish();
  if (fseen) fseen->Finish();
  if (bblocks) {
    const int64_t B = CountingBloom::kBlock, bcap = std::max<int64_t>(1, (16 << 20) / B);
    std::vector<int64_t> ids(bcap);
    std::vector<uint8_t> cnt(bcap * B);
    for (int64_t lo = 0; lo < bblocks->rows(); lo += bcap) {
      const int64_t m = std::min(bcap, bblocks->rows() - lo);
      bblocks->Read(ids.data(), m);
      bcounters->Read(cnt.data(), m);
      for (int64_t j = 0; j < m; ++j) t0.WriteBloomBlock(ids[j], cnt.data() + j * B);
    }
    bblocks->Finish();
    bcounters->Finish();
  }
  if (clock) {
    int64_t saved = -1;
    clock->Read(&saved, 1);
    clock->Finish();
    for (TableType* t : targets) {
      if (clear)
        t->SetClock(saved);  // a full restore: exactly the saved table's clock
      else
        t->AdvanceClock(saved);
    }
  }
  for (TableType* t : targets) t->WriteNewRows();  // a tier's rows in DRAM only: on disk now (tiered_store.h)
}

std::vector<std::string> Strings(const Tensor& t) {
  std::vector<std::string> out;
  for (int64_t i = 0; i < t.NumElements(); ++i) out.emplace_back(t.flat<tensorflow::tstring>()(i));
  return out;
}

template <typename K>
class EvLoadBundleOp : public EvTableOp<K> {
 public:
  explicit EvLoadBundleOp(OpKernelConstruction* c) : EvTableOp<K>(c) {
    int32_t shard_index, num_shards;
    OP_REQUIRES_OK(c, ReadAttrs(c, "clear", &clear_, "shard_index", &shard_index, "num_shards", &num_shards, "view",
                                &view_, "view_prefix", &view_prefix_));
    OP_REQUIRES_OK(c, ReadChunkRows(c, &chunk_rows_));
    OP_REQUIRES(c, num_shards >= 1 && shard_index >= 0 && shard_index < num_shards,
                errors::InvalidArgument("need 0 <= shard_index < num_shards, got ", shard_index, " of ", num_shards));
    routing_.num_shards = num_shards;
    routing_.to.assign(num_shards, -1);
    routing_.to[shard_index] = 0;
  }

  EV_TABLE_KERNEL(ctx, res, t) {
    EV_INPUT(ctx, prefix_t, "prefix");
    EV_INPUT(ctx, name_t, "ev_name");
    EV_INPUT(ctx, slot_names, "slot_names");
    const ServingRows* serving = res.serving();
    OP_REQUIRES(ctx, view_.empty() || (serving && serving->name() == view_),
                errors::InvalidArgument("EvLoadBundle: a ", view_, " serving view loads only into a serving table "
                                        "in that precision"));
    OP_REQUIRES(ctx, !serving || slot_names.NumElements() == 0,
                errors::InvalidArgument("EvLoadBundle: a serving table holds no optimizer slots"));
    std::vector<ExportCounts> c;
    EV_TRY(ctx, LoadBundle<K>(std::vector<std::remove_reference_t<decltype(t)>*>{&t}, routing_,
                              std::string(prefix_t.scalar<tensorflow::tstring>()()),
                              std::string(name_t.scalar<tensorflow::tstring>()()), Strings(slot_names), serving, view_,
                              view_prefix_, clear_, chunk_rows_, &c));
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({3}), &out));
    out->flat<int64_t>()(0) = c[0].rows;
    out->flat<int64_t>()(1) = c[0].filtered;
    out->flat<int64_t>()(2) = c[0].deleted;
  }

 private:
  bool clear_;
  int64_t chunk_rows_;
  Routing routing_;
  std::string view_, view_prefix_;  // the serving view to read rows from ("": the float32 values)
};

// EvLoadBundleRouted: one load into the tables of several shards of one EV on
// this device, each key to the table of its shard (shard_indices[i] of
// num_shards: handles[i]), the bundle's tensors read once for all of them.
// The tables are of one kind (all in DRAM, or all tiered); no serving tables.
template <typename K>
class EvLoadBundleRoutedOp : public OpKernel {
 public:
  explicit EvLoadBundleRoutedOp(OpKernelConstruction* c) : OpKernel(c) {
    std::vector<int32_t> shards;
    OP_REQUIRES_OK(c, ReadAttrs(c, "clear", &clear_, "shard_indices", &shards, "num_shards", &routing_.num_shards));
    OP_REQUIRES_OK(c, ReadChunkRows(c, &chunk_rows_));
    OP_REQUIRES(c, routing_.num_shards >= 2, errors::InvalidArgument("num_shards must be >= 2"));
    routing_.to.assign(routing_.num_shards, -1);
    for (size_t i = 0; i < shards.size(); ++i) {
      OP_REQUIRES(c, shards[i] >= 0 && shards[i] < routing_.num_shards && routing_.to[shards[i]] < 0,
                  errors::InvalidArgument("shard_indices must be distinct shards of num_shards, got ", shards[i]));
      routing_.to[shards[i]] = static_cast<int>(i);
    }
  }

  void Compute(OpKernelContext* ctx) override {
    EV_INPUT(ctx, prefix_t, "prefix");
    EV_INPUT(ctx, name_t, "ev_name");
    EV_INPUT(ctx, slot_names, "slot_names");
    tensorflow::OpInputList handles;
    OP_REQUIRES_OK(ctx, ctx->input_list("handles", &handles));
    const int nt = handles.size();
    OP_REQUIRES(ctx, nt >= 1 && static_cast<size_t>(nt) == CountTargets(),
                errors::InvalidArgument("one handle per shard index"));
    std::vector<tensorflow::core::RefCountPtr<EvResource<K>>> res(nt);
    std::vector<TableT<K>*> dram;
    std::vector<TieredTableT<K>*> tiered;
    for (int i = 0; i < nt; ++i) {
      OP_REQUIRES_OK(ctx, tensorflow::LookupResource(ctx, handles[i].scalar<ResourceHandle>()(), &res[i]));
      OP_REQUIRES(ctx, !res[i]->serving(), errors::InvalidArgument("EvLoadBundleRouted: a serving table"));
      if (res[i]->tiered())
        tiered.push_back(res[i]->tiered());
      else
        dram.push_back(res[i]->dram());
    }
    OP_REQUIRES(ctx, tiered.empty() || dram.empty(),
                errors::InvalidArgument("EvLoadBundleRouted: the tables are not all tiered or all in DRAM"));
    const std::string prefix(prefix_t.scalar<tensorflow::tstring>()()), name(name_t.scalar<tensorflow::tstring>()());
    std::vector<ExportCounts> c;
    WriteBackReport report;  // as EvTableOp: refused write-backs of this op's evictions (rows kept in DRAM)
    EV_TRY(ctx, {
      if (!tiered.empty())
        LoadBundle<K>(tiered, routing_, prefix, name, Strings(slot_names), nullptr, "", "", clear_, chunk_rows_, &c);
      else
        LoadBundle<K>(dram, routing_, prefix, name, Strings(slot_names), nullptr, "", "", clear_, chunk_rows_, &c);
    });
    if (report.failures() > 0)
      return ctx->CtxFailure(errors::ResourceExhausted("EmbeddingVariable: ", report.message(),
                                                       "; free disk space or raise dram_bytes"));
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({nt, 3}), &out));
    for (int i = 0; i < nt; ++i) {
      out->matrix<int64_t>()(i, 0) = c[i].rows;
      out->matrix<int64_t>()(i, 1) = c[i].filtered;
      out->matrix<int64_t>()(i, 2) = c[i].deleted;
    }
  }

 private:
  size_t CountTargets() const {
    size_t n = 0;
    for (int to : routing_.to) n += to >= 0;
    return n;
  }
  bool clear_;
  int64_t chunk_rows_;
  Routing routing_;
};

// EvDiskFree: statvfs of `path` (absolute) or of its nearest existing parent.
class EvDiskFreeOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    EV_INPUT(ctx, path_t, "path");
    std::string path(path_t.scalar<tensorflow::tstring>()());
    struct stat st;
    OP_REQUIRES(ctx, !path.empty() && path[0] == '/', errors::InvalidArgument("EvDiskFree: an absolute path, got ", path));
    while (::stat(path.c_str(), &st) != 0 && errno == ENOENT && path != "/") {
      const size_t slash = path.find_last_of('/');
      path = slash == 0 ? "/" : path.substr(0, slash);
    }
    struct statvfs fs;
    OP_REQUIRES(ctx, ::stat(path.c_str(), &st) == 0 && ::statvfs(path.c_str(), &fs) == 0,
                errors::FailedPrecondition("EvDiskFree: cannot stat ", path, ": ", std::strerror(errno)));
    const uint64_t blocks = ::geteuid() == 0 ? fs.f_bfree : fs.f_bavail;
    Tensor *free_t, *dev_t;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &free_t));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &dev_t));
    free_t->scalar<int64_t>()() = static_cast<int64_t>(blocks * fs.f_frsize);
    dev_t->scalar<int64_t>()() = static_cast<int64_t>(st.st_dev);
  }
};

// EvTierRecordBytes: the core's record size (row_store.h, serving_rows.h).
class EvTierRecordBytesOp : public OpKernel {
 public:
  explicit EvTierRecordBytesOp(OpKernelConstruction* c) : OpKernel(c) {
    int dim, slots;
    std::string precision;
    OP_REQUIRES_OK(c, ReadAttrs(c, "dim", &dim, "slots", &slots, "precision", &precision));
    OP_REQUIRES(c, precision == "float32" || slots == 0,
                errors::InvalidArgument("EvTierRecordBytes: a serving table's rows (precision ", precision,
                                        ") have no slots, got slots=", slots));
    try {
      bytes_ = RecordBytes(precision == "float32" ? RowFloats(dim, slots)
                                                  : ServingRows::PackedFloats(view::Parse(precision), dim));
    } catch (const std::invalid_argument& e) {
      c->CtxFailure(errors::InvalidArgument("EvTierRecordBytes: ", e.what()));
    }
  }
  void Compute(OpKernelContext* ctx) override {
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = bytes_;
  }

 private:
  int64_t bytes_ = 0;
};

class EvCrc32cExtendOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    EV_INPUT(ctx, crc_t, "crc");
    EV_INPUT(ctx, data_t, "data");
    const int64_t crc = crc_t.scalar<int64_t>()();
    const auto& data = data_t.scalar<tensorflow::tstring>()();
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = Crc32cExtend(static_cast<uint32_t>(crc), data.data(), data.size());
  }
};

// crc32c and size of each local file of `path`, read in chunks of up to
// 256 KiB through one buffer, allocated once per call and not cleared (a
// zero-filled buffer per file cost more than reading a small delta's files).
// The buffer stays in the core's L2 cache, so the checksum reads what the
// kernel just copied from the cache, not from memory (a restore checks every
// file of a full this way before it loads them).
class EvFileCrc32cOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    EV_INPUT(ctx, path_t, "path");
    const auto paths = path_t.flat<tensorflow::tstring>();
    Tensor *c, *s;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, path_t.shape(), &c));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, path_t.shape(), &s));
    auto crcs = c->flat<int64_t>();
    auto sizes = s->flat<int64_t>();
    constexpr size_t kChunk = 256 << 10;
    std::unique_ptr<char[]> buf(new char[kChunk]);
    for (int64_t i = 0; i < paths.size(); ++i) {
      const std::string path(paths(i));
      const FileCrc32c f = Crc32cOfFile(path.c_str(), buf.get(), kChunk);
      OP_REQUIRES(ctx, f.opened, errors::NotFound("cannot open '", path, "': ", std::strerror(f.err)));
      OP_REQUIRES(ctx, f.err == 0, errors::DataLoss("cannot read '", path, "': ", std::strerror(f.err)));
      crcs(i) = f.crc;
      sizes(i) = f.size;
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("EvSaveBundle").Device(DEVICE_CPU), EvSaveBundleOp);
EV_REGISTER_KEYED("EvLoadBundle", EvLoadBundleOp);
EV_REGISTER_KEYED("EvLoadBundleRouted", EvLoadBundleRoutedOp);
REGISTER_KERNEL_BUILDER(Name("EvCrc32cExtend").Device(DEVICE_CPU), EvCrc32cExtendOp);
REGISTER_KERNEL_BUILDER(Name("EvDiskFree").Device(DEVICE_CPU), EvDiskFreeOp);
REGISTER_KERNEL_BUILDER(Name("EvTierRecordBytes").Device(DEVICE_CPU), EvTierRecordBytesOp);
REGISTER_KERNEL_BUILDER(Name("EvFileCrc32c").Device(DEVICE_CPU), EvFileCrc32cOp);

}  // namespace
}  // namespace tf
}  // namespace evstore
