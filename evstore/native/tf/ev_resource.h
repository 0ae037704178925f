// The EmbeddingVariable as a TensorFlow resource: a thin owner of one
// evstore::Table<K> (native/core). Kernels look it up through its handle; all
// table logic stays in the core.
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include "absl/strings/escaping.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/platform/tstring.h"
#include "../core/serving_rows.h"
#include "../core/table.h"
#include "../core/tiered_store.h"

namespace evstore {
namespace tf {

// ---- key dtypes ----------------------------------------------------------------
// Kernels are templated on the keys' tensor element type T (int32_t, int64_t,
// tstring). KeyDtype<T> maps it to the core's key type (key_traits.h): integers
// are themselves; a tf.string key is a std::string_view of the tensor's bytes.
template <typename T>
struct KeyDtype {
  using Key = T;
  static Key View(const T& v) { return v; }
  static T ToTensor(Key k) { return k; }
  static std::string Text(Key k) { return std::to_string(k); }
};
template <>
struct KeyDtype<tensorflow::tstring> {
  using Key = std::string_view;
  static Key View(const tensorflow::tstring& v) { return Key(v.data(), v.size()); }
  static tensorflow::tstring ToTensor(Key k) { return tensorflow::tstring(k.data(), k.size()); }
  static std::string Text(Key k) { return "'" + absl::CEscape(absl::string_view(k.data(), k.size())) + "'"; }
};
template <typename T>
using CoreKey = typename KeyDtype<T>::Key;
// The two table types a resource may hold: rows all in DRAM (the default),
// or in a DRAM cache over a disk tier (core/tiered_store.h). Kernels are
// written once over the table type (kernel_util.h: EV_TABLE_KERNEL) and the
// resource picks the type when it is created, so the all-DRAM table is the
// same code as without tiering.
template <typename T>
using TableT = Table<CoreKey<T>>;
template <typename T>
using TieredTableT = Table<CoreKey<T>, KeyTraits<CoreKey<T>>, TieredStore<>>;

template <typename K>
class EvResource : public tensorflow::ResourceBase {
 public:
  // A tier config with dram_bytes > 0 makes a tiered table. `serving`
  // (optional) makes it a serving table: rows packed in that precision (its
  // table's dim is the packed width: core/serving_rows.h), lookups decode
  // them and count (Table::FindEach).
  explicit EvResource(TableConfig cfg, std::unique_ptr<ServingRows> serving = nullptr)
      : serving_(std::move(serving)) {
    if (serving_) {
      cfg.dim = serving_->packed_floats();
      cfg.bank.assign(cfg.dim, 0.f);
      cfg.default_value.assign(cfg.dim, 0.f);
    }
    // A serving table reads its tier with preadv, not through the mapping: a
    // disk read error is then that request's error, and the server keeps
    // serving (through the mapping it would be SIGBUS: core/row_file.h).
    if (serving_) cfg.tier.mapped_reads = false;
    if (cfg.tier.dram_bytes > 0) {
      tiered_ = std::make_unique<TieredTableT<K>>(std::move(cfg));
    } else {
      dram_ = std::make_unique<TableT<K>>(std::move(cfg));
    }
  }
  // Exactly one of these is non-null.
  TableT<K>* dram() { return dram_.get(); }
  TieredTableT<K>* tiered() { return tiered_.get(); }
  // Calls fn(table) with the table of whichever type this resource holds.
  template <typename Fn>
  decltype(auto) Visit(Fn&& fn) {
    if (tiered_) return fn(*tiered_);
    return fn(*dram_);
  }
  template <typename Fn>
  decltype(auto) Visit(Fn&& fn) const {
    if (tiered_) return fn(static_cast<const TieredTableT<K>&>(*tiered_));
    return fn(static_cast<const TableT<K>&>(*dram_));
  }
  // Exchanges the tables of two resources (EvSwapTables: a serving process
  // loads a chain into a second table, then makes it the served one). Not
  // synchronised with kernels running on either resource: the caller keeps
  // every other op off both while it runs.
  // A serving table's precision goes with its rows.
  void SwapTable(EvResource& other) {
    dram_.swap(other.dram_);
    tiered_.swap(other.tiered_);
    serving_.swap(other.serving_);
  }
  // The serving table's row format, or null (a training table).
  const ServingRows* serving() const { return serving_.get(); }
  // Floats per looked-up row (a serving table's packed rows decode to this many).
  int dim() const {
    if (serving_) return serving_->dim();
    return Visit([](const auto& t) { return t.dim(); });
  }
  std::string DebugString() const override {
    return Visit([](const auto& t) {
      return "EmbeddingVariable(dim=" + std::to_string(t.dim()) + ", size=" + std::to_string(t.size()) + ")";
    });
  }
  int64_t MemoryUsed() const override {
    return Visit([](const auto& t) {
      TableStats s = t.Stats();
      return s.index_bytes + s.meta_bytes + s.row_bytes;
    });
  }

 private:
  std::unique_ptr<TableT<K>> dram_;
  std::unique_ptr<TieredTableT<K>> tiered_;
  std::unique_ptr<ServingRows> serving_;
};

}  // namespace tf
}  // namespace evstore
