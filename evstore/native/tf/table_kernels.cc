// Kernels that create, inspect, export and import a table.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel_util.h"

namespace evstore {
namespace tf {
namespace {

// ---------------------------------------------------------------- create

template <typename K>
class EvCreateOp : public OpKernel {
 public:
  explicit EvCreateOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, ReadAttrs(c, "dim", &dim_, "segments_log2", &segments_log2_, "min_freq", &min_freq_,
                                "bloom_capacity", &bloom_capacity_, "bloom_fp_rate", &bloom_fp_rate_,
                                "tier_dram_bytes", &tier_dram_bytes_, "tier_path", &tier_path_, "serving_rows",
                                &serving_rows_));
    OP_REQUIRES(c, tier_dram_bytes_ >= 0,
                errors::InvalidArgument("tier_dram_bytes must be >= 0, got ", tier_dram_bytes_));
    OP_REQUIRES(c, tier_dram_bytes_ == 0 || !tier_path_.empty(),
                errors::InvalidArgument("a tiered table (tier_dram_bytes > 0) needs tier_path"));
    OP_REQUIRES(c, segments_log2_ >= 0 && segments_log2_ <= 12,
                errors::InvalidArgument("segments_log2 must be in [0, 12]"));
    OP_REQUIRES(c, min_freq_ >= 1, errors::InvalidArgument("min_freq must be >= 1, got ", min_freq_));
  }
  void Compute(OpKernelContext* ctx) override {
    EV_INPUT(ctx, bank, "bank");
    EV_INPUT(ctx, dflt, "default_value");
    OP_REQUIRES(ctx, bank.dims() == 2 && bank.dim_size(1) == dim_ && bank.dim_size(0) >= 1,
                errors::InvalidArgument("bank must be [rows >= 1, ", dim_, "], got ", bank.shape().DebugString()));
    OP_REQUIRES(ctx, dflt.NumElements() == dim_,
                errors::InvalidArgument("default_value must have ", dim_, " elements, got ",
                                        dflt.shape().DebugString()));
    TableConfig cfg;
    cfg.dim = static_cast<int>(dim_);
    cfg.segments_log2 = static_cast<int>(segments_log2_);
    cfg.min_freq = static_cast<uint32_t>(min_freq_);
    cfg.bloom.capacity = bloom_capacity_;
    cfg.bloom.fp_rate = bloom_fp_rate_;
    cfg.tier.dram_bytes = tier_dram_bytes_;
    cfg.tier.path = tier_path_;
    auto b = bank.flat<float>();
    cfg.bank.assign(b.data(), b.data() + b.size());
    auto d = dflt.flat<float>();
    cfg.default_value.assign(d.data(), d.data() + d.size());
    tensorflow::ResourceHandle handle;
    OP_REQUIRES_OK(ctx, tensorflow::HandleFromInput(ctx, schema::kHandle, &handle));
    EvResource<K>* res = nullptr;
    absl::Status st;
    try {
      std::unique_ptr<ServingRows> serving;
      if (!serving_rows_.empty()) serving = std::make_unique<ServingRows>(serving_rows_, cfg.dim, cfg.default_value);
      st = tensorflow::LookupOrCreateResource<EvResource<K>>(
          ctx, handle, &res, [&cfg, &serving](EvResource<K>** r) {
            *r = new EvResource<K>(cfg, std::move(serving));
            return absl::OkStatus();
          });
    } catch (const std::exception& e) {
      ctx->CtxFailure(errors::InvalidArgument(e.what()));
      return;
    }
    OP_REQUIRES_OK(ctx, st);
    tensorflow::core::ScopedUnref unref(res);
    OP_REQUIRES(ctx, res->dim() == dim_,
                errors::FailedPrecondition("EmbeddingVariable '", handle.name(),
                                           "' already exists with dim ", res->dim(), ", not ", dim_));
  }

 private:
  int64_t dim_, segments_log2_, min_freq_, bloom_capacity_, tier_dram_bytes_;
  float bloom_fp_rate_;
  std::string tier_path_;
  std::string serving_rows_;  // "": a training table; else a serving table's precision (core/serving_rows.h)
};

// ---------------------------------------------------------------- introspection

template <typename K>
class EvSizeOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = t.size();
  }
};

