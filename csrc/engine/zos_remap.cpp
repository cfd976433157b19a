#include "zos_remap.hpp"

#include <cstring>

namespace deepinfer {

bool prepare_zos_inputs(const int64_t* prev_ids, int64_t m, const int64_t* cur_ids, int64_t n, int32_t* remap,
                        std::unordered_map<int64_t, int32_t>& scratch) {
  if (m == n && (n == 0 || std::memcmp(prev_ids, cur_ids, sizeof(int64_t) * n) == 0)) {
    for (int64_t i = 0; i < n; ++i) remap[i] = static_cast<int32_t>(i);
    return true;
  }
  scratch.clear();
  scratch.reserve(static_cast<size_t>(m));
  for (int64_t j = 0; j < m; ++j)
    scratch.emplace(prev_ids[j], static_cast<int32_t>(j));  // keeps the first row
  for (int64_t i = 0; i < n; ++i) {
    auto it = scratch.find(cur_ids[i]);
    remap[i] = it == scratch.end() ? -1 : it->second;
  }
  return false;
}

bool prepare_zos_inputs(const int64_t* prev_ids, int64_t m, const int64_t* cur_ids, int64_t n,
                        int32_t* remap) {
  std::unordered_map<int64_t, int32_t> scratch;
  return prepare_zos_inputs(prev_ids, m, cur_ids, n, remap, scratch);
}

}  // namespace deepinfer
