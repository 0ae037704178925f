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
#include "../core/table.h"

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
template <typename T>
using TableT = Table<CoreKey<T>>;

template <typename K>
class EvResource : public tensorflow::ResourceBase {
 public:
  using TableType = TableT<K>;
  explicit EvResource(TableConfig cfg) : table_(std::move(cfg)) {}
  TableType& table() { return table_; }
  std::string DebugString() const override {
    return "EmbeddingVariable(dim=" + std::to_string(table_.dim()) + ", size=" + std::to_string(table_.size()) + ")";
  }
  int64_t MemoryUsed() const override {
    TableStats s = table_.Stats();
    return s.index_bytes + s.meta_bytes + s.row_bytes;
  }

 private:
  TableType table_;
};

}  // namespace tf
}  // namespace evstore