template <typename K>
class EvSlotsOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    const SlotSpecs slots = t.slots();
    const int64_t ns = static_cast<int64_t>(slots.size());
    Tensor *names, *inits;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({ns}), &names));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({ns}), &inits));
    for (int64_t i = 0; i < ns; ++i) {
      names->flat<tensorflow::tstring>()(i) = slots[i].first;
      inits->flat<float>()(i) = slots[i].second;
    }
  }
};

template <typename K>
class EvStatsOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    TableStats s = t.Stats();
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({schema::kNumStatsFields}), &out));
    auto o = out->flat<int64_t>();
    int i = 0;  // fields in schema order (core/schema.h: EVSTORE_STATS_FIELDS)
#define EV_STATS_OUT(name, doc) o(i++) = s.name;
    EVSTORE_STATS_FIELDS(EV_STATS_OUT)
#undef EV_STATS_OUT
  }
};

template <typename K>
class EvKeyInfoOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    EV_KEYS_INPUT(ctx, keys, kin);
    Tensor *freqs, *versions, *admitted;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &freqs));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, keys.shape(), &versions));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, keys.shape(), &admitted));
    const int64_t n = keys.NumElements();
    std::vector<uint8_t> present(n), adm(n);
    t.Read(kin.data(), n, t.stride(), present.data(), adm.data(), versions->flat<int64_t>().data(),
           freqs->flat<int64_t>().data(), /*rows=*/nullptr);
    auto a = admitted->flat<bool>();
    auto v = versions->flat<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      a(i) = adm[i] != 0;
      v(i) = PublicVersion(v(i));  // -1 for never updated (the slot may encode the admission step)
    }
  }
};

// The reference model's copy-on-write (Table::KeepFrom): the source table is
// the second resource input, of either table type.
template <typename K>
class EvKeepRowsOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    EV_KEYS_INPUT(ctx, keys, kin);
    tensorflow::core::RefCountPtr<EvResource<K>> src;
    OP_REQUIRES_OK(ctx, GetTable<K>(ctx, &src, "source"));
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    int64_t kept = 0;
    EV_TRY(ctx, kept = src->Visit([&](const auto& s) { return t.KeepFrom(s, kin.data(), keys.NumElements()); }));
    out->scalar<int64_t>()() = kept;
  }
};

template <typename K>
class EvRemoveOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    EV_KEYS_INPUT(ctx, keys, kin);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    // A serving table exports nothing: it keeps no deleted set.
    out->scalar<int64_t>()() = t.Erase(kin.data(), keys.NumElements(), /*track_deleted=*/!res.serving());
  }
};

