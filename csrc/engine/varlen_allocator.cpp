#include "varlen_allocator.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace deepinfer {

std::string VarlenCurve::validate() const {
  if (graph_sizes.empty()) return "graph_sizes must not be empty";
  if (graph_sizes.size() != step_ms.size()) {
    return "graph_sizes and step_ms must have the same length (got " + std::to_string(graph_sizes.size()) +
           " and " + std::to_string(step_ms.size()) + ")";
  }
  for (size_t i = 0; i < graph_sizes.size(); ++i) {
    if (graph_sizes[i] < 1) return "graph_sizes must be >= 1 (got " + std::to_string(graph_sizes[i]) + ")";
    if (i > 0 && graph_sizes[i] <= graph_sizes[i - 1]) return "graph_sizes must be strictly increasing";
    if (!(std::isfinite(step_ms[i]) && step_ms[i] > 0)) return "step_ms must be finite and > 0";
  }
  return "";
}

namespace {

constexpr uint32_t kOneBits = 0x3F800000u;  // bits of 1.0f; products are in [0, 1]

// Stable LSD radix sort of `keys` by their upper 32 bits (3 passes of 11/11/10 bits; a pass whose digit is
// the same for every key is skipped).
void radix_sort_upper32(std::vector<uint64_t>& keys, std::vector<uint64_t>& buf) {
  const size_t n = keys.size();
  buf.resize(n);
  uint64_t* src = keys.data();
  uint64_t* dst = buf.data();
  static constexpr int kShift[3] = {32, 43, 54};
  static constexpr int kBits[3] = {11, 11, 10};
  size_t count[2048];
  for (int p = 0; p < 3; ++p) {
    const size_t buckets = size_t{1} << kBits[p];
    const uint64_t mask = buckets - 1;
    std::memset(count, 0, sizeof(size_t) * buckets);
    for (size_t i = 0; i < n; ++i) ++count[(src[i] >> kShift[p]) & mask];
    if (count[(src[0] >> kShift[p]) & mask] == n) continue;  // every key has the same digit
    size_t sum = 0;
    for (size_t b = 0; b < buckets; ++b) {
      const size_t c = count[b];
      count[b] = sum;
      sum += c;
    }
    for (size_t i = 0; i < n; ++i) dst[count[(src[i] >> kShift[p]) & mask]++] = src[i];
    std::swap(src, dst);
  }
  if (src != keys.data()) std::memcpy(keys.data(), src, sizeof(uint64_t) * n);
}

}  // namespace

int32_t VarlenAllocator::allocate(const float* probs, int32_t n, int32_t k, const int32_t* caps,
                                  const VarlenCurve& curve, double slope_ms_per_token, double sampler_ms,
                                  int32_t max_total_q, int32_t* drafts) {
  for (int32_t i = 0; i < n; ++i) drafts[i] = 0;
  if (n <= 0) return 0;
  int32_t limit = curve.graph_sizes.back();
  if (max_total_q > 0) limit = std::min(limit, max_total_q);
  if (n >= limit || k <= 0) return n;

  // Exact cumulative products, then sort keys generated in (position, request) order so the stable sort
  // breaks ties by position, then request.
  cum_.resize(static_cast<size_t>(n) * k);
  for (int32_t i = 0; i < n; ++i) {
    double c = 1.0;
    for (int32_t j = 0; j < k; ++j) {
      c *= static_cast<double>(probs[static_cast<int64_t>(i) * k + j]);
      cum_[static_cast<size_t>(i) * k + j] = c;
    }
  }
  keys_.clear();
  for (int32_t j = 0; j < k; ++j) {
    for (int32_t i = 0; i < n; ++i) {
      if (j >= (caps ? std::min(caps[i], k) : k)) continue;
      float f = static_cast<float>(cum_[static_cast<size_t>(i) * k + j]);
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof(bits));
      const uint32_t order = kOneBits - std::min(bits, kOneBits);  // ascending order = descending product
      keys_.push_back((static_cast<uint64_t>(order) << 32) | (static_cast<uint64_t>(j) << 24) |
                      static_cast<uint64_t>(i));
    }
  }
  if (keys_.empty()) return n;
  radix_sort_upper32(keys_, scratch_);

  const int64_t take = std::min<int64_t>(static_cast<int64_t>(limit) - n, static_cast<int64_t>(keys_.size()));
  prefix_.resize(static_cast<size_t>(take) + 1);
  prefix_[0] = n;
  for (int64_t t = 1; t <= take; ++t) {
    const uint64_t key = keys_[t - 1];
    const size_t req = key & 0xFFFFFFu;
    const size_t pos = (key >> 24) & 0xFFu;
    prefix_[t] = prefix_[t - 1] + cum_[req * k + pos];
  }
  // Score the largest t inside each graph size (backed off over entries that add nothing); strict
  // improvement.
  const std::vector<int32_t>& gs = curve.graph_sizes;
  double best = -1.0;
  int64_t best_t = 0;
  for (size_t g = 0; g < gs.size(); ++g) {
    if (gs[g] < n) continue;
    int64_t t = std::min<int64_t>(static_cast<int64_t>(gs[g]) - n, take);
    const int64_t lo = g > 0 && gs[g - 1] >= n ? static_cast<int64_t>(gs[g - 1]) - n + 1 : 0;
    if (t < lo) break;
    while (t > lo && prefix_[t - 1] == prefix_[t]) --t;
    const double s = prefix_[t] / (curve.step_ms[g] + slope_ms_per_token * gs[g] + sampler_ms);
    if (s > best) {
      best = s;
      best_t = t;
    }
    if (static_cast<int64_t>(gs[g]) - n >= take) break;
  }
  for (int64_t t = 0; t < best_t; ++t) ++drafts[keys_[t] & 0xFFFFFFu];
  return static_cast<int32_t>(n + best_t);
}

}  // namespace deepinfer
