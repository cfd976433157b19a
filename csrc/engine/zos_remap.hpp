// ZOS row remap (seed §6.2): for each sequence of this step, its row in the previous step or -1 when new.
#pragma once

#include <cstdint>
#include <unordered_map>

namespace deepinfer {

// Writes remap[i] = row of cur_ids[i] in prev_ids (first occurrence) or -1. Returns true (fast path, no
// hashing) when the two lists are identical, in which case remap is the identity.
bool prepare_zos_inputs(const int64_t* prev_ids, int64_t m, const int64_t* cur_ids, int64_t n,
                        int32_t* remap);

// Same, reusing a caller-owned hash map to avoid per-call allocation.
bool prepare_zos_inputs(const int64_t* prev_ids, int64_t m, const int64_t* cur_ids, int64_t n, int32_t* remap,
                        std::unordered_map<int64_t, int32_t>& scratch);

}  // namespace deepinfer