// Upserts rows of a serving table in its precision (EvServeUpsert).
template <typename K>
class EvServeUpsertOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    const ServingRows* serving = res.serving();
    OP_REQUIRES(ctx, serving, errors::FailedPrecondition("EvServeUpsert needs a serving table (EvCreate's serving_rows)"));
    EV_KEYS_INPUT(ctx, keys, kin);
    EV_INPUT(ctx, values, "values");
    EV_INPUT(ctx, scales, "scales");
    EV_INPUT(ctx, freqs, "freqs");
    const int64_t n = keys.NumElements();
    OP_REQUIRES(ctx, values.dims() == 2 && values.dim_size(0) == n && values.dim_size(1) == serving->dim(),
                errors::InvalidArgument("values must be [", n, ", ", serving->dim(), "], got ",
                                        values.shape().DebugString()));
    OP_REQUIRES(ctx, freqs.NumElements() == n, errors::InvalidArgument("freqs must have one element per key"));
    const tensorflow::DataType dt = values.dtype();
    const view::Codec c = serving->codec();
    const bool encoded = dt != tensorflow::DT_FLOAT || c == view::Codec::kNone;
    if (encoded) {
      const tensorflow::DataType want = c == view::Codec::kBfloat16 ? tensorflow::DT_BFLOAT16
                                        : c == view::Codec::kFloat16 ? tensorflow::DT_HALF
                                        : c == view::Codec::kInt8    ? tensorflow::DT_INT8
                                                                     : tensorflow::DT_FLOAT;
      OP_REQUIRES(ctx, dt == want,
                  errors::InvalidArgument("a ", serving->name(), " serving table takes float32 rows or ",
                                          tensorflow::DataTypeString(want), " rows, got ",
                                          tensorflow::DataTypeString(dt)));
    }
    OP_REQUIRES(ctx, !(encoded && c == view::Codec::kInt8) || scales.NumElements() == n,
                errors::InvalidArgument("int8 rows need one scale per row"));
    if (n == 0) return;
    const int w = serving->packed_floats();
    // Rows whose codes are their packed words are stored from the input as they are.
    const bool in_place = encoded && serving->CodesArePacked();
    std::vector<float> packed(in_place ? 0 : static_cast<size_t>(n) * w);
    if (!in_place && encoded)
      serving->Pack(values.tensor_data().data(), scales.flat<float>().data(), n, packed.data());
    else if (!in_place)
      serving->Encode(values.flat<float>().data(), n, packed.data());
    const float* rows = in_place ? reinterpret_cast<const float*>(values.tensor_data().data()) : packed.data();
    std::vector<int64_t> versions(n, -1);
    EV_TRY(ctx, t.ImportRows(kin.data(), n, rows, w, nullptr, 0, {}, versions.data(), freqs.flat<int64_t>().data(),
                             /*mark_dirty=*/false, IntraOp(ctx)));
  }
};

// Before a serving table's publish (EvServeWarm): a tiered table makes room
// for one row per key (evicting others first, so what it reads next stays),
// then reads the rows of `keys` it holds into its cache; the upserts under
// the serving write lock then read and write no disk.
template <typename K>
class EvServeWarmOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    if constexpr (std::is_same_v<TableType, TieredTableT<K>>) {
      EV_KEYS_INPUT(ctx, keys, kin);
      EV_TRY(ctx, {
        t.store().MakeRoom(keys.NumElements());
        t.FindEach(kin.data(), keys.NumElements(), /*count=*/false, IntraOp(ctx), [](int64_t, const float*) {});
      });
    }
  }
};

// Sets a tiered table's DRAM budget (EvSetDramBytes); nothing for a table in DRAM.
template <typename K>
class EvSetDramBytesOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    EV_INPUT(ctx, bytes, "dram_bytes");
    if constexpr (std::is_same_v<TableType, TieredTableT<K>>) {
      EV_TRY(ctx, t.store().SetDramBytes(bytes.scalar<int64_t>()()));
    }
  }
};

// ---------------------------------------------------------------- export / import

template <typename K>
class EvExportOp : public EvTableOp<K> {
 public:
  using EvTableOp<K>::EvTableOp;
  EV_TABLE_KERNEL(ctx, res, t) {
    const int dim = t.dim();
    SlotSpecs slots = t.slots();
    const int ns = static_cast<int>(slots.size());
    // Collected per segment; the stride is re-read under each segment lock via
    // the row pointer's table stride at the time (slots only grow).
    std::vector<OwnedKey<K>> keys, fkeys;
    std::vector<float> vals, slotv;
    std::vector<int64_t> vers, freqs, ffreqs;
    for (int s = 0; s < t.num_segments(); ++s) {
      t.ForEachInSegment(s, [&](const ExportedKey<CoreKey<K>>& x, const float* row) {
        if (!x.admitted) {
          fkeys.emplace_back(x.key);
          ffreqs.push_back(x.freq);
          return;
        }
        keys.emplace_back(x.key);
        vers.push_back(x.version);
        freqs.push_back(x.freq);
        vals.insert(vals.end(), row, row + dim);
        slotv.insert(slotv.end(), row + dim, row + dim * (1 + ns));
      });
    }
    const int64_t n = keys.size(), m = fkeys.size();
    Tensor* o[8];
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &o[0]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n, dim}), &o[1]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n, ns, dim}), &o[2]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({n}), &o[3]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(4, TensorShape({n}), &o[4]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(5, TensorShape({m}), &o[5]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(6, TensorShape({m}), &o[6]));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(7, TensorShape({ns}), &o[7]));
    CopyKeysOut<K>(keys.begin(), keys.end(), o[0]);
    std::copy(vals.begin(), vals.end(), o[1]->flat<float>().data());
    std::copy(slotv.begin(), slotv.end(), o[2]->flat<float>().data());
    std::copy(vers.begin(), vers.end(), o[3]->flat<int64_t>().data());
    std::copy(freqs.begin(), freqs.end(), o[4]->flat<int64_t>().data());
    CopyKeysOut<K>(fkeys.begin(), fkeys.end(), o[5]);
    std::copy(ffreqs.begin(), ffreqs.end(), o[6]->flat<int64_t>().data());
    auto names = o[7]->flat<tensorflow::tstring>();
    for (int i = 0; i < ns; ++i) names(i) = slots[i].first;
  }
};

