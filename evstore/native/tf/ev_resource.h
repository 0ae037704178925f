// The EmbeddingVariable as a TensorFlow resource: a thin owner of one
// evstore::Table<K> (native/core). Kernels look it up through its handle; all
// table logic stays in the core.
#pragma once
#include <memory>
#include <string>

#include "tensorflow/core/framework/resource_mgr.h"
#include "../core/table.h"

namespace evstore {
namespace tf {

template <typename K>
class EvResource : public tensorflow::ResourceBase {
 public:
  explicit EvResource(TableConfig cfg) : table_(std::move(cfg)) {}
  Table<K>& table() { return table_; }
  std::string DebugString() const override {
    return "EmbeddingVariable(dim=" + std::to_string(table_.dim()) + ", size=" + std::to_string(table_.size()) + ")";
  }
  int64_t MemoryUsed() const override {
    TableStats s = table_.Stats();
    return s.index_bytes + s.meta_bytes + s.row_bytes;
  }

 private:
  Table<K> table_;
};

}  // namespace tf
}  // namespace evstore
