// Varlen verification allocator (DSpark varlen, seed §7.2, DESIGN §6).
//
// Every request i has k draft positions with acceptance probabilities p[i][j]. Expand them into
// (cumulative product c[i][j] = p[i][0] * ... * p[i][j], request i), sort descending, and add one at a time
// starting from golden-only (total_q = n). For each total_q the score is
//     expected_tokens / (step_ms[g] + slope_ms_per_token * graph_sizes[g] + sampler_ms)
// with expected_tokens = n + sum of the cumulative products included and g the smallest graph size >=
// total_q. The total_q with the highest score wins; the first total_q - n entries in sorted order are the
// drafts each request verifies. Because c[i][j] is non-increasing in j, every request gets a prefix of its
// drafts.
//
// Ordering and tie-breaking (deterministic): entries are ordered by their cumulative product rounded to
// float32 (a stable LSD radix sort, O(n*k)); entries equal at that precision are ordered by draft position,
// then request index (round-robin over requests, and still a prefix per request). Expected tokens are summed
// in double from the exact products. Within one graph size the denominator is constant, so only the largest
// total_q of each graph size (backed off over entries that add nothing) is scored; among equal scores the
// smallest total_q wins (a strict improvement is needed to verify more). Limits: total_q never exceeds the
// largest graph size nor max_total_q (when > 0). If n alone reaches that limit, no drafts are given and
// total_q = n (the batch runs without a captured graph of that size).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace deepinfer {

struct VarlenCurve {
  std::vector<int32_t> graph_sizes;  // strictly increasing, >= 1
  std::vector<double> step_ms;       // > 0, one per graph size
  // Empty string when valid, else a readable problem naming the argument.
  std::string validate() const;
};

class VarlenAllocator {
 public:
  // probs: row-major [n, k]; caps (optional, may be null): at most caps[i] drafts for request i (<= k).
  // Writes drafts[i] and returns total_q.
  int32_t allocate(const float* probs, int32_t n, int32_t k, const int32_t* caps, const VarlenCurve& curve,
                   double slope_ms_per_token, double sampler_ms, int32_t max_total_q, int32_t* drafts);

 private:
  std::vector<double> cum_;        // [n, k] exact cumulative products
  std::vector<uint64_t> keys_;     // (order key << 32) | (pos << 24) | req
  std::vector<uint64_t> scratch_;  // radix sort buffer
  std::vector<double> prefix_;     // expected tokens after taking t entries
};

}  // namespace deepinfer