template <typename K>
class EvImportOp : public EvTableOp<K> {
 public:
  explicit EvImportOp(OpKernelConstruction* c) : EvTableOp<K>(c) { OP_REQUIRES_OK(c, ReadAttrs(c, "clear", &clear_)); }
  EV_TABLE_KERNEL(ctx, res, t) {
    const int dim = t.dim();
    EV_KEYS_INPUT(ctx, keys, kin);
    EV_INPUT(ctx, vals, "values");
    EV_INPUT(ctx, slots, "slots");
    EV_INPUT(ctx, names, "slot_names");
    EV_INPUT(ctx, vers, "versions");
    EV_INPUT(ctx, freqs, "freqs");
    EV_INPUT(ctx, fkeys, "filtered_keys");
    EV_INPUT(ctx, ffreqs, "filtered_freqs");
    OP_REQUIRES(ctx, keys.dims() == 1, errors::InvalidArgument("keys must be a vector"));
    const int64_t n = keys.dim_size(0);
    const int64_t ns = names.NumElements();
    OP_REQUIRES(ctx, vals.dims() == 2 && vals.dim_size(0) == n && vals.dim_size(1) == dim,
                errors::InvalidArgument("values must be [", n, ", ", dim, "], got ", vals.shape().DebugString()));
    OP_REQUIRES(ctx, slots.dims() == 3 && slots.dim_size(0) == n && slots.dim_size(1) == ns && slots.dim_size(2) == dim,
                errors::InvalidArgument("slots must be [", n, ", ", ns, ", ", dim, "], got ",
                                        slots.shape().DebugString()));
    OP_REQUIRES(ctx, vers.NumElements() == n && freqs.NumElements() == n,
                errors::InvalidArgument("versions and freqs must have one entry per key"));
    OP_REQUIRES(ctx, fkeys.NumElements() == ffreqs.NumElements(),
                errors::InvalidArgument("filtered_keys and filtered_freqs must have the same length"));
    SlotSpecs want;
    auto nm = names.flat<tensorflow::tstring>();
    SlotSpecs have = t.slots();
    for (int64_t i = 0; i < ns; ++i) {
      float init = 0.f;
      for (const auto& h : have)
        if (h.first == std::string(nm(i))) init = h.second;
      want.emplace_back(std::string(nm(i)), init);
    }
    KeysIn<K> fkin;
    OP_REQUIRES_OK(ctx, fkin.Init(fkeys));
    EV_TRY(ctx, {
      std::vector<int> offs = t.EnsureSlots(want);
      if (clear_) t.Clear();
      t.Reserve(t.Stats().size + n + fkeys.NumElements());
      t.ImportRows(kin.data(), n, vals.flat<float>().data(), dim, slots.flat<float>().data(), ns * dim,
                   offs, vers.flat<int64_t>().data(), freqs.flat<int64_t>().data(), /*mark_dirty=*/!clear_);
      t.ImportFiltered(fkin.data(), fkeys.NumElements(), ffreqs.flat<int64_t>().data(), !clear_);
      t.WriteNewRows();
    });
  }

 private:
  bool clear_;
};

// ---------------------------------------------------------------- two-phase export

