// Helpers shared by the tensor store's tests.
#ifndef MEMASCEND_TESTS_STORE_STORE_TEST_UTIL_H_
#define MEMASCEND_TESTS_STORE_STORE_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <memascend/tensor_store.h>
#include <memascend/volume.h>

#include "testing/status_matchers.h"

namespace memascend::testing {

inline TensorSpec Spec(std::string name, std::size_t bytes, DType dtype = DType::kBF16,
                       std::vector<std::int64_t> shape = {}, Use use = Use::kParameters,
                       Durability durability = Durability::kDurable) {
  TensorSpec s;
  s.name = std::move(name);
  s.bytes = bytes;
  s.dtype = dtype;
  s.shape = std::move(shape);
  s.use = use;
  s.durability = durability;
  return s;
}

// A freshly formatted file volume of `bytes`, opened.
inline std::unique_ptr<Volume> MakeVolume(const std::string& path, std::uint64_t bytes) {
  VolumeFormatOptions f;
  f.size = bytes;
  EXPECT_OK(Volume::Format(path, f));
  return *Volume::Open(path, {});
}

}  // namespace memascend::testing

#endif  // MEMASCEND_TESTS_STORE_STORE_TEST_UTIL_H_