template <typename K>
class EvBeginExportOp : public EvTableOp<K> {
 public:
  explicit EvBeginExportOp(OpKernelConstruction* c) : EvTableOp<K>(c) {
    OP_REQUIRES_OK(c, ReadAttrs(c, "return_keys", &return_keys_));
  }
  EV_TABLE_KERNEL(ctx, res, t) {
    std::shared_ptr<const typename TableType::Snapshot> snap;
    EV_TRY(ctx, snap = t.BeginExport());
    const int64_t nd = return_keys_ ? snap->dirty.size() : 0, nx = return_keys_ ? snap->deleted.size() : 0;
    Tensor *id, *dirty, *deleted;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &id));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({nd}), &dirty));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({nx}), &deleted));
    id->scalar<int64_t>()() = static_cast<int64_t>(snap->id);
    if (!return_keys_) return;
    CopyKeysOut<K>(snap->dirty.begin(), snap->dirty.end(), dirty);
    CopyKeysOut<K>(snap->deleted.begin(), snap->deleted.end(), deleted);
  }

 private:
  bool return_keys_;
};

template <typename K>
class EvEndExportOp : public EvTableOp<K> {
 public:
  explicit EvEndExportOp(OpKernelConstruction* c) : EvTableOp<K>(c) { OP_REQUIRES_OK(c, ReadAttrs(c, "commit", &commit_)); }
  EV_TABLE_KERNEL(ctx, res, t) {
    EV_INPUT(ctx, snapshot_id, "snapshot_id");
    uint64_t id = static_cast<uint64_t>(snapshot_id.scalar<int64_t>()());
    if (commit_) {
      EV_TRY(ctx, t.Commit(id));
    } else {
      EV_TRY(ctx, t.Abort(id));
    }
  }

 private:
  bool commit_;
};

// ---------------------------------------------------------------- swap

template <typename K>
class EvSwapTablesOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    tensorflow::core::RefCountPtr<EvResource<K>> a;
    OP_REQUIRES_OK(ctx, GetTable<K>(ctx, &a));
    tensorflow::ResourceHandle hb;
    OP_REQUIRES_OK(ctx, tensorflow::HandleFromInput(ctx, "other", &hb));
    tensorflow::core::RefCountPtr<EvResource<K>> b;
    OP_REQUIRES_OK(ctx, tensorflow::LookupResource(ctx, hb, &b));
    OP_REQUIRES(ctx, a->dim() == b->dim(),
                errors::InvalidArgument("EvSwapTables: tables of dim ", a->dim(), " and ", b->dim()));
    if (a.get() != b.get()) a->SwapTable(*b);
  }
};

template <typename K>
using EvHandleKernel = tensorflow::ResourceHandleOp<EvResource<K>>;

EV_REGISTER_KEYED("EvHandleOp", EvHandleKernel);
EV_REGISTER_KEYED("EvCreate", EvCreateOp);
EV_REGISTER_KEYED("EvSize", EvSizeOp);
EV_REGISTER_KEYED("EvSlots", EvSlotsOp);
EV_REGISTER_KEYED("EvStats", EvStatsOp);
EV_REGISTER_KEYED("EvKeyInfo", EvKeyInfoOp);
EV_REGISTER_KEYED("EvKeepRows", EvKeepRowsOp);
EV_REGISTER_KEYED("EvRemove", EvRemoveOp);
EV_REGISTER_KEYED("EvExport", EvExportOp);
EV_REGISTER_KEYED("EvImport", EvImportOp);
EV_REGISTER_KEYED("EvBeginExport", EvBeginExportOp);
EV_REGISTER_KEYED("EvEndExport", EvEndExportOp);
EV_REGISTER_KEYED("EvSwapTables", EvSwapTablesOp);
EV_REGISTER_KEYED("EvServeUpsert", EvServeUpsertOp);
EV_REGISTER_KEYED("EvServeWarm", EvServeWarmOp);
EV_REGISTER_KEYED("EvSetDramBytes", EvSetDramBytesOp);

}  // namespace
}  // namespace tf
}  // namespace evstore
